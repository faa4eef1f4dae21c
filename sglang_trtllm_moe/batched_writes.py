"""Batched expert writes: a validated update bucket's expert tensors of managed layers are written per (layer,
parameter) in a few device operations, instead of one trip each through the model's `load_weights` loop and
SGLang's FusedMoE loader.

Where it runs: at the update entry points (builtins/weight_updates.py `check_buckets_around`), once the whole list
`model.load_weights` got has passed `bucket_validation.check_bucket`. Every item that resolves to an expert tensor
of a layer the plugin manages (layer_state.state_of) is written here; everything else — non-expert tensors, layers
SGLang prepares itself, fused all-expert formats (gpt-oss), fused shared experts, parameters whose loader was
replaced, anything whose write cannot be mapped — goes on to the model's own `load_weights`, unchanged and in order.

What a write does is SGLang's own loader's, never a copy of its rules:

* which local slots a checkpoint expert id lands in (EP ranks, EPLB replicas, experts of other ranks dropped):
  SGLang's own `FusedMoE.weight_loader` of this release, called with a stand-in for the layer whose
  `_weight_loader_impl` records the slot instead of writing (`local_slots`);
* where the bytes of one tensor go inside a slot (TP narrowing, the padded intermediate per half and its zero-fill,
  gate/up order, per-tensor scale positions): SGLang's own `_weight_loader_impl` of this release, run once per
  (parameter, shard, tensor geometry) on *meta* tensors under a `TorchFunctionMode` that records each write into the
  parameter as (destination view, source view) — offsets, shapes and strides — and refuses to run anything that
  would write elsewhere or read a value (`plan_of`). The trace is repeated for a second slot: the plan is kept only
  when the writes move with the slot and stay inside it. SGLang code that reads values, transforms the tensor (not a
  view of it) or writes outside the slot yields no plan, and those tensors keep the per-tensor path.

Then per layer, under its lock: the written experts of each group are returned to checkpoint layout with one
`unprepare_` call per group (layer_state.unprepare_locked; nothing to do in a begin/end session), and each (parameter,
plan) group is written with one `torch._foreach_copy_` / `_foreach_zero_` per recorded write (the tensors' views, in
the bucket's order; the last write of a slot wins, as in SGLang's loop). The entry point's flush lays the dirty
experts out as before. A bucket is validated whole before any of this runs; nothing here converts a tensor to a
Python value.
"""

from __future__ import annotations

import contextlib
import threading
import types
import weakref
from collections import Counter
from collections.abc import Iterator
from typing import Any, NamedTuple

import torch
from torch.overrides import TorchFunctionMode

from . import layer_attrs, layer_state
from .formats.base import WeightFormat

#: switched off: every tensor goes through SGLang's per-tensor loader (set_enabled)
_ON = [True]
_COUNTS: Counter = Counter()
_COUNTS_LOCK = threading.Lock()


def set_enabled(on: bool) -> bool:
    """Batch expert writes (True, the default) or leave every tensor to SGLang's loader; returns the previous value."""
    prev = _ON[0]
    _ON[0] = bool(on)
    return prev


def enabled() -> bool:
    return _ON[0]


@contextlib.contextmanager
def disabled() -> Iterator[None]:
    """Every tensor through SGLang's per-tensor loader for the block (what the plugin did before batched writes)."""
    prev = set_enabled(False)
    try:
        yield
    finally:
        set_enabled(prev)


def counts() -> dict[str, int]:
    """Totals since the process started: `tensors` written batched, `dropped` (experts of other EP ranks, as SGLang
    drops them), `left` (expert tensors of managed layers left to SGLang's loader), `groups` (parameter groups
    written), `traces` (plans traced)."""
    with _COUNTS_LOCK:
        return dict(_COUNTS)


def _count(**kw: int) -> None:
    with _COUNTS_LOCK:
        _COUNTS.update(kw)


# ---- SGLang's own loader, run on a stand-in ------------------------------------------------------------------------


def unwrapped(fn):
    """A function without the hook wrappers around it (`__wrapped__` chain)."""
    while hasattr(fn, "__wrapped__"):
        fn = fn.__wrapped__
    return fn


class _StandIn:
    """`layer` as SGLang's own FusedMoE methods see it, for a call that must change nothing: attribute reads resolve
    as on the layer (its class's data descriptors, then its own attributes), except that functions of its class run
    unhooked with the stand-in as `self`; attribute writes stay on the stand-in; `_weight_loader_impl` — the write
    itself — is `record` when given."""

    def __init__(self, layer, record=None):
        self.__dict__["_layer"] = layer
        self.__dict__["_record"] = record

    def __getattr__(self, name: str):
        layer = self.__dict__["_layer"]
        if name == "_weight_loader_impl" and self.__dict__["_record"] is not None:
            return self.__dict__["_record"]
        v = None
        for klass in type(layer).__mro__:
            v = klass.__dict__.get(name)
            if v is not None:
                break
        own = getattr(layer, "__dict__", {})
        if name in own and not (hasattr(v, "__set__") or hasattr(v, "__delete__")):
            return own[name]  # an attribute of the layer itself (a patched method included), as Python finds it
        if isinstance(v, types.FunctionType):
            return types.MethodType(unwrapped(v), self)
        return getattr(layer, name)

    def __setattr__(self, name: str, value) -> None:
        self.__dict__[name] = value


def local_slots(layer, param, weight_name: str, shard_id: str, expert_id: int, tensor) -> tuple[int, ...]:
    """The slots of `param`'s first dimension SGLang's own `FusedMoE.weight_loader` writes checkpoint expert
    `expert_id` into on this rank (none: another rank's expert; several: EPLB replicas)."""
    slots: list[int] = []

    def record(*args, **kwargs):
        slots.append(kwargs["expert_id"] if "expert_id" in kwargs else args[4])

    loader = unwrapped(type(layer).weight_loader)
    loader(_StandIn(layer, record), param, tensor, weight_name, shard_id, expert_id)
    return tuple(int(s) for s in slots)


# ---- a write of one tensor, traced -------------------------------------------------------------------------------


class Geometry(NamedTuple):
    """A view of a storage: element offset, shape, strides."""

    offset: int
    shape: tuple
    stride: tuple

    def span(self) -> tuple[int, int]:
        """[first, last + 1) element offsets the view touches."""
        if any(s == 0 for s in self.shape):
            return self.offset, self.offset
        last = self.offset + sum((n - 1) * st for n, st in zip(self.shape, self.stride, strict=True))
        return min(self.offset, last), max(self.offset, last) + 1


def _geometry(t: torch.Tensor, base: int = 0) -> Geometry:
    return Geometry(int(t.storage_offset()) - base, tuple(t.shape), tuple(t.stride()))


class WriteOp(NamedTuple):
    """One write SGLang's loader makes into a slot: kind "copy" (src: a view of the loaded tensor, same shape as
    dst), "zero", or "fill" (value); dst's offset is relative to the slot's first element."""

    kind: str
    dst: Geometry
    src: Geometry | None = None
    value: float | int | bool | None = None


class SlotPlan(NamedTuple):
    """Every write of one tensor into one slot, in SGLang's order, and the slot elements they touch."""

    ops: tuple
    span: tuple


class _Refused(Exception):
    """The traced loader did something a plan cannot replay."""


#: ops that return their input's values: on the loaded tensor they are taken as the input itself (a view of it)
_SAME_VALUES = frozenset({"contiguous", "clone", "detach", "to", "cpu", "cuda"})
_ZEROS = frozenset({"zeros_like", "zeros", "new_zeros"})


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


class _Trace(TorchFunctionMode):
    """Records every write into the probe parameter's storage; refuses writes elsewhere, value reads (they fail on
    meta tensors) and copies from anything but the probe's loaded tensor or zeros."""

    def __init__(self, dst: torch.Tensor, src: torch.Tensor):
        super().__init__()
        self.dst, self.src = _storage(dst), _storage(src)
        self.zeros: set[int] = set()
        self.keep: list = []  # tensors whose storage ids are in `zeros`: alive while tracing
        self.ops: list[tuple] = []

    def _kind(self, t) -> str:
        if not isinstance(t, torch.Tensor):
            return "value"
        if t.device.type != "meta":
            return "real"
        s = _storage(t)
        if s == self.dst:
            return "dst"
        if s == self.src:
            return "src"
        return "zero" if s in self.zeros else "temp"

    def _write(self, dst: torch.Tensor, value) -> None:
        kind = self._kind(value)
        if kind == "value":
            if value == 0:
                self.ops.append(("zero", dst))
            elif isinstance(value, (int, float, bool)):
                self.ops.append(("fill", dst, value))
            else:
                raise _Refused(f"writes {type(value).__name__}")
            return
        if kind not in ("src", "zero"):
            raise _Refused(f"copies from a {kind} tensor")
        if value.shape != dst.shape:
            value = value.reshape(dst.shape) if value.numel() == dst.numel() else value.expand(dst.shape)
        self.ops.append(("zero", dst) if kind == "zero" else ("copy", dst, value))

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        first: Any = args[0] if args else None
        if name == "__set__":  # Parameter.data = ...
            raise _Refused("rebinds a parameter's data")
        if name == "__setitem__":
            if self._kind(first) != "dst":
                raise _Refused("indexed write outside the parameter")
            self._write(first[args[1]], args[2])
            return None
        inplace = (
            (name.endswith("_") and not name.startswith("_"))
            or (name.startswith("__i") and name.endswith("__"))  # x += y, x *= y, ...
            or "out" in kwargs
        )
        if inplace:
            target = kwargs["out"] if "out" in kwargs else first
            kind = self._kind(target)
            if kind == "dst":
                if name == "copy_":
                    self._write(first, args[1] if len(args) > 1 else kwargs["src"])
                elif name == "zero_":
                    self._write(first, 0)
                elif name == "fill_" and not isinstance(args[1], torch.Tensor):
                    self._write(first, args[1])
                else:
                    raise _Refused(f"{name} on the parameter")
                return first
            if kind != "temp":
                raise _Refused(f"{name} on a {kind} tensor")
            out = func(*args, **kwargs)
            self.zeros.discard(_storage(target))
            return out
        if name in _SAME_VALUES and self._kind(first) == "src":
            dtype = kwargs.get("dtype", next((a for a in args[1:] if isinstance(a, torch.dtype)), None))
            if dtype is None or dtype == first.dtype:
                return first
            raise _Refused("converts the loaded tensor's dtype")
        out = func(*args, **kwargs)
        if name in _ZEROS and isinstance(out, torch.Tensor) and out.device.type == "meta":
            self.zeros.add(_storage(out))
            self.keep.append(out)
        return out


def _meta_like(t: torch.Tensor) -> torch.Tensor:
    return torch.empty_strided(tuple(t.shape), tuple(t.stride()), dtype=t.dtype, device="meta")


def _probe_param(param: torch.Tensor) -> torch.Tensor:
    """A meta stand-in of `param`: same class, shape, strides, dtype and attributes (what SGLang's loader reads)."""
    probe = torch.Tensor._make_subclass(type(param), _meta_like(param.data), False)
    probe.__dict__.update(param.__dict__)
    return probe


def _trace(layer, param, weight_name: str, shard_id: str, loaded: torch.Tensor, slot: int) -> list[tuple]:
    probe, src = _probe_param(param), _meta_like(loaded)
    impl = unwrapped(type(layer)._weight_loader_impl)
    mode = _Trace(probe.data, src)
    with mode:
        impl(
            _StandIn(layer), param=probe, loaded_weight=src, weight_name=weight_name, shard_id=shard_id, expert_id=slot
        )
    return [
        (op[0], _geometry(op[1]), _geometry(op[2]) if op[0] == "copy" else None, op[2] if op[0] == "fill" else None)
        for op in mode.ops
    ]


def _slot_plan(layer, param, weight_name: str, shard_id: str, loaded: torch.Tensor) -> SlotPlan | None:
    """SGLang's write of `loaded` into one slot of `param` as a plan, or None when it cannot be replayed."""
    n, step = int(param.shape[0]), int(param.stride(0))
    try:
        first = _trace(layer, param, weight_name, shard_id, loaded, 0)
        again = _trace(layer, param, weight_name, shard_id, loaded, 1) if n > 1 else None
    except Exception:  # noqa: BLE001 - whatever SGLang's loader does on meta tensors: not replayable, not an error
        return None
    if not first:
        return None
    ops = []
    lo, hi = step, 0
    for k, (kind, dst, src, value) in enumerate(first):
        if again is not None:
            kind2, dst2, src2, value2 = again[k] if k < len(again) else (None, None, None, None)
            moved = Geometry(dst.offset + step, dst.shape, dst.stride)
            if (kind2, dst2, src2, value2) != (kind, moved, src, value):
                return None
        a, b = dst.span()
        if a < 0 or b > step:
            return None  # a write outside its slot
        lo, hi = min(lo, a), max(hi, b)
        ops.append(WriteOp(kind, dst, src, value))
    if again is not None and len(again) != len(first):
        return None
    return SlotPlan(tuple(ops), (lo, hi))


def plan_of(layer, param, pname: str, weight_name: str, shard_id: str, loaded: torch.Tensor) -> SlotPlan | None:
    """The plan of a write of a tensor like `loaded` into `param` (cached on the layer per parameter, shard and
    geometry); None: that write keeps SGLang's per-tensor path. The caller holds the layer's lock."""
    plans = layer.__dict__.setdefault(layer_attrs.BATCH_PLANS, {})
    key = (
        pname,
        id(param),
        shard_id,
        tuple(param.shape),
        param.stride(),
        param.dtype,
        tuple(loaded.shape),
        loaded.stride(),
        loaded.dtype,
    )
    if key in plans:
        entry = plans[key]
        if entry[0]() is param:
            return entry[1]
    plan = _slot_plan(layer, param, weight_name, shard_id, loaded)
    plans[key] = (weakref.ref(param), plan)
    _count(traces=1)
    return plan


# ---- a bucket ----------------------------------------------------------------------------------------------------


def _own_loader(layer, param) -> bool:
    """`param` is loaded by `layer`'s own FusedMoE.weight_loader (not a replacement someone installed)."""
    wl = getattr(param, "weight_loader", None)
    return (
        isinstance(wl, types.MethodType)
        and wl.__self__ is layer
        and unwrapped(wl.__func__) is unwrapped(getattr(type(layer), "weight_loader", None))
    )


def _routed(layer) -> int | None:
    """The checkpoint expert ids of routed experts are below this (fused shared experts follow)."""
    n = getattr(layer, "_num_global_routed", None)
    if n is None:
        total = getattr(layer, "num_experts", None)
        if total is None:
            return None
        n = int(total) - int(getattr(layer, "num_fused_shared_experts", 0) or 0)
    return int(n)


def write(items: list, targets: list) -> list:
    """Write the expert tensors of managed layers among `items` (a validated bucket: (name, tensor) pairs) batched;
    `targets[i]`: (layer, parameter name, shard id, checkpoint expert id) of items[i], or None. Returns the items
    left for the model's own `load_weights`, in order."""
    if not _ON[0]:
        return items
    by_layer: dict[int, tuple] = {}
    for i, target in enumerate(targets):
        if target is None:
            continue
        layer = target[0]
        entry = by_layer.get(id(layer))
        if entry is None:
            entry = by_layer[id(layer)] = (layer, *_written_here(layer), [])
        if entry[2] is not None:
            entry[3].append(i)
    taken: set[int] = set()
    for layer, st, fmt, indices in by_layer.values():
        if fmt is None:
            continue
        with layer_state.locked(layer):
            done = _write_layer(layer, st, fmt, items, targets, indices)
        taken |= done
        _count(left=len(indices) - len(done))
    if not taken:
        return items
    return [item for i, item in enumerate(items) if i not in taken]


def batches(layer) -> bool:
    """True when a validated bucket's expert tensors for `layer` are written here rather than by SGLang's loader."""
    return _written_here(layer)[1] is not None


def _written_here(layer) -> tuple:
    """(its layout state or None, the format whose layer this is) when its expert writes are batched here: a layer
    the plugin manages, or one SGLang prepares itself in a format declared `batched_where_sglang_prepares`; (None,
    None) for every other layer (all experts at once: gpt-oss, or SGLang's own loader)."""
    st = layer_state.state_of(layer)
    if st is not None:
        return (st, None) if st.fmt.fused else (st, st.fmt)
    fmt = layer_state.observed(layer)
    return (None, fmt) if fmt is not None and fmt.batched_where_sglang_prepares and not fmt.fused else (None, None)


_UNSEEN = object()


class _Param:
    """What one (parameter, shard id) of a layer needs for a bucket's writes, looked up once per bucket."""

    __slots__ = ("param", "pname", "weight_name", "global_ids", "plans")

    def __init__(self, param, pname: str, weight_name: str):
        self.param, self.pname, self.weight_name = param, pname, weight_name
        self.global_ids = bool(getattr(param, "_sglang_require_global_experts", False))
        self.plans: dict = {}


def _write_layer(layer, st, fmt, items: list, targets: list, indices: list[int]) -> set[int]:
    """One layer's writes of a bucket (under its lock, where the plugin manages it: `st`). Returns the indices
    written (or dropped, as SGLang drops another rank's experts); the others are left to SGLang's loader."""
    routed = _routed(layer)
    if routed is None:
        return set()
    viewed: set[str] = set()
    if st is not None and st.views:
        # the groups' parameters seen as SGLang loads them while they are written (BF16's prepared view is 4-D)
        viewed = {st.groups[targets[i][1]] for i in indices if targets[i][1] in st.groups}
        for group in viewed:
            fmt.on_layout(layer, group, all_prepared=False)
    try:
        return _write_experts(layer, st, fmt, routed, items, targets, indices)
    finally:
        for group in viewed:
            if st.all_prepared(group):  # nothing of it written after all: shown as prepared again
                fmt.on_layout(layer, group, all_prepared=True)


def _write_experts(layer, st, fmt, routed: int, items: list, targets: list, indices: list[int]) -> set[int]:
    prefix = getattr(layer, layer_attrs.PREFIX, None) or "experts"
    converts = type(fmt).converted_by_sglang is not WeightFormat.converted_by_sglang
    params = layer._parameters
    infos: dict = {}
    slots_of: dict = {}
    refused: set[str] = set()  # parameters with a tensor that keeps the per-tensor path: all of theirs do
    pending: list[tuple] = []  # (index, _Param, slots, plan, tensor)
    dropped: list[int] = []
    for i in indices:
        _, pname, shard, expert = targets[i]
        if pname in refused:
            continue
        info = infos.get((pname, shard), _UNSEEN)
        if info is _UNSEEN:
            param = params.get(pname)
            ok = param is not None and _own_loader(layer, param)
            info = infos[(pname, shard)] = _Param(param, pname, f"{prefix}.{pname}") if ok else None
        tensor = items[i][1]
        if (
            info is None
            or not isinstance(tensor, torch.Tensor)
            or type(expert) is not int
            or not 0 <= expert < routed
            or (converts and fmt.converted_by_sglang(layer, pname, tensor, expert, "global"))
        ):
            refused.add(pname)
            continue
        key = (expert, info.global_ids)
        slots = slots_of.get(key)
        if slots is None:
            try:
                slots = slots_of[key] = local_slots(layer, info.param, info.weight_name, shard, expert, tensor)
            except Exception:  # noqa: BLE001 - SGLang's mapping on this release: leave it to its own loader
                refused.add(pname)
                continue
        if not slots:
            dropped.append(i)  # another EP rank's expert: SGLang's loader writes nothing of it here either
            continue
        geometry = (tensor.shape, tensor.stride(), tensor.dtype)
        plan = info.plans.get(geometry, _UNSEEN)
        if plan is _UNSEEN:
            plan = info.plans[geometry] = plan_of(layer, info.param, pname, info.weight_name, shard, tensor)
        if plan is None:
            refused.add(pname)
            continue
        pending.append((i, info, slots, plan, tensor))
    groups = _groups(pending, refused)
    if not groups:
        return set(dropped)
    if st is not None:  # the written experts of each layout group back to checkpoint layout: one call per group
        ids: dict[str, set] = {}
        for g in groups.values():
            group = st.groups.get(g[0].pname)
            if group is not None:
                ids.setdefault(group, set()).update(g[2])
        for group, experts in ids.items():
            back = [e for e in sorted(experts) if e < st.num_experts and st.is_prepared(group, e)]
            if back:
                layer_state.unprepare_locked(layer, st, group, back)
        st.scalars_dirty = True
    for info, plan, writes in groups.values():
        _apply(info.param, plan, writes)
    written = [p[0] for p in pending if p[1].pname not in refused]
    _count(tensors=len(written), dropped=len(dropped), groups=len(groups))
    return set(written) | set(dropped)


def _groups(pending: list[tuple], refused: set[str]) -> dict:
    """{(parameter, plan): (_Param, plan, {slot: tensor})} of the pending writes of parameters not refused: the last
    write of a slot wins (SGLang's order). A parameter whose plans overlap inside a slot they share is added to
    `refused` (the order across its plans matters: SGLang's per-tensor path keeps it)."""
    groups: dict = {}
    for _, info, slots, plan, tensor in pending:
        if info.pname in refused:
            continue
        key = (id(info.param), plan)
        g = groups.get(key)
        if g is None:
            g = groups[key] = (info, plan, {})
        writes: dict = g[2]
        for s in slots:
            writes.pop(s, None)
            writes[s] = tensor
    per_param: dict = {}
    for info, plan, writes in groups.values():
        per_param.setdefault(info.pname, []).append((plan.span, set(writes)))
    for pname, spans in per_param.items():
        for a in range(len(spans)):
            for b in range(a + 1, len(spans)):
                (lo1, hi1), s1 = spans[a]
                (lo2, hi2), s2 = spans[b]
                if lo1 < hi2 and lo2 < hi1 and s1 & s2:
                    refused.add(pname)
    return {k: g for k, g in groups.items() if g[0].pname not in refused}


_FOREACH_COPY = getattr(torch, "_foreach_copy_", None)
_FOREACH_ZERO = getattr(torch, "_foreach_zero_", None)


def _apply(param, plan: SlotPlan, writes: dict) -> None:
    """Every write of `plan` for every (slot, tensor) of `writes`, one foreach call per write of the plan."""
    data = param.data
    base, step = data.storage_offset(), int(data.stride(0))
    slots = list(writes)
    tensors = list(writes.values())
    for op in plan.ops:
        d = op.dst
        dsts = [data.as_strided(d.shape, d.stride, base + s * step + d.offset) for s in slots]
        if op.kind == "copy":
            g = op.src
            srcs = [t.as_strided(g.shape, g.stride, t.storage_offset() + g.offset) for t in tensors]
            if _FOREACH_COPY is not None:
                _FOREACH_COPY(dsts, srcs)
            else:
                for a, b in zip(dsts, srcs, strict=True):
                    a.copy_(b)
        elif op.kind == "zero":
            if _FOREACH_ZERO is not None:
                _FOREACH_ZERO(dsts)
            else:
                for a in dsts:
                    a.zero_()
        else:
            for a in dsts:
                a.fill_(op.value)
