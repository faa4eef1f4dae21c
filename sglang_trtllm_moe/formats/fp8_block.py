"""FP8 128x128 block (DeepSeek, SGLang `fp8` with weight_block_size [128, 128]): e4m3 weights, fp32 `weight_scale_inv`
per 128x128 block, activations quantized per token and 128 columns at run time.

Kernel (flashinfer `trtllm_fp8_block_scale_moe`, DeepSeekFp8): MajorK, no row shuffle (`use_shuffled_weight=False`,
the activation is a separate kernel), w13 halves [up; gate] (the activation kernel reads x1 = first half as the
linear input and silu()s the second: trtllm_fused_moe_dev_kernel.cu activationDeepSeekKernel). SGLang 0.5.23's
FusedMoE._weight_loader_impl swaps shard ids w1<->w3 for Fp8MoEMethod on flashinfer_trtllm, so the loaded
w13 and its block scales are already [up; gate] per (padded) half: the kernel layout *is* the loaded layout.
The format still owns the layer (per-expert state, validation, scalars-free flush, runner) so RL updates follow the
same path as every other format; preparing is the identity.
Only SwiGLU: flashinfer's launcher refuses any other activation for DeepSeekFp8.
"""

from __future__ import annotations

from .base import ParamLayout, WeightFormat

BLOCK = 128


class Fp8Block(WeightFormat):
    name = "fp8_block"
    params = (
        ParamLayout("w13_weight", "w13", permute_rows=False),
        ParamLayout("w13_weight_scale_inv", "w13", permute_rows=False),
        ParamLayout("w2_weight", "w2", permute_rows=False),
        ParamLayout("w2_weight_scale_inv", "w2", permute_rows=False),
    )

    def check_layout(self, layer) -> str | None:
        cfg = layer.moe_runner_config
        if cfg.activation != "silu" or not cfg.is_gated:
            return (f"activation {cfg.activation!r} ({'gated' if cfg.is_gated else 'non-gated'}) is not supported by the "
                    "DeepSeek FP8 block-scale kernel, which only implements SwiGLU (gated silu)")
        problem = super().check_layout(layer)
        if problem:
            return problem
        e, m, h = layer.w13_weight.shape
        i = layer.w2_weight.shape[2]
        if h % BLOCK or i % BLOCK or m != 2 * i:
            return (f"w13 {tuple(layer.w13_weight.shape)} / w2 {tuple(layer.w2_weight.shape)}: the kernel needs hidden and "
                    f"(padded) intermediate sizes that are multiples of {BLOCK} and w13 = [up; gate] of 2 x intermediate rows")
        want13 = (e, m // BLOCK, h // BLOCK)
        want2 = (e, h // BLOCK, i // BLOCK)
        if tuple(layer.w13_weight_scale_inv.shape) != want13 or tuple(layer.w2_weight_scale_inv.shape) != want2:
            return (f"block scales {tuple(layer.w13_weight_scale_inv.shape)} / {tuple(layer.w2_weight_scale_inv.shape)} "
                    f"are not one per 128x128 block ({want13} / {want2})")
        return None


FP8_BLOCK = Fp8Block()
