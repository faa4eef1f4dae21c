"""The emulator captured into a real CUDA graph and replayed: what SGLang does with the MoE forward on a GPU.

Runs where a CUDA GPU exists (the lent H200: `python -m pytest tests/test_capture_cuda.py`); skipped elsewhere with
the missing piece named. Imports neither SGLang nor flashinfer, so it runs on a bare torch machine.
tests/test_capture_safe.py proves the property on any device with a guard; this is the real capture. Each entry
point of each family and variant (tests/support/emulator_cases.py) runs eagerly under the guard (on CUDA it also sees
host <-> device copies), is captured after SGLang's eager warm-up (cuda_graph_runner: two runs on a side stream) with
the index-map caches emptied first, and its replay must equal the eager result. Then every input is overwritten in
place with another batch's (routing, activations, weights, scalars) and the replay must equal an eager call on
those: nothing of the first batch is baked into the graph.
"""

from __future__ import annotations

import pytest
import torch

from sglang_trtllm_moe import layouts

from .support import emulator_cases as cases
from .support.capture_guard import capture_guard

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU (a CUDA graph is captured): no CUDA device on this machine", allow_module_level=True)

DEV = torch.device("cuda")


def _to_device(value):
    if isinstance(value, torch.Tensor):
        return value.to(DEV)
    if isinstance(value, tuple):
        return tuple(_to_device(v) for v in value)
    return value


def _copy_into(static, fresh):
    """Overwrite the captured call's input tensors in place with another batch's (same shapes and dtypes)."""
    for key, value in static.items():
        if isinstance(value, torch.Tensor) and key not in ("output", "routing_replay_out"):
            value.copy_(fresh[key])
        elif isinstance(value, tuple):
            for s, f in zip(value, fresh[key], strict=True):
                s.copy_(f)


def _kwargs(name, routed, seed, ep):
    family, args = cases.case(name, 6, seed=seed, ep=ep)
    if routed:
        args = cases.routed_kwargs(family, args, packed=True)
    return cases.entry_point(family, routed), {k: _to_device(v) for k, v in args.items()}


def _call(fn, kwargs):
    out = fn(**kwargs)
    return out[0] if isinstance(out, list) else out


@pytest.mark.parametrize("routed", [False, True], ids=["logits", "routed"])
@pytest.mark.parametrize("ep", [False, True], ids=["all-experts", "ep-rank"])
@pytest.mark.parametrize("name", cases.VARIANTS)
def test_entry_point_is_captured_and_replayed(name, ep, routed):
    fn, static = _kwargs(name, routed, seed=1, ep=ep)
    with capture_guard():
        eager = _call(fn, static).clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            _call(fn, static)
    torch.cuda.current_stream().wait_stream(side)
    layouts.clear_caches()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = _call(fn, static)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)
    assert out.float().abs().sum() > 0
    _, fresh = _kwargs(name, routed, seed=2, ep=ep)
    expected = _call(fn, fresh)
    replay = fresh.get("routing_replay_out")
    _copy_into(static, fresh)
    graph.replay()
    torch.cuda.synchronize()
    assert not torch.equal(expected, eager)  # the second batch is another batch
    assert torch.equal(out, expected)
    if replay is not None:
        assert torch.equal(static["routing_replay_out"], replay)
