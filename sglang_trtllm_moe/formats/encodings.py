"""How a format's experts are stored: one `Encoding` per stored encoding, and the helpers formats share.

An `Encoding` is data plus functions, read by everything that used to branch on a quant's name: the weight checker
(`grid`: a checkpoint-layout weight and its block scales as values with one grid step each), the sandbox's
checkpoint writers (`quantize`: one projection's float weight -> its checkpoint tensors; `dequantize`: back;
`quant_config` / `hf_quant_config`: what config.json says; sandbox/checkpoints.py, checkpoint_configs.py and
layer_checkpoints.py), and the runner's family (`kernel`: the TRT-LLM-Gen entry-point family that consumes it, a
format's `kernel`). The math is `quant.py`'s (pure torch, shared with the emulator).

Where an encoding lives: with the one format module that stores it (`nvfp4.MODELOPT_NVFP4`,
`ct_nvfp4.CT_NVFP4_WEIGHTS`, `fp8_block.DEEPSEEK_FP8`, ...); here when several format modules store it (`MXFP4`).
This module is also the one place for helpers formats share (`swiglu_limits`, `block_scaled_intermediate`,
`mxfp4_activations`): format modules import it and `base`, never each other (a variant subclasses its parent).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from .. import quant
from ..compat import features
from .records import SUPPORTED, KernelCall, Support

Tensors = dict[str, torch.Tensor]

#: the runner backend SGLang serves MXFP4 on (gpt-oss and FP4 experts): selection reports it, never switches to it
FLASHINFER_MXFP4 = "flashinfer_mxfp4"
MX_BLOCK = quant.MXFP8_BLOCK
#: DeepSeek FP8's 128x128 scale block (the fp8 block-scale family's K block)
FP8_BLOCK = quant.FP8_BLOCK


@dataclass(frozen=True)
class Calibration:
    """What a checkpoint writer knows of one expert projection besides its weight (sandbox/checkpoints.py measures
    it on a calibration batch, as ModelOpt's max calibration does)."""

    #: amax of the projection's GEMM input (the RMSNorm output for gate / up, the activation output for down)
    input_amax: float
    #: the larger weight amax of the expert's gate and up projections (one fused global scale: llm-compressor)
    gate_up_amax: float
    #: the down projection (GEMM2)
    down: bool


@dataclass(frozen=True)
class Unquantized:
    """What a checkpoint keeps in BF16, in the two spellings quant configs use (sandbox/checkpoint_configs.py)."""

    #: ModelOpt's exclude_modules globs (SGLang matches them per dotted part)
    globs: tuple[str, ...]
    #: Fp8Config's ignored_layers: module paths matched on dotted boundaries
    modules: tuple[str, ...]


def _no_config(unquantized: Unquantized) -> dict | None:
    return None


def _no_hf_config(quantization_config: dict) -> dict | None:
    return None


def grid_dequantize(weight: torch.Tensor, scale: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Checkpoint-layout `[E, M, K]` (+ its float block scales that tile it, or None) -> (float32 values, float32
    per-element tolerance: one step of the weight dtype's grid at each value, SGLang's `_quant_ulp` rule, scaled
    like the values). A dense weight (BF16, FP8 per-tensor), or float block scales (DeepSeek FP8)."""
    q = weight.float()
    finfo = torch.finfo(weight.dtype) if weight.dtype.is_floating_point else None
    if finfo is None:
        tol = torch.zeros_like(q)
    else:
        _, exp = torch.frexp(q.abs())
        tol = torch.exp2((exp - 1).float()).masked_fill(q.abs() < finfo.smallest_normal, finfo.smallest_normal)
        tol = tol * finfo.eps
    if scale is None:
        return q, tol
    s = scale.float()
    bm, bk = -(-q.shape[-2] // s.shape[-2]), -(-q.shape[-1] // s.shape[-1])
    s = s.repeat_interleave(bm, dim=-2).repeat_interleave(bk, dim=-1)[..., : q.shape[-2], : q.shape[-1]]
    return q * s, tol * s


@dataclass(frozen=True, kw_only=False)
class Encoding:
    """One stored encoding of expert weights (see the module's docstring for who reads which field)."""

    #: the sandbox's quant name of a checkpoint stored so (`TinySpec.stored`, `random_<name>_checkpoint`)
    name: str
    #: the kernel family (`kernel_api.FAMILIES`) that consumes it: a format's `kernel` unless it says otherwise
    kernel: str
    #: one expert projection's float weight -> its checkpoint tensors by suffix ("weight", "weight_scale", ...)
    quantize: Callable[[torch.Tensor, Calibration], Tensors]
    #: those tensors (by suffix) -> the float32 weight the kernels compute with
    dequantize: Callable[[Mapping[str, torch.Tensor]], torch.Tensor]
    #: the weight checker's view: checkpoint-layout weight + its block scales -> (values in block-scale units, one
    #: grid step per value); a weight without scales always goes to `grid_dequantize`
    grid: Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]] = grid_dequantize
    #: config.json's `quantization_config` of a checkpoint stored so, given what it keeps in BF16; None: none
    quant_config: Callable[[Unquantized], dict | None] = _no_config
    #: hf_quant_config.json (ModelOpt's legacy file), from `quant_config`'s; None: no such file
    hf_quant_config: Callable[[dict], dict | None] = _no_hf_config
    #: the std of a random layer checkpoint's weights (sandbox/layer_checkpoints.py)
    random_std: float = 0.05


# ---- shared grids (the checker's dequantization of block-scaled encodings) --------------------------------------


def fp4_step(packed: torch.Tensor) -> torch.Tensor:
    """One e2m1 grid step above each code's magnitude, per unpacked value."""
    steps = torch.tensor([0.5, 0.5, 0.5, 0.5, 1.0, 1.0, 2.0, 2.0], device=packed.device)
    u8 = packed.view(torch.uint8)
    codes = torch.stack([u8 & 0x07, (u8 >> 4) & 0x07], dim=-1).flatten(-2)
    return steps[codes.long()]


def e4m3_step(q: torch.Tensor) -> torch.Tensor:
    """One e4m3 grid step at each value (subnormal step below the smallest normal)."""
    finfo = torch.finfo(torch.float8_e4m3fn)
    x = q.float().abs()
    _, exp = torch.frexp(x)
    step = torch.exp2((exp - 1).float()) * finfo.eps
    return torch.where(x < finfo.smallest_normal, torch.full_like(x, finfo.smallest_normal * finfo.eps), step)


def ue8m0_tolerance(values_tol: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return values_tol * quant.ue8m0_to_float(scale).repeat_interleave(MX_BLOCK, dim=-1)


def nvfp4_grid(weight: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed e2m1 `[E, M, K/2]` x linear e4m3 `[E, M, K/16]` -> `[E, M, K]` (global scale excluded: a scalar
    parameter). Tolerance: the e2m1 grid step above each code's magnitude, times its block scale. The negative-zero
    code dequantizes to +0.0, as flashinfer's CPU dequantizer gives it (the checker's checksum hashes the bytes)."""
    values = quant.nvfp4_dequantize(weight, scale, 1.0) + 0.0
    sf = scale.view(torch.float8_e4m3fn).float() if scale.dtype == torch.uint8 else scale.float()
    return values, fp4_step(weight) * sf.repeat_interleave(quant.NVFP4_BLOCK, dim=-1)


def mxfp8_grid(weight: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """e4m3 `[E, M, K]` x linear UE8M0 bytes `[E, M, K/32]` -> values and one e4m3 step per value."""
    return quant.mxfp8_dequantize(weight, scale), ue8m0_tolerance(e4m3_step(weight), scale)


def mxfp4_grid(weight: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed e2m1 `[E, M, K/2]` x linear UE8M0 `[E, M, K/32]` -> values and one e2m1 step per value."""
    return quant.mxfp4_dequantize(weight, scale), ue8m0_tolerance(fp4_step(weight), scale)


# ---- shared config writers ------------------------------------------------------------------------------------------


def modelopt_config(algo: str, group_size: int | None = None) -> Callable[[Unquantized], dict]:
    """A ModelOpt checkpoint's `quantization_config` (`quant_algo` `algo`), its BF16 modules in `ignore`."""

    def make(unquantized: Unquantized) -> dict:
        cfg: dict[str, Any] = {
            "quant_method": "modelopt",
            "quant_algo": algo,
            "ignore": list(unquantized.globs),
            "producer": {"name": "modelopt", "version": "0.29.0"},
        }
        if group_size is not None:
            cfg["group_size"] = group_size
        return cfg

    return make


def modelopt_hf_config(qc: dict) -> dict:
    """ModelOpt's hf_quant_config.json (the legacy file SGLang still reads first for ModelOpt checkpoints)."""
    body = {"quant_algo": qc["quant_algo"], "kv_cache_quant_algo": None, "exclude_modules": qc["ignore"]}
    if "group_size" in qc:
        body["group_size"] = qc["group_size"]
    return {"producer": qc["producer"], "quantization": body}


def compressed_tensors_config(template: Mapping[str, Any]) -> Callable[[Unquantized], dict]:
    """An llm-compressor checkpoint's config (`template`), its BF16 modules as "re:" patterns (Kimi-K2's style)."""

    def make(unquantized: Unquantized) -> dict:
        return {
            **template,
            "quantization_status": "compressed",
            "ignore": [("re:.*" + i.replace(".", r"\.").replace("*", ".*") + ".*") for i in unquantized.globs],
        }

    return make


# ---- encodings stored by more than one format module ----------------------------------------------------------------


def _mxfp4_quantize(w: torch.Tensor, calib: Calibration) -> Tensors:
    q, s = quant.mxfp4_quantize(w)
    return {"weight": q.view(torch.int8), "weight_scale_inv": s.view(torch.float8_e8m0fnu)}


#: MXFP4: packed e2m1, a UE8M0 scale per 32 (DeepSeek-V4's FP4 experts; gpt-oss stores it fused, all experts at once)
MXFP4 = Encoding(
    "mxfp4",
    "fp4_block_scale",
    _mxfp4_quantize,
    lambda t: quant.mxfp4_dequantize(t["weight"], t["weight_scale_inv"]),
    grid=mxfp4_grid,
)


# ---- helpers shared between formats' kernel arguments and serving rules ---------------------------------------------


def swiglu_limits(quant_info: Any) -> dict:  # SGLang QuantInfo (no type information)
    """The block-scale kernel family's SwiGLU alpha / beta / clamp arguments from SGLang's FP8 QuantInfo (None where
    this release's QuantInfo carries none: features.FP8_QUANT_INFO_SWIGLU)."""
    names = ("gemm1_alpha", "gemm1_beta", "gemm1_clamp_limit")
    if not features.FP8_QUANT_INFO_SWIGLU.present():
        return dict.fromkeys(names)
    return {n: getattr(quant_info, n) for n in names}


def block_scaled_intermediate(per_rank: int) -> Support:
    """`supports_intermediate` of the fp8 block-scale kernel family (DeepSeek FP8, MXFP8): the checkpoint's per-rank
    share of the intermediate must already be a multiple of the 128-wide scale block (a TP split inside a block
    would cut its scale; selection does not pad these)."""
    if per_rank % FP8_BLOCK:
        return False, f"intermediate per rank {per_rank} is not a multiple of the 128x128 FP8 scale block"
    return SUPPORTED


def mxfp4_activations(call: KernelCall, precision: str, hidden: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(hidden_states, hidden_states_scale) for the MXFP4 kernels: "default" = MXFP8 with a linear [T, H/32] scale
    viewed as float8_e4m3fn (SGLang's views), "bf16" = the activations zero-padded to the kernel's hidden size."""
    x = call.hidden
    if precision == "bf16":
        if x.shape[-1] != hidden:
            x = torch.nn.functional.pad(x, (0, hidden - x.shape[-1]))
        return x, None
    if precision != "default":
        raise NotImplementedError(f"flashinfer_mxfp4_moe_precision {precision!r} (default = MXFP8, or bf16)")
    if call.hidden_scale is not None:
        hs, sf = x, call.hidden_scale
    elif call.on_kernel:
        if features.MXFP8_QUANTIZE_IN_FP8_UTILS.present():
            from sglang.srt.layers.quantization.fp8_utils import flashinfer_mxfp8_quantize as mxq
        else:
            from flashinfer import mxfp8_quantize as mxq
        hs, sf = mxq(x, False, alignment=hidden)
    else:
        if x.shape[-1] != hidden:
            x = torch.nn.functional.pad(x, (0, hidden - x.shape[-1]))
        hs, sf = quant.mxfp8_quantize(x)
    return hs, sf.view(torch.uint8).view(torch.float8_e4m3fn).reshape(hs.shape[0], -1)


__all__ = [
    "FLASHINFER_MXFP4",
    "FP8_BLOCK",
    "MXFP4",
    "MX_BLOCK",
    "Calibration",
    "Encoding",
    "Tensors",
    "Unquantized",
    "block_scaled_intermediate",
    "compressed_tensors_config",
    "e4m3_step",
    "fp4_step",
    "grid_dequantize",
    "modelopt_config",
    "modelopt_hf_config",
    "mxfp4_activations",
    "mxfp4_grid",
    "mxfp8_grid",
    "nvfp4_grid",
    "swiglu_limits",
    "ue8m0_tolerance",
]
