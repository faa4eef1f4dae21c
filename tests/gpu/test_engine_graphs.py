"""A real sglang.Engine on a GPU with CUDA graphs on, serving through the plugin (emulated TRT-LLM-Gen kernels on a
faked SM100), every RL step: updates land in the graphs captured at start-up, exactly (tests/gpu/engine_run.py has
the flow). One process per model (each Engine needs a fresh CUDA context for its memory pools), the models of
SGLANG_TRTLLM_MOE_GPU_MODELS (default: NVFP4, FP8 block, FP8 per-tensor, BF16, relu2 NVFP4, online NVFP4 from a
BF16 checkpoint, and a Kimi-K2-style DeepSeek-V3 in INT4 W4A16); and DeepSeek-V3 with its NextN draft under EAGLE
(tests/gpu/draft_engine_run.py).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from ..support.helpers import REPO, last_json

DEFAULT = (
    "qwen3_moe:nvfp4,deepseek_v3:fp8_block,qwen3_moe:fp8,qwen3_moe:bf16,nemotron_h:nvfp4,qwen3_moe:nvfp4_online,"
    "deepseek_v3:ct_int4"
)
MODELS = os.environ.get("SGLANG_TRTLLM_MOE_GPU_MODELS", DEFAULT).split(",")
STEPS = (
    "engine G up",
    "load",
    "disk A->B",
    "disk B->A exact",
    "tensor buckets (CUDA tensors) == disk",
    "refused bucket changes nothing",
    "partial update (CUDA tensors)",
    "weight checker",
    "eager fresh load == graphs after updates (bytes)",
    "eager fresh load == graphs after updates (tokens)",
    "routed experts: graphs == eager, not zeros",
)
_REPORTS: dict = {}


#: tests/gpu/draft_engine_run.py: DeepSeek-V3 FP8 block with its NextN draft, EAGLE, graphs on
DRAFT = "deepseek_v3:fp8_block-nextn"
DRAFT_STEPS = (
    "engine G up (EAGLE, graphs)",
    "disk A->B",
    "a bad draft expert on disk: refused, target and draft unchanged",
    "tokens after the update == a fresh load of B",
    "draft counters after the update == a fresh load of B",
    "control: a stale draft (target B, draft A) changes the counters",
)


def report(model: str) -> dict:
    if model not in _REPORTS:
        argv = ["tests.gpu.draft_engine_run"] if model == DRAFT else ["tests.gpu.engine_run", model]
        proc = subprocess.run(
            [sys.executable, "-m", *argv],
            cwd=str(REPO),
            capture_output=True,
            text=True,
            timeout=900,
        )
        try:
            rep = last_json(proc)
        except AssertionError:  # the process died without a report (SGLang kills its launcher when a child fails)
            rep = {"error": f"engine_run exited with {proc.returncode} and no report", "traceback": proc.stdout[-3000:]}
        rep["_stderr_tail"] = proc.stderr[-6000:]
        _REPORTS[model] = rep  # once per model, failed or not: each step's test reads the same report
        out = os.environ.get("SGLANG_TRTLLM_MOE_GPU_OUT")
        if out:
            with open(os.path.join(out, f"engine-{model.replace(':', '-')}.json"), "w") as f:
                json.dump(rep, f, default=str)
    return _REPORTS[model]


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("step", STEPS)
def test_engine_with_cuda_graphs(model, step):
    rep = report(model)
    steps = DRAFT_STEPS if model == DRAFT else STEPS
    assert step in steps
    assert "error" not in rep, f"{rep['error']}\n{rep.get('traceback', '')}\n{rep['_stderr_tail']}"
    assert step in rep, f"step {step!r} did not run: {sorted(rep)}\n{rep['_stderr_tail']}"
    res = rep[step]
    assert res["ok"], json.dumps(res, default=str)[:3000]


@pytest.mark.parametrize("step", DRAFT_STEPS)
def test_engine_with_a_speculative_draft_updates_the_draft(step):
    """An RL disk update reaches the NextN draft's MoE layers: the accepted-draft counters equal a fresh load's."""
    test_engine_with_cuda_graphs(DRAFT, step)


def test_sleep_wake_with_the_memory_saver_then_a_full_update_is_exact():
    if "qwen3_moe:nvfp4" not in MODELS:
        pytest.skip("runs with the qwen3_moe:nvfp4 model (SGLANG_TRTLLM_MOE_GPU_MODELS)")
    rep = report("qwen3_moe:nvfp4")
    assert "error" not in rep, f"{rep['error']}\n{rep.get('traceback', '')}"
    res = rep["memory saver: release, resume, full update == fresh"]
    assert res["ok"], res
