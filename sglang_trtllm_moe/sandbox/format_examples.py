"""Each weight format as the CPU sandbox builds it: a layer as SGLang builds it from a checkpoint (`Example`), and
its tiny whole-model checkpoint (`TinyCheckpoint`) or why it has none — one table keyed by the format's name
(`WeightFormat.name`).

The runtime's formats (`sglang_trtllm_moe/formats/`) say what the plugin serves and how it lays it out; what exists
only to stand SGLang up without a GPU lives here, in the sandbox, and the runtime never reads it. The harness's layer
kinds (`layers.LAYERS`), the tiny checkpoints' quants (`tiny_spec`) and the layer tests derive from this table, so a
new format adds one row to each of `EXAMPLES` and `TINY` (a format missing from either is named at import).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from .. import formats
from ..formats.ct_int4 import EXAMPLE_CONFIG as CT_INT4_CONFIG
from ..formats.ct_int4 import K_BLOCK
from ..formats.ct_nvfp4 import EXAMPLE_CONFIG as CT_NVFP4_CONFIG
from ..formats.fp8_block import BLOCK
from ..formats.mxfp4_gptoss import ALPHA, LIMIT


@dataclass(frozen=True)
class Example:
    """A layer of a format as SGLang builds it from a checkpoint: the CPU harness (`layers.LAYERS`) and the layer
    tests derive their kinds from it. SGLang's own config class parses `quantization_config`
    (`sglang_config.from_config`), as its model loader does."""

    #: the harness's name of such a layer (`MoeSpec.fmt`, test ids)
    kind: str
    #: a checkpoint's config.json `quantization_config` in this format; for a format SGLang quantizes as it loads,
    #: the config `--quantization <name>` yields on a checkpoint that has none
    quantization_config: Mapping[str, Any]
    #: SGLang's config class, "<module under sglang.srt.layers.quantization>.<class>"; None: unquantized (SGLang
    #: picks UnquantizedFusedMoEMethod)
    sglang_config: str | None
    #: the layer_checkpoints function making a random calibrated checkpoint of such a layer
    checkpoint: str
    #: the `--quantization` a server is started with for such a checkpoint, where the checkpoint's config does not
    #: name it (SGLang quantizes a checkpoint that has no such config as it loads); None: the config's own
    quantization: str | None = None
    #: a classmethod of `sglang_config` that builds the config without a checkpoint's (the model loader's call for
    #: `--quantization X` on a checkpoint without one), called with no argument; None: `from_config`
    sglang_factory: str | None = None
    #: attributes SGLang's model loader sets on the parsed config from the model's config (e.g. `is_fp4_experts`,
    #: copied from ModelConfig)
    config_attrs: Mapping[str, Any] = field(default_factory=dict)
    #: the layer declares the softmax-renormalize router TopK(renormalize=True) implements (model code passes one;
    #: ModelOptFp8MoEMethod only takes flashinfer_trtllm when the layer declares it, compressed-tensors' trtllm
    #: apply asserts one)
    routing: bool = True
    #: FusedMoE keywords of such a layer (under the caller's)
    layer_kwargs: Mapping[str, Any] = field(default_factory=dict)
    #: FusedMoE keywords passed where the release's FusedMoE takes them (e.g. DeepSeek-V4's swiglu_limit)
    layer_kwargs_if_accepted: Mapping[str, Any] = field(default_factory=dict)
    #: SGLang's config probes torch.cuda's capability while the layer is built (compressed-tensors): the harness
    #: answers "SM100" for the build on a box without CUDA
    capability_probe: bool = False
    #: the intermediate size of the harness's layers (`MoeSpec`) and tiny models of this format by default: a multiple
    #: of what its kernel's layout needs (INT4's 128-byte K blocks: 256)
    intermediate: int = 128


@dataclass(frozen=True)
class TinyCheckpoint:
    """A format's tiny whole-model checkpoint: `tiny_spec` derives its quants (`QUANTS`), the architectures each is
    built for (`SUPPORTED`) and how an online one is served (`ONLINE`) from this table, and the CLI's
    `tiny-checkpoint --quant` lists them. A checkpoint stored in an encoding the sandbox already writes (BF16 for an
    online format) edits nothing else; a new stored encoding also needs its writers (checkpoints.py,
    checkpoint_configs.py)."""

    #: the sandbox's name of the quant (`TinySpec.quant`, `tiny-checkpoint --quant`, test ids)
    quant: str
    #: the sandbox's architectures (tiny_spec.ARCHS) SGLang builds with FusedMoE layers in this quant
    archs: tuple[str, ...]
    #: a format SGLang quantizes as it loads: the quant the checkpoint's tensors and config.json are written in (one
    #: the sandbox writes, e.g. "bf16"); a server is started with the format's one SGLang quantization
    #: (`--quantization`, `quantizations`). None: the checkpoint is written in `quant` itself
    stored: str | None = None


@dataclass(frozen=True)
class NoTinyCheckpoint:
    """Why a format has no tiny whole-model checkpoint (its layer tests build its layers directly)."""

    why: str


_CT = "compressed_tensors.compressed_tensors.CompressedTensorsConfig"

#: format name -> a layer of it as SGLang builds it from a checkpoint
EXAMPLES: dict[str, Example] = {
    "nvfp4": Example(
        "nvfp4",
        {"quant_method": "modelopt", "quantization": {"quant_algo": "NVFP4", "group_size": 16}},
        "modelopt_quant.ModelOptFp4Config",
        "random_nvfp4_checkpoint",
        routing=False,
    ),
    "nvfp4_online": Example(
        "nvfp4_online",
        {"quant_method": "nvfp4_online"},
        "nvfp4_online.NvFp4OnlineConfig",
        "random_bf16_checkpoint",
        routing=False,
    ),
    #: a BF16 checkpoint (no quantization_config) served with --quantization modelopt_fp4: SGLang's model loader
    #: builds its config with ModelOptFp4Config.for_online_weight_quantization
    "nvfp4_online_tensor": Example(
        "nvfp4_online_tensor",
        {},
        "modelopt_quant.ModelOptFp4Config",
        "random_bf16_checkpoint",
        routing=False,
        quantization="modelopt_fp4",
        sglang_factory="for_online_weight_quantization",
    ),
    "ct_int4": Example(
        "ct_int4", CT_INT4_CONFIG, _CT, "random_ct_int4_checkpoint", capability_probe=True, intermediate=K_BLOCK
    ),
    "ct_nvfp4": Example("ct_nvfp4", CT_NVFP4_CONFIG, _CT, "random_ct_nvfp4_checkpoint", capability_probe=True),
    "fp8_tensor_modelopt": Example(
        "fp8_modelopt",
        {"quant_method": "modelopt", "quantization": {"quant_algo": "FP8"}},
        "modelopt_quant.ModelOptFp8Config",
        "random_fp8_checkpoint",
    ),
    "fp8_tensor": Example(
        "fp8_tensor", {"quant_method": "fp8", "activation_scheme": "static"}, "fp8.Fp8Config", "random_fp8_checkpoint"
    ),
    #: an FP8 [128, 128] config with the routed experts in MXFP4 (DeepSeek-V4, MiMo-V2): SGLang's model loader
    #: copies ModelConfig.is_fp4_experts (from `routed_experts_quant_method`) onto the parsed Fp8Config
    "mxfp4_experts": Example(
        "mxfp4_experts",
        {
            "quant_method": "fp8",
            "activation_scheme": "dynamic",
            "weight_block_size": [128, 128],
            "routed_experts_quant_method": "mxfp4",
        },
        "fp8.Fp8Config",
        "random_mxfp4_experts_checkpoint",
        config_attrs={"is_fp4_experts": True},
        layer_kwargs_if_accepted={"swiglu_limit": 10.0},  # DeepSeek-V4's; SGLang <= 0.5.18 asserts it is set
    ),
    "fp8_block": Example(
        "fp8_block",
        {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [BLOCK, BLOCK]},
        "fp8.Fp8Config",
        "random_fp8_checkpoint",
    ),
    "mxfp8": Example(
        "mxfp8", {"quant_method": "mxfp8", "activation_scheme": "dynamic"}, "fp8.Fp8Config", "random_mxfp8_checkpoint"
    ),
    #: gpt-oss: SwiGLU with its alpha and clamp, bf16 biases
    "mxfp4_gptoss": Example(
        "mxfp4_gptoss",
        {"quant_method": "mxfp4"},
        "mxfp4.Mxfp4Config",
        "random_gptoss_checkpoint",
        routing=False,
        layer_kwargs={"activation": "silu", "with_bias": True, "gemm1_alpha": ALPHA, "gemm1_clamp_limit": LIMIT},
    ),
    "bf16": Example("bf16", {}, None, "random_bf16_checkpoint", routing=False),
}

#: architectures SGLang builds with FusedMoE layers in every quant (quantized Mixtral other than SGLang `fp8` /
#: compressed-tensors is QuantMixtralForCausalLM, no FusedMoE)
_ALL = ("qwen3_moe", "deepseek_v3", "nemotron_h", "mixtral")
_NO_MIXTRAL = ("qwen3_moe", "deepseek_v3", "nemotron_h")

#: format name -> its tiny whole-model checkpoint, or why it has none
TINY: dict[str, TinyCheckpoint | NoTinyCheckpoint] = {
    "nvfp4": TinyCheckpoint("nvfp4", _NO_MIXTRAL),
    #: a plain BF16 checkpoint served with `--quantization nvfp4_online`
    "nvfp4_online": TinyCheckpoint("nvfp4_online", ("qwen3_moe",), stored="bf16"),
    #: the same BF16 checkpoint served with `--quantization modelopt_fp4`
    "nvfp4_online_tensor": TinyCheckpoint("nvfp4_online_tensor", ("qwen3_moe",), stored="bf16"),
    "ct_int4": TinyCheckpoint("ct_int4", ("deepseek_v3", "qwen3_moe")),
    "ct_nvfp4": TinyCheckpoint("ct_nvfp4", _ALL),
    "fp8_tensor_modelopt": TinyCheckpoint("fp8", _NO_MIXTRAL),
    "fp8_tensor": TinyCheckpoint("fp8_static", _ALL),
    "mxfp4_experts": NoTinyCheckpoint(
        "no tiny DeepSeek-V4 / MiMo-V2 model yet: tests/test_mxfp4_experts_layer.py builds its layers"
    ),
    #: DeepSeek-V3's recipe (the sandbox's only block-FP8 architecture)
    "fp8_block": TinyCheckpoint("fp8_block", ("deepseek_v3",)),
    "mxfp8": NoTinyCheckpoint("no tiny MXFP8 model yet: tests/test_mxfp8_layer.py builds its layers directly"),
    "mxfp4_gptoss": NoTinyCheckpoint(
        "no tiny gpt-oss model yet: tests/test_mxfp4_gptoss_layer.py builds its layers directly"
    ),
    "bf16": TinyCheckpoint("bf16", _ALL),
}

_names = [f.name for f in formats.FORMATS]
for _table, _what in ((EXAMPLES, "EXAMPLES"), (TINY, "TINY")):
    if sorted(_table) != sorted(_names):
        raise AssertionError(
            f"sandbox/format_examples.py {_what} names {sorted(_table)}, the format registry {sorted(_names)}: give "
            "every registered format one row (and none other)"
        )


def example_of(fmt: formats.WeightFormat) -> Example:
    """The sandbox's layer of `fmt`."""
    return EXAMPLES[fmt.name]


def tiny_of(fmt: formats.WeightFormat) -> TinyCheckpoint | NoTinyCheckpoint:
    """The sandbox's tiny whole-model checkpoint of `fmt`, or why it has none."""
    return TINY[fmt.name]


__all__ = ["EXAMPLES", "TINY", "Example", "NoTinyCheckpoint", "TinyCheckpoint", "example_of", "tiny_of"]
