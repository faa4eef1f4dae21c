"""Rollout routing replay (R3, `--enable-return-routed-experts`) through the plugin's fused runner, layer by layer, on
every release.

SGLang captures the experts each token was routed to in its own `select_experts`; a layer on `flashinfer_trtllm`
routes inside the kernel, so SGLang alone returns zeros there. The plugin's runner passes the kernel (here its
emulator, which writes what it routed exactly as the kernel does) a `routing_replay_out` buffer and hands the ids to
SGLang's own capture site. The oracle is SGLang's own `select_experts` on the same router logits (its torch-native
path), compared as sets per token: SGLang's top-k and the kernel may list the k experts in another order. Random
fp32 logits: no ties.

SGLang's global capturer object is replaced by a recorder for these layer tests (a data sink with its `capture`
method; SGLang's capture site — its per-router opt-out, the call — stays SGLang's own): its real buffer needs a
model's layer count and the scheduler's batch sizes. The whole-model tests (tests/test_models.py
`test_routed_experts_...`) and the HTTP server (tests/test_http_server.py) run SGLang's real capturer.
"""

from __future__ import annotations

import importlib

import pytest
import torch

from sglang_trtllm_moe import TrtllmLayerError, kernel_api, layer_state, runner
from sglang_trtllm_moe.compat import routed_experts
from sglang_trtllm_moe.kernel_api import RoutingMethodType
from sglang_trtllm_moe.sandbox import layers as cpu_layers

from .support import r3, sglang_runtime

TRTLLM, MXFP4 = "flashinfer_trtllm", "flashinfer_mxfp4"


Recorder, recording, sglang_topk_ids, as_sets = r3.Recorder, r3.recording, r3.topk_ids, r3.as_sets


# ---- every format the fused runner serves ----------------------------------------------------------------------

MAKERS = {
    "nvfp4": cpu_layers.random_nvfp4_checkpoint,
    "ct_nvfp4": cpu_layers.random_ct_nvfp4_checkpoint,
    "fp8_modelopt": cpu_layers.random_fp8_checkpoint,
    "fp8_tensor": cpu_layers.random_fp8_checkpoint,
    "fp8_block": cpu_layers.random_fp8_checkpoint,
    "bf16": cpu_layers.random_bf16_checkpoint,
}
SPEC = dict(num_experts=8, hidden=128, intermediate=128)
FORMATS = [pytest.param(TRTLLM, cpu_layers.MoeSpec(**SPEC, fmt=f), id=f) for f in MAKERS] + [
    pytest.param(TRTLLM, cpu_layers.MoeSpec(**SPEC, fmt="nvfp4", gated=False, activation="relu2"), id="nvfp4-relu2"),
    pytest.param(
        TRTLLM, cpu_layers.MoeSpec(**SPEC, fmt="fp8_tensor", gated=False, activation="relu2"), id="fp8_tensor-relu2"
    ),
    pytest.param(TRTLLM, cpu_layers.MoeSpec(num_experts=8, intermediate=128, fmt="mxfp8"), id="mxfp8"),
    pytest.param(TRTLLM, cpu_layers.MoeSpec(num_experts=8, hidden=256, fmt="ct_int4"), id="ct_int4"),
    pytest.param(
        MXFP4, cpu_layers.MoeSpec(num_experts=8, hidden=256, intermediate=128, fmt="mxfp4_gptoss"), id="mxfp4_gptoss"
    ),
]


def _layer(backend, spec, method=RoutingMethodType.Renormalize, **build):
    """A prepared layer of `spec`, declaring routing `method` as a model class does (gpt-oss: none; it routes its
    bypassed logits with Renormalize whatever it declares)."""
    from sglang.srt.layers.moe.utils import RoutingMethodType as SGLangRouting

    sglang_runtime.ensure(backend)
    if spec.fmt != "mxfp4_gptoss":
        build.setdefault("routing_method_type", SGLangRouting(int(method)))
    layer = cpu_layers.build_layer(spec, **build)
    if spec.fmt == "mxfp4_gptoss":
        cpu_layers.load_fused(layer, cpu_layers.random_checkpoint(spec, 0))
    else:
        make = MAKERS.get(spec.fmt) or (lambda s, seed: cpu_layers.random_checkpoint(s, seed))
        cpu_layers.load_checkpoint(layer, make(spec, seed=0), spec.num_experts)
    layer.quant_method.process_weights_after_loading(layer)
    return layer


def _bypassed(layer, spec, x, logits, **topk_kwargs):
    """SGLang's TopK for this layer, producing the output its CUDA path hands the fused runner (routing left to
    the kernel), then the layer's forward; returns (output, topk output)."""
    from sglang.srt.layers.moe.topk import TopK, TopKOutputFormat

    kw = dict(top_k=spec.top_k, renormalize=True, layer_id=layer.layer_id)
    kw.update(topk_kwargs)
    if spec.fmt == "mxfp4_gptoss":
        kw["output_format"] = TopKOutputFormat.BYPASSED
    topk = TopK(**kw)
    if hasattr(topk, "bind_runner_backend") and spec.fmt != "mxfp4_gptoss":
        topk.bind_runner_backend(layer.runner_backend, routing_method_type=layer.routing_method_type)
    out = topk.forward_cuda(x, logits)
    assert type(out).__name__ == "BypassedTopKOutput", type(out).__name__
    return layer(x, out), out


def _inputs(spec, tokens=7, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(tokens, spec.hidden, generator=g).to(torch.bfloat16), torch.randn(
        tokens, spec.num_experts, generator=g
    )


@pytest.mark.parametrize("backend,spec", FORMATS)
def test_fused_runner_reports_the_experts_it_routed_for_every_format(backend, spec, monkeypatch):
    monkeypatch.setenv("SGLANG_TRTLLM_MOE_EMULATE", "1")
    layer = _layer(backend, spec, layer_id=3)
    assert layer_state.state_of(layer) is not None or layer_state.observed(layer) is not None
    x, logits = _inputs(spec)
    with recording() as rec:
        plain, _ = _bypassed(layer, spec, x, logits)
    with recording() as rec:
        out, topk = _bypassed(layer, spec, x, logits)
        assert len(rec.calls) == 1, [c[0] for c in rec.calls]
        layer_id, ids = rec.calls[0]
    assert layer_id == 3
    assert ids.shape == (x.shape[0], spec.top_k)
    assert as_sets(ids) == as_sets(sglang_topk_ids(x, logits, topk.topk_config))
    # reporting changes nothing about the output
    assert torch.equal(out, plain)


def test_without_the_capturer_nothing_is_reported_and_no_buffer_is_passed(monkeypatch):
    """R3 off (no capturer): the kernel gets no `routing_replay_out` (zero cost) and nothing is captured."""
    monkeypatch.setenv("SGLANG_TRTLLM_MOE_EMULATE", "1")
    spec = cpu_layers.MoeSpec(**SPEC, fmt="nvfp4")
    layer = _layer(TRTLLM, spec)
    seen = []
    from sglang_trtllm_moe import emulator

    real = emulator.trtllm_fp4_block_scale_moe
    monkeypatch.setattr(
        emulator, "trtllm_fp4_block_scale_moe", lambda **kw: seen.append(kw.get("routing_replay_out")) or real(**kw)
    )
    assert routed_experts.capturer() is None
    x, logits = _inputs(spec)
    _bypassed(layer, spec, x, logits)
    assert seen == [None]
    with recording():
        _bypassed(layer, spec, x, logits)
    assert seen[-1] is not None and seen[-1].dtype == torch.int16 and tuple(seen[-1].shape) == (7, 2)


# ---- every routing method the plugin serves --------------------------------------------------------------------


def _llama4_routing():
    from sglang.srt.models.llama4 import Llama4MoE

    return Llama4MoE.custom_routing_function


#: (layer's routing method, SGLang TopK arguments a model declaring it passes, experts, top_k)
METHODS = {
    "Renormalize": (RoutingMethodType.Renormalize, dict(renormalize=True), 8, 2),
    "RenormalizeNaive": (RoutingMethodType.RenormalizeNaive, dict(renormalize=True), 8, 2),
    "Default": (RoutingMethodType.Default, dict(renormalize=False), 8, 2),
    "DeepSeekV3": (
        RoutingMethodType.DeepSeekV3,
        dict(
            renormalize=True,
            use_grouped_topk=True,
            num_expert_group=4,
            topk_group=2,
            scoring_func="sigmoid",
            routed_scaling_factor=2.5,
        ),
        16,
        4,
    ),
    "Llama4": (RoutingMethodType.Llama4, dict(renormalize=False, custom_routing_function="llama4"), 8, 1),
}


@pytest.mark.parametrize("name", sorted(METHODS))
def test_every_routing_method_reports_what_sglangs_own_topk_picks(name, monkeypatch):
    monkeypatch.setenv("SGLANG_TRTLLM_MOE_EMULATE", "1")
    method, topk_kwargs, experts, top_k = METHODS[name]
    spec = cpu_layers.MoeSpec(num_experts=experts, hidden=128, intermediate=128, top_k=top_k, fmt="bf16")
    layer = _layer(TRTLLM, spec, method, layer_id=1)
    x, logits = _inputs(spec, tokens=9, seed=2)
    kw = dict(topk_kwargs)
    if kw.get("custom_routing_function") == "llama4":
        kw["custom_routing_function"] = _llama4_routing()
    if kw.get("use_grouped_topk"):
        kw["correction_bias"] = torch.randn(experts, generator=torch.Generator().manual_seed(3)) * 0.1
    with recording() as rec:
        _, topk = _bypassed(layer, spec, x, logits, **kw)
    assert [c[0] for c in rec.calls] == [1]
    ref = sglang_topk_ids(x, logits, topk.topk_config)
    assert as_sets(rec.calls[0][1]) == as_sets(ref), (name, rec.calls[0][1].tolist(), ref.tolist())


# ---- what SGLang's non-fused path does, the fused one does ----------------------------------------------------


@pytest.mark.sglang(">=0.5.15", reason="TopKConfig.allow_routed_experts_capture (the draft opt-out) arrives in 0.5.15")
def test_a_router_that_opts_out_of_capture_is_not_reported(monkeypatch):
    """Speculative-draft routers (MTP / NextN / EAGLE) opt out: they must never write the target's buffer."""
    monkeypatch.setenv("SGLANG_TRTLLM_MOE_EMULATE", "1")
    spec = cpu_layers.MoeSpec(**SPEC, fmt="nvfp4")
    layer = _layer(TRTLLM, spec)
    x, logits = _inputs(spec)
    with recording() as rec:
        _bypassed(layer, spec, x, logits, allow_routed_experts_capture=False)
        assert rec.calls == []
        _bypassed(layer, spec, x, logits)
        assert len(rec.calls) == 1


def test_routed_runner_is_captured_once_by_sglangs_own_topk(monkeypatch):
    """flashinfer_trtllm_routed (SGLang's TopK materializes the top-k and captures it): the plugin adds nothing."""
    monkeypatch.setenv("SGLANG_TRTLLM_MOE_EMULATE", "1")
    spec = cpu_layers.MoeSpec(**SPEC, fmt="nvfp4")
    layer = _layer(TRTLLM, spec, layer_id=2)
    x, logits = _inputs(spec)
    from sglang.srt.layers.moe.topk import TopK

    topk = TopK(top_k=2, renormalize=True, layer_id=2)
    with recording() as rec:
        out = topk.forward_native(x, logits)  # STANDARD output: SGLang's select_experts captured it
        layer(x, out)
    assert [c[0] for c in rec.calls] == [2]
    assert as_sets(rec.calls[0][1]) == as_sets(out.topk_ids)


def test_no_tokens_no_capture(monkeypatch):
    monkeypatch.setenv("SGLANG_TRTLLM_MOE_EMULATE", "1")
    spec = cpu_layers.MoeSpec(**SPEC, fmt="nvfp4")
    layer = _layer(TRTLLM, spec)
    x, logits = _inputs(spec, tokens=0)
    with recording() as rec:
        out, _ = _bypassed(layer, spec, x, logits)
    assert out.shape[0] == 0 and rec.calls == []


def test_where_the_kernel_cannot_report_sglangs_own_topk_routes_and_captures(monkeypatch):
    """A flashinfer whose kernel does not write routing_replay_out for the layer's method (auto-selected or SGLang's
    own choice): the runner routes with SGLang's select_experts (which captures, under the layer's id) and the
    routed kernel — never zeros."""
    monkeypatch.setenv("SGLANG_TRTLLM_MOE_EMULATE", "1")
    monkeypatch.setattr(runner, "kernel_replays", lambda method, on_kernel: False)
    spec = cpu_layers.MoeSpec(**SPEC, fmt="nvfp4")
    layer = _layer(TRTLLM, spec, layer_id=5)
    x, logits = _inputs(spec)
    called = []
    real = routed_experts.capture
    monkeypatch.setattr(routed_experts, "capture", lambda *a, **k: called.append(a) or real(*a, **k))
    with recording() as rec:
        _, topk = _bypassed(layer, spec, x, logits)
    assert called == []  # not the plugin's report: SGLang's own top-k captured
    assert [c[0] for c in rec.calls] == [5]
    assert as_sets(rec.calls[0][1]) == as_sets(sglang_topk_ids(x, logits, topk.topk_config))


# ---- which flashinfer reports which method -------------------------------------------------------------------


@pytest.mark.parametrize(
    "version,method,ok",
    [
        ("0.6.8.post1", RoutingMethodType.DeepSeekV3, True),
        ("0.6.12", RoutingMethodType.Renormalize, False),
        ("0.6.14", RoutingMethodType.Renormalize, True),
        ("0.6.17", RoutingMethodType.Llama4, False),
        ("0.6.18", RoutingMethodType.Llama4, True),
        ("0.6.17", None, False),
        ("0.7.2.post1", None, True),
        ("0.7.4", RoutingMethodType.Unspecified, False),
        (None, RoutingMethodType.DeepSeekV3, False),
    ],
)
def test_replay_table(version, method, ok):
    assert kernel_api.replays_routing(version, method) is ok


def test_replay_table_matches_the_installed_flashinfers_sources():
    """The sources flashinfer ships: a routing kernel that writes mPtrRoutingReplayOut, per method family."""
    import pathlib

    from sglang_trtllm_moe.selection import flashinfer_version

    spec = importlib.util.find_spec("flashinfer")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("flashinfer-python is not installed in this env (SGLang 0.5.11-0.5.15 pins cannot import on CPU)")
    root = pathlib.Path(next(iter(spec.submodule_search_locations))) / "data" / "csrc"
    files = {p.name: p.read_text(errors="replace") for p in root.rglob("trtllm_fused_moe_routing_*")}
    if not files:
        pytest.skip("this flashinfer wheel ships no routing kernel sources")

    def writes(prefix):
        return any("mPtrRoutingReplayOut[" in text for name, text in files.items() if name.startswith(prefix))

    v = flashinfer_version()
    assert writes("trtllm_fused_moe_routing_deepseek") == kernel_api.replays_routing(v, RoutingMethodType.DeepSeekV3)
    assert writes("trtllm_fused_moe_routing_custom") == kernel_api.replays_routing(v, RoutingMethodType.Renormalize)
    assert writes("trtllm_fused_moe_routing_llama4") == kernel_api.replays_routing(v, RoutingMethodType.Llama4)


def test_explicit_flashinfer_trtllm_with_r3_on_a_kernel_that_cannot_report_is_refused_at_preparation(monkeypatch):
    from sglang_trtllm_moe.compat import platform

    monkeypatch.setenv("SGLANG_TRTLLM_MOE_EMULATE", "0")
    monkeypatch.setattr(platform, "returns_routed_experts", lambda: True)
    monkeypatch.setattr(platform, "backend_requested", lambda: TRTLLM)
    import sglang_trtllm_moe.selection as selection

    monkeypatch.setattr(selection, "flashinfer_version", lambda: "0.6.12")
    from sglang.srt.layers.moe.utils import RoutingMethodType as SGLangRouting

    spec = cpu_layers.MoeSpec(**SPEC, fmt="nvfp4")
    sglang_runtime.ensure(TRTLLM)
    layer = cpu_layers.build_layer(spec, routing_method_type=SGLangRouting.Renormalize)
    cpu_layers.load_checkpoint(layer, cpu_layers.random_nvfp4_checkpoint(spec), spec.num_experts)
    with pytest.raises(TrtllmLayerError) as e:
        layer.quant_method.process_weights_after_loading(layer)
    msg = str(e.value)
    assert "model.layers.0.mlp.experts" in msg and "Renormalize" in msg and "0.6.14" in msg
    assert "flashinfer_trtllm_routed" in msg and "Fix:" in msg
    # a flashinfer that reports it: served
    monkeypatch.setattr(selection, "flashinfer_version", lambda: "0.6.14")
    layer.quant_method.process_weights_after_loading(layer)
    assert layer_state.state_of(layer) is not None or layer_state.observed(layer) is not None
