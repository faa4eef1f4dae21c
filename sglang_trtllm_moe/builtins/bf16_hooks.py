"""BF16 (unquantized) layers on flashinfer_trtllm, prepared in place (formats/bf16.py), and SGLang's whole-layer
restore hooks made unnecessary for the layers the plugin manages.
"""

from __future__ import annotations

from .. import hookimpl, layer_state
from ..compat import features
from ..formats import BF16, CT_NVFP4
from ..targets import HookTarget
from ._prepare import kw, sglang_prepares, take_over

UNQUANT = "sglang.srt.layers.quantization.unquant.UnquantizedFusedMoEMethod"
CT_MOE = "sglang.srt.layers.quantization.compressed_tensors.compressed_tensors.CompressedTensorsFusedMoEMethod"


def _side_attrs(method, layer) -> None:
    """SGLang's BF16 trtllm apply reads only w13_weight / w2_weight (kept [E, M, K]; the runner views them 4-D).
    Of the rest of SGLang's BF16 post-load steps only MORI's dispatcher dtype can apply to a trtllm layer."""
    method.w13_swiglu_interleaved = False
    from sglang.srt.layers.moe.utils import get_moe_a2a_backend

    if get_moe_a2a_backend().is_mori() and hasattr(layer, "dispatcher"):
        layer.dispatcher.set_quant_config({"weight_dtype": layer.w13_weight.dtype})


def process_weights_after_loading(original, method, layer, *args, **kwargs):
    """SGLang's own version re-lays every expert and reshapes the Parameters to 4-D (and on CPU would AMX-pack
    them): for a layer on flashinfer_trtllm the plugin prepares in place, per dirty expert, shape kept."""
    if not getattr(method, "use_flashinfer_trtllm_moe", False):
        return sglang_prepares(original, method, layer, *args, **kwargs)
    if not take_over(BF16, method, layer, _side_attrs):
        return sglang_prepares(original, method, layer, *args, **kwargs)


def apply(original, method, *args, **kwargs):
    """A prepared layer holds kernel-layout bytes, so it must take SGLang's flashinfer_trtllm branch (forward_cuda)
    on every device: SGLang's CPU dispatch (forward_cpu / moe_forward_native, also its bs=1 torch.compile path)
    would read those bytes as plain [E, M, K] weights. That holds for a layer SGLang prepared (and the plugin
    watches) when it runs on the emulator; off SM100 the runner then emulates or says what to do."""
    from ..runner import emulating

    layer = kw(args, kwargs, 0, "layer")
    kernel_layout = layer_state.state_of(layer) is not None or (emulating() and layer_state.observed(layer))
    if not kernel_layout or not getattr(method, "use_flashinfer_trtllm_moe", False):
        return original(method, *args, **kwargs)
    return method.forward_cuda(layer, kw(args, kwargs, 1, "dispatch_output"))


def restore_shape_for_load(original, method, *args, **kwargs):
    """SGLang un-blocks the whole 4-D layer before each load (sglang#33743). Managed layers never change shape and
    the loader hook returns just the expert being written to checkpoint layout, so there is nothing to undo."""
    if layer_state.state_of(kw(args, kwargs, 0, "layer")) is not None:
        return None
    return original(method, *args, **kwargs)


def restore_weights_before_loading(original, method, layer, *args, **kwargs):
    """SGLang's `restore_weights_before_loading` (0.5.21+) runs before every disk update and at
    `begin_weight_update`. Managed layers need none of it: a loader write returns just the written expert to
    checkpoint layout (loader_hooks), and `begin_weight_update` — where loader-free refits may write straight
    into the parameters — un-prepares every managed layer of every format (weight_updates.py). So a one-expert disk
    update re-prepares one expert, not the layer."""
    if layer_state.state_of(layer) is not None:
        return None
    return original(method, layer, *args, **kwargs)


@hookimpl
def register_sglang_hooks(register, release):
    register(
        HookTarget(
            f"{UNQUANT}.process_weights_after_loading",
            process_weights_after_loading,
            "around",
            capability="bf16-prep",
            formats=(BF16.name,),
            why="BF16 layers on flashinfer_trtllm are prepared in place (shape [E, M, K] kept), per dirty expert",
        )
    )
    register(
        HookTarget(
            f"{UNQUANT}.apply",
            apply,
            "around",
            capability="bf16-prep",
            formats=(BF16.name,),
            why="a prepared BF16 layer always takes SGLang's flashinfer_trtllm branch, never a path that reads it as "
            "plain weights",
        )
    )
    register(
        HookTarget(
            f"{UNQUANT}.maybe_restore_flashinfer_trtllm_bf16_weight_shape_for_load",
            restore_shape_for_load,
            "around",
            releases=features.BF16_LOAD_RESTORES_LAYOUT.releases,
            capability="rl-update",
            formats=(BF16.name,),
            why="SGLang's whole-layer un-block before each load is unnecessary for in-place [E, M, K] layers",
        )
    )
    for method, served in ((UNQUANT, BF16), (CT_MOE, CT_NVFP4)):
        register(
            HookTarget(
                f"{method}.restore_weights_before_loading",
                restore_weights_before_loading,
                "around",
                releases=features.UPDATE_SESSIONS.releases,
                capability="rl-update",
                formats=(served.name,),
                why="managed layers are un-prepared per written expert, not by SGLang's whole-layer restore",
            )
        )
