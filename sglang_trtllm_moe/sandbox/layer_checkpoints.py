"""Random calibrated checkpoints of one MoE layer, per weight format: what `sandbox/layers.py`'s LayerKinds load, the
tests compare and the benchmarks time. One generator per seed, one draw per projection in order, so every format's
checkpoint of the same seed is built from the same numbers; names below the MoE block, as a safetensors checkpoint
holds them ("experts.3.gate_proj.weight"). Apart from the layer builder because nothing here touches SGLang."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

import torch

from .. import quant
from ..formats import FORMATS
from ..formats.encodings import Calibration, Encoding

if TYPE_CHECKING:
    from .layers import MoeSpec

GATE, UP, DOWN = "gate_proj", "up_proj", "down_proj"


class Maker(Protocol):
    """A random layer checkpoint maker: (spec, seed, experts) -> tensors by name below the MoE block."""

    def __call__(self, spec: MoeSpec, seed: int = 0, experts: Any = None) -> dict[str, torch.Tensor]: ...


def _random_experts(spec: MoeSpec, seed: int, experts, std: float = 0.02, up_factor: float = 1.0):
    """(expert, {projection: float32 weight}) with HF shapes; one generator, one draw per projection in order, so
    every format's checkpoint of the same seed is built from the same numbers (std varies per expert)."""
    g = torch.Generator().manual_seed(seed)
    h, i = spec.hidden, spec.intermediate
    for e in range(spec.num_experts) if experts is None else experts:
        yield (
            e,
            {
                proj: torch.randn((h, i) if proj == DOWN else (i, h), generator=g)
                * (std + 0.01 * (e % 3))
                * (up_factor if proj == UP else 1.0)
                for proj in spec.shards
            },
        )


def random_nvfp4_checkpoint(spec: MoeSpec, seed: int = 0, experts=None) -> dict[str, torch.Tensor]:
    """ModelOpt NVFP4 tensors per expert and projection, as a safetensors checkpoint names them."""
    out: dict[str, torch.Tensor] = {}
    for e, ws in _random_experts(spec, seed, experts):
        for proj, w in ws.items():
            gs = float(448 * 6 / w.abs().max())
            packed, sf = quant.nvfp4_quantize(w, gs)
            base = f"experts.{e}.{proj}."
            out[base + "weight"] = packed
            out[base + "weight_scale"] = sf
            out[base + "weight_scale_2"] = torch.tensor(1.0 / gs, dtype=torch.float32)
            out[base + "input_scale"] = torch.tensor(0.5 + 0.1 * ((e + len(proj)) % 4), dtype=torch.float32)
    return out


def random_ct_nvfp4_checkpoint(
    spec: MoeSpec, seed: int = 0, experts=None, same_gate_up_scale: bool = True
) -> dict[str, torch.Tensor]:
    """Compressed-tensors NVFP4 tensors as llm-compressor names them. Its global scales are *quantize* scales
    (value = e2m1 * e4m3 / global_scale), i.e. the inverses of ModelOpt's weight_scale_2 / input_scale.
    llm-compressor fuses the gate/up global scales; `same_gate_up_scale=False` makes them differ."""
    out: dict[str, torch.Tensor] = {}
    for e, ws in _random_experts(spec, seed, experts):
        fused = float(448 * 6 / max(float(ws[p].abs().max()) for p in spec.shards if p != DOWN))
        in_gs = 1.0 / (0.5 + 0.1 * (e % 4))
        for proj, w in ws.items():
            gs = fused if (proj != DOWN and same_gate_up_scale) else float(448 * 6 / w.abs().max())
            packed, sf = quant.nvfp4_quantize(w, gs)
            base = f"experts.{e}.{proj}."
            out[base + "weight_packed"] = packed
            out[base + "weight_scale"] = sf
            out[base + "weight_global_scale"] = torch.tensor([gs], dtype=torch.float32)
            out[base + "input_global_scale"] = torch.tensor(
                [in_gs if proj != DOWN else in_gs * 0.8], dtype=torch.float32
            )
    return out


def random_fp8_checkpoint(spec: MoeSpec, seed: int = 0, experts=None, equal_gate_up_scale: bool = False):
    """FP8 tensors per expert and projection. Per-tensor (ModelOpt / fp8 static): e4m3 `weight`, fp32 `weight_scale`
    (amax/448 of that projection, so gate and up differ unless `equal_gate_up_scale`) and static `input_scale`
    (one per expert and GEMM, calibrated like a real checkpoint for x ~ N(0, 1): no e4m3 clipping of x or
    of the GEMM1 output, relu2's squared output needing the larger a2).
    Block (DeepSeek): e4m3 `weight` and fp32 `weight_scale_inv` per 128x128 block (a partial last block when I is
    not a multiple of 128, as DeepSeek-style checkpoints store it)."""
    out: dict[str, torch.Tensor] = {}
    for e, ws in _random_experts(spec, seed, experts, up_factor=1.5):
        for proj, w in ws.items():
            base = f"experts.{e}.{proj}."
            if spec.fmt == "fp8_block":
                r, c = w.shape
                wp = torch.zeros(-(-r // quant.FP8_BLOCK) * quant.FP8_BLOCK, -(-c // quant.FP8_BLOCK) * quant.FP8_BLOCK)
                wp[:r, :c] = w
                q, s = quant.fp8_block_quantize(wp)
                out[base + "weight"], out[base + "weight_scale_inv"] = q[:r, :c].contiguous(), s
                continue
            amax = w.abs().max()
            if equal_gate_up_scale and proj != DOWN:
                amax = max(ws[p].abs().max() for p in ws if p != DOWN)
            scale = (amax / quant.FP8_E4M3_MAX).to(torch.float32)
            out[base + "weight"] = quant.fp8_quantize(w, scale)
            out[base + "weight_scale"] = scale
            out[base + "input_scale"] = torch.tensor(
                (0.012 + 0.002 * (e % 3)) if proj != DOWN else (0.004 if spec.gated else 0.05) + 0.001 * (e % 4),
                dtype=torch.float32,
            )
    return out


def random_mxfp4_experts_checkpoint(
    spec: MoeSpec, seed: int = 0, experts=None, scale_dtype: torch.dtype = torch.float8_e8m0fnu
) -> dict[str, torch.Tensor]:
    """DeepSeek-V4-style MXFP4 experts: int8 packed e2m1 `weight` and UE8M0 `weight_scale_inv` as float8_e8m0fnu
    (native DeepSeek-V4), or as the float32 values 2^(b-127) (`scale_dtype=torch.float32`)."""
    out: dict[str, torch.Tensor] = {}
    for e, ws in _random_experts(spec, seed, experts, std=0.05):
        for proj, w in ws.items():
            q, s = quant.mxfp4_quantize(w)
            s = s.view(torch.float8_e8m0fnu)
            out[f"experts.{e}.{proj}.weight"] = q.view(torch.int8)
            out[f"experts.{e}.{proj}.weight_scale_inv"] = (
                s if scale_dtype == torch.float8_e8m0fnu else s.to(scale_dtype)
            )
    return out


def random_gptoss_checkpoint(
    spec: MoeSpec, seed: int = 0, experts=None, bias_dtype: torch.dtype = torch.bfloat16
) -> dict[str, torch.Tensor]:
    """gpt-oss's fused MXFP4 tensors, named by the FusedMoE parameter they load into (what GptOssForCausalLM's
    `_load_mxfp4_experts_weights` passes to `weight_loader(..., expert_id=None)`): w13 rows interleaved
    (2j = gate_j, 2j+1 = up_j), blocks uint8 [E, 2I, H/2], scales uint8 [E, 2I, H/32], biases bf16. The fused
    tensors hold every expert: `experts` is ignored."""
    g = torch.Generator().manual_seed(seed + 1000)
    gate, up, down = [], [], []
    for _, ws in _random_experts(spec, seed, None, std=0.05):
        gate.append(ws[GATE])
        up.append(ws[UP])
        down.append(ws[DOWN])
    w13 = torch.stack([torch.stack([g_, u_], dim=1).reshape(-1, spec.hidden) for g_, u_ in zip(gate, up, strict=True)])
    q13, s13 = quant.mxfp4_quantize(w13)
    q2, s2 = quant.mxfp4_quantize(torch.stack(down))
    return {
        "w13_weight": q13,
        "w13_weight_scale": s13,
        "w13_weight_bias": (torch.randn(spec.num_experts, 2 * spec.intermediate, generator=g) * 0.1).to(bias_dtype),
        "w2_weight": q2,
        "w2_weight_scale": s2,
        "w2_weight_bias": (torch.randn(spec.num_experts, spec.hidden, generator=g) * 0.1).to(bias_dtype),
    }


def encoded_checkpoint(encoding: Encoding) -> Maker:
    """The random calibrated layer checkpoint of a stored encoding, from the encoding alone (`Encoding.quantize` of
    each projection, `Encoding.random_std`): `random_<encoding>_checkpoint` of every encoding without a maker of its
    own above (one with format-specific scales or keyword arguments writes its own)."""

    def make(spec: MoeSpec, seed: int = 0, experts: Any = None) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        for e, ws in _random_experts(spec, seed, experts, std=encoding.random_std):
            gate_up_amax = max(float(w.abs().max()) for p, w in ws.items() if p != DOWN)
            for proj, w in ws.items():
                calib = Calibration(1.0, gate_up_amax, proj == DOWN)
                out.update({f"experts.{e}.{proj}.{k}": t for k, t in encoding.quantize(w, calib).items()})
        return out

    make.__name__ = make.__qualname__ = f"random_{encoding.name}_checkpoint"
    make.__doc__ = f"A random calibrated {encoding.name} layer checkpoint (`encoded_checkpoint`)."
    return make


def __getattr__(name: str) -> Maker:
    """`random_<encoding>_checkpoint` of every registered encoding this module has no maker of its own for (e.g.
    `random_bf16_checkpoint`, `random_mxfp8_checkpoint`): `encoded_checkpoint`."""
    for fmt in FORMATS:
        if name == f"random_{fmt.encoding.name}_checkpoint":
            return encoded_checkpoint(fmt.encoding)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def random_checkpoint(spec: MoeSpec, seed: int = 0, experts=None, **kwargs) -> dict[str, torch.Tensor]:
    """The random calibrated checkpoint of `spec`'s kind of layer (keyword arguments: its maker's)."""
    return spec.kind.checkpoint(spec, seed, experts, **kwargs)


__all__ = [
    "DOWN",
    "GATE",
    "UP",
    "encoded_checkpoint",
    "random_checkpoint",
    "random_ct_nvfp4_checkpoint",
    "random_fp8_checkpoint",
    "random_gptoss_checkpoint",
    "random_mxfp4_experts_checkpoint",
    "random_nvfp4_checkpoint",
]
