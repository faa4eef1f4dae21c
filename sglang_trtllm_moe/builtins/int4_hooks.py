"""INT4 W4A16 experts (compressed-tensors, group 32: Kimi-K2) on flashinfer_trtllm, prepared in place by the plugin.

SGLang's `CompressedTensorsMxInt4MoE` builds the kernel's layout in new tensors expert by expert and
`replace_parameter`s all four (formats/ct_int4.py says what breaks then); its `apply_weights` calls
`trtllm_mxint4_block_scale_moe` itself, so a layer the plugin prepared runs through the plugin runner from an AROUND
hook there (flashinfer's kernel on SM100, the emulator elsewhere), with the arguments SGLang's apply builds.
"""

from __future__ import annotations

from .. import hookimpl, layer_state
from ..formats.ct_int4 import CT_INT4
from ..targets import HookTarget
from ._prepare import take_over

SCHEME = (
    "sglang.srt.layers.quantization.compressed_tensors.schemes.compressed_tensors_w4a4_mxint4_moe."
    "CompressedTensorsMxInt4MoE"
)


def process_weights_after_loading(original, scheme, layer, *args, **kwargs):
    if not take_over(CT_INT4, scheme, layer):
        return original(scheme, layer, *args, **kwargs)


def apply_weights(original, scheme, layer, dispatch_output, *args, **kwargs):
    """A managed layer runs on the plugin runner with what SGLang's apply passes the kernel: the global and local
    expert counts, this rank's expert offset and the layer's routing method."""
    from types import SimpleNamespace

    from .. import runner

    if layer_state.state_of(layer) is None:
        return original(scheme, layer, dispatch_output, *args, **kwargs)
    cfg = scheme.moe_runner_config
    qi = SimpleNamespace(
        global_num_experts=cfg.num_experts,
        local_num_experts=cfg.num_local_experts,
        local_expert_offset=layer.moe_ep_rank * cfg.num_local_experts,
        routing_method_type=layer.routing_method_type,
    )
    return runner.run(CT_INT4, dispatch_output, qi, cfg)


@hookimpl
def register_sglang_hooks(register, release):
    register(
        HookTarget(
            f"{SCHEME}.process_weights_after_loading",
            process_weights_after_loading,
            "around",
            capability="ct-int4-prep",
            formats=(CT_INT4.name,),
            why="INT4 W4A16 (compressed-tensors, group 32) layers on flashinfer_trtllm are prepared in place, per "
            "dirty expert (SGLang replaces all four Parameters: its next RL update writes checkpoint words into them)",
        )
    )
    register(
        HookTarget(
            f"{SCHEME}.apply_weights",
            apply_weights,
            "around",
            capability="ct-int4-prep",
            formats=(CT_INT4.name,),
            why="managed INT4 layers run on the plugin runner (flashinfer's kernel, or the emulator): SGLang's apply "
            "calls the kernel itself",
        )
    )
