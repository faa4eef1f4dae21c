"""Real SGLang MoE layers on a CPU box: build them, make random checkpoints, load them through SGLang's loader.

Used by the tests, `demo` and `bench`, so all three drive the same SGLang objects a server would: FusedMoE built
with a real quant config, shards fed one by one through `FusedMoE.weight_loader` (the path
`model.load_weights`, update_weights_from_disk and update_weights_from_tensor all end in), and SGLang's
`process_weights_after_loading`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import quant

GATE, UP, DOWN = "gate_proj", "up_proj", "down_proj"


@dataclass
class MoeSpec:
    num_experts: int = 8
    hidden: int = 256
    intermediate: int = 128
    top_k: int = 2
    activation: str = "silu"
    gated: bool = True
    fmt: str = "nvfp4"

    @property
    def shards(self) -> tuple[str, ...]:
        return (GATE, UP, DOWN) if self.gated else (UP, DOWN)


def build_layer(spec: MoeSpec, prefix: str = "model.layers.0.mlp.experts"):
    from sglang.srt.layers.moe.fused_moe_triton.layer import FusedMoE

    if spec.fmt in ("bf16", "ct_nvfp4"):
        return _build_bf16_or_ct_nvfp4(spec, prefix)
    from . import mx_layers

    if spec.fmt in mx_layers.MX_FORMATS:
        return mx_layers.build_layer(spec, prefix)
    if spec.fmt in FP8_CONFIGS:
        return _build_fp8(spec, prefix)
    if spec.fmt != "nvfp4":
        raise NotImplementedError(f"format {spec.fmt!r}")
    from sglang.srt.layers.quantization.modelopt_quant import ModelOptFp4Config

    qc = ModelOptFp4Config.from_config({"quantization": {"quant_algo": "NVFP4", "group_size": 16}})
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
    )


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


def load_checkpoint(layer, tensors: dict[str, torch.Tensor], num_experts: int) -> int:
    """Feed every checkpoint tensor through SGLang's own FusedMoE.weight_loader. Returns the number of calls."""
    from sglang.srt.layers.moe.fused_moe_triton.layer import FusedMoE

    gated = getattr(layer.moe_runner_config, "is_gated", True)
    # Non-gated (relu2) checkpoints name their single GEMM1 projection up_proj; SGLang loads it as shard w1.
    mapping = FusedMoE.make_expert_params_mapping(GATE if gated else UP, DOWN, UP if gated else "<none>", num_experts)
    params = dict(layer.named_parameters())
    calls = 0
    for name, t in tensors.items():
        full = "experts." + name.split("experts.", 1)[1]
        for param_name, weight_name, expert_id, shard_id in mapping:
            if not full.startswith(weight_name):
                continue
            pname = param_name.split("experts.", 1)[1] + full[len(weight_name) :].replace(".", "_")
            param = params[pname]
            param.weight_loader(param, t, pname, shard_id=shard_id, expert_id=expert_id)
            calls += 1
            break
        else:
            raise KeyError(f"no FusedMoE parameter for checkpoint tensor {name}")
    return calls


class TinyMoeModel(torch.nn.Module):
    """The smallest model SGLang's weight-update paths accept: one FusedMoE under a DeepSeek-style prefix and a
    `load_weights` that routes checkpoint names to FusedMoE.weight_loader, as SGLang's model classes do."""

    prefix = "model.layers.0.mlp."

    def __init__(self, spec: MoeSpec):
        super().__init__()
        self.spec = spec
        self.experts = build_layer(spec, prefix=self.prefix + "experts")
        self.quant_config = self.experts.quant_config

    def load_weights(self, weights):
        tensors = {}
        for name, t in weights:
            if not name.startswith(self.prefix):
                raise KeyError(f"unexpected weight {name}")
            tensors[name[len(self.prefix) :]] = t
        load_checkpoint(self.experts, tensors, self.spec.num_experts)
        return set(tensors)


def checkpoint_names(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Full checkpoint names as a model's safetensors holds them."""
    return {TinyMoeModel.prefix + k: v for k, v in tensors.items()}


def write_safetensors_checkpoint(path, tensors: dict[str, torch.Tensor], spec: MoeSpec) -> None:
    """A model directory SGLang's update_weights_from_disk can read: config.json + model.safetensors."""
    import json
    import os

    from safetensors.torch import save_file

    os.makedirs(path, exist_ok=True)
    save_file(
        {k: v.contiguous() for k, v in checkpoint_names(tensors).items()}, os.path.join(path, "model.safetensors")
    )
    cfg = {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        "hidden_size": spec.hidden,
        "moe_intermediate_size": spec.intermediate,
        "intermediate_size": 4 * spec.hidden,
        "n_routed_experts": spec.num_experts,
        "num_experts_per_tok": spec.top_k,
        "num_hidden_layers": 1,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "vocab_size": 256,
        "torch_dtype": "bfloat16",
        "quantization_config": {"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16},
    }
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)


# ---- BF16 (unquantized) and compressed-tensors NVFP4 -------------------------------------------------------------

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


def _build_bf16_or_ct_nvfp4(spec: MoeSpec, prefix: str):
    """BF16: no quant config (SGLang picks UnquantizedFusedMoEMethod). Compressed-tensors: SGLang's own parser of the
    config dict; its capability probe calls torch.cuda, so on a CPU box it is answered "supported" for the build."""
    from unittest import mock

    from sglang.srt.layers.moe.fused_moe_triton.layer import FusedMoE

    qc, probe = None, mock.patch.object(torch.cuda, "get_device_capability", lambda *a, **k: (10, 0))
    extra = {}
    if spec.fmt == "ct_nvfp4":
        from sglang.srt.layers.moe.utils import RoutingMethodType
        from sglang.srt.layers.quantization.compressed_tensors.compressed_tensors import CompressedTensorsConfig

        qc = CompressedTensorsConfig.from_config(CT_NVFP4_CONFIG)
        # its trtllm apply asserts a routing method; model code passes one (Qwen3-MoE: Renormalize)
        extra["routing_method_type"] = RoutingMethodType.Renormalize
    with probe if (spec.fmt == "ct_nvfp4" and not torch.cuda.is_available()) else _nullcontext():
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
            **extra,
        )


def _nullcontext():
    import contextlib

    return contextlib.nullcontext()


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


# ---- FP8 per-tensor (ModelOpt / SGLang fp8 static) and FP8 128x128 block (DeepSeek) --------------------------------

#: the config.json `quantization_config` of each FP8 flavour, parsed by SGLang's own config classes
FP8_CONFIGS = {
    "fp8_modelopt": {"quant_method": "modelopt", "quantization": {"quant_algo": "FP8"}},
    "fp8_tensor": {"quant_method": "fp8", "activation_scheme": "static"},
    "fp8_block": {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128]},
}


def _build_fp8(spec: MoeSpec, prefix: str):
    """ModelOptFp8MoEMethod only takes flashinfer_trtllm when the layer declares its router (create_moe_runner), so
    every FP8 layer here declares the softmax-renormalize router TopK(renormalize=True) implements."""
    from sglang.srt.layers.moe.fused_moe_triton.layer import FusedMoE
    from sglang.srt.layers.moe.utils import RoutingMethodType

    if spec.fmt == "fp8_modelopt":
        from sglang.srt.layers.quantization.modelopt_quant import ModelOptFp8Config as cls
    else:
        from sglang.srt.layers.quantization.fp8 import Fp8Config as cls
    return FusedMoE(
        num_experts=spec.num_experts,
        hidden_size=spec.hidden,
        intermediate_size=spec.intermediate,
        top_k=spec.top_k,
        layer_id=0,
        params_dtype=torch.bfloat16,
        quant_config=cls.from_config(FP8_CONFIGS[spec.fmt]),
        prefix=prefix,
        activation=spec.activation,
        is_gated=spec.gated,
        routing_method_type=RoutingMethodType.Renormalize,
    )


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
