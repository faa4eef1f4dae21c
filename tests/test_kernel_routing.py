"""A routing the kernel cannot do never reaches it as another method, on every release.

The plugin runner routes a layer inside the TRT-LLM-Gen kernel only when the layer's top-k configuration is what the
kernel's routing method computes (kernel_api.kernel_routing_problem: SGLang 0.5.23's own rule,
`topk._can_bypass_trtllm_routing`, checked against it here where the release has it). Otherwise SGLang's own top-k
routes and the routed kernel computes: a DeepSeek-V4-style sqrtsoftplus layer or a DeepSeekV3 layer without its
correction bias, handed to the runner with routing left to the kernel (as every release before 0.5.23 hands it),
gives exactly the output of SGLang's own top-k path."""

from __future__ import annotations

import inspect
import itertools

import pytest
import torch

from sglang_trtllm_moe import kernel_api
from sglang_trtllm_moe.kernel_api import RoutingMethodType
from sglang_trtllm_moe.sandbox import layers as cpu_layers

from .support import sglang_runtime

SPEC = cpu_layers.MoeSpec(num_experts=8, intermediate=128, fmt="bf16")


@pytest.fixture(scope="module", autouse=True)
def runtime():
    sglang_runtime.ensure("flashinfer_trtllm")


@pytest.fixture(autouse=True)
def plugin_prepares(monkeypatch):
    monkeypatch.setenv("SGLANG_TRTLLM_MOE_EMULATE", "1")
    sglang_runtime.plugin_prepares(monkeypatch, "bf16")


def _sglang_rule():
    from sglang.srt.layers.moe import topk

    return getattr(topk, "_can_bypass_trtllm_routing", None)


def test_the_rule_is_sglangs_own():
    """Every (method, top-k configuration) of a grid: the kernel routes it exactly where SGLang's own rule lets it."""
    rule = _sglang_rule()
    if rule is None:
        from sglang_trtllm_moe.compat.releases import installed_version

        pytest.skip(f"SGLang {installed_version()} has no topk._can_bypass_trtllm_routing (0.5.23+) to compare with")
    from sglang.srt.layers.moe.topk import TopKConfig

    bias = torch.zeros(8)
    fields = set(inspect.signature(TopKConfig).parameters)
    checked = 0
    for method, grouped, biased, renorm, scoring, top_k, log1p in itertools.product(
        list(RoutingMethodType),
        (False, True),
        (False, True),
        (False, True),
        ("softmax", "sigmoid", "sqrtsoftplus"),
        (1, 2),
        (False, True),
    ):
        kw = dict(
            top_k=top_k,
            use_grouped_topk=grouped,
            num_expert_group=4 if grouped else None,
            topk_group=2 if grouped else None,
            renormalize=renorm,
            correction_bias=bias if biased else None,
            scoring_func=scoring,
            sqrtsoftplus_log1p=log1p,
            routing_method_type=method,
        )
        cfg = TopKConfig(**{k: v for k, v in kw.items() if k in fields})
        ours = kernel_api.kernel_routing_problem(int(method), cfg) is None
        assert ours == rule(cfg), (method.name, kw, kernel_api.kernel_routing_problem(int(method), cfg))
        checked += 1
    assert checked > 1000


def _topk(**kw):
    """SGLang's TopK of this release for the layer's router (keywords it does not take are left out)."""
    from sglang.srt.layers.moe.topk import TopK

    accepted = inspect.signature(TopK.__init__).parameters
    return TopK(**{k: v for k, v in kw.items() if k in accepted})


def _layer(method):
    layer = cpu_layers.build_layer(SPEC, routing_method_type=method)
    cpu_layers.load_checkpoint(layer, cpu_layers.random_bf16_checkpoint(SPEC, seed=3), SPEC.num_experts)
    layer.quant_method.process_weights_after_loading(layer)
    return layer


def _inputs():
    g = torch.Generator().manual_seed(11)
    x = torch.randn(12, SPEC.hidden, generator=g).to(torch.bfloat16)
    logits = torch.randn(12, SPEC.num_experts, generator=g)
    return x, logits


def _both(layer, topk):
    """(SGLang's own top-k path, the same routing left to the kernel as releases before 0.5.23 hand it over)."""
    from sglang.srt.layers.moe.topk import BypassedTopKOutput

    x, logits = _inputs()
    materialized = layer(x, topk.forward_native(x, logits))
    bypassed = layer(x, BypassedTopKOutput(x, logits, topk.topk_config))
    return materialized, bypassed


BIAS = torch.linspace(-0.5, 0.5, SPEC.num_experts)
CANNOT = {
    # DeepSeek-V4: ungrouped sqrtsoftplus with a correction bias, declared DeepSeekV3 (SGLang's deepseek_v2.py)
    "deepseek-v4-sqrtsoftplus": dict(scoring_func="sqrtsoftplus", correction_bias=BIAS, use_grouped_topk=False),
    "deepseek-v3-without-correction-bias": dict(
        scoring_func="sigmoid", use_grouped_topk=True, num_expert_group=4, topk_group=2
    ),
}


@pytest.mark.parametrize("case", sorted(CANNOT))
def test_a_routing_the_kernel_cannot_do_gets_sglangs_own_topk(case):
    layer = _layer(RoutingMethodType.DeepSeekV3)
    topk = _topk(top_k=2, layer_id=0, renormalize=True, **CANNOT[case])
    assert kernel_api.kernel_routing_problem(int(RoutingMethodType.DeepSeekV3), topk.topk_config)
    try:
        materialized, bypassed = _both(layer, topk)
    except ValueError as e:
        if "scoring function" not in str(e):
            raise
        pytest.skip(f"this SGLang release's own top-k does not compute this routing ({e}): nothing to serve")
    assert torch.equal(bypassed, materialized)


def test_a_routing_the_kernel_computes_is_routed_in_the_kernel(monkeypatch):
    """DeepSeekV3 with grouped top-k and its correction bias: the kernel's own method (SGLang's top-k is not asked),
    with the experts and weights SGLang's top-k picks."""
    from sglang_trtllm_moe import runner

    calls = []
    real = runner._select_experts
    monkeypatch.setattr(runner, "_select_experts", lambda *a, **k: calls.append(1) or real(*a, **k))
    layer = _layer(RoutingMethodType.DeepSeekV3)
    topk = _topk(
        top_k=2,
        layer_id=0,
        renormalize=True,
        scoring_func="sigmoid",
        correction_bias=BIAS,
        use_grouped_topk=True,
        num_expert_group=4,
        topk_group=2,
    )
    assert kernel_api.kernel_routing_problem(int(RoutingMethodType.DeepSeekV3), topk.topk_config) is None
    materialized, bypassed = _both(layer, topk)
    assert calls == []
    assert float((bypassed.float() - materialized.float()).norm() / materialized.float().norm()) < 0.02
