"""NVFP4 layers on flashinfer_trtllm, prepared in place by the plugin: ModelOpt and compressed-tensors (W4A4).

SGLang's own prep allocates new tensors per expert (and compressed-tensors renames the parameters), so every later
weight update either writes into kernel-layout storage or re-shuffles experts that were not reloaded; the plugin's
prep is in place, per dirty expert (formats/nvfp4.py, formats/ct_nvfp4.py).
"""

from __future__ import annotations

from .. import hookimpl
from ..compat import features
from ..formats import CT_NVFP4, NVFP4
from ..targets import HookTarget
from ._prepare import kw, take_over

MODELOPT = "sglang.srt.layers.quantization.modelopt_quant"
CT_NVFP4_SCHEME = ("sglang.srt.layers.quantization.compressed_tensors.schemes.compressed_tensors_w4a4_nvfp4_moe."
                   "CompressedTensorsW4A4Nvfp4MoE")


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
        return original(method, layer, *args, **kwargs)
    if not take_over(NVFP4, method, layer, _modelopt_side_attrs):
        return original(method, layer, *args, **kwargs)


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
        new = torch.nn.Parameter(torch.empty((old.shape[0], rows, *old.shape[2:]), dtype=old.dtype,
                                             device=old.device), requires_grad=False)
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
        return original(scheme, layer, *args, **kwargs)
    if not take_over(CT_NVFP4, scheme, layer, _ct_side_attrs):
        return original(scheme, layer, *args, **kwargs)


def ct_apply_weights(original, scheme, layer, dispatch_output, *args, **kwargs):
    """features.CT_NVFP4_APPLY_CALLS_FLASHINFER: every trtllm layer runs on the plugin runner with the QuantInfo
    0.5.17+ builds from the same layer attributes, as it does there."""
    if not getattr(scheme, "use_flashinfer_trtllm", False):
        return original(scheme, layer, dispatch_output, *args, **kwargs)
    from types import SimpleNamespace

    from .. import runner

    quant_info = SimpleNamespace(
        w13_weight=layer.w13_weight, w2_weight=layer.w2_weight,
        w13_weight_scale=layer.w13_weight_scale, w2_weight_scale=layer.w2_weight_scale,
        g1_scale_c=layer.g1_scale_c, g1_alphas=layer.g1_alphas, g2_alphas=layer.g2_alphas,
        w13_input_scale_quant=layer.w13_input_scale_quant[:1],
        global_num_experts=layer.num_experts,
        local_expert_offset=layer.moe_ep_rank * layer.num_local_experts,
        local_num_experts=layer.num_local_experts,
        intermediate_size_per_partition=layer.intermediate_size_per_partition,
        routing_method_type=layer.routing_method_type,
        use_per_token_activation=False,
    )
    return runner.run(CT_NVFP4, dispatch_output, quant_info, scheme.moe_runner_config)


@hookimpl
def register_sglang_hooks(register, release):
    register(HookTarget(
        f"{MODELOPT}.ModelOptNvFp4FusedMoEMethod.process_weights_after_loading",
        modelopt_process_weights_after_loading, "around", releases=">=0.5.11", capability="nvfp4-prep",
        why="NVFP4 layers on flashinfer_trtllm are prepared in place by the plugin, per dirty expert",
    ))
    register(HookTarget(
        f"{CT_NVFP4_SCHEME}.create_weights", ct_create_weights, "after", releases=">=0.5.11",
        capability="ct-nvfp4-prep", why="non-gated GEMM1 allocated at the kernel's [E, I, ...] (SGLang allocates 2I rows)",
    ))
    register(HookTarget(
        f"{CT_NVFP4_SCHEME}.process_weights_after_loading", ct_process_weights_after_loading, "around",
        releases=">=0.5.11", capability="ct-nvfp4-prep",
        why="compressed-tensors NVFP4 layers on flashinfer_trtllm are prepared in place, per dirty expert",
    ))
    register(HookTarget(
        f"{CT_NVFP4_SCHEME}.apply_weights", ct_apply_weights, "around",
        releases=features.CT_NVFP4_APPLY_CALLS_FLASHINFER.releases, capability="ct-nvfp4-prep",
        why=features.CT_NVFP4_APPLY_CALLS_FLASHINFER.why,
    ))
