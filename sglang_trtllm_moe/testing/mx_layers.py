"""MX-format FusedMoE layers on a CPU box: build them with SGLang's own quant configs, make random checkpoints, and
run SGLang's (and FlashInfer's) own preparation of the same checkpoint as a byte oracle.

Formats: "mxfp8" (quant_method mxfp8 -> Fp8MoEMethod.use_mxfp8, flashinfer_trtllm[_routed]); "mxfp4_experts"
(an FP8 [128, 128] config with is_fp4_experts, flashinfer_mxfp4 -> Mxfp4FlashinferTrtllmMoEMethod, 0.5.12+).

SGLang's own preparation runs on CPU with the fewest stand-ins (each is a CUDA-only helper whose CPU equivalent
computes the same bytes):
* MXFP8: `fp8._is_cuda` (a guard) is set True, and `flashinfer.block_scale_interleave` (CUDA kernel) is the
  plugin's pure-torch 128x4 swizzle, returned flat as flashinfer returns it. Index helpers are FlashInfer's own.
* MXFP4 experts: the module binds flashinfer's names only when `is_flashinfer_available()` (CUDA), so FlashInfer's
  own `_maybe_get_cached_w3_w1_permute_indices` / `get_w2_permute_indices_with_cache` are bound there and
  `block_scale_interleave` is the torch swizzle; `torch.cuda.empty_cache` is a no-op.
"""

from __future__ import annotations

import contextlib

import torch

from .. import layouts, quant
from .layers import DOWN, GATE, UP, MoeSpec, _random_experts

MX_FORMATS = ("mxfp8", "mxfp4_experts")


# ---- build -------------------------------------------------------------------------------------------------------


def build_layer(spec: MoeSpec, prefix: str = "model.layers.0.mlp.experts", **kwargs):
    from sglang.srt.layers.moe.fused_moe_triton.layer import FusedMoE
    from sglang.srt.layers.moe.utils import RoutingMethodType

    if spec.fmt == "mxfp8":
        from sglang.srt.layers.quantization.fp8 import Fp8Config

        qc = Fp8Config.from_config({"quant_method": "mxfp8", "activation_scheme": "dynamic"})
        return FusedMoE(
            num_experts=spec.num_experts, hidden_size=spec.hidden, intermediate_size=spec.intermediate,
            top_k=spec.top_k, layer_id=0, params_dtype=torch.bfloat16, quant_config=qc, prefix=prefix,
            activation=spec.activation, is_gated=spec.gated, routing_method_type=RoutingMethodType.Renormalize,
            **kwargs,
        )
    if spec.fmt == "mxfp4_experts":
        import inspect

        from sglang.srt.layers.quantization.fp8 import Fp8Config

        qc = Fp8Config.from_config({"quant_method": "fp8", "activation_scheme": "dynamic",
                                    "weight_block_size": [128, 128]})
        qc.is_fp4_experts = True  # what SGLang's model loader copies from ModelConfig.is_fp4_experts
        if "swiglu_limit" in inspect.signature(FusedMoE.__init__).parameters:
            kwargs.setdefault("swiglu_limit", 10.0)  # DeepSeek-V4's; SGLang <= 0.5.18 asserts it is set
        return FusedMoE(
            num_experts=spec.num_experts, hidden_size=spec.hidden, intermediate_size=spec.intermediate,
            top_k=spec.top_k, layer_id=0, params_dtype=torch.bfloat16, quant_config=qc, prefix=prefix,
            activation=spec.activation, is_gated=spec.gated, routing_method_type=RoutingMethodType.Renormalize,
            **kwargs,
        )
    raise NotImplementedError(f"MX format {spec.fmt!r}")


# ---- checkpoints ---------------------------------------------------------------------------------------------------


def random_mxfp8_checkpoint(spec: MoeSpec, seed: int = 0, experts=None) -> dict[str, torch.Tensor]:
    """MXFP8 tensors per expert and projection: e4m3 `weight` and uint8 UE8M0 `weight_scale_inv` per 32 columns."""
    out: dict[str, torch.Tensor] = {}
    for e, ws in _random_experts(spec, seed, experts, std=0.05):
        for proj, w in ws.items():
            q, s = quant.mxfp8_quantize(w)
            out[f"experts.{e}.{proj}.weight"] = q
            out[f"experts.{e}.{proj}.weight_scale_inv"] = s
    return out


def random_mxfp4_experts_checkpoint(spec: MoeSpec, seed: int = 0, experts=None,
                                    scale_dtype: torch.dtype = torch.float8_e8m0fnu) -> dict[str, torch.Tensor]:
    """DeepSeek-V4-style MXFP4 experts: int8 packed e2m1 `weight` and UE8M0 `weight_scale_inv` as float8_e8m0fnu
    (native DeepSeek-V4), or as the float32 values 2^(b-127) (`scale_dtype=torch.float32`)."""
    out: dict[str, torch.Tensor] = {}
    for e, ws in _random_experts(spec, seed, experts, std=0.05):
        for proj, w in ws.items():
            q, s = quant.mxfp4_quantize(w)
            s = s.view(torch.float8_e8m0fnu)
            out[f"experts.{e}.{proj}.weight"] = q.view(torch.int8)
            out[f"experts.{e}.{proj}.weight_scale_inv"] = s if scale_dtype == torch.float8_e8m0fnu else s.to(scale_dtype)
    return out


def random_checkpoint(spec: MoeSpec, seed: int = 0, experts=None, **kwargs) -> dict[str, torch.Tensor]:
    if spec.fmt == "mxfp8":
        return random_mxfp8_checkpoint(spec, seed, experts)
    if spec.fmt == "mxfp4_experts":
        return random_mxfp4_experts_checkpoint(spec, seed, experts, **kwargs)
    raise NotImplementedError(spec.fmt)


def dequantized_experts(spec: MoeSpec, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """{f"experts.{e}.{proj}.weight": float32 [out, in]} as the checkpoint means them (reference math)."""
    out = {}
    for e in range(spec.num_experts):
        for proj in spec.shards:
            base = f"experts.{e}.{proj}."
            if spec.fmt == "mxfp8":
                out[base + "weight"] = quant.mxfp8_dequantize(tensors[base + "weight"], tensors[base + "weight_scale_inv"])
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


def reference_moe(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, weights: dict,
                  spec: MoeSpec, *, alpha=None, beta=None, limit=None, biases: dict | None = None,
                  round_like_kernel: str | None = None) -> torch.Tensor:
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


# ---- SGLang's own preparation (the oracle) ------------------------------------------------------------------------


def torch_block_scale_interleave(x, *args, **kwargs):
    """flashinfer.block_scale_interleave on CPU: 128x4 swizzle of a 2-D [R, C], returned flat (and padded)."""
    if x.dim() != 2:
        raise ValueError(f"expects a 2-D scale matrix, got {tuple(x.shape)}")
    return layouts.swizzle_sf_128x4(x.contiguous()).reshape(-1)


def _unhooked(fn):
    while hasattr(fn, "__wrapped__"):
        fn = fn.__wrapped__
    return fn


@contextlib.contextmanager
def _patched(*triples):
    saved = []
    for obj, name, value in triples:
        saved.append((obj, name, getattr(obj, name, None), hasattr(obj, name)))
        setattr(obj, name, value)
    try:
        yield
    finally:
        for obj, name, old, had in reversed(saved):
            if had:
                setattr(obj, name, old)
            else:
                delattr(obj, name)


def sglang_prepare(layer) -> None:
    """SGLang's own process_weights_after_loading of `layer` (the plugin's hook bypassed), on CPU."""
    method = layer.quant_method
    if type(method).__name__ == "Fp8MoEMethod":
        import flashinfer
        from sglang.srt.layers.quantization import fp8 as fp8_mod

        with _patched((fp8_mod, "_is_cuda", True), (flashinfer, "block_scale_interleave", torch_block_scale_interleave)):
            _unhooked(type(method).process_weights_after_loading)(method, layer)
        return
    if type(method).__name__ == "Mxfp4FlashinferTrtllmMoEMethod":
        from flashinfer.fused_moe import core as ficore
        from sglang.srt.layers.quantization import mxfp4_flashinfer_trtllm_moe as fte

        with _patched((fte, "_maybe_get_cached_w3_w1_permute_indices", ficore._maybe_get_cached_w3_w1_permute_indices),
                      (fte, "get_w2_permute_indices_with_cache", ficore.get_w2_permute_indices_with_cache),
                      (fte, "block_scale_interleave", torch_block_scale_interleave),
                      (torch.cuda, "empty_cache", lambda: None)):
            _unhooked(type(method).process_weights_after_loading)(method, layer)
        return
    raise NotImplementedError(type(method).__name__)


def sglang_layer(spec: MoeSpec, prefix: str = "model.layers.0.mlp.experts", **kwargs):
    """A layer exactly as SGLang allocates it (the plugin's allocation hook bypassed): for SGLang's own flow."""
    if spec.fmt != "mxfp4_experts":
        return build_layer(spec, prefix, **kwargs)
    from sglang.srt.layers.quantization import mxfp4_flashinfer_trtllm_moe as fte

    cls = fte.Mxfp4FlashinferTrtllmMoEMethod
    with _patched((cls, "create_weights", _unhooked(cls.create_weights))):
        return build_layer(spec, prefix, **kwargs)


__all__ = ["MX_FORMATS", "build_layer", "sglang_layer", "random_mxfp4_experts_checkpoint", "random_checkpoint", "random_mxfp8_checkpoint", "dequantized_experts",
           "reference_moe", "sglang_prepare", "torch_block_scale_interleave"]
