"""Scale values against a format's value rule (formats/base.py `LoadRule.value_rule`), for many tensors at once.

Why batched: one RL update writes thousands of scales per layer. On a CUDA tensor every per-tensor verdict read by
Python (`bool(t.all())`, `float(t)`) is a device synchronisation, and every per-tensor reduction a kernel launch
(several microseconds of host time each: a layer's 2,304 scale tensors would cost more than its copy). So
`find_bad` checks the tensors of a device together: those of one rule, dtype and trailing shape are concatenated
(one `torch.cat` / `torch.stack`: a copy of the scales, at memory speed) and reduced once, and one transfer per
device per call reads every group's verdict. CPU tensors are checked one by one (a Python float, or one max over
the bytes: nothing to synchronise, and cheaper than a copy). Only a refusal pays more: the tensors of a group that
failed are checked one by one and the first bad value of a refused tensor is located for the message.

Rules: float values (POSITIVE: finite and > 0 — per-tensor weight, global and input scales; NONNEGATIVE: finite and
>= 0 — block scales), and the bytes of 1-byte scale encodings, read as bytes so that no value conversion hides
anything: e4m3 (NVFP4 block scales: NaN at 0x7F / 0xFF, negative above 0x80) and UE8M0 (MXFP8 / MXFP4 scales: NaN
at 0xFF). An all-zero block scale is valid (a zero block).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from ..formats.load_rules import E4M3_BYTES, FINITE, NONNEGATIVE, POSITIVE, UE8M0_BYTES

#: what each rule asks for, as a refusal's "expected ..."
EXPECTED = {
    POSITIVE: "every value finite and > 0",
    NONNEGATIVE: "every value finite and >= 0",
    E4M3_BYTES: "e4m3 scale bytes that are finite and >= 0 (no 0x7F / 0xFF NaN byte, no negative byte above 0x80)",
    UE8M0_BYTES: "UE8M0 scale bytes without 0xFF (NaN)",
    FINITE: "every value of the source weight finite (it is quantized as it loads: a NaN or inf reaches its scales)",
}
_BYTE_RULES = (E4M3_BYTES, UE8M0_BYTES)
_INF = math.inf
#: device types whose tensors `find_bad` may check one at a time in Python (no device synchronisation to save); every
#: other device's tensors are checked in groups with one read-back per device (tests and benchmarks empty it to run
#: the device path on the CPU)
PER_TENSOR_DEVICES = {"cpu"}
#: at most this many bytes of scales are concatenated for one reduction (a bound on the temporary copy)
GROUP_BYTES = 64 * 2**20
#: CPU tensors of at least this many bytes are reduced one by one (one pass over their bytes, where concatenating
#: them would copy them first: the per-call overhead of a reduction, ~5 us, is small against reading them)
CPU_ALONE_BYTES = 4096


def bad_mask(t: torch.Tensor, rule: str) -> torch.Tensor:
    """Elementwise: True where a value breaks `rule` (on `t`'s device; no synchronisation)."""
    t = t.detach()
    if rule in _BYTE_RULES:
        b = t if t.dtype == torch.uint8 else t.view(torch.uint8)
        if rule == E4M3_BYTES:
            return ((b & 0x7F) == 0x7F) | (b > 0x80)
        return b == 0xFF
    v = t if t.dtype.itemsize >= 4 else t.float()
    if rule == FINITE:
        return ~torch.isfinite(v)
    ok = (v > 0) if rule == POSITIVE else (v >= 0)  # NaN fails both comparisons
    return ~(ok & (v < _INF))


def _scalar_ok(x: float, rule: str) -> bool:
    return math.isfinite(x) and (rule == FINITE or (x > 0 if rule == POSITIVE else x >= 0))


def _bytes(t: torch.Tensor) -> torch.Tensor:
    if t.requires_grad:
        t = t.detach()
    return t if t.dtype is torch.uint8 else t.view(torch.uint8)


def any_bad(t: torch.Tensor, rule: str) -> torch.Tensor:
    """A 0-dim bool on `t`'s device: does `t` hold a value that breaks `rule`? Reductions only (a max / min over
    the bytes or values), no elementwise mask: a uint8 max runs at memory speed, a 4-op mask at a tenth of it
    (measured: 84 MiB of e4m3 scales, 11 ms vs 534 ms on one CPU thread). No synchronisation."""
    if rule == E4M3_BYTES:
        b = _bytes(t)
        # valid bytes: 0x00 - 0x7E, and 0x80 (-0). As unsigned bytes the top exceeds 0x80 exactly when a negative or
        # the 0xFF NaN is present; a 0x7F NaN can hide under a 0x80 there, but as signed bytes 0x7F (127) is the only
        # byte that reaches 127. Two max reductions over views, branch-free: nothing is read back per tensor.
        return (b.amax() > 0x80) | (b.view(torch.int8).amax() == 0x7F)
    if rule == UE8M0_BYTES:
        return _bytes(t).amax() == 0xFF
    v = t.detach()
    lo, hi = v.amin(), v.amax()  # NaN propagates through both
    ok = (lo > -_INF) if rule == FINITE else (lo > 0) if rule == POSITIVE else (lo >= 0)
    return ~(ok & (hi < _INF))


def _cpu_bad(t: torch.Tensor, rule: str) -> bool:
    if rule not in _BYTE_RULES:
        if t.numel() == 1:  # one scale per expert and shard: a Python float is cheapest
            return not _scalar_ok(t.item(), rule)
        lo, hi = torch.aminmax(t.detach() if t.requires_grad else t)  # NaN propagates through both
        return not (_scalar_ok(float(lo), rule) and math.isfinite(float(hi)))
    if rule == E4M3_BYTES:
        b = _bytes(t)
        top = int(b.amax())
        if top == 0x80:  # only then can a 0x7F hide below the top byte: a second pass, rarely taken
            return int(b.view(torch.int8).amax()) == 0x7F
        return top > 0x80 or top == 0x7F
    return bool(any_bad(t, rule))


def _per_tensor(t: torch.Tensor) -> bool:
    return ("cpu" in PER_TENSOR_DEVICES) if t.is_cpu else (t.device.type in PER_TENSOR_DEVICES)


def bad_one(t: torch.Tensor, rule: str) -> bool:
    """Does one tensor hold a value that breaks `rule`? (A write checked on its own, outside a request: one read-back
    when `t` is on a device.)"""
    if not t.numel():
        return False
    if _per_tensor(t):
        return _cpu_bad(t, rule)
    return bool(any_bad(t, rule))


def find_bad(items: Sequence[tuple[torch.Tensor, str]]) -> list[int]:
    """Indices of the (tensor, rule) items holding a value that breaks their rule, in order. At most one device
    synchronisation per device of the tensors (none for CPU tensors), and a few kernel launches per group of tensors
    of one rule, dtype and trailing shape — not per tensor. On the CPU (nothing to synchronise) scalars are read as
    Python floats and tensors of CPU_ALONE_BYTES or more reduced one by one; the smaller ones are checked in groups
    there too (one reduction over a copy of many small scales costs less than a reduction each)."""
    bad: list[int] = []
    groups: dict[tuple, list[tuple[int, torch.Tensor]]] = {}
    cpu_per_tensor = "cpu" in PER_TENSOR_DEVICES
    for i, (t, rule) in enumerate(items):
        n = t.numel()
        if not n:
            continue
        if cpu_per_tensor if t.is_cpu else t.device.type in PER_TENSOR_DEVICES:
            if n == 1 and rule not in _BYTE_RULES:
                if not _scalar_ok(t.item(), rule):
                    bad.append(i)
                continue
            if n * t.element_size() >= CPU_ALONE_BYTES:
                if _cpu_bad(t, rule):
                    bad.append(i)
                continue
        shape = t.shape
        key = (t.device, rule, t.dtype, len(shape), shape[1:])
        group = groups.get(key)
        if group is None:
            groups[key] = [(i, t)]
        else:
            group.append((i, t))
    if not groups:
        return bad
    pending: dict[torch.device, list[tuple[list, str, torch.Tensor]]] = {}
    with torch.no_grad():
        for (dev, rule, _, ndim, _), its in groups.items():
            for part in _parts(its):
                whole = _joined([t for _, t in part], ndim)
                pending.setdefault(dev, []).append((part, rule, any_bad(whole, rule)))
    for dev, flags in pending.items():
        if dev.type == "cpu" and cpu_per_tensor:
            verdicts = [bool(f) for *_, f in flags]  # nothing to synchronise
        else:
            verdicts = torch.stack([f for *_, f in flags]).tolist()  # the one synchronisation of this device
        for (part, rule, _), v in zip(flags, verdicts, strict=True):
            if v:  # a refusal: which of the group's tensors (one read-back each)
                bad.extend(i for i, t in part if bool(any_bad(t, rule)))
    return sorted(bad)


def _joined(ts: list[torch.Tensor], ndim: int) -> torch.Tensor:
    if len(ts) == 1:
        return ts[0]
    join = torch.stack if ndim == 0 else torch.cat
    try:
        return join(ts)
    except (RuntimeError, TypeError, NotImplementedError):  # a 1-byte float dtype cat does not take: its bytes
        return join([_bytes(t) for t in ts])


def _parts(its: list) -> list[list]:
    """A group's tensors in runs of at most GROUP_BYTES (the temporary copy of one reduction)."""
    nbytes = its[0][1].numel() * its[0][1].element_size()
    per = max(1, GROUP_BYTES // max(nbytes, 1))
    return [its[k : k + per] for k in range(0, len(its), per)] if len(its) > per else [its]


def describe_bad(t: torch.Tensor, rule: str) -> str:
    """The first value of `t` that breaks `rule`, with its index, for a refusal (synchronises: refusals only)."""
    mask = bad_mask(t, rule)
    idx = tuple(int(i) for i in mask.nonzero()[0].tolist()) if mask.dim() else ()
    at = f" at {list(idx)}" if idx else ""
    n = int(mask.sum())
    more = f" ({n} such values)" if n > 1 else ""
    x = t.detach()[idx] if idx else t.detach().reshape(())
    if rule in _BYTE_RULES:
        byte = int((x if x.dtype == torch.uint8 else x.view(torch.uint8)).item())
        if byte == 0xFF or (rule == E4M3_BYTES and byte & 0x7F == 0x7F):
            what = f"byte 0x{byte:02x} (NaN in {'e4m3' if rule == E4M3_BYTES else 'UE8M0'})"
        else:
            what = f"byte 0x{byte:02x} (negative in e4m3)"
        return what + at + more
    return f"value {float(x)!r}" + at + more


__all__ = ["EXPECTED", "any_bad", "bad_mask", "bad_one", "describe_bad", "find_bad"]
