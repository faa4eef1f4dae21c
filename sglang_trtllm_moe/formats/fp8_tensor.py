"""FP8 per-tensor (ModelOpt FP8, SGLang `fp8` with static activation scales): e4m3 weights, one fp32 scale per expert
and shard, static input scales.

Kernel layout (flashinfer `trtllm_fp8_per_tensor_scale_moe`, MajorK): w13 rows [up; gate] -> gated interleave ->
shuffle_matrix_a(128); w2: shuffle only. The loaders leave the halves in different orders:
  * ModelOptFp8MoEMethod: [gate (w1); up (w3)] (no `load_up_proj_weight_first`); SGLang swaps the halves at prep
    (`align_fp8_moe_weights_for_flashinfer_trtllm(swap_w13_halves=True)`), so our row map folds that swap in;
  * Fp8MoEMethod on flashinfer_trtllm: FusedMoE._weight_loader_impl swaps shard ids w1<->w3, so w13 is already
    [up; gate] and `w13_weight_scale[:, 0]` is the up scale.
In both, scale column k belongs to the half stored at position k.

Scalars: SGLang re-quantizes w1 and w3 to max(s_w1, s_w3) (lossy: the smaller-scale half loses up to one e4m3 step
per element) because its other FP8 kernels take one w13 scale. This kernel takes separate gate and up scalars, so
the bytes stay as loaded and
  output1_scales_gate_scalar = a1 * s_gate, output1_scales_scalar = a1 * s_up / a2 (gated; 1/a2 non-gated, the
  gate scalar then holds the dequant a1 * s_w1), output2_scales_scalar = a2 * s_w2,
with a1/a2 = max over experts of the input scales (SGLang's choice: the kernel quantizes activations once per
layer). With s_gate == s_up these are SGLang's numbers bit for bit (same float ops in the same order).
"""

from __future__ import annotations

import torch

from .. import layouts
from .base import ParamLayout, WeightFormat

#: (activation, gated) pairs SGLang's FP8 trtllm path accepts (flashinfer_trtllm.py `_SUPPORTED_FP8_ACTIVATIONS`)
SUPPORTED_ACTIVATIONS = {("silu", True), ("silu", False), ("relu2", False)}


def _swap_halves_map(m: int) -> torch.Tensor:
    return (torch.arange(m, dtype=torch.long) + m // 2) % m


class Fp8PerTensor(WeightFormat):
    params = (ParamLayout("w13_weight", "w13"), ParamLayout("w2_weight", "w2"))
    scalar_params = ("w13_weight_scale", "w2_weight_scale", "w13_input_scale", "w2_input_scale")

    def __init__(self, name: str, gate_first: bool):
        self.name = name
        #: True when the loader stores w13 as [gate; up] (ModelOpt), False for [up; gate] (Fp8MoEMethod)
        self.gate_first = gate_first

    def row_map(self, layer, p: ParamLayout, t: torch.Tensor) -> torch.Tensor:
        base = super().row_map(layer, p, t)
        if p.group != "w13" or not self.gate_first or not self.is_gated(layer):
            return base
        m, dev = t.shape[1], layouts._norm_device(t.device)
        # kernel row r = logical [up; gate] row base[r] = stored [gate; up] row swap[base[r]]
        return layouts._cached(("fp8-w13-gate-first", m, True, 128, dev), lambda: _swap_halves_map(m).to(dev)[base])

    def check_layout(self, layer) -> str | None:
        cfg = layer.moe_runner_config
        if (cfg.activation, bool(cfg.is_gated)) not in SUPPORTED_ACTIVATIONS:
            return (f"activation {cfg.activation!r} ({'gated' if cfg.is_gated else 'non-gated'}) is not served by the "
                    "TRT-LLM FP8 per-tensor kernel path (supported: gated silu, non-gated silu/relu2)")
        for knob in ("gemm1_alpha", "gemm1_beta", "gemm1_clamp_limit", "swiglu_limit"):
            if getattr(cfg, knob, None) is not None:
                return f"{knob} is set, but the FP8 per-tensor kernel has no SwiGLU alpha/beta/clamp"
        for n in ("w13_input_scale", "w2_input_scale", "w13_weight_scale", "w2_weight_scale"):
            if getattr(layer, n, None) is None:
                return (f"{n} is missing: the per-tensor kernel needs static input and weight scales "
                        "(activation_scheme 'static')")
        return super().check_layout(layer)

    def compute_scalars(self, layer) -> dict[str, torch.Tensor]:
        a1 = layer.w13_input_scale.data.max().to(torch.float32)
        a2 = layer.w2_input_scale.data.max().to(torch.float32)
        s = layer.w13_weight_scale.data.to(torch.float32)
        s = s.reshape(s.shape[0], -1)
        if self.is_gated(layer):
            gate, up = (s[:, 0], s[:, 1]) if self.gate_first else (s[:, 1], s[:, 0])
            out1 = up * a1 * (1.0 / a2)
        else:
            gate = s[:, 0]
            out1 = torch.ones_like(gate) * (1.0 / a2)
        return {
            "output1_scales_scalar": out1.contiguous(),
            "output1_scales_gate_scalar": (gate * a1).contiguous(),
            "output2_scales_scalar": (a2 * layer.w2_weight_scale.data.to(torch.float32)).contiguous(),
            "w13_input_scale_max": a1,
        }


FP8_TENSOR_MODELOPT = Fp8PerTensor("fp8_tensor_modelopt", gate_first=True)
FP8_TENSOR = Fp8PerTensor("fp8_tensor", gate_first=False)
