"""Compressed-tensors NVFP4 (`CompressedTensorsW4A4Nvfp4MoE`, llm-compressor): NVFP4 bytes, other bookkeeping.

* Parameters are `w13_weight_packed` / `w2_weight_packed` (SGLang renames them to `w13_weight` / `w2_weight` in
  its prep and deletes the originals, so a later reload by checkpoint name has nowhere to go; the plugin keeps
  them and registers the kernel names as aliases of the same Parameter).
* On flashinfer_trtllm the loader puts w13 in checkpoint order [gate; up] (`load_up_proj_weight_first` is False)
  and SGLang swaps the halves afterwards (`reorder_w1w3_to_w3w1`); here the swap is folded into the w13 row map.
* Global scales are *quantize* scales: weight_global_scale = 1 / ModelOpt weight_scale_2, input_global_scale =
  1 / input_scale. SGLang's trtllm path takes the min input_global_scale (= max input scale), as ModelOpt takes the
  max input_scale. SGLang uses the gate's weight global scale for both halves (warning that accuracy "may be
  affected" when they differ); the kernel takes the up scale separately through output1_scale_scalar, so ours keeps
  it: identical scalars when gate and up share a global scale (what llm-compressor writes), exact ones when they do
  not. Non-gated (relu2): g1_scale_c = 1/a2 as for ModelOpt (SGLang multiplies in g1_alphas a second time there).
"""

from __future__ import annotations

import torch

from .. import quant
from ..compat import defer
from .base import TRTLLM, Checkpoint, Layer, ParamLayout, Support, WeightFormat
from .encodings import Calibration, Encoding, Tensors, compressed_tensors_config, nvfp4_grid
from .nvfp4 import NvFp4


def _llm_compressor_nvfp4(w: torch.Tensor, calib: Calibration) -> Tensors:
    """One projection as llm-compressor writes it: gate and up share one global scale (fused), down its own; its
    global scales are quantize scales (the inverses of ModelOpt's weight_scale_2 / input_scale)."""
    gs = float(quant.FP8_E4M3_MAX * 6 / (w.abs().max() if calib.down else calib.gate_up_amax))
    packed, sf = quant.nvfp4_quantize(w, gs)
    return {
        "weight_packed": packed,
        "weight_scale": sf,
        "weight_global_scale": torch.tensor([gs], dtype=torch.float32),
        "input_global_scale": torch.tensor([quant.FP8_E4M3_MAX * 6 / calib.input_amax], dtype=torch.float32),
    }


#: the config.json `quantization_config` of an llm-compressor NVFP4 (W4A4, tensor_group, group 16) checkpoint
EXAMPLE_CONFIG = {
    "quant_method": "compressed-tensors",
    "format": "nvfp4-pack-quantized",
    "ignore": [],
    "config_groups": {
        "group_0": {
            "targets": ["Linear"],
            "weights": {
                "num_bits": 4,
                "type": "float",
                "strategy": "tensor_group",
                "group_size": 16,
                "symmetric": True,
                "dynamic": False,
            },
            "input_activations": {
                "num_bits": 4,
                "type": "float",
                "strategy": "tensor_group",
                "group_size": 16,
                "symmetric": True,
                "dynamic": "local",
            },
        }
    },
}


#: compressed-tensors NVFP4: `weight_packed`, `weight_scale` e4m3 per 16, `weight_global_scale`,
#: `input_global_scale` (quantize scales)
CT_NVFP4_WEIGHTS = Encoding(
    "ct_nvfp4",
    "fp4_block_scale",
    _llm_compressor_nvfp4,
    lambda t: quant.nvfp4_dequantize(t["weight_packed"], t["weight_scale"], float(t["weight_global_scale"])),
    grid=nvfp4_grid,
    quant_config=compressed_tensors_config(EXAMPLE_CONFIG),
)


class CtNvFp4(NvFp4):
    name = "ct_nvfp4"
    title = "NVFP4 (compressed-tensors nvfp4)"
    encoding = CT_NVFP4_WEIGHTS
    #: SGLang has no routed path for compressed-tensors (handle_moe_kernel_config asserts)
    quantizations = {TRTLLM: frozenset({"compressed-tensors"})}
    #: SGLang's own prepared FP4-leaf layers are read as ModelOpt NVFP4 (the same bytes), not as this format
    sglang_leaf = None
    params = (
        ParamLayout("w13_weight_packed", "w13"),
        ParamLayout("w13_weight_scale", "w13", sf_swizzle=True),
        ParamLayout("w2_weight_packed", "w2"),
        ParamLayout("w2_weight_scale", "w2", sf_swizzle=True),
    )
    scalar_params = (
        "w13_weight_global_scale",
        "w2_weight_global_scale",
        "w13_input_global_scale",
        "w2_input_global_scale",
    )
    upstream_verdicts = (
        defer.Verdict(
            defer.CPU_ORACLE.releases,
            False,
            "measured: SGLang renames the *_packed Parameters at prep, so the next load by checkpoint name raises "
            "KeyError",
        ),
        defer.read_before_cpu_oracle(),
    )

    def supports_activation(self, activation: str, gated: bool) -> Support:
        # its apply is compressed-tensors' (or the plugin's runner, before 0.5.17), not ModelOpt's activation table
        return WeightFormat.supports_activation(self, activation, gated)

    #: kernel-side names SGLang's apply reads -> the loaded Parameter they alias
    aliases = {"w13_weight": "w13_weight_packed", "w2_weight": "w2_weight_packed"}

    def row_map(self, layer: Layer, p: ParamLayout, t: torch.Tensor) -> torch.Tensor:
        rmap = super().row_map(layer, p, t)
        if p.group == "w13" and self.is_gated(layer):
            m = t.shape[1]
            swap = (torch.arange(m, device=rmap.device) + m // 2) % m  # checkpoint [gate; up] -> [up; gate]
            rmap = swap[rmap]
        return rmap

    def describes(self, checkpoint: Checkpoint) -> bool:
        return checkpoint.quantization == "compressed-tensors" and checkpoint.quant_scheme == "nvfp4"

    def refusal(self, checkpoint: Checkpoint) -> str | None:
        if checkpoint.quantization == "compressed-tensors" and not self.describes(checkpoint):
            return f"compressed-tensors scheme {checkpoint.quant_scheme or 'unknown'!r} is not NVFP4"
        return None

    def scale_of(self, name: str) -> str | None:
        if name.endswith("_weight_packed"):
            return name[: -len("_packed")] + "_scale"
        return super().scale_of(name)

    def dequant_scales(self, layer: Layer) -> dict[str, torch.Tensor]:
        """compressed-tensors stores quantization scales: the dequantization scale is 1 / global scale (gate, up)."""
        wgs = layer.w13_weight_global_scale.data.to(torch.float32)
        e = wgs.shape[0]
        gate = 1 / wgs.reshape(e, -1)[:, 0]
        up = 1 / wgs[:, 1] if (self.is_gated(layer) and wgs.dim() == 2 and wgs.shape[1] >= 2) else gate
        return {"w1": gate, "w3": up, "w2": 1 / layer.w2_weight_global_scale.data.to(torch.float32).reshape(e)}

    def compute_scalars(self, layer: Layer) -> dict[str, torch.Tensor]:
        gated = self.is_gated(layer)
        e = layer.w13_weight_packed.shape[0]
        # exactly SGLang's expressions (compressed_tensors_w4a4_nvfp4_moe.py), so the bits match
        a1_q = layer.w13_input_global_scale.data.min().to(torch.float32).expand(e)
        a2_q = layer.w2_input_global_scale.data.min().to(torch.float32).expand(e)
        wgs = layer.w13_weight_global_scale.data
        s_gate = 1 / wgs[:, 0]
        s_up = 1 / wgs[:, 1] if (gated and wgs.dim() == 2 and wgs.shape[1] >= 2) else s_gate
        g1 = (1 / a1_q) * s_gate
        g1_up = (1 / a1_q) * s_up
        g2 = ((1 / a2_q) * (1 / layer.w2_weight_global_scale.data)).to(torch.float32)
        scale_c = (a2_q * g1_up).to(torch.float32) if gated else a2_q.contiguous()
        return {
            "g1_alphas": g1.to(torch.float32),
            "g1_alphas_up": g1_up.to(torch.float32),
            "g2_alphas": g2,
            "w13_input_scale_quant": a1_q.contiguous(),
            "w2_input_scale_quant": a2_q.contiguous(),
            "g1_scale_c": scale_c,
        }


CT_NVFP4 = CtNvFp4()
