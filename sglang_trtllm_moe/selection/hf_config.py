"""A MoeProblem from a HuggingFace config.json, naming the quantization the way SGLang's ModelConfig does."""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Any

from ..formats import FORMATS, Checkpoint
from ..kernel_api import RoutingMethodType
from .problem import MoeProblem

#: Architectures whose MoE experts are non-gated (a single up projection), and the config key of their activation.
NON_GATED_ARCHS = {
    "NemotronHForCausalLM": "mlp_hidden_act",
    "NemotronHPuzzleForCausalLM": "mlp_hidden_act",
    "NemotronH_Omni_Reasoning_V3": "mlp_hidden_act",
}

#: Quantizations with which SGLang builds Mixtral as MixtralForCausalLM (FusedMoE). Any other quantized Mixtral is
#: built as QuantMixtralForCausalLM: per-expert linear layers, no FusedMoE, no MoE runner (`model_loader/utils.py`
#: get_model_architecture, "Special handling for quantized Mixtral"; the same list in every release 0.5.11-0.5.23).
MIXTRAL_FUSED_MOE_QUANTS = ("fp8", "compressed-tensors", "gptq_marlin", "awq_marlin", "quark_int4fp8_moe")


def no_fused_moe_reason(architectures: Collection[str] | None, quantization: str | None) -> str | None:
    """Why SGLang builds a model of these architectures with this quantization (SGLang's name, as ModelConfig
    gives it) without FusedMoE layers; None when it builds them."""
    if (
        quantization is not None
        and quantization not in MIXTRAL_FUSED_MOE_QUANTS
        and "MixtralForCausalLM" in (architectures or ())
    ):
        return (
            f"SGLang builds quantized Mixtral ({quantization}) as QuantMixtralForCausalLM (per-expert linear "
            f"layers, no FusedMoE; FusedMoE only with {', '.join(MIXTRAL_FUSED_MOE_QUANTS)} or unquantized: "
            f"model_loader/utils.py get_model_architecture)"
        )
    return None


def _get(cfg: Any, key: str, default: Any = None) -> Any:
    if isinstance(cfg, Mapping):
        return cfg.get(key, default)
    return getattr(cfg, key, default)


#: The routing method SGLang's model class declares for its MoE layers (`routing_method_type=` to FusedMoE, read from
#: the 0.5.23 model files; classes that compute it from the config are left out): the selection needs it only where
#: the installed flashinfer reports routed experts for some methods and not others (kernel_api.ROUTING_REPLAY_SINCE).
ROUTING_BY_ARCH: dict[str, RoutingMethodType] = {
    "Qwen3MoeForCausalLM": RoutingMethodType.Renormalize,
    "Qwen2MoeForCausalLM": RoutingMethodType.RenormalizeNaive,
    "DeepseekV3ForCausalLM": RoutingMethodType.DeepSeekV3,
    "DeepseekV2ForCausalLM": RoutingMethodType.DeepSeekV3,
    "KimiK25ForConditionalGeneration": RoutingMethodType.DeepSeekV3,
    "Glm4MoeForCausalLM": RoutingMethodType.DeepSeekV3,
    "NemotronHForCausalLM": RoutingMethodType.DeepSeekV3,
    "Llama4ForConditionalGeneration": RoutingMethodType.Llama4,
    "Llama4ForCausalLM": RoutingMethodType.Llama4,
    "Step3p5ForCausalLM": RoutingMethodType.Renormalize,
}

_ACT_ALIASES = {"swish": "silu", "gelu_pytorch_tanh": "gelu", "gelu_new": "gelu", "gelu_tanh": "gelu"}


#: (the checkpoint's quantization, `--quantization`) pairs SGLang quantizes online although the checkpoint has a
#: quantization_config: each format's `online_sources` with the quantizations it serves (nvfp4_online_tensor:
#: modelopt_fp4 on an FP8 checkpoint)
ONLINE_FROM = frozenset(
    (source, q) for f in FORMATS for source in f.online_sources for qs in f.quantizations.values() for q in qs
)


def detect_quantization(quant_cfg: Mapping | None) -> tuple[str | None, tuple[int, ...] | None, str | None]:
    """(SGLang quantization name, fp8 weight_block_size, compressed-tensors scheme) from `quantization_config`.

    Mirrors how SGLang's ModelConfig names the checkpoint's method (tests compare against it)."""
    if not quant_cfg:
        return None, None, None
    method = str(_get(quant_cfg, "quant_method", "") or "").lower()
    if method == "modelopt":
        algo = str(_get(quant_cfg, "quant_algo", "") or "").upper()
        if not algo and isinstance(_get(quant_cfg, "quantization"), Mapping):
            algo = str(_get(quant_cfg, "quantization").get("quant_algo", "")).upper()
        if algo == "NVFP4":
            return "modelopt_fp4", None, None
        if algo == "FP8":
            return "modelopt_fp8", None, None
        if algo == "MIXED_PRECISION":
            return "modelopt_mixed", None, None
        return "modelopt", None, None
    if method == "fp8":
        wbs = _get(quant_cfg, "weight_block_size")
        return "fp8", (tuple(int(x) for x in wbs) if wbs else None), None
    if method == "compressed-tensors":
        scheme = None
        for group in (_get(quant_cfg, "config_groups") or {}).values():
            w = (group or {}).get("weights") or {}
            bits, typ, gs = w.get("num_bits"), w.get("type"), w.get("group_size")
            claimed = [s for f in FORMATS if (s := f.config_scheme(w, (group or {}).get("input_activations")))]
            if claimed:
                scheme = claimed[0]
            elif bits == 4 and typ == "float" and gs == 16:
                scheme = "nvfp4"
            elif bits == 8 and typ == "float":
                scheme = "w8a8_fp8"
            elif typ == "int":
                scheme = f"int{bits}"
            break
        return "compressed-tensors", None, scheme
    return method or None, None, None


def problem_from_hf_config(cfg: Any, *, quantization: str | None = None, **parallel: Any) -> MoeProblem | None:
    """A MoeProblem from a HuggingFace config (dict or PretrainedConfig); None for a model without routed experts.

    `quantization` overrides the checkpoint's (as `--quantization` does); `parallel` takes the MoeProblem
    fields tp_size, ep_size, a2a_backend, enable_eplb, num_redundant_experts, init_expert_location,
    speculative_draft, return_routed_experts."""
    text = _get(cfg, "text_config") or cfg
    archs = _get(cfg, "architectures") or _get(text, "architectures") or [""]
    arch = archs[0]
    experts = next(
        (
            _get(text, k)
            for k in ("n_routed_experts", "num_experts", "num_local_experts", "moe_num_experts")
            if _get(text, k)
        ),
        None,
    )
    inter = _get(text, "moe_intermediate_size") or _get(text, "intermediate_size")
    hidden = _get(text, "hidden_size")
    if not experts or not inter or not hidden:
        return None
    if arch in NON_GATED_ARCHS:
        gated, act = False, _get(text, NON_GATED_ARCHS[arch]) or "relu2"
    else:
        act = _get(text, "hidden_act") or _get(text, "hidden_activation") or "silu"
        gated = act != "relu2"
    act = _ACT_ALIASES.get(str(act), str(act))
    quant_cfg = _get(cfg, "quantization_config") or _get(text, "quantization_config")
    detected, block, scheme = detect_quantization(quant_cfg)
    act_scheme = _get(quant_cfg, "activation_scheme") if quant_cfg else None
    quant = quantization if quantization is not None else detected
    if quant == "modelopt" and detected and detected.startswith("modelopt_"):
        quant = detected
    online = quantization is not None and (detected is None or (detected, quant) in ONLINE_FROM)
    return MoeProblem(
        hidden_size=int(hidden),
        intermediate_size=int(inter),
        num_experts=int(experts),
        top_k=int(_get(text, "num_experts_per_tok") or _get(text, "moe_topk") or 1),
        checkpoint=Checkpoint(
            quantization=quant,
            weight_block_size=block if quant == "fp8" else None,
            quant_scheme=scheme if quant == "compressed-tensors" else None,
            activation_scheme=str(act_scheme) if quant == "fp8" and act_scheme else None,
            fp4_experts=quant == "fp8" and fp4_experts(cfg, quant_cfg),
            online=online,
        ),
        activation=act,
        gated=gated,
        architecture=arch,
        routing_method=int(ROUTING_BY_ARCH[arch]) if arch in ROUTING_BY_ARCH else None,
        no_fused_moe=no_fused_moe_reason(archs, quant),
        **parallel,
    )


#: architectures whose published checkpoints store the routed experts in MXFP4 on an FP8 config (SGLang's
#: ModelConfig.is_fp4_experts detects DeepSeek-V4's from the expert tensors' I8/U8/F4 dtype, which config.json
#: alone cannot show)
FP4_EXPERT_ARCHS = ("DeepseekV4ForCausalLM",)


def fp4_experts(cfg: Any, quant_cfg: Any) -> bool:
    """SGLang's ModelConfig.is_fp4_experts, as far as config.json tells: `routed_experts_quant_method: mxfp4`
    (0.5.19+), MiMo-V2's `store_dtype: mxfp4`, or a DeepSeek-V4 architecture."""
    text = _get(cfg, "text_config") or cfg
    if quant_cfg and str(_get(quant_cfg, "routed_experts_quant_method", "") or "").lower() == "mxfp4":
        return True
    if str(_get(text, "store_dtype", "") or _get(quant_cfg or {}, "store_dtype", "") or "").lower() == "mxfp4":
        return True
    archs = _get(cfg, "architectures") or _get(text, "architectures") or []
    return any(a in FP4_EXPERT_ARCHS for a in archs)


__all__ = [
    "FP4_EXPERT_ARCHS",
    "MIXTRAL_FUSED_MOE_QUANTS",
    "NON_GATED_ARCHS",
    "ROUTING_BY_ARCH",
    "detect_quantization",
    "fp4_experts",
    "no_fused_moe_reason",
    "problem_from_hf_config",
]
