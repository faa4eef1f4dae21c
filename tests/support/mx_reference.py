"""The MX formats' reference math, written independently of the plugin: a checkpoint's experts dequantized as the
checkpoint means them, and a float32 MoE of them (per token, per selected expert; no layouts, no emulator code)."""

from __future__ import annotations

import torch

from sglang_trtllm_moe import quant
from sglang_trtllm_moe.sandbox.layers import DOWN, GATE, UP, MoeSpec


def dequantized_experts(spec: MoeSpec, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """{f"experts.{e}.{proj}.weight": float32 [out, in]} as the checkpoint means them (reference math); gpt-oss also
    f"experts.{e}.{proj}.bias"."""
    out = {}
    if spec.fmt == "mxfp4_gptoss":
        w13 = quant.mxfp4_dequantize(tensors["w13_weight"], tensors["w13_weight_scale"])
        w2 = quant.mxfp4_dequantize(tensors["w2_weight"], tensors["w2_weight_scale"])
        b13, b2 = tensors["w13_weight_bias"].float(), tensors["w2_weight_bias"].float()
        for e in range(spec.num_experts):
            base = f"experts.{e}."
            out[base + f"{GATE}.weight"], out[base + f"{UP}.weight"] = w13[e, 0::2], w13[e, 1::2]
            out[base + f"{GATE}.bias"], out[base + f"{UP}.bias"] = b13[e, 0::2], b13[e, 1::2]
            out[base + f"{DOWN}.weight"], out[base + f"{DOWN}.bias"] = w2[e], b2[e]
        return out
    for e in range(spec.num_experts):
        for proj in spec.shards:
            base = f"experts.{e}.{proj}."
            if spec.fmt == "mxfp8":
                out[base + "weight"] = quant.mxfp8_dequantize(
                    tensors[base + "weight"], tensors[base + "weight_scale_inv"]
                )
            elif spec.fmt == "mxfp4_experts":
                s = tensors[base + "weight_scale_inv"]
                s = s if s.dtype == torch.float8_e8m0fnu else s.to(torch.float8_e8m0fnu)
                out[base + "weight"] = quant.mxfp4_dequantize(tensors[base + "weight"], s)
            else:
                raise NotImplementedError(spec.fmt)
    return out


def _mxfp8_round(v: torch.Tensor) -> torch.Tensor:
    q, s = quant.mxfp8_quantize(v.reshape(1, -1))
    return quant.mxfp8_dequantize(q, s).reshape(v.shape)


def reference_moe(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    weights: dict,
    spec: MoeSpec,
    *,
    alpha=None,
    beta=None,
    limit=None,
    biases: dict | None = None,
    round_like_kernel: str | None = None,
) -> torch.Tensor:
    """Float32 MoE of the dequantized checkpoint: per token sum_k w_k * W2 act(W13 x + b13) + b2. Gated SwiGLU with
    optional alpha/beta/clamp (x_glu = min(gate, L), x_lin = clamp(up, -L, L), silu_alpha(x_glu) * (x_lin + beta)),
    relu2. `round_like_kernel="mxfp8"` also rounds where the kernel does (activations and the bf16 intermediate to
    MXFP8, each expert's output to bf16); "bf16" rounds the intermediate and output to bf16 only."""
    xf = x.float()
    if round_like_kernel == "mxfp8":
        xf = torch.stack([_mxfp8_round(r) for r in xf])
    biases = biases or {}
    out = torch.zeros(x.shape[0], spec.hidden)
    for t in range(x.shape[0]):
        for k in range(topk_ids.shape[1]):
            e = int(topk_ids[t, k])
            base = f"experts.{e}."
            up = weights[base + f"{UP}.weight"] @ xf[t] + biases.get(base + f"{UP}.bias", 0.0)
            if spec.gated:
                gate = weights[base + f"{GATE}.weight"] @ xf[t] + biases.get(base + f"{GATE}.bias", 0.0)
                if limit is not None:
                    gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
                a = 1.0 if alpha is None else alpha
                h = gate * torch.sigmoid(a * gate) * (up + (0.0 if beta is None else beta))
            else:
                h = torch.relu(up).square()
            if round_like_kernel:
                h = h.to(torch.bfloat16).float()
                if round_like_kernel == "mxfp8":
                    h = _mxfp8_round(h)
            y = weights[base + f"{DOWN}.weight"] @ h + biases.get(base + f"{DOWN}.bias", 0.0)
            if round_like_kernel:
                y = y.to(torch.bfloat16).float()
            out[t] += float(topk_weights[t, k]) * y
    return out
