"""Run a MoE layer on the TRT-LLM-Gen kernel family of its format: flashinfer's kernels on SM100, or the emulator.

SGLang's flashinfer_trtllm(_routed) dispatchers call one leaf per QuantInfo type (FP4, FP8, BF16) and look it up
as a module global at call time, so an AROUND hook on each leaf (builtins/runner_hooks.py) reaches every layer.
A layer the plugin prepared runs here: its format builds the kernel arguments (formats/), the routing is the same
for every format, and the call goes to one of two backends with the same signatures — flashinfer on an SM 10.x GPU,
or the PyTorch emulator when SGLANG_TRTLLM_MOE_EMULATE=1 (any device). Anywhere else it stops with an error that
says what to do, instead of SGLang's CUDA assertion or a silent fallback. A layer SGLang prepared itself goes back
to SGLang's leaf unchanged — except under the emulator, which reads SGLang's bytes as the kernel would (same layout).
"""

from __future__ import annotations

import functools
from types import ModuleType
from typing import Any

import torch

from . import env, kernel_api, layer_state
from .compat import routed_experts
from .errors import KernelUnavailableError
from .formats import KernelCall, WeightFormat, sglang_prepared
from .formats.base import Layer

# SGLang objects (SGLang ships no type information): a TopK output, a token dispatcher's output, a leaf's QuantInfo,
# a MoeRunnerConfig, a StandardCombineInput
TopKOutput = Any
DispatchOutput = Any
QuantInfo = Any
RunnerConfig = Any
CombineInput = Any

ENV_EMULATE = env.ENV_EMULATE
emulating = env.emulating


def _kernel_backend(layer: Layer, device: torch.device) -> tuple[ModuleType, bool]:
    """(module with flashinfer's trtllm_* signatures, on_kernel)."""
    if emulating():
        from . import emulator

        return emulator, False
    if device.type == "cuda" and torch.cuda.get_device_capability(device)[0] == 10:
        import flashinfer.fused_moe as fi

        return fi, True
    where = "CPU" if device.type != "cuda" else "SM{}{}".format(*torch.cuda.get_device_capability(device))
    raise KernelUnavailableError(
        f"{layer_state.layer_name(layer)}: the flashinfer_trtllm MoE kernels need an SM100 (Blackwell, compute "
        f"capability 10.x) GPU and this layer runs on {where}. Set {ENV_EMULATE}=1 to run the sglang-trtllm-moe "
        "PyTorch emulator on the same prepared weights, or choose another --moe-runner-backend."
    )


def ensure_prepared(layer: Layer) -> None:
    """A layer with experts left in checkpoint layout (e.g. after update_weights_from_tensor) is flushed first."""
    st = layer_state.state_of(layer)
    if st is not None and not st.clean:
        layer_state.flush(layer)


def routing_declared(layer: Layer) -> bool:
    """Does the layer say how its router routes? A model class passes `routing_method_type` to FusedMoE (Qwen3-MoE:
    Renormalize, DeepSeek / Nemotron-H / GLM: DeepSeekV3), which keeps it on the layer and its runner config;
    Mixtral does not (compat.features.TRTLLM_ROUTING_GUESSED: SGLang then lets the kernel guess)."""
    from .kernel_api import RoutingMethodType

    for holder in (layer, getattr(layer, "moe_runner_config", None)):
        method = getattr(holder, "routing_method_type", None)
        if method is not None and int(method) != int(RoutingMethodType.Unspecified):
            return True
    return False


def declared_method(layer: Layer) -> int | None:
    """The routing method the layer declares (its own, else its runner config's), or None."""
    for holder in (layer, getattr(layer, "moe_runner_config", None)):
        method = getattr(holder, "routing_method_type", None)
        if method is not None:
            return int(method)
    return None


def needs_own_topk(layer: Layer, topk_output: TopKOutput, method: int | None = None) -> bool:
    """A TopK output that leaves routing to the kernel, for a layer whose top-k the kernel's routing `method`
    (default: the one the layer declares) does not compute (kernel_api.kernel_routing_problem: SGLang 0.5.23's own
    rule, applied on every release): such a layer gets SGLang's own top-k and the routed kernel."""
    from sglang.srt.layers.moe.topk import TopKOutputChecker

    if not TopKOutputChecker.format_is_bypassed(topk_output):
        return False
    if method is None:
        method = declared_method(layer)
    return kernel_api.kernel_routing_problem(method, topk_output.topk_config) is not None


def kernel_replays(method: int | None, on_kernel: bool) -> bool:
    """Does the kernel that runs here write the experts it routed (`routing_replay_out`) for routing `method`? The
    emulator does for every method; flashinfer's kernels from the version kernel_api.ROUTING_REPLAY_SINCE names."""
    if not on_kernel:
        return True
    return kernel_api.replays_routing(_kernel_flashinfer_version(), method)


@functools.cache
def _kernel_flashinfer_version() -> str | None:
    """The installed flashinfer's version, read once per process: the forward path asks for it on every call, and
    reading it is a look-up of package metadata on disk."""
    from .selection import flashinfer_version

    return flashinfer_version()


def replay_problem(layer: Layer) -> str | None:
    """Why a layer could not return the experts the kernel routed it to when SGLang captures routed experts
    (`--enable-return-routed-experts`) and it runs on the fused runner here, or None when it can (or nothing is
    captured). Asked once per layer at preparation, when an explicit flashinfer_trtllm must fail up front."""
    from .compat.platform import returns_routed_experts
    from .selection import flashinfer_version

    if emulating() or not returns_routed_experts():
        return None
    method = None
    for holder in (layer, getattr(layer, "moe_runner_config", None)):
        method = getattr(holder, "routing_method_type", None) if method is None else method
    method = None if method is None else int(method)
    version = flashinfer_version()
    if kernel_api.replays_routing(version, method):
        return None
    name = kernel_api.RoutingMethodType(method).name if method is not None else "an undeclared method"
    need = kernel_api.ROUTING_REPLAY_SINCE.get(kernel_api.RoutingMethodType(method)) if method is not None else None
    return (
        f"--enable-return-routed-experts needs the experts the fused kernel routed, and flashinfer {version}'s "
        f"trtllm kernels do not write them (routing_replay_out) for routing {name}"
        + (f" (from flashinfer {need})" if need else "")
    )


def routing_kwargs(
    topk_output: TopKOutput,
    method: int | None,
    runner_config: RunnerConfig,
    routed: bool,
    hidden: torch.Tensor | None = None,
    layer: Layer | None = None,
    own_topk: bool | None = None,
) -> tuple[dict, bool]:
    """Kernel routing arguments: logits + method (bypassed TopK), or precomputed top-k (routed variant). With
    `own_topk` (default: `layer` given and declaring no routing method) the layer gets SGLang's own top-k
    (`select_experts`, the router its model asked for, which also captures routed experts) and the routed kernel,
    instead of an in-kernel method."""
    from sglang.srt.layers.moe.topk import TopKOutputChecker

    if own_topk is None:
        own_topk = layer is not None and needs_own_topk(layer, topk_output, method)
    if not routed and own_topk and layer is not None:
        topk_output = _select_experts(topk_output, hidden, layer)
        routed = True
    if routed or not TopKOutputChecker.format_is_bypassed(topk_output):
        if hasattr(topk_output, "packed_topk_ids"):
            ids = topk_output.packed_topk_ids
        else:
            ids = (
                topk_output.topk_ids.contiguous().to(torch.int32),
                topk_output.topk_weights.contiguous().to(torch.bfloat16),
            )
        top_k = (ids[0] if isinstance(ids, tuple) else ids).shape[1]
        return dict(
            topk_ids=ids,
            routing_bias=None,
            top_k=top_k,
            n_group=0,
            topk_group=0,
            routed_scaling_factor=None,
            routing_method_type=1,
        ), True
    cfg = topk_output.topk_config
    return dict(
        routing_logits=topk_output.router_logits,
        routing_bias=cfg.correction_bias,
        top_k=cfg.top_k,
        n_group=cfg.num_expert_group,
        topk_group=cfg.topk_group,
        routed_scaling_factor=runner_config.routed_scaling_factor,
        routing_method_type=int(method) if method is not None else 0,
    ), False


def run(
    fmt: WeightFormat,
    dispatch_output: DispatchOutput,
    quant_info: QuantInfo,
    runner_config: RunnerConfig,
    use_routed_topk: bool = False,
) -> CombineInput:
    """The layer through `fmt`'s kernel family; returns SGLang's combine input."""
    from sglang.srt.layers.moe.token_dispatcher.standard import StandardCombineInput

    layer = runner_config.layer
    ensure_prepared(layer)
    x = dispatch_output.hidden_states
    hidden_scale = getattr(dispatch_output, "hidden_states_scale", None)
    if hidden_scale is not None and not fmt.accepts_prequantized:
        raise NotImplementedError(
            f"{layer_state.layer_name(layer)}: pre-quantized (a2a) {fmt.title or fmt.name} dispatch is not supported "
            "by the plugin runner yet"
        )
    out_dtype = getattr(dispatch_output, "output_dtype", None) or (x.dtype if hidden_scale is None else torch.bfloat16)
    if x.shape[0] == 0:
        # SGLang runs 0-token forwards (idle DP-attention / EP ranks, a server's warm-up): nothing to compute, and
        # neither the activation quantizers nor the kernels take an empty batch
        width = x.shape[-1] if hidden_scale is None else int(getattr(layer, "hidden_size", x.shape[-1]))
        return StandardCombineInput(hidden_states=x.new_empty((0, width), dtype=out_dtype))
    backend, on_kernel = _kernel_backend(layer, x.device)
    call = KernelCall(layer, quant_info, runner_config, x, on_kernel, hidden_scale)
    topk_output = dispatch_output.topk_output
    method = fmt.routing_method(call)
    # routed experts (R3): SGLang captures them in its own top-k; for routing inside the kernel, the kernel reports
    # them (routing_replay_out) and they go to SGLang's capture site — or, where this kernel cannot report them for
    # the method, SGLang's own top-k routes (and captures) and the routed kernel computes
    replay_wanted = not use_routed_topk and _capture_wanted(topk_output)
    # the router logits as the kernel takes them (float32 or bfloat16 on every pinned flashinfer): as they are, an
    # exact widening, or — where no accepted dtype holds them — SGLang's own top-k and the routed kernel
    logits_dtype = _kernel_logits_dtype(fmt, call, topk_output, method) if not use_routed_topk else None
    own_topk = (
        (not fmt.routes_in_kernel(call) and needs_own_topk(layer, topk_output, method))
        or (replay_wanted and not kernel_replays(0 if method is None else method, on_kernel))
        or logits_dtype == ""
    )
    routing, routed = routing_kwargs(
        topk_output, method, runner_config, use_routed_topk, hidden=x, layer=layer, own_topk=own_topk
    )
    if not routed and logits_dtype:
        routing["routing_logits"] = routing["routing_logits"].to(getattr(torch, logits_dtype))
    entry = kernel_api.kernel_function(fmt.kernel, routed)
    # the routing arguments this entry point takes (trtllm_bf16_routed_moe has no routing_bias)
    routing = {k: v for k, v in routing.items() if k in kernel_api.SIGNATURES[entry].parameters}
    try:
        kwargs = fmt.kernel_args(call, routing, routed)
    except NotImplementedError as e:
        raise NotImplementedError(f"{layer_state.layer_name(layer)}: {e}") from e
    kwargs["do_finalize"] = True
    if "activation_type" in kernel_api.SIGNATURES[entry].parameters:  # the INT4 launcher fixes SwiGLU itself
        kwargs["activation_type"] = kernel_api.activation_type(runner_config.activation, runner_config.is_gated)
    replay = None
    if replay_wanted and not routed:
        # int16 [T, top_k], as the kernel writes it; allocated per call (CUDA graphs: from the graph's pool)
        replay = torch.empty((x.shape[0], int(kwargs["top_k"])), dtype=torch.int16, device=x.device)
        kwargs["routing_replay_out"] = replay
    out = getattr(backend, entry)(**kwargs)
    out = out[0] if isinstance(out, (list, tuple)) else out
    if replay is not None:
        routed_experts.capture(topk_output.topk_config, layer_id(layer), replay)
    return StandardCombineInput(hidden_states=out.to(out_dtype))


def _kernel_logits_dtype(
    fmt: WeightFormat, call: KernelCall, topk_output: TopKOutput, method: int | None
) -> str | None:
    """For routing left to the kernel (a bypassed TopK output): the dtype to hand it the router logits in — their
    own, or an exact widening (kernel_api.routing_logits_dtypes: what the installed flashinfer's launcher accepts;
    the emulator checks the same) — or "" when no dtype the kernel takes holds them exactly (route with SGLang's
    top-k instead: never a kernel error at the first forward, never a lossy cast). None: nothing to hand over."""
    from sglang.srt.layers.moe.topk import TopKOutputChecker

    if not TopKOutputChecker.format_is_bypassed(topk_output) or fmt.routes_in_kernel(call):
        return None  # precomputed top-k, or a format that casts for its own call (gpt-oss: bfloat16, as SGLang)
    logits = topk_output.router_logits
    version = _kernel_flashinfer_version() if call.on_kernel else None
    accepted = kernel_api.routing_logits_dtypes(version, fmt.kernel, method)
    return kernel_api.routing_logits_dtype(str(logits.dtype).replace("torch.", ""), accepted) or ""


def layer_id(layer: Layer) -> int:
    """The model layer index SGLang's capturer files a MoE layer's routed experts under (its TopK's layer_id)."""
    lid = getattr(layer, "layer_id", None)
    if lid is None:
        raise ValueError(f"{layer_state.layer_name(layer)}: a MoE layer without layer_id cannot report routed experts")
    return int(lid)


def _select_experts(topk_output: TopKOutput, hidden: torch.Tensor | None, layer: Layer) -> TopKOutput:
    """SGLang's own top-k for a bypassed TopK output, as its TopK would compute it for this layer (with the layer id,
    so SGLang's routed-experts capture files it under this layer, and the padding / expert-location facts)."""
    import dataclasses

    from sglang.srt.layers.moe.topk import select_experts

    if hidden is None:
        raise ValueError("routing_kwargs: SGLang's own top-k for a layer needs its input activations (hidden=)")
    # SGLang's own selection, on the path TopK itself takes on this device (its torch-native one off CUDA)
    cfg = dataclasses.replace(topk_output.topk_config, torch_native=hidden.device.type != "cuda")
    logits = getattr(topk_output, "raw_router_logits", None)
    if logits is None:
        logits = topk_output.router_logits
    return select_experts(
        hidden,
        logits,
        cfg,
        layer_id=getattr(layer, "layer_id", None),
        num_token_non_padded=topk_output.num_token_non_padded,
        expert_location_dispatch_info=topk_output.expert_location_dispatch_info,
    )


def _capture_wanted(topk_output: TopKOutput) -> bool:
    """Routing left to the kernel (a bypassed TopK output) while SGLang captures routed experts for this router."""
    from sglang.srt.layers.moe.topk import TopKOutputChecker

    return TopKOutputChecker.format_is_bypassed(topk_output) and routed_experts.wanted(topk_output.topk_config)


def _routes_here(layer: Layer, topk_output: TopKOutput) -> bool:
    """Must the plugin route a layer SGLang prepared (its leaf would guess an undeclared routing method, or would
    route in the kernel without reporting the routed experts SGLang captures)?"""
    return needs_own_topk(layer, topk_output) or _capture_wanted(topk_output)


def format_for(
    leaf: str, runner_config: RunnerConfig, dispatch_output: DispatchOutput | None = None
) -> WeightFormat | None:
    """The format to run a layer with on SGLang's `leaf` ("fp4" | "fp8" | "bf16"), or None for SGLang's own leaf:
    a layer the plugin prepared runs on its format; a layer SGLang prepared that the plugin watches (compat/defer.py)
    runs on its format under the emulator, where SGLang's leaf would guess an undeclared routing method, or where it
    would route in the kernel while SGLang captures routed experts (its leaf reports none: zeros); under the
    emulator, a layer SGLang prepared runs on the format whose layout its leaf holds (`formats.sglang_prepared`)."""
    layer = getattr(runner_config, "layer", None)
    st = layer_state.state_of(layer)
    if st is not None:
        return st.fmt
    observed = layer_state.observed(layer)
    if observed is not None and dispatch_output is not None and _routes_here(layer, dispatch_output.topk_output):
        return observed
    if not emulating():
        return None
    return observed or sglang_prepared(leaf)


__all__ = [
    "ENV_EMULATE",
    "KernelUnavailableError",
    "emulating",
    "ensure_prepared",
    "format_for",
    "declared_method",
    "kernel_replays",
    "layer_id",
    "needs_own_topk",
    "replay_problem",
    "routing_declared",
    "routing_kwargs",
    "run",
]
