"""MX-format MoE layers on the TRT-LLM-Gen kernels, prepared in place by the plugin, per dirty expert.

* MXFP8 (`quant_method: mxfp8` -> Fp8MoEMethod.use_mxfp8) on flashinfer_trtllm / flashinfer_trtllm_routed
  (formats/mxfp8.py). SGLang's own prep is in place but re-shuffles every expert at every flush, so after a
  one-expert RL update the experts that were not reloaded are shuffled twice.

Layers the plugin does not take stay SGLang's, with one log line per reason: online MXFP8 (`--quantization mxfp8`
on a BF16 checkpoint: SGLang quantizes at prep and rebinds the Parameters to fp8), non-gated MXFP8 before 0.5.19
(SGLang allocates 2I rows and slices them at prep). FP4 experts explicitly put on flashinfer_trtllm (SGLang has no
MXFP4 path there: plain Fp8MoEMethod fails at the first forward) are a TrtllmLayerError naming the fix.
"""

from __future__ import annotations

import logging

from .. import hookimpl, layer_state
from ..compat import features
from ..errors import TrtllmLayerError
from ..formats.mxfp8 import MXFP8
from ..targets import HookTarget
from ._prepare import prepare_layer

logger = logging.getLogger("sglang_trtllm_moe")

FP8_METHOD = "sglang.srt.layers.quantization.fp8.Fp8MoEMethod"

_LOGGED: set = set()


def hand_back(layer, what: str, why: str) -> None:
    """One log line per (format, reason) and process: the layer stays on SGLang's own path."""
    key = (what, why)
    if key not in _LOGGED:
        _LOGGED.add(key)
        logger.info("sglang-trtllm-moe: %s (first: %s) stays on SGLang's own preparation: %s", what,
                    layer_state.layer_name(layer), why)


def _on_trtllm() -> bool:
    from sglang.srt.layers.moe.utils import get_moe_runner_backend

    b = get_moe_runner_backend()
    return b.is_flashinfer_trtllm() or b.is_flashinfer_trtllm_routed()


def mxfp8_problem(method, layer) -> str | None:
    """None when the plugin prepares this MXFP8 layer; else why SGLang keeps it."""
    if not method.quant_config.is_checkpoint_fp8_serialized:
        return ("online MXFP8 (--quantization mxfp8 on a BF16 checkpoint): SGLang quantizes at prep and rebinds the "
                "Parameters to fp8, so RL updates must send BF16 weights through SGLang's own path")
    if not layer.moe_runner_config.is_gated and not features.MXFP8_NON_GATED_W13_ROWS.present():
        return ("non-gated MXFP8 before SGLang 0.5.19: w13 is allocated with 2 x intermediate rows and sliced "
                "(new storage) by SGLang's prep")
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
    if (features.MXFP8_ACTIVATION_PARAMS.present() and getattr(method, "_owns_moe_runner", True)
            and not hasattr(layer, "_flashinfer_trtllm_gemm1_alpha")):
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
        return original(method, layer, *args, **kwargs)
    problem = mxfp8_problem(method, layer)
    if problem:
        hand_back(layer, "MXFP8 layer", problem)
        return original(method, layer, *args, **kwargs)
    prepare_layer(MXFP8, method, layer, _mxfp8_side_attrs)


def is_mx_fp8_method(method) -> bool:
    return bool(getattr(method, "use_mxfp8", False) or getattr(method, "is_fp4_expert", False))


#: fp8_hooks.py holds the one AROUND hook on Fp8MoEMethod.process_weights_after_loading from 0.5.19 (FP8 prep) and
#: hands MXFP8 / FP4-expert layers here; before 0.5.19 this module registers it (two AROUND hooks on one target
#: would each have to trust the other to call through: SGLang warns about exactly that).
FP8_HOOK_RELEASES = "<0.5.19"


@hookimpl
def register_sglang_hooks(register, release):
    register(HookTarget(
        f"{FP8_METHOD}.process_weights_after_loading", fp8_method_process_weights_after_loading, "around",
        releases=">=0.5.11," + FP8_HOOK_RELEASES, capability="mxfp8-prep",
        why="MXFP8 layers on flashinfer_trtllm(_routed) are prepared in place, per dirty expert (SGLang re-shuffles "
            "every expert at every flush); FP4 experts on flashinfer_trtllm are a clear error",
    ))
