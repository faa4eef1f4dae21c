"""What a weight-checker comparison reports (`Report`, `Mismatch`), and where a differing element sits in the
checkpoint's own coordinates (`checkpoint_coordinates`: the checkpoint name, expert, row and column a trainer knows)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from . import layer_attrs
from .checker_sides import ParamSide

MAX_REPORTED = 8


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


def note(
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
#: formats whose checkpoint names no per-expert projection (gpt-oss: one fused, row-interleaved gate_up_proj)
_NO_PROJECTIONS = ("mxfp4_gptoss",)
#: FusedMoE._weight_loader_impl swaps the w1/w3 shard ids of these quant methods on flashinfer_trtllm (every release;
#: ModelOpt NVFP4 too before 0.5.23: compat.features.NVFP4_W13_SCALE_2_UP_GATE)
_LOADER_SWAPS_W13 = ("Fp8MoEMethod", "UnquantizedFusedMoEMethod", "CompressedTensorsMxInt4MoE")


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
