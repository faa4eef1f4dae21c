"""Per-half padding of the gated intermediate: the kernel splits GEMM1 output at innerDim/2."""

from __future__ import annotations

import torch


def pad_gated_halves(w13: torch.Tensor, ip: int) -> torch.Tensor:
    """[E, 2I, ...] in [up; gate] -> [E, 2*ip, ...]: up at rows [0, I), gate at [ip, ip+I), zeros elsewhere.

    The kernel splits GEMM1 output at innerDim/2 = ip, so padding only at the end (SGLang `_align_fp4_moe_weights`)
    would read gate rows as up rows whenever I != ip.
    """
    if w13.dim() < 2 or w13.shape[1] % 2:
        raise ValueError(f"gated w13 must be [E, 2I, ...] with an even row count, got shape {tuple(w13.shape)}")
    i = w13.shape[1] // 2
    if ip < i:
        raise ValueError(f"padded intermediate ip={ip} is smaller than I={i} (w13 shape {tuple(w13.shape)})")
    out = w13.new_zeros((w13.shape[0], 2 * ip, *w13.shape[2:]))
    out[:, :i] = w13[:, :i]
    out[:, ip : ip + i] = w13[:, i:]
    return out


def unpad_gated_halves(w13p: torch.Tensor, i: int) -> torch.Tensor:
    """Inverse of `pad_gated_halves`: [E, 2*ip, ...] -> [E, 2I, ...]."""
    if w13p.dim() < 2 or w13p.shape[1] % 2 or w13p.shape[1] // 2 < i:
        raise ValueError(f"padded gated w13 of shape {tuple(w13p.shape)} cannot hold two halves of I={i}")
    ip = w13p.shape[1] // 2
    return torch.cat([w13p[:, :i], w13p[:, ip : ip + i]], dim=1)
