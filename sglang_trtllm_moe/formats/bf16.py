"""BF16 (unquantized) experts for flashinfer `trtllm_bf16_moe`: row permutation, then BlockMajorK, in place.

Kernel layout (flashinfer prepare.py `prepare_trtllm_bf16_weights`, SGLang unquant.py): w13 rows [up; gate] ->
gated interleave -> shuffle_matrix_a (non-gated: shuffle only), w2: shuffle; then each expert [M, K] becomes
block-major [K/64, M, 64] (128-byte blocks of K). SGLang does this per expert and then *reshapes the Parameter to
4-D*, so every later weight load first needs `maybe_restore_flashinfer_trtllm_bf16_weight_shape_for_load` to
un-block the whole layer (sglang#26194, #28015, #33743). Here the Parameter keeps its loaded shape [E, M, K] and
storage; only its bytes are block-major. The runner hands the kernel `layouts.block_major_k_view` (4-D, same
storage), SGLang's loader always sees [E, M, K], and the per-expert state in `weights` un-blocks only the expert
being written. No scalars: the kernel takes no scales.

SGLang's FusedMoE already allocates the intermediate padded to 128 on this backend (per half for gated w13, the
loader zero-fills the pad), so there is nothing to re-allocate.
"""

from __future__ import annotations

from .base import ParamLayout, WeightFormat

#: activations SGLang 0.5.23 lets through to the BF16 kernel (flashinfer_trtllm.py `_SUPPORTED_BF16_ACTIVATIONS`)
SUPPORTED_ACTIVATIONS = ("silu", "relu2")
BLOCK_K_BYTES = 128


class Bf16(WeightFormat):
    name = "bf16"
    params = (
        ParamLayout("w13_weight", "w13", block_major_k=True),
        ParamLayout("w2_weight", "w2", block_major_k=True),
    )

    def check_layout(self, layer) -> str | None:
        cfg = layer.moe_runner_config
        if cfg.activation not in SUPPORTED_ACTIVATIONS:
            return (f"activation {cfg.activation!r} is not served by the TRT-LLM-Gen BF16 MoE kernel "
                    f"(supported: {', '.join(SUPPORTED_ACTIVATIONS)})")
        if cfg.gemm1_alpha is not None or cfg.gemm1_clamp_limit is not None:
            return ("SwiGLU-OAI parameters (gemm1_alpha / gemm1_clamp_limit) are not passed to the BF16 kernel by "
                    "SGLang's flashinfer_trtllm path, so the layer would compute a different activation")
        if getattr(cfg, "num_fused_shared_experts", 0):
            return "fused shared experts are not supported by the flashinfer_trtllm BF16 MoE"
        problem = super().check_layout(layer)
        if problem:
            return problem
        for p in self.params:
            t = getattr(layer, p.name)
            if t.dtype.itemsize != 2:
                return f"{p.name} is {t.dtype}; the BF16 kernel takes 16-bit weights"
            if (t.shape[2] * t.element_size()) % BLOCK_K_BYTES:
                return (f"{p.name} rows are {t.shape[2]} elements; BlockMajorK needs a multiple of "
                        f"{BLOCK_K_BYTES // t.element_size()} (pad the {'hidden' if p.group == 'w13' else 'intermediate'} size)")
        return None


BF16 = Bf16()
