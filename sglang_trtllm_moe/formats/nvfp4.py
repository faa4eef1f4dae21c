"""NVFP4 (ModelOpt / compressed-tensors W4A4): packed e2m1 weights, e4m3 block scales per 16, fp32 global scales.

Kernel layout (flashinfer `trtllm_fp4_block_scale_moe`): w13 rows [up; gate] → gated interleave → shuffle_matrix_a
blocks; the block scales take the same row map, then the 128x4 swizzle; w2 and its scales: shuffle only.
Scalars follow SGLang's trtllm path exactly (a1/a2 = max of the per-expert input scales), so a layer prepared
here and one prepared by SGLang feed the kernel the same numbers:
  g1_alphas = a1 * s2_gate, g1_alphas_up = a1 * s2_up, g2_alphas = a2 * s2_w2,
  w13_input_scale_quant = 1/a1, w2_input_scale_quant = 1/a2,
  g1_scale_c = g1_alphas_up / a2 (gated), 1/a2 per expert (non-gated).
"""

from __future__ import annotations

from typing import ClassVar

import torch

from .. import quant
from ..compat import defer, features
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
from .encodings import Calibration, Encoding, Tensors, modelopt_config, modelopt_hf_config, nvfp4_grid


def _modelopt_nvfp4(w: torch.Tensor, calib: Calibration) -> Tensors:
    """One projection as ModelOpt writes it: its own global scale (weight_scale_2 = its inverse, a dequantization
    scale), the static input scale amax / (448 * 6)."""
    gs = float(quant.FP8_E4M3_MAX * 6 / w.abs().max())
    packed, sf = quant.nvfp4_quantize(w, gs)
    return {
        "weight": packed,
        "weight_scale": sf,
        "weight_scale_2": torch.tensor(1.0 / gs, dtype=torch.float32),
        "input_scale": torch.tensor(calib.input_amax / (quant.FP8_E4M3_MAX * 6), dtype=torch.float32),
    }


#: ModelOpt NVFP4: `weight` packed e2m1, `weight_scale` e4m3 per 16, `weight_scale_2` and `input_scale` fp32
MODELOPT_NVFP4 = Encoding(
    "nvfp4",
    "fp4_block_scale",
    _modelopt_nvfp4,
    lambda t: quant.nvfp4_dequantize(t["weight"], t["weight_scale"], 1.0 / float(t["weight_scale_2"])),
    grid=nvfp4_grid,
    quant_config=modelopt_config("NVFP4", group_size=quant.NVFP4_BLOCK),
    hf_quant_config=modelopt_hf_config,
)


class NvFp4(WeightFormat):
    name = "nvfp4"
    title = "NVFP4 (modelopt_fp4)"
    encoding = MODELOPT_NVFP4
    hook_module = "sglang_trtllm_moe.builtins.nvfp4_hooks"
    upstream_verdicts: tuple[defer.Verdict, ...] = (
        defer.Verdict(
            defer.EVERY_RELEASE.releases,
            False,
            "measured: a one-expert update re-shuffles the experts that were not reloaded (w13/w2 weights and "
            "block scales differ from a fresh load); a tensor update is never prepared (kernel scalars stale)",
        ),
    )
    quantizations = {TRTLLM: frozenset({"modelopt_fp4"}), TRTLLM_ROUTED: frozenset({"modelopt_fp4"})}
    #: SGLang's own trtllm NVFP4 prep produces this layout (its FP4 leaf's layers, emulated as NVFP4)
    sglang_leaf: ClassVar[str | None] = "fp4"
    #: flashinfer's FP4 launcher takes Swiglu / Geglu gated and Silu / Gelu / Relu2 non-gated from the first release
    #: SGLang 0.5.11 pins (activation_type); "situ" needs clamp parameters the plugin does not prepare
    gated_activations = frozenset({"silu", "gelu"})
    non_gated_activations = frozenset({"silu", "gelu", "relu2"})
    #: gated: 64 per rank, because the scale-row permutation asserts 2*Ip % 128 == 0 (flashinfer#3206, vllm#46880) and
    #: SGLang's NVFP4 create_weights pads to exactly that; non-gated: 128 (the layer's own rounding on trtllm)
    intermediate_align = (64, 128)
    params = (
        ParamLayout("w13_weight", "w13"),
        ParamLayout("w13_weight_scale", "w13", sf_swizzle=True),
        ParamLayout("w2_weight", "w2"),
        ParamLayout("w2_weight_scale", "w2", sf_swizzle=True),
    )
    scalar_params = ("w13_weight_scale_2", "w2_weight_scale_2", "w13_input_scale", "w2_input_scale")

    def describes(self, checkpoint: Checkpoint) -> bool:
        """A serialized ModelOpt NVFP4 checkpoint; `--quantization modelopt_fp4` on one without NVFP4 metadata is
        quantized online (formats/nvfp4_online.py NvFp4OnlineTensor)."""
        return checkpoint.quantization == "modelopt_fp4" and not checkpoint.online

    def supports_activation(self, activation: str, gated: bool) -> Support:
        if activation == "gelu" and not features.MODELOPT_NVFP4_GELU.present():
            return False, (
                f"{'gated' if gated else 'non-gated'} 'gelu' is not mapped by this SGLang release's ModelOpt NVFP4 "
                "MoE method (silu / relu2 only before 0.5.13; it asserts on any other activation)"
            )
        return super().supports_activation(activation, gated)

    def dequant_scales(self, layer: Layer) -> dict[str, torch.Tensor]:
        """ModelOpt's weight_scale_2 is the dequantization scale (gate / up columns in the stored order of
        features.NVFP4_W13_SCALE_2_UP_GATE, as `compute_scalars` reads them)."""
        s2 = layer.w13_weight_scale_2.data.to(torch.float32)
        e = s2.shape[0]
        if self.is_gated(layer) and s2.dim() == 2 and s2.shape[1] >= 2:
            gate, up = (s2[:, 1], s2[:, 0]) if features.NVFP4_W13_SCALE_2_UP_GATE.present() else (s2[:, 0], s2[:, 1])
        else:
            gate = up = s2.reshape(e)
        return {"w1": gate, "w3": up, "w2": layer.w2_weight_scale_2.data.to(torch.float32).reshape(e)}

    def compute_scalars(self, layer: Layer) -> dict[str, torch.Tensor]:
        gated = self.is_gated(layer)
        a1 = layer.w13_input_scale.data.max().to(torch.float32)
        a2 = layer.w2_input_scale.data.max().to(torch.float32)
        if getattr(getattr(layer, "quant_config", None), "use_per_token_activation", False):
            a1 = torch.ones_like(a1)
            a2 = torch.ones_like(a2)
        s2 = layer.w13_weight_scale_2.data
        if gated and s2.dim() == 2 and s2.shape[1] >= 2:  # stored order: features.NVFP4_W13_SCALE_2_UP_GATE
            gate, up = (s2[:, 1], s2[:, 0]) if features.NVFP4_W13_SCALE_2_UP_GATE.present() else (s2[:, 0], s2[:, 1])
        else:
            gate = up = s2.reshape(s2.shape[0])
        g1 = (a1 * gate).to(torch.float32)
        g1_up = (a1 * up).to(torch.float32)
        w2_q = (1 / a2).to(torch.float32)
        e = g1.shape[0]
        act = layer.moe_runner_config.activation
        if gated and act != "situ":
            scale_c = (w2_q * g1_up).to(torch.float32)
        else:
            scale_c = w2_q.expand(e).contiguous()
        return {
            "g1_alphas": g1,
            "g1_alphas_up": g1_up,
            "g2_alphas": (a2 * layer.w2_weight_scale_2.data).to(torch.float32),
            "w13_input_scale_quant": (1 / a1).to(torch.float32),
            "w2_input_scale_quant": w2_q,
            "g1_scale_c": scale_c,
        }

    def activation_args(self, call: KernelCall) -> dict:
        """The kernel's activation arguments (by keyword): NVFP4 with the layer's static 1/a1."""
        qi = call.quant_info
        if getattr(qi, "use_per_token_activation", False):
            raise NotImplementedError(
                f"{self.name}: per-token NVFP4 activations belong to the nvfp4_online format (formats/nvfp4_online.py)"
            )
        if call.on_kernel:
            from sglang.srt.layers.moe.moe_runner.flashinfer_trtllm import quantize_hidden_states_fp4

            hs, hs_sf = quantize_hidden_states_fp4(call.hidden, qi.w13_input_scale_quant)
        else:
            from ..quant import nvfp4_quantize

            hs, hs_sf = nvfp4_quantize(call.hidden, qi.w13_input_scale_quant)
        return dict(hidden_states=hs, hidden_states_scale=hs_sf.view(torch.float8_e4m3fn).reshape(hs.shape[0], -1))

    def kernel_args(self, call: KernelCall, routing: dict, routed: bool) -> dict:
        """SGLang's FP4 QuantInfo as its own leaf reads it; activations quantized to NVFP4 with the layer's 1/a1."""
        qi = call.quant_info
        swiglu = features.FP4_QUANT_INFO_SWIGLU.present()
        return dict(
            **self.activation_args(call),
            gemm1_weights=qi.w13_weight,
            gemm1_weights_scale=qi.w13_weight_scale.view(torch.float8_e4m3fn),
            gemm1_bias=None,
            gemm1_alpha=qi.gemm1_alpha if swiglu else None,
            gemm1_beta=qi.gemm1_beta if swiglu else None,
            gemm1_clamp_limit=qi.gemm1_clamp_limit if swiglu else None,
            gemm2_weights=qi.w2_weight,
            gemm2_weights_scale=qi.w2_weight_scale.view(torch.float8_e4m3fn),
            gemm2_bias=None,
            output1_scale_scalar=qi.g1_scale_c,
            output1_scale_gate_scalar=qi.g1_alphas,
            output2_scale_scalar=qi.g2_alphas,
            num_experts=qi.global_num_experts,
            intermediate_size=qi.intermediate_size_per_partition,
            local_expert_offset=qi.local_expert_offset,
            local_num_experts=qi.local_num_experts,
            **routing,
        )


NVFP4 = NvFp4()
