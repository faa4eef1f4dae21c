"""BF16 (weights row-prepared then block-major K, passed as [E, K/64, M, 64]): flashinfer `trtllm_bf16_moe` /
`_routed_moe`."""

from __future__ import annotations

import torch

from .. import layouts
from ..kernel_api import WeightLayout
from .common import (
    activate,
    check_local,
    gemm,
    gemm1_rows,
    is_gated,
    round_bf16,
    row_inverses,
    run_experts,
    scalar_or_none,
    unshuffle_rows,
    unsupported,
)
from .entry_points import entry_points


def _bf16_weights(w: torch.Tensor, rows: int, cols: int, inv: torch.Tensor, e: int) -> torch.Tensor:
    """Expert e of a BlockMajorK bf16 weight ([E, K/64, M, 64], or the flat [E, M, K] storage) -> logical [M, K]."""
    we = w[e]
    if we.dim() == 3:  # [K/bk, M, bk]
        we = layouts.from_block_major_k(we.unsqueeze(0))[0]
    elif we.dim() == 2:  # block-major bytes kept in an [M, K] shaped tensor
        we = layouts.from_block_major_k(layouts.block_major_k_view(w[e : e + 1]))[0]
    if tuple(we.shape) != (rows, cols):
        raise ValueError(f"bf16 weight of shape {tuple(w.shape)} does not hold [{rows}, {cols}] per expert")
    return unshuffle_rows(we, inv).float()


def _bf16_impl(
    ids,
    weights,
    hidden_states,
    gemm1_weights,
    gemm2_weights,
    intermediate_size,
    local_expert_offset,
    local_num_experts,
    use_shuffled_weight,
    weight_layout,
    activation_type,
    gemm1_alpha,
    gemm1_beta,
    gemm1_clamp_limit,
    output,
    routing_replay_out,
):
    act = int(activation_type)
    unsupported(
        weight_layout=(weight_layout, int(weight_layout) == WeightLayout.BlockMajorK),
        use_shuffled_weight=(use_shuffled_weight, bool(use_shuffled_weight)),
    )
    if hidden_states.dtype != torch.bfloat16:
        raise NotImplementedError(f"hidden_states dtype {hidden_states.dtype} (BF16 MoE takes bf16 activations)")
    T, H = hidden_states.shape
    M, inter = gemm1_rows(intermediate_size, act), intermediate_size
    check_local("gemm1_weights", gemm1_weights, local_num_experts)
    check_local("gemm2_weights", gemm2_weights, local_num_experts)
    inv1, inv2 = row_inverses(M, is_gated(act), H, hidden_states.device)

    def expert(e, rows, _w):
        w1 = _bf16_weights(gemm1_weights, M, H, inv1, e)
        w2 = _bf16_weights(gemm2_weights, H, inter, inv2, e)
        h = activate(
            gemm(rows, w1),
            act,
            alpha=scalar_or_none(gemm1_alpha, e),
            beta=scalar_or_none(gemm1_beta, e),
            limit=scalar_or_none(gemm1_clamp_limit, e),
        )
        return round_bf16(gemm(round_bf16(h), w2))  # the FC1 epilogue writes bf16; GEMM2 output is bf16

    return run_experts(
        hidden_states.float(),
        ids,
        weights,
        local_expert_offset,
        local_num_experts,
        expert,
        H,
        output,
        routing_replay_out,
    )


trtllm_bf16_moe, trtllm_bf16_routed_moe = entry_points("bf16", _bf16_impl, "BF16 block-major-K weights")
