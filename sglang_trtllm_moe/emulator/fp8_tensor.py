"""FP8 per-tensor (e4m3 weights and activations, per-expert scalars): flashinfer `trtllm_fp8_per_tensor_scale_moe` /
`_routed_moe`."""

from __future__ import annotations

import torch

from .. import quant
from ..kernel_api import ActivationType
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
    scalar,
    unshuffle_rows,
    unsupported,
)
from .routing import split_routed_input


def _fp8_tensor_impl(
    ids,
    weights,
    hidden_states,
    gemm1_weights,
    output1_scales_scalar,
    output1_scales_gate_scalar,
    gemm2_weights,
    output2_scales_scalar,
    intermediate_size,
    local_expert_offset,
    local_num_experts,
    use_routing_scales_on_input,
    activation_type,
    output,
    gemm1_clamp_limit,
    routing_replay_out,
):
    act = int(activation_type)
    unsupported(gemm1_clamp_limit=("<tensor>", gemm1_clamp_limit is None))
    if hidden_states.dtype != torch.float8_e4m3fn:
        raise NotImplementedError(f"hidden_states dtype {hidden_states.dtype} (only e4m3 activations are emulated)")
    T, H = hidden_states.shape
    M, inter = gemm1_rows(intermediate_size, act), intermediate_size
    check_local("gemm1_weights", gemm1_weights, local_num_experts)
    check_local("gemm2_weights", gemm2_weights, local_num_experts)
    if tuple(gemm1_weights.shape[1:]) != (M, H) or tuple(gemm2_weights.shape[1:]) != (H, inter):
        raise ValueError(
            f"weights {tuple(gemm1_weights.shape)}/{tuple(gemm2_weights.shape)} != [E, {M}, {H}]/[E, {H}, {inter}]"
        )
    inv1, inv2 = row_inverses(M, is_gated(act), H, hidden_states.device)

    def expert(e, rows, slot_w):
        w1 = unshuffle_rows(gemm1_weights[e], inv1).float()
        w2 = unshuffle_rows(gemm2_weights[e], inv2).float()
        a1 = rows @ w1.t()
        if use_routing_scales_on_input:  # Llama4: routing weight scales GEMM1 (per-token scale), not the output
            a1 = a1 * slot_w.unsqueeze(1)
        h = activate(a1, act, scalar(output1_scales_gate_scalar, e, 1.0), scalar(output1_scales_scalar, e, 1.0))
        hq = quant.fp8_quantize(h, 1.0)  # re-quantized to e4m3 with scale 1 (output1 scale already holds 1/a2)
        return round_bf16((hq.float() @ w2.t()) * scalar(output2_scales_scalar, e, 1.0))

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
        weights_on_input=bool(use_routing_scales_on_input),
    )


def trtllm_fp8_per_tensor_scale_moe(
    routing_logits: torch.Tensor,
    routing_bias: torch.Tensor | None,
    hidden_states: torch.Tensor,
    gemm1_weights: torch.Tensor,
    output1_scales_scalar: torch.Tensor,
    output1_scales_gate_scalar: torch.Tensor,
    gemm2_weights: torch.Tensor,
    output2_scales_scalar: torch.Tensor,
    num_experts: int,
    top_k: int,
    n_group: int | None,
    topk_group: int | None,
    intermediate_size: int,
    local_expert_offset: int,
    local_num_experts: int,
    routed_scaling_factor: float | None,
    use_routing_scales_on_input: bool,
    routing_method_type: int = 0,
    do_finalize: bool = True,
    enable_pdl: bool | None = None,
    tune_max_num_tokens: int = 8192,
    activation_type: int = ActivationType.Swiglu.value,
    norm_topk_prob: bool = True,
    routing_replay_out: torch.Tensor | None = None,
    output: torch.Tensor | None = None,
    gemm1_clamp_limit: torch.Tensor | None = None,
    workspace_buffer: torch.Tensor | None = None,
) -> list[torch.Tensor] | torch.Tensor:
    """Emulates flashinfer `trtllm_fp8_per_tensor_scale_moe`; returns the output tensor (do_finalize=True)."""
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
    return call_impl(_fp8_tensor_impl, ids, w, locals())


def trtllm_fp8_per_tensor_scale_routed_moe(
    topk_ids: torch.Tensor | tuple[torch.Tensor, torch.Tensor],
    routing_bias: torch.Tensor | None,
    hidden_states: torch.Tensor,
    gemm1_weights: torch.Tensor,
    output1_scales_scalar: torch.Tensor,
    output1_scales_gate_scalar: torch.Tensor,
    gemm2_weights: torch.Tensor,
    output2_scales_scalar: torch.Tensor,
    num_experts: int,
    top_k: int,
    n_group: int | None,
    topk_group: int | None,
    intermediate_size: int,
    local_expert_offset: int,
    local_num_experts: int,
    routed_scaling_factor: float | None,
    use_routing_scales_on_input: bool,
    routing_method_type: int = 0,
    do_finalize: bool = True,
    enable_pdl: bool | None = None,
    tune_max_num_tokens: int = 8192,
    activation_type: int = ActivationType.Swiglu.value,
    routing_replay_out: torch.Tensor | None = None,
    output: torch.Tensor | None = None,
    gemm1_clamp_limit: torch.Tensor | None = None,
    workspace_buffer: torch.Tensor | None = None,
) -> list[torch.Tensor] | torch.Tensor:
    """Emulates flashinfer `trtllm_fp8_per_tensor_scale_routed_moe`."""
    common_unsupported(do_finalize)
    ids, w = split_routed_input(topk_ids)
    return call_impl(_fp8_tensor_impl, ids, w, locals())
