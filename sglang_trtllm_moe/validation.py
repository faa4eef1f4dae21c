"""Refuse a weight update before a byte changes, when SGLang's loader would corrupt the layer or fail half-way.

SGLang's FusedMoE loader narrows by TP rank and `copy_`s: it silently converts dtypes and broadcasts shapes (a
float32 tensor into packed-FP4 bytes, a w2 scale broadcast over the gate and up scales), zero-fills the rest of a
short tensor, and raises raw TypeError / IndexError / RuntimeError for a float, str or None expert id or a tensor on
another device — after the plugin has already returned the expert to checkpoint layout. Every write into a layer
the plugin manages is checked here first, for every parameter kind the format declares (`formats.base.LoadRule`):

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
loaded, and records what it validated (`Checked`); `check_write` runs in the FusedMoE.weight_loader hook (before
SGLang maps expert ids to EP ranks, so every rank refuses the same bad tensor) for every write the request's check
did not already validate — writes that do not come through an entry point (a user's own `load_weights`, custom
loaders) are checked whole there — and `_weight_loader_impl` checks only the local expert id, under the layer's lock.

Cost: each write is checked by a plan computed once per (layer, parameter) (`plan_of`: name, rule, accepted shard
ids, expert ranges, devices, dtypes and shapes), so a write that passes costs a few dict lookups and comparisons; a
write the plan does not accept goes through the full checks, which refuse it with their message (or accept a rarer
valid form: numpy or 0-dim tensor expert ids, a layer without a known intermediate size). Refusal messages are built
only when refusing.
"""

from __future__ import annotations

import numbers
import threading
import weakref
from typing import NoReturn

import torch

from . import layer_attrs, value_checks
from .errors import WeightUpdateRefused
from .formats.base import LoadRule, WeightFormat
from .layer_state import PLANS_ATTR, layer_name, observed, state_of

SHARDS = ("w1", "w2", "w3")

#: how every refusal ends (a whole request's refusal says it once, for all its tensors)
NOTHING_WRITTEN = "; nothing was written"
#: checkpoint projection names -> SGLang shard ids (FusedMoE.make_expert_params_mapping of SGLang's model classes)
PROJECTIONS = {"gate_proj": "w1", "w1": "w1", "up_proj": "w3", "w3": "w3", "down_proj": "w2", "w2": "w2"}

#: per thread, what weight_loader validated for the _weight_loader_impl call SGLang makes inside it (param, tensor,
#: parameter name, local expert count); the loader hooks set and read it through mark_validated / restore_validated /
#: validated / was_validated
_HANDSHAKE = threading.local()


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


def _short(x) -> str:
    if isinstance(x, torch.Tensor):
        r = (
            f"tensor({x.tolist()!r}, dtype={x.dtype})"
            if x.numel() <= 4 and x.device.type != "meta"
            else f"tensor(shape={tuple(x.shape)}, dtype={x.dtype}, device={x.device})"
        )
    else:
        r = repr(x)
    return r if len(r) <= 80 else r[:77] + "..."


class Refusal:
    """Raises a refusal of one write: "<layer>: refused weight update of <param> (<what>): <problem>; expected
    <expected>; nothing was written". Keeps its arguments; the message is built only when it refuses."""

    __slots__ = ("layer", "name", "shard_id", "expert_id", "what")

    def __init__(self, layer, name, shard_id, expert_id, what: str | None = None):
        self.layer, self.name, self.shard_id, self.expert_id, self.what = layer, name, shard_id, expert_id, what

    @property
    def where(self) -> str:
        what = self.what or f"shard {_short(self.shard_id)}, expert {_short(self.expert_id)}"
        return f"{layer_name(self.layer)}: refused weight update of {self.name} ({what})"

    def __call__(self, problem: str, expected: str) -> NoReturn:
        raise WeightUpdateRefused(f"{self.where}: {problem}; expected {expected}{NOTHING_WRITTEN}")


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


# ---- write plans: what a write into one parameter must look like, computed once --------------------------------

_CPU = torch.device("cpu")


class WritePlan:
    """What `check_write` needs to accept a write into one parameter of one layer, computed once (`plan_of`): the
    parameter's managed name, its rule, the shard ids it takes, the expert ranges, the devices, the accepted dtypes
    (cached per loaded dtype), the accepted shapes (where the layer's sizes make them a small set) and the value rule
    per loaded dtype. `accepts` answers (name, expert id) for a write every check would accept, None for anything
    else (the full checks then decide, and refuse with their message)."""

    __slots__ = (
        "param",
        "fmt",
        "name",
        "dot_name",
        "rule",
        "shape",
        "dtype",
        "ptr",
        "shards",
        "global_n",
        "local_n",
        "devices",
        "dtypes",
        "shapes",
        "codes",
        "converts",
        "managed",
        "hit",
    )

    def __init__(self, layer, fmt, param, name: str, rule: LoadRule | None):
        #: the parameter, weakly (a plan never keeps a replaced parameter's storage alive)
        self.param = weakref.ref(param)
        self.fmt, self.name, self.dot_name, self.rule = fmt, name, "." + name, rule
        self.shape, self.dtype, self.ptr = param.shape, param.dtype, param.data_ptr()
        self.dtypes: dict = {}
        self.codes: dict = {}
        self.shapes: frozenset | None = None
        self.shards: tuple = ()
        self.global_n = self.local_n = 0
        self.devices = frozenset((param.device, _CPU))
        self.converts = type(fmt).converted_by_sglang is not WeightFormat.converted_by_sglang
        self.hit = (name, self.dot_name, 0)
        #: every parameter name the format has a rule for (a weight_name ending in another one is checked in full)
        self.managed = frozenset((*(p.name for p in fmt.params), *fmt.scalar_params))
        if rule is None:
            return
        gated = fmt.is_gated(layer)
        self.shards = ("w2",) if rule.group == "w2" else (("w1", "w3") if gated else ("w1",))
        view = param_view(layer, fmt, name, param)
        self.global_n = global_expert_count(layer, param)
        self.local_n = int(view.shape[0])
        #: what a request's record says of a write this plan accepted (validation.Checked)
        self.hit = (name, self.dot_name, self.local_n)
        if rule.scalar:
            self.shapes = frozenset({(), (1,)})
        else:
            extents, _, _ = _intermediate_extents(layer, fmt, rule, view, gated)
            if isinstance(extents, tuple):
                if rule.group == "w13":
                    self.shapes = frozenset((x, int(view.shape[2])) for x in extents)
                else:
                    self.shapes = frozenset((int(view.shape[1]), x) for x in extents)

    def accepts(self, layer, param, loaded, weight_name, shard_id, expert_id, scope, headers, values):
        if type(weight_name) is not str:
            return None
        # SGLang's mapped name ends in the parameter's; a checkpoint name ("...experts.3.gate_proj.weight_scale")
        # ends in a suffix that names no other parameter
        if not weight_name.endswith(self.dot_name) and weight_name[weight_name.rfind(".") + 1 :] in self.managed:
            return None
        if type(shard_id) is not str or shard_id not in self.shards or type(expert_id) is not int:
            return None
        n = self.global_n if scope == "global" else self.local_n
        if n and not 0 <= expert_id < n:
            return None
        if not isinstance(loaded, torch.Tensor):
            return None
        if self.converts and self.fmt.converted_by_sglang(layer, self.name, loaded, expert_id, scope):
            return self.name, expert_id
        dev = loaded.device
        if dev not in self.devices and not (headers and dev.type == "meta"):
            return None
        dt = loaded.dtype
        ok = self.dtypes.get(dt)
        if ok is None:
            ok = self.dtypes[dt] = self.rule.accepts_dtype(dt, self.dtype)  # type: ignore[union-attr]
        if not ok or self.shapes is None or loaded.shape not in self.shapes:
            return None
        if values is False:
            return self.name, expert_id
        code = self.codes.get(dt, 0)
        if code == 0:
            code = self.codes[dt] = self.rule.value_rule(self.dtype, dt)  # type: ignore[union-attr]
        if code is None or not loaded.numel():
            return self.name, expert_id
        if isinstance(values, list):
            values.append(ValueJob(loaded, code, self.rule, (layer, self.name, shard_id, expert_id)))  # type: ignore[arg-type]
        elif dev.type != "meta" and not (
            scope == "global" and _FROM_FILES and _values_from_files(param, shard_id, expert_id)
        ):
            if value_checks.bad_one(loaded, code):
                return None  # the full checks refuse it, naming the value
        return self.name, expert_id


def plan_of(layer, param) -> WritePlan | None:
    """The write plan of `param` in `layer` (cached on the layer, rebuilt when the parameter's storage, shape or
    dtype changed, or another parameter took its name); None when the layer is not the plugin's (managed or
    watched), or `param` is not one of its parameters or is one the plugin computes (the full checks refuse those)."""
    d = getattr(layer, "__dict__", None)
    plans = d.get(PLANS_ATTR) if d is not None else None
    if plans is not None:
        plan = plans.get(id(param))
        if (
            plan is not None
            and plan.param() is param
            and d["_parameters"].get(plan.name) is param  # type: ignore[index]
            and param.data_ptr() == plan.ptr
            and param.dtype is plan.dtype
            and param.shape == plan.shape
        ):
            return plan
    elif d is None or not isinstance(d.get("_parameters"), dict) or format_of(layer) is None:
        return None  # not an nn.Module (the full checks), or not the plugin's layer
    return _new_plan(layer, param)


def _new_plan(layer, param) -> WritePlan | None:
    fmt = format_of(layer)
    if fmt is None or not isinstance(param, torch.Tensor):
        return None
    name = param_name(layer, param, fmt)
    if name is None:
        return None
    rule = fmt.load_rule(name)
    if rule is None and not hasattr(param, "weight_loader"):
        return None  # a kernel scalar the plugin computes: refused by the full checks
    plan = WritePlan(layer, fmt, param, name, rule)
    plans = layer.__dict__.setdefault(PLANS_ATTR, {})
    for key, old in list(plans.items()):  # plans of parameters the layer no longer holds (no storage kept alive)
        p = old.param()
        if p is None or layer._parameters.get(old.name) is not p:
            plans.pop(key, None)
    plans[id(param)] = plan
    return plan


# ---- what a request's entry-point check validated ---------------------------------------------------------------

#: the records of the requests now running (validation.Checked), read by the loader hooks of every thread
_ACTIVE: list = []
#: the disk updates now running: their records of (id(param), shard id, expert id) whose values were read from the
#: checkpoint's files and checked
_FROM_FILES: list = []
_CHECKED_LOCK = threading.Lock()


class Checked:
    """What one update request's entry-point check validated, for the loader hooks while the request runs.

    Thread-safe: SGLang's loaders write from thread pools (DeepSeek), so the record is visible process-wide while
    the request runs (and only then: `close()`, the entry point's end in a finally), keyed by the objects themselves
    (held, so no id is reused meanwhile). A write matches only when it is the same tensor object written into the
    same parameter with the same shard and expert id as checked — a tensor the model's loader re-creates or
    re-routes is checked again in the hook; a tensor is never re-checked for being re-sent."""

    def __init__(self):
        #: (id(tensor), id(param), shard id, expert id) -> (tensor, param, (parameter name, its "."-prefixed form,
        #: local expert count)) of writes validated whole
        self.tensors: dict = {}
        #: ids of those tensors (what the request's later checks skip)
        self.ids: set = set()
        #: (id(param), shard id, expert id) -> (param, dtype, shape, (parameter name, "." + name, local expert count))
        #: of checkpoint tensors the disk pre-check validated: header, and values read from the files
        self.from_files: dict = {}
        self._on = False

    def add_tensors(self, entries) -> None:
        """entries: (tensor, param, shard id, expert id, (parameter name, "." + name, local expert count), ...) of
        writes validated whole."""
        tensors, ids = self.tensors, self.ids
        for t, param, shard, expert, hit, *_ in entries:
            tensors[(id(t), id(param), shard, expert)] = (t, param, hit)
            ids.add(id(t))
        self._activate(_ACTIVE)

    def add_from_files(self, entries) -> None:
        """entries: (header's meta tensor, param, shard id, expert id, (parameter name, "." + name, local expert
        count), ...) of the checkpoint tensors the disk pre-check validated from their headers and whose values
        (where their kind has a value rule) it read from the files and checked."""
        files = self.from_files
        for meta, param, shard, expert, hit, *_ in entries:
            files[(id(param), shard, expert)] = (param, meta.dtype, meta.shape, hit)
        self._activate(_FROM_FILES)

    def _activate(self, table: list) -> None:
        with _CHECKED_LOCK:
            if not any(r is self for r in table):
                table.append(self)
                self._on = True

    def close(self) -> None:
        if not self._on:
            return
        with _CHECKED_LOCK:
            for table in (_ACTIVE, _FROM_FILES):
                table[:] = [r for r in table if r is not self]
            self._on = False
        self.tensors.clear()
        self.ids.clear()
        self.from_files.clear()

    def __len__(self) -> int:
        return len(self.tensors) + len(self.from_files)


def checked_write(param, loaded, weight_name, shard_id, expert_id) -> tuple[str, str, int] | None:
    """(parameter name, "." + name, local expert count) when a running request's entry-point check already
    validated this write whole, else None:

    * tensor buckets: the same tensor object, into the same parameter, shard and expert id;
    * a disk update: SGLang's CPU tensor for a (parameter, shard, expert id) whose checkpoint tensor the pre-check
      validated from its header — the same dtype and shape — and whose values it read from the file (unchanged
      since: the entry point compares the files' fingerprints after the load). Every check of the write depends on
      nothing else but the name SGLang passes (checked here) and the device (the CPU), so it would answer the same.
    The name SGLang passes must end in the parameter's."""
    if type(shard_id) is not str or type(expert_id) is not int:
        return None
    hit = None
    if _ACTIVE:
        key = (id(loaded), id(param), shard_id, expert_id)
        for rec in _ACTIVE:
            v = rec.tensors.get(key)
            if v is not None:
                hit = v[2]
                break
    if hit is None and _FROM_FILES:
        slot = (id(param), shard_id, expert_id)
        for rec in _FROM_FILES:
            v = rec.from_files.get(slot)
            if v is not None:
                if loaded.__class__ is torch.Tensor and loaded.is_cpu and loaded.dtype is v[1] and loaded.shape == v[2]:
                    hit = v[3]
                break
    if hit is not None and type(weight_name) is str and (weight_name.endswith(hit[1]) or weight_name == hit[0]):
        return hit
    return None


def _values_from_files(param, shard_id, expert_id) -> bool:
    key = (id(param), shard_id, expert_id)
    return any(key in rec.from_files for rec in _FROM_FILES)


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
        return name, e  # SGLang converts this write itself (its own dtypes and shapes): ids checked above
    check_tensor(layer, fmt, rule, param, view, loaded, gated, refuse, headers=headers, values=values)
    return name, e


def _check_name(layer, fmt, param, name, weight_name, refuse: Refusal) -> None:
    if not isinstance(weight_name, str):
        refuse(f"weight_name is {type(weight_name).__name__}", "the parameter's name as a str")
    tail = weight_name.rsplit(".", 1)[-1]
    if tail != name and fmt.load_rule(tail) is not None and layer._parameters.get(tail) is not param:
        # SGLang routes a write by substrings of weight_name ("input_scale", "weight_scale_2", "scale", ...)
        refuse(
            f"weight_name {weight_name!r} names another parameter ({tail}) than the one passed ({name}), so "
            "SGLang's loader would write it by the wrong rule",
            f"weight_name ending in {name!r}",
        )


def _check_shard(rule: LoadRule, shard_id, gated: bool, refuse: Refusal) -> None:
    allowed = ("w2",) if rule.group == "w2" else (("w1", "w3") if gated else ("w1",))
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
            f"expert id {_short(expert_id)} of type {type(expert_id).__name__} is not an integer expert index",
            "an int (or a 0-dim integer tensor)",
        )
    if scope == "global":
        n = global_expert_count(layer, param)
        what = "experts of this model"
    else:
        global_ids = getattr(param, "_sglang_require_global_experts", False)
        n = int(view.shape[0])
        what = "experts kept in this parameter" if global_ids else "local experts of this layer"
    if n and not 0 <= e < n:
        refuse(f"expert id {e} is out of range ({n} {what})", f"0 <= expert id < {n}")
    return e


def _intermediate_extents(layer, fmt, rule: LoadRule, view, gated: bool):
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
    if dev != param.device and dev.type != "cpu" and not (headers and dev.type == "meta"):
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
    elif rule.scalar:
        if shape not in ((), (1,)):
            refuse(
                f"shape {shape}: {rule.name} holds one {rule.kind.replace('_', ' ')} per expert and shard",
                "a 0-dim or [1] tensor",
            )
    else:
        extents, want, _ = _intermediate_extents(layer, fmt, rule, view, gated)
        if rule.group == "w13":
            fixed_dim, split_dim, fixed = 1, 0, int(view.shape[2])
            expected = f"[{want}, {fixed}]"
        else:
            fixed_dim, split_dim, fixed = 0, 1, int(view.shape[1])
            expected = f"[{fixed}, {want}]"
        if len(shape) != 2 or shape[fixed_dim] != fixed or shape[split_dim] not in extents:
            short = len(shape) == 2 and shape[fixed_dim] == fixed and 0 < shape[split_dim] < max(extents)
            note = " (SGLang would zero-fill the rest)" if short else ""
            refuse(f"shape {shape} does not fit {rule.name} {tuple(view.shape)}{note}", expected)
    if isinstance(values, list):
        code = rule.value_rule(param.dtype, loaded.dtype) if loaded.numel() else None
        if code is not None:
            values.append(ValueJob(loaded, code, rule, refuse))
    elif values:
        check_values(rule, param, loaded, refuse)


class ValueJob:
    """The values of one tensor of a request, to be checked with the others (`values=` list of check_write).

    tensor: the tensor (a meta tensor for a checkpoint's header: its values are read later); code: the value rule
    (formats/base.py VALUE_RULES); rule; refuse: its Refusal, or the (layer, parameter name, shard id, expert id) to
    build it from if it refuses; name: the checkpoint name it came by (set by the request's check)."""

    __slots__ = ("tensor", "code", "rule", "_refuse", "name")

    def __init__(self, tensor: torch.Tensor, code: str, rule: LoadRule, refuse, name: str = ""):
        self.tensor, self.code, self.rule, self._refuse, self.name = tensor, code, rule, refuse, name

    @property
    def refuse(self) -> Refusal:
        r = self._refuse
        if not isinstance(r, Refusal):
            r = self._refuse = Refusal(*r)
        return r

    def refusal(self, tensor: torch.Tensor | None = None) -> str:
        """The refusal message for this tensor's (or its values', read later) bad value."""
        try:
            refuse_values(self.rule, self.tensor if tensor is None else tensor, self.code, self.refuse)
        except WeightUpdateRefused as e:
            return str(e)
        raise AssertionError("refuse_values returned")


def value_rule_of(rule: LoadRule, param, loaded) -> str | None:
    """The value rule `loaded` must satisfy to be written into `param` (None: not value-checked, or a header's meta
    tensor, which has no values)."""
    if not isinstance(loaded, torch.Tensor) or loaded.device.type == "meta" or not loaded.numel():
        return None
    return rule.value_rule(param.dtype, loaded.dtype)


def check_values(rule: LoadRule, param, loaded, refuse: Refusal) -> None:
    """One tensor's values (a whole request checks all of its tensors at once: bucket_validation.py)."""
    code = value_rule_of(rule, param, loaded)
    if code is not None and value_checks.bad_one(loaded, code):
        refuse_values(rule, loaded, code, refuse)


def refuse_values(rule: LoadRule, loaded, code: str, refuse: Refusal) -> NoReturn:
    refuse(
        f"{rule.name} {value_checks.describe_bad(loaded, code)} is not a valid {rule.kind.replace('_', ' ')}",
        value_checks.EXPECTED[code],
    )


# ---- the FusedMoE loader hooks: validated once per call ---------------------------------------------------------


def mark_validated(param, loaded, name: str | None = None, local_experts: int = 0):
    """`FusedMoE.weight_loader` validated this (param, tensor) as parameter `name` (of `local_experts` local experts,
    0: not known): `_weight_loader_impl` only checks the local id. Returns what to restore."""
    prev = getattr(_HANDSHAKE, "validated", None)
    _HANDSHAKE.validated = (param, loaded, name, local_experts)
    return prev


def restore_validated(prev) -> None:
    _HANDSHAKE.validated = prev


def was_validated(param, loaded) -> bool:
    v = getattr(_HANDSHAKE, "validated", None)
    return v is not None and v[0] is param and v[1] is loaded


def validated(param, loaded) -> tuple | None:
    """(param, tensor, parameter name, local expert count or 0) when `weight_loader` validated this write in this
    thread; None if it did not."""
    v = getattr(_HANDSHAKE, "validated", None)
    if v is not None and v[0] is param and v[1] is loaded:
        return v
    return None


def check_local_expert(layer, param, name, expert_id, shard_id) -> int:
    """The cheap check in `_weight_loader_impl` after a validated `weight_loader` call: the (local) expert id."""
    if type(expert_id) is int:  # the plan weight_loader's check used (its expert count does not change)
        plans = layer.__dict__.get(PLANS_ATTR) if hasattr(layer, "__dict__") else None
        plan = plans.get(id(param)) if plans else None
        if plan is not None and plan.param() is param and plan.name == name and 0 <= expert_id < plan.local_n:
            return expert_id
    refuse = Refusal(layer, name, shard_id, expert_id)
    return _check_expert(layer, param_view(layer, format_of(layer), name, param), param, expert_id, "local", refuse)


# ---- fused all-expert writes (gpt-oss MXFP4) ---------------------------------------------------------------------


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
    if loaded.device != param.device and loaded.device.type != "cpu" and (shape or loaded.device.type != "meta"):
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
    if isinstance(values, list):
        code = rule.value_rule(param.dtype, loaded.dtype) if loaded.numel() else None
        if code is not None:
            values.append(ValueJob(loaded, code, rule, refuse))
    elif values:
        check_values(rule, param, loaded, refuse)
