"""MX-format MoE layers on the TRT-LLM-Gen kernels, prepared in place by the plugin, per dirty expert.

* MXFP8 (`quant_method: mxfp8` -> Fp8MoEMethod.use_mxfp8) on flashinfer_trtllm / flashinfer_trtllm_routed
  (formats/mxfp8.py). SGLang's own prep is in place but re-shuffles every expert at every flush, so after a
  one-expert RL update the experts that were not reloaded are shuffled twice.
* MXFP4 experts on an FP8 config (Mxfp4FlashinferTrtllmMoEMethod, flashinfer_mxfp4, 0.5.12+;
  formats/mxfp4_experts.py): storage allocated at the kernel's final width right after SGLang's create_weights
  (e8m0 scales, weights padded per half), prepared in place, run through the plugin runner. SGLang's own prep
  builds new Parameters without `weight_loader`, so its next RL update raises AttributeError.
* gpt-oss MXFP4 (Mxfp4MoEMethod on flashinfer_mxfp4, SM100 trtllm-gen; formats/mxfp4_gptoss.py): biases allocated
  fp32 right after SGLang's create_weights, weights and scales kept uint8, prepared in place; fused all-expert
  writes are validated and un-prepared in the FusedMoE.weight_loader hook (loader_hooks.py). SGLang's own prep
  replaces the Parameters (scales viewed e4m3, biases fp32), so its reload raises TypeError or value-converts.

Layers the plugin does not take stay SGLang's, with one log line per reason: online MXFP8 (`--quantization mxfp8`
on a BF16 checkpoint: SGLang quantizes at prep and rebinds the Parameters to fp8), non-gated MXFP8 before 0.5.19
(SGLang allocates 2I rows and slices them at prep). FP4 experts explicitly put on flashinfer_trtllm (SGLang has no
MXFP4 path there: plain Fp8MoEMethod fails at the first forward) are a TrtllmLayerError naming the fix.
"""

from __future__ import annotations

import logging

from .. import hookimpl, layer_attrs, layer_state
from ..compat import features
from ..errors import TrtllmLayerError
from ..formats.mxfp4_experts import MXFP4_EXPERTS
from ..formats.mxfp4_gptoss import MXFP4_GPTOSS
from ..formats.mxfp8 import MXFP8
from ..targets import HookTarget
from ._prepare import kw, sglang_prepares, take_over

logger = logging.getLogger("sglang_trtllm_moe")

FP4_EXPERTS = "sglang.srt.layers.quantization.mxfp4_flashinfer_trtllm_moe.Mxfp4FlashinferTrtllmMoEMethod"
GPTOSS = "sglang.srt.layers.quantization.mxfp4.Mxfp4MoEMethod"
#: set on a layer whose storage the plugin allocated (its unpadded per-rank intermediate size)
ALLOCATED = layer_attrs.UNPADDED_INTERMEDIATE
GPTOSS_ALLOCATED = layer_attrs.GPTOSS_ALLOCATED

_LOGGED: set = set()


def hand_back(layer, what: str, why: str) -> None:
    """One log line per (format, reason) and process: the layer stays on SGLang's own path."""
    key = (what, why)
    if key not in _LOGGED:
        _LOGGED.add(key)
        logger.info(
            "sglang-trtllm-moe: %s (first: %s) stays on SGLang's own preparation: %s",
            what,
            layer_state.layer_name(layer),
            why,
        )


def _on_trtllm() -> bool:
    from sglang.srt.layers.moe.utils import get_moe_runner_backend

    b = get_moe_runner_backend()
    return b.is_flashinfer_trtllm() or b.is_flashinfer_trtllm_routed()


def mxfp8_problem(method, layer) -> str | None:
    """None when the plugin prepares this MXFP8 layer; else why SGLang keeps it."""
    if not method.quant_config.is_checkpoint_fp8_serialized:
        return (
            "online MXFP8 (--quantization mxfp8 on a BF16 checkpoint): SGLang quantizes at prep and rebinds the "
            "Parameters to fp8, so RL updates must send BF16 weights through SGLang's own path"
        )
    if not layer.moe_runner_config.is_gated and not features.MXFP8_NON_GATED_W13_ROWS.present():
        return (
            "non-gated MXFP8 before SGLang 0.5.19: w13 is allocated with 2 x intermediate rows and sliced "
            "(new storage) by SGLang's prep"
        )
    if getattr(method, "convert_mxfp8_to_block", False):
        return "MXFP8 converted to block FP8 at load (ROCm gfx94x)"
    return None


def _mxfp8_side_attrs(method, layer) -> None:
    """What SGLang's MXFP8 post-load leaves for its apply() and dispatcher (fp8.py _process_mxfp8_moe_weights and
    the function tail). The SwiGLU tensors depend on the config only: made once, so their storage stays put."""
    import torch

    layer.w13_weight_scale_inv.format_ue8m0 = True
    layer.w2_weight_scale_inv.format_ue8m0 = True
    layer.w13_input_scale = None
    layer.w2_input_scale = None
    if (
        features.MXFP8_ACTIVATION_PARAMS.present()
        and getattr(method, "_owns_moe_runner", True)
        and not hasattr(layer, "_flashinfer_trtllm_gemm1_alpha")
    ):
        method._prepare_flashinfer_trtllm_activation_params(layer)
    if hasattr(layer, "dispatcher"):
        layer.dispatcher.set_quant_config({"weight_dtype": torch.float8_e4m3fn, "use_mxfp8": True})


def fp8_method_process_weights_after_loading(original, method, layer, *args, **kwargs):
    if getattr(method, "is_fp4_expert", False) and _on_trtllm():
        raise TrtllmLayerError(
            f"{layer_state.layer_name(layer)}: --moe-runner-backend flashinfer_trtllm cannot serve this layer: its "
            "routed experts are MXFP4 (FP4 experts on an FP8 config) and SGLang has no MXFP4 path on "
            "flashinfer_trtllm (plain Fp8MoEMethod fails at the first forward). Fix: --moe-runner-backend "
            "flashinfer_mxfp4 (SGLang's TRT-LLM-Gen MXFP4 path, which the plugin prepares in place), or auto"
        )
    if not getattr(method, "use_mxfp8", False) or not _on_trtllm():
        return sglang_prepares(original, method, layer, *args, **kwargs)
    problem = mxfp8_problem(method, layer)
    if problem:
        hand_back(layer, "MXFP8 layer", problem)
        return sglang_prepares(original, method, layer, *args, **kwargs)
    if not take_over(MXFP8, method, layer, _mxfp8_side_attrs):
        return sglang_prepares(original, method, layer, *args, **kwargs)


# ---- MXFP4 experts on an FP8 config -----------------------------------------------------------------------------


def _megamoe() -> bool:
    from sglang.srt.layers.moe.utils import get_moe_a2a_backend

    a2a = get_moe_a2a_backend()
    return any(getattr(a2a, m, lambda: False)() for m in ("is_megamoe", "is_flashinfer_megamoe"))


def fp4_experts_create_weights(result, method, *args, **kwargs):
    """AFTER SGLang's create_weights (nothing loaded yet): the kernel's final storage, kept for the layer's life."""
    layer = kw(args, kwargs, 0, "layer")
    hidden = int(kw(args, kwargs, 2, "hidden_size"))
    inter = int(kw(args, kwargs, 3, "intermediate_size_per_partition"))
    problem = (
        "MegaMoE consumes the canonical layout"
        if _megamoe()
        else MXFP4_EXPERTS.allocation_problem(layer, inter, hidden)
    )
    if problem:
        hand_back(layer, "MXFP4-expert layer", problem)
        return result
    MXFP4_EXPERTS.allocate_(layer, inter, hidden)
    object.__setattr__(layer, ALLOCATED, inter)
    return result


def _fp4_experts_side_attrs(method, layer) -> None:
    """What SGLang's prep leaves for apply() and the dispatcher: the three all-ones output scales (buffers, as
    SGLang registers them; made once, so their storage stays put), the padded intermediate (0.5.21+), and the FP8
    delegate's dispatcher wire format."""
    import torch

    for name in ("output1_scale_scalar", "output1_scale_gate_scalar", "output2_scale_scalar"):
        if getattr(layer, name, None) is None:
            layer.register_buffer(
                name,
                torch.ones(layer.num_local_experts, dtype=torch.float32, device=layer.w13_weight.device),
                persistent=False,
            )
    if features.FP4_EXPERTS_SGLANG_PADS.present():
        layer.intermediate_size_per_partition = layer.w2_weight.shape[2] * 2
    if hasattr(layer, "dispatcher"):
        layer.dispatcher.set_quant_config({"weight_dtype": torch.int8, "use_mxfp8": False})


def fp4_experts_process_weights_after_loading(original, method, layer, *args, **kwargs):
    if getattr(layer, ALLOCATED, None) is None or not take_over(MXFP4_EXPERTS, method, layer, _fp4_experts_side_attrs):
        return sglang_prepares(original, method, layer, *args, **kwargs)


def fp4_experts_apply(original, method, layer, dispatch_output, *args, **kwargs):
    """A managed layer runs on the plugin runner with the arguments SGLang's apply builds (module-global flashinfer
    functions there cannot be reached by a hook)."""
    from types import SimpleNamespace

    from sglang.srt.layers.moe.topk import TopKOutputChecker

    from .. import runner

    if layer_state.state_of(layer) is None:
        return original(method, layer, dispatch_output, *args, **kwargs)
    _refuse_unsupported_dispatch(layer, dispatch_output)
    topk_output = dispatch_output.topk_output
    bypassed = {}
    if TopKOutputChecker.format_is_bypassed(topk_output):
        if getattr(method, "_bypassed_routing_method", None) is None:
            raise NotImplementedError("MxFP4 bypassed routing is not configured")
        cfg = topk_output.topk_config
        rsf = cfg.routed_scaling_factor
        bypassed = dict(
            norm_topk_prob=cfg.renormalize,
            routed_scaling_factor=rsf
            if getattr(cfg, "apply_routed_scaling_factor_on_output", False) and rsf is not None
            else 1.0,
        )
    qi = SimpleNamespace(
        global_num_experts=layer.num_experts,
        local_num_experts=layer.num_local_experts,
        local_expert_offset=layer.moe_ep_rank * layer.num_local_experts,
        routing_method_type=getattr(method, "_bypassed_routing_method", None),
        gemm1_clamp_limit=getattr(method, "_gemm1_clamp_limit_tensor", None),
        precision=getattr(method, "flashinfer_mxfp4_moe_precision", "default"),
        bypassed_routing=bypassed,
    )
    return runner.run(MXFP4_EXPERTS, dispatch_output, qi, method.moe_runner_config)


def _refuse_unsupported_dispatch(layer, dispatch_output) -> None:
    if getattr(dispatch_output, "hidden_states_pre_quant", None) is not None:
        raise NotImplementedError(
            f"{layer_state.layer_name(layer)}: a dispatcher-quantized MXFP8 input (hidden_states_pre_quant) is not "
            "supported by the plugin runner yet; run without the flashinfer a2a pre-quantization"
        )
    try:
        from sglang.srt.layers.moe.moe_runner.flashinfer_trtllm import is_deferred_finalize_enabled
    except ImportError:
        return
    if is_deferred_finalize_enabled():
        raise NotImplementedError(
            f"{layer_state.layer_name(layer)}: deferred MoE finalize (SGLANG_ENABLE_MOE_DEFERRED_FINALIZE) is not "
            "supported by the plugin runner yet; unset it"
        )


# ---- gpt-oss MXFP4 ------------------------------------------------------------------------------------------------


def gptoss_create_weights(result, method, *args, **kwargs):
    """AFTER SGLang's create_weights: the biases at the kernel's fp32 width, once."""
    layer = kw(args, kwargs, 0, "layer")
    if not MXFP4_GPTOSS.on_trtllm_gen(method):
        return result  # SM90/SM120 cutlass, marlin, triton kernels, ...: not a TRT-LLM-Gen layer
    problem = "MegaMoE consumes the canonical layout" if _megamoe() else MXFP4_GPTOSS.allocation_problem(method, layer)
    if problem:
        hand_back(layer, "gpt-oss MXFP4 layer", problem)
        return result
    MXFP4_GPTOSS.allocate_(layer)
    object.__setattr__(layer, GPTOSS_ALLOCATED, True)
    return result


def _gptoss_side_attrs(method, layer) -> None:
    from sglang.srt.layers.moe.utils import get_moe_a2a_backend

    layer._situ_routing_bias_bf16 = None
    if getattr(get_moe_a2a_backend(), "is_mori", lambda: False)() and hasattr(layer, "dispatcher"):
        layer.dispatcher.set_quant_config({})


def gptoss_process_weights_after_loading(original, method, layer, *args, **kwargs):
    if not getattr(layer, GPTOSS_ALLOCATED, False) or not take_over(MXFP4_GPTOSS, method, layer, _gptoss_side_attrs):
        return sglang_prepares(original, method, layer, *args, **kwargs)


def gptoss_apply(original, method, layer, dispatch_output, *args, **kwargs):
    from types import SimpleNamespace

    from .. import runner

    if layer_state.state_of(layer) is None:
        return original(method, layer, dispatch_output, *args, **kwargs)
    _refuse_unsupported_dispatch(layer, dispatch_output)
    qi = SimpleNamespace(
        global_num_experts=layer.num_experts,
        local_num_experts=layer.num_local_experts,
        local_expert_offset=layer.moe_ep_rank * layer.num_local_experts,
        precision=getattr(method, "flashinfer_mxfp4_moe_precision", "default"),
    )
    return runner.run(MXFP4_GPTOSS, dispatch_output, qi, method.moe_runner_config)


def is_mx_fp8_method(method) -> bool:
    return bool(getattr(method, "use_mxfp8", False) or getattr(method, "is_fp4_expert", False))


@hookimpl
def register_sglang_hooks(register, release):
    # Fp8MoEMethod.process_weights_after_loading: fp8_hooks.py holds the one AROUND hook on every release and hands
    # MXFP8 / FP4-expert layers to `fp8_method_process_weights_after_loading` here (two AROUND hooks on one target
    # would each have to trust the other to call through: SGLang warns about exactly that)
    rel = features.FP4_EXPERTS_METHOD.releases
    register(
        HookTarget(
            f"{FP4_EXPERTS}.create_weights",
            fp4_experts_create_weights,
            "after",
            releases=rel,
            capability="mxfp4-experts-prep",
            formats=(MXFP4_EXPERTS.name,),
            why="MXFP4-expert storage at the kernel's final width from the start (e8m0 scales, padded per half): the "
            "Parameters, their storage and weight_loader stay the same for the layer's life",
        )
    )
    register(
        HookTarget(
            f"{FP4_EXPERTS}.process_weights_after_loading",
            fp4_experts_process_weights_after_loading,
            "around",
            releases=rel,
            capability="mxfp4-experts-prep",
            formats=(MXFP4_EXPERTS.name,),
            why="MXFP4-expert layers on flashinfer_mxfp4 are prepared in place, per dirty expert (SGLang replaces the "
            "Parameters and drops their weight_loader)",
        )
    )
    register(
        HookTarget(
            f"{FP4_EXPERTS}.apply",
            fp4_experts_apply,
            "around",
            releases=rel,
            capability="mxfp4-experts-prep",
            formats=(MXFP4_EXPERTS.name,),
            why="managed MXFP4-expert layers run on the plugin runner (flashinfer's kernel, or the emulator)",
        )
    )
    register(
        HookTarget(
            f"{GPTOSS}.create_weights",
            gptoss_create_weights,
            "after",
            capability="mxfp4-gptoss-prep",
            formats=(MXFP4_GPTOSS.name,),
            why="gpt-oss MXFP4 biases at the kernel's fp32 width from the start: Parameters, storage and weight_loader "
            "stay the same for the layer's life",
        )
    )
    register(
        HookTarget(
            f"{GPTOSS}.process_weights_after_loading",
            gptoss_process_weights_after_loading,
            "around",
            capability="mxfp4-gptoss-prep",
            formats=(MXFP4_GPTOSS.name,),
            why="gpt-oss MXFP4 layers on flashinfer_mxfp4 (SM100) are prepared in place (SGLang replaces the "
            "Parameters: its next reload raises TypeError or value-converts every scale byte)",
        )
    )
    register(
        HookTarget(
            f"{GPTOSS}.apply",
            gptoss_apply,
            "around",
            capability="mxfp4-gptoss-prep",
            formats=(MXFP4_GPTOSS.name,),
            why="managed gpt-oss MXFP4 layers run on the plugin runner (flashinfer's kernel, or the emulator)",
        )
    )
