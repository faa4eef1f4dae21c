"""The main job (`sglang-trtllm-moe demo`, what `ci/demo` runs) passes end to end on this machine: the whole-model
RL loop on sglang.Engine(device="cpu") (Qwen3-MoE NVFP4), with a line per step and the summary table."""

import os
import subprocess
import sys

import pytest

from sglang_trtllm_moe.sandbox.releases import RL_LOOP_RELEASES

pytestmark = pytest.mark.sglang(
    str(RL_LOOP_RELEASES),
    reason="the demo drives sglang.Engine through its weight-update sessions and weight-checker request "
    "(sandbox/releases.py RL_LOOP_RELEASES)",
)

STEPS = (
    "plugin loaded by SGLang",
    "explain",
    "engine up",
    "reference",
    "load",
    "forward vs transformers",
    "round 1: disk",
    "round 2: tensor buckets",
    "round 3: flattened buckets",
    "partial disk",
    "weight checker",
    "corrupted update caught",
    "restored",
)


def test_demo_passes_every_check(tmp_path):
    # a fresh process as a user would start it: no rendezvous variables left by this test process
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK")
    }
    proc = subprocess.run(
        [sys.executable, "-m", "sglang_trtllm_moe", "demo"],
        capture_output=True,
        text=True,
        timeout=900,
        cwd=tmp_path,
        env=env,
    )
    out = proc.stdout
    assert proc.returncode == 0, out[-4000:] + proc.stderr[-4000:]
    assert "\nsummary" in out and " 0 failed" in out
    for step in STEPS:
        assert f"[PASS] {step} (" in out, step
        assert f"  {step}  " in out.split("\nsummary", 1)[1], step  # a row of the summary table
