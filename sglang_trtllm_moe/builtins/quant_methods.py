"""Hooks that put the plugin in charge of weight preparation for layers on the flashinfer_trtllm path.

* `process_weights_after_loading` of each supported quant method: for layers SGLang set up for the TRT-LLM
  kernels, the plugin prepares in place (formats/ + layouts) instead of SGLang's allocate-and-rebind code;
  after the first time, it prepares only what changed (weights.flush).
* `FusedMoE._weight_loader_impl`: validates a shard before anything is written and returns a prepared expert to
  checkpoint layout before SGLang's loader writes into it.
"""

from __future__ import annotations

import logging

from .. import hookimpl, runner, weights
from ..formats.nvfp4 import NVFP4
from ..targets import HookTarget

logger = logging.getLogger("sglang_trtllm_moe")

MODELOPT = "sglang.srt.layers.quantization.modelopt_quant"
FUSED_MOE = "sglang.srt.layers.moe.fused_moe_triton.layer.FusedMoE"


class TrtllmLayerError(ValueError):
    """A layer explicitly put on flashinfer_trtllm that the kernels cannot serve."""


def _nvfp4_serves(method, layer) -> tuple[bool, str]:
    if not getattr(method, "enable_flashinfer_trtllm_moe", False):
        return False, "not on the flashinfer_trtllm backend"
    if not getattr(method, "use_flashinfer_trtllm_weight_layout", True):
        return False, "MegaMoE consumes the canonical layout"
    if getattr(layer, "inference_moe_w13_interleaved", False):
        return False, "w13 is stored interleaved by the checkpoint; SGLang de-interleaves it itself"
    return True, ""


def _sglang_side_attrs_nvfp4(method, layer) -> None:
    """Attributes SGLang's own trtllm path leaves on the layer, which its apply() and dispatcher read."""
    from torch.nn import Parameter

    for half in ("w13", "w2"):
        # 0.5.2x: create_weights leaves None and SGLang aliases it (the kernel never reads it). Older releases
        # register a Parameter placeholder: keep it, so every registered parameter stays the same object.
        if not isinstance(layer._parameters.get(f"{half}_blockscale_swizzled"), Parameter):
            setattr(layer, f"{half}_blockscale_swizzled", getattr(layer, f"{half}_weight_scale"))
    layer.trtllm_padded_hidden_size = None
    dispatcher = getattr(layer, "dispatcher", None)
    if dispatcher is not None and hasattr(dispatcher, "set_quant_config"):
        dispatcher.set_quant_config({"input_global_scale": None})


def prepare_layer(fmt, method, layer, side_attrs) -> None:
    st = weights.state_of(layer)
    if st is None:
        problem = fmt.check_layout(layer)
        if problem:
            raise TrtllmLayerError(
                f"{weights.layer_name(layer)}: --moe-runner-backend flashinfer_trtllm cannot serve this {fmt.name} layer: "
                f"{problem}. Fix: choose another --moe-runner-backend for this model (e.g. flashinfer_cutlass), "
                "or leave it on auto"
            )
        weights.attach(layer, fmt)
        n = weights.flush(layer)
        logger.info("sglang-trtllm-moe: %s: %s prepared in place for flashinfer_trtllm (%d expert groups)",
                    weights.layer_name(layer), fmt.name, n)
    else:
        weights.flush(layer)
    side_attrs(method, layer)


def nvfp4_process_weights_after_loading(original, method, layer, *args, **kwargs):
    ok, why = _nvfp4_serves(method, layer)
    if not ok:
        return original(method, layer, *args, **kwargs)
    prepare_layer(NVFP4, method, layer, _sglang_side_attrs_nvfp4)


def weight_loader_impl(original, layer, param, loaded_weight, weight_name, shard_id, expert_id, *args, **kwargs):
    st = weights.state_of(layer)
    if st is None:
        return original(layer, param, loaded_weight, weight_name, shard_id, expert_id, *args, **kwargs)
    name = weights.param_name(layer, param) or weight_name
    # One step under the layer's lock (SGLang's DeepSeek loader writes shards of one expert from a thread pool):
    # a concurrent writer of the same expert must neither see it half un-prepared nor have its rows overwritten
    # by this writer's in-place inverse.
    with st.lock:
        weights.validate_shard(layer, name, param, loaded_weight, shard_id, expert_id)
        weights.before_write(layer, name, None if expert_id is None else int(expert_id))
        return original(layer, param, loaded_weight, weight_name, shard_id, expert_id, *args, **kwargs)


def remember_prefix(result, layer, *args, **kwargs):
    """FusedMoE does not keep its checkpoint prefix; errors and reports name layers by it."""
    import inspect

    from sglang.srt.layers.moe.fused_moe_triton.layer import FusedMoE

    init = FusedMoE.__init__
    while hasattr(init, "__wrapped__"):
        init = init.__wrapped__
    try:
        prefix = inspect.signature(init).bind(layer, *args, **kwargs).arguments.get("prefix")
    except TypeError:
        prefix = kwargs.get("prefix")
    if prefix:
        object.__setattr__(layer, "_trtllm_moe_prefix", prefix)
    cfg = getattr(layer, "moe_runner_config", None)
    if cfg is not None and getattr(cfg, "layer", None) is None:
        cfg.layer = layer  # < 0.5.16: MoeRunnerConfig has no `layer` field; the plugin runner finds the layer by it


def weight_loader(original, layer, param, loaded_weight, weight_name, shard_id, expert_id=None, *args, **kwargs):
    """SGLang silently drops a shard whose global expert id maps to no local expert (right for EP ranks that do
    not own it); an id no rank owns is a caller bug that would leave the old weights in place unnoticed."""
    if weights.state_of(layer) is not None and expert_id is not None:
        total = int(getattr(layer, "num_experts", 0)) + int(getattr(layer, "num_fused_shared_experts", 0) or 0)
        if total and not 0 <= int(expert_id) < total:
            raise ValueError(
                f"{weights.layer_name(layer)}: refused weight update of {weight_name}: expert id {expert_id} is not "
                f"an expert of this model (0..{total - 1}); nothing was written"
            )
    return original(layer, param, loaded_weight, weight_name, shard_id, expert_id, *args, **kwargs)


# ---- BF16 (UnquantizedFusedMoEMethod) and compressed-tensors NVFP4 ----------------------------------------------

UNQUANT = "sglang.srt.layers.quantization.unquant.UnquantizedFusedMoEMethod"
CT_NVFP4_SCHEME = ("sglang.srt.layers.quantization.compressed_tensors.schemes.compressed_tensors_w4a4_nvfp4_moe."
                   "CompressedTensorsW4A4Nvfp4MoE")
CT_MOE = "sglang.srt.layers.quantization.compressed_tensors.compressed_tensors.CompressedTensorsFusedMoEMethod"


def _kw(args, kwargs, i, name):
    return kwargs[name] if name in kwargs else args[i]


def _sglang_side_attrs_bf16(method, layer) -> None:
    """SGLang's BF16 trtllm apply reads only w13_weight / w2_weight (kept [E, M, K]; the runner views them 4-D).
    Of the rest of SGLang's BF16 post-load steps only MORI's dispatcher dtype can apply to a trtllm layer."""
    method.w13_swiglu_interleaved = False
    try:
        from sglang.srt.layers.moe.utils import get_moe_a2a_backend

        if get_moe_a2a_backend().is_mori() and hasattr(layer, "dispatcher"):
            layer.dispatcher.set_quant_config({"weight_dtype": layer.w13_weight.dtype})
    except (ImportError, AttributeError):
        pass


def bf16_process_weights_after_loading(original, method, layer, *args, **kwargs):
    """SGLang's own version re-lays every expert and reshapes the Parameters to 4-D (and on CPU would AMX-pack
    them): for a layer on flashinfer_trtllm the plugin prepares in place, per dirty expert, shape kept."""
    if not getattr(method, "use_flashinfer_trtllm_moe", False):
        return original(method, layer, *args, **kwargs)
    from ..formats.bf16 import BF16

    prepare_layer(BF16, method, layer, _sglang_side_attrs_bf16)


def bf16_apply(original, method, *args, **kwargs):
    """A managed layer holds kernel-layout bytes, so it must take SGLang's flashinfer_trtllm branch (forward_cuda)
    on every device: SGLang's CPU dispatch (forward_cpu / moe_forward_native, also its bs=1 torch.compile path)
    would read those bytes as plain [E, M, K] weights. Off SM100 the runner then emulates or says what to do."""
    layer = _kw(args, kwargs, 0, "layer")
    if weights.state_of(layer) is None or not getattr(method, "use_flashinfer_trtllm_moe", False):
        return original(method, *args, **kwargs)
    return method.forward_cuda(layer, _kw(args, kwargs, 1, "dispatch_output"))


def bf16_restore_shape_for_load(original, method, *args, **kwargs):
    """SGLang un-blocks the whole 4-D layer before each load (sglang#33743). Managed layers never change shape and
    weight_loader_impl returns just the expert being written to checkpoint layout, so there is nothing to undo."""
    if weights.state_of(_kw(args, kwargs, 0, "layer")) is not None:
        return None
    return original(method, *args, **kwargs)


def unprepare_before_loading(original, method, layer, *args, **kwargs):
    """SGLang's `restore_weights_before_loading` (0.5.21+) runs before every disk update and at
    `begin_weight_update`. Managed layers need none of it: a loader write returns just the written expert to
    checkpoint layout (weight_loader_impl), and `begin_weight_update` — where loader-free refits may write straight
    into the parameters — un-prepares every managed layer of every format (builtins/weight_updates.py). So a
    one-expert disk update re-prepares one expert, not the layer."""
    if weights.state_of(layer) is not None:
        return None
    return original(method, layer, *args, **kwargs)


def ct_nvfp4_create_weights(result, scheme, *args, **kwargs):
    """AFTER create_weights: SGLang allocates GEMM1 with 2*I rows whatever the activation; a non-gated (relu2)
    layer on flashinfer_trtllm gets [E, I, ...] (the kernel's shape) before anything is loaded, same attributes."""
    import torch

    layer = _kw(args, kwargs, 0, "layer")
    if not getattr(scheme, "use_flashinfer_trtllm", False) or layer.moe_runner_config.is_gated:
        return result
    rows = _kw(args, kwargs, 3, "intermediate_size_per_partition")
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


def _sglang_side_attrs_ct_nvfp4(scheme, layer) -> None:
    """SGLang's apply reads w13_weight / w2_weight; they alias the loaded *_packed Parameters (same object)."""
    from ..formats.nvfp4 import CT_NVFP4

    for alias, name in CT_NVFP4.aliases.items():
        if getattr(layer, alias, None) is not getattr(layer, name):
            layer.register_parameter(alias, getattr(layer, name))


def ct_nvfp4_process_weights_after_loading(original, scheme, layer, *args, **kwargs):
    if not getattr(scheme, "use_flashinfer_trtllm", False):
        return original(scheme, layer, *args, **kwargs)
    from ..formats.nvfp4 import CT_NVFP4

    prepare_layer(CT_NVFP4, scheme, layer, _sglang_side_attrs_ct_nvfp4)


def ct_nvfp4_apply_weights(original, scheme, layer, dispatch_output, *args, **kwargs):
    """Before 0.5.17 the compressed-tensors NVFP4 scheme calls flashinfer itself in apply_weights (no MoeRunner),
    reading TopKOutput.topk_config (only the bypassed output has it: CPU TopK and the routed path give a
    StandardTopKOutput) and ignoring the separate up-half scale the plugin keeps. Every trtllm layer runs on the
    plugin runner with the QuantInfo 0.5.17+ builds from the same layer attributes, as it does there (the FP4 leaf
    is replaced for all layers, prepared by the plugin or by SGLang)."""
    if not getattr(scheme, "use_flashinfer_trtllm", False):
        return original(scheme, layer, dispatch_output, *args, **kwargs)
    from types import SimpleNamespace

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
    return runner.fused_experts_fp4(dispatch_output, quant_info, scheme.moe_runner_config)


# ---- FP8 per-tensor (ModelOpt FP8, Fp8MoEMethod static) and FP8 128x128 block (Fp8MoEMethod DeepSeek) ---------

FP8_METHOD = "sglang.srt.layers.quantization.fp8.Fp8MoEMethod"


def _fp8_method_format(method):
    """(format, None) for an Fp8MoEMethod layer the plugin prepares; (None, why) to leave it to SGLang."""
    from ..formats.fp8_block import FP8_BLOCK
    from ..formats.fp8_tensor import FP8_TENSOR

    from sglang.srt.layers.moe.utils import get_moe_runner_backend

    backend = get_moe_runner_backend()
    if not (backend.is_flashinfer_trtllm() or backend.is_flashinfer_trtllm_routed()):
        return None, "not on the flashinfer_trtllm backend"
    qc = method.quant_config
    if getattr(method, "use_mxfp8", False) or getattr(method, "is_fp4_expert", False):
        return None, "MXFP8 / FP4-expert checkpoints keep SGLang's own preparation"
    if not qc.is_checkpoint_fp8_serialized:
        return None, "the checkpoint is not FP8 (SGLang quantizes it at load time)"
    if method.block_quant:
        if list(qc.weight_block_size or ()) != [128, 128]:
            return None, f"weight_block_size {qc.weight_block_size} is not the DeepSeek 128x128 recipe"
        return FP8_BLOCK, None
    return FP8_TENSOR, None


def _sglang_side_attrs_fp8(method, layer) -> None:
    """What SGLang's Fp8MoEMethod post-load leaves for its apply(): the optional SwiGLU tensors it reads as
    layer._flashinfer_trtllm_gemm1_*, and the dispatcher's wire format."""
    if getattr(method, "_owns_moe_runner", False):
        method._prepare_flashinfer_trtllm_activation_params(layer)
    if hasattr(layer, "dispatcher"):
        layer.dispatcher.set_quant_config({"weight_dtype": layer.w13_weight.dtype, "use_mxfp8": False})


def fp8_process_weights_after_loading(original, method, layer, *args, **kwargs):
    fmt, why = _fp8_method_format(method)
    if fmt is None:
        return original(method, layer, *args, **kwargs)
    if not method.block_quant and method.quant_config.activation_scheme != "static":
        raise TrtllmLayerError(
            f"{weights.layer_name(layer)}: --moe-runner-backend flashinfer_trtllm cannot serve this FP8 per-tensor "
            "layer: its activation scales are dynamic and the TRT-LLM per-tensor kernel takes one static input scale. "
            "Fix: use a checkpoint with static input scales, or choose another --moe-runner-backend"
        )
    prepare_layer(fmt, method, layer, _sglang_side_attrs_fp8)


def _sglang_side_attrs_modelopt_fp8(method, layer) -> None:
    """ModelOptFp8MoEMethod.apply reads output1_scales_scalar / output1_scales_gate_scalar / output2_scales_scalar
    (set as kernel scalars by the flush) and the weights; nothing else."""


def modelopt_fp8_process_weights_after_loading(original, method, layer, *args, **kwargs):
    backend = getattr(method, "_moe_runner_backend", None)
    if backend is None:  # < 0.5.23: the method has no per-instance backend and reads the global one
        from sglang.srt.layers.moe.utils import get_moe_runner_backend

        backend = get_moe_runner_backend()
    if not backend.is_flashinfer_trtllm() or not method.quant_config.is_checkpoint_fp8_serialized:
        return original(method, layer, *args, **kwargs)
    from ..formats.fp8_tensor import FP8_TENSOR_MODELOPT

    prepare_layer(FP8_TENSOR_MODELOPT, method, layer, _sglang_side_attrs_modelopt_fp8)


@hookimpl
def register_sglang_hooks(register, release):
    register(HookTarget(
        f"{FUSED_MOE}.weight_loader", weight_loader, "around", releases=">=0.5.11", capability="rl-update",
        why="refuse expert ids that no rank owns (SGLang drops them silently)",
    ))
    register(HookTarget(
        f"{FUSED_MOE}.__init__", remember_prefix, "after", releases=">=0.5.11", capability="core",
        why="remember each MoE layer's checkpoint prefix so errors and reports can name it",
    ))
    register(HookTarget(
        f"{MODELOPT}.ModelOptNvFp4FusedMoEMethod.process_weights_after_loading",
        nvfp4_process_weights_after_loading, "around", releases=">=0.5.11", capability="nvfp4-prep",
        why="NVFP4 layers on flashinfer_trtllm are prepared in place by the plugin, per dirty expert",
    ))
    register(HookTarget(
        f"{FUSED_MOE}._weight_loader_impl", weight_loader_impl, "around", releases=">=0.5.11",
        capability="rl-update", why="validate shards and un-prepare an expert before SGLang's loader writes into it",
    ))
    # BF16 (unquantized) and compressed-tensors NVFP4
    register(HookTarget(
        f"{UNQUANT}.process_weights_after_loading", bf16_process_weights_after_loading, "around",
        releases=">=0.5.11", capability="bf16-prep",
        why="BF16 layers on flashinfer_trtllm are prepared in place (shape [E, M, K] kept), per dirty expert",
    ))
    register(HookTarget(
        f"{UNQUANT}.apply", bf16_apply, "around", releases=">=0.5.11", capability="bf16-prep",
        why="a prepared BF16 layer always takes SGLang's flashinfer_trtllm branch, never a path that reads it as plain weights",
    ))
    register(HookTarget(
        f"{UNQUANT}.maybe_restore_flashinfer_trtllm_bf16_weight_shape_for_load", bf16_restore_shape_for_load,
        "around", releases=">=0.5.23", capability="rl-update",
        why="SGLang's whole-layer un-block before each load is unnecessary for in-place [E, M, K] layers",
    ))
    for method in (UNQUANT, CT_MOE):
        register(HookTarget(
            f"{method}.restore_weights_before_loading", unprepare_before_loading, "around", releases=">=0.5.21",
            capability="rl-update", why="managed layers are un-prepared per written expert, not by SGLang's whole-layer restore",
        ))
    register(HookTarget(
        f"{CT_NVFP4_SCHEME}.create_weights", ct_nvfp4_create_weights, "after", releases=">=0.5.11",
        capability="ct-nvfp4-prep", why="non-gated GEMM1 allocated at the kernel's [E, I, ...] (SGLang allocates 2I rows)",
    ))
    register(HookTarget(
        f"{CT_NVFP4_SCHEME}.process_weights_after_loading", ct_nvfp4_process_weights_after_loading, "around",
        releases=">=0.5.11", capability="ct-nvfp4-prep",
        why="compressed-tensors NVFP4 layers on flashinfer_trtllm are prepared in place, per dirty expert",
    ))
    register(HookTarget(
        f"{CT_NVFP4_SCHEME}.apply_weights", ct_nvfp4_apply_weights, "around", releases=">=0.5.11,<0.5.17",
        capability="ct-nvfp4-prep",
        why="before 0.5.17 the scheme calls flashinfer itself (reads topk_config; drops the up-half scale): "
            "trtllm layers run on the plugin runner as they do from 0.5.17",
    ))
    # FP8 per-tensor and FP8 128x128 block
    register(HookTarget(
        f"{MODELOPT}.ModelOptFp8MoEMethod.process_weights_after_loading", modelopt_fp8_process_weights_after_loading,
        "around", releases=">=0.5.19", capability="fp8-prep",
        why="ModelOpt FP8 layers on flashinfer_trtllm are prepared in place, w1/w3 scales kept separate (no requant)",
    ))
    register(HookTarget(
        f"{FP8_METHOD}.process_weights_after_loading", fp8_process_weights_after_loading, "around",
        releases=">=0.5.19", capability="fp8-prep",
        why="FP8 per-tensor / DeepSeek block layers on flashinfer_trtllm are prepared in place, per dirty expert",
    ))
