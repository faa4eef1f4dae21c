"""FP8 128x128 block (DeepSeek, SGLang `fp8` with weight_block_size [128, 128]): e4m3 weights, fp32 `weight_scale_inv`
per 128x128 block, activations quantized per token and 128 columns at run time.

Kernel (flashinfer `trtllm_fp8_block_scale_moe`, DeepSeekFp8): MajorK, no row shuffle (`use_shuffled_weight=False`,
the activation is a separate kernel), w13 halves [up; gate] (the activation kernel reads x1 = first half as the
linear input and silu()s the second: trtllm_fused_moe_dev_kernel.cu activationDeepSeekKernel). SGLang 0.5.23's
FusedMoE._weight_loader_impl swaps shard ids w1<->w3 for Fp8MoEMethod on flashinfer_trtllm, so the loaded
w13 and its block scales are already [up; gate] per (padded) half: the kernel layout *is* the loaded layout.
The format still owns the layer (per-expert state, validation, scalars-free flush, runner) so RL updates follow the
same path as every other format; preparing is the identity.
Only SwiGLU: flashinfer's launcher refuses any other activation for DeepSeekFp8 (0.6.x: `TVM_FFI_ICHECK(activation_type
== ActivationType::Swiglu)`; 0.7.x takes an `activation_type` but throws NotImplementedError "DeepSeekFp8 only
supports ActivationType::Swiglu" for anything else, trtllm_fused_moe_kernel_launcher.cu).
"""

from __future__ import annotations

import torch

from .. import quant
from ..compat import defer
from .base import (
    TRTLLM,
    TRTLLM_ROUTED,
    Checkpoint,
    KernelCall,
    Layer,
    ParamLayout,
    Support,
    WeightFormat,
)
from .encodings import (
    Calibration,
    Encoding,
    Tensors,
    Unquantized,
    block_scaled_intermediate,
    swiglu_limits,
)

BLOCK = quant.FP8_BLOCK


def _deepseek_fp8(w: torch.Tensor, calib: Calibration) -> Tensors:
    """One projection: e4m3 `weight` and fp32 `weight_scale_inv` per 128x128 block."""
    q, s = quant.fp8_block_quantize(w)
    return {"weight": q, "weight_scale_inv": s}


def _block_config(unquantized: Unquantized) -> dict:
    return {
        "quant_method": "fp8",
        "activation_scheme": "dynamic",
        "weight_block_size": [BLOCK, BLOCK],
        "fmt": "e4m3",
        "ignored_layers": list(unquantized.modules),
    }


#: DeepSeek 128x128 block FP8 (`quant_method: fp8`, `weight_block_size`)
DEEPSEEK_FP8 = Encoding(
    "fp8_block",
    "fp8_block_scale",
    _deepseek_fp8,
    lambda t: quant.fp8_block_dequantize(t["weight"], t["weight_scale_inv"]),
    quant_config=_block_config,
    random_std=0.02,
)


class Fp8Block(WeightFormat):
    name = "fp8_block"
    title = "FP8 128x128 block (fp8)"
    encoding = DEEPSEEK_FP8
    hook_module = "sglang_trtllm_moe.builtins.fp8_hooks"
    upstream_verdicts = (
        defer.Verdict(
            defer.EVERY_RELEASE.releases,
            True,
            "measured: every flow exact, storage, Parameters and weight_loaders kept (the kernel layout is the "
            "loaded layout: FusedMoE loads w13 as [up; gate] on trtllm and nothing is permuted)",
        ),
    )
    quantizations = {TRTLLM: frozenset({"fp8"}), TRTLLM_ROUTED: frozenset({"fp8"})}
    gated_activations = frozenset({"silu"})
    non_gated_activations = frozenset()
    #: SGLang prepares it itself on every release (compat/defer.py): nothing is permuted, the loaded layout is the
    #: kernel's, and FusedMoE._weight_loader_impl only writes bytes (besides clearing the MXFP8 shuffle-index cache,
    #: which no FP8 block layer reads) — tests/test_batched_writes.py compares its batched bytes with SGLang's loader
    batched_where_sglang_prepares = True
    activation_note = "flashinfer's DeepSeekFp8 block-scale kernel only implements SwiGLU (gated silu)"
    #: cannot be padded past its scale blocks: the per-rank intermediate must already be a multiple of 128
    intermediate_align = (BLOCK, BLOCK)

    def supports_intermediate(self, per_rank: int, gated: bool) -> Support:
        return block_scaled_intermediate(per_rank)

    def describes(self, checkpoint: Checkpoint) -> bool:
        return (
            checkpoint.quantization == "fp8"
            and tuple(checkpoint.weight_block_size or ()) == (BLOCK, BLOCK)
            and not checkpoint.fp4_experts
        )

    def refusal(self, checkpoint: Checkpoint) -> str | None:
        wbs = checkpoint.weight_block_size
        if checkpoint.quantization == "fp8" and wbs is not None and not self.describes(checkpoint):
            return f"fp8 with weight_block_size {list(wbs)} (only [{BLOCK}, {BLOCK}] is served)"
        return None

    params = (
        ParamLayout("w13_weight", "w13", permute_rows=False),
        ParamLayout("w13_weight_scale_inv", "w13", permute_rows=False),
        ParamLayout("w2_weight", "w2", permute_rows=False),
        ParamLayout("w2_weight_scale_inv", "w2", permute_rows=False),
    )

    def check_layout(self, layer: Layer) -> str | None:
        problem = super().check_layout(layer)
        if problem:
            return problem
        e, m, h = layer.w13_weight.shape
        i = layer.w2_weight.shape[2]
        if h % BLOCK or i % BLOCK or m != 2 * i:
            return (
                f"w13 {tuple(layer.w13_weight.shape)} / w2 {tuple(layer.w2_weight.shape)}: the kernel needs hidden "
                f"and (padded) intermediate sizes that are multiples of {BLOCK} and w13 = [up; gate] of 2 x "
                "intermediate rows"
            )
        want13 = (e, m // BLOCK, h // BLOCK)
        want2 = (e, h // BLOCK, i // BLOCK)
        if tuple(layer.w13_weight_scale_inv.shape) != want13 or tuple(layer.w2_weight_scale_inv.shape) != want2:
            return (
                f"block scales {tuple(layer.w13_weight_scale_inv.shape)} / {tuple(layer.w2_weight_scale_inv.shape)} "
                f"are not one per 128x128 block ({want13} / {want2})"
            )
        return None

    def kernel_args(self, call: KernelCall, routing: dict, routed: bool) -> dict:
        """Activations per token and 128 columns, scales handed over transposed [H/128, T] as the kernel reads them;
        weights MajorK unshuffled; DeepSeekFp8."""
        layer, qi = call.layer, call.quant_info
        if routing.get("routed_scaling_factor") is None:
            routing["routed_scaling_factor"] = 1.0
        if call.on_kernel:
            from sglang.srt.layers.moe.moe_runner.flashinfer_trtllm import per_token_group_quant_fp8

            hs, sf = per_token_group_quant_fp8(call.hidden, BLOCK, column_major_scales=True)
            sf_t = sf.t()
        else:
            from ..quant import fp8_group_quantize

            hs, sf = fp8_group_quantize(call.hidden, BLOCK)
            sf_t = sf.t().contiguous()
        return dict(
            hidden_states=hs,
            hidden_states_scale=sf_t,
            gemm1_weights=layer.w13_weight,
            gemm1_weights_scale=layer.w13_weight_scale_inv,
            gemm2_weights=layer.w2_weight,
            gemm2_weights_scale=layer.w2_weight_scale_inv,
            **swiglu_limits(qi),
            num_experts=qi.global_num_experts,
            intermediate_size=int(layer.w2_weight.shape[2]),
            local_expert_offset=qi.local_expert_offset,
            local_num_experts=qi.local_num_experts,
            use_shuffled_weight=False,
            weight_layout=0,
            fp8_quantization_type=1,  # MajorK, DeepSeekFp8
            **routing,
        )


FP8_BLOCK = Fp8Block()
