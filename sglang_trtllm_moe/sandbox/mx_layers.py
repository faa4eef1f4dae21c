"""MX-format FusedMoE layers on a CPU box: build them with SGLang's own quant configs, make random checkpoints, and
run SGLang's (and FlashInfer's) own preparation of the same checkpoint as a byte oracle.

Formats: "mxfp8" (quant_method mxfp8 -> Fp8MoEMethod.use_mxfp8, flashinfer_trtllm[_routed]); "mxfp4_experts"
(an FP8 [128, 128] config with is_fp4_experts, flashinfer_mxfp4 -> Mxfp4FlashinferTrtllmMoEMethod, 0.5.12+);
"mxfp4_gptoss" (quant_method mxfp4 -> Mxfp4MoEMethod on flashinfer_mxfp4 / SM100: fused all-expert tensors, w13 rows
interleaved gate/up, bf16 biases, gpt-oss's alpha 1.702 and clamp 7).

SGLang's own preparation runs on CPU with the fewest stand-ins (each is a CUDA-only helper whose CPU equivalent
computes the same bytes):
* MXFP8: `fp8._is_cuda` (a guard) is set True, and `flashinfer.block_scale_interleave` (CUDA kernel) is the
  plugin's pure-torch 128x4 swizzle, returned flat as flashinfer returns it. Index helpers are FlashInfer's own.
* MXFP4 experts: the module binds flashinfer's names only when `is_flashinfer_available()` (CUDA), so FlashInfer's
  own `_maybe_get_cached_w3_w1_permute_indices` / `get_w2_permute_indices_with_cache` are bound there and
  `block_scale_interleave` is the torch swizzle; `torch.cuda.empty_cache` is a no-op.
* gpt-oss: likewise `nvfp4_block_scale_interleave` (torch) and FlashInfer's `get_w2_permute_indices_with_cache` are
  bound in `mxfp4`, and `Tensor.cuda` is the identity while it runs (it moves the alpha/beta/clamp scalars).
"""

from __future__ import annotations

import contextlib

import torch

from .. import layouts, quant
from ..formats.mxfp4_gptoss import MXFP4_GPTOSS
from .layers import DOWN, GATE, UP, MoeSpec, _random_experts

MX_FORMATS = ("mxfp8", "mxfp4_experts", "mxfp4_gptoss")
GPTOSS_ALPHA, GPTOSS_LIMIT = 1.702, 7.0


# ---- build -------------------------------------------------------------------------------------------------------


def build_layer(spec: MoeSpec, prefix: str = "model.layers.0.mlp.experts", **kwargs):
    from sglang.srt.layers.moe.fused_moe_triton.layer import FusedMoE
    from sglang.srt.layers.moe.utils import RoutingMethodType

    if spec.fmt == "mxfp8":
        from sglang.srt.layers.quantization.fp8 import Fp8Config

        qc = Fp8Config.from_config({"quant_method": "mxfp8", "activation_scheme": "dynamic"})
        return FusedMoE(
            num_experts=spec.num_experts,
            hidden_size=spec.hidden,
            intermediate_size=spec.intermediate,
            top_k=spec.top_k,
            layer_id=0,
            params_dtype=torch.bfloat16,
            quant_config=qc,
            prefix=prefix,
            activation=spec.activation,
            is_gated=spec.gated,
            routing_method_type=RoutingMethodType.Renormalize,
            **kwargs,
        )
    if spec.fmt == "mxfp4_experts":
        import inspect

        from sglang.srt.layers.quantization.fp8 import Fp8Config

        qc = Fp8Config.from_config(
            {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
        )
        qc.is_fp4_experts = True  # what SGLang's model loader copies from ModelConfig.is_fp4_experts
        if "swiglu_limit" in inspect.signature(FusedMoE.__init__).parameters:
            kwargs.setdefault("swiglu_limit", 10.0)  # DeepSeek-V4's; SGLang <= 0.5.18 asserts it is set
        return FusedMoE(
            num_experts=spec.num_experts,
            hidden_size=spec.hidden,
            intermediate_size=spec.intermediate,
            top_k=spec.top_k,
            layer_id=0,
            params_dtype=torch.bfloat16,
            quant_config=qc,
            prefix=prefix,
            activation=spec.activation,
            is_gated=spec.gated,
            routing_method_type=RoutingMethodType.Renormalize,
            **kwargs,
        )
    if spec.fmt == "mxfp4_gptoss":
        from sglang.srt.layers.quantization.mxfp4 import Mxfp4Config

        kwargs.setdefault("gemm1_alpha", GPTOSS_ALPHA)
        kwargs.setdefault("gemm1_clamp_limit", GPTOSS_LIMIT)
        return FusedMoE(
            num_experts=spec.num_experts,
            hidden_size=spec.hidden,
            intermediate_size=spec.intermediate,
            top_k=spec.top_k,
            layer_id=0,
            params_dtype=torch.bfloat16,
            quant_config=Mxfp4Config(is_checkpoint_mxfp4_serialized=True),
            prefix=prefix,
            activation="silu",
            with_bias=True,
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


def random_mxfp4_experts_checkpoint(
    spec: MoeSpec, seed: int = 0, experts=None, scale_dtype: torch.dtype = torch.float8_e8m0fnu
) -> dict[str, torch.Tensor]:
    """DeepSeek-V4-style MXFP4 experts: int8 packed e2m1 `weight` and UE8M0 `weight_scale_inv` as float8_e8m0fnu
    (native DeepSeek-V4), or as the float32 values 2^(b-127) (`scale_dtype=torch.float32`)."""
    out: dict[str, torch.Tensor] = {}
    for e, ws in _random_experts(spec, seed, experts, std=0.05):
        for proj, w in ws.items():
            q, s = quant.mxfp4_quantize(w)
            s = s.view(torch.float8_e8m0fnu)
            out[f"experts.{e}.{proj}.weight"] = q.view(torch.int8)
            out[f"experts.{e}.{proj}.weight_scale_inv"] = (
                s if scale_dtype == torch.float8_e8m0fnu else s.to(scale_dtype)
            )
    return out


GPTOSS_PARAMS = ("w13_weight", "w13_weight_scale", "w13_weight_bias", "w2_weight", "w2_weight_scale", "w2_weight_bias")


def random_gptoss_checkpoint(
    spec: MoeSpec, seed: int = 0, experts=None, bias_dtype: torch.dtype = torch.bfloat16
) -> dict[str, torch.Tensor]:
    """gpt-oss's fused MXFP4 tensors, named by the FusedMoE parameter they load into (what GptOssForCausalLM's
    `_load_mxfp4_experts_weights` passes to `weight_loader(..., expert_id=None)`): w13 rows interleaved
    (2j = gate_j, 2j+1 = up_j), blocks uint8 [E, 2I, H/2], scales uint8 [E, 2I, H/32], biases bf16."""
    g = torch.Generator().manual_seed(seed + 1000)
    gate, up, down = [], [], []
    for _, ws in _random_experts(spec, seed, None, std=0.05):
        gate.append(ws[GATE])
        up.append(ws[UP])
        down.append(ws[DOWN])
    w13 = torch.stack([torch.stack([g_, u_], dim=1).reshape(-1, spec.hidden) for g_, u_ in zip(gate, up, strict=True)])
    q13, s13 = quant.mxfp4_quantize(w13)
    q2, s2 = quant.mxfp4_quantize(torch.stack(down))
    return {
        "w13_weight": q13,
        "w13_weight_scale": s13,
        "w13_weight_bias": (torch.randn(spec.num_experts, 2 * spec.intermediate, generator=g) * 0.1).to(bias_dtype),
        "w2_weight": q2,
        "w2_weight_scale": s2,
        "w2_weight_bias": (torch.randn(spec.num_experts, spec.hidden, generator=g) * 0.1).to(bias_dtype),
    }


def load_fused(layer, tensors: dict[str, torch.Tensor]) -> None:
    """gpt-oss's loader: every fused tensor through its Parameter's weight_loader with expert_id=None."""
    from sglang.srt.model_loader.weight_utils import default_weight_loader

    params = dict(layer.named_parameters())
    for name, t in tensors.items():
        p = params[name]
        loader = getattr(p, "weight_loader", default_weight_loader)  # as GptOssForCausalLM looks it up
        loader(p, t, weight_name=name, shard_id=None, expert_id=None)


#: gpt-oss's checkpoint tensor names -> the FusedMoE parameters GptOssForCausalLM loads them into
GPTOSS_CHECKPOINT_NAMES = dict(MXFP4_GPTOSS.fused_checkpoint_names)
_PARAM_TO_CHECKPOINT = {v: k for k, v in GPTOSS_CHECKPOINT_NAMES.items()}


class GptOssTinyModel(torch.nn.Module):
    """One gpt-oss MXFP4 FusedMoE under a model prefix, with a `load_weights` that routes gpt-oss's checkpoint names
    (`experts.gate_up_proj_blocks`, ...) to FusedMoE.weight_loader with expert_id=None, as GptOssForCausalLM does
    (SGLang's weight-update entry points call it)."""

    prefix = "model.layers.0.mlp."

    def __init__(self, spec: MoeSpec):
        super().__init__()
        self.spec = spec
        self.experts = build_layer(spec, prefix=self.prefix + "experts")
        self.quant_config = self.experts.quant_config

    def load_weights(self, weights):
        names = set()
        for name, t in weights:
            short = name[len(self.prefix) + len("experts.") :]
            load_fused(self.experts, {GPTOSS_CHECKPOINT_NAMES[short]: t})
            names.add(name)
        return names


def gptoss_checkpoint(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Parameter-keyed fused tensors -> gpt-oss's checkpoint names below the MoE block
    ("experts.gate_up_proj_blocks")."""
    return {"experts." + _PARAM_TO_CHECKPOINT[k]: v for k, v in tensors.items()}


def gptoss_names(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Full checkpoint names as a gpt-oss safetensors holds them."""
    return {GptOssTinyModel.prefix + k: v for k, v in gptoss_checkpoint(tensors).items()}


def random_checkpoint(spec: MoeSpec, seed: int = 0, experts=None, **kwargs) -> dict[str, torch.Tensor]:
    if spec.fmt == "mxfp8":
        return random_mxfp8_checkpoint(spec, seed, experts)
    if spec.fmt == "mxfp4_experts":
        return random_mxfp4_experts_checkpoint(spec, seed, experts, **kwargs)
    if spec.fmt == "mxfp4_gptoss":
        return random_gptoss_checkpoint(spec, seed, experts, **kwargs)
    raise NotImplementedError(spec.fmt)


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


def prep_patches(method) -> contextlib.AbstractContextManager:
    """The CPU stand-ins SGLang's own preparation of `method`'s layers needs (module doc), as one context."""
    name = type(method).__name__
    if name == "Fp8MoEMethod":
        import flashinfer
        from sglang.srt.layers.quantization import fp8 as fp8_mod

        return _patched(
            (fp8_mod, "_is_cuda", True), (flashinfer, "block_scale_interleave", torch_block_scale_interleave)
        )
    if name == "Mxfp4FlashinferTrtllmMoEMethod":
        from flashinfer.fused_moe import core as ficore
        from sglang.srt.layers.quantization import mxfp4_flashinfer_trtllm_moe as fte

        return _patched(
            (fte, "_maybe_get_cached_w3_w1_permute_indices", ficore._maybe_get_cached_w3_w1_permute_indices),
            (fte, "get_w2_permute_indices_with_cache", ficore.get_w2_permute_indices_with_cache),
            (fte, "block_scale_interleave", torch_block_scale_interleave),
            (torch.cuda, "empty_cache", lambda: None),
        )
    if name == "Mxfp4MoEMethod":
        from flashinfer.fused_moe import core as ficore
        from sglang.srt.layers.quantization import mxfp4 as mx

        return _patched(
            (mx, "nvfp4_block_scale_interleave", torch_block_scale_interleave),
            (mx, "get_w2_permute_indices_with_cache", ficore.get_w2_permute_indices_with_cache),
            (torch.Tensor, "cuda", lambda self, *a, **k: self),
            (torch.cuda, "empty_cache", lambda: None),
        )
    raise NotImplementedError(name)


def sglang_prepare(layer) -> None:
    """SGLang's own process_weights_after_loading of `layer` (the plugin's hook bypassed), on CPU."""
    method = layer.quant_method
    with prep_patches(method):
        _unhooked(type(method).process_weights_after_loading)(method, layer)


def sglang_layer(spec: MoeSpec, prefix: str = "model.layers.0.mlp.experts", **kwargs):
    """A layer exactly as SGLang allocates it (the plugin's allocation hook bypassed): for SGLang's own flow."""
    if spec.fmt == "mxfp4_experts":
        from sglang.srt.layers.quantization.mxfp4_flashinfer_trtllm_moe import Mxfp4FlashinferTrtllmMoEMethod as cls
    elif spec.fmt == "mxfp4_gptoss":
        from sglang.srt.layers.quantization.mxfp4 import Mxfp4MoEMethod as cls
    else:
        return build_layer(spec, prefix, **kwargs)
    with _patched((cls, "create_weights", _unhooked(cls.create_weights))):
        return build_layer(spec, prefix, **kwargs)


__all__ = [
    "MX_FORMATS",
    "build_layer",
    "sglang_layer",
    "prep_patches",
    "GptOssTinyModel",
    "gptoss_names",
    "load_fused",
    "random_gptoss_checkpoint",
    "random_mxfp4_experts_checkpoint",
    "random_checkpoint",
    "random_mxfp8_checkpoint",
    "dequantized_experts",
    "reference_moe",
    "sglang_prepare",
    "torch_block_scale_interleave",
]
