"""Every format's real SGLang FusedMoE layer on the GPU, prepared by the plugin, its forward captured in a CUDA graph
(the plugin's runner and the emulator under `torch.cuda.graph`, as SGLang's decode graphs capture them): the replay
equals the eager forward; an RL update of two experts through SGLang's own weight_loader keeps every prepared
parameter's storage (`data_ptr()`), and the same graph, replayed, equals an eager forward on the updated weights —
without recapture. A 0-token forward returns an empty output.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from sglang_trtllm_moe import layer_state
from sglang_trtllm_moe.sandbox import layers as cpu_layers

from ..support import sglang_runtime

MAKERS = {
    "nvfp4": cpu_layers.random_nvfp4_checkpoint,
    "ct_nvfp4": cpu_layers.random_ct_nvfp4_checkpoint,
    "fp8_modelopt": cpu_layers.random_fp8_checkpoint,
    "fp8_tensor": cpu_layers.random_fp8_checkpoint,
    "fp8_block": cpu_layers.random_fp8_checkpoint,
    "bf16": cpu_layers.random_bf16_checkpoint,
}
SPEC = dict(num_experts=8, hidden=256, intermediate=256)
CASES = [pytest.param(cpu_layers.MoeSpec(**SPEC, fmt=f), id=f) for f in MAKERS] + [
    pytest.param(cpu_layers.MoeSpec(**SPEC, fmt="nvfp4", gated=False, activation="relu2"), id="nvfp4-relu2"),
    pytest.param(cpu_layers.MoeSpec(**SPEC, fmt="mxfp8"), id="mxfp8"),
]


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


@pytest.mark.parametrize("spec", CASES[:1] + CASES[-2:-1])
def test_a_forward_with_no_tokens_on_the_gpu(spec, monkeypatch):
    monkeypatch.setenv("SGLANG_TRTLLM_MOE_EMULATE", "1")
    layer = _layer(spec)
    x = torch.empty(0, spec.hidden, dtype=torch.bfloat16, device="cuda")
    out = layer(x, _topk(layer, spec, x, torch.empty(0, spec.num_experts, device="cuda")))
    assert out.shape == (0, spec.hidden)
