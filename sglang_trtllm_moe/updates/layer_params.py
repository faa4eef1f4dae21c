"""A write's layer and parameter as every check of the update path sees them: the parameter's managed name, the
format whose rules apply, the parameter as [experts, rows, cols], the expert counts and the TP-split extents a loaded
tensor may have."""

from __future__ import annotations

import numbers

import torch

from .. import layer_attrs
from ..formats.load_rules import LoadRule
from ..layer_state import observed, state_of

SHARDS = ("w1", "w2", "w3")

#: checkpoint projection names -> SGLang shard ids (FusedMoE.make_expert_params_mapping of SGLang's model classes)
PROJECTIONS = {"gate_proj": "w1", "w1": "w1", "up_proj": "w3", "w3": "w3", "down_proj": "w2", "w2": "w2"}


def param_name(layer, param, fmt=None) -> str | None:
    """The name `param` is registered under in `layer` (a managed name first, for aliases of one Parameter)."""
    params = getattr(layer, "_parameters", None)
    items = params.items() if params is not None else layer.named_parameters(recurse=False)
    first = None
    for name, p in items:
        if p is param:
            if fmt is None or fmt.load_rule(name) is not None:
                return name
            first = first or name
    return first


def expert_index(expert_id) -> int | None:
    """An expert id as an int: int, numpy integer or 0-dim integer tensor; None for anything else (bool, float,
    str, None, a tensor of another shape or dtype)."""
    if isinstance(expert_id, bool):
        return None
    if isinstance(expert_id, numbers.Integral):
        return int(expert_id)
    if (
        isinstance(expert_id, torch.Tensor)
        and expert_id.dim() == 0
        and expert_id.device.type != "meta"
        and not expert_id.dtype.is_floating_point
        and not expert_id.dtype.is_complex
        and expert_id.dtype != torch.bool
    ):
        return int(expert_id)
    return None


def format_of(layer):
    """The format whose rules writes into `layer` follow: the plugin's (a layer it prepares) or the one it watches
    (a layer SGLang prepares itself, compat/defer.py); None for every other layer."""
    st = state_of(layer)
    return st.fmt if st is not None else observed(layer)


def param_view(layer, fmt, name: str, param) -> torch.Tensor:
    """`param` as [experts, rows, cols] for a laid-out parameter (a release may show it in another shape, e.g.
    SGLang's 4-D BF16 block layout: `WeightFormat.tensor`), as it is for the others."""
    for p in fmt.params:
        if p.name == name:
            return fmt.tensor(layer, p)
    return param.data


def managed_names(layer, fmt) -> list[str]:
    params = getattr(layer, "_parameters", {})
    return [n for n in params if fmt.load_rule(n) is not None]


def global_expert_count(layer, param) -> int:
    """How many checkpoint expert ids `FusedMoE.weight_loader` takes for `param`."""
    if getattr(param, "_sglang_require_global_experts", False):
        return int(param.shape[0])
    return int(getattr(layer, "num_experts", 0) or 0) + int(getattr(layer, "num_fused_shared_experts", 0) or 0)


def intermediate_extents(layer, fmt, rule: LoadRule, view, gated: bool):
    """(allowed extents of the TP-split dim of a loaded tensor, a description, the param's per-rank extent)."""
    per_rank = (
        int(view.shape[1]) // 2 if (rule.group == "w13" and gated) else int(view.shape[1 if rule.group == "w13" else 2])
    )
    tp = int(getattr(layer, "moe_tp_size", 1) or 1)
    presharded = bool(getattr(layer, "use_presharded_weights", False))
    ranks = 1 if presharded else tp
    padded = per_rank * ranks
    ref = next((fmt.tensor(layer, p) for p in fmt.params if p.group == "w13"), None)
    full = getattr(layer, layer_attrs.INTERMEDIATE, None)
    if ref is None or not full:
        return range(1, padded + 1), f"at most {padded}", per_rank
    ip = int(ref.shape[1]) // (2 if gated else 1)  # the layer's padded per-rank intermediate
    logical = -(-(int(full) // (tp if presharded else 1)) * per_rank // ip)
    if logical == padded:
        return (padded,), f"{padded}", per_rank
    return (logical, padded), f"{logical} (the checkpoint's) or {padded} (the layer's padded size)", per_rank
