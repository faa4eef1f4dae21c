"""The fused MoE function SGLang calls for `flashinfer_trtllm` / `flashinfer_trtllm_routed`.

SGLang's FusedOpPool stores the dispatcher function object, but the dispatcher looks the per-dtype leaf up as a
module global at call time, so replacing the leaf (`fused_experts_none_to_flashinfer_trtllm_fp4`, ...) takes effect
for every layer. The leaf builds the kernel's arguments once and hands them to one of two backends with the same
signature: flashinfer's TRT-LLM-Gen kernels on an SM100 GPU, or the PyTorch emulator when
SGLANG_TRTLLM_MOE_EMULATE=1 (any device). Anywhere else it stops with an error that says what to do, instead of
SGLang's CUDA assertion or a silent fallback.
"""

from __future__ import annotations

import os

import torch

from . import weights

ENV_EMULATE = "SGLANG_TRTLLM_MOE_EMULATE"


class KernelUnavailableError(RuntimeError):
    pass


def emulating() -> bool:
    return os.environ.get(ENV_EMULATE, "").strip().lower() in ("1", "true", "yes", "on")


def _kernel_backend(layer, device: torch.device):
    """(module with flashinfer's trtllm_* signatures, name)."""
    if emulating():
        from . import emulator

        return emulator, "emulator"
    if device.type == "cuda" and torch.cuda.get_device_capability(device)[0] == 10:
        import flashinfer.fused_moe as fi

        return fi, "flashinfer"
    where = "CPU" if device.type != "cuda" else "SM%d%d" % torch.cuda.get_device_capability(device)
    raise KernelUnavailableError(
        f"{weights.layer_name(layer)}: the flashinfer_trtllm MoE kernels need an SM100 (Blackwell, compute capability "
        f"10.x) GPU and this layer runs on {where}. Set {ENV_EMULATE}=1 to run the sglang-trtllm-moe PyTorch emulator "
        "on the same prepared weights, or choose another --moe-runner-backend."
    )


def ensure_prepared(layer) -> None:
    """A layer with experts left in checkpoint layout (e.g. after update_weights_from_tensor) is flushed first."""
    st = weights.state_of(layer)
    if st is not None and not st.clean:
        weights.flush(layer)


def _routing_kwargs(topk_output, quant_info, runner_config, routed: bool) -> tuple[dict, bool]:
    """Kernel routing arguments: logits + method (bypassed TopK), or precomputed top-k (routed variant)."""
    from sglang.srt.layers.moe.topk import TopKOutputChecker

    if routed or not TopKOutputChecker.format_is_bypassed(topk_output):
        if hasattr(topk_output, "packed_topk_ids"):
            ids = topk_output.packed_topk_ids
        else:
            ids = (topk_output.topk_ids.contiguous().to(torch.int32), topk_output.topk_weights.contiguous().to(torch.bfloat16))
        top_k = (ids[0] if isinstance(ids, tuple) else ids).shape[1]
        return dict(topk_ids=ids, routing_bias=None, top_k=top_k, n_group=0, topk_group=0,
                    routed_scaling_factor=None, routing_method_type=1), True
    cfg = topk_output.topk_config
    method = quant_info.routing_method_type
    return dict(
        routing_logits=topk_output.router_logits,
        routing_bias=cfg.correction_bias,
        top_k=cfg.top_k,
        n_group=cfg.num_expert_group,
        topk_group=cfg.topk_group,
        routed_scaling_factor=runner_config.routed_scaling_factor,
        routing_method_type=int(method) if method is not None else 0,
    ), False


# flashinfer.tllm_enums.ActivationType values (flashinfer 0.7.2), kept as ints so CPU boxes need no flashinfer.
_GATED_ACT = {"silu": 3, "gelu": 4, "situ": 10}  # Swiglu, Geglu, Situ
_NON_GATED_ACT = {"silu": 2, "gelu": 0, "relu2": 6}  # Silu, Gelu, Relu2


def activation_type(activation: str, gated: bool) -> int:
    table = _GATED_ACT if gated else _NON_GATED_ACT
    if activation not in table:
        raise ValueError(
            f"activation {activation!r} ({'gated' if gated else 'non-gated'}) is not served by the TRT-LLM-Gen MoE "
            f"kernels; supported: {sorted(table)}"
        )
    return table[activation]


def _begin(dispatch_output, runner_config, what: str):
    """Shared prologue of every leaf: the layer (flushed if an update left experts in checkpoint layout), its input,
    and the backend that will run it. Pre-quantized a2a input is refused by name, not misread."""
    layer = runner_config.layer
    ensure_prepared(layer)
    x = dispatch_output.hidden_states
    backend, name = _kernel_backend(layer, x.device)
    if getattr(dispatch_output, "hidden_states_scale", None) is not None:
        raise NotImplementedError(
            f"{weights.layer_name(layer)}: pre-quantized (a2a) {what} dispatch is not supported by the plugin runner yet"
        )
    return layer, x, backend, name


def _finish(fn, kwargs: dict, x):
    """Shared epilogue: call the kernel (or emulator), unwrap flashinfer's list return, hand SGLang a combine input."""
    from sglang.srt.layers.moe.token_dispatcher.standard import StandardCombineInput

    out = fn(**kwargs)
    out = out[0] if isinstance(out, (list, tuple)) else out
    return StandardCombineInput(hidden_states=out.to(x.dtype))


def fused_experts_fp4(dispatch_output, quant_info, runner_config, use_routed_topk: bool = False):
    layer, x, backend, name = _begin(dispatch_output, runner_config, "NVFP4")
    if getattr(quant_info, "use_per_token_activation", False):
        raise NotImplementedError(f"{weights.layer_name(layer)}: per-token NVFP4 activations are not supported by the plugin runner yet")
    if name == "flashinfer":
        from sglang.srt.layers.moe.moe_runner.flashinfer_trtllm import quantize_hidden_states_fp4

        hs, hs_sf = quantize_hidden_states_fp4(x, quant_info.w13_input_scale_quant)
    else:
        from .quant import nvfp4_quantize

        hs, hs_sf = nvfp4_quantize(x, quant_info.w13_input_scale_quant)
    routing, routed = _routing_kwargs(dispatch_output.topk_output, quant_info, runner_config, use_routed_topk)
    kwargs = dict(
        hidden_states=hs,
        hidden_states_scale=hs_sf.view(torch.float8_e4m3fn).reshape(hs.shape[0], -1),
        gemm1_weights=quant_info.w13_weight,
        gemm1_weights_scale=quant_info.w13_weight_scale.view(torch.float8_e4m3fn),
        gemm1_bias=None,
        # < 0.5.2x: the FP4 QuantInfo has no gemm1_alpha/beta (SGLang passes None there)
        gemm1_alpha=getattr(quant_info, "gemm1_alpha", None),
        gemm1_beta=getattr(quant_info, "gemm1_beta", None),
        gemm1_clamp_limit=getattr(quant_info, "gemm1_clamp_limit", None),
        gemm2_weights=quant_info.w2_weight,
        gemm2_weights_scale=quant_info.w2_weight_scale.view(torch.float8_e4m3fn),
        gemm2_bias=None,
        output1_scale_scalar=quant_info.g1_scale_c,
        output1_scale_gate_scalar=quant_info.g1_alphas,
        output2_scale_scalar=quant_info.g2_alphas,
        num_experts=quant_info.global_num_experts,
        intermediate_size=quant_info.intermediate_size_per_partition,
        local_expert_offset=quant_info.local_expert_offset,
        local_num_experts=quant_info.local_num_experts,
        do_finalize=True,
        activation_type=activation_type(runner_config.activation, runner_config.is_gated),
        **routing,
    )
    fn = backend.trtllm_fp4_block_scale_routed_moe if routed else backend.trtllm_fp4_block_scale_moe
    return _finish(fn, kwargs, x)


def fused_experts_bf16(dispatch_output, quant_info, runner_config, use_routed_topk: bool = False):
    """BF16 leaf (`fused_experts_none_to_flashinfer_trtllm_bf16`). The weights stay [E, M, K] Parameters whose bytes
    are block-major (formats/bf16.py); the kernel is given the 4-D BlockMajorK view of the same storage.
    routed_scaling_factor reaches the kernel on the logits path (vllm#43769 lost it for BF16); on the routed path
    SGLang's TopK has already folded it into the weights."""
    from . import layouts

    layer, x, backend, _ = _begin(dispatch_output, runner_config, "BF16")
    # SGLang's BF16 quant info carries no routing method; its leaf reads the runner config's
    from types import SimpleNamespace

    method = SimpleNamespace(routing_method_type=runner_config.routing_method_type)
    routing, routed = _routing_kwargs(dispatch_output.topk_output, method, runner_config, use_routed_topk)
    if routed:
        routing.pop("routing_bias", None)  # trtllm_bf16_routed_moe takes no bias: the top-k is already chosen
    kwargs = dict(
        hidden_states=x,
        gemm1_weights=layouts.block_major_k_view(quant_info.gemm1_weights.data),
        gemm2_weights=layouts.block_major_k_view(quant_info.gemm2_weights.data),
        num_experts=quant_info.global_num_experts,
        intermediate_size=runner_config.intermediate_size_per_partition,
        local_expert_offset=quant_info.local_expert_offset,
        local_num_experts=runner_config.num_local_experts,
        use_shuffled_weight=True,
        weight_layout=2,  # WeightLayout.BlockMajorK
        do_finalize=True,
        activation_type=activation_type(runner_config.activation, runner_config.is_gated),
        **routing,
    )
    fn = backend.trtllm_bf16_routed_moe if routed else backend.trtllm_bf16_moe
    return _finish(fn, kwargs, x)


_FP8_FORMATS = ("fp8_tensor", "fp8_tensor_modelopt", "fp8_block")


def serves_fp8(runner_config) -> bool:
    """The FP8 leaf also serves MXFP8 and layers SGLang prepared itself; only layers the plugin prepared are ours."""
    st = weights.state_of(getattr(runner_config, "layer", None))
    return st is not None and st.fmt.name in _FP8_FORMATS


def fused_experts_fp8(dispatch_output, quant_info, runner_config, use_routed_topk: bool = False):
    """FP8 leaf (`fused_experts_none_to_flashinfer_trtllm_fp8`) for per-tensor and DeepSeek 128x128 block layers.

    Per-tensor: activations e4m3 with the layer's static a1 (= max input scale, the scalar the flush keeps), the
    three per-expert scalars of formats/fp8_tensor.py (separate gate and up dequant). Block: activations per token
    and 128 columns, scales handed over transposed [H/128, T] as the kernel reads them; weights MajorK unshuffled.
    The routed variants take SGLang's materialized top-k (routed_scaling_factor already folded in by TopK).
    """
    layer, x, backend, name = _begin(dispatch_output, runner_config, "FP8")
    block = weights.state_of(layer).fmt.name == "fp8_block"
    routing, routed = _routing_kwargs(dispatch_output.topk_output, quant_info, runner_config, use_routed_topk)
    if routing.get("routed_scaling_factor") is None:
        routing["routed_scaling_factor"] = 1.0
    if not routed and not block:  # the per-tensor kernel reads bf16 logits (SGLang casts them the same way)
        routing["routing_logits"] = routing["routing_logits"].to(torch.bfloat16)
    kwargs = dict(
        gemm1_weights=layer.w13_weight,
        gemm2_weights=layer.w2_weight,
        num_experts=quant_info.global_num_experts,
        intermediate_size=int(layer.w2_weight.shape[2]),
        local_expert_offset=quant_info.local_expert_offset,
        local_num_experts=quant_info.local_num_experts,
        do_finalize=True,
        activation_type=activation_type(runner_config.activation, runner_config.is_gated),
        **routing,
    )
    if block:
        if name == "flashinfer":
            from sglang.srt.layers.moe.moe_runner.flashinfer_trtllm import per_token_group_quant_fp8

            hs, sf = per_token_group_quant_fp8(x, 128, column_major_scales=True)
            sf_t = sf.t()
        else:
            from .quant import fp8_group_quantize

            hs, sf = fp8_group_quantize(x, 128)
            sf_t = sf.t().contiguous()
        kwargs.update(
            hidden_states=hs, hidden_states_scale=sf_t,
            gemm1_weights_scale=layer.w13_weight_scale_inv, gemm2_weights_scale=layer.w2_weight_scale_inv,
            gemm1_alpha=getattr(quant_info, "gemm1_alpha", None), gemm1_beta=getattr(quant_info, "gemm1_beta", None),
            gemm1_clamp_limit=getattr(quant_info, "gemm1_clamp_limit", None),
            use_shuffled_weight=False, weight_layout=0, fp8_quantization_type=1,  # MajorK, DeepSeekFp8
        )
        fn = backend.trtllm_fp8_block_scale_routed_moe if routed else backend.trtllm_fp8_block_scale_moe
    else:
        a1 = layer.w13_input_scale_max
        if name == "flashinfer":
            from sglang.srt.layers.moe.moe_runner.flashinfer_trtllm import scaled_fp8_quant

            hs, _ = scaled_fp8_quant(x, a1)
        else:
            from .quant import fp8_quantize

            hs = fp8_quantize(x, a1)
        kwargs.update(
            hidden_states=hs,
            output1_scales_scalar=layer.output1_scales_scalar,
            output1_scales_gate_scalar=layer.output1_scales_gate_scalar,
            output2_scales_scalar=layer.output2_scales_scalar,
            use_routing_scales_on_input=False,
        )
        fn = backend.trtllm_fp8_per_tensor_scale_routed_moe if routed else backend.trtllm_fp8_per_tensor_scale_moe
    return _finish(fn, kwargs, x)
