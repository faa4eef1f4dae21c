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
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch

from . import layer_attrs
from .formats.base import WeightFormat

ENV_MODE = "SGLANG_TRTLLM_MOE_CHECK_MODE"
MODES = ("auto", "raw", "layout")
#: scratch per side and chunk of experts (SGLang's checker chunks at 64 Mi elements)
CHUNK_BYTES = 64 << 20
MAX_REPORTED = 8

_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def check_mode() -> str:
    """How SGLang's checker compares plugin layers: auto (raw when both sides share a layout, else layout), raw,
    layout. Read per comparison from SGLANG_TRTLLM_MOE_CHECK_MODE so a running server can be switched."""
    mode = os.environ.get(ENV_MODE, "auto").strip().lower() or "auto"
    if mode not in MODES:
        raise ValueError(f"{ENV_MODE}={mode!r}: expected one of {MODES}")
    return mode


# ----------------------------------------------------------------------------------------------------------------
# One parameter as one side holds it
# ----------------------------------------------------------------------------------------------------------------


@dataclass
class ParamSide:
    """A laid-out weight of a managed layer as one side holds it: the group's tensors and which experts are in
    kernel layout. The layer supplies geometry (gated, row maps) and nothing else: its own tensors are not read."""

    layer: Any
    fmt: WeightFormat
    name: str
    #: every laid-out parameter of the weight's group (the gated row map mixes them), full expert range
    tensors: dict[str, torch.Tensor]
    #: bool[E]: experts whose bytes are in kernel layout on this side
    prepared: torch.Tensor

    @property
    def group(self) -> str:
        g = self.fmt.group_of(self.name)
        if g is None:  # live_side only builds sides of laid-out parameters
            raise ValueError(f"{self.name} is not a laid-out parameter of {self.fmt.name}")
        return g

    @property
    def scale_name(self) -> str | None:
        return self.fmt.scale_of(self.name)

    @property
    def compared(self) -> tuple[str, ...]:
        """The parameters this entry covers: the weight and its block scales."""
        return (self.name,) if self.scale_name is None else (self.name, self.scale_name)

    @property
    def num_experts(self) -> int:
        return self.tensors[self.name].shape[0]


def group_names(fmt: WeightFormat, name: str) -> tuple[str, ...]:
    g = fmt.group_of(name)
    return tuple(p.name for p in fmt.params if p.group == g)


def _as_laid_out(fmt: WeightFormat, name: str, t: torch.Tensor) -> torch.Tensor:
    """`t` (a parameter's data or a snapshot of it) seen as [experts, rows, cols], as the format's layouts work on
    it (BF16 shows prepared parameters 4-D)."""
    from types import SimpleNamespace

    p = next(q for q in fmt.params if q.name == name)
    return fmt.tensor(SimpleNamespace(**{name: t}), p)


def live_side(layer, name: str) -> ParamSide:
    """The layer's own parameters and layout state right now."""
    from .layer_state import layer_name, state_of

    st = state_of(layer)
    if st is None:
        raise ValueError(f"{layer_name(layer)} is not managed by sglang-trtllm-moe: no TRT-LLM layout to undo")
    group = st.fmt.group_of(name)
    if group is None:
        raise ValueError(f"{layer_name(layer)}: {name} is not a laid-out parameter of {st.fmt.name}")
    with st.lock:  # the mask and the bytes it describes, as one writer-free moment
        tensors = {n: _as_laid_out(st.fmt, n, getattr(layer, n).data) for n in group_names(st.fmt, name)}
        return ParamSide(layer, st.fmt, name, tensors, st.prepared[group].clone())


def snapshot_side(
    layer, name: str, tensors: dict[str, torch.Tensor], prepared: torch.Tensor | None = None, checkpoint: bool = False
) -> ParamSide:
    """Other tensors of the same layer (a snapshot, or checkpoint-layout tensors with `checkpoint=True`)."""
    live = live_side(layer, name)
    missing = [n for n in live.tensors if n not in tensors]
    if missing:
        raise ValueError(f"{name}: the snapshot lacks {missing} (the whole group {tuple(live.tensors)} is needed)")
    if checkpoint:
        prepared = torch.zeros_like(live.prepared)
    elif prepared is None:
        prepared = live.prepared
    return ParamSide(
        layer,
        live.fmt,
        name,
        {n: _as_laid_out(live.fmt, n, tensors[n]) for n in live.tensors},
        prepared.clone().bool().cpu(),
    )


class _Shadow:
    """The layer, with its group's parameters replaced by our copies: lets the format's own `unprepare_` (the
    exact inverse the plugin uses for weight updates) run on scratch instead of the live weights."""

    def __init__(self, layer, tensors: dict[str, torch.Tensor]):
        self.__dict__["_layer"] = layer
        self.__dict__["_tensors"] = tensors

    def __getattr__(self, name):
        t = self.__dict__["_tensors"].get(name)
        return t if t is not None else getattr(self.__dict__["_layer"], name)


def _undo_layout_(side: ParamSide, s: int, chunk: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """In place on copies of experts [s, s+k): back to checkpoint layout where `side` holds them prepared."""
    k = next(iter(chunk.values())).shape[0]
    ids = side.prepared[s : s + k].nonzero().flatten().tolist()
    if ids:
        side.fmt.unprepare_(_Shadow(side.layer, chunk), side.group, ids)
    return chunk


def _copy_chunk(side: ParamSide, s: int, t: int, device: torch.device) -> dict[str, torch.Tensor]:
    return {n: x[s:t].to(device=device, copy=True).contiguous() for n, x in side.tensors.items()}


def _device(*sides: ParamSide) -> torch.device:
    for side in sides:
        for x in side.tensors.values():
            if x.is_cuda:
                return x.device
    if torch.cuda.is_available():  # a CPU snapshot on a GPU host: compare on the GPU, like SGLang does
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _expert_chunks(side: ParamSide) -> list[tuple[int, int]]:
    e = side.num_experts
    per_expert = sum(x[0].numel() * max(x.element_size(), 4) for x in side.tensors.values()) if e else 1
    k = max(1, CHUNK_BYTES // max(1, per_expert))
    return [(s, min(s + k, e)) for s in range(0, e, k)]


# ----------------------------------------------------------------------------------------------------------------
# Reports
# ----------------------------------------------------------------------------------------------------------------


class Mismatch(NamedTuple):
    """One differing element: (param, expert, row, col) in SGLang's parameter in checkpoint layout (local expert,
    w13 rows as SGLang's loader stacks the halves; col in stored elements for raw, in values for layout), and
    `where`: the same element in the checkpoint's own coordinates (`checkpoint_coordinates`)."""

    param: str
    expert: int
    row: int
    col: int
    expect: float | int
    actual: float | int
    exceeds: bool = True
    where: str = ""


@dataclass
class Report:
    """Outcome of one comparison. Coordinates are the checkpoint layout of the parameter: [expert, row, col] with
    col in stored elements for raw (a packed-FP4 byte holds columns 2c and 2c+1) and in values for layout."""

    name: str
    mode: str
    numel: int = 0
    num_mismatch: int = 0
    num_exceed: int = 0
    max_abs_err: float = 0.0
    sum_abs_err: float = 0.0
    first: list[Mismatch] = field(default_factory=list)
    #: per parameter and expert: how many elements differ
    per_expert: dict[tuple[str, int], int] = field(default_factory=dict)

    @property
    def equal(self) -> bool:
        return self.num_mismatch == 0

    @property
    def mean_abs_err(self) -> float:
        return self.sum_abs_err / max(self.numel, 1)

    @property
    def experts(self) -> list[int]:
        return sorted({e for _, e in self.per_expert})

    def summary(self) -> str:
        if self.equal:
            return f"{self.name}: equal ({self.mode}, {self.numel} elements)"
        fmt = (lambda v: f"0x{v:x}") if self.mode == "raw" else (lambda v: f"{v:.6g}")
        where = "; ".join(
            (f"{m.where} = " if m.where else "")
            + f"{m.param}[expert {m.expert}, row {m.row}, col {m.col}] expect {fmt(m.expect)} actual {fmt(m.actual)}"
            + ("" if m.exceeds or self.mode == "raw" else " (within tolerance)")
            for m in self.first
        )
        return (
            f"{self.name}: {self.num_mismatch} of {self.numel} elements differ ({self.mode} compare, "
            f"{self.num_exceed} beyond tolerance) in experts {self.experts}; first, in checkpoint coordinates: {where}"
        )

    __str__ = summary


def _note(
    report: Report,
    param: str,
    s: int,
    diff: torch.Tensor,
    exceed: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    side: ParamSide | None = None,
    pack: int = 1,
    stored_bits: int = 8,
) -> None:
    """Count and locate the differing elements of one chunk (diff/exceed are bool [k, M, K]). `pack`: checkpoint
    values per stored element of `param` (2 for packed FP4 bytes) of `stored_bits` bits, for the checkpoint
    coordinates."""
    n = int(diff.sum())
    if not n:
        return
    if diff.dim() == 2:  # [k, M] (a bias): one column
        diff, exceed, a, b = (x.unsqueeze(-1) for x in (diff, exceed, a, b))
    report.num_mismatch += n
    report.num_exceed += int(exceed.sum())
    for e, c in enumerate(diff.flatten(1).sum(1).tolist()):
        if c:
            report.per_expert[(param, s + e)] = c
    room = MAX_REPORTED - len(report.first)
    if room > 0:
        raw = report.mode == "raw"
        for e, r, c in diff.nonzero()[:room].tolist():
            va, vb = a[e, r, c].item(), b[e, r, c].item()
            if side is None:
                where = ""
            elif raw:
                # a stored element holding `pack` values: the values whose bits differ (low bits = even value)
                width = stored_bits // pack if pack > 1 else 0
                mask = (1 << width) - 1 if width else 0
                bits = int(va) ^ int(vb)  # raw compares integer views of the stored elements
                values = [c * pack + i for i in range(pack) if not width or (bits >> (i * width)) & mask]
                where = checkpoint_coordinates(side, param, s + e, r, c, pack, values)
            else:
                where = checkpoint_coordinates(side, param, s + e, r, c // pack, pack, [c])
            report.first.append(Mismatch(param, s + e, r, c, vb, va, bool(exceed[e, r, c]), where))


# ----------------------------------------------------------------------------------------------------------------
# Checkpoint coordinates
# ----------------------------------------------------------------------------------------------------------------

#: checkpoint projection names per SGLang shard id (non-gated GEMM1 is named up_proj: Nemotron-H's convention, the
#: same as the update validation's), and Mixtral's own names (its checkpoints say w1 / w2 / w3)
_PROJECTION = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
_MIXTRAL_PROJECTION = {"w1": "w1", "w3": "w3", "w2": "w2"}
#: FusedMoE._weight_loader_impl swaps the w1/w3 shard ids of these quant methods on flashinfer_trtllm (every release;
#: ModelOpt NVFP4 too before 0.5.23: compat.features.NVFP4_W13_SCALE_2_UP_GATE)
_LOADER_SWAPS_W13 = ("Fp8MoEMethod", "UnquantizedFusedMoEMethod", "CompressedTensorsMxInt4MoE")
#: formats whose checkpoint names no per-expert projection (gpt-oss: one fused, row-interleaved gate_up_proj)
_NO_PROJECTIONS = ("mxfp4_gptoss",)


def w13_halves(layer) -> tuple[str, str]:
    """The shard ids (w1 = gate_proj, w3 = up_proj) of the first and second half of a gated w13 as SGLang's loader
    stacks it: `FusedMoE._load_w13` puts w1 first unless the weight-layout method has `load_up_proj_weight_first`,
    after `_weight_loader_impl` swapped the w1/w3 ids of some methods on flashinfer_trtllm (tests/test_checker_
    coordinates.py checks this against SGLang's own loader for every format, on every release)."""
    from .compat import features

    method = getattr(layer, "weight_load_method", None) or getattr(layer, "quant_method", None)
    up_first = bool(getattr(method, "load_up_proj_weight_first", False))
    names = {c.__name__ for c in type(method).__mro__}
    swapped = bool(names & set(_LOADER_SWAPS_W13)) or (
        "ModelOptNvFp4FusedMoEMethod" in names and features.NVFP4_W13_SCALE_2_UP_GATE.present()
    )
    if swapped and getattr(layer, "use_flashinfer_trtllm_moe", False):
        up_first = not up_first
    return ("w3", "w1") if up_first else ("w1", "w3")


def checkpoint_coordinates(side: ParamSide, param: str, expert: int, row: int, col: int, pack: int, values) -> str:
    """One element of a laid-out parameter (local expert, row and stored column of SGLang's checkpoint-layout
    parameter) as the checkpoint names it: `<layer prefix>.<expert>.<gate_proj|up_proj|down_proj>.<suffix>[row, col]`
    with the checkpoint's expert id (EP), row (which half of a gated w13, TP rank offset) and column of that tensor
    (TP rank offset of w2), plus the value columns where one stored element packs several (FP4). "" where the
    checkpoint has no per-expert projections."""
    layer, fmt = side.layer, side.fmt
    if fmt.name in _NO_PROJECTIONS:
        return ""
    from .layer_state import layer_name

    prefix = getattr(layer, layer_attrs.PREFIX, None) or layer_name(layer)
    group = fmt.group_of(param) or ("w2" if param.startswith("w2") else "w13")
    suffix = param.split("_", 1)[1] if "_" in param else param
    tp = int(getattr(layer, "moe_tp_size", 1) or 1)
    tp_rank = int(getattr(layer, "moe_tp_rank", 0) or 0)
    presharded = bool(getattr(layer, "use_presharded_weights", False))
    rows = int(side.tensors[param].shape[1]) if param in side.tensors else 0
    full = getattr(layer, layer_attrs.INTERMEDIATE, None)
    if group == "w13":
        gated = fmt.is_gated(layer)
        half = rows // 2 if gated else rows
        shard = w13_halves(layer)[row // half] if gated and half else "w1"
        if not gated:
            shard = "w3"  # one GEMM1 projection: up_proj in the checkpoint
        r = row % half if half else row
        per_rank = (int(full) // tp if full and not presharded else half) if tp > 1 else half
        offset = tp_rank * per_rank if tp > 1 and not presharded else 0
        pad = r >= per_rank
        row_txt, col_txt, values_txt = f"{r + offset}", f"{col}", values
    else:
        shard, pad = "w2", False
        per_rank_cols = (int(full) // tp if full and not presharded else 0) if tp > 1 else 0
        col_offset = tp_rank * per_rank_cols
        row_txt, col_txt = f"{row}", f"{col + col_offset // pack}"
        values_txt = [v + col_offset for v in values]
    names = _MIXTRAL_PROJECTION if "block_sparse_moe" in prefix else _PROJECTION
    ep = int(getattr(layer, "moe_ep_size", 1) or 1)
    expert_id = expert + int(getattr(layer, "moe_ep_rank", 0) or 0) * int(getattr(layer, "num_local_experts", 0) or 0)
    out = f"{prefix}.{expert_id if ep > 1 else expert}.{names[shard]}.{suffix}[{row_txt}, {col_txt}]"
    if pack > 1 and "scale" not in param:
        out += f" (packed: value{'s' if len(values_txt) > 1 else ''} {', '.join(map(str, values_txt))})"
    if pad:
        out += " (a padding row: beyond the checkpoint's intermediate size)"
    return out


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
    dev = _device(actual, expect)
    rep = Report(label or actual.name, "raw")
    for s, t in _expert_chunks(actual):
        a, b = _copy_chunk(actual, s, t, dev), _copy_chunk(expect, s, t, dev)
        rep.numel += sum(a[n].numel() for n in actual.compared)
        if all(torch.equal(a[n].view(torch.uint8), b[n].view(torch.uint8)) for n in actual.compared):
            continue
        # The same inverse applied to both sides keeps the byte comparison exact and puts it in checkpoint order.
        _undo_layout_(actual, s, a)
        _undo_layout_(actual, s, b)
        for n in actual.compared:
            ia, ib = a[n].view(_INT_OF_SIZE[a[n].element_size()]), b[n].view(_INT_OF_SIZE[b[n].element_size()])
            diff = ia != ib
            if not bool(diff.any()):
                continue
            err = (a[n].float() - b[n].float()).abs()[diff]
            rep.max_abs_err = max(rep.max_abs_err, float(err.nan_to_num(nan=float("inf")).max()))
            rep.sum_abs_err += float(err.nan_to_num(nan=0.0).sum())
            _note(
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
    dev = device or _device(side)
    for s, t in _expert_chunks(side):
        values, tol = _dequantized(side, _undo_layout_(side, s, _copy_chunk(side, s, t, dev)))
        yield s, values, tol


def compare_layout(expect: ParamSide, actual: ParamSide, label: str | None = None) -> Report:
    """Undo each side's layout, dequantize, compare values with the format's per-element tolerance."""
    _check_pair(expect, actual, raw=False)
    dev = _device(actual, expect)
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
        _note(rep, actual.name, s, diff, exceed, va, vb, side=actual, pack=pack)
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
