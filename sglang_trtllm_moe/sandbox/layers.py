"""Real SGLang MoE layers on a CPU box, one builder for every registered weight format: build them, make random
calibrated checkpoints (layer_checkpoints.py), load them through SGLang's own loader.

Used by the tests, `bench` and benchmarks/, so all drive the same SGLang objects a server would: FusedMoE built with
a real quant config (parsed by SGLang's own config class), shards fed one by one through `FusedMoE.weight_loader`
(the path `model.load_weights`, update_weights_from_disk and update_weights_from_tensor all end in), and SGLang's
`process_weights_after_loading`.

`LAYERS` holds one `LayerKind` per kind of layer the harness builds (`MoeSpec.fmt`), derived from each registered
format's own `example` (formats/records.py: the quant config SGLang builds such a layer from, its random
checkpoint, FusedMoE keywords), so a new format is not listed here. What the registry declares (all experts
written at once, the checkpoint names of fused tensors) drives the loaders; `build_layer` is the one FusedMoE call.

Random checkpoints per format: `layer_checkpoints.py` (re-exported here). SGLang's own preparation as the byte
oracle (`sglang_prepare`, `sglang_layer`, its CPU stand-ins): `sglang_oracle.py`.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from .. import formats
from ..formats import WeightFormat
from . import layer_checkpoints
from .format_examples import Example, example_of
from .layer_checkpoints import DOWN, GATE, UP, Maker, random_checkpoint
from .nvfp4_quantizer import torch_nvfp4_quantize

GPTOSS_PARAMS = ("w13_weight", "w13_weight_scale", "w13_weight_bias", "w2_weight", "w2_weight_scale", "w2_weight_bias")


@dataclass
class MoeSpec:
    num_experts: int = 8
    hidden: int = 256
    #: 0: the kind's own (its format's `Example.intermediate`: 128, or what its kernel's layout needs)
    intermediate: int = 0
    top_k: int = 2
    activation: str = "silu"
    gated: bool = True
    #: the kind of layer: a key of LAYERS
    fmt: str = "nvfp4"

    def __post_init__(self) -> None:
        if not self.intermediate:
            self.intermediate = example_of(self.kind.format).intermediate

    @property
    def shards(self) -> tuple[str, ...]:
        return (GATE, UP, DOWN) if self.gated else (UP, DOWN)

    @property
    def kind(self) -> LayerKind:
        try:
            return LAYERS[self.fmt]
        except KeyError:
            raise NotImplementedError(f"format {self.fmt!r}; the harness builds {sorted(LAYERS)}") from None


# ---- the kinds of layer: derived from each format's own `example` ---------------------------------------------------


def _sglang_config(example: Example) -> Callable[[], Any] | None:
    """SGLang's own parser of the example's `quantization_config` (`<quantization.module>.<class>.from_config`), plus
    the attributes SGLang's model loader copies onto it; None for an unquantized layer."""
    if example.sglang_config is None:
        return None
    module, cls = example.sglang_config.rsplit(".", 1)

    def make():
        config_class = getattr(importlib.import_module(f"sglang.srt.layers.quantization.{module}"), cls)
        if example.sglang_factory is not None:
            qc = getattr(config_class, example.sglang_factory)()
        else:
            qc = config_class.from_config(dict(example.quantization_config))
        for name, value in example.config_attrs.items():
            setattr(qc, name, value)
        return qc

    return make


def _layer_kwargs(example: Example) -> Callable[[MoeSpec], dict]:
    def kwargs(spec: MoeSpec) -> dict:
        kw = dict(example.layer_kwargs)
        if example.layer_kwargs_if_accepted:
            from sglang.srt.layers.moe.fused_moe_triton.layer import FusedMoE

            accepted = inspect.signature(FusedMoE.__init__).parameters
            kw.update({k: v for k, v in example.layer_kwargs_if_accepted.items() if k in accepted})
        return kw

    return kwargs


@dataclass(frozen=True)
class LayerKind:
    """One kind of FusedMoE layer the harness builds (from its format's `example`)."""

    #: the registry's format the plugin prepares such a layer in
    format: WeightFormat
    #: SGLang's quant config for it, parsed by SGLang's own config class (None: unquantized, SGLang picks
    #: UnquantizedFusedMoEMethod)
    quant_config: Callable[[], Any] | None
    #: its random calibrated checkpoint: (spec, seed, experts, **kwargs) -> tensors
    checkpoint: Callable[..., dict[str, torch.Tensor]]
    #: see `Example.routing`
    routing: bool
    #: FusedMoE arguments of this kind (defaults under the caller's)
    kwargs: Callable[[MoeSpec], dict]
    #: see `Example.capability_probe`
    capability_probe: bool

    @classmethod
    def of(cls, fmt: WeightFormat) -> LayerKind:
        ex = example_of(fmt)
        checkpoint = getattr(layer_checkpoints, ex.checkpoint)
        return cls(fmt, _sglang_config(ex), checkpoint, ex.routing, _layer_kwargs(ex), ex.capability_probe)


#: every kind of layer the harness builds, by `MoeSpec.fmt`: one per registered format
LAYERS: dict[str, LayerKind] = {example_of(f).kind: LayerKind.of(f) for f in formats.FORMATS}
if len(LAYERS) != len(formats.FORMATS):
    raise AssertionError(f"two formats declare one example kind: {[example_of(f).kind for f in formats.FORMATS]}")


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
    with patched((torch.cuda, "get_device_capability", lambda *a, **k: (10, 0))) if probe else contextlib.nullcontext():
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


# ---- patching SGLang and flashinfer names for a call -------------------------------------------------------------


def online_quantizer():
    """flashinfer's NVFP4 quantizer as the CPU stand-in (nvfp4_quantizer.py) while SGLang's nvfp4_online loader or
    leaf runs (a no-op where the CPU sandbox installed it process-wide)."""
    import flashinfer

    return patched((flashinfer, "nvfp4_quantize", torch_nvfp4_quantize))


def unhooked(fn):
    while hasattr(fn, "__wrapped__"):
        fn = fn.__wrapped__
    return fn


@contextlib.contextmanager
def patched(*triples):
    """Set (object, attribute, value) for the block, then restore every original: an attribute the object held
    itself is set back; one it inherited (a method of an instance's class, torch.Tensor's C slots) or did not have
    is deleted again, so no shadow is left behind."""
    saved = [(obj, name, name in vars(obj), getattr(obj, name, None)) for obj, name, _ in triples]
    try:
        for obj, name, value in triples:
            setattr(obj, name, value)
        yield
    finally:
        for obj, name, own, old in reversed(saved):
            if own:
                setattr(obj, name, old)
            else:
                delattr(obj, name)


def __getattr__(name: str) -> Maker:
    """Every `random_<kind>_checkpoint` of layer_checkpoints.py under this module's name too (the harness's callers
    reach a layer's maker here, beside its builder), so a new encoding lists its maker nowhere else."""
    if name.startswith("random_") and name.endswith("_checkpoint"):
        return getattr(layer_checkpoints, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "DOWN",
    "GATE",
    "UP",
    "random_checkpoint",
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
    "online_quantizer",
    "patched",
    "unhooked",
    "torch_nvfp4_quantize",
]
