"""Every format's real SGLang FusedMoE layer on the GPU, prepared by the plugin, its forward captured in a CUDA graph
(the plugin's runner and the emulator under `torch.cuda.graph`, as SGLang's decode graphs capture them): the replay
equals the eager forward; an RL update of two experts through SGLang's own weight_loader keeps every prepared
parameter's storage (`data_ptr()`), and the same graph, replayed, equals an eager forward on the updated weights —
without recapture. A 0-token forward returns an empty output.

nvfp4_online (BF16 checkpoint, experts quantized to NVFP4 by SGLang's online loader as they load, activations
quantized per token in the forward): SGLang's loader calls flashinfer's `nvfp4_quantize(..., backend="cute-dsl")`,
which needs the CuTe DSL and SM100+. Where it does not run (`quantizer_problem()` asks once; the lent H200: SM90, and
no `cutlass` module) the loader gets the plugin's pure-torch quantizer on the CUDA tensors instead
(`cuda_nvfp4_quantize`, test-side only, like sandbox/layers.py `online_quantizer` on CPU). Its bytes against
flashinfer's: tests/gpu/test_nvfp4_quantizers.py, on SM100+ (flashinfer's FP4 kernels are compiled out below).
"""

from __future__ import annotations

import contextlib
import functools
import json
import os

import pytest
import torch

from sglang_trtllm_moe import layer_state, quant
from sglang_trtllm_moe.compat import features
from sglang_trtllm_moe.sandbox import layers as cpu_layers

from ..support import sglang_runtime

#: the harness kinds run here, each with its format's random checkpoint (sandbox LAYERS, from the format's example;
#: nvfp4_online's is a BF16 source its online loader quantizes)
MAKERS = {
    k: cpu_layers.LAYERS[k].checkpoint
    for k in ("nvfp4", "ct_nvfp4", "fp8_modelopt", "fp8_tensor", "fp8_block", "bf16", "nvfp4_online", "ct_int4")
}
SPEC = dict(num_experts=8, hidden=256, intermediate=256)
CASES = [pytest.param(cpu_layers.MoeSpec(**SPEC, fmt=f), id=f) for f in MAKERS] + [
    pytest.param(cpu_layers.MoeSpec(**SPEC, fmt="nvfp4", gated=False, activation="relu2"), id="nvfp4-relu2"),
    pytest.param(cpu_layers.MoeSpec(**SPEC, fmt="mxfp8"), id="mxfp8"),
    # per-token non-gated NVFP4 is served at hidden sizes that are multiples of 512 (formats/nvfp4_online.py)
    pytest.param(
        cpu_layers.MoeSpec(**{**SPEC, "hidden": 512}, fmt="nvfp4_online", gated=False, activation="relu2"),
        id="nvfp4_online-relu2",
        marks=pytest.mark.sglang(
            features.NVFP4_ONLINE_NON_GATED.releases,
            reason="SGLang's online loader never writes a non-gated layer before 0.5.18 (the plugin refuses it)",
        ),
    ),
]


ONLINE = next(c for c in CASES if c.id == "nvfp4_online")


@functools.lru_cache(maxsize=1)
def quantizer_problem() -> str | None:
    """Why flashinfer's NVFP4 quantizer, called as SGLang's online loader calls it (linear scales, cute-dsl), does
    not run on this GPU; None where it does. Written to $SGLANG_TRTLLM_MOE_GPU_OUT/gpu-nvfp4-online-quantizer.json."""
    problem = None
    cap = torch.cuda.get_device_capability()
    if cap < (10, 0):  # quantization.cuh: the FP4 kernels' bodies are under __CUDA_ARCH__ >= 1000
        problem = f"SM{cap[0]}{cap[1]}: flashinfer's NVFP4 quantization kernels are SM100+"
    try:
        from flashinfer import SfLayout, nvfp4_quantize

        w = torch.randn(128, 256, device="cuda").to(torch.bfloat16)
        gs = (448.0 * 6.0) / w.float().abs().amax()
        q, sf = nvfp4_quantize(w, gs, sfLayout=SfLayout.layout_linear, backend="cute-dsl")
        torch.cuda.synchronize()
        if q.numel() != 128 * 128:
            problem = f"unexpected output shape {tuple(q.shape)}"
    except Exception as e:  # noqa: BLE001 - any failure means the stand-in serves
        problem = "; ".join(filter(None, [problem, f"cute-dsl: {type(e).__name__}: {str(e)[:400]}"]))
    out = os.environ.get("SGLANG_TRTLLM_MOE_GPU_OUT")
    if out:
        with open(os.path.join(out, "gpu-nvfp4-online-quantizer.json"), "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "capability": list(cap), "problem": problem}, f)
    return problem


def cuda_nvfp4_quantize(a, a_global_sf, sfLayout=None, do_shuffle=False, sf_vec_size=16, **kwargs):
    """flashinfer.nvfp4_quantize for what SGLang's online loader asks of it (linear scales, no shuffle, 16-element
    blocks, the plain recipe) on CUDA tensors, by the plugin's pure-torch quantizer (quant.nvfp4_quantize), where
    flashinfer's does not run (quantizer_problem). Anything else raises NotImplementedError."""
    from flashinfer import SfLayout

    kwargs.pop("backend", None)
    kwargs.pop("enable_pdl", None)
    extra = {k: v for k, v in kwargs.items() if v is not None and v is not False}
    if not a.is_cuda or extra or do_shuffle or sf_vec_size != 16 or sfLayout != SfLayout.layout_linear:
        raise NotImplementedError(f"the CUDA nvfp4_quantize stand-in: {sfLayout}, shuffle {do_shuffle}, {extra}")
    if os.environ.get("FLASHINFER_NVFP4_4OVER6") == "1":
        raise NotImplementedError("the CUDA nvfp4_quantize stand-in serves the plain recipe only")
    q, sf = quant.nvfp4_quantize(a, a_global_sf)
    return q, sf.view(torch.uint8)


@contextlib.contextmanager
def gpu_online_quantizer():
    """What SGLang's online loader quantizes with in these tests: flashinfer's own where it runs, else the stand-in."""
    if quantizer_problem() is None:
        yield
        return
    import flashinfer

    real = flashinfer.nvfp4_quantize
    flashinfer.nvfp4_quantize = cuda_nvfp4_quantize
    try:
        yield
    finally:
        flashinfer.nvfp4_quantize = real


@pytest.fixture(autouse=True)
def _online_quantizer_on_cuda(monkeypatch):
    # sandbox/layers.py load_checkpoint wraps nvfp4_online loads in its CPU stand-in (refuses CUDA tensors)
    monkeypatch.setattr(cpu_layers, "online_quantizer", gpu_online_quantizer)


@contextlib.contextmanager
def on_cuda():
    before = torch.get_default_device()
    torch.set_default_device("cuda")
    try:
        yield
    finally:
        torch.set_default_device(before)


def _checkpoint(spec, seed: int, experts=None) -> dict:
    """A random checkpoint of the spec's format (the registry's builder for formats without their own maker)."""
    make = MAKERS.get(spec.fmt, cpu_layers.random_checkpoint)
    return make(spec, seed=seed, experts=experts)


def _layer(spec, seed=0):
    from sglang.srt.layers.moe.utils import RoutingMethodType

    sglang_runtime.ensure("flashinfer_trtllm")
    with on_cuda():
        layer = cpu_layers.build_layer(spec, routing_method_type=RoutingMethodType.Renormalize)
    cpu_layers.load_checkpoint(layer, _checkpoint(spec, seed=seed), spec.num_experts)
    layer.quant_method.process_weights_after_loading(layer)
    return layer


def _topk(layer, spec, x, logits):
    from sglang.srt.layers.moe.topk import TopK

    topk = TopK(top_k=spec.top_k, renormalize=True, layer_id=0)
    if hasattr(topk, "bind_runner_backend"):
        topk.bind_runner_backend(layer.runner_backend, routing_method_type=layer.routing_method_type)
    out = topk.forward_cuda(x, logits)
    assert type(out).__name__ == "BypassedTopKOutput", type(out).__name__
    return out


@pytest.mark.parametrize("spec", CASES)
def test_forward_in_a_cuda_graph_and_an_update_landing_in_it(spec, monkeypatch):
    monkeypatch.setenv("SGLANG_TRTLLM_MOE_EMULATE", "1")
    layer = _layer(spec)
    assert layer_state.state_of(layer) is not None or layer_state.observed(layer) is not None
    g = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(4, spec.hidden, generator=g, device="cuda").to(torch.bfloat16)
    logits = torch.randn(4, spec.num_experts, generator=g, device="cuda")
    topk = _topk(layer, spec, x, logits)
    eager = layer(x, topk).clone()
    ptrs = {n: p.data_ptr() for n, p in layer.named_parameters()}

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up on a side stream, as torch.cuda.graphs asks
        layer(x, topk)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = layer(x, topk)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(static_out, eager), "the captured forward differs from the eager one"

    # new inputs through the same graph
    x.copy_(torch.randn(4, spec.hidden, generator=g, device="cuda").to(torch.bfloat16))
    logits.copy_(torch.randn(4, spec.num_experts, generator=g, device="cuda"))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(static_out, layer(x, topk)), "a replay on new inputs differs from the eager forward"

    # an RL update of experts 2 and 5 through SGLang's own weight_loader; the plugin lays them out in place
    new = _checkpoint(spec, seed=7, experts=[2, 5])
    before = static_out.clone()
    cpu_layers.load_checkpoint(layer, new, spec.num_experts)
    layer_state.flush(layer)
    assert {n: p.data_ptr() for n, p in layer.named_parameters()} == ptrs, "an update moved prepared storage"
    graph.replay()
    torch.cuda.synchronize()
    updated = layer(x, topk)
    assert torch.equal(static_out, updated), "the captured graph does not see the update"
    assert not torch.equal(static_out, before), "the update changed nothing (the check could not fail)"


@pytest.mark.parametrize("spec", [c for c in CASES if c.id in ("nvfp4", "nvfp4-relu2", "nvfp4_online")])
def test_a_forward_with_no_tokens_on_the_gpu(spec, monkeypatch):
    monkeypatch.setenv("SGLANG_TRTLLM_MOE_EMULATE", "1")
    layer = _layer(spec)
    x = torch.empty(0, spec.hidden, dtype=torch.bfloat16, device="cuda")
    out = layer(x, _topk(layer, spec, x, torch.empty(0, spec.num_experts, device="cuda")))
    assert out.shape == (0, spec.hidden)
