"""A plain dequantized MoE computed straight from checkpoint tensors — what the fused kernel approximates.

The demo and the benchmark compare the plugin's output against it. It shares no layout code with the plugin:
it reads the checkpoint (ModelOpt NVFP4 names), dequantizes each projection and runs gate/up/down in float32.
"""

from __future__ import annotations

import torch

from .. import quant
from .layers import DOWN, GATE, UP, MoeSpec


def dequant_projection(ck: dict, expert: int, proj: str) -> torch.Tensor:
    base = f"experts.{expert}.{proj}."
    return quant.nvfp4_dequantize(
        ck[base + "weight"], ck[base + "weight_scale"], 1.0 / ck[base + "weight_scale_2"].float()
    )


def input_scales(ck: dict) -> tuple[float, float]:
    """(a1, a2): the largest static input scales of GEMM1 and GEMM2, as SGLang's trtllm path uses them."""
    a1 = max(float(v) for k, v in ck.items() if k.endswith("input_scale") and ".down_proj." not in k)
    a2 = max(float(v) for k, v in ck.items() if k.endswith("input_scale") and ".down_proj." in k)
    return a1, a2


def _fp4_round_trip(t: torch.Tensor, amax_scale: float) -> torch.Tensor:
    packed, sf = quant.nvfp4_quantize(t, 1.0 / amax_scale)
    return quant.nvfp4_dequantize(packed, sf, 1.0 / amax_scale)


def moe(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    ck: dict,
    spec: MoeSpec,
    quantize_like_kernel: bool = False,
) -> torch.Tensor:
    """With `quantize_like_kernel`, the activations and the GEMM1 output are rounded to NVFP4 with the
    checkpoint's static input scales, where the kernel rounds them; otherwise everything stays float32."""
    x = x.float()
    scales = input_scales(ck) if quantize_like_kernel else None
    if scales is not None:
        x = _fp4_round_trip(x, scales[0])
    out = torch.zeros_like(x)
    for e in topk_ids.unique().tolist():
        tok, slot = (topk_ids == e).nonzero(as_tuple=True)
        xe = x[tok]
        if spec.gated:
            h = torch.nn.functional.silu(xe @ dequant_projection(ck, e, GATE).T) * (
                xe @ dequant_projection(ck, e, UP).T
            )
        else:
            h = torch.relu(xe @ dequant_projection(ck, e, UP).T) ** 2
        if scales is not None:
            h = _fp4_round_trip(h, scales[1])
        y = h @ dequant_projection(ck, e, DOWN).T
        out.index_add_(0, tok, y * topk_weights[tok, slot].float()[:, None])
    return out
