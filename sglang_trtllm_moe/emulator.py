"""What FlashInfer's TRT-LLM-Gen fused MoE kernels compute, in torch, from the same prepared bytes the kernels read.

Why: the kernels only run on Blackwell (SM100). To prove on CPU (or any GPU) that the plugin's prepared weights are
right, the emulator takes the *prepared* tensors exactly as the kernel would (shuffled rows, gated interleave, 128x4
swizzled scales, block-major K), undoes the layouts with `layouts`' inverses, and runs the per-format math of the
kernels in float32 (notes: ../shared/reference/flashinfer-trtllm-moe.md §1-§4; CUDA sources shipped in the wheel).
The public functions have flashinfer 0.7.2's exact signatures, so `runner` can swap one for the other.

Structure shared by every format:
  route -> group the (token, slot) pairs by local expert -> per expert that received tokens: dequantize its weights,
  GEMM1 (fp32), activation (+ the format's scalars), re-quantize the intermediate like the kernel, GEMM2 (fp32),
  round to bf16 (the GEMM2 output dtype) -> finalize: out[t] = sum_k w[t,k] * y[t,k] in fp32, in slot order, to bf16.
Slots routed to experts outside [local_expert_offset, local_expert_offset + local_num_experts) contribute nothing.

Not bit-exact by design: the kernels' fused epilogues live in cubins (reciprocal approximations, accumulation order);
expect FP4/FP8-level agreement, see tests/test_emulator.py for the tolerances. Options the emulator does not model
raise NotImplementedError naming the option, never silently compute something else.
"""

from __future__ import annotations

import enum
from typing import Callable, List, Optional, Tuple, Union

import torch

from . import layouts, quant
from .routing import route, split_routed_input


class ActivationType(enum.IntEnum):
    """Same values as `flashinfer.tllm_enums.ActivationType` (checked by tests), without importing flashinfer."""

    Gelu = 0
    Relu = 1
    Silu = 2
    Swiglu = 3
    Geglu = 4
    SwigluBias = 5
    Relu2 = 6
    SwigluStep = 7
    GegluTanh = 8
    Identity = 9
    Situ = 10
    InvalidType = 11
    ClampedRelu2 = 12


class WeightLayout(enum.IntEnum):
    MajorK = 0
    MajorMn = 1
    BlockMajorK = 2


class Fp8QuantizationType(enum.IntEnum):
    NoneFp8 = 0
    DeepSeekFp8 = 1
    MxFp8 = 2
    PerTensorFp8 = 3
    PerChannelFp8 = 4


GATED_ACTIVATIONS = {ActivationType.Swiglu, ActivationType.Geglu, ActivationType.GegluTanh}
NON_GATED_ACTIVATIONS = {ActivationType.Gelu, ActivationType.Relu, ActivationType.Silu, ActivationType.Relu2,
                         ActivationType.Identity}
_FLT_MIN = float(torch.finfo(torch.float32).tiny)


def is_gated(activation_type: int) -> bool:
    """Gated activations read GEMM1 as two halves [up; gate] (the kernel's x1 = first half, x2 = second half)."""
    a = int(activation_type)
    if a in GATED_ACTIVATIONS:
        return True
    if a in NON_GATED_ACTIVATIONS:
        return False
    raise NotImplementedError(f"activation_type={a} ({_act_name(a)}) is not emulated; supported: "
                              f"{sorted(x.name for x in GATED_ACTIVATIONS | NON_GATED_ACTIVATIONS)}")


def _act_name(a: int) -> str:
    try:
        return ActivationType(a).name
    except ValueError:
        return "unknown"


# ----------------------------------------------------------------------------------------------------------------
# Activation (the FC1 epilogue / DeepSeek activation kernel)
# ----------------------------------------------------------------------------------------------------------------


def _scalar(t: Optional[torch.Tensor], e: int, default: float) -> float:
    return default if t is None else float(t.reshape(-1)[e])


def _gelu(x: torch.Tensor, tanh: bool = False) -> torch.Tensor:
    return torch.nn.functional.gelu(x, approximate="tanh" if tanh else "none")


def _activate(a1: torch.Tensor, act: int, gate_scale: float = 1.0, out_scale: float = 1.0, *,
              alpha: Optional[float] = None, beta: Optional[float] = None, limit: Optional[float] = None,
              valid_intermediate: Optional[int] = None) -> torch.Tensor:
    """GEMM1 output (raw accumulator units) -> activation, as the kernels' epilogue computes it.

    Gated: x1 = up = first half, x2 = gate = second half (dev_kernel.cu gatedSilu(xLinear=x1, xGlu=x2)). The OAI
    controls act on raw accumulator units (clamp limit and beta are passed divided by the dequant scale, SGLang
    modelopt_quant.py), then `gate_scale` (output1_scale_gate_scalar) dequantizes the gate and `out_scale`
    (output1_scale_scalar) scales the product:
        h = act(min(x2, L) * gate_scale) * (clamp(x1, -L, L) + beta) * out_scale,
    with act(g) = g / (1 + exp(-alpha g)) for Swiglu (gatedSilu's exact expression).
    Non-gated: h = act(A1 * gate_scale) * out_scale (SGLang and flashinfer's own prepare put the dequant scale in
    the gate scalar and only the re-quantization factor in output1_scale_scalar for Relu2).
    """
    if is_gated(act):
        ip = a1.shape[-1] // 2
        up, gate = a1[..., :ip], a1[..., ip:]
        if limit is not None:
            gate = gate.clamp(max=limit)
            up = up.clamp(-limit, limit)
        g = gate * gate_scale
        if act == ActivationType.Swiglu:
            a = 1.0 if alpha is None else alpha
            h = g / (1.0 + torch.exp(-a * g))
        elif alpha is not None or beta is not None or limit is not None:
            raise NotImplementedError(f"gemm1_alpha/beta/clamp_limit with activation_type={_act_name(act)}")
        else:
            h = _gelu(g, tanh=(act == ActivationType.GegluTanh))
        h = h * (up + (0.0 if beta is None else beta)) * out_scale
        if valid_intermediate is not None and valid_intermediate < ip:
            h[..., valid_intermediate:] = 0
        return h
    if alpha is not None or beta is not None or limit is not None:
        raise NotImplementedError(f"gemm1_alpha/beta/clamp_limit with non-gated activation {_act_name(act)}")
    x = a1 * gate_scale
    if act == ActivationType.Relu2:
        h = torch.relu(x).square()
    elif act == ActivationType.Relu:
        h = torch.relu(x)
    elif act == ActivationType.Silu:
        h = x / (1.0 + torch.exp(-x))
    elif act == ActivationType.Gelu:
        h = _gelu(x)
    else:  # Identity
        h = x
    h = h * out_scale
    if valid_intermediate is not None and valid_intermediate < h.shape[-1]:
        h[..., valid_intermediate:] = 0
    return h


# ----------------------------------------------------------------------------------------------------------------
# Shared driver: routing, grouping by expert, finalize
# ----------------------------------------------------------------------------------------------------------------

ExpertFn = Callable[[int, torch.Tensor, torch.Tensor], torch.Tensor]


def _groups(ids: torch.Tensor, offset: int, n_local: int):
    """Yield (local expert, flat slot indices) for each local expert that received slots; flat slot = t * K + k."""
    flat = ids.reshape(-1).long() - int(offset)
    slots = ((flat >= 0) & (flat < int(n_local))).nonzero().squeeze(1)
    experts = flat[slots]
    order = torch.argsort(experts, stable=True)
    slots, experts = slots[order], experts[order]
    if slots.numel() == 0:
        return
    uniq, counts = torch.unique_consecutive(experts, return_counts=True)
    for e, s in zip(uniq.tolist(), torch.split(slots, counts.tolist())):
        yield e, s


def _run(x: torch.Tensor, ids: torch.Tensor, weights: Optional[torch.Tensor], offset: int, n_local: int,
         expert_fn: ExpertFn, hidden_out: int, output: Optional[torch.Tensor],
         routing_replay_out: Optional[torch.Tensor] = None, weights_on_input: bool = False) -> torch.Tensor:
    """x [T, H] float32 (dequantized activations); expert_fn(e, rows, slot_weights) -> bf16-valued [n, hidden_out]."""
    T, K = ids.shape
    if routing_replay_out is not None:
        routing_replay_out[:T].copy_(ids.to(routing_replay_out.dtype))
    y = torch.zeros(T * K, hidden_out, dtype=torch.float32, device=x.device)
    w_flat = None if weights is None else weights.reshape(-1).float()
    for e, s in _groups(ids, offset, n_local):
        y[s] = expert_fn(e, x[s // K], None if w_flat is None else w_flat[s])
    y = y.view(T, K, hidden_out)
    acc = torch.zeros(T, hidden_out, dtype=torch.float32, device=x.device)
    for k in range(K):  # finalize: fp32 sum in slot order (finalize kernel), weight in its own dtype
        if weights_on_input or weights is None:
            acc = acc + y[:, k]
        else:
            acc = acc + weights[:, k].float().unsqueeze(1) * y[:, k]
    out = acc.to(torch.bfloat16)
    if output is not None:
        output.copy_(out)
        return output
    return out


def _routing(routing_logits, routing_bias, top_k, n_group, topk_group, routed_scaling_factor,
             routing_method_type, norm_topk_prob):
    return route(routing_method_type, routing_logits, top_k, bias=routing_bias, n_group=n_group,
                 topk_group=topk_group, routed_scaling_factor=routed_scaling_factor, norm_topk_prob=norm_topk_prob)


def _unsupported(**opts) -> None:
    """Raise NotImplementedError for the first option that is set to something the emulator does not model."""
    for name, (value, ok) in opts.items():
        if not ok:
            raise NotImplementedError(f"the TRT-LLM-Gen MoE emulator does not model {name}={value!r}")


def _common_unsupported(do_finalize, num_fused_shared_experts=None, gemm1_bias=None, gemm2_bias=None,
                        gemm1_lora_delta=None):
    _unsupported(
        do_finalize=(do_finalize, bool(do_finalize)),
        num_fused_shared_experts=(num_fused_shared_experts, not num_fused_shared_experts),
        gemm1_bias=("<tensor>", gemm1_bias is None),
        gemm2_bias=("<tensor>", gemm2_bias is None),
        gemm1_lora_delta=("<tensor>", gemm1_lora_delta is None),
    )


def _check_local(name: str, w: torch.Tensor, local_num_experts: int) -> None:
    if w.shape[0] != local_num_experts:
        raise ValueError(f"{name} has {w.shape[0]} experts but local_num_experts={local_num_experts}: "
                         "weights hold only this rank's experts")


def _gemm1_rows(intermediate_size: int, act: int) -> int:
    return 2 * intermediate_size if is_gated(act) else intermediate_size


def _unshuffle_rows(w: torch.Tensor, inv: torch.Tensor) -> torch.Tensor:
    """Rows of one expert's prepared matrix back to logical order (row permutation on the byte view)."""
    return w.view(torch.uint8).index_select(0, inv).view(w.dtype)


def _sf_numel(n_experts: int, rows: int, cols: int) -> int:
    return n_experts * (-(-rows // 128) * 128) * (-(-cols // 4) * 4)


def _expert_sf(sf: torch.Tensor, e: int, n_experts: int, rows: int, cols: int) -> torch.Tensor:
    """Expert e's 128x4-swizzled scales -> linear [rows, cols] uint8, accepting [E, R, C], [E, Rp, Cp] or flat."""
    rp, cp = -(-rows // 128) * 128, -(-cols // 4) * 4
    flat = sf.reshape(-1).view(torch.uint8) if sf.is_contiguous() else sf.contiguous().reshape(-1).view(torch.uint8)
    if flat.numel() != n_experts * rp * cp:
        raise ValueError(f"scale tensor of shape {tuple(sf.shape)} does not hold {n_experts} experts of "
                         f"{rows}x{cols} scales swizzled to {rp}x{cp}")
    return layouts.unswizzle_sf_128x4(flat[e * rp * cp:(e + 1) * rp * cp].view(rp, cp), rows, cols)


def _bf16(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.bfloat16).float()


# ----------------------------------------------------------------------------------------------------------------
# NVFP4 (weights and activations e2m1 + e4m3 per-16 scales)
# ----------------------------------------------------------------------------------------------------------------


def _fp4_impl(ids, weights, hidden_states, hidden_states_scale, gemm1_weights, gemm1_weights_scale,
              gemm1_alpha, gemm1_beta, gemm1_clamp_limit, gemm2_weights, gemm2_weights_scale,
              output1_scale_scalar, output1_scale_gate_scalar, output2_scale_scalar, intermediate_size,
              local_expert_offset, local_num_experts, activation_type, output, valid_hidden_size,
              valid_intermediate_size, routing_replay_out):
    act = int(activation_type)
    if hidden_states.dtype != torch.uint8:
        raise NotImplementedError(f"hidden_states dtype {hidden_states.dtype} with FP4 weights (only NVFP4 "
                                  "activations, packed uint8, are emulated; MXFP8/BF16 activations are not)")
    T = hidden_states.shape[0]
    H = hidden_states.shape[1] * 2
    if hidden_states_scale is None:
        raise ValueError("NVFP4 hidden_states need hidden_states_scale (linear e4m3 [T, H/16])")
    M = _gemm1_rows(intermediate_size, act)
    _check_local("gemm1_weights", gemm1_weights, local_num_experts)
    _check_local("gemm2_weights", gemm2_weights, local_num_experts)
    if tuple(gemm1_weights.shape[1:]) != (M, H // 2):
        raise ValueError(f"gemm1_weights shape {tuple(gemm1_weights.shape)} != [E, {M}, {H // 2}] for "
                         f"intermediate_size={intermediate_size}, activation {_act_name(act)}, hidden {H}")
    I = intermediate_size
    if tuple(gemm2_weights.shape[1:]) != (H, I // 2):
        raise ValueError(f"gemm2_weights shape {tuple(gemm2_weights.shape)} != [E, {H}, {I // 2}]")
    n_sf = gemm1_weights_scale.numel()
    if n_sf != _sf_numel(local_num_experts, M, H // 16) and n_sf == _sf_numel(local_num_experts, M, H // 32):
        raise NotImplementedError("MXFP4 weights (ue8m0 scales per 32) are not emulated; only NVFP4 weights")
    dev = hidden_states.device
    x = quant.nvfp4_dequantize(hidden_states, hidden_states_scale.reshape(T, H // 16), 1.0)
    inv1 = layouts.invert_map(layouts.w13_row_map(M, is_gated(act), dev))
    inv2 = layouts.invert_map(layouts.w2_row_map(H, dev))
    E = local_num_experts

    def expert(e, rows, _w):
        w1 = _unshuffle_rows(gemm1_weights[e], inv1)
        s1 = _expert_sf(gemm1_weights_scale, e, E, M, H // 16).index_select(0, inv1)
        w2 = _unshuffle_rows(gemm2_weights[e], inv2)
        s2 = _expert_sf(gemm2_weights_scale, e, E, H, I // 16).index_select(0, inv2)
        a1 = rows @ quant.nvfp4_dequantize(w1, s1, 1.0).t()
        h = _activate(a1, act, _scalar(output1_scale_gate_scalar, e, 1.0), _scalar(output1_scale_scalar, e, 1.0),
                      alpha=None if gemm1_alpha is None else _scalar(gemm1_alpha, e, 1.0),
                      beta=None if gemm1_beta is None else _scalar(gemm1_beta, e, 0.0),
                      limit=None if gemm1_clamp_limit is None else _scalar(gemm1_clamp_limit, e, 0.0),
                      valid_intermediate=valid_intermediate_size)
        hq, hs = quant.nvfp4_quantize(h, 1.0)  # FC1 epilogue writes NVFP4 with global scale 1
        a2 = quant.nvfp4_dequantize(hq, hs, 1.0) @ quant.nvfp4_dequantize(w2, s2, 1.0).t()
        return _bf16(a2 * _scalar(output2_scale_scalar, e, 1.0))

    out = _run(x, ids, weights, local_expert_offset, local_num_experts, expert, H, None, routing_replay_out)
    if valid_hidden_size is not None:
        out = out[:, :valid_hidden_size]
    if output is not None:
        output.copy_(out)
        out = output
    return [out]


def _fp4_unsupported(per_token_scale, hidden_states_scale_layout) -> None:
    linear = hidden_states_scale_layout is None or int(hidden_states_scale_layout) == 2  # SfLayout.layout_linear
    _unsupported(per_token_scale=("<tensor>", per_token_scale is None),
                 hidden_states_scale_layout=(hidden_states_scale_layout, linear))


def trtllm_fp4_block_scale_moe(
    routing_logits: torch.Tensor,
    routing_bias: Optional[torch.Tensor],
    hidden_states: torch.Tensor,
    hidden_states_scale: Optional[torch.Tensor],
    gemm1_weights: torch.Tensor,
    gemm1_weights_scale: torch.Tensor,
    gemm1_bias: Optional[torch.Tensor],
    gemm1_alpha: Optional[torch.Tensor],
    gemm1_beta: Optional[torch.Tensor],
    gemm1_clamp_limit: Optional[torch.Tensor],
    gemm2_weights: torch.Tensor,
    gemm2_weights_scale: torch.Tensor,
    gemm2_bias: Optional[torch.Tensor],
    output1_scale_scalar: Optional[torch.Tensor],
    output1_scale_gate_scalar: Optional[torch.Tensor],
    output2_scale_scalar: Optional[torch.Tensor],
    num_experts: int,
    top_k: int,
    n_group: Optional[int],
    topk_group: Optional[int],
    intermediate_size: int,
    local_expert_offset: int,
    local_num_experts: int,
    routed_scaling_factor: Optional[float],
    routing_method_type: int = 0,
    do_finalize: bool = True,
    enable_pdl: Optional[bool] = None,
    activation_type: int = ActivationType.Swiglu.value,
    per_token_scale: Optional[torch.Tensor] = None,
    output: Optional[torch.Tensor] = None,
    tune_max_num_tokens: int = 8192,
    norm_topk_prob: bool = True,
    routing_replay_out: Optional[torch.Tensor] = None,
    num_fused_shared_experts: Optional[int] = None,
    valid_hidden_size: Optional[int] = None,
    valid_intermediate_size: Optional[int] = None,
    hidden_states_scale_layout=None,
) -> List[torch.Tensor]:
    """Emulates flashinfer `trtllm_fp4_block_scale_moe` (NVFP4 weights + NVFP4 activations); returns [output]."""
    _common_unsupported(do_finalize, num_fused_shared_experts, gemm1_bias, gemm2_bias)
    _fp4_unsupported(per_token_scale, hidden_states_scale_layout)
    ids, w = _routing(routing_logits, routing_bias, top_k, n_group, topk_group, routed_scaling_factor,
                      routing_method_type, norm_topk_prob)
    return _fp4_impl(ids, w, hidden_states, hidden_states_scale, gemm1_weights, gemm1_weights_scale, gemm1_alpha,
                     gemm1_beta, gemm1_clamp_limit, gemm2_weights, gemm2_weights_scale, output1_scale_scalar,
                     output1_scale_gate_scalar, output2_scale_scalar, intermediate_size, local_expert_offset,
                     local_num_experts, activation_type, output, valid_hidden_size, valid_intermediate_size,
                     routing_replay_out)


def trtllm_fp4_block_scale_routed_moe(
    topk_ids: Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]],
    routing_bias: Optional[torch.Tensor],
    hidden_states: torch.Tensor,
    hidden_states_scale: Optional[torch.Tensor],
    gemm1_weights: torch.Tensor,
    gemm1_weights_scale: torch.Tensor,
    gemm1_bias: Optional[torch.Tensor],
    gemm1_alpha: Optional[torch.Tensor],
    gemm1_beta: Optional[torch.Tensor],
    gemm1_clamp_limit: Optional[torch.Tensor],
    gemm2_weights: torch.Tensor,
    gemm2_weights_scale: torch.Tensor,
    gemm2_bias: Optional[torch.Tensor],
    output1_scale_scalar: Optional[torch.Tensor],
    output1_scale_gate_scalar: Optional[torch.Tensor],
    output2_scale_scalar: Optional[torch.Tensor],
    num_experts: int,
    top_k: int,
    n_group: Optional[int],
    topk_group: Optional[int],
    intermediate_size: int,
    local_expert_offset: int,
    local_num_experts: int,
    routed_scaling_factor: Optional[float],
    routing_method_type: int = 0,
    do_finalize: bool = True,
    enable_pdl: Optional[bool] = None,
    activation_type: int = ActivationType.Swiglu.value,
    per_token_scale: Optional[torch.Tensor] = None,
    output: Optional[torch.Tensor] = None,
    tune_max_num_tokens: int = 8192,
    gemm1_lora_delta: Optional[torch.Tensor] = None,
    valid_hidden_size: Optional[int] = None,
    valid_intermediate_size: Optional[int] = None,
    num_fused_shared_experts: Optional[int] = None,
    hidden_states_scale_layout=None,
) -> List[torch.Tensor]:
    """Emulates flashinfer `trtllm_fp4_block_scale_routed_moe` (precomputed top-k, packed or (ids, weights))."""
    _common_unsupported(do_finalize, num_fused_shared_experts, gemm1_bias, gemm2_bias, gemm1_lora_delta)
    _fp4_unsupported(per_token_scale, hidden_states_scale_layout)
    ids, w = split_routed_input(topk_ids)
    return _fp4_impl(ids, w, hidden_states, hidden_states_scale, gemm1_weights, gemm1_weights_scale, gemm1_alpha,
                     gemm1_beta, gemm1_clamp_limit, gemm2_weights, gemm2_weights_scale, output1_scale_scalar,
                     output1_scale_gate_scalar, output2_scale_scalar, intermediate_size, local_expert_offset,
                     local_num_experts, activation_type, output, valid_hidden_size, valid_intermediate_size, None)


# ----------------------------------------------------------------------------------------------------------------
# FP8 per-tensor (e4m3 weights and activations, per-expert scalars)
# ----------------------------------------------------------------------------------------------------------------


def _fp8_tensor_impl(ids, weights, hidden_states, gemm1_weights, output1_scales_scalar, output1_scales_gate_scalar,
                     gemm2_weights, output2_scales_scalar, intermediate_size, local_expert_offset, local_num_experts,
                     use_routing_scales_on_input, activation_type, output, gemm1_clamp_limit, routing_replay_out):
    act = int(activation_type)
    _unsupported(gemm1_clamp_limit=("<tensor>", gemm1_clamp_limit is None))
    if hidden_states.dtype != torch.float8_e4m3fn:
        raise NotImplementedError(f"hidden_states dtype {hidden_states.dtype} (only e4m3 activations are emulated)")
    T, H = hidden_states.shape
    M, I = _gemm1_rows(intermediate_size, act), intermediate_size
    _check_local("gemm1_weights", gemm1_weights, local_num_experts)
    _check_local("gemm2_weights", gemm2_weights, local_num_experts)
    if tuple(gemm1_weights.shape[1:]) != (M, H) or tuple(gemm2_weights.shape[1:]) != (H, I):
        raise ValueError(f"weights {tuple(gemm1_weights.shape)}/{tuple(gemm2_weights.shape)} != [E, {M}, {H}]/"
                         f"[E, {H}, {I}]")
    dev = hidden_states.device
    inv1 = layouts.invert_map(layouts.w13_row_map(M, is_gated(act), dev))
    inv2 = layouts.invert_map(layouts.w2_row_map(H, dev))

    def expert(e, rows, slot_w):
        w1 = _unshuffle_rows(gemm1_weights[e], inv1).float()
        w2 = _unshuffle_rows(gemm2_weights[e], inv2).float()
        a1 = rows @ w1.t()
        if use_routing_scales_on_input:  # Llama4: routing weight scales GEMM1 (per-token scale), not the output
            a1 = a1 * slot_w.unsqueeze(1)
        h = _activate(a1, act, _scalar(output1_scales_gate_scalar, e, 1.0), _scalar(output1_scales_scalar, e, 1.0))
        hq = quant.fp8_quantize(h, 1.0)  # re-quantized to e4m3 with scale 1 (output1 scale already holds 1/a2)
        return _bf16((hq.float() @ w2.t()) * _scalar(output2_scales_scalar, e, 1.0))

    return _run(hidden_states.float(), ids, weights, local_expert_offset, local_num_experts, expert, H, output,
                routing_replay_out, weights_on_input=bool(use_routing_scales_on_input))


def trtllm_fp8_per_tensor_scale_moe(
    routing_logits: torch.Tensor,
    routing_bias: Optional[torch.Tensor],
    hidden_states: torch.Tensor,
    gemm1_weights: torch.Tensor,
    output1_scales_scalar: torch.Tensor,
    output1_scales_gate_scalar: torch.Tensor,
    gemm2_weights: torch.Tensor,
    output2_scales_scalar: torch.Tensor,
    num_experts: int,
    top_k: int,
    n_group: Optional[int],
    topk_group: Optional[int],
    intermediate_size: int,
    local_expert_offset: int,
    local_num_experts: int,
    routed_scaling_factor: Optional[float],
    use_routing_scales_on_input: bool,
    routing_method_type: int = 0,
    do_finalize: bool = True,
    enable_pdl: Optional[bool] = None,
    tune_max_num_tokens: int = 8192,
    activation_type: int = ActivationType.Swiglu.value,
    norm_topk_prob: bool = True,
    routing_replay_out: Optional[torch.Tensor] = None,
    output: Optional[torch.Tensor] = None,
    gemm1_clamp_limit: Optional[torch.Tensor] = None,
) -> Union[List[torch.Tensor], torch.Tensor]:
    """Emulates flashinfer `trtllm_fp8_per_tensor_scale_moe`; returns the output tensor (do_finalize=True)."""
    _common_unsupported(do_finalize)
    ids, w = _routing(routing_logits, routing_bias, top_k, n_group, topk_group, routed_scaling_factor,
                      routing_method_type, norm_topk_prob)
    return _fp8_tensor_impl(ids, w, hidden_states, gemm1_weights, output1_scales_scalar, output1_scales_gate_scalar,
                            gemm2_weights, output2_scales_scalar, intermediate_size, local_expert_offset,
                            local_num_experts, use_routing_scales_on_input, activation_type, output,
                            gemm1_clamp_limit, routing_replay_out)


def trtllm_fp8_per_tensor_scale_routed_moe(
    topk_ids: Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]],
    routing_bias: Optional[torch.Tensor],
    hidden_states: torch.Tensor,
    gemm1_weights: torch.Tensor,
    output1_scales_scalar: torch.Tensor,
    output1_scales_gate_scalar: torch.Tensor,
    gemm2_weights: torch.Tensor,
    output2_scales_scalar: torch.Tensor,
    num_experts: int,
    top_k: int,
    n_group: Optional[int],
    topk_group: Optional[int],
    intermediate_size: int,
    local_expert_offset: int,
    local_num_experts: int,
    routed_scaling_factor: Optional[float],
    use_routing_scales_on_input: bool,
    routing_method_type: int = 0,
    do_finalize: bool = True,
    enable_pdl: Optional[bool] = None,
    tune_max_num_tokens: int = 8192,
    activation_type: int = ActivationType.Swiglu.value,
    routing_replay_out: Optional[torch.Tensor] = None,
    output: Optional[torch.Tensor] = None,
    gemm1_clamp_limit: Optional[torch.Tensor] = None,
) -> Union[List[torch.Tensor], torch.Tensor]:
    """Emulates flashinfer `trtllm_fp8_per_tensor_scale_routed_moe`."""
    _common_unsupported(do_finalize)
    ids, w = split_routed_input(topk_ids)
    return _fp8_tensor_impl(ids, w, hidden_states, gemm1_weights, output1_scales_scalar, output1_scales_gate_scalar,
                            gemm2_weights, output2_scales_scalar, intermediate_size, local_expert_offset,
                            local_num_experts, use_routing_scales_on_input, activation_type, output,
                            gemm1_clamp_limit, routing_replay_out)


# ----------------------------------------------------------------------------------------------------------------
# FP8 block scale (DeepSeek: e4m3 with 128x128 weight scales and 1x128 activation scales)
# ----------------------------------------------------------------------------------------------------------------


def _block_requant(x: torch.Tensor) -> torch.Tensor:
    """Per (row, 128-column block) e4m3 with scale max(amax/448, FLT_MIN), dequantized back (activation kernel)."""
    q, s = quant.fp8_group_quantize(x, 128, min_scale=_FLT_MIN)
    return quant.fp8_group_dequantize(q, s, 128)


def _fp8_block_impl(ids, weights, hidden_states, hidden_states_scale, gemm1_weights, gemm1_weights_scale,
                    gemm2_weights, gemm2_weights_scale, intermediate_size, local_expert_offset, local_num_experts,
                    use_shuffled_weight, weight_layout, fp8_quantization_type, activation_type, gemm1_alpha,
                    gemm1_beta, gemm1_clamp_limit, output, valid_hidden_size, valid_intermediate_size,
                    routing_replay_out):
    act = int(activation_type)
    _unsupported(fp8_quantization_type=(fp8_quantization_type, int(fp8_quantization_type) == 1),
                 use_shuffled_weight=(use_shuffled_weight, not use_shuffled_weight),
                 weight_layout=(weight_layout, int(weight_layout) in (0, 2)),
                 activation_type=(_act_name(act), act == ActivationType.Swiglu))
    if hidden_states.dtype != torch.float8_e4m3fn:
        raise NotImplementedError(f"hidden_states dtype {hidden_states.dtype} (only e4m3 activations are emulated)")
    T, H = hidden_states.shape
    M, I = 2 * intermediate_size, intermediate_size
    if H % 128 or I % 128:
        raise ValueError(f"DeepSeek FP8 needs hidden ({H}) and intermediate ({I}) sizes that are multiples of 128")
    _check_local("gemm1_weights", gemm1_weights, local_num_experts)
    _check_local("gemm2_weights", gemm2_weights, local_num_experts)
    if int(weight_layout) == WeightLayout.BlockMajorK:
        w1_all, w2_all = layouts.from_block_major_k(gemm1_weights), layouts.from_block_major_k(gemm2_weights)
    else:
        w1_all, w2_all = gemm1_weights, gemm2_weights
    if tuple(w1_all.shape[1:]) != (M, H) or tuple(w2_all.shape[1:]) != (H, I):
        raise ValueError(f"weights {tuple(gemm1_weights.shape)}/{tuple(gemm2_weights.shape)} do not hold "
                         f"[E, {M}, {H}]/[E, {H}, {I}] in layout {int(weight_layout)}")
    x = quant.fp8_group_dequantize(hidden_states, hidden_states_scale.t().reshape(T, H // 128), 128)

    def expert(e, rows, _w):
        w1 = quant.fp8_block_dequantize(w1_all[e], gemm1_weights_scale[e])
        w2 = quant.fp8_block_dequantize(w2_all[e], gemm2_weights_scale[e])
        a1 = _block_requant(rows @ w1.t())  # GEMM1 writes e4m3 + per-128-column dequant scales
        h = _activate(a1, act, alpha=None if gemm1_alpha is None else _scalar(gemm1_alpha, e, 1.0),
                      beta=None if gemm1_beta is None else _scalar(gemm1_beta, e, 0.0),
                      limit=None if gemm1_clamp_limit is None else _scalar(gemm1_clamp_limit, e, 0.0),
                      valid_intermediate=valid_intermediate_size)
        return _bf16(_block_requant(h) @ w2.t())

    out = _run(x, ids, weights, local_expert_offset, local_num_experts, expert, H, None, routing_replay_out)
    if valid_hidden_size is not None:
        out = out[:, :valid_hidden_size]
    if output is not None:
        output.copy_(out)
        out = output
    return out


def trtllm_fp8_block_scale_moe(
    routing_logits: torch.Tensor,
    routing_bias: Optional[torch.Tensor],
    hidden_states: torch.Tensor,
    hidden_states_scale: torch.Tensor,
    gemm1_weights: torch.Tensor,
    gemm1_weights_scale: torch.Tensor,
    gemm2_weights: torch.Tensor,
    gemm2_weights_scale: torch.Tensor,
    num_experts: int,
    top_k: int,
    n_group: Optional[int],
    topk_group: Optional[int],
    intermediate_size: int,
    local_expert_offset: int,
    local_num_experts: int,
    routed_scaling_factor: Optional[float],
    routing_method_type: int = 0,
    use_shuffled_weight: bool = False,
    weight_layout: int = 0,
    do_finalize: bool = True,
    enable_pdl: Optional[bool] = None,
    tune_max_num_tokens: int = 8192,
    fp8_quantization_type: Fp8QuantizationType = Fp8QuantizationType.DeepSeekFp8,
    num_fused_shared_experts: Optional[int] = None,
    activation_type: int = ActivationType.Swiglu.value,
    norm_topk_prob: bool = True,
    routing_replay_out: Optional[torch.Tensor] = None,
    gemm1_alpha: Optional[torch.Tensor] = None,
    gemm1_beta: Optional[torch.Tensor] = None,
    gemm1_clamp_limit: Optional[torch.Tensor] = None,
    output: Optional[torch.Tensor] = None,
    valid_hidden_size: Optional[int] = None,
    valid_intermediate_size: Optional[int] = None,
    *,
    gemm1_bias: Optional[torch.Tensor] = None,
    gemm2_bias: Optional[torch.Tensor] = None,
) -> Union[List[torch.Tensor], torch.Tensor]:
    """Emulates flashinfer `trtllm_fp8_block_scale_moe` (DeepSeekFp8, MajorK or BlockMajorK, unshuffled)."""
    _common_unsupported(do_finalize, num_fused_shared_experts, gemm1_bias, gemm2_bias)
    ids, w = _routing(routing_logits, routing_bias, top_k, n_group, topk_group, routed_scaling_factor,
                      routing_method_type, norm_topk_prob)
    return _fp8_block_impl(ids, w, hidden_states, hidden_states_scale, gemm1_weights, gemm1_weights_scale,
                           gemm2_weights, gemm2_weights_scale, intermediate_size, local_expert_offset,
                           local_num_experts, use_shuffled_weight, weight_layout, fp8_quantization_type,
                           activation_type, gemm1_alpha, gemm1_beta, gemm1_clamp_limit, output, valid_hidden_size,
                           valid_intermediate_size, routing_replay_out)


def trtllm_fp8_block_scale_routed_moe(
    topk_ids: Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]],
    routing_bias: Optional[torch.Tensor],
    hidden_states: torch.Tensor,
    hidden_states_scale: torch.Tensor,
    gemm1_weights: torch.Tensor,
    gemm1_weights_scale: torch.Tensor,
    gemm2_weights: torch.Tensor,
    gemm2_weights_scale: torch.Tensor,
    num_experts: int,
    top_k: int,
    n_group: Optional[int],
    topk_group: Optional[int],
    intermediate_size: int,
    local_expert_offset: int,
    local_num_experts: int,
    routed_scaling_factor: Optional[float],
    routing_method_type: int = 0,
    use_shuffled_weight: bool = False,
    weight_layout: int = 0,
    do_finalize: bool = True,
    enable_pdl: Optional[bool] = None,
    gemm1_lora_delta: Optional[torch.Tensor] = None,
    output: Optional[torch.Tensor] = None,
    tune_max_num_tokens: int = 8192,
    fp8_quantization_type: Fp8QuantizationType = Fp8QuantizationType.DeepSeekFp8,
    activation_type: int = ActivationType.Swiglu.value,
    gemm1_alpha: Optional[torch.Tensor] = None,
    gemm1_beta: Optional[torch.Tensor] = None,
    gemm1_clamp_limit: Optional[torch.Tensor] = None,
    valid_hidden_size: Optional[int] = None,
    valid_intermediate_size: Optional[int] = None,
) -> Union[List[torch.Tensor], torch.Tensor]:
    """Emulates flashinfer `trtllm_fp8_block_scale_routed_moe`."""
    _common_unsupported(do_finalize, gemm1_lora_delta=gemm1_lora_delta)
    ids, w = split_routed_input(topk_ids)
    return _fp8_block_impl(ids, w, hidden_states, hidden_states_scale, gemm1_weights, gemm1_weights_scale,
                           gemm2_weights, gemm2_weights_scale, intermediate_size, local_expert_offset,
                           local_num_experts, use_shuffled_weight, weight_layout, fp8_quantization_type,
                           activation_type, gemm1_alpha, gemm1_beta, gemm1_clamp_limit, output, valid_hidden_size,
                           valid_intermediate_size, None)


# ----------------------------------------------------------------------------------------------------------------
# BF16 (weights row-prepared then block-major K, passed as [E, K/64, M, 64])
# ----------------------------------------------------------------------------------------------------------------


def _bf16_weights(w: torch.Tensor, rows: int, cols: int, inv: torch.Tensor, e: int) -> torch.Tensor:
    """Expert e of a BlockMajorK bf16 weight ([E, K/64, M, 64], or the flat [E, M, K] storage) -> logical [M, K]."""
    we = w[e]
    if we.dim() == 3:  # [K/bk, M, bk]
        we = layouts.from_block_major_k(we.unsqueeze(0))[0]
    elif we.dim() == 2:  # block-major bytes kept in an [M, K] shaped tensor
        we = layouts.from_block_major_k(layouts.block_major_k_view(w[e:e + 1]))[0]
    if tuple(we.shape) != (rows, cols):
        raise ValueError(f"bf16 weight of shape {tuple(w.shape)} does not hold [{rows}, {cols}] per expert")
    return _unshuffle_rows(we, inv).float()


def _bf16_impl(ids, weights, hidden_states, gemm1_weights, gemm2_weights, intermediate_size, local_expert_offset,
               local_num_experts, use_shuffled_weight, weight_layout, activation_type, gemm1_alpha, gemm1_beta,
               gemm1_clamp_limit, output, routing_replay_out):
    act = int(activation_type)
    _unsupported(weight_layout=(weight_layout, int(weight_layout) == WeightLayout.BlockMajorK),
                 use_shuffled_weight=(use_shuffled_weight, bool(use_shuffled_weight)))
    if hidden_states.dtype != torch.bfloat16:
        raise NotImplementedError(f"hidden_states dtype {hidden_states.dtype} (BF16 MoE takes bf16 activations)")
    T, H = hidden_states.shape
    M, I = _gemm1_rows(intermediate_size, act), intermediate_size
    _check_local("gemm1_weights", gemm1_weights, local_num_experts)
    _check_local("gemm2_weights", gemm2_weights, local_num_experts)
    dev = hidden_states.device
    inv1 = layouts.invert_map(layouts.w13_row_map(M, is_gated(act), dev))
    inv2 = layouts.invert_map(layouts.w2_row_map(H, dev))

    def expert(e, rows, _w):
        w1 = _bf16_weights(gemm1_weights, M, H, inv1, e)
        w2 = _bf16_weights(gemm2_weights, H, I, inv2, e)
        h = _activate(rows @ w1.t(), act, alpha=None if gemm1_alpha is None else _scalar(gemm1_alpha, e, 1.0),
                      beta=None if gemm1_beta is None else _scalar(gemm1_beta, e, 0.0),
                      limit=None if gemm1_clamp_limit is None else _scalar(gemm1_clamp_limit, e, 0.0))
        return _bf16(_bf16(h) @ w2.t())  # the FC1 epilogue writes bf16; GEMM2 output is bf16

    return _run(hidden_states.float(), ids, weights, local_expert_offset, local_num_experts, expert, H, output,
                routing_replay_out)


def trtllm_bf16_moe(
    routing_logits: torch.Tensor,
    routing_bias: Optional[torch.Tensor],
    hidden_states: torch.Tensor,
    gemm1_weights: torch.Tensor,
    gemm2_weights: torch.Tensor,
    num_experts: int,
    top_k: int,
    n_group: Optional[int],
    topk_group: Optional[int],
    intermediate_size: int,
    local_expert_offset: int,
    local_num_experts: int,
    routed_scaling_factor: Optional[float] = None,
    routing_method_type: int = 0,
    use_shuffled_weight: bool = True,
    weight_layout: int = WeightLayout.BlockMajorK,
    do_finalize: bool = True,
    enable_pdl: bool = True,
    tune_max_num_tokens: int = 8192,
    activation_type: int = ActivationType.Swiglu.value,
    norm_topk_prob: bool = True,
    routing_replay_out: Optional[torch.Tensor] = None,
    gemm1_alpha: Optional[torch.Tensor] = None,
    gemm1_beta: Optional[torch.Tensor] = None,
    gemm1_clamp_limit: Optional[torch.Tensor] = None,
    output: Optional[torch.Tensor] = None,
) -> Union[List[torch.Tensor], torch.Tensor]:
    """Emulates flashinfer `trtllm_bf16_moe`."""
    _common_unsupported(do_finalize)
    ids, w = _routing(routing_logits, routing_bias, top_k, n_group, topk_group, routed_scaling_factor,
                      routing_method_type, norm_topk_prob)
    return _bf16_impl(ids, w, hidden_states, gemm1_weights, gemm2_weights, intermediate_size, local_expert_offset,
                      local_num_experts, use_shuffled_weight, weight_layout, activation_type, gemm1_alpha, gemm1_beta,
                      gemm1_clamp_limit, output, routing_replay_out)


def trtllm_bf16_routed_moe(
    topk_ids: Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]],
    hidden_states: torch.Tensor,
    gemm1_weights: torch.Tensor,
    gemm2_weights: torch.Tensor,
    num_experts: int,
    top_k: int,
    n_group: Optional[int],
    topk_group: Optional[int],
    intermediate_size: int,
    local_expert_offset: int,
    local_num_experts: int,
    routed_scaling_factor: Optional[float] = None,
    routing_method_type: int = 0,
    use_shuffled_weight: bool = True,
    weight_layout: int = WeightLayout.BlockMajorK,
    do_finalize: bool = True,
    enable_pdl: bool = True,
    gemm1_lora_delta: Optional[torch.Tensor] = None,
    tune_max_num_tokens: int = 8192,
    activation_type: int = ActivationType.Swiglu.value,
    routing_replay_out: Optional[torch.Tensor] = None,
    gemm1_alpha: Optional[torch.Tensor] = None,
    gemm1_beta: Optional[torch.Tensor] = None,
    gemm1_clamp_limit: Optional[torch.Tensor] = None,
    output: Optional[torch.Tensor] = None,
) -> Union[torch.Tensor, List[torch.Tensor]]:
    """Emulates flashinfer `trtllm_bf16_routed_moe`."""
    _common_unsupported(do_finalize, gemm1_lora_delta=gemm1_lora_delta)
    ids, w = split_routed_input(topk_ids)
    return _bf16_impl(ids, w, hidden_states, gemm1_weights, gemm2_weights, intermediate_size, local_expert_offset,
                      local_num_experts, use_shuffled_weight, weight_layout, activation_type, gemm1_alpha, gemm1_beta,
                      gemm1_clamp_limit, output, routing_replay_out)


KERNEL_FUNCTIONS = (
    "trtllm_fp4_block_scale_moe",
    "trtllm_fp4_block_scale_routed_moe",
    "trtllm_fp8_block_scale_moe",
    "trtllm_fp8_block_scale_routed_moe",
    "trtllm_fp8_per_tensor_scale_moe",
    "trtllm_fp8_per_tensor_scale_routed_moe",
    "trtllm_bf16_moe",
    "trtllm_bf16_routed_moe",
)

__all__ = ["ActivationType", "WeightLayout", "Fp8QuantizationType", "is_gated", "KERNEL_FUNCTIONS",
           *KERNEL_FUNCTIONS]
