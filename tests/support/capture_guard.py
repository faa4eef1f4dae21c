"""A CPU stand-in for CUDA-graph capture: a context under which every operation that capture refuses raises.

Why: SGLang captures the MoE forward into a CUDA graph, and capture fails on any host read of a device tensor (a
sync: `.item()`, `float(t)`, `bool(t)`, `.tolist()`), on operations whose output shape depends on tensor values
(`nonzero`, `unique*`, `masked_select`, boolean-mask indexing, `repeat_interleave` without `output_size`) and on
host->device copies (`torch.tensor(python data, device=...)`). On a CPU box none of these fails, so a forward that
relies on one works in every CPU test and breaks only on the GPU server. Run under `capture_guard()`, the same
forward raises `CaptureUnsafe` at the first such operation, on any device.

Two layers: a TorchDispatchMode sees every aten operation (item/float/int/bool all end in `_local_scalar_dense`; a
tensor made from Python data passes through `lift_fresh`); a TorchFunctionMode sees what never reaches the
dispatcher on CPU (`Tensor.tolist`, `Tensor.numpy`) and the Python-data constructors by name. Cross-device copies
(`_to_copy` / `copy_` between the host and a device) are refused too; on a CPU-only run there are none to see.
Violations are also recorded, so code that swallows exceptions cannot hide one: leaving the context raises.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten


class CaptureUnsafe(AssertionError):
    """An operation CUDA-graph capture refuses ran inside `capture_guard()`."""


#: aten operations refused whatever their arguments: what they do under capture
REFUSED = {
    aten._local_scalar_dense.default: "reads a tensor's value on the host (.item(), float(), int(), bool())",
    aten.is_nonzero.default: "reads a tensor's truth value on the host (bool(t), `if t:`)",
    aten.equal.default: "torch.equal reads its answer on the host",
    aten.nonzero.default: "nonzero: output shape depends on the values (host sync)",
    aten.argwhere.default: "argwhere: output shape depends on the values (host sync)",
    aten.unique_consecutive.default: "unique_consecutive: output shape depends on the values (host sync)",
    aten._unique.default: "unique: output shape depends on the values (host sync)",
    aten._unique2.default: "unique: output shape depends on the values (host sync)",
    aten.unique_dim.default: "unique(dim=): output shape depends on the values (host sync)",
    aten.unique_dim_consecutive.default: "unique_consecutive(dim=): output shape depends on the values",
    aten.masked_select.default: "masked_select: output shape depends on the values (host sync)",
    aten.bincount.default: "bincount: output size depends on the values (host sync)",
    aten._assert_async.default: "_assert_async: a host-checked assertion",
    aten._assert_async.msg: "_assert_async: a host-checked assertion",
    aten.lift_fresh.default: "a tensor made from Python data (torch.tensor(...)): a host->device copy",
    aten.lift_fresh_copy.default: "a tensor made from Python data (torch.tensor(...)): a host->device copy",
}
#: index operations refused when an index is a mask (they run nonzero on it)
MASK_INDEXED = {aten.index.Tensor, aten.index_put.default, aten.index_put_.default, aten._index_put_impl_.default}
#: repeat_interleave with a tensor of repeats and no output_size sums the repeats on the host
REPEAT_INTERLEAVE = {aten.repeat_interleave.Tensor, aten.repeat_interleave.self_Tensor}
#: Tensor methods and constructors that never reach the dispatcher on CPU (or that hide a lift_fresh)
REFUSED_FUNCTIONS = {
    torch.Tensor.tolist: "Tensor.tolist reads the values on the host",
    torch.Tensor.numpy: "Tensor.numpy reads the values on the host",
    torch.Tensor.item: "Tensor.item reads a value on the host",
    torch.tensor: "torch.tensor(python data): a host->device copy",
    torch.Tensor.new_tensor: "Tensor.new_tensor(python data): a host->device copy",
    torch.from_numpy: "torch.from_numpy: host data",
}


def _is_mask(t: object) -> bool:
    return isinstance(t, torch.Tensor) and t.dtype in (torch.bool, torch.uint8)


def _host_and_device(a: torch.device, b: torch.device) -> bool:
    return a != b and "cpu" in (a.type, b.type)


class _Modes:
    def __init__(self) -> None:
        self.violations: list[str] = []
        #: inside `t[index] = python number`: torch makes that 0-d value on the tensor's device with a fill, and only
        #: on CPU passes it through lift_fresh (python_variable_indexing.cpp valueToTensor): capture-safe, not refused
        self.scalar_setitem = 0

    def refuse(self, what: str, why: str) -> None:
        msg = f"{what}: {why}"
        self.violations.append(msg)
        raise CaptureUnsafe(f"not CUDA-graph capture-safe: {msg}")


class _Dispatch(TorchDispatchMode):
    def __init__(self, modes: _Modes) -> None:
        super().__init__()
        self.modes = modes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        why = REFUSED.get(func)
        lifted_setitem_value = func is aten.lift_fresh.default and self.modes.scalar_setitem and args[0].dim() == 0
        if why is not None and not lifted_setitem_value:
            self.modes.refuse(str(func), why)
        if func in MASK_INDEXED:
            indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
            if any(_is_mask(i) for i in indices or ()):
                self.modes.refuse(str(func), "indexing with a boolean mask: output shape depends on the values")
        if func in REPEAT_INTERLEAVE and kwargs.get("output_size", args[3] if len(args) > 3 else None) is None:
            self.modes.refuse(str(func), "repeat_interleave with tensor repeats and no output_size (host sync)")
        if func is aten._to_copy.default and isinstance(args[0], torch.Tensor):
            dst = kwargs.get("device")
            if dst is not None and _host_and_device(args[0].device, torch.device(dst)):
                self.modes.refuse(str(func), f"a copy {args[0].device} -> {dst} (host <-> device)")
        if func is aten.copy_.default and _host_and_device(args[0].device, args[1].device):
            self.modes.refuse(str(func), f"a copy {args[1].device} -> {args[0].device} (host <-> device)")
        return func(*args, **kwargs)


class _Function(TorchFunctionMode):
    def __init__(self, modes: _Modes) -> None:
        super().__init__()
        self.modes = modes

    def __torch_function__(self, func, types, args=(), kwargs=None):
        why = REFUSED_FUNCTIONS.get(func)
        if why is not None:
            self.modes.refuse(getattr(func, "__qualname__", str(func)), why)
        if func is torch.as_tensor and args and not isinstance(args[0], torch.Tensor):
            self.modes.refuse("torch.as_tensor", "a tensor made from Python data: a host->device copy")
        if func is torch.Tensor.__setitem__ and len(args) == 3 and isinstance(args[2], (bool, int, float)):
            self.modes.scalar_setitem += 1
            try:
                return func(*args, **(kwargs or {}))
            finally:
                self.modes.scalar_setitem -= 1
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def capture_guard() -> Iterator[list[str]]:
    """Run the body as CUDA-graph capture would see it: raise `CaptureUnsafe` at the first refused operation; yields
    the list of violations (empty unless code inside swallowed a `CaptureUnsafe`, which leaving the context reports)."""
    modes = _Modes()
    with _Function(modes), _Dispatch(modes):
        yield modes.violations
    if modes.violations:
        raise CaptureUnsafe(f"not CUDA-graph capture-safe (an exception was swallowed): {modes.violations}")
