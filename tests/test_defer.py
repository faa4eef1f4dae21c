"""The defer verdicts (each format's `upstream_verdicts`, compat/defer.py) against SGLang itself, and what the
plugin does where upstream is right.

* Each verdict is re-measured on the installed release: SGLang alone (plugin switched off) prepares a layer of
  each format and goes through the updates its public API allows (tests/support/upstream_rl.py); "upstream
  correct" must be exactly what the format's verdict says. Where SGLang's own trtllm path cannot run on CPU at this
  release's flashinfer pin, the check says so instead of passing.
* Where a verdict says upstream is right, a layer is left to SGLang's own preparation with the plugin loaded
  (SGLang's shapes and bytes, SGLang's own reload), and the plugin still watches it: the emulator runs SGLang's
  bytes (a forward matches a reference) and the flows stay exact.
"""

from __future__ import annotations

import json

import pytest
import torch

from sglang_trtllm_moe import layer_state
from sglang_trtllm_moe.compat import defer, installed_version
from sglang_trtllm_moe.formats import FORMATS as REGISTRY
from sglang_trtllm_moe.formats import by_name
from sglang_trtllm_moe.sandbox import layers as cpu_layers

from .support import probes, sglang_runtime

#: the registry's names (test ids): every format declares its verdicts (`upstream_verdicts`); `by_name` gives the entry
FORMATS = sorted(f.name for f in REGISTRY)


#: tests/support/upstream_rl.py in a fresh process with the plugin disabled (the session's shared SGLang-alone process,
#: tests/support/probes.py: after every other section there, since it publishes SGLang's process-wide state)
MEASURED = probes.section(
    "disabled",
    "upstream_rl",
    f"""
    from tests.support import upstream_rl
    RESULT = upstream_rl.main({FORMATS!r})
    """,
    order=probes.LAST,
)


@pytest.fixture(scope="module")
def measured():
    return probes.result("disabled", MEASURED)


@pytest.mark.parametrize("fmt", FORMATS)
def test_verdict_matches_what_sglang_does_on_this_release(measured, fmt):
    v = defer.verdict(by_name(fmt))
    assert v is not None, f"{fmt} declares no upstream verdict on sglang {installed_version()}"
    got = measured[fmt]
    if got.get("upstream_correct") is None:
        assert v.evidence.startswith("read:"), (
            f"{fmt}: SGLang's own path cannot run here ({got.get('cannot_run')}) but its verdict claims a measurement"
        )
        pytest.skip(
            f"sglang {installed_version()}: SGLang's own {fmt} trtllm preparation cannot run on CPU here "
            f"({got['cannot_run'][:120]}); verdict read from its code: {v.evidence}"
        )
    flows = {k: {kk: vv for kk, vv in x.items() if kk != "trace"} for k, x in got.items() if isinstance(x, dict)}
    assert got["upstream_correct"] is v.upstream_correct, (fmt, v, flows)


def test_every_format_of_the_registry_has_a_verdict_on_every_supported_release():
    for fmt in REGISTRY:
        for minor in range(11, 24):
            assert defer.verdict(fmt, f"0.5.{minor}") is not None, (fmt.name, minor)


# ---- where upstream is right: SGLang prepares, the plugin watches ------------------------------------------------

DEFERRED = [f for f in FORMATS if defer.upstream_prepares(by_name(f))]


@pytest.fixture(scope="module", autouse=True)
def runtime():
    sglang_runtime.ensure("flashinfer_trtllm")


def _checkpoint(fmt, spec, seed, experts=None):
    make = {"bf16": cpu_layers.random_bf16_checkpoint}.get(fmt, cpu_layers.random_fp8_checkpoint)
    return make(spec, seed=seed, experts=experts)


@pytest.mark.skipif(not DEFERRED, reason="no format is left to SGLang on this release (compat/defer.py)")
@pytest.mark.parametrize("fmt", DEFERRED or ["none"])
def test_deferred_layer_is_sglangs_own_and_watched(fmt, monkeypatch):
    """The plugin loaded, the layer on flashinfer_trtllm: SGLang's own preparation runs (its shapes and bytes),
    the plugin attaches no layout state but watches the layer, a one-expert update through SGLang's updater equals
    a fresh load, and the emulator reads SGLang's bytes."""
    spec = cpu_layers.MoeSpec(num_experts=4, intermediate=128, fmt=fmt)
    model = sglang_runtime.prepared_model(spec, _checkpoint(fmt, spec, 0))
    layer = model.experts
    assert layer_state.state_of(layer) is None and layer_state.observed(layer) is not None
    assert layer_state.observed(layer).name == fmt
    ptrs = {n: p.data_ptr() for n, p in model.named_parameters()}
    one = _checkpoint(fmt, spec, 1, experts=[2])
    u = sglang_runtime.updater(model)
    from sglang_trtllm_moe.compat import features

    named = list(cpu_layers.checkpoint_names(one).items())
    if features.UPDATE_SESSIONS.present():
        u.begin_weight_update()
        assert u.update_weights_from_tensor(named)[0]
        u.end_weight_update(run_post_load=False)
    else:
        assert u.update_weights_from_tensor(named)[0]
    fresh = sglang_runtime.prepared_model(spec, {**_checkpoint(fmt, spec, 0), **one})
    for n, p in fresh.named_parameters():
        mine = dict(model.named_parameters())[n]
        assert mine.shape == p.shape and torch.equal(
            mine.detach().reshape(-1).view(torch.uint8), p.detach().reshape(-1).view(torch.uint8)
        ), n
    assert {n: p.data_ptr() for n, p in model.named_parameters()} == ptrs

    monkeypatch.setenv("SGLANG_TRTLLM_MOE_EMULATE", "1")
    g = torch.Generator().manual_seed(3)
    x = torch.randn(8, spec.hidden, generator=g).to(torch.bfloat16)
    logits = torch.randn(8, spec.num_experts, generator=g)
    out, topk = sglang_runtime.forward(layer, x, logits)
    ck = {**_checkpoint(fmt, spec, 0), **one}
    ref = _float_moe(x, topk.topk_ids, topk.topk_weights, ck, spec, fmt)
    err = float((out.float() - ref).norm() / ref.norm())
    assert err < (0.02 if fmt == "bf16" else 0.08), err  # bf16: rounding only; fp8 block: per-128 activation quant


def _float_moe(x, ids, weights, ck, spec, fmt):
    from sglang_trtllm_moe import quant

    def w(e, proj):
        base = f"experts.{e}.{proj}."
        if fmt == "bf16":
            return ck[base + "weight"].float()
        q, s = ck[base + "weight"], ck[base + "weight_scale_inv"]
        return quant.fp8_block_dequantize(q, s)

    x = x.float()
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for k in range(ids.shape[1]):
            e = int(ids[t, k])
            h = torch.nn.functional.silu(w(e, "gate_proj") @ x[t]) * (w(e, "up_proj") @ x[t])
            out[t] += float(weights[t, k]) * (w(e, "down_proj") @ h)
    return out


def test_measurement_tool_reports_json(measured):
    json.dumps(measured)
    assert set(measured) == set(FORMATS)
