"""Real SGLang MoE layers on a CPU box, one builder for every registered weight format: build them, make random
calibrated checkpoints, load them through SGLang's own loader, and run SGLang's own preparation as a byte oracle.

Used by the tests, `bench` and benchmarks/, so all drive the same SGLang objects a server would: FusedMoE built with
a real quant config (parsed by SGLang's own config class), shards fed one by one through `FusedMoE.weight_loader`
(the path `model.load_weights`, update_weights_from_disk and update_weights_from_tensor all end in), and SGLang's
`process_weights_after_loading`.

`LAYERS` holds one `LayerKind` per kind of layer the harness builds (`MoeSpec.fmt`), each naming the registry's
format (formats/) the plugin prepares it in — every registered format has one (tests/test_package.py) — with the
quant config SGLang builds such a layer from and its random checkpoint. What the registry declares (all experts
written at once, the checkpoint names of fused tensors) drives the loaders; `build_layer` is the one FusedMoE call.

SGLang's own preparation (`sglang_prepare`, `sglang_layer`) runs on CPU with the fewest stand-ins, each a CUDA-only
helper whose CPU equivalent computes the same bytes:
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
import importlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from .. import formats, layouts, quant
from ..compat.cpu_nvfp4 import torch_nvfp4_quantize
from ..formats import WeightFormat

GATE, UP, DOWN = "gate_proj", "up_proj", "down_proj"
GPTOSS_ALPHA, GPTOSS_LIMIT = 1.702, 7.0
GPTOSS_PARAMS = ("w13_weight", "w13_weight_scale", "w13_weight_bias", "w2_weight", "w2_weight_scale", "w2_weight_bias")


@dataclass
class MoeSpec:
    num_experts: int = 8
    hidden: int = 256
    intermediate: int = 128
    top_k: int = 2
    activation: str = "silu"
    gated: bool = True
    #: the kind of layer: a key of LAYERS
    fmt: str = "nvfp4"

    @property
    def shards(self) -> tuple[str, ...]:
        return (GATE, UP, DOWN) if self.gated else (UP, DOWN)

    @property
    def kind(self) -> LayerKind:
        try:
            return LAYERS[self.fmt]
        except KeyError:
            raise NotImplementedError(f"format {self.fmt!r}; the harness builds {sorted(LAYERS)}") from None


# ---- random calibrated checkpoints, per format ---------------------------------------------------------------------


def _random_experts(spec: MoeSpec, seed: int, experts, std: float = 0.02, up_factor: float = 1.0):
    """(expert, {projection: float32 weight}) with HF shapes; one generator, one draw per projection in order, so
    every format's checkpoint of the same seed is built from the same numbers (std varies per expert)."""
    g = torch.Generator().manual_seed(seed)
    h, i = spec.hidden, spec.intermediate
    for e in range(spec.num_experts) if experts is None else experts:
        yield (
            e,
            {
                proj: torch.randn((h, i) if proj == DOWN else (i, h), generator=g)
                * (std + 0.01 * (e % 3))
                * (up_factor if proj == UP else 1.0)
                for proj in spec.shards
            },
        )


def random_nvfp4_checkpoint(spec: MoeSpec, seed: int = 0, experts=None) -> dict[str, torch.Tensor]:
    """ModelOpt NVFP4 tensors per expert and projection, as a safetensors checkpoint names them."""
    out: dict[str, torch.Tensor] = {}
    for e, ws in _random_experts(spec, seed, experts):
        for proj, w in ws.items():
            gs = float(448 * 6 / w.abs().max())
            packed, sf = quant.nvfp4_quantize(w, gs)
            base = f"experts.{e}.{proj}."
            out[base + "weight"] = packed
            out[base + "weight_scale"] = sf
            out[base + "weight_scale_2"] = torch.tensor(1.0 / gs, dtype=torch.float32)
            out[base + "input_scale"] = torch.tensor(0.5 + 0.1 * ((e + len(proj)) % 4), dtype=torch.float32)
    return out


def random_bf16_checkpoint(spec: MoeSpec, seed: int = 0, experts=None) -> dict[str, torch.Tensor]:
    """BF16 tensors per expert and projection (HF names)."""
    return {
        f"experts.{e}.{proj}.weight": w.to(torch.bfloat16)
        for e, ws in _random_experts(spec, seed, experts, std=0.05)
        for proj, w in ws.items()
    }


def random_ct_nvfp4_checkpoint(
    spec: MoeSpec, seed: int = 0, experts=None, same_gate_up_scale: bool = True
) -> dict[str, torch.Tensor]:
    """Compressed-tensors NVFP4 tensors as llm-compressor names them. Its global scales are *quantize* scales
    (value = e2m1 * e4m3 / global_scale), i.e. the inverses of ModelOpt's weight_scale_2 / input_scale.
    llm-compressor fuses the gate/up global scales; `same_gate_up_scale=False` makes them differ."""
    out: dict[str, torch.Tensor] = {}
    for e, ws in _random_experts(spec, seed, experts):
        fused = float(448 * 6 / max(float(ws[p].abs().max()) for p in spec.shards if p != DOWN))
        in_gs = 1.0 / (0.5 + 0.1 * (e % 4))
        for proj, w in ws.items():
            gs = fused if (proj != DOWN and same_gate_up_scale) else float(448 * 6 / w.abs().max())
            packed, sf = quant.nvfp4_quantize(w, gs)
            base = f"experts.{e}.{proj}."
            out[base + "weight_packed"] = packed
            out[base + "weight_scale"] = sf
            out[base + "weight_global_scale"] = torch.tensor([gs], dtype=torch.float32)
            out[base + "input_global_scale"] = torch.tensor(
                [in_gs if proj != DOWN else in_gs * 0.8], dtype=torch.float32
            )
    return out


def random_fp8_checkpoint(spec: MoeSpec, seed: int = 0, experts=None, equal_gate_up_scale: bool = False):
    """FP8 tensors per expert and projection. Per-tensor (ModelOpt / fp8 static): e4m3 `weight`, fp32 `weight_scale`
    (amax/448 of that projection, so gate and up differ unless `equal_gate_up_scale`) and static `input_scale`
    (one per expert and GEMM, calibrated like a real checkpoint for x ~ N(0, 1): no e4m3 clipping of x or
    of the GEMM1 output, relu2's squared output needing the larger a2).
    Block (DeepSeek): e4m3 `weight` and fp32 `weight_scale_inv` per 128x128 block (a partial last block when I is
    not a multiple of 128, as DeepSeek-style checkpoints store it)."""
    out: dict[str, torch.Tensor] = {}
    for e, ws in _random_experts(spec, seed, experts, up_factor=1.5):
        for proj, w in ws.items():
            base = f"experts.{e}.{proj}."
            if spec.fmt == "fp8_block":
                r, c = w.shape
                wp = torch.zeros(-(-r // quant.FP8_BLOCK) * quant.FP8_BLOCK, -(-c // quant.FP8_BLOCK) * quant.FP8_BLOCK)
                wp[:r, :c] = w
                q, s = quant.fp8_block_quantize(wp)
                out[base + "weight"], out[base + "weight_scale_inv"] = q[:r, :c].contiguous(), s
                continue
            amax = w.abs().max()
            if equal_gate_up_scale and proj != DOWN:
                amax = max(ws[p].abs().max() for p in ws if p != DOWN)
            scale = (amax / quant.FP8_E4M3_MAX).to(torch.float32)
            out[base + "weight"] = quant.fp8_quantize(w, scale)
            out[base + "weight_scale"] = scale
            out[base + "input_scale"] = torch.tensor(
                (0.012 + 0.002 * (e % 3)) if proj != DOWN else (0.004 if spec.gated else 0.05) + 0.001 * (e % 4),
                dtype=torch.float32,
            )
    return out


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


def random_gptoss_checkpoint(
    spec: MoeSpec, seed: int = 0, experts=None, bias_dtype: torch.dtype = torch.bfloat16
) -> dict[str, torch.Tensor]:
    """gpt-oss's fused MXFP4 tensors, named by the FusedMoE parameter they load into (what GptOssForCausalLM's
    `_load_mxfp4_experts_weights` passes to `weight_loader(..., expert_id=None)`): w13 rows interleaved
    (2j = gate_j, 2j+1 = up_j), blocks uint8 [E, 2I, H/2], scales uint8 [E, 2I, H/32], biases bf16. The fused
    tensors hold every expert: `experts` is ignored."""
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


def random_checkpoint(spec: MoeSpec, seed: int = 0, experts=None, **kwargs) -> dict[str, torch.Tensor]:
    """The random calibrated checkpoint of `spec`'s kind of layer (keyword arguments: its maker's)."""
    return spec.kind.checkpoint(spec, seed, experts, **kwargs)


# ---- the kinds of layer: what SGLang builds each from ---------------------------------------------------------------


def _parsed(module: str, cls: str, config: dict) -> Callable[[], Any]:
    """SGLang's own parser of a checkpoint's `quantization_config`: `<quantization.module>.<cls>.from_config`."""

    def make():
        return getattr(importlib.import_module(f"sglang.srt.layers.quantization.{module}"), cls).from_config(config)

    return make


def _fp4_experts_config():
    """An FP8 [128, 128] config with the routed experts in MXFP4 (DeepSeek-V4, MiMo-V2)."""
    qc = _parsed("fp8", "Fp8Config", FP8_BLOCK_CONFIG)()
    qc.is_fp4_experts = True  # what SGLang's model loader copies from ModelConfig.is_fp4_experts
    return qc


def _gptoss_config():
    from sglang.srt.layers.quantization.mxfp4 import Mxfp4Config

    return Mxfp4Config(is_checkpoint_mxfp4_serialized=True)


def _fp4_experts_kwargs(spec: MoeSpec) -> dict:
    import inspect

    from sglang.srt.layers.moe.fused_moe_triton.layer import FusedMoE

    if "swiglu_limit" in inspect.signature(FusedMoE.__init__).parameters:
        return {"swiglu_limit": 10.0}  # DeepSeek-V4's; SGLang <= 0.5.18 asserts it is set
    return {}


def _gptoss_kwargs(spec: MoeSpec) -> dict:
    """gpt-oss: SwiGLU with its alpha 1.702 and clamp 7, bf16 biases."""
    return dict(activation="silu", with_bias=True, gemm1_alpha=GPTOSS_ALPHA, gemm1_clamp_limit=GPTOSS_LIMIT)


def _no_kwargs(spec: MoeSpec) -> dict:
    return {}


@dataclass(frozen=True)
class LayerKind:
    """One kind of FusedMoE layer the harness builds."""

    #: the registry's format the plugin prepares such a layer in
    format: WeightFormat
    #: SGLang's quant config for it, parsed by SGLang's own config class (None: unquantized, SGLang picks
    #: UnquantizedFusedMoEMethod)
    quant_config: Callable[[], Any] | None
    #: its random calibrated checkpoint: (spec, seed, experts, **kwargs) -> tensors
    checkpoint: Callable[..., dict[str, torch.Tensor]]
    #: the layer declares the softmax-renormalize router TopK(renormalize=True) implements (model code passes one;
    #: ModelOptFp8MoEMethod only takes flashinfer_trtllm when the layer declares it, compressed-tensors' trtllm
    #: apply asserts one)
    routing: bool = True
    #: FusedMoE arguments of this kind (defaults under the caller's)
    kwargs: Callable[[MoeSpec], dict] = field(default=_no_kwargs)
    #: SGLang's config probes torch.cuda's capability while the layer is built (compressed-tensors): answered
    #: "SM100" for the build on a box without CUDA
    capability_probe: bool = False


#: the config.json `quantization_config` of an llm-compressor NVFP4 (W4A4, tensor_group, group 16) checkpoint
CT_NVFP4_CONFIG = {
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
FP8_BLOCK_CONFIG = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
FP8_MODELOPT_CONFIG = {"quant_method": "modelopt", "quantization": {"quant_algo": "FP8"}}

#: every kind of layer the harness builds, by `MoeSpec.fmt`
LAYERS: dict[str, LayerKind] = {
    "nvfp4": LayerKind(
        formats.NVFP4,
        _parsed("modelopt_quant", "ModelOptFp4Config", {"quantization": {"quant_algo": "NVFP4", "group_size": 16}}),
        random_nvfp4_checkpoint,
        routing=False,
    ),
    "nvfp4_online": LayerKind(
        formats.NVFP4_ONLINE,
        _parsed("nvfp4_online", "NvFp4OnlineConfig", {}),
        random_bf16_checkpoint,
        routing=False,
    ),
    "ct_nvfp4": LayerKind(
        formats.CT_NVFP4,
        _parsed("compressed_tensors.compressed_tensors", "CompressedTensorsConfig", CT_NVFP4_CONFIG),
        random_ct_nvfp4_checkpoint,
        capability_probe=True,
    ),
    "fp8_modelopt": LayerKind(
        formats.FP8_TENSOR_MODELOPT,
        _parsed(
            "modelopt_quant", "ModelOptFp8Config", {"quant_method": "modelopt", "quantization": {"quant_algo": "FP8"}}
        ),
        random_fp8_checkpoint,
    ),
    "fp8_tensor": LayerKind(
        formats.FP8_TENSOR,
        _parsed("fp8", "Fp8Config", {"quant_method": "fp8", "activation_scheme": "static"}),
        random_fp8_checkpoint,
    ),
    "fp8_block": LayerKind(formats.FP8_BLOCK, _parsed("fp8", "Fp8Config", FP8_BLOCK_CONFIG), random_fp8_checkpoint),
    "mxfp8": LayerKind(
        formats.MXFP8,
        _parsed("fp8", "Fp8Config", {"quant_method": "mxfp8", "activation_scheme": "dynamic"}),
        random_mxfp8_checkpoint,
    ),
    "mxfp4_experts": LayerKind(
        formats.MXFP4_EXPERTS, _fp4_experts_config, random_mxfp4_experts_checkpoint, kwargs=_fp4_experts_kwargs
    ),
    "mxfp4_gptoss": LayerKind(
        formats.MXFP4_GPTOSS, _gptoss_config, random_gptoss_checkpoint, routing=False, kwargs=_gptoss_kwargs
    ),
    "bf16": LayerKind(formats.BF16, None, random_bf16_checkpoint, routing=False),
}


def kind_of(format_name: str) -> str:
    """The harness's kind of layer (`MoeSpec.fmt`) for a registered format's name."""
    for name, kind in LAYERS.items():
        if kind.format.name == format_name:
            return name
    raise KeyError(f"no layer kind for format {format_name!r}")


# ---- build and load ------------------------------------------------------------------------------------------------


def build_layer(spec: MoeSpec, prefix: str = "model.layers.0.mlp.experts", **kwargs):
    """A FusedMoE of `spec`'s kind, as SGLang's model code builds it (keyword arguments: FusedMoE's)."""
    from sglang.srt.layers.moe.fused_moe_triton.layer import FusedMoE

    kind = spec.kind
    kw: dict[str, Any] = dict(
        num_experts=spec.num_experts,
        hidden_size=spec.hidden,
        intermediate_size=spec.intermediate,
        top_k=spec.top_k,
        layer_id=0,
        params_dtype=torch.bfloat16,
        quant_config=kind.quant_config() if kind.quant_config else None,
        prefix=prefix,
        activation=spec.activation,
        is_gated=spec.gated,
    )
    if kind.routing:
        from sglang.srt.layers.moe.utils import RoutingMethodType

        kw["routing_method_type"] = RoutingMethodType.Renormalize
    kw.update(kind.kwargs(spec))
    kw.update(kwargs)
    probe = kind.capability_probe and not torch.cuda.is_available()
    with (
        _patched((torch.cuda, "get_device_capability", lambda *a, **k: (10, 0))) if probe else contextlib.nullcontext()
    ):
        return FusedMoE(**kw)


def load_checkpoint(layer, tensors: dict[str, torch.Tensor], num_experts: int) -> int:
    """Feed every checkpoint tensor through SGLang's own FusedMoE.weight_loader. Returns the number of calls."""
    from sglang.srt.layers.moe.fused_moe_triton.layer import FusedMoE

    gated = getattr(layer.moe_runner_config, "is_gated", True)
    # Non-gated (relu2) checkpoints name their single GEMM1 projection up_proj; SGLang loads it as shard w1.
    mapping = FusedMoE.make_expert_params_mapping(GATE if gated else UP, DOWN, UP if gated else "<none>", num_experts)
    params = dict(layer.named_parameters())
    calls = 0
    online = type(getattr(layer, "quant_method", None)).__name__ == "ModelOptNvFp4OnlineFusedMoEMethod"
    with online_quantizer() if online else contextlib.nullcontext():  # SGLang quantizes as it loads (CUDA-only)
        for name, t in tensors.items():
            calls += _load_one(layer, mapping, params, name, t)
    return calls


def _load_one(layer, mapping, params, name, t) -> int:
    full = "experts." + name.split("experts.", 1)[1]
    for param_name, weight_name, expert_id, shard_id in mapping:
        if not full.startswith(weight_name):
            continue
        pname = param_name.split("experts.", 1)[1] + full[len(weight_name) :].replace(".", "_")
        param = params[pname]
        param.weight_loader(param, t, pname, shard_id=shard_id, expert_id=expert_id)
        return 1
    raise KeyError(f"no FusedMoE parameter for checkpoint tensor {name}")


def load_fused(layer, tensors: dict[str, torch.Tensor]) -> None:
    """gpt-oss's loader: every fused tensor through its Parameter's weight_loader with expert_id=None."""
    from sglang.srt.model_loader.weight_utils import default_weight_loader

    params = dict(layer.named_parameters())
    for name, t in tensors.items():
        p = params[name]
        loader = getattr(p, "weight_loader", default_weight_loader)  # as GptOssForCausalLM looks it up
        loader(p, t, weight_name=name, shard_id=None, expert_id=None)


#: the FusedMoE parameter a fused format's checkpoint tensor loads into -> its checkpoint name below the MoE block
_FUSED_CHECKPOINT_NAME = {
    param: name for kind in LAYERS.values() for name, param in kind.format.fused_checkpoint_names.items()
}


class TinyMoeModel(torch.nn.Module):
    """The smallest model SGLang's weight-update paths accept: one FusedMoE under a DeepSeek-style prefix and a
    `load_weights` that routes checkpoint names to FusedMoE.weight_loader, as SGLang's model classes do (gpt-oss:
    its fused tensors' names with expert_id=None, as GptOssForCausalLM does)."""

    prefix = "model.layers.0.mlp."

    def __init__(self, spec: MoeSpec):
        super().__init__()
        self.spec = spec
        self.experts = build_layer(spec, prefix=self.prefix + "experts")
        self.quant_config = self.experts.quant_config

    def load_weights(self, weights):
        fmt = self.spec.kind.format
        if fmt.fused:
            names = set()
            for name, t in weights:
                short = name[len(self.prefix) + len("experts.") :]
                load_fused(self.experts, {fmt.fused_checkpoint_names[short]: t})
                names.add(name)
            return names
        tensors = {}
        for name, t in weights:
            if not name.startswith(self.prefix):
                raise KeyError(f"unexpected weight {name}")
            tensors[name[len(self.prefix) :]] = t
        load_checkpoint(self.experts, tensors, self.spec.num_experts)
        return set(tensors)


def below_block(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Checkpoint names below the MoE block ("experts.3.gate_proj.weight"); a fused format's parameter-keyed
    tensors ("w13_weight") by their checkpoint names ("experts.gate_up_proj_blocks")."""
    return {k if k.startswith("experts.") else "experts." + _FUSED_CHECKPOINT_NAME[k]: v for k, v in tensors.items()}


def checkpoint_names(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Full checkpoint names as a model's safetensors holds them (TinyMoeModel's prefix + `below_block`)."""
    return {TinyMoeModel.prefix + k: v for k, v in below_block(tensors).items()}


# ---- SGLang's own preparation (the oracle) ------------------------------------------------------------------------


def online_quantizer():
    """flashinfer's NVFP4 quantizer as the CPU stand-in (compat/cpu_nvfp4.py) while SGLang's nvfp4_online loader or
    leaf runs (a no-op where the CPU sandbox installed it process-wide)."""
    import flashinfer

    return _patched((flashinfer, "nvfp4_quantize", torch_nvfp4_quantize))


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
    """SGLang's own process_weights_after_loading of an MX `layer` (the plugin's hook bypassed), on CPU."""
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
    "DOWN",
    "GATE",
    "UP",
    "LAYERS",
    "LayerKind",
    "MoeSpec",
    "TinyMoeModel",
    "below_block",
    "build_layer",
    "checkpoint_names",
    "kind_of",
    "load_checkpoint",
    "load_fused",
    "prep_patches",
    "random_bf16_checkpoint",
    "random_checkpoint",
    "random_ct_nvfp4_checkpoint",
    "random_fp8_checkpoint",
    "random_gptoss_checkpoint",
    "random_mxfp4_experts_checkpoint",
    "random_mxfp8_checkpoint",
    "random_nvfp4_checkpoint",
    "online_quantizer",
    "torch_nvfp4_quantize",
    "sglang_layer",
    "sglang_prepare",
    "torch_block_scale_interleave",
]
