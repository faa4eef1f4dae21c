"""Weight-checker comparators for every MoE layer the plugin lays out for the TRT-LLM-Gen kernels.

Why: RL frameworks verify a weight update with SGLang's weight checker (`POST /weights_checker`; slime's
`--check-weight-update-equal` drives it: snapshot, update, compare).
Upstream raises NotImplementedError for trtllm NVFP4 layers before 0.5.17, then compares their bytes without
saying where they differ, and has no comparator for the other trtllm layouts. A failed check must name the expert,
row and column the update got wrong, in the coordinates the trainer knows (the checkpoint's), not in the kernel's
shuffled ones. And a trainer holding checkpoint-layout tensors must be able to compare them with a prepared engine.

Two comparisons of one laid-out weight (with its block scales) as two sides hold it (`ParamSide`):

* `compare_raw`: stored bytes, bit for bit: two snapshots of prepared weights. Chunks of experts that differ are
  then seen through the actual side's inverse layout, so mismatches are reported in checkpoint coordinates.
* `compare_layout`: each side undoes its own layout (the format's own `unprepare_`, applied to a copy, only for the
  experts that side holds prepared) and dequantizes (`WeightFormat.dequantize_param`), so a prepared tensor
  compares with a checkpoint-layout one. An element exceeds when |a - b| > tol_a + tol_b, the per-element
  quantization steps of each side (SGLang's own rule in `compare_weights`).

Both work chunk by chunk over experts (bounded scratch), on CUDA when the data or the machine has it, else on CPU
(never `.cuda()`: SGLang's raw comparator does that and fails on a CPU host).
"""

from __future__ import annotations

import os

import torch

from .checker_reports import Mismatch, Report, checkpoint_coordinates, note, w13_halves
from .checker_sides import (
    ParamSide,
    copy_chunk,
    device_of,
    expert_chunks,
    group_names,
    live_side,
    snapshot_side,
    undo_layout_,
)

ENV_MODE = "SGLANG_TRTLLM_MOE_CHECK_MODE"
MODES = ("auto", "raw", "layout")

_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def check_mode() -> str:
    """How SGLang's checker compares plugin layers: auto (raw when both sides share a layout, else layout), raw,
    layout. Read per comparison from SGLANG_TRTLLM_MOE_CHECK_MODE so a running server can be switched."""
    mode = os.environ.get(ENV_MODE, "auto").strip().lower() or "auto"
    if mode not in MODES:
        raise ValueError(f"{ENV_MODE}={mode!r}: expected one of {MODES}")
    return mode


def _pack(side: ParamSide, chunk: dict[str, torch.Tensor], name: str) -> int:
    """Checkpoint values per stored element of `name` (2 for packed FP4 weights; 1 for block scales)."""
    if name != side.name:
        return 1
    scale = side.scale_name
    w = chunk[name][:1, :1]
    values, _ = side.fmt.dequantize_param(name, w, None if scale is None else chunk[scale][:1, :1])
    return max(1, int(values.shape[-1]) // max(1, int(w.shape[-1])))


def _check_pair(expect: ParamSide, actual: ParamSide, raw: bool) -> None:
    if expect.fmt.name != actual.fmt.name or expect.name != actual.name:
        raise ValueError(f"cannot compare {expect.fmt.name} {expect.name} with {actual.fmt.name} {actual.name}")
    for n in actual.tensors:
        x, y = expect.tensors[n], actual.tensors[n]
        if x.shape != y.shape or (raw and x.dtype != y.dtype):
            raise ValueError(f"{n}: expect {tuple(x.shape)} {x.dtype} vs actual {tuple(y.shape)} {y.dtype}")


def compare_raw(expect: ParamSide, actual: ParamSide, label: str | None = None) -> Report:
    """Bit-exact compare of the stored bytes of the weight and its block scales."""
    _check_pair(expect, actual, raw=True)
    dev = device_of(actual, expect)
    rep = Report(label or actual.name, "raw")
    for s, t in expert_chunks(actual):
        a, b = copy_chunk(actual, s, t, dev), copy_chunk(expect, s, t, dev)
        rep.numel += sum(a[n].numel() for n in actual.compared)
        if all(torch.equal(a[n].view(torch.uint8), b[n].view(torch.uint8)) for n in actual.compared):
            continue
        # The same inverse applied to both sides keeps the byte comparison exact and puts it in checkpoint order.
        undo_layout_(actual, s, a)
        undo_layout_(actual, s, b)
        for n in actual.compared:
            ia, ib = a[n].view(_INT_OF_SIZE[a[n].element_size()]), b[n].view(_INT_OF_SIZE[b[n].element_size()])
            diff = ia != ib
            if not bool(diff.any()):
                continue
            err = (a[n].float() - b[n].float()).abs()[diff]
            rep.max_abs_err = max(rep.max_abs_err, float(err.nan_to_num(nan=float("inf")).max()))
            rep.sum_abs_err += float(err.nan_to_num(nan=0.0).sum())
            note(
                rep,
                n,
                s,
                diff,
                diff,
                ia.long() & (256 ** a[n].element_size() - 1),
                ib.long() & (256 ** b[n].element_size() - 1),
                side=actual,
                pack=_pack(actual, a, n),
                stored_bits=8 * a[n].element_size(),
            )
    return rep


def _dequantized(side: ParamSide, chunk: dict[str, torch.Tensor]):
    scale = side.scale_name
    return side.fmt.dequantize_param(side.name, chunk[side.name], None if scale is None else chunk[scale])


def iter_dequantized(side: ParamSide, device: torch.device | None = None):
    """(first expert, float32 values, tolerance) per chunk of experts, in checkpoint layout."""
    dev = device or device_of(side)
    for s, t in expert_chunks(side):
        values, tol = _dequantized(side, undo_layout_(side, s, copy_chunk(side, s, t, dev)))
        yield s, values, tol


def compare_layout(expect: ParamSide, actual: ParamSide, label: str | None = None) -> Report:
    """Undo each side's layout, dequantize, compare values with the format's per-element tolerance."""
    _check_pair(expect, actual, raw=False)
    dev = device_of(actual, expect)
    rep = Report(label or actual.name, "layout")
    for (s, va, ta), (_, vb, tb) in zip(iter_dequantized(actual, dev), iter_dequantized(expect, dev), strict=True):
        if va.shape != vb.shape:
            raise ValueError(f"{actual.name}: dequantized shapes differ: {tuple(vb.shape)} vs {tuple(va.shape)}")
        rep.numel += va.numel()
        err = (va - vb).abs()
        diff = ~(err == 0)  # NaN differs
        if not bool(diff.any()):
            continue
        exceed = ~(err <= ta + tb)
        rep.max_abs_err = max(rep.max_abs_err, float(err.nan_to_num(nan=float("inf")).max()))
        rep.sum_abs_err += float(err.nan_to_num(nan=0.0).sum())
        pack = max(1, int(va.shape[-1]) // max(1, int(actual.tensors[actual.name].shape[-1])))
        note(rep, actual.name, s, diff, exceed, va, vb, side=actual, pack=pack)
    return rep


def compare(expect: ParamSide, actual: ParamSide, mode: str | None = None, label: str | None = None) -> Report:
    """raw, layout, or auto: raw (strictest) when both sides hold the same experts prepared, else layout."""
    mode = mode or check_mode()
    if mode == "auto":
        same = torch.equal(expect.prepared.cpu(), actual.prepared.cpu()) and all(
            expect.tensors[n].dtype == actual.tensors[n].dtype for n in actual.tensors
        )
        mode = "raw" if same else "layout"
    if mode == "raw":
        return compare_raw(expect, actual, label)
    if mode == "layout":
        return compare_layout(expect, actual, label)
    raise ValueError(f"unknown compare mode {mode!r}: expected one of {MODES}")


# ----------------------------------------------------------------------------------------------------------------
# SGLang's ComparableWeight protocol (iter_chunks / dequantize / repr)
# ----------------------------------------------------------------------------------------------------------------


class TrtllmMoeComparable:
    """What SGLang's WeightChecker holds for a plugin-laid-out weight. `compare_weights` is hooked to call
    `compare` on two of these (and keep the report for the message); without that hook SGLang's own
    `compare_weights` still works on `iter_chunks`: dequantized checkpoint-layout values with tolerances."""

    def __init__(self, side: ParamSide, label: str):
        self.side = side
        self.label = label
        self.report: Report | None = None

    def iter_chunks(self):
        for _, values, tol in iter_dequantized(self.side):
            yield values.reshape(-1), tol.reshape(-1)

    def dequantize(self, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        """The weight's values in checkpoint layout (SGLang's checksum hashes this): every scale applied — block
        scales, then the per-tensor / global ones (`WeightFormat.dequant_scales`), in flashinfer's order — a gated
        w13 as [gate_proj; up_proj] (FusedMoE's own stacking, whatever this layer's loader stored first), cast to
        `dtype`: two engines holding the same weights hash alike whatever their layout or quantization, the same
        weights held unquantized by SGLang alone (a BF16 engine of the dequantized checkpoint) included."""
        side = self.side
        scales = side.fmt.dequant_scales(side.layer)
        group = side.fmt.group_of(side.name) or ("w2" if side.name.startswith("w2") else "w13")
        up_first = group == "w13" and side.fmt.is_gated(side.layer) and w13_halves(side.layer)[0] == "w3"
        out = []
        for s, values, _ in iter_dequantized(side):
            mult = _row_scales(side, scales, s, values.shape[0], values.shape[1])
            v = values if mult is None else values * mult.unsqueeze(-1)
            if up_first:
                half = v.shape[1] // 2
                v = torch.cat([v[:, half:], v[:, :half]], dim=1)
            out.append(v.to(dtype))
        return torch.cat(out, dim=0)

    def __repr__(self) -> str:
        s = self.side
        head = (
            f"trtllm_moe_{s.fmt.name}({'+'.join(s.compared)} shape={tuple(s.tensors[s.name].shape)} "
            f"prepared={int(s.prepared.sum())}/{s.num_experts})"
        )
        return head if self.report is None or self.report.equal else f"{head} {self.report.summary()}"


def _row_scales(side: ParamSide, scales: dict, first: int, n: int, rows: int) -> torch.Tensor | None:
    """`[n, rows]` dequantization scales of experts first..first+n of `side`'s weight, per checkpoint-layout row
    (a gated w13: the half each row belongs to, `w13_halves`), or None (no per-tensor scales)."""
    if not scales:
        return None
    group = side.fmt.group_of(side.name) or ("w2" if side.name.startswith("w2") else "w13")
    if group == "w2":
        return scales["w2"][first : first + n].reshape(n, 1).expand(n, rows)
    if not side.fmt.is_gated(side.layer):
        return scales["w3"][first : first + n].reshape(n, 1).expand(n, rows)
    a, b = (scales[h][first : first + n].reshape(n, 1) for h in w13_halves(side.layer))
    return torch.cat([a.expand(n, rows // 2), b.expand(n, rows - rows // 2)], dim=1)


def compare_comparables(expect: TrtllmMoeComparable, actual: TrtllmMoeComparable, mode: str | None = None):
    """Run `compare` and keep the report on the actual side (SGLang prints its repr when the check fails)."""
    rep = compare(expect.side, actual.side, mode, label=actual.label)
    actual.report = rep
    return rep


__all__ = [
    "ENV_MODE",
    "MODES",
    "check_mode",
    "ParamSide",
    "live_side",
    "snapshot_side",
    "group_names",
    "Mismatch",
    "Report",
    "checkpoint_coordinates",
    "w13_halves",
    "compare_raw",
    "compare_layout",
    "compare",
    "iter_dequantized",
    "TrtllmMoeComparable",
    "compare_comparables",
]
