"""Refuse a weight update that SGLang's loader would turn into wrong bytes, before anything changes.

SGLang's loader narrows by TP rank and `copy_`s, which silently converts dtypes and broadcasts shapes: an RL
framework sending a float32 tensor into packed-FP4 storage, or a w2 shard labelled w1, would corrupt the expert
without an error. Called by the loader hook with the layer's lock held, before the layout state changes.
"""

from __future__ import annotations

import torch

from .layer_state import layer_name, state_of

_SHARDS = ("w1", "w2", "w3")


def param_name(layer, param) -> str | None:
    for name, p in layer.named_parameters(recurse=False):
        if p is param:
            return name
    return None


def validate_shard(layer, name: str, param, loaded: torch.Tensor, shard_id, expert_id) -> None:
    """Refuse a write that SGLang's loader would turn into wrong bytes, before anything changes.

    SGLang's loader narrows by TP rank and `copy_`s, which silently converts dtypes and broadcasts shapes; an
    RL framework sending a float32 tensor into packed-FP4 storage, or a w2 shard labelled w1, would corrupt the
    expert without an error. Checked here: shard id, expert id, dtype of byte-packed storage, and every dimension
    that the TP split does not touch.
    """
    st = state_of(layer)
    if st is None:
        return
    where = f"{layer_name(layer)}: refused weight update of {name} (shard {shard_id!r}, expert {expert_id})"
    if shard_id not in _SHARDS:
        raise ValueError(f"{where}: shard id must be one of {_SHARDS}; nothing was written")
    # Params SGLang keeps for every expert of the model (input scales, `_sglang_require_global_experts`) reach the
    # loader with the GLOBAL expert id; under EP that id is >= the local count on every rank but the first.
    n_ids = int(param.shape[0]) if getattr(param, "_sglang_require_global_experts", False) else st.num_experts
    if expert_id is not None and not (0 <= int(expert_id) < n_ids):
        raise ValueError(f"{where}: expert id out of range [0, {n_ids}); nothing was written")
    if check_load_dtype(st.fmt, name, param, loaded, where, layer, expert_id) == "requantized":
        return  # a fused FP8 shared expert: SGLang requantizes it to the layer's format (its own shapes)
    group = st.fmt.group_of(name)
    if group is None:
        if name in st.fmt.scalar_params and loaded.numel() != 1 and expert_id is not None:
            raise ValueError(f"{where}: expected one scale per expert and shard, got shape {tuple(loaded.shape)}; nothing was written")
        return
    tp = int(getattr(layer, "moe_tp_size", 1) or 1)
    gated = st.fmt.is_gated(layer)
    rows, cols = param.shape[1], param.shape[2]
    if group == "w13":
        if shard_id == "w2" or (not gated and shard_id == "w3"):
            raise ValueError(f"{where}: {name} takes shard {'w1/w3' if gated else 'w1'}, not {shard_id!r}; nothing was written")
        half = rows // 2 if gated else rows
        ok = loaded.dim() == 2 and loaded.shape[1] == cols and 0 < loaded.shape[0] <= half * tp
        want = f"[<= {half * tp}, {cols}]"
    else:
        if shard_id != "w2":
            raise ValueError(f"{where}: {name} takes shard 'w2', not {shard_id!r}; nothing was written")
        ok = loaded.dim() == 2 and loaded.shape[0] == rows and 0 < loaded.shape[1] <= cols * tp
        want = f"[{rows}, <= {cols * tp}]"
    if not ok:
        raise ValueError(f"{where}: shape {tuple(loaded.shape)} does not fit, expected {want}; nothing was written")


def check_load_dtype(fmt, name: str, param, loaded: torch.Tensor, where: str, layer=None, expert_id=None):
    """Refuse a dtype SGLang's loader would value-convert into wrong bytes. A format may declare, per parameter, the
    checkpoint dtypes its loader writes correctly (`WeightFormat.load_dtypes`: MX scales are UE8M0 bytes that must
    arrive as uint8, or as float values SGLang itself converts); otherwise byte-sized storage takes its own dtype only."""
    from .errors import WeightUpdateRefused

    accepted = fmt.load_dtypes.get(name)
    shared = getattr(fmt, "shared_expert_load_dtypes", {}).get(name)
    if shared and expert_id is not None and getattr(layer, "_has_fused_shared", False) \
            and int(expert_id) >= int(getattr(layer, "_num_local_routed", 1 << 30)):
        if loaded.dtype in shared:
            return "requantized"  # SGLang requantizes a fused FP8 shared expert itself (FP4 experts)
    if accepted is None:
        if param.dtype.itemsize == 1 and loaded.dtype != param.dtype:
            raise WeightUpdateRefused(
                f"{where}: dtype {loaded.dtype} cannot be written into {param.dtype} storage (it would be "
                f"value-converted, not copied); send the checkpoint's {param.dtype} tensor; nothing was written"
            )
        return
    if loaded.dtype not in accepted:
        raise WeightUpdateRefused(
            f"{where}: dtype {loaded.dtype} is not a {fmt.title or fmt.name} checkpoint dtype for {name} (SGLang's "
            f"loader would convert it by value into {param.dtype} storage, not copy it); send one of "
            f"{[str(d).replace('torch.', '') for d in accepted]}; nothing was written"
        )


def validate_fused(layer, name: str, param, loaded: torch.Tensor) -> None:
    """A write of all experts of one parameter at once (`expert_id=None`: gpt-oss's MXFP4 loader), refused before a
    byte changes: SGLang's fast path copies it into the top-left corner of the padded parameter, so the dtype must
    be one the format declares and every dimension must fit (experts exactly, rows and columns at most)."""
    from .errors import WeightUpdateRefused

    st = state_of(layer)
    if st is None:
        return
    where = f"{layer_name(layer)}: refused weight update of {name} (all experts at once)"
    check_load_dtype(st.fmt, name, param, loaded, where, layer, None)
    fits = loaded.dim() == param.dim() and loaded.shape[0] == param.shape[0] and all(
        0 < a <= b for a, b in zip(loaded.shape[1:], param.shape[1:]))
    if not fits:
        raise WeightUpdateRefused(
            f"{where}: shape {tuple(loaded.shape)} does not fit {tuple(param.shape)} (experts equal, every other "
            "dimension at most the parameter's); nothing was written")
