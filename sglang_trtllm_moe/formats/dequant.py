"""Shared dequantization for the weight checker: values on a format's quantization grid with their per-element
tolerance (one grid step). `WeightFormat.dequantize_param`'s default is `grid_dequantize`; formats with their own
encodings (NVFP4, MX) override it and fall back to it for their dense or float-scaled parameters."""

from __future__ import annotations

import torch


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
