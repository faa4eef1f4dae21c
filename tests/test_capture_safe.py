"""The emulator's forward is CUDA-graph capture-safe: no host reads, no value-dependent shapes, no host->device copies.

SGLang captures the MoE forward into a CUDA graph on a GPU; under the emulator (any GPU that is not SM100) that
forward is the plugin's runner, its format's kernel arguments and the emulator. Capture refuses a host read of a
device tensor, a value-dependent output shape and a host->device copy, and a CPU run never notices any of them. So
each forward here runs under `capture_guard()` (tests/support/capture_guard.py), which raises on every such
operation on any device:

* every emulator entry point, logits-routed and routed (packed and pair), of every family and variant
  (tests/support/emulator_cases.py), 1 and several tokens, all experts and an expert-parallel rank, with
  routing_replay_out; every routing method;
* a real SGLang layer of every kind sandbox/layers.py builds, through SGLang's FusedMoE forward and the plugin's
  runner (the guard wraps `runner.run`: SGLang's own TopK before it is SGLang's to keep capture-safe, and its CPU
  path here is not the one a GPU runs).

tests/test_capture_cuda.py captures the same entry points into a real CUDA graph where a GPU exists.

The static formulation (every local expert on every row, then a select) must give what the grouped one gave: a tiny
copy of the old grouping here is compared bit for bit, each GEMM row by row in both (BLAS picks its kernel by the
row count, and MKL's 1-3 row kernels round differently from the same rows inside a larger matrix).
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from sglang_trtllm_moe import runner
from sglang_trtllm_moe.emulator import bf16, fp8_block, fp8_tensor, mxint4, nvfp4

from .support import emulator_cases as cases
from .support.capture_guard import CaptureUnsafe, capture_guard
from .test_empty_forward import CASES as LAYER_CASES
from .test_empty_forward import _forward, _layer

aten = torch.ops.aten


# ---- the guard can fail ------------------------------------------------------------------------------------------

REFUSED = {
    "item": lambda t: t.sum().item(),
    "float": lambda t: float(t[0]),
    "int": lambda t: int(t[0]),
    "bool": lambda t: bool(t[0] > 0),
    "if tensor": lambda t: 1 if (t > 0).any() else 0,
    "tolist": lambda t: t.tolist(),
    "nonzero": lambda t: (t > 0).nonzero(),
    "mask index": lambda t: t[t > 0],
    "mask assign": lambda t: t.clone().__setitem__(t > 0, 0.0),
    "unique_consecutive": lambda t: torch.unique_consecutive(t),
    "unique": lambda t: torch.unique(t),
    "masked_select": lambda t: t.masked_select(t > 0),
    "repeat_interleave(tensor)": lambda t: t.repeat_interleave(torch.ones(t.shape[0], dtype=torch.long)),
    "torch.tensor": lambda t: t * torch.tensor(1.0 / 6.0),
    "torch.tensor(list)": lambda t: torch.tensor([0.5, 1.0]),
    "as_tensor(float)": lambda t: torch.as_tensor(2.0),
    "equal": lambda t: torch.equal(t, t),
}


@pytest.mark.parametrize("name", REFUSED)
def test_the_guard_refuses_what_capture_refuses(name):
    t = torch.tensor([0.5, -1.0, 2.0, 2.0])
    REFUSED[name](t)  # runs outside the guard
    with pytest.raises(CaptureUnsafe), capture_guard():
        REFUSED[name](t)


def test_the_guard_reports_a_swallowed_refusal():
    t = torch.ones(3)
    with pytest.raises(CaptureUnsafe, match="swallowed"), capture_guard():
        try:
            t.sum().item()
        except CaptureUnsafe:
            pass


def test_the_guard_lets_capture_safe_code_through():
    """What the emulator does instead: static shapes, selects, fills, integer-indexed gathers, int repeats."""
    t = torch.tensor([0.5, -1.0, 2.0, 2.0])
    ids = torch.tensor([[1, 3], [0, 1]])
    with capture_guard() as violations:
        lut = torch.stack([torch.full((), v) for v in (0.0, 0.5, 1.0)])
        got = torch.where(t > 0, t * lut[ids.reshape(-1) % 3], torch.zeros_like(t))
        got = got + t.repeat_interleave(2)[::2] * torch.arange(4)
        got[ids[0]] = 7.0  # index_put_ with integer indices
        per_expert = t.reshape(-1)[2]  # a 0-d tensor, never read on the host
        got = got * per_expert
    assert violations == []
    assert torch.equal(got, torch.tensor([0.5, 14.0, 8.0, 14.0]))


# ---- every entry point, every routing method ---------------------------------------------------------------------


def _check_forward(family, args, out, ids):
    """Output of the right shape; a token none of whose slots is on this rank gets exactly 0, the others do not."""
    tokens = args["hidden_states"].shape[0]
    width = args["output"].shape[1] if args.get("output") is not None else cases.H
    assert out.shape == (tokens, width) and out.dtype == torch.bfloat16
    off, n = args["local_expert_offset"], args["local_num_experts"]
    local = ((ids >= off) & (ids < off + n)).any(dim=1)
    assert torch.isfinite(out.float()).all()
    assert (out[~local] == 0).all() and (out[local].float().abs().sum(dim=1) > 0).all()


def _call(fn, kwargs):
    out = fn(**kwargs)
    return out[0] if isinstance(out, list) else out


def _fresh(kwargs):
    """Same arguments with new output buffers, so two calls never share what they write."""
    out = dict(kwargs)
    for k in ("routing_replay_out", "output"):
        if out.get(k) is not None:
            out[k] = out[k].clone()
    return out


@pytest.mark.parametrize("tokens", [1, 6], ids=["1-token", "6-tokens"])
@pytest.mark.parametrize("ep", [False, True], ids=["all-experts", "ep-rank"])
@pytest.mark.parametrize("name", cases.VARIANTS)
def test_every_entry_point_runs_capture_safe(name, ep, tokens):
    family, args = cases.case(name, tokens, seed=tokens, ep=ep)
    ids, _ = cases.topk_of(args)
    calls = [(cases.entry_point(family, False), args)]
    calls += [(cases.entry_point(family, True), cases.routed_kwargs(family, args, packed)) for packed in (True, False)]
    for fn, kwargs in calls:
        expected = _call(fn, _fresh(kwargs))
        kwargs = _fresh(kwargs)
        with capture_guard():
            out = _call(fn, kwargs)
        assert torch.equal(out, expected), fn.__name__
        _check_forward(family, kwargs, out, ids)
        replay = kwargs.get("routing_replay_out")
        if replay is not None:
            assert torch.equal(replay[:tokens].int(), ids) and (replay[tokens:] == -1).all(), fn.__name__


@pytest.mark.parametrize("method", list(cases.ROUTING), ids=[m.name for m in cases.ROUTING])
def test_every_routing_method_runs_capture_safe(method):
    family, args = cases.case("bf16-swiglu", 5, seed=int(method), method=method)
    ids, _ = cases.topk_of(args)
    fn = cases.entry_point(family, False)
    expected = _call(fn, _fresh(args))
    with capture_guard():
        out = _call(fn, args)
    assert torch.equal(out, expected)
    assert torch.equal(args["routing_replay_out"][:5].int(), ids)
    _check_forward(family, args, out, ids)


# ---- the static formulation gives what the grouped one gave ------------------------------------------------------


def grouped_run_experts(
    x, ids, weights, offset, n_local, expert_fn, hidden_out, output, routing_replay_out=None, weights_on_input=False
):
    """The emulator's driver before it was made capture-safe: each local expert that received slots runs on those
    slots' rows only (gathered with nonzero / unique / tolist), then the same finalize."""
    T, K = ids.shape
    if routing_replay_out is not None:
        routing_replay_out[:T].copy_(ids.to(routing_replay_out.dtype))
    y = torch.zeros(T * K, hidden_out, dtype=torch.float32)
    flat = ids.reshape(-1).long() - offset
    w_flat = None if weights is None else weights.reshape(-1).float()
    for e in torch.unique(flat[(flat >= 0) & (flat < n_local)]).tolist():
        s = (flat == e).nonzero().squeeze(1)
        y[s] = expert_fn(e, x[s // K], w_flat[s] if weights_on_input else None)
    y = y.view(T, K, hidden_out)
    acc = torch.zeros(T, hidden_out, dtype=torch.float32)
    for k in range(K):
        acc = acc + (y[:, k] if weights_on_input or weights is None else weights[:, k].float().unsqueeze(1) * y[:, k])
    out = acc.to(torch.bfloat16)
    if output is not None:
        output.copy_(out)
        return output
    return out


class RowByRowMatmul(TorchDispatchMode):
    """Every `mm` one row at a time, so a row's GEMM result cannot depend on the rows around it."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is aten.mm.default and args[0].shape[0] > 1:
            a, b = args
            return torch.cat([torch.mm(a[i : i + 1], b) for i in range(a.shape[0])])
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("ep", [False, True], ids=["all-experts", "ep-rank"])
@pytest.mark.parametrize("name", cases.VARIANTS)
def test_static_formulation_equals_the_grouped_one_bit_for_bit(name, ep, monkeypatch):
    family, args = cases.case(name, 7, seed=11, ep=ep)
    fn = cases.entry_point(family, False)
    with RowByRowMatmul():
        static = _call(fn, _fresh(args)).clone()
        for module in (nvfp4, fp8_block, fp8_tensor, bf16, mxint4):
            monkeypatch.setattr(module, "run_experts", grouped_run_experts)
        grouped = _call(fn, _fresh(args))
    assert static.float().abs().sum() > 0
    assert torch.equal(static, grouped)


# ---- a real SGLang layer of every kind, through the plugin's runner ----------------------------------------------


@pytest.mark.parametrize("tokens", [1, 5], ids=["1-token", "5-tokens"])
@pytest.mark.parametrize("backend,spec", LAYER_CASES)
def test_every_layer_kind_forwards_capture_safe(backend, spec, tokens, monkeypatch):
    """The unguarded forward first is SGLang's eager warm-up before it captures (cuda_graph_runner): it also leaves
    the runner's layout bookkeeping read (layer_state: Python lists mirrored from the CPU masks)."""
    monkeypatch.setenv("SGLANG_TRTLLM_MOE_EMULATE", "1")
    layer = _layer(backend, spec)
    g = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, spec.hidden, generator=g).to(torch.bfloat16)
    logits = torch.randn(tokens, spec.num_experts, generator=g)
    expected = _forward(layer, spec, x, logits)
    real, runs = runner.run, []

    def guarded(*args, **kwargs):
        with capture_guard():
            out = real(*args, **kwargs)
        runs.append(out)
        return out

    monkeypatch.setattr(runner, "run", guarded)
    out = _forward(layer, spec, x, logits)
    assert len(runs) == 1, "the layer did not run through the plugin's runner"
    assert torch.equal(out, expected)
    assert out.shape == x.shape and torch.isfinite(out.float()).all() and out.float().abs().sum() > 0
