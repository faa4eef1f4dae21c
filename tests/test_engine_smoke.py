"""sglang.Engine(device="cpu") through the plugin on every release (issue #40): start-up with `auto` resolving to the
plugin's runner, generate, disk and tensor updates A -> B -> A bit-exact against the Engine's own fresh load of A (B
reached both ways agrees byte for byte), a bucket with one NaN scale refused with every byte kept — in one Engine, in
well under a minute (tests/support/engine_smoke.py). The full RL loop (sessions, weight checker, a ModelRunner
reference, transformers) is tests/test_engine.py on RL_LOOP_RELEASES, where this smoke does not run again; there the
same smoke runs on a Qwen3-MoE in INT4 W4A16 (compressed-tensors group 32, Kimi-K2's format), which the RL loop's
models do not cover.
"""

from __future__ import annotations

import pytest
from packaging.specifiers import SpecifierSet

from sglang_trtllm_moe.sandbox.releases import ENGINE_RELEASES, RL_LOOP_RELEASES

from .support.helpers import last_json, run_module

#: where the whole RL loop runs (tests/test_engine.py: the same steps and more, against a ModelRunner reference) the
#: smoke would only repeat it: CI time goes to the releases that have nothing else on the Engine
SMOKE_RELEASES = ENGINE_RELEASES & SpecifierSet(f"<{min(s.version for s in RL_LOOP_RELEASES)}")

SMOKE = pytest.mark.sglang(
    str(SMOKE_RELEASES),
    reason="sglang.Engine as sandbox/engine.py drives it; from RL_LOOP_RELEASES on tests/test_engine.py runs the "
    "whole RL loop instead (sandbox/releases.py)",
)
#: the INT4 W4A16 smoke (issue #51: compressed-tensors group 32, as Kimi-K2 ships it) where the whole RL loop runs on
#: the other formats; every flow of a Kimi-K2-style DeepSeek-V3 in INT4 runs through SGLang's ModelRunner in
#: tests/test_models.py
INT4 = pytest.mark.sglang(
    str(RL_LOOP_RELEASES),
    reason="the INT4 Engine smoke runs on the release the RL loop's Engine tests run on (sandbox/releases.py "
    "RL_LOOP_RELEASES); older releases run the NVFP4 smoke",
)

STEPS = (
    "engine up",
    "load",
    "disk: A -> B",
    "tensor: B -> A",
    "tensor: A -> B",
    "disk: B -> A",
    "bad bucket refused",
    "still A",
)

_RUNS: dict = {}


def run(model: str = "qwen3_moe:nvfp4") -> dict:
    if model not in _RUNS:
        _RUNS[model] = last_json(run_module("tests.support.engine_smoke", model, timeout=600))
    return _RUNS[model]


def _check(model: str, step: str) -> None:
    res = run(model)
    steps = {c["step"]: c for c in res["steps"]}
    failed = [c for c in res["steps"] if not c["ok"] and c["step"] not in STEPS]
    assert not failed, f"{failed}\nSGLang's output:\n{res['log']}"
    assert step in steps, f"step {step!r} did not run: {list(steps)}"
    assert steps[step]["ok"], steps[step]["detail"]


@SMOKE
@pytest.mark.parametrize("step", STEPS)
def test_engine_smoke(step):
    _check("qwen3_moe:nvfp4", step)


@INT4
@pytest.mark.parametrize("step", STEPS)
def test_int4_engine_smoke(step):
    _check("qwen3_moe:ct_int4", step)
