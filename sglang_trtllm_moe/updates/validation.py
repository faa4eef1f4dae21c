"""Refuse a weight update before a byte changes, when SGLang's loader would corrupt the layer or fail half-way.

SGLang's FusedMoE loader narrows by TP rank and `copy_`s: it silently converts dtypes and broadcasts shapes (a
float32 tensor into packed-FP4 bytes, a w2 scale broadcast over the gate and up scales), zero-fills the rest of a
short tensor, and raises raw TypeError / IndexError / RuntimeError for a float, str or None expert id or a tensor on
another device — after the plugin has already returned the expert to checkpoint layout. Every write into a layer
the plugin manages is checked here first, for every parameter kind the format declares (`formats.load_rules.LoadRule`):

* the parameter is one of the layer's checkpoint parameters (not a kernel scalar the plugin computes), and the
  `weight_name` does not name another one;
* the shard id is a str of the parameter's group: w1/w3 for w13 parameters (w1 only when the layer is not gated),
  w2 for w2 parameters — per-tensor scales and input scales included;
* the expert id is an int or a 0-dim integer tensor (bool, float, str, None and 1-element tensors are refused) in
  range: the checkpoint's experts in `FusedMoE.weight_loader`, the local ones (or, for parameters SGLang keeps for
  every expert, all of them) in `_weight_loader_impl`;
* the tensor is a torch.Tensor on the parameter's device or the CPU (never meta);
* its dtype is one the parameter accepts (`LoadRule.accepts_dtype`);
* its shape: a scale per expert and shard is 0-dim or [1]; a weight or block scale is 2-D, the dimension TP does
  not split equals the parameter's, the split one is the checkpoint's (the layer's logical intermediate) or the
  layer's padded extent — anything else (a short tensor SGLang would zero-fill, a long one it would cut) is refused;
* its values, where the kind has a value rule (formats/base.py `LoadRule.value_rule`, value_checks.py): per-tensor
  weight scales, global scales and input scales finite and > 0; block scales finite and >= 0 — 16/32-bit floats as
  values, 1-byte scales on their bytes (e4m3: no NaN byte 0x7F / 0xFF, no negative; UE8M0: no 0xFF). Weights are
  data: not value-checked.

Errors are `WeightUpdateRefused` (a ValueError) naming the layer, the parameter, the problem and what is expected.
`check_bucket` (bucket_validation.py) runs at the update entry points over a whole request before anything is
loaded, and records what it validated (`checked_writes.Checked`); `check_write` runs in the FusedMoE.weight_loader
hook (before SGLang maps expert ids to EP ranks, so every rank refuses the same bad tensor) for every write the
request's check did not already validate — writes that do not come through an entry point (a user's own
`load_weights`, custom loaders) are checked whole there — and `_weight_loader_impl` checks only the local expert id,
under the layer's lock.

Cost: each write is checked by a plan computed once per (layer, parameter) (`write_plans.plan_of`: name, rule,
accepted shard ids, expert ranges, devices, dtypes and shapes), so a write that passes costs a few dict lookups and
comparisons; a write the plan does not accept goes through the full checks, which refuse it with their message (or
accept a rarer valid form: numpy or 0-dim tensor expert ids, a layer without a known intermediate size). The plan and
the full checks ask the same rules (write_plans.py: `names_another_parameter`, `shards_of`, `expert_count`,
`accepted_devices`, `ShapeRule`; the format's `LoadRule` for dtypes and values), each declared once; refusal
messages are built only when refusing.
"""

from __future__ import annotations

import torch

from ..formats.load_rules import LoadRule
from ..layer_state import PLANS_ATTR
from .layer_params import SHARDS, expert_index, format_of, managed_names, param_name, param_view
from .refusal import Refusal, ValueJob, check_values, short
from .write_plans import ShapeRule, accepted_devices, expert_count, names_another_parameter, plan_of, shards_of


def check_write(
    layer,
    param,
    loaded,
    weight_name,
    shard_id,
    expert_id,
    scope: str = "local",
    headers: bool = False,
    values: bool | list = True,
):
    """Validate one write of SGLang's FusedMoE loader into a managed layer; returns (parameter name, expert id as
    an int) — or None when the layer or the parameter is not managed by the plugin (SGLang's own behaviour).

    scope "global": `FusedMoE.weight_loader`'s checkpoint expert id; "local": `_weight_loader_impl`'s local (or,
    for parameters SGLang keeps for every expert, global) id. headers: `loaded` may be a meta tensor standing for a
    checkpoint tensor not read yet (its safetensors header): name, shard, expert, dtype and shape are checked.
    values: True — check the values here (unless a running disk update's pre-check read them from the checkpoint's
    files: `Checked.add_from_files`); a list — append a `ValueJob` for them instead (a whole request checks its
    tensors' values at once; a header's meta tensor gets a job too, for its values read later)."""
    return check_planned(
        plan_of(layer, param), layer, param, loaded, weight_name, shard_id, expert_id, scope, headers, values
    )


def check_planned(
    plan, layer, param, loaded, weight_name, shard_id, expert_id, scope="local", headers=False, values=True
):
    """`check_write` with the parameter's write plan already looked up (`plan_of`; None: the full checks)."""
    if plan is not None:
        if plan.rule is None:
            return None  # a parameter the format does not manage: SGLang's own loader, unchanged
        hit = plan.accepts(layer, param, loaded, weight_name, shard_id, expert_id, scope, headers, values)
        if hit is not None:
            return hit
    return _check_write(layer, param, loaded, weight_name, shard_id, expert_id, scope, headers, values)


def _check_write(layer, param, loaded, weight_name, shard_id, expert_id, scope, headers, values):
    """check_write without a plan: every check in turn (refuses with its message)."""
    fmt = format_of(layer)
    if fmt is None:
        return None
    name = param_name(layer, param, fmt)
    refuse = Refusal(layer, name or "a parameter", shard_id, expert_id)
    if name is None:
        refuse("the parameter is not one of this layer's", f"one of {managed_names(layer, fmt)}")
    rule = fmt.load_rule(name)
    if rule is None:
        if hasattr(param, "weight_loader"):
            return None  # a parameter the format does not manage: SGLang's own loader, unchanged
        refuse(
            f"{name} is computed by the plugin from the loaded weights and scales, not loaded",
            f"one of {managed_names(layer, fmt)}",
        )
    _check_name(layer, fmt, param, name, weight_name, refuse)
    gated = fmt.is_gated(layer)
    _check_shard(rule, shard_id, gated, refuse)
    view = param_view(layer, fmt, name, param)
    e = _check_expert(layer, view, param, expert_id, scope, refuse)
    if isinstance(loaded, torch.Tensor) and fmt.converted_by_sglang(layer, name, loaded, e, scope):
        # SGLang converts this write itself (its own dtypes): ids checked above, and where the format says what the
        # conversion stores, its shape as a direct write's, and the source values
        shape = fmt.converted_shape(layer, name, loaded)
        if shape is not None:
            # the stored tensor is of the parameter's own dtype on no device: only its shape can be wrong
            if ShapeRule(layer, fmt, rule, view, gated).problem(tuple(shape)) is not None:
                # the format answers the source's own shape where it cannot be converted (an odd K cannot be packed
                # two codes per byte): no stored shape to name then
                stored = (
                    f"SGLang cannot convert it to this parameter's {param.dtype} storage at that shape"
                    if tuple(shape) == tuple(loaded.shape) and loaded.dtype != param.dtype
                    else f"SGLang would store it as {tuple(shape)} {param.dtype}"
                )
                refuse(
                    f"a {loaded.dtype} source tensor of shape {tuple(loaded.shape)} does not fit this parameter "
                    f"({stored})",
                    f"the checkpoint's shape of this expert's {name} shard",
                )
        problem = fmt.source_problem(layer, name, loaded) if loaded.device.type != "meta" else None
        if problem:
            refuse(problem, f"finite {loaded.dtype} values")
        if loaded.device.type == "meta" and isinstance(values, list) and fmt.source_values is not None:
            values.append(ValueJob(loaded, fmt.source_values, rule, (layer, name, shard_id, e)))  # read from the file
        return name, e
    check_tensor(layer, fmt, rule, param, view, loaded, gated, refuse, headers=headers, values=values)
    return name, e


def _check_name(layer, fmt, param, name, weight_name, refuse: Refusal) -> None:
    if not isinstance(weight_name, str):
        refuse(f"weight_name is {type(weight_name).__name__}", "the parameter's name as a str")
    tail = names_another_parameter(fmt, weight_name, name)
    if tail is not None and layer._parameters.get(tail) is not param:
        # SGLang routes a write by substrings of weight_name ("input_scale", "weight_scale_2", "scale", ...)
        refuse(
            f"weight_name {weight_name!r} names another parameter ({tail}) than the one passed ({name}), so "
            "SGLang's loader would write it by the wrong rule",
            f"weight_name ending in {name!r}",
        )


def _check_shard(rule: LoadRule, shard_id, gated: bool, refuse: Refusal) -> None:
    allowed = shards_of(rule, gated)
    if not isinstance(shard_id, str) or shard_id not in allowed:
        why = "" if isinstance(shard_id, str) and shard_id in SHARDS else f" (SGLang's shard ids are {SHARDS})"
        kind = rule.kind.replace("_", " ")
        refuse(
            f"{rule.name} ({kind} of the {rule.group} group{'' if gated or rule.group == 'w2' else ', not gated'})"
            f" does not take shard {shard_id!r}{why}",
            f"shard {' or '.join(map(repr, allowed))}",
        )


def _check_expert(layer, view, param, expert_id, scope: str, refuse: Refusal) -> int:
    e = expert_index(expert_id)
    if e is None:
        refuse(
            f"expert id {short(expert_id)} of type {type(expert_id).__name__} is not an integer expert index",
            "an int (or a 0-dim integer tensor)",
        )
    n = expert_count(layer, param, view, scope)
    if n and not 0 <= e < n:
        if scope == "global":
            what = "experts of this model"
        elif getattr(param, "_sglang_require_global_experts", False):
            what = "experts kept in this parameter"
        else:
            what = "local experts of this layer"
        refuse(f"expert id {e} is out of range ({n} {what})", f"0 <= expert id < {n}")
    return e


def check_tensor(
    layer,
    fmt,
    rule: LoadRule,
    param,
    view,
    loaded,
    gated: bool,
    refuse: Refusal,
    whole=None,
    headers: bool = False,
    values: bool | list = True,
) -> None:
    """whole: the shape a whole-parameter write must have (load_format="direct"); None for one shard.
    values: True — check the values here; False — not at all; a list — append a `ValueJob` for the caller to check
    with the other tensors of its request (value_checks.find_bad)."""
    if not isinstance(loaded, torch.Tensor):
        refuse(f"the loaded weight is a {type(loaded).__name__}, not a torch.Tensor", "a torch.Tensor")
    dev = loaded.device
    if dev not in accepted_devices(param) and not (headers and dev.type == "meta"):
        refuse(
            f"the tensor is on {dev}" + (" (no data)" if dev.type == "meta" else ""),
            f"a tensor on {param.device}" + ("" if param.device.type == "cpu" else " or on the CPU"),
        )
    if not rule.accepts_dtype(loaded.dtype, param.dtype):
        extra = f" or {', '.join(map(str, rule.dtypes))}" if rule.dtypes else ""
        conv = (
            " (any 16/32/64-bit float is converted)"
            if param.dtype.is_floating_point and param.dtype.itemsize >= 2
            else " (copy_ would value-convert it, not copy the bytes)"
        )
        refuse(f"dtype {loaded.dtype} cannot be written into {param.dtype} storage{conv}", f"{param.dtype}{extra}")
    shape = tuple(loaded.shape)
    if whole is not None:
        if shape != tuple(whole):
            refuse(f"shape {shape} of a whole-parameter write", f"{tuple(whole)}")
    else:
        problem = ShapeRule(layer, fmt, rule, view, gated).problem(shape)
        if problem is not None:
            refuse(*problem)
    _values_of(rule, param, loaded, values, refuse)


def check_local_expert(layer, param, name, expert_id, shard_id) -> int:
    """The cheap check in `_weight_loader_impl` after a validated `weight_loader` call: the (local) expert id."""
    if type(expert_id) is int:  # the plan weight_loader's check used (its expert count does not change)
        plans = layer.__dict__.get(PLANS_ATTR) if hasattr(layer, "__dict__") else None
        plan = plans.get(id(param)) if plans else None
        if plan is not None and plan.param() is param and plan.name == name and 0 <= expert_id < plan.local_n:
            return expert_id
    refuse = Refusal(layer, name, shard_id, expert_id)
    return _check_expert(layer, param_view(layer, format_of(layer), name, param), param, expert_id, "local", refuse)


def validate_fused(layer, name: str, param, loaded, shape: bool = True, values: bool | list = True) -> None:
    """A write of all experts of one parameter at once (`expert_id=None`, shard None: gpt-oss's MXFP4 loader) into
    a format declared `fused`, refused before a byte changes: SGLang's fast path copies it into the top-left corner
    of the padded parameter, so it must be a tensor on the parameter's device or the CPU, of a dtype the parameter's
    rule accepts, with exactly the layer's experts and every other dimension at most the parameter's (a bias
    [E, rows], a weight or block scale [E, rows, cols]), and valid values where the rule has a value rule.
    shape=False: a checkpoint tensor before the model's loader narrows it to this rank (a whole request's check);
    values as in `check_tensor`."""
    fmt = format_of(layer)
    refuse = Refusal(layer, name, None, None, what="all experts at once")
    rule = fmt.load_rule(name) if fmt is not None else None
    if rule is None:
        refuse(f"{name} is not one of this layer's checkpoint parameters", f"one of {managed_names(layer, fmt)}")
    if not isinstance(loaded, torch.Tensor):
        refuse(f"the loaded weight is a {type(loaded).__name__}, not a torch.Tensor", "a torch.Tensor")
    if loaded.device not in accepted_devices(param) and (shape or loaded.device.type != "meta"):
        refuse(f"the tensor is on {loaded.device}", f"a tensor on {param.device} or on the CPU")
    if not rule.accepts_dtype(loaded.dtype, param.dtype):
        extra = f" or {', '.join(map(str, rule.dtypes))}" if rule.dtypes else ""
        refuse(
            f"dtype {loaded.dtype} cannot be written into {param.dtype} storage (copy_ would value-convert it, "
            "not copy the bytes)"
            if param.dtype.itemsize == 1
            else f"dtype {loaded.dtype} is not a float dtype",
            f"{param.dtype}{extra}",
        )
    fits = (
        loaded.dim() == param.dim()
        and loaded.shape[0] == param.shape[0]
        and all(0 < a <= b for a, b in zip(loaded.shape[1:], param.shape[1:], strict=True))
    )
    if shape and not fits:
        refuse(
            f"shape {tuple(loaded.shape)} does not fit {tuple(param.shape)}",
            "the layer's experts exactly, every other dimension at most the parameter's",
        )
    _values_of(rule, param, loaded, values, refuse)


def _values_of(rule, param, loaded, values, refuse) -> None:
    """The value check of a write whose structure passed: queued as a `ValueJob` when `values` is a list (a whole
    request checks its values together), run now when it is true, skipped when false."""
    if isinstance(values, list):
        code = rule.value_rule(param.dtype, loaded.dtype) if loaded.numel() else None
        if code is not None:
            values.append(ValueJob(loaded, code, rule, refuse))
    elif values:
        check_values(rule, param, loaded, refuse)
