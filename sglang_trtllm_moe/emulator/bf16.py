"""BF16 (weights row-prepared then block-major K, passed as [E, K/64, M, 64]): flashinfer `trtllm_bf16_moe` /
`_routed_moe`."""

from __future__ import annotations

import torch

from .. import layouts
from ..kernel_api import ActivationType, WeightLayout
from .common import (
    activate,
    call_impl,
    check_local,
    common_unsupported,
    gemm1_rows,
    is_gated,
    round_bf16,
    routing,
    row_inverses,
    run_experts,
    scalar_or_none,
    unshuffle_rows,
    unsupported,
)
from .routing import split_routed_input


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
            rows @ w1.t(),
            act,
            alpha=scalar_or_none(gemm1_alpha, e),
            beta=scalar_or_none(gemm1_beta, e),
            limit=scalar_or_none(gemm1_clamp_limit, e),
        )
        return round_bf16(round_bf16(h) @ w2.t())  # the FC1 epilogue writes bf16; GEMM2 output is bf16

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


def trtllm_bf16_moe(
    routing_logits: torch.Tensor,
    routing_bias: torch.Tensor | None,
    hidden_states: torch.Tensor,
    gemm1_weights: torch.Tensor,
    gemm2_weights: torch.Tensor,
    num_experts: int,
    top_k: int,
    n_group: int | None,
    topk_group: int | None,
    intermediate_size: int,
    local_expert_offset: int,
    local_num_experts: int,
    routed_scaling_factor: float | None = None,
    routing_method_type: int = 0,
    use_shuffled_weight: bool = True,
    weight_layout: int = WeightLayout.BlockMajorK,
    do_finalize: bool = True,
    enable_pdl: bool = True,
    tune_max_num_tokens: int = 8192,
    activation_type: int = ActivationType.Swiglu.value,
    norm_topk_prob: bool = True,
    routing_replay_out: torch.Tensor | None = None,
    gemm1_alpha: torch.Tensor | None = None,
    gemm1_beta: torch.Tensor | None = None,
    gemm1_clamp_limit: torch.Tensor | None = None,
    output: torch.Tensor | None = None,
    workspace_buffer: torch.Tensor | None = None,
) -> list[torch.Tensor] | torch.Tensor:
    """Emulates flashinfer `trtllm_bf16_moe`."""
    common_unsupported(do_finalize)
    ids, w = routing(
        routing_logits,
        routing_bias,
        top_k,
        n_group,
        topk_group,
        routed_scaling_factor,
        routing_method_type,
        norm_topk_prob,
    )
    return call_impl(_bf16_impl, ids, w, locals())


def trtllm_bf16_routed_moe(
    topk_ids: torch.Tensor | tuple[torch.Tensor, torch.Tensor],
    hidden_states: torch.Tensor,
    gemm1_weights: torch.Tensor,
    gemm2_weights: torch.Tensor,
    num_experts: int,
    top_k: int,
    n_group: int | None,
    topk_group: int | None,
    intermediate_size: int,
    local_expert_offset: int,
    local_num_experts: int,
    routed_scaling_factor: float | None = None,
    routing_method_type: int = 0,
    use_shuffled_weight: bool = True,
    weight_layout: int = WeightLayout.BlockMajorK,
    do_finalize: bool = True,
    enable_pdl: bool = True,
    gemm1_lora_delta: torch.Tensor | None = None,
    tune_max_num_tokens: int = 8192,
    activation_type: int = ActivationType.Swiglu.value,
    routing_replay_out: torch.Tensor | None = None,
    gemm1_alpha: torch.Tensor | None = None,
    gemm1_beta: torch.Tensor | None = None,
    gemm1_clamp_limit: torch.Tensor | None = None,
    output: torch.Tensor | None = None,
    workspace_buffer: torch.Tensor | None = None,
) -> torch.Tensor | list[torch.Tensor]:
    """Emulates flashinfer `trtllm_bf16_routed_moe`."""
    common_unsupported(do_finalize, gemm1_lora_delta=gemm1_lora_delta)
    ids, w = split_routed_input(topk_ids)
    return call_impl(_bf16_impl, ids, w, locals())
