"""FP8 per-tensor (e4m3 weights and activations, per-expert scalars): flashinfer `trtllm_fp8_per_tensor_scale_moe` /
`_routed_moe`."""

from __future__ import annotations

import torch

from .. import quant
from .common import (
    activate,
    check_local,
    gemm,
    gemm1_rows,
    is_gated,
    round_bf16,
    row_inverses,
    run_experts,
    scalar,
    unshuffle_rows,
    unsupported,
)
from .entry_points import entry_points


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
        a1 = gemm(rows, w1)
        if use_routing_scales_on_input:  # Llama4: routing weight scales GEMM1 (per-token scale), not the output
            a1 = a1 * slot_w.unsqueeze(1)
        h = activate(a1, act, scalar(output1_scales_gate_scalar, e, 1.0), scalar(output1_scales_scalar, e, 1.0))
        hq = quant.fp8_quantize(h, 1.0)  # re-quantized to e4m3 with scale 1 (output1 scale already holds 1/a2)
        return round_bf16(gemm(hq.float(), w2) * scalar(output2_scales_scalar, e, 1.0))

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


trtllm_fp8_per_tensor_scale_moe, trtllm_fp8_per_tensor_scale_routed_moe = entry_points(
    "fp8_per_tensor_scale", _fp8_tensor_impl, "e4m3 weights and activations, per-expert scalars"
)
