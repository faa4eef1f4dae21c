"""INT4 W4A16 experts, symmetric, a bf16 scale per 32 values (compressed-tensors `pack-quantized`: Kimi-K2.x as its
vendor releases it) on flashinfer's `trtllm_mxint4_block_scale_moe` (SGLang `CompressedTensorsMxInt4MoE`, chosen by
`CompressedTensorsConfig._is_mxint4a16` on flashinfer_trtllm; its apply calls the kernel itself).

SGLang's `process_weights_after_loading` builds the kernel's layout expert by expert in new tensors and
`replace_parameter`s all four (uint8 weights of another shape, flat bf16 scales, no `weight_loader`): the next RL
update raises AttributeError (measured) — a loader that went around it would write int32 checkpoint words into
kernel-layout storage — and captured CUDA graphs keep reading the old storage. Here the
same bytes are written in place, per expert, into SGLang's own Parameters:

* Weights (`*_weight_packed`, int32 [E, M, K/8]): a word's bytes are the kernel's bytes — two nibbles each, the even
  element low (compressed-tensors' `pack_to_int32` puts element j of a word at bits 4j) — but the checkpoint stores
  w/s + 8 and the kernel w/s: SGLang's `repack` is `(n - 8) & 0xF`, i.e. `n ^ 8`, so the bytes are XORed with 0x88.
  Then rows: w13 [up; gate] (FusedMoE's loader swaps w1/w3 for this method on flashinfer_trtllm, every release)
  gated-interleaved and shuffled (`_maybe_get_cached_w3_w1_permute_indices`, epilogue tile 128), w2 shuffled; then
  block-major K with 128-byte blocks (`convert_to_block_layout(..., 128)`). One pass (layouts.blocks, `xor`).
* Scales (`*_weight_scale`, bf16 [E, M, K/32]): the same row maps (`get_shuffle_matrix_sf_a_row_indices` returns the
  weights' rows, whatever its `num_elts_per_sf`), then the 128x4 swizzle of `block_scale_interleave` on 2-byte
  elements — the same bytes as its output when M % 128 == 0 and K/32 % 4 == 0, which the kernel needs anyway.
* The kernel is handed views of the same storage: weights as uint8 [E, K/256, M, 128] (SGLang's shape), scales as
  bf16 [E, M*K/32] (SGLang's flat stack); the launcher reads data pointers, dtypes and the scales' element count.

The kernel: SwiGLU only (the launcher fixes it; SGLang asserts a gated layer), BF16 activations, no scalars.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from .. import quant
from ..compat import defer
from ..kernel_api import RoutingMethodType
from .base import (
    SUPPORTED,
    TRTLLM,
    Checkpoint,
    KernelCall,
    Layer,
    ParamLayout,
    Support,
    WeightFormat,
)
from .encodings import Calibration, Encoding, Tensors, compressed_tensors_config, grid_dequantize

#: the byte XOR that turns compressed-tensors' nibbles (w/s + 8) into the kernel's (w/s), and back
NIBBLE_SIGN = 0x88
#: the kernel's block of K is 128 bytes: 256 INT4 values, on both GEMMs' K (hidden for w13, intermediate for w2)
K_BLOCK = 256


def _pack_quantized(w: torch.Tensor, calib: Calibration) -> Tensors:
    """One projection as Kimi-K2 ships it: int32 words (w/s + 8), bf16 scales per 32, its [out, in] shape."""
    packed, scale = quant.int4_quantize(w)
    return {
        "weight_packed": packed,
        "weight_scale": scale,
        "weight_shape": torch.tensor(list(w.shape), dtype=torch.int32),
    }


def _int4_grid(weight: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """int32 words `[E, M, K/8]` (w/s + 8) x bf16 scales `[E, M, K/32]` -> values and one INT4 step (the scale)
    per value."""
    if weight.dtype != torch.int32:
        return grid_dequantize(weight, scale)
    return quant.int4_dequantize(weight, scale), scale.float().repeat_interleave(quant.INT4_GROUP, dim=-1)


#: Kimi-K2's `quantization_config` (llm-compressor W4A16, group 32, symmetric, static, no activation quantization)
EXAMPLE_CONFIG: dict[str, Any] = {
    "quant_method": "compressed-tensors",
    "format": "pack-quantized",
    "ignore": [],
    "config_groups": {
        "group_0": {
            "targets": ["Linear"],
            "weights": {
                "num_bits": 4,
                "type": "int",
                "strategy": "group",
                "group_size": 32,
                "symmetric": True,
                "dynamic": False,
                "actorder": None,
                "observer": "minmax",
            },
            "input_activations": None,
            "output_activations": None,
        }
    },
    "kv_cache_scheme": None,
}


#: compressed-tensors INT4 W4A16, symmetric, group 32: `weight_packed` int32, `weight_scale` bf16, `weight_shape`
INT4_G32 = Encoding(
    "ct_int4",
    "mxint4_block_scale",
    _pack_quantized,
    lambda t: quant.int4_dequantize(t["weight_packed"], t["weight_scale"]),
    grid=_int4_grid,
    quant_config=compressed_tensors_config(EXAMPLE_CONFIG),
)


class CtInt4(WeightFormat):
    name = "ct_int4"
    title = "INT4 W4A16 group 32 (compressed-tensors pack-quantized)"
    encoding = INT4_G32
    hook_module = "sglang_trtllm_moe.builtins.int4_hooks"
    #: SGLang's only path for this scheme's MoE layers on the TRT-LLM-Gen kernels (its scheme asserts
    #: is_flashinfer_trtllm(): no routed path)
    quantizations = {TRTLLM: frozenset({"compressed-tensors"})}
    gated_activations = frozenset({"silu"})
    non_gated_activations = frozenset()
    activation_note = "flashinfer's MxInt4 launcher computes SwiGLU only and SGLang's scheme asserts a gated layer"
    #: FusedMoE rounds the per-rank intermediate to 128 on flashinfer_trtllm (zero-filling the pad); the kernel's
    #: 128-byte K blocks need 256 (`supports_intermediate`)
    intermediate_align = (128, 128)
    hidden_align = K_BLOCK
    params = (
        ParamLayout("w13_weight_packed", "w13", block_major_k=True, byte_xor=NIBBLE_SIGN),
        ParamLayout("w13_weight_scale", "w13", sf_swizzle=True),
        ParamLayout("w2_weight_packed", "w2", block_major_k=True, byte_xor=NIBBLE_SIGN),
        ParamLayout("w2_weight_scale", "w2", sf_swizzle=True),
    )
    # validation (LoadRule, derived): int32 words only (uint8 / int8 bytes would be value-converted by copy_), scales
    # any 16/32/64-bit float (SGLang's copy_ converts, as its loader does), finite and >= 0 (a zero group scale is a
    # zero block: SGLang's padded loading zero-fills the pad groups the same way)
    #: measured on every release: SGLang's prep reads flashinfer's CPU index helpers only (its CUDA-only interleave is
    #: the torch swizzle, sandbox/sglang_oracle.py), which the oracle flashinfer of 0.5.11 - 0.5.15 has too
    upstream_verdicts = (
        defer.Verdict(
            defer.EVERY_RELEASE.releases,
            False,
            "measured: SGLang's prep replace_parameter()s all four tensors (uint8 block-major weights, flat bf16 "
            "scales) without weight_loader, so the next load raises AttributeError",
        ),
    )

    def describes(self, checkpoint: Checkpoint) -> bool:
        return checkpoint.quantization == "compressed-tensors" and checkpoint.quant_scheme == "mxint4"

    def config_scheme(self, weights: Mapping[str, Any], input_activations: Any) -> str | None:
        """SGLang's `CompressedTensorsConfig._is_mxint4a16` (with `_is_wNa16_group_channel`, which it is asked under):
        INT4 weights per group of 32, symmetric, static, no activation quantization — the scheme it serves with
        CompressedTensorsMxInt4MoE on flashinfer_trtllm (Kimi-K2's): "mxint4"."""
        mxint4a16 = (
            weights.get("type") == "int"
            and weights.get("num_bits") == 4
            and weights.get("strategy") == "group"
            and weights.get("group_size") == 32
            and bool(weights.get("symmetric", True))
            and not weights.get("dynamic", False)
            and not input_activations
        )
        return "mxint4" if mxint4a16 else None

    def refusal(self, checkpoint: Checkpoint) -> str | None:
        scheme = checkpoint.quant_scheme or ""
        if checkpoint.quantization == "compressed-tensors" and scheme.startswith("int"):
            return (
                f"compressed-tensors {scheme.upper()} weights other than W4A16 symmetric static group 32 (what "
                "SGLang's CompressedTensorsMxInt4MoE serves on flashinfer_trtllm) run on SGLang's Marlin / triton MoE"
            )
        return None

    def supports_intermediate(self, per_rank: int, gated: bool) -> Support:
        padded = self.padded_intermediate(per_rank, gated)
        if padded % K_BLOCK:
            return False, (
                f"intermediate size {per_rank} per rank (allocated {padded}) is not a multiple of {K_BLOCK}: the "
                "MxInt4 kernel's 128-byte K blocks of w2 need it (SGLang's own preparation fails there too); fewer "
                "tensor-parallel ranks per expert give a larger one"
            )
        return SUPPORTED

    # ---- layout -------------------------------------------------------------------------------------------------
    def check_layout(self, layer: Layer) -> str | None:
        """The activation first (the serving role's), then INT4's own sizes (they name what a user can change), then
        the generic rules."""
        cfg = layer.moe_runner_config
        problem = self.supports_activation(cfg.activation, bool(cfg.is_gated))[1]
        return problem or self._int4_problem(layer) or super().check_layout(layer)

    def _int4_problem(self, layer: Layer) -> str | None:
        cfg = layer.moe_runner_config
        if getattr(cfg, "gemm1_alpha", None) is not None or getattr(cfg, "gemm1_clamp_limit", None) is not None:
            return (
                "SwiGLU alpha / clamp limit: SGLang's MxInt4 call passes the model's floats where the kernel takes "
                "per-expert tensors"
            )
        e, m, k8 = layer.w13_weight_packed.shape
        h, i = k8 * 8, layer.w2_weight_packed.shape[2] * 8
        for n, dtype, shape in (
            ("w13_weight_packed", torch.int32, (e, m, h // 8)),
            ("w2_weight_packed", torch.int32, (e, h, i // 8)),
            ("w13_weight_scale", torch.bfloat16, (e, m, h // 32)),
            ("w2_weight_scale", torch.bfloat16, (e, h, i // 32)),
        ):
            t = getattr(layer, n)
            if t.dtype != dtype or tuple(t.shape) != shape:
                return f"{n} is {tuple(t.shape)} {t.dtype}, expected {shape} {dtype} (compressed-tensors W4A16)"
        if m != 2 * i:
            return f"w13 has {m} rows for intermediate {i}: the MxInt4 kernel is gated (2 x intermediate rows)"
        if h % K_BLOCK or i % K_BLOCK:
            return (
                f"hidden {h} / intermediate {i} per rank: the MxInt4 kernel's 128-byte K blocks need multiples of "
                f"{K_BLOCK} (SGLang's own preparation fails there too)"
            )
        return None

    # ---- checker ------------------------------------------------------------------------------------------------
    def scale_of(self, name: str) -> str | None:
        if name.endswith("_weight_packed"):
            return name[: -len("_packed")] + "_scale"
        return super().scale_of(name)

    # ---- the kernel ---------------------------------------------------------------------------------------------
    def kernel_args(self, call: KernelCall, routing: dict, routed: bool) -> dict:
        """SGLang's `CompressedTensorsMxInt4MoE.apply_weights` call, on views of the plugin-prepared storage."""
        from .. import layouts

        layer, qi = call.layer, call.quant_info
        if routing.get("routed_scaling_factor") is None:
            routing["routed_scaling_factor"] = 1.0  # SGLang: `routed_scaling_factor if not None else 1.0`
        if not routed and routing.get("routing_method_type") == RoutingMethodType.DeepSeekV3:  # float32, as SGLang
            routing["routing_logits"] = routing["routing_logits"].to(torch.float32)
        e = layer.w13_weight_packed.shape[0]
        return dict(
            hidden_states=call.hidden,
            gemm1_weights=layouts.block_major_k_view(layer.w13_weight_packed.data.view(torch.uint8)),
            gemm1_weights_scale=layer.w13_weight_scale.data.view(e, -1),
            gemm1_alpha=None,
            gemm1_beta=None,
            gemm1_clamp_limit=None,
            gemm2_weights=layouts.block_major_k_view(layer.w2_weight_packed.data.view(torch.uint8)),
            gemm2_weights_scale=layer.w2_weight_scale.data.view(e, -1),
            num_experts=qi.global_num_experts,
            intermediate_size=int(layer.w2_weight_packed.shape[2]) * 8,
            local_expert_offset=qi.local_expert_offset,
            local_num_experts=qi.local_num_experts,
            **routing,
        )


CT_INT4 = CtInt4()
