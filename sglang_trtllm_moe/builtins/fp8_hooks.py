"""FP8 layers on flashinfer_trtllm, prepared in place: per-tensor (ModelOpt FP8, `fp8` with static activation
scales) and DeepSeek 128x128 block.

SGLang's own per-tensor prep dequantizes w1/w3 and re-quantizes them to one scale (lossy) and replaces the
Parameters (the next RL update then has no weight_loader); the plugin keeps the bytes as loaded and passes separate
gate and up scalars to the kernel (formats/fp8_tensor.py). MXFP8 and FP4-expert layers: builtins/mx_hooks.py.
"""

from __future__ import annotations

from .. import hookimpl
from ..compat import features
from ..formats import FP8_BLOCK, FP8_TENSOR, FP8_TENSOR_MODELOPT, MXFP8
from ..targets import HookTarget
from ._prepare import kw, sglang_prepares, take_over

MODELOPT = "sglang.srt.layers.quantization.modelopt_quant"
FP8_METHOD = "sglang.srt.layers.quantization.fp8.Fp8MoEMethod"


def _on_trtllm(backend) -> bool:
    return backend.is_flashinfer_trtllm() or backend.is_flashinfer_trtllm_routed()


def _fp8_method_format(method):
    """(format, None) for an Fp8MoEMethod layer the plugin prepares; (None, why) to leave it to SGLang."""
    from sglang.srt.layers.moe.utils import get_moe_runner_backend

    if not _on_trtllm(get_moe_runner_backend()):
        return None, "not on the flashinfer_trtllm backend"
    qc = method.quant_config
    if getattr(method, "use_mxfp8", False) or getattr(method, "is_fp4_expert", False):
        return None, "MXFP8 / FP4-expert layers are mx_hooks.py's"
    if not qc.is_checkpoint_fp8_serialized:
        return None, "the checkpoint is not FP8 (SGLang quantizes it at load time)"
    if method.block_quant:
        if list(qc.weight_block_size or ()) != [128, 128]:
            return None, f"weight_block_size {qc.weight_block_size} is not the DeepSeek 128x128 recipe"
        return FP8_BLOCK, None
    return FP8_TENSOR, None


def held_format(method, layer):
    """The format an FP8 layer of SGLang's holds on the plugin's backends, or None (aside.owners: one quant-method
    class, several formats)."""
    from . import mx_hooks

    if type(method).__name__ == "ModelOptFp8MoEMethod":
        return FP8_TENSOR_MODELOPT
    if mx_hooks.is_mx_fp8_method(method):
        return MXFP8 if getattr(method, "use_mxfp8", False) else None
    return _fp8_method_format(method)[0]


def _fp8_side_attrs(method, layer) -> None:
    """What SGLang's Fp8MoEMethod post-load leaves for its apply(): the optional SwiGLU tensors it reads as
    layer._flashinfer_trtllm_gemm1_*, and the dispatcher's wire format."""
    owns = method._owns_moe_runner if features.FP8_OWNS_MOE_RUNNER.present() else True
    if features.FP8_TRTLLM_ACTIVATION_PARAMS.present() and owns:
        method._prepare_flashinfer_trtllm_activation_params(layer)
    if hasattr(layer, "dispatcher"):
        layer.dispatcher.set_quant_config({"weight_dtype": layer.w13_weight.dtype, "use_mxfp8": False})


def fp8_create_weights(result, method, *args, **kwargs):
    """AFTER create_weights (features.FP8_W13_ALWAYS_TWO_HALVES): a non-gated per-tensor layer on flashinfer_trtllm
    gets w13 at the kernel's [E, I, H] before anything is loaded, with the attributes SGLang gave it (weight_loader,
    ...). w13_weight_scale stays [E, 2]: the loader broadcasts a non-gated layer's one scale into both columns."""
    import torch

    layer = kw(args, kwargs, 0, "layer")
    fmt, _ = _fp8_method_format(method)
    if fmt is not FP8_TENSOR or layer.moe_runner_config.is_gated:
        return result
    rows = kw(args, kwargs, 3, "intermediate_size_per_partition")
    old = layer.w13_weight
    if old.shape[1] != rows:
        new = torch.nn.Parameter(
            torch.empty((old.shape[0], rows, *old.shape[2:]), dtype=old.dtype, device=old.device), requires_grad=False
        )
        for k, v in vars(old).items():  # weight_loader, ... (set_weight_attrs)
            setattr(new, k, v)
        layer.register_parameter("w13_weight", new)
    return result


def fp8_process_weights_after_loading(original, method, layer, *args, **kwargs):
    from . import mx_hooks

    if mx_hooks.is_mx_fp8_method(method):  # one hook per target: MXFP8 / FP4-expert layers are mx_hooks.py's
        return mx_hooks.fp8_method_process_weights_after_loading(original, method, layer, *args, **kwargs)
    fmt, _ = _fp8_method_format(method)
    if fmt is None:
        return sglang_prepares(original, method, layer, *args, **kwargs)
    if not take_over(fmt, method, layer, _fp8_side_attrs):
        return sglang_prepares(original, method, layer, *args, **kwargs)


def modelopt_fp8_process_weights_after_loading(original, method, layer, *args, **kwargs):
    if features.MODELOPT_FP8_OWN_BACKEND.present():
        backend = method._moe_runner_backend
    else:
        from sglang.srt.layers.moe.utils import get_moe_runner_backend

        backend = get_moe_runner_backend()
    if not backend.is_flashinfer_trtllm() or not method.quant_config.is_checkpoint_fp8_serialized:
        return sglang_prepares(original, method, layer, *args, **kwargs)
    # ModelOptFp8MoEMethod.apply reads the weights and the kernel scalars the flush sets (output1_scales_scalar,
    # output1_scales_gate_scalar, output2_scales_scalar); nothing else of SGLang's post-load is needed
    if not take_over(FP8_TENSOR_MODELOPT, method, layer):
        return sglang_prepares(original, method, layer, *args, **kwargs)


@hookimpl
def register_sglang_hooks(register, release):
    register(
        HookTarget(
            f"{MODELOPT}.ModelOptFp8MoEMethod.process_weights_after_loading",
            modelopt_fp8_process_weights_after_loading,
            "around",
            capability="fp8-prep",
            formats=(FP8_TENSOR_MODELOPT.name,),
            why="ModelOpt FP8 layers on flashinfer_trtllm are prepared in place, w1/w3 scales kept separate "
            "(no requant)",
        )
    )
    register(
        HookTarget(
            f"{FP8_METHOD}.process_weights_after_loading",
            fp8_process_weights_after_loading,
            "around",
            capability="fp8-prep",
            formats=(FP8_TENSOR.name, FP8_BLOCK.name, MXFP8.name),
            why="FP8 per-tensor / DeepSeek block layers on flashinfer_trtllm are prepared in place, per dirty expert "
            "(MXFP8 / FP4-expert layers: handed to mx_hooks)",
        )
    )
    register(
        HookTarget(
            f"{FP8_METHOD}.create_weights",
            fp8_create_weights,
            "after",
            releases=features.FP8_W13_ALWAYS_TWO_HALVES.releases,
            capability="fp8-prep",
            formats=(FP8_TENSOR.name,),
            why="non-gated per-tensor w13 allocated at the kernel's [E, I, H] (SGLang allocates 2*I rows before "
            "0.5.19)",
        )
    )
