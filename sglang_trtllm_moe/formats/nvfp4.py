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

import torch

from .base import ParamLayout, WeightFormat


def w13_scales_up_first() -> bool:
    """True where SGLang's trtllm weight loader stores the per-tensor w13 scales [Up, Gate] (0.5.11-0.5.22)."""
    from ..compat.releases import installed_version

    v = installed_version()
    return v is not None and v.release[:3] < (0, 5, 23)


class NvFp4(WeightFormat):
    name = "nvfp4"
    params = (
        ParamLayout("w13_weight", "w13"),
        ParamLayout("w13_weight_scale", "w13", sf_swizzle=True),
        ParamLayout("w2_weight", "w2"),
        ParamLayout("w2_weight_scale", "w2", sf_swizzle=True),
    )
    scalar_params = ("w13_weight_scale_2", "w2_weight_scale_2", "w13_input_scale", "w2_input_scale")

    def dequantize_param(self, name, weight, scale):
        """Packed e2m1 `[E, M, K/2]` x linear e4m3 `[E, M, K/16]` -> `[E, M, K]` (global scale_2 excluded: it is a
        scalar parameter). Tolerance: the e2m1 grid step above each code's magnitude, times its block scale."""
        from .. import quant

        if scale is None:
            return super().dequantize_param(name, weight, scale)
        values = quant.nvfp4_dequantize(weight, scale, 1.0)
        steps = torch.tensor([0.5, 0.5, 0.5, 0.5, 1.0, 1.0, 2.0, 2.0], device=weight.device)
        u8 = weight.view(torch.uint8)
        codes = torch.stack([u8 & 0x07, (u8 >> 4) & 0x07], dim=-1).flatten(-2)
        sf = scale.view(torch.float8_e4m3fn).float() if scale.dtype == torch.uint8 else scale.float()
        return values, steps[codes.long()] * sf.repeat_interleave(16, dim=-1)

    def compute_scalars(self, layer) -> dict[str, torch.Tensor]:
        gated = self.is_gated(layer)
        a1 = layer.w13_input_scale.data.max().to(torch.float32)
        a2 = layer.w2_input_scale.data.max().to(torch.float32)
        if getattr(getattr(layer, "quant_config", None), "use_per_token_activation", False):
            a1 = torch.ones_like(a1)
            a2 = torch.ones_like(a2)
        s2 = layer.w13_weight_scale_2.data
        if gated and s2.dim() == 2 and s2.shape[1] >= 2:
            # <= 0.5.22 FusedMoE's loader swaps the w1/w3 shard ids for flashinfer_trtllm ("w31") for the per-tensor
            # scales too, so scale_2 is stored [Up, Gate]; SGLang's own prep there still reads [:, 0] as the gate
            # (gate/up alphas swapped whenever the two scales differ). 0.5.23 keeps them [Gate, Up].
            gate, up = (s2[:, 1], s2[:, 0]) if w13_scales_up_first() else (s2[:, 0], s2[:, 1])
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


NVFP4 = NvFp4()


class CtNvFp4(NvFp4):
    """Compressed-tensors NVFP4 (`CompressedTensorsW4A4Nvfp4MoE`): same bytes as ModelOpt, different bookkeeping.

    * Parameters are `w13_weight_packed` / `w2_weight_packed` (SGLang renames them to `w13_weight` / `w2_weight` in
      its prep and deletes the originals, so a later reload by checkpoint name has nowhere to go; the plugin keeps
      them and registers the kernel names as aliases of the same Parameter).
    * On flashinfer_trtllm the loader puts w13 in checkpoint order [gate; up] (`load_up_proj_weight_first` is False)
      and SGLang swaps the halves afterwards (`reorder_w1w3_to_w3w1`); here the swap is folded into the w13 row map.
    * Global scales are *quantize* scales (llm-compressor): weight_global_scale = 1 / ModelOpt weight_scale_2,
      input_global_scale = 1 / input_scale. SGLang's trtllm path takes the min input_global_scale (= max input
      scale), as ModelOpt takes the max input_scale. SGLang uses the gate's weight global scale for both halves
      (warning that accuracy "may be affected" when they differ); the kernel takes the up scale separately through
      output1_scale_scalar, so ours keeps it: identical scalars when gate and up share a global scale (what
      llm-compressor writes), exact ones when they do not. Non-gated (relu2): g1_scale_c = 1/a2 as for ModelOpt
      (SGLang multiplies in g1_alphas a second time there).
    """

    name = "ct_nvfp4"
    params = (
        ParamLayout("w13_weight_packed", "w13"),
        ParamLayout("w13_weight_scale", "w13", sf_swizzle=True),
        ParamLayout("w2_weight_packed", "w2"),
        ParamLayout("w2_weight_scale", "w2", sf_swizzle=True),
    )
    scalar_params = ("w13_weight_global_scale", "w2_weight_global_scale", "w13_input_global_scale",
                     "w2_input_global_scale")
    #: kernel-side names SGLang's apply reads -> the loaded Parameter they alias
    aliases = {"w13_weight": "w13_weight_packed", "w2_weight": "w2_weight_packed"}

    def row_map(self, layer, p, t):
        rmap = super().row_map(layer, p, t)
        if p.group == "w13" and self.is_gated(layer):
            m = t.shape[1]
            swap = (torch.arange(m, device=rmap.device) + m // 2) % m  # checkpoint [gate; up] -> [up; gate]
            rmap = swap[rmap]
        return rmap

    def check_layout(self, layer):
        from ..runner import _GATED_ACT, _NON_GATED_ACT

        cfg = layer.moe_runner_config
        table = _GATED_ACT if cfg.is_gated else _NON_GATED_ACT
        if cfg.activation not in table:
            return (f"activation {cfg.activation!r} ({'gated' if cfg.is_gated else 'non-gated'}) is not served by the "
                    f"TRT-LLM-Gen NVFP4 MoE kernel (supported: {', '.join(sorted(table))})")
        return super().check_layout(layer)

    def scale_of(self, name):
        if name.endswith("_weight_packed"):
            return name[: -len("_packed")] + "_scale"
        return super().scale_of(name) if hasattr(super(), "scale_of") else None

    def compute_scalars(self, layer) -> dict[str, torch.Tensor]:
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
