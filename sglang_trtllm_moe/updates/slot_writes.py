"""Where a group of batched writes lands (batched_writes.py): the tensors of one (parameter, slot plan) — each the
same geometry — written with one foreach call per write of the plan, a run of consecutive slots whose tensors are
views of one buffer at a constant stride (a flattened bucket, an IPC buffer, a distributed broadcast) as one strided
view on both sides, and the views of each slot kept across requests while the parameter's storage stays where it is
(`Shard`)."""

from __future__ import annotations

import weakref

import torch

from .slot_plans import SlotPlan


class Shard:
    """What the batched writes keep for one ParamShard across requests (its `writes`): for the parameter's storage as
    it is now, the slot plan per tensor geometry (with which of its copies take the tensor whole) and the views of
    each slot every write of a plan lands in."""

    __slots__ = ("param", "where", "plans", "views")

    def __init__(self, param, where: tuple):
        self.param = weakref.ref(param)
        #: the parameter's storage and geometry the views below were made for
        self.where = where
        self.plans: dict = {}  # (shape, strides, dtype) -> (SlotPlan | None, whole: tuple[bool, ...])
        self.views: dict = {}  # (id(plan), k) -> {slot: the destination view of the plan's k-th write in that slot}


def shard_of(ps, param) -> Shard:
    data = param.data
    where = (data.data_ptr(), data.shape, data.stride())
    sh = ps.writes.get("shard")
    if sh is None or sh.param() is not param or sh.where != where:
        sh = ps.writes["shard"] = Shard(param, where)
    return sh


_FOREACH_COPY = getattr(torch, "_foreach_copy_", None)
_FOREACH_ZERO = getattr(torch, "_foreach_zero_", None)


def storage_of(t: torch.Tensor) -> int:
    """Where the storage `t` is a view of starts: tensors of a run share it (a strided view of the first then reads
    exactly the run's bytes, inside that storage)."""
    return t.untyped_storage().data_ptr()


def runs(writes: dict) -> list[tuple]:
    """The (slot, tensor) writes as runs: (first slot, count, first tensor, element stride between the tensors or
    0). A run is consecutive slots whose tensors are views of one storage at a constant positive byte stride (one
    buffer: a flattened bucket, an IPC buffer, a distributed broadcast; one write for the run instead of one per
    tensor); every tensor of one group has the same geometry."""
    out: list[tuple] = []
    s0 = k = step = last = where = 0
    t0 = None
    one_by_one = False  # the group's views are not of one buffer: taken one by one
    for s, t in writes.items():
        if t0 is not None and not one_by_one and s == s0 + k and t._base is not None and t0._base is not None:
            p = t.data_ptr()
            if k == 1:  # a second tensor: the first one's storage (asked only now)
                last, where = t0.data_ptr(), storage_of(t0)
            d = p - last
            if d > 0 and (k == 1 or d == step) and not d % t.element_size():
                if storage_of(t) == where:
                    step, last, k = d, p, k + 1
                    continue
                one_by_one = True
        if t0 is not None:
            out.append((s0, k, t0, step // t0.element_size() if k > 1 else 0))
        s0, k, t0, step = s, 1, t, 0
    if t0 is not None:
        out.append((s0, k, t0, step // t0.element_size() if k > 1 else 0))
    return out


def apply(param, plan: SlotPlan, whole: tuple, sh: Shard, writes: dict) -> None:
    """Every write of `plan` for every (slot, tensor) of `writes`, one foreach call per write of the plan (a run of
    experts of one buffer as one strided view on both sides)."""
    data = param.data
    base, step = data.storage_offset(), int(data.stride(0))
    parts = runs(writes)
    for k_op, op in enumerate(plan.ops):
        d, g = op.dst, op.src
        views = sh.views.get((id(plan), k_op))
        if views is None:
            views = sh.views[(id(plan), k_op)] = {}
        dsts, srcs = [], []
        for s0, k, t0, delta in parts:
            if k == 1:
                v = views.get(s0)
                if v is None:
                    v = views[s0] = data.as_strided(d.shape, d.stride, base + s0 * step + d.offset)
                dsts.append(v)
                if g is not None:
                    srcs.append(t0 if whole[k_op] else t0.as_strided(g.shape, g.stride, t0.storage_offset() + g.offset))
            else:
                dsts.append(data.as_strided((k, *d.shape), (step, *d.stride), base + s0 * step + d.offset))
                if g is not None:
                    srcs.append(t0.as_strided((k, *g.shape), (delta, *g.stride), t0.storage_offset() + g.offset))
        if op.kind == "copy":
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
