"""Slot plans for batched writes (batched_writes.py): where SGLang's own `_weight_loader_impl` of this release
writes a tensor inside an expert's slot, traced once per (parameter, shard, tensor geometry) on meta tensors under a
`TorchFunctionMode` that records each write into the parameter as (destination view, source view) and refuses to run
anything that would write elsewhere or read a value. The trace is repeated for a second slot: the plan is kept only
when the writes move with the slot and stay inside it (`slot_plan`; None: that write keeps SGLang's per-tensor path).
`StandIn` is the layer as SGLang's own FusedMoE methods see it, for a call that must change nothing."""

from __future__ import annotations

import types
from typing import Any, NamedTuple

import torch
from torch.overrides import TorchFunctionMode

#: why SGLang's loader cannot be traced in this process (capabilities.py: the batched-writes group stepped aside), or
#: None
_UNTRACEABLE: list[str | None] = [None]


def set_untraceable(why: str | None) -> None:
    """Set (or clear) why no trace of SGLang's loader is to be trusted here (batched_writes.step_aside)."""
    _UNTRACEABLE[0] = why


def traceable() -> bool:
    """A trace of SGLang's loader finds its writes (plans, local slots) in this process."""
    return _UNTRACEABLE[0] is None


def unwrapped(fn):
    """A function without the hook wrappers around it (`__wrapped__` chain)."""
    while hasattr(fn, "__wrapped__"):
        fn = fn.__wrapped__
    return fn


class StandIn:
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
    loader(StandIn(layer, record), param, tensor, weight_name, shard_id, expert_id)
    return tuple(int(s) for s in slots)


def own_loader(layer, param) -> bool:
    """`param` is loaded by `layer`'s own FusedMoE.weight_loader (not a replacement someone installed)."""
    wl = getattr(param, "weight_loader", None)
    return (
        isinstance(wl, types.MethodType)
        and wl.__self__ is layer
        and unwrapped(wl.__func__) is unwrapped(getattr(type(layer), "weight_loader", None))
    )


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
        impl(StandIn(layer), param=probe, loaded_weight=src, weight_name=weight_name, shard_id=shard_id, expert_id=slot)
    return [
        (op[0], _geometry(op[1]), _geometry(op[2]) if op[0] == "copy" else None, op[2] if op[0] == "fill" else None)
        for op in mode.ops
    ]


def slot_plan(layer, param, weight_name: str, shard_id: str, loaded: torch.Tensor) -> SlotPlan | None:
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
