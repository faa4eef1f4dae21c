"""FP4 weights: flashinfer `trtllm_fp4_block_scale_moe` / `_routed_moe`.

* NVFP4 weights and activations (e2m1 + e4m3 scales per 16, global scales through the output scalars); with
  `per_token_scale` (online NVFP4) GEMM1 is scaled per token and its bf16 output re-quantized per row with per-row
  FP32 scales that scale GEMM2 (trtllm_fused_moe_runner.cu, usePerTokenScalingGemm1/2). The same steps as
  flashinfer's own per-token test reference (tests/moe/utils.py `compute_reference_moe_fp4(use_per_token_activation=
  True)`, read at fb28d72; it is not in the wheels): input = dequant * per-token scale, the activation rounded to
  bf16 and quantized per row with global inverse 1 / (448 * 6), the row scale applied to GEMM2 (before it here,
  after it there: linear, equal up to fp32 rounding); the per-row quantizer is byte-compared with flashinfer's on a GPU
  (tests/gpu/test_nvfp4_quantizers.py).
* MXFP4 weights (e2m1 + UE8M0 scales per 32; gpt-oss, DeepSeek-V4 experts) with MXFP8 activations (the
  intermediate re-quantized bf16 -> MXFP8, flashinfer's test reference) or BF16 activations (intermediate bf16),
  optional fp32 GEMM1/GEMM2 biases in the kernel's row layout, SwiGLU with alpha/beta/clamp (gpt-oss: 1.702, 1, 7).
"""

from __future__ import annotations

import os

import torch

from .. import quant
from ..kernel_api import UNSET
from .common import (
    act_name,
    activate,
    check_local,
    expert_sf,
    gemm,
    gemm1_rows,
    is_gated,
    round_bf16,
    row_inverses,
    run_experts,
    scalar,
    scalar_or_none,
    sf_numel,
    unshuffle_rows,
    unsupported,
)
from .entry_points import entry_points


def _fp4_impl(
    ids,
    weights,
    hidden_states,
    hidden_states_scale,
    gemm1_weights,
    gemm1_weights_scale,
    gemm1_alpha,
    gemm1_beta,
    gemm1_clamp_limit,
    gemm2_weights,
    gemm2_weights_scale,
    output1_scale_scalar,
    output1_scale_gate_scalar,
    output2_scale_scalar,
    intermediate_size,
    local_expert_offset,
    local_num_experts,
    activation_type,
    output,
    valid_hidden_size,
    valid_intermediate_size,
    routing_replay_out,
    gemm1_bias=None,
    gemm2_bias=None,
    per_token_scale=None,
):
    """NVFP4 weights x NVFP4 activations, or MXFP4 weights (UE8M0 scales per 32, picked by the scale count as the
    launcher does) x MXFP8 (e4m3 + linear scales) or BF16 activations, with optional fp32 GEMM biases in the
    kernel's row layout (gpt-oss)."""
    act = int(activation_type)
    for name, t in (("gemm1_weights", gemm1_weights), ("gemm2_weights", gemm2_weights)):
        if t.dtype != torch.uint8:  # deduce_trtllm_gen_tensor_dtype (flashinfer tllm_enums.py)
            raise ValueError(f"{name} must be uint8 (two packed e2m1 per byte), got {t.dtype}")
    for name, t in (("gemm1_weights_scale", gemm1_weights_scale), ("gemm2_weights_scale", gemm2_weights_scale)):
        if t.dtype != torch.float8_e4m3fn:  # "FP4 launcher requires float8 tensor metadata" (flashinfer prepare.py)
            raise ValueError(f"{name} must carry float8_e4m3fn metadata (E4M3 or UE8M0 bytes), got {t.dtype}")
    T = hidden_states.shape[0]
    if hidden_states.dtype == torch.uint8:
        H, acts = hidden_states.shape[1] * 2, "nvfp4"
    elif hidden_states.dtype == torch.float8_e4m3fn:
        H, acts = hidden_states.shape[1], "mxfp8"
    elif hidden_states.dtype == torch.bfloat16:
        H, acts = hidden_states.shape[1], "bf16"
    else:
        raise NotImplementedError(f"hidden_states dtype {hidden_states.dtype} with FP4 weights")
    M = gemm1_rows(intermediate_size, act)
    inter = intermediate_size
    check_local("gemm1_weights", gemm1_weights, local_num_experts)
    check_local("gemm2_weights", gemm2_weights, local_num_experts)
    if tuple(gemm1_weights.shape[1:]) != (M, H // 2):
        raise ValueError(
            f"gemm1_weights shape {tuple(gemm1_weights.shape)} != [E, {M}, {H // 2}] for "
            f"intermediate_size={intermediate_size}, activation {act_name(act)}, hidden {H}"
        )
    if tuple(gemm2_weights.shape[1:]) != (H, inter // 2):
        raise ValueError(f"gemm2_weights shape {tuple(gemm2_weights.shape)} != [E, {H}, {inter // 2}]")
    E = local_num_experts
    mx = gemm1_weights_scale.numel() != sf_numel(E, M, H // 16)  # the launcher's rule: NVFP4 iff numel == K/16
    if mx and gemm1_weights_scale.numel() != sf_numel(E, M, H // 32):
        raise ValueError(
            f"gemm1_weights_scale has {gemm1_weights_scale.numel()} elements: neither NVFP4 (per 16) "
            f"nor MXFP4 (per 32) scales of [E={E}, {M}, {H}]"
        )
    if mx and acts == "nvfp4":
        raise NotImplementedError(
            "MXFP4 weights with NVFP4 activations: the kernel takes MXFP8 or BF16 activations with MXFP4 weights"
        )
    if not mx and acts != "nvfp4":
        raise NotImplementedError(f"NVFP4 weights with {acts} activations (only NVFP4 activations are emulated)")
    block = 32 if mx else 16
    dev = hidden_states.device
    per_token = per_token_scale is not None
    if per_token and (mx or acts != "nvfp4"):
        raise NotImplementedError("per_token_scale with other than NVFP4 weights and NVFP4 activations")
    if acts == "nvfp4":
        if hidden_states_scale is None:
            raise ValueError("NVFP4 hidden_states need hidden_states_scale (linear e4m3 [T, H/16])")
        x = quant.nvfp4_dequantize(hidden_states, hidden_states_scale.reshape(T, H // 16), 1.0)
        if per_token:  # GEMM1 scaled per token (the launcher's usePerTokenScalingGemm1)
            if per_token_scale.dtype != torch.float32 or per_token_scale.numel() != T:
                raise ValueError(
                    f"per_token_scale must be float32 [{T}], got {per_token_scale.dtype} {tuple(per_token_scale.shape)}"
                )
            x = x * per_token_scale.reshape(T, 1)
    elif acts == "mxfp8":
        if hidden_states_scale is None:
            raise ValueError("MXFP8 hidden_states need hidden_states_scale (linear UE8M0 [T, H/32])")
        x = quant.mxfp8_dequantize(hidden_states, hidden_states_scale.reshape(T, H // 32))
    else:
        x = hidden_states.float()
    inv1, inv2 = row_inverses(M, is_gated(act), H, dev)

    def dequant_w(w, s):
        return quant.mxfp4_dequantize(w, s) if mx else quant.nvfp4_dequantize(w, s, 1.0)

    def requant(h):
        if per_token:  # usePerTokenScalingGemm2: GEMM1 writes bf16, re-quantized per row with per-row FP32 scales
            hq, hs, p2 = quant.nvfp4_quantize_per_token(round_bf16(h))
            return quant.nvfp4_dequantize(hq, hs, 1.0) * p2.unsqueeze(-1)
        if acts == "nvfp4":  # FC1 epilogue writes NVFP4 with global scale 1
            hq, hs = quant.nvfp4_quantize(h, 1.0)
            return quant.nvfp4_dequantize(hq, hs, 1.0)
        h = round_bf16(h)
        if acts == "mxfp8":
            hq, hs = quant.mxfp8_quantize(h)
            return quant.mxfp8_dequantize(hq, hs)
        return h

    def expert(e, rows, _w):
        w1 = unshuffle_rows(gemm1_weights[e], inv1)
        s1 = expert_sf(gemm1_weights_scale, e, E, M, H // block).index_select(0, inv1)
        w2 = unshuffle_rows(gemm2_weights[e], inv2)
        s2 = expert_sf(gemm2_weights_scale, e, E, H, inter // block).index_select(0, inv2)
        a1 = gemm(rows, dequant_w(w1, s1))
        if gemm1_bias is not None:
            a1 = a1 + gemm1_bias[e].float().index_select(0, inv1)
        h = activate(
            a1,
            act,
            scalar(output1_scale_gate_scalar, e, 1.0),
            scalar(output1_scale_scalar, e, 1.0),
            alpha=scalar_or_none(gemm1_alpha, e),
            beta=scalar_or_none(gemm1_beta, e),
            limit=scalar_or_none(gemm1_clamp_limit, e),
            valid_intermediate=valid_intermediate_size,
        )
        a2 = gemm(requant(h), dequant_w(w2, s2))
        if gemm2_bias is not None:
            a2 = a2 + gemm2_bias[e].float().index_select(0, inv2)
        return round_bf16(a2 * scalar(output2_scale_scalar, e, 1.0))

    out = run_experts(x, ids, weights, local_expert_offset, local_num_experts, expert, H, None, routing_replay_out)
    if valid_hidden_size is not None:
        out = out[:, :valid_hidden_size]
    if output is not None:  # a narrower caller output takes the first columns (flashinfer: hidden_size_output)
        output.copy_(out[:, : output.shape[1]])
        out = output
    return [out]


def _fp4unsupported(per_token_scale, hidden_states_scale_layout, nvfp4_4over6) -> None:
    """What the FP4 entry points take and the emulator does not model. `nvfp4_4over6` (flashinfer 0.7.4+) only
    changes the per-token NVFP4 requantization: left unset (the kernel reads its environment then, refused here when
    that asks for 4over6) or None it is the standard recipe; a recipe is refused by name."""
    linear = hidden_states_scale_layout is None or int(hidden_states_scale_layout) == 2  # SfLayout.layout_linear
    # per-token: the kernel re-quantizes GEMM1's output with the recipe of FLASHINFER_NVFP4_4OVER6 (read from the
    # environment by the runner); the emulator models the standard recipe only
    env_4over6 = os.environ.get("FLASHINFER_NVFP4_4OVER6") == "1"
    unsupported(
        per_token_scale=("<tensor> with FLASHINFER_NVFP4_4OVER6=1", per_token_scale is None or not env_4over6),
        hidden_states_scale_layout=(hidden_states_scale_layout, linear),
        nvfp4_4over6=(nvfp4_4over6, nvfp4_4over6 is UNSET or nvfp4_4over6 is None),
    )


trtllm_fp4_block_scale_moe, trtllm_fp4_block_scale_routed_moe = entry_points(
    "fp4_block_scale", _fp4_impl, "NVFP4 x NVFP4, MXFP4 x MXFP8 / BF16, biases; returns [output]", _fp4unsupported
)
