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

A load that replaced `torch.Tensor.copy_` sees every write as SGLang's loader makes it: while `torch.Tensor.copy_`
is not torch's own (`copy_replaced`; verl's delta loader masks NaN sources with one and records every destination
with another), `write` leaves the whole list to SGLang's per-tensor loader — one `copy_` per destination, through
the replacement — and traces nothing (a trace runs SGLang's loader on meta tensors, which a replacement would see).
The entry points also leave a request naming a custom loader (`load_format`) to it (builtins/weight_updates.py).
"""

from __future__ import annotations

import contextlib
import threading
import types
import weakref
from collections import Counter
from collections.abc import Iterator

import torch

from .. import layer_attrs, layer_state
from ..formats.base import WeightFormat
from . import undo
from .slot_plans import SlotPlan, StandIn, slot_plan, unwrapped

#: switched off: every tensor goes through SGLang's per-tensor loader (set_enabled)
_ON = [True]
_COUNTS: Counter = Counter()
_COUNTS_LOCK = threading.Lock()


def set_enabled(on: bool) -> bool:
    """Batch expert writes (True, the default) or leave every tensor to SGLang's loader; returns the previous value."""
    prev = _ON[0]
    _ON[0] = bool(on)
    return prev


#: why the plugin stepped aside for batched writes in this process (capabilities.py: its slot trace would not find
#: SGLang's write), or None
_ASIDE: list[str | None] = [None]


def step_aside(why: str | None) -> None:
    """Set (or clear) the reason the batched writer leaves every tensor to SGLang's loader (aside.at_update)."""
    _ASIDE[0] = why


def enabled() -> bool:
    return _ON[0] and _ASIDE[0] is None


#: torch's own `Tensor.copy_` (a method of TensorBase; `torch.Tensor` defines none of its own)
_TORCH_COPY = torch._C.TensorBase.copy_


def copy_replaced() -> bool:
    """Something replaced `torch.Tensor.copy_` (a loader that masks or records writes): batched writes step aside."""
    return torch.Tensor.copy_ is not _TORCH_COPY


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
    written), `traces` (plans traced), `stepped_aside` (tensors of lists left whole to SGLang's loader because
    `torch.Tensor.copy_` was replaced)."""
    with _COUNTS_LOCK:
        return dict(_COUNTS)


def _count(**kw: int) -> None:
    with _COUNTS_LOCK:
        _COUNTS.update(kw)


# ---- SGLang's own loader, run on a stand-in ------------------------------------------------------------------------


def local_slots(layer, param, weight_name: str, shard_id: str, expert_id: int, tensor) -> tuple[int, ...]:
    """The slots of `param`'s first dimension SGLang's own `FusedMoE.weight_loader` writes checkpoint expert
    `expert_id` into on this rank (none: another rank's expert; several: EPLB replicas)."""
    slots: list[int] = []

    def record(*args, **kwargs):
        slots.append(kwargs["expert_id"] if "expert_id" in kwargs else args[4])

    loader = unwrapped(type(layer).weight_loader)
    loader(StandIn(layer, record), param, tensor, weight_name, shard_id, expert_id)
    return tuple(int(s) for s in slots)


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
    plan = slot_plan(layer, param, weight_name, shard_id, loaded)
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
    left for the model's own `load_weights`, in order (all of them while `copy_replaced()`)."""
    if not enabled():
        return items
    if torch.Tensor.copy_ is not _TORCH_COPY:
        _count(stepped_aside=len(items))
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
            undo.before_write(layer)  # a guarded request: the layer copied before its first write
            done = _write_layer(layer, st, fmt, items, targets, indices)
        taken |= done
        _count(left=len(indices) - len(done))
    if not taken:
        return items
    return [item for i, item in enumerate(items) if i not in taken]


#: a disk update's expert tensors are written in chunks of about this many bytes (`stream`): the iterator's CPU
#: tensors of a chunk are held until it is written, as a tensor bucket's are
STREAM_CHUNK_BYTES = 256 << 20


def stream(weights, target_of, chunk_bytes: int = STREAM_CHUNK_BYTES) -> Iterator:
    """A disk update's iterator of (name, tensor), as SGLang hands it to `model.load_weights`: the items `target_of`
    resolves ((layer, parameter name, shard id, checkpoint expert id): an expert tensor the pre-check validated
    from the files) are collected and written batched about every `chunk_bytes`; every other item, and whatever a
    chunk could not take, is yielded on to the model's loader. Everything is written by the time the iterator ends
    (before the model's `load_weights` returns and SGLang prepares the layers)."""
    pending: list = []
    targets: list = []
    size = 0
    for item in weights:
        target = target_of(item)
        if target is None:
            yield item
            continue
        pending.append(item)
        targets.append(target)
        t = item[1]
        size += t.numel() * t.element_size()
        if size >= chunk_bytes:
            yield from write(pending, targets)
            pending, targets, size = [], [], 0
    if pending:
        yield from write(pending, targets)


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
