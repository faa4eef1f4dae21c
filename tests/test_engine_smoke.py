"""sglang.Engine(device="cpu") through the plugin on every release (issue #40): start-up with `auto` resolving to the
plugin's runner, generate, disk and tensor updates A -> B -> A bit-exact against the Engine's own fresh load of A (B
reached both ways agrees byte for byte), a bucket with one NaN scale refused with every byte kept — in one Engine, in
well under a minute (tests/support/engine_smoke.py). The full RL loop (sessions, weight checker, a ModelRunner
reference, transformers) is tests/test_engine.py on RL_LOOP_RELEASES, where this smoke does not run again.
"""

from __future__ import annotations

import pytest
from packaging.specifiers import SpecifierSet

from sglang_trtllm_moe.compat.sandbox_releases import ENGINE_RELEASES, RL_LOOP_RELEASES

from .support.helpers import last_json, run_module

#: where the whole RL loop runs (tests/test_engine.py: the same steps and more, against a ModelRunner reference) the
#: smoke would only repeat it: CI time goes to the releases that have nothing else on the Engine
SMOKE_RELEASES = ENGINE_RELEASES & SpecifierSet(f"<{min(s.version for s in RL_LOOP_RELEASES)}")

pytestmark = pytest.mark.sglang(
    str(SMOKE_RELEASES),
    reason="sglang.Engine as sandbox/engine.py drives it; from RL_LOOP_RELEASES on tests/test_engine.py runs the "
    "whole RL loop instead (compat/sandbox_releases.py)",
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

_RUN: dict = {}


def run() -> dict:
    if not _RUN:
        proc = run_module("tests.support.engine_smoke", "qwen3_moe:nvfp4", timeout=600)
        _RUN.update(last_json(proc))
    return _RUN


@pytest.mark.parametrize("step", STEPS)
def test_engine_smoke(step):
    steps = {c["step"]: c for c in run()["steps"]}
    failed = [c for c in run()["steps"] if not c["ok"] and c["step"] not in STEPS]
    assert not failed, f"{failed}\nSGLang's output:\n{run()['log']}"
    assert step in steps, f"step {step!r} did not run: {list(steps)}"
    assert steps[step]["ok"], steps[step]["detail"]
