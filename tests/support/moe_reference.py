"""A plain MoE written independently of the plugin: per token, per selected expert, from checkpoint tensors.

Dequantizes the ModelOpt NVFP4 checkpoint (value = e2m1 * e4m3 scale * weight_scale_2, flashinfer's own CPU
dequant convention) and runs gate/up/down in float32 — no layouts, no emulator code."""

from __future__ import annotations

import torch
from flashinfer.quantization.fp4_quantization import _e2m1_and_ufp8sf_scale_to_float_cpu as fi_dequant  # oracle

from sglang_trtllm_moe.sandbox.layers import DOWN, GATE, UP


def dequant_nvfp4(ck, name):
    packed, sf, s2 = ck[name + "weight"], ck[name + "weight_scale"], ck[name + "weight_scale_2"]
    rows = packed.shape[0]
    out = fi_dequant(packed.view(torch.uint8), sf.view(torch.uint8), s2.float().reshape(1), 16, 1, False)
    return out.reshape(rows, -1).float()


def _round_nvfp4(t, scale):
    """Round to NVFP4 with a static input scale, as the kernel does to its activations (quantizer checked
    bit-exact against flashinfer's dequant in test_quant.py)."""
    from sglang_trtllm_moe.quant import nvfp4_dequantize, nvfp4_quantize

    packed, sf = nvfp4_quantize(t, 1.0 / scale)
    return nvfp4_dequantize(packed, sf, 1.0 / scale)


def reference_moe(x, topk_ids, topk_weights, ck, spec, round_like_kernel=False):
    x = x.float()
    if round_like_kernel:
        a1 = max(float(v) for k, v in ck.items() if k.endswith("input_scale") and "down_proj" not in k)
        a2 = max(float(v) for k, v in ck.items() if k.endswith("input_scale") and "down_proj" in k)
        x = _round_nvfp4(x, a1)
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for k in range(topk_ids.shape[1]):
            e = int(topk_ids[t, k])
            base = f"experts.{e}."
            w2 = dequant_nvfp4(ck, base + DOWN + ".")
            if spec.gated:
                g = dequant_nvfp4(ck, base + GATE + ".") @ x[t]
                u = dequant_nvfp4(ck, base + UP + ".") @ x[t]
                h = torch.nn.functional.silu(g) * u
            else:
                h = torch.relu(dequant_nvfp4(ck, base + UP + ".") @ x[t]) ** 2
            if round_like_kernel:
                h = _round_nvfp4(h[None], a2)[0]
            out[t] += float(topk_weights[t, k]) * (w2 @ h)
    return out
