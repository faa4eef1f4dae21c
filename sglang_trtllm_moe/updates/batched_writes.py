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
with another), the request (updates/request.py `writes_batched`) leaves the whole list to SGLang's per-tensor
loader — one `copy_` per destination, through the replacement — and traces nothing (a trace runs SGLang's loader on
meta tensors, which a replacement would see). The entry points also leave a request naming a custom loader
(`load_format`) to it (builtins/weight_updates.py).
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections import Counter
from collections.abc import Callable, Iterator

import torch

from .. import layer_attrs, layer_state
from ..formats.base import WeightFormat
from . import slot_plans, undo
from .name_index import OTHER, Index, ParamShard, Target
from .slot_plans import SlotPlan, local_slots, own_loader, slot_plan
from .slot_writes import Shard, apply, shard_of

__all__ = [
    "batches",
    "copy_replaced",
    "counts",
    "disabled",
    "dropped",
    "enabled",
    "local_slots",
    "plan_of",
    "set_enabled",
    "step_aside",
    "stream",
    "without_others",
    "write",
]

#: switched off: every tensor goes through SGLang's per-tensor loader (set_enabled)
_ON = [True]
_COUNTS: Counter = Counter()
_COUNTS_LOCK = threading.Lock()


def set_enabled(on: bool) -> bool:
    """Batch expert writes (True, the default) or leave every tensor to SGLang's loader; returns the previous value."""
    prev = _ON[0]
    _ON[0] = bool(on)
    return prev


def step_aside(why: str | None) -> None:
    """Set (or clear) why the batched writer leaves every tensor to SGLang's loader (aside.at_update: capabilities.py
    found SGLang's write where the slot trace would not see it). The name index then knows no expert's slots either
    (slot_plans.set_untraceable): every rank checks every expert and SGLang's loader drops another rank's."""
    slot_plans.set_untraceable(why)


def enabled() -> bool:
    return _ON[0] and slot_plans.traceable()


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


def count_stepped_aside(n: int) -> None:
    """`n` tensors of a list left whole to SGLang's loader while `torch.Tensor.copy_` is replaced."""
    _count(stepped_aside=n)


def _count(**kw: int) -> None:
    with _COUNTS_LOCK:
        _COUNTS.update(kw)


# ---- where SGLang's loader puts a tensor's bytes (traced once) ----------------------------------------------------


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


def _plan(sh: Shard, layer, param, ps: ParamShard, t: torch.Tensor):
    geometry = (t.shape, t.stride(), t.dtype)
    got = sh.plans.get(geometry)
    if got is None:
        plan = plan_of(layer, param, ps.pname, ps.weight_name, ps.shard, t)
        whole = ()
        if plan is not None:
            shape, stride = tuple(t.shape), tuple(t.stride())
            whole = tuple(
                op.kind == "copy" and op.src.offset == 0 and op.src.shape == shape and op.src.stride == stride
                for op in plan.ops
            )
        got = sh.plans[geometry] = (plan, whole)
    return got


# ---- a bucket ----------------------------------------------------------------------------------------------------


def write(items: list, index: Index, batched: bool = True) -> list:
    """The expert tensors of managed layers among `items` (a validated bucket: (name, tensor) pairs), resolved by the
    model's name `index`: another rank's experts dropped (SGLang's own loader drops them), the rest written batched
    per (layer, parameter) — or, `batched` False (the request's per-tensor path), left to SGLang's loader. Returns
    the items left for the model's own `load_weights`, in order."""
    get, known = index.get, index.targets.get
    rest: list[int] = []
    groups: dict[int, tuple] = {}  # id(layer) -> (layer, {ParamShard: [(index, tensor, Target)]})
    dropped = 0
    for i, item in enumerate(items):
        name = item[0] if isinstance(item, (list, tuple)) and len(item) == 2 else None
        target = known(name, _MISS) if type(name) is str else None
        if target is _MISS:
            target = get(name)  # type: ignore[arg-type]  # (a str: known() was asked)
        if target is None or target is OTHER:
            rest.append(i)
            continue
        slots = target.slots
        if slots is None or not batched:
            if slots is not None and not slots:
                dropped += 1  # another rank's expert: SGLang's loader would write nothing of it here
            else:
                rest.append(i)
            continue
        if not slots:
            dropped += 1
            continue
        ps = target.ps
        layer_groups = groups.get(id(ps.layer))
        if layer_groups is None:
            layer_groups = groups[id(ps.layer)] = (ps.layer, {})
        shards: dict = layer_groups[1]
        entries = shards.get(ps)
        if entries is None:
            entries = shards[ps] = []
        entries.append((i, item[1], target))
    written = 0
    for layer, shards in groups.values():
        st, fmt = _written_here(layer)
        if fmt is None:
            rest += [i for entries in shards.values() for i, _, _ in entries]
            continue
        with layer_state.locked(layer):
            undo.before_write(layer)  # a guarded request: the layer copied before its first write
            left, n = _write_layer(layer, st, fmt, shards)
        rest += left
        written += n
        _count(left=len(left))
    if dropped and batched:  # (the counters are the batched path's)
        _count(dropped=dropped)
    if not written and not dropped:
        return items
    if len(rest) == len(items):
        return items
    rest.sort()
    return [items[i] for i in rest]


def without_others(items: list, index: Index, batched: bool = True) -> tuple[list, list[int] | None]:
    """`items` ((name, tensor) pairs) without the expert tensors another rank holds (name_index.Target.slots == ():
    SGLang's own loader would write nothing of them here), and the indices kept (None: all of them)."""
    get, known = index.get, index.targets.get
    kept: list[int] = []
    for i, item in enumerate(items):
        name = item[0] if isinstance(item, (list, tuple)) and len(item) == 2 else None
        target = known(name, _MISS) if type(name) is str else None
        if target is _MISS:
            target = get(name)  # type: ignore[arg-type]  # (a str: known() was asked)
        if target is None or target.__class__ is not Target or target.slots is None or target.slots:
            kept.append(i)
    if len(kept) == len(items):
        return items, None
    if batched:
        _count(dropped=len(items) - len(kept))
    return [items[i] for i in kept], kept


def dropped(items: list, elsewhere: list[int], batched: bool = True) -> tuple[list, list[int] | None]:
    """`items` without those at `elsewhere` (expert tensors another rank holds, found by a request's check), and the
    indices kept (None: all of them)."""
    if not elsewhere:
        return items, None
    gone = set(elsewhere)
    kept = [i for i in range(len(items)) if i not in gone]
    if batched:
        _count(dropped=len(gone))
    return [items[i] for i in kept], kept


#: a disk update's expert tensors are written in chunks of about this many bytes (`stream`): the iterator's CPU
#: tensors of a chunk are held until it is written, as a tensor bucket's are
STREAM_CHUNK_BYTES = 256 << 20


def stream(weights, index: Index, validated: Callable, chunk_bytes: int = STREAM_CHUNK_BYTES) -> Iterator:
    """A disk update's iterator of (name, tensor), as SGLang hands it to `model.load_weights`: another rank's expert
    tensors are dropped (never read from their files: SGLang's tensors are views of the mapped files); the expert
    tensors `validated(name, tensor, target)` accepts — the pre-check validated them from the files; it answers the
    tensor to write (the values the pre-check read, where it kept them) or None — are collected and written batched
    about every `chunk_bytes`; every other item, and whatever a chunk could not take, is yielded on to the model's
    loader. Everything is written by the time the iterator ends (before the model's `load_weights` returns and SGLang
    prepares the layers)."""
    pending: list = []
    size = 0
    dropped = 0
    get = index.get
    for item in weights:
        name = item[0] if type(item) is tuple and len(item) == 2 else None
        target = get(name) if type(name) is str else None
        if target is None or target.__class__ is not Target or target.slots is None:
            yield item
            continue
        if not target.slots:
            dropped += 1  # another rank's expert
            continue
        t = validated(name, item[1], target)
        if t is None:
            yield item
            continue
        pending.append((name, t))
        size += t.numel() * t.element_size()
        if size >= chunk_bytes:
            yield from write(pending, index)
            pending, size = [], 0
    if pending:
        yield from write(pending, index)
    if dropped:
        _count(dropped=dropped)


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


def _write_layer(layer, st, fmt, shards: dict) -> tuple[list[int], int]:
    """One layer's writes of a bucket (under its lock, where the plugin manages it: `st`). Returns (the indices left
    to SGLang's loader, how many were written)."""
    viewed: set[str] = set()
    if st is not None and st.views:
        # the groups' parameters seen as SGLang loads them while they are written (BF16's prepared view is 4-D)
        viewed = {st.groups[ps.pname] for ps in shards if ps.pname in st.groups}
        for group in viewed:
            fmt.on_layout(layer, group, all_prepared=False)
    try:
        return _write_shards(layer, st, fmt, shards)
    finally:
        for group in viewed:
            if st.all_prepared(group):  # nothing of it written after all: shown as prepared again
                fmt.on_layout(layer, group, all_prepared=True)


def _write_shards(layer, st, fmt, shards: dict) -> tuple[list[int], int]:
    converts = type(fmt).converted_by_sglang is not WeightFormat.converted_by_sglang
    params = layer._parameters
    refused: set[str] = set()  # parameters with a tensor that keeps the per-tensor path: all of theirs do
    # (id(param), plan) -> [ParamShard, param, plan, whole, Shard, {slot: tensor}]: shards whose writes are the
    # same plan (an input scale written alike from w1 and w3) are one group, in the bucket's order
    groups: dict = {}
    for ps, entries in shards.items():
        if ps.pname in refused:
            continue
        param = params.get(ps.pname)
        if param is None or not own_loader(layer, param):
            refused.add(ps.pname)
            continue
        sh = shard_of(ps, param)
        for _, t, target in entries:
            if not isinstance(t, torch.Tensor) or (
                converts and fmt.converted_by_sglang(layer, ps.pname, t, target.expert, "global")
            ):
                refused.add(ps.pname)
                break
            plan, whole = _plan(sh, layer, param, ps, t)
            if plan is None:
                refused.add(ps.pname)
                break
            g = groups.get((id(param), plan))
            if g is None:
                g = groups[(id(param), plan)] = [ps, param, plan, whole, sh, {}]
            w = g[5]
            for s in target.slots:
                w.pop(s, None)  # the last write of a slot wins, as in SGLang's loop
                w[s] = t
    _overlapping(groups, refused)
    groups = {k: g for k, g in groups.items() if g[0].pname not in refused}
    left = [i for ps, entries in shards.items() if ps.pname in refused for i, _, _ in entries]
    if not groups:
        return left, 0
    if st is not None:  # the written experts of each layout group back to checkpoint layout: one call per group
        ids: dict[str, set] = {}
        for g in groups.values():
            group = st.groups.get(g[0].pname)
            if group is not None:
                ids.setdefault(group, set()).update(g[5])
        for group, experts in ids.items():
            back = [e for e in sorted(experts) if e < st.num_experts and st.is_prepared(group, e)]
            if back:
                layer_state.unprepare_locked(layer, st, group, back)
        st.scalars_dirty = True
    for _, param, plan, whole, sh, writes in groups.values():
        apply(param, plan, whole, sh, writes)
    n = sum(len(entries) for ps, entries in shards.items() if ps.pname not in refused)
    _count(tensors=n, groups=len(groups))
    return left, n


def _overlapping(groups: dict, refused: set[str]) -> None:
    """A parameter whose plans overlap inside a slot they share is added to `refused` (the order across its plans
    matters: SGLang's per-tensor path keeps it)."""
    per_param: dict = {}
    for ps, _, plan, _, _, writes in groups.values():
        per_param.setdefault(ps.pname, []).append((plan.span, set(writes)))
    for pname, spans in per_param.items():
        for a in range(len(spans)):
            for b in range(a + 1, len(spans)):
                (lo1, hi1), s1 = spans[a]
                (lo2, hi2), s2 = spans[b]
                if lo1 < hi2 and lo2 < hi1 and s1 & s2:
                    refused.add(pname)


_MISS = object()
