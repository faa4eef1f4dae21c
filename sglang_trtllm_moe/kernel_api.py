"""The contract of FlashInfer's TRT-LLM-Gen fused MoE entry points, without importing flashinfer.

Why one module: the runner calls these entry points (on SM100) or the emulator's (anywhere) with the same
arguments (their signatures: one table here, the emulator's entry points are made from it), the formats declare which
activations their kernel computes, and the emulator mirrors the enums; all of
them must agree with flashinfer's `tllm_enums` and SGLang's `get_activation_type` (tests compare against both), and
importing flashinfer on a CPU box is slow or impossible (0.6.8-0.6.12 assert libcudart at import).
"""

from __future__ import annotations

import enum
import inspect
from typing import Any


class ActivationType(enum.IntEnum):
    """Same values as `flashinfer.tllm_enums.ActivationType` (checked by tests), without importing flashinfer."""

    Gelu = 0
    Relu = 1
    Silu = 2
    Swiglu = 3
    Geglu = 4
    SwigluBias = 5
    Relu2 = 6
    SwigluStep = 7
    GegluTanh = 8
    Identity = 9
    Situ = 10
    InvalidType = 11
    ClampedRelu2 = 12
    PowLU = 13  # flashinfer 0.7.4+ (FLASHINFER_ADDED)


class WeightLayout(enum.IntEnum):
    MajorK = 0
    MajorMn = 1
    BlockMajorK = 2


class Fp8QuantizationType(enum.IntEnum):
    NoneFp8 = 0
    DeepSeekFp8 = 1
    MxFp8 = 2
    PerTensorFp8 = 3
    PerChannelFp8 = 4


class RoutingMethodType(enum.IntEnum):
    """Same values as `flashinfer.tllm_enums.RoutingMethodType` (checked by tests), without importing flashinfer."""

    Default = 0  # softmax over all experts -> top-k (weights not renormalized)
    Renormalize = 1  # top-k of logits -> softmax over the k
    DeepSeekV3 = 2  # sigmoid (+bias for selection) -> group top-2 sum -> top groups -> top-k; sigma*rsf/sum
    Llama4 = 3  # top-1 -> sigmoid
    RenormalizeNaive = 4  # softmax -> top-k -> renormalize (same kernel and result as Renormalize)
    TopK = 5  # top-k of raw logits, raw weights
    SigmoidRenorm = 6  # sigmoid -> top-k -> divide by sum (if norm_topk_prob)
    MiniMax2 = 7  # sigmoid + bias for selection -> top-k -> sigma*rsf/(sum+eps)
    Sigmoid = 8  # sigmoid -> top-k, no renormalization
    TopKSigmoid = 9  # top-k of raw logits -> sigmoid
    Unspecified = 10


#: SGLang's activation names -> the kernels' ActivationType, per gating (SGLang flashinfer_trtllm.py
#: `get_activation_type`); gated activations read GEMM1 as two halves [up; gate]
GATED = {"silu": ActivationType.Swiglu, "gelu": ActivationType.Geglu, "situ": ActivationType.Situ}
NON_GATED = {"silu": ActivationType.Silu, "gelu": ActivationType.Gelu, "relu2": ActivationType.Relu2}


def activation_type(activation: str, gated: bool) -> int:
    """The kernels' `activation_type` for SGLang's (activation, is_gated)."""
    table = GATED if gated else NON_GATED
    if activation not in table:
        raise ValueError(
            f"activation {activation!r} ({'gated' if gated else 'non-gated'}) is not served by the TRT-LLM-Gen MoE "
            f"kernels; supported: {sorted(table)}"
        )
    return int(table[activation])


#: kernel families: flashinfer.fused_moe.trtllm_<family>_moe and trtllm_<family>_routed_moe
FAMILIES = ("fp4_block_scale", "fp8_block_scale", "fp8_per_tensor_scale", "bf16", "mxint4_block_scale")


def kernel_function(family: str, routed: bool) -> str:
    """The entry point's name: logits routed inside the kernel, or precomputed top-k (`_routed`)."""
    if family not in FAMILIES:
        raise ValueError(f"unknown TRT-LLM-Gen MoE kernel family {family!r}; known: {FAMILIES}")
    return f"trtllm_{family}_{'routed_' if routed else ''}moe"


KERNEL_FUNCTIONS = tuple(kernel_function(f, r) for f in FAMILIES for r in (False, True))


#: From which flashinfer-python each in-kernel routing method writes `routing_replay_out` (int16 [tokens, top_k], the
#: experts the kernel routed each token to: rollout routing replay, SGLang's --enable-return-routed-experts). Read
#: from the CUDA sources each wheel ships (data/csrc/fused_moe/trtllm_backend/): every entry point takes the argument
#: from 0.6.8.post1 (the oldest pin), but until 0.6.14 only the DeepSeekV3 routing kernel writes it (the custom
#: kernels set the pointer and skip the write, flashinfer#3382: the buffer keeps whatever it held), and the Llama4
#: kernel writes it from 0.6.18. A method missing here has no replay on any version.
ROUTING_REPLAY_SINCE: dict[RoutingMethodType, str] = {
    RoutingMethodType.DeepSeekV3: "0.6.8",
    RoutingMethodType.Default: "0.6.14",
    RoutingMethodType.Renormalize: "0.6.14",
    RoutingMethodType.RenormalizeNaive: "0.6.14",
    RoutingMethodType.TopK: "0.6.14",
    RoutingMethodType.SigmoidRenorm: "0.6.14",
    RoutingMethodType.Sigmoid: "0.6.14",
    RoutingMethodType.MiniMax2: "0.6.14",
    RoutingMethodType.TopKSigmoid: "0.6.14",
    RoutingMethodType.Llama4: "0.6.18",
}


def replays_routing(flashinfer_version: str | None, method: int | None) -> bool:
    """Does flashinfer `flashinfer_version`'s fused MoE kernel write `routing_replay_out` for routing `method`?
    `method` None (unknown): only a flashinfer that replays every method can promise it."""
    if flashinfer_version is None:
        return False
    from packaging.version import Version

    try:
        v = Version(Version(flashinfer_version).base_version)
    except ValueError:
        return False
    if method is None:
        return all(v >= Version(since) for since in ROUTING_REPLAY_SINCE.values())
    since = ROUTING_REPLAY_SINCE.get(RoutingMethodType(int(method))) if int(method) in _METHOD_VALUES else None
    return since is not None and v >= Version(since)


_METHOD_VALUES = {int(m) for m in RoutingMethodType}


#: The dtypes the in-kernel-routing entry points take `routing_logits` in, read from flashinfer's launcher
#: (data/csrc/trtllm_fused_moe_kernel_launcher.cu). From 0.6.8 (flashinfer#2534; the oldest pin, SGLang 0.5.11's
#: 0.6.8.post1) `FusedMoeLauncher::check_routing_logits` accepts float32 or bfloat16 for every entry point and every
#: routing method (0.7.2.post1: lines 1238-1252, `TVM_FFI_ICHECK(routing_logits.value().dtype() == dl_float32 ||
#: ... == dl_bfloat16) << "routing_logits must be float or bfloat16."`; the routing kernels take either,
#: fused_moe/trtllm_backend/trtllm_fused_moe_routing_runner.cu `mDtypeInput = dtypeLogits`). Before 0.6.8 the FP8
#: per-tensor and FP8 block launchers wanted float32 for DeepSeekV3 and bfloat16 for every other method, and the FP4
#: one float32 for DeepSeekV3 (flashinfer#2469; the crash of a float32 router on FP8 block in flashinfer#2796).
#: Anything else (float16 from a model served in fp16, float64) is refused by every version.
ROUTING_LOGITS_ANY_METHOD_SINCE = "0.6.8"
#: what every pinned flashinfer (and the emulator) takes for every routing method
ROUTING_LOGITS_DTYPES = ("float32", "bfloat16")
#: widenings that keep every value exactly
_EXACT_WIDENINGS = {"bfloat16": ("float32",), "float16": ("float32",)}


def routing_logits_dtypes(flashinfer_version: str | None, family: str, method: int | None) -> tuple[str, ...]:
    """The `routing_logits` dtypes (torch names without "torch.") flashinfer `flashinfer_version`'s `family` entry
    point accepts with routing `method`; None = the newest contract (the emulator's)."""
    if flashinfer_version is None:
        return ROUTING_LOGITS_DTYPES
    from packaging.version import Version

    try:
        v = Version(Version(flashinfer_version).base_version)
    except ValueError:
        return ROUTING_LOGITS_DTYPES  # "unknown": the contract of every pinned version
    if v >= Version(ROUTING_LOGITS_ANY_METHOD_SINCE):
        return ROUTING_LOGITS_DTYPES
    deepseek = method is not None and int(method) == int(RoutingMethodType.DeepSeekV3)
    if family in ("fp8_per_tensor_scale", "fp8_block_scale"):
        return ("float32",) if deepseek else ("bfloat16",)
    if family == "fp4_block_scale" and deepseek:
        return ("float32",)
    return ROUTING_LOGITS_DTYPES


def routing_logits_dtype(dtype: str, accepted: tuple[str, ...]) -> str | None:
    """The dtype to hand router logits of `dtype` to a kernel that accepts `accepted`: `dtype` itself, an exact
    widening of it (bfloat16 / float16 -> float32), or None when no accepted dtype holds every value (float32 where
    only bfloat16 is taken, float64): then they must not be cast, SGLang's own top-k routes instead."""
    if dtype in accepted:
        return dtype
    return next((d for d in _EXACT_WIDENINGS.get(dtype, ()) if d in accepted), None)


#: What each in-kernel routing method computes, as the top-k configuration SGLang's TopK would need to compute the
#: same (SGLang 0.5.23's own rule, `layers/moe/topk.py` `_can_bypass_trtllm_routing`; tests/test_routing.py compares
#: `kernel_routing_problem` with it). Method -> (scoring function or None for "any", renormalize or None for "any",
#: needs grouped top-k with a correction bias, needs plain top-k: no grouping, no bias). Methods not listed compute
#: nothing SGLang's TopK asks for (TopK, MiniMax2, TopKSigmoid, Unspecified): never routed in the kernel for a layer.
_KERNEL_ROUTING: dict[RoutingMethodType, tuple[str | None, bool | None, bool, bool]] = {
    # the biased grouped router: sigmoid whatever the layer's scoring function says, as SGLang's own grouped path
    RoutingMethodType.DeepSeekV3: (None, True, True, False),
    RoutingMethodType.Renormalize: ("softmax", True, False, True),
    RoutingMethodType.RenormalizeNaive: ("softmax", True, False, True),
    RoutingMethodType.Default: ("softmax", False, False, True),
    RoutingMethodType.SigmoidRenorm: ("sigmoid", True, False, True),
    RoutingMethodType.Sigmoid: ("sigmoid", False, False, True),
}


def kernel_routing_problem(method: int | None, topk_config: Any) -> str | None:
    """Why the kernel's routing `method` would not compute what a layer's top-k configuration asks for (SGLang's
    TopKConfig of any release, read by duck typing: fields a release lacks read as their neutral value), or None
    when it computes exactly that. SGLang before 0.5.23 hands every layer on flashinfer_trtllm to the kernel's
    router with the layer's method whatever its top-k asks (a DeepSeek-V4 sqrtsoftplus layer routed as DeepSeekV3's
    sigmoid, a DeepSeekV3 layer without its correction bias grouped as if it had one); the plugin runner routes such
    a layer with SGLang's own top-k and the routed kernel instead, on every release."""
    if method is None or int(method) not in _METHOD_VALUES or int(method) == int(RoutingMethodType.Unspecified):
        return "the layer declares no routing method (the kernel would guess one)"
    m = RoutingMethodType(int(method))
    cfg = topk_config
    if getattr(cfg, "sqrtsoftplus_log1p", False):
        return "sqrtsoftplus routing (through log1p): no TRT-LLM-Gen routing method computes it"
    shared = getattr(cfg, "num_shared_topk_slots", 0) or 0
    if shared:
        return f"{shared} shared-expert top-k slot(s) appended by SGLang's top-k"
    grouped = bool(getattr(cfg, "use_grouped_topk", False))
    biased = getattr(cfg, "correction_bias", None) is not None
    custom = getattr(cfg, "custom_routing_function", None) is not None
    renorm = bool(getattr(cfg, "renormalize", True))
    scoring = getattr(cfg, "scoring_func", "softmax") or "softmax"
    if m == RoutingMethodType.Llama4:
        ok = not grouped and not biased and int(getattr(cfg, "top_k", 0)) == 1 and not renorm and custom
        return None if ok else "Llama4 routing is top-1 sigmoid through Llama-4's own routing function only"
    if custom:
        return "a custom routing function (the kernel computes its own method's)"
    rule = _KERNEL_ROUTING.get(m)
    if rule is None:
        return f"{m.name} is not a routing SGLang's top-k computes"
    want_scoring, want_renorm, grouped_biased, plain = rule
    if grouped_biased and not (grouped and biased):
        return f"{m.name} routing is grouped top-k with a correction bias; this layer's top-k is " + (
            "ungrouped" if not grouped else "without a correction bias"
        )
    if plain and (grouped or biased):
        return f"{m.name} routing takes no expert groups and no correction bias"
    if want_scoring is not None and scoring != want_scoring:
        return f"{m.name} routing scores with {want_scoring}; this layer's top-k scores with {scoring}"
    if want_renorm is not None and renorm != want_renorm:
        verb = "renormalizes" if want_renorm else "does not renormalize"
        return f"{m.name} routing {verb} the top-k weights; this layer's top-k " + ("does" if renorm else "does not")
    return None


class _Unset:
    """flashinfer 0.7.4's default of `nvfp4_4over6` ("not passed: read the FLASHINFER_NVFP4_4OVER6* environment"),
    mirrored: the same repr, compared by identity as theirs is (it has no `__eq__`)."""

    def __repr__(self) -> str:
        return "<nvfp4_4over6 unset: read FLASHINFER_NVFP4_4OVER6*>"

    def __reduce__(self) -> str:
        return "UNSET"


#: the default of the FP4 entry points' `nvfp4_4over6` (see `_Unset`)
UNSET: Any = _Unset()

# ----------------------------------------------------------------------------------------------------------------
# The entry points' signatures: one table, read from flashinfer's `fused_moe/core.py` of the newest tested version
# (0.7.4). The emulator's entry points are generated from it (emulator/entry_points.py) and tests/test_emulator.py
# compares it with the installed flashinfer's: names, order, kinds, defaults.
# ----------------------------------------------------------------------------------------------------------------

#: the spine every entry point shares, in this order, required: the expert-parallel and routing sizes
_SIZES = "num_experts top_k n_group topk_group intermediate_size local_expert_offset local_num_experts"
_FP4_TENSORS = (
    "hidden_states hidden_states_scale gemm1_weights gemm1_weights_scale gemm1_bias gemm1_alpha gemm1_beta "
    "gemm1_clamp_limit gemm2_weights gemm2_weights_scale gemm2_bias output1_scale_scalar output1_scale_gate_scalar "
    "output2_scale_scalar"
)
_FP8_BLOCK_TENSORS = (
    "hidden_states hidden_states_scale gemm1_weights gemm1_weights_scale gemm2_weights gemm2_weights_scale"
)
_FP8_TENSOR_TENSORS = (
    "hidden_states gemm1_weights output1_scales_scalar output1_scales_gate_scalar gemm2_weights output2_scales_scalar"
)
#: INT4 weights x BF16 activations: SwiGLU only (no activation_type: the launcher fixes it), no output scalars
_MXINT4_TENSORS = (
    "hidden_states gemm1_weights gemm1_weights_scale gemm1_alpha gemm1_beta gemm1_clamp_limit gemm2_weights "
    "gemm2_weights_scale"
)
#: Each entry point's parameters in order, as flashinfer writes them, space-separated: positional-or-keyword, "|" =
#: the defaulted ones start here (their defaults: DEFAULTS, else None), "*" = keyword-only from here. The first one
#: routes: `routing_logits` (routing inside the kernel) or `topk_ids` (precomputed top-k, the `_routed` entry points).
SIGNATURE_SPECS: dict[str, str] = {
    "trtllm_fp4_block_scale_moe": f"routing_logits routing_bias {_FP4_TENSORS} {_SIZES} routed_scaling_factor"
    " | routing_method_type do_finalize enable_pdl activation_type per_token_scale output tune_max_num_tokens"
    " norm_topk_prob routing_replay_out num_fused_shared_experts valid_hidden_size valid_intermediate_size"
    " hidden_states_scale_layout workspace_buffer nvfp4_4over6",
    "trtllm_fp4_block_scale_routed_moe": f"topk_ids routing_bias {_FP4_TENSORS} {_SIZES} routed_scaling_factor"
    " | routing_method_type do_finalize enable_pdl activation_type per_token_scale output tune_max_num_tokens"
    " gemm1_lora_delta valid_hidden_size valid_intermediate_size num_fused_shared_experts hidden_states_scale_layout"
    " workspace_buffer nvfp4_4over6 routing_metadata",
    "trtllm_fp8_block_scale_moe": f"routing_logits routing_bias {_FP8_BLOCK_TENSORS} {_SIZES} routed_scaling_factor"
    " | routing_method_type use_shuffled_weight weight_layout do_finalize enable_pdl tune_max_num_tokens"
    " fp8_quantization_type num_fused_shared_experts activation_type norm_topk_prob routing_replay_out gemm1_alpha"
    " gemm1_beta gemm1_clamp_limit output valid_hidden_size valid_intermediate_size"
    " * gemm1_bias gemm2_bias workspace_buffer",
    "trtllm_fp8_block_scale_routed_moe": f"topk_ids routing_bias {_FP8_BLOCK_TENSORS} {_SIZES} routed_scaling_factor"
    " | routing_method_type use_shuffled_weight weight_layout do_finalize enable_pdl gemm1_lora_delta output"
    " tune_max_num_tokens fp8_quantization_type activation_type gemm1_alpha gemm1_beta gemm1_clamp_limit"
    " valid_hidden_size valid_intermediate_size workspace_buffer",
    "trtllm_fp8_per_tensor_scale_moe": f"routing_logits routing_bias {_FP8_TENSOR_TENSORS} {_SIZES}"
    " routed_scaling_factor use_routing_scales_on_input | routing_method_type do_finalize enable_pdl"
    " tune_max_num_tokens activation_type norm_topk_prob routing_replay_out output gemm1_clamp_limit workspace_buffer",
    "trtllm_fp8_per_tensor_scale_routed_moe": f"topk_ids routing_bias {_FP8_TENSOR_TENSORS} {_SIZES}"
    " routed_scaling_factor use_routing_scales_on_input | routing_method_type do_finalize enable_pdl"
    " tune_max_num_tokens activation_type routing_replay_out output gemm1_clamp_limit workspace_buffer",
    "trtllm_bf16_moe": f"routing_logits routing_bias hidden_states gemm1_weights gemm2_weights {_SIZES}"
    " | routed_scaling_factor routing_method_type use_shuffled_weight weight_layout do_finalize enable_pdl"
    " tune_max_num_tokens activation_type norm_topk_prob routing_replay_out gemm1_alpha gemm1_beta gemm1_clamp_limit"
    " output workspace_buffer",
    "trtllm_bf16_routed_moe": f"topk_ids hidden_states gemm1_weights gemm2_weights {_SIZES}"
    " | routed_scaling_factor routing_method_type use_shuffled_weight weight_layout do_finalize enable_pdl"
    " gemm1_lora_delta tune_max_num_tokens activation_type routing_replay_out gemm1_alpha gemm1_beta"
    " gemm1_clamp_limit output workspace_buffer",
    "trtllm_mxint4_block_scale_moe": f"routing_logits routing_bias {_MXINT4_TENSORS} {_SIZES} routed_scaling_factor"
    " | routing_method_type do_finalize enable_pdl output tune_max_num_tokens norm_topk_prob routing_replay_out"
    " valid_hidden_size valid_intermediate_size workspace_buffer",
    "trtllm_mxint4_block_scale_routed_moe": f"topk_ids {_MXINT4_TENSORS} {_SIZES} routed_scaling_factor"
    " | routing_method_type do_finalize enable_pdl gemm1_lora_delta output tune_max_num_tokens valid_hidden_size"
    " valid_intermediate_size workspace_buffer",
}
#: the defaults that are not None, the same on every entry point that takes the parameter ...
DEFAULTS: dict[str, Any] = {
    "routing_method_type": 0,
    "do_finalize": True,
    "activation_type": ActivationType.Swiglu.value,
    "tune_max_num_tokens": 8192,
    "norm_topk_prob": True,
    "use_shuffled_weight": False,
    "weight_layout": 0,
    "fp8_quantization_type": Fp8QuantizationType.DeepSeekFp8,
    "nvfp4_4over6": UNSET,
}
#: ... but for a family's own (BF16 takes shuffled block-major-K weights and enables PDL by default)
FAMILY_DEFAULTS: dict[str, dict[str, Any]] = {
    "bf16": {"use_shuffled_weight": True, "weight_layout": WeightLayout.BlockMajorK, "enable_pdl": True},
}


def _signature(name: str, family: str) -> inspect.Signature:
    P = inspect.Parameter
    defaults: dict[str, Any] | None = None
    keyword_only, params = False, []
    for word in SIGNATURE_SPECS[name].split():
        if word == "|":
            defaults = {**DEFAULTS, **FAMILY_DEFAULTS.get(family, {})}
        elif word == "*":
            keyword_only = True
        else:
            kind = P.KEYWORD_ONLY if keyword_only else P.POSITIONAL_OR_KEYWORD
            params.append(P(word, kind, default=P.empty if defaults is None else defaults.get(word)))
    return inspect.Signature(params)


#: entry point name -> its flashinfer signature (names, order, kinds, defaults; no annotations)
SIGNATURES: dict[str, inspect.Signature] = {
    kernel_function(f, r): _signature(kernel_function(f, r), f) for f in FAMILIES for r in (False, True)
}

#: What flashinfer added to these entry points and enums after 0.7.2.post1 (the flashinfer of SGLang 0.5.23's env,
#: the oldest the contract tests compare against), read from the wheels: parameter (of every entry point in
#: SIGNATURES that takes it) or enum member name -> the first version that has it. The emulator and the enums here
#: follow the newest; tests/test_emulator.py leaves out what the installed flashinfer predates and compares the rest
#: exactly. 0.7.4 (next after 0.7.2.post1): a caller-owned scratch buffer on every entry point (keyword-only on
#: trtllm_fp8_block_scale_moe, after its keyword-only biases), the NVFP4 "4over6" recipe of the per-token
#: requantization on both FP4 entry points, precomputed routing metadata on the routed FP4 one, and PowLU. (A name
#: that reaches different entry points in different versions would need keys per entry point.)
FLASHINFER_ADDED: dict[str, str] = {
    "workspace_buffer": "0.7.4",
    "nvfp4_4over6": "0.7.4",
    "routing_metadata": "0.7.4",
    "PowLU": "0.7.4",
}
_ENUMS = {e.__name__: e for e in (ActivationType, WeightLayout, Fp8QuantizationType, RoutingMethodType)}


def flashinfer_predates(version: str, owner: str) -> set[str]:
    """The parameters (of entry point `owner`) or members (of enum `owner`) that flashinfer `version` does not have
    yet, per FLASHINFER_ADDED."""
    from packaging.version import Version

    names = SIGNATURES[owner].parameters if owner in SIGNATURES else _ENUMS[owner].__members__
    v = Version(version)
    return {n for n, since in FLASHINFER_ADDED.items() if n in names and v < Version(since)}


__all__ = [
    "ActivationType",
    "WeightLayout",
    "Fp8QuantizationType",
    "RoutingMethodType",
    "GATED",
    "NON_GATED",
    "activation_type",
    "FAMILIES",
    "kernel_function",
    "KERNEL_FUNCTIONS",
    "UNSET",
    "SIGNATURE_SPECS",
    "DEFAULTS",
    "FAMILY_DEFAULTS",
    "SIGNATURES",
    "FLASHINFER_ADDED",
    "flashinfer_predates",
    "ROUTING_REPLAY_SINCE",
    "replays_routing",
    "ROUTING_LOGITS_ANY_METHOD_SINCE",
    "ROUTING_LOGITS_DTYPES",
    "routing_logits_dtypes",
    "routing_logits_dtype",
    "kernel_routing_problem",
]
