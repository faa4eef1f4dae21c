"""FP8 block scale: flashinfer `trtllm_fp8_block_scale_moe` / `_routed_moe`.

* DeepSeekFp8 (fp8_quantization_type=1): e4m3 with 128x128 weight scales, 1x128 activation scales, unshuffled.
* MxFp8 (2): e4m3 with one UE8M0 scale byte per 32 values along K (weights: shuffled rows + 128x4 swizzled scales,
  uint8 as the launcher demands; activations: uint8 [T, H/32] linear). GEMM1 -> activation (SwiGLU with optional
  alpha/beta/clamp, or relu2) -> the intermediate to bf16 then MXFP8 (flashinfer's test reference:
  `mxfp8_quantize(act.to(bf16))`) -> GEMM2 -> bf16. No global scales: raw accumulator units are real units.
"""

from __future__ import annotations

import torch

from .. import layouts, quant
from ..kernel_api import ActivationType, Fp8QuantizationType, WeightLayout
from .common import (
    FLT_MIN,
    act_name,
    activate,
    check_local,
    expert_sf,
    gemm,
    is_gated,
    round_bf16,
    row_inverses,
    run_experts,
    scalar_or_none,
    unshuffle_rows,
    unsupported,
)
from .entry_points import entry_points


def _block_requant(x: torch.Tensor) -> torch.Tensor:
    """Per (row, 128-column block) e4m3 with scale max(amax/448, FLT_MIN), dequantized back (activation kernel)."""
    q, s = quant.fp8_group_quantize(x, 128, min_scale=FLT_MIN)
    return quant.fp8_group_dequantize(q, s, 128)


def _fp8_block_impl(
    ids,
    weights,
    hidden_states,
    hidden_states_scale,
    gemm1_weights,
    gemm1_weights_scale,
    gemm2_weights,
    gemm2_weights_scale,
    intermediate_size,
    local_expert_offset,
    local_num_experts,
    use_shuffled_weight,
    weight_layout,
    fp8_quantization_type,
    activation_type,
    gemm1_alpha,
    gemm1_beta,
    gemm1_clamp_limit,
    output,
    valid_hidden_size,
    valid_intermediate_size,
    routing_replay_out,
):
    if int(fp8_quantization_type) == Fp8QuantizationType.MxFp8:
        args = dict(locals())  # this impl's parameters, as MxFp8's takes them
        del args["fp8_quantization_type"]
        return _mxfp8_impl(**args)
    act = int(activation_type)
    unsupported(
        fp8_quantization_type=(fp8_quantization_type, int(fp8_quantization_type) in (1, 2)),
        use_shuffled_weight=(use_shuffled_weight, not use_shuffled_weight),
        weight_layout=(weight_layout, int(weight_layout) in (0, 2)),
        activation_type=(act_name(act), act == ActivationType.Swiglu),
    )
    if hidden_states.dtype != torch.float8_e4m3fn:
        raise NotImplementedError(f"hidden_states dtype {hidden_states.dtype} (only e4m3 activations are emulated)")
    T, H = hidden_states.shape
    M, inter = 2 * intermediate_size, intermediate_size
    if H % 128 or inter % 128:
        raise ValueError(f"DeepSeek FP8 needs hidden ({H}) and intermediate ({inter}) sizes that are multiples of 128")
    check_local("gemm1_weights", gemm1_weights, local_num_experts)
    check_local("gemm2_weights", gemm2_weights, local_num_experts)
    if int(weight_layout) == WeightLayout.BlockMajorK:
        w1_all, w2_all = layouts.from_block_major_k(gemm1_weights), layouts.from_block_major_k(gemm2_weights)
    else:
        w1_all, w2_all = gemm1_weights, gemm2_weights
    if tuple(w1_all.shape[1:]) != (M, H) or tuple(w2_all.shape[1:]) != (H, inter):
        raise ValueError(
            f"weights {tuple(gemm1_weights.shape)}/{tuple(gemm2_weights.shape)} do not hold "
            f"[E, {M}, {H}]/[E, {H}, {inter}] in layout {int(weight_layout)}"
        )
    x = quant.fp8_group_dequantize(hidden_states, hidden_states_scale.t().reshape(T, H // 128), 128)

    def expert(e, rows, _w):
        w1 = quant.fp8_block_dequantize(w1_all[e], gemm1_weights_scale[e])
        w2 = quant.fp8_block_dequantize(w2_all[e], gemm2_weights_scale[e])
        a1 = _block_requant(gemm(rows, w1))  # GEMM1 writes e4m3 + per-128-column dequant scales
        h = activate(
            a1,
            act,
            alpha=scalar_or_none(gemm1_alpha, e),
            beta=scalar_or_none(gemm1_beta, e),
            limit=scalar_or_none(gemm1_clamp_limit, e),
            valid_intermediate=valid_intermediate_size,
        )
        return round_bf16(gemm(_block_requant(h), w2))

    out = run_experts(x, ids, weights, local_expert_offset, local_num_experts, expert, H, None, routing_replay_out)
    if valid_hidden_size is not None:
        out = out[:, :valid_hidden_size]
    if output is not None:
        output.copy_(out)
        out = output
    return out


def _mxfp8_impl(
    ids,
    weights,
    hidden_states,
    hidden_states_scale,
    gemm1_weights,
    gemm1_weights_scale,
    gemm2_weights,
    gemm2_weights_scale,
    intermediate_size,
    local_num_experts,
    local_expert_offset,
    use_shuffled_weight,
    weight_layout,
    activation_type,
    gemm1_alpha,
    gemm1_beta,
    gemm1_clamp_limit,
    output,
    valid_hidden_size,
    valid_intermediate_size,
    routing_replay_out,
):
    act = int(activation_type)
    unsupported(
        use_shuffled_weight=(use_shuffled_weight, bool(use_shuffled_weight)),
        weight_layout=(weight_layout, int(weight_layout) == WeightLayout.MajorK),
        activation_type=(act_name(act), act in (ActivationType.Swiglu, ActivationType.Relu2)),
    )
    if hidden_states.dtype != torch.float8_e4m3fn:
        raise NotImplementedError(f"hidden_states dtype {hidden_states.dtype} (MxFp8 takes e4m3 activations)")
    for name, t in (
        ("hidden_states_scale", hidden_states_scale),
        ("gemm1_weights_scale", gemm1_weights_scale),
        ("gemm2_weights_scale", gemm2_weights_scale),
    ):
        if t is None or t.dtype != torch.uint8:  # the MxFp8 launcher checks this (trtllm_fused_moe_kernel_launcher.cu)
            raise ValueError(f"MxFp8: {name} must be uint8 UE8M0 bytes, got {None if t is None else t.dtype}")
    gated = is_gated(act)
    T, H = hidden_states.shape
    inter = intermediate_size
    M = 2 * inter if gated else inter
    if H % 128 or inter % 128:
        raise ValueError(f"MxFp8 needs hidden ({H}) and intermediate ({inter}) sizes that are multiples of 128")
    check_local("gemm1_weights", gemm1_weights, local_num_experts)
    check_local("gemm2_weights", gemm2_weights, local_num_experts)
    if tuple(gemm1_weights.shape[1:]) != (M, H) or tuple(gemm2_weights.shape[1:]) != (H, inter):
        raise ValueError(
            f"weights {tuple(gemm1_weights.shape)}/{tuple(gemm2_weights.shape)} do not hold "
            f"[E, {M}, {H}]/[E, {H}, {inter}]"
        )
    E = local_num_experts
    inv1, inv2 = row_inverses(M, gated, H, hidden_states.device)
    x = quant.mxfp8_dequantize(hidden_states, hidden_states_scale.reshape(T, H // 32))

    def expert(e, rows, _w):
        w1 = unshuffle_rows(gemm1_weights[e], inv1)
        s1 = expert_sf(gemm1_weights_scale, e, E, M, H // 32).index_select(0, inv1)
        w2 = unshuffle_rows(gemm2_weights[e], inv2)
        s2 = expert_sf(gemm2_weights_scale, e, E, H, inter // 32).index_select(0, inv2)
        a1 = gemm(rows, quant.mxfp8_dequantize(w1, s1))
        h = activate(
            a1,
            act,
            alpha=scalar_or_none(gemm1_alpha, e),
            beta=scalar_or_none(gemm1_beta, e),
            limit=scalar_or_none(gemm1_clamp_limit, e),
            valid_intermediate=valid_intermediate_size,
        )
        hq, hs = quant.mxfp8_quantize(round_bf16(h))
        return round_bf16(gemm(quant.mxfp8_dequantize(hq, hs), quant.mxfp8_dequantize(w2, s2)))

    out = run_experts(x, ids, weights, local_expert_offset, local_num_experts, expert, H, None, routing_replay_out)
    if valid_hidden_size is not None:
        out = out[:, :valid_hidden_size]
    if output is not None:
        output.copy_(out)
        out = output
    return out


trtllm_fp8_block_scale_moe, trtllm_fp8_block_scale_routed_moe = entry_points(
    "fp8_block_scale", _fp8_block_impl, "DeepSeekFp8 MajorK/BlockMajorK unshuffled; MxFp8 shuffled"
)
