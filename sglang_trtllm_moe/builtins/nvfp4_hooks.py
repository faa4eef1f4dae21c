"""NVFP4 layers on flashinfer_trtllm, prepared in place by the plugin: ModelOpt and compressed-tensors (W4A4).

SGLang's own prep allocates new tensors per expert (and compressed-tensors renames the parameters), so every later
weight update either writes into kernel-layout storage or re-shuffles experts that were not reloaded; the plugin's
prep is in place, per dirty expert (formats/nvfp4.py, formats/ct_nvfp4.py).
"""

from __future__ import annotations

import logging

from .. import hookimpl, layer_state
from ..compat import features
from ..errors import TrtllmLayerError
from ..formats import CT_NVFP4, NVFP4, NVFP4_ONLINE, NVFP4_ONLINE_TENSOR
from ..targets import HookTarget
from ._prepare import UNREADABLE, kw, sglang_prepares, take_over

logger = logging.getLogger("sglang_trtllm_moe")

MODELOPT = "sglang.srt.layers.quantization.modelopt_quant"
CT_NVFP4_SCHEME = (
    "sglang.srt.layers.quantization.compressed_tensors.schemes.compressed_tensors_w4a4_nvfp4_moe."
    "CompressedTensorsW4A4Nvfp4MoE"
)


def _modelopt_serves(method, layer) -> tuple[bool, str]:
    if not getattr(method, "enable_flashinfer_trtllm_moe", False):
        return False, "not on the flashinfer_trtllm backend"
    if features.NVFP4_MEGAMOE_LAYOUT.present() and not method.use_flashinfer_trtllm_weight_layout:
        return False, "MegaMoE consumes the canonical layout"
    if features.NVFP4_W13_INTERLEAVED_CHECKPOINTS.present() and getattr(layer, "inference_moe_w13_interleaved", False):
        return False, "w13 is stored interleaved by the checkpoint; SGLang de-interleaves it itself"
    return True, ""


def _modelopt_side_attrs(method, layer) -> None:
    """Attributes SGLang's own trtllm path leaves on the layer, which its apply() and dispatcher read."""
    for half in ("w13", "w2"):
        # the kernel never reads *_blockscale_swizzled; SGLang aliases it to the scales. Releases that registered a
        # placeholder Parameter keep it, so every registered parameter stays the same object.
        if not features.NVFP4_BLOCKSCALE_SWIZZLED_PARAMETERS.present():
            setattr(layer, f"{half}_blockscale_swizzled", getattr(layer, f"{half}_weight_scale"))
    layer.trtllm_padded_hidden_size = None
    dispatcher = getattr(layer, "dispatcher", None)
    if dispatcher is not None and hasattr(dispatcher, "set_quant_config"):
        dispatcher.set_quant_config({"input_global_scale": None})


def modelopt_process_weights_after_loading(original, method, layer, *args, **kwargs):
    ok, _ = _modelopt_serves(method, layer)
    if not ok:
        return sglang_prepares(original, method, layer, *args, **kwargs)
    if not take_over(_modelopt_format(method), method, layer, _modelopt_side_attrs):
        return sglang_prepares(original, method, layer, *args, **kwargs)


def _modelopt_format(method):
    """nvfp4_online's method subclasses ModelOpt's (same parameters): per-token activations under
    `--quantization nvfp4_online`; static per-tensor ones under `modelopt_fp4` on a checkpoint without NVFP4
    metadata (features.MODELOPT_FP4_ONLINE: not serialized, quantized as it loads). Each is its own format."""
    config = getattr(method, "quant_config", None)
    get_name = getattr(config, "get_name", None)
    name = get_name() if callable(get_name) else None
    if name == "nvfp4_online":
        return NVFP4_ONLINE
    if name == "modelopt_fp4" and getattr(config, "is_checkpoint_nvfp4_serialized", True) is False:
        return NVFP4_ONLINE_TENSOR
    return NVFP4


def held_format(method, layer):
    """The format a ModelOpt NVFP4 layer holds (aside.owners: one quant-method class, several formats)."""
    return _modelopt_format(method)


def modelopt_create_moe_runner(result, method, *args, **kwargs):
    """AFTER create_moe_runner (features.NVFP4_AUTO_RUNNER_MISMATCH): prepare for the runner that will actually run.

    With a global `auto` on Blackwell, SGLang's NVFP4 method resolves its runner to FLASHINFER_TRTLLM here, after
    its __init__ (and FusedMoE) keyed the weight layout on the global backend. Before anything is loaded, the method
    and the layer are told the runner they got, so the loader's w1/w3 order, the post-load layout (the plugin's, or
    SGLang's own) and apply's trtllm branch all agree. SGLang's rule is read (its result), not repeated. A layer
    whose shapes the TRT-LLM layout cannot take (SGLang pads the intermediate only for an explicit
    flashinfer_trtllm) fails here with one clear error instead of at its first forward."""
    layer = kw(args, kwargs, 0, "layer")
    backend = getattr(method, "_moe_runner_backend", None)
    if backend is None or getattr(method, "enable_flashinfer_trtllm_moe", True):
        return result
    if not (backend.is_flashinfer_trtllm() or backend.is_flashinfer_trtllm_routed()):
        return result
    if features.NVFP4_MEGAMOE_LAYOUT.present():
        from sglang.srt.layers.moe.utils import get_moe_a2a_backend

        if get_moe_a2a_backend().is_megamoe():  # consumes the canonical layout, never runs FusedMoE's runner
            return result
    try:
        problem = NVFP4.check_layout(layer)
    except UNREADABLE as e:  # not the layer the plugin knows: SGLang's own behaviour, unchanged
        logger.info(
            "sglang-trtllm-moe: %s: NVFP4 runner/layout agreement not checked (%s: %s)",
            layer_state.layer_name(layer),
            type(e).__name__,
            e,
        )
        return result
    if problem:
        raise TrtllmLayerError(
            f"{layer_state.layer_name(layer)}: SGLang's ModelOpt NVFP4 MoE method resolves --moe-runner-backend auto "
            f"to {backend.value} on this GPU, but the layer (intermediate size per rank "
            f"{layer.intermediate_size_per_partition}) is not allocated for it: {problem}. SGLang pads the "
            "intermediate size for that kernel only when it is asked for explicitly. Fix: pass "
            "--moe-runner-backend flashinfer_trtllm (the layer is then padded), or --moe-runner-backend "
            "flashinfer_cutlass"
        )
    method.enable_flashinfer_trtllm_moe = True
    if features.NVFP4_MEGAMOE_LAYOUT.present():
        method.use_flashinfer_trtllm_weight_layout = True
    layer.use_flashinfer_trtllm_moe = True  # FusedMoE's w1/w3 order and padded loading (global-only before 0.5.23)
    logger.info(
        "sglang-trtllm-moe: %s: SGLang resolved auto to %s for this NVFP4 layer; its weights are laid out "
        "for that runner",
        layer_state.layer_name(layer),
        backend.value,
    )
    return result


def ct_create_weights(result, scheme, *args, **kwargs):
    """AFTER create_weights: SGLang allocates GEMM1 with 2*I rows whatever the activation; a non-gated (relu2)
    layer on flashinfer_trtllm gets [E, I, ...] (the kernel's shape) before anything is loaded, same attributes."""
    import torch

    layer = kw(args, kwargs, 0, "layer")
    if not getattr(scheme, "use_flashinfer_trtllm", False) or layer.moe_runner_config.is_gated:
        return result
    rows = kw(args, kwargs, 3, "intermediate_size_per_partition")
    for name in ("w13_weight_packed", "w13_weight_scale"):
        old = getattr(layer, name)
        if old.shape[1] == rows:
            continue
        new = torch.nn.Parameter(
            torch.empty((old.shape[0], rows, *old.shape[2:]), dtype=old.dtype, device=old.device), requires_grad=False
        )
        for k, v in vars(old).items():  # weight_loader, quant_method, ... (set_weight_attrs)
            setattr(new, k, v)
        layer.register_parameter(name, new)
    return result


def _ct_side_attrs(scheme, layer) -> None:
    """SGLang's apply reads w13_weight / w2_weight; they alias the loaded *_packed Parameters (same object)."""
    for alias, name in CT_NVFP4.aliases.items():
        if getattr(layer, alias, None) is not getattr(layer, name):
            layer.register_parameter(alias, getattr(layer, name))


def ct_process_weights_after_loading(original, scheme, layer, *args, **kwargs):
    if not getattr(scheme, "use_flashinfer_trtllm", False):
        return sglang_prepares(original, scheme, layer, *args, **kwargs)
    if not take_over(CT_NVFP4, scheme, layer, _ct_side_attrs):
        return sglang_prepares(original, scheme, layer, *args, **kwargs)


def ct_apply_weights(original, scheme, layer, dispatch_output, *args, **kwargs):
    """features.CT_NVFP4_APPLY_CALLS_FLASHINFER: every trtllm layer runs on the plugin runner with the QuantInfo
    0.5.17+ builds from the same layer attributes, as it does there."""
    if not getattr(scheme, "use_flashinfer_trtllm", False):
        return original(scheme, layer, dispatch_output, *args, **kwargs)
    from types import SimpleNamespace

    from .. import runner

    quant_info = SimpleNamespace(
        w13_weight=layer.w13_weight,
        w2_weight=layer.w2_weight,
        w13_weight_scale=layer.w13_weight_scale,
        w2_weight_scale=layer.w2_weight_scale,
        g1_scale_c=layer.g1_scale_c,
        g1_alphas=layer.g1_alphas,
        g2_alphas=layer.g2_alphas,
        w13_input_scale_quant=layer.w13_input_scale_quant[:1],
        global_num_experts=layer.num_experts,
        local_expert_offset=layer.moe_ep_rank * layer.num_local_experts,
        local_num_experts=layer.num_local_experts,
        intermediate_size_per_partition=layer.intermediate_size_per_partition,
        routing_method_type=layer.routing_method_type,
        use_per_token_activation=False,
    )
    return runner.run(CT_NVFP4, dispatch_output, quant_info, scheme.moe_runner_config)


#: the formats whose layers ModelOptNvFp4FusedMoEMethod's hooks take over (nvfp4_online's method subclasses it)
MODELOPT_FORMATS = (NVFP4.name, NVFP4_ONLINE.name, NVFP4_ONLINE_TENSOR.name)


@hookimpl
def register_sglang_hooks(register, release):
    register(
        HookTarget(
            f"{MODELOPT}.ModelOptNvFp4FusedMoEMethod.process_weights_after_loading",
            modelopt_process_weights_after_loading,
            "around",
            capability="nvfp4-prep",
            formats=MODELOPT_FORMATS,
            why="NVFP4 layers on flashinfer_trtllm are prepared in place by the plugin, per dirty expert",
        )
    )
    register(
        HookTarget(
            f"{MODELOPT}.ModelOptNvFp4FusedMoEMethod.create_moe_runner",
            modelopt_create_moe_runner,
            "after",
            releases=features.NVFP4_AUTO_RUNNER_MISMATCH.releases,
            capability="nvfp4-prep",
            formats=MODELOPT_FORMATS,
            why="on a global auto, SGLang runs NVFP4 on flashinfer_trtllm: the weights are laid out for it too",
        )
    )
    register(
        HookTarget(
            f"{CT_NVFP4_SCHEME}.create_weights",
            ct_create_weights,
            "after",
            capability="ct-nvfp4-prep",
            formats=(CT_NVFP4.name,),
            why="non-gated GEMM1 allocated at the kernel's [E, I, ...] (SGLang allocates 2I rows)",
        )
    )
    register(
        HookTarget(
            f"{CT_NVFP4_SCHEME}.process_weights_after_loading",
            ct_process_weights_after_loading,
            "around",
            capability="ct-nvfp4-prep",
            formats=(CT_NVFP4.name,),
            why="compressed-tensors NVFP4 layers on flashinfer_trtllm are prepared in place, per dirty expert",
        )
    )
    register(
        HookTarget(
            f"{CT_NVFP4_SCHEME}.apply_weights",
            ct_apply_weights,
            "around",
            releases=features.CT_NVFP4_APPLY_CALLS_FLASHINFER.releases,
            capability="ct-nvfp4-prep",
            formats=(CT_NVFP4.name,),
            why=features.CT_NVFP4_APPLY_CALLS_FLASHINFER.why,
        )
    )
