"""`explain` on a machine without a GPU (issue #28, finding 6): asked about this machine (no `--sm`), it says there
is no CUDA GPU here and how to ask about a Blackwell server, instead of "no CUDA GPU is not SM 10.x"."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from sglang_trtllm_moe.sandbox import checkpoints as ck

from .support.helpers import REPO


@pytest.mark.skipif(torch.cuda.is_available(), reason="asks about a machine without a CUDA GPU; this one has one")
def test_explain_without_sm_on_a_machine_without_a_gpu(tmp_path):
    model = ck.write(str(tmp_path / "tiny"), ck.TinySpec(arch="qwen3_moe", quant="nvfp4"))
    proc = subprocess.run(
        [sys.executable, "-m", "sglang_trtllm_moe", "explain", "--model", model, "--no-sglang"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=str(REPO),
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    assert "[NOT_SM100]" in out and "no CUDA GPU on this machine (the TRT-LLM-Gen kernels need SM 10.x)" in out, out
    assert "is not SM 10.x" not in out.replace("need SM 10.x", ""), out
    assert "note: this machine has no CUDA GPU" in out and "pass --sm 100" in out, out


def test_explain_says_which_update_entry_points_leave_a_speculative_draft_stale(tmp_path):
    """`--speculative-algorithm`: before 0.5.21 the distributed update reaches the target only (features.
    DISTRIBUTED_UPDATE_SKIPS_DRAFT, probed against the release's scheduler); from 0.5.21 no entry point leaves the
    draft out unless the request's selector does."""
    from sglang_trtllm_moe.compat import features
    from sglang_trtllm_moe.explain import explain_model

    model = ck.write(str(tmp_path / "tiny"), ck.TinySpec(arch="deepseek_v3", quant="fp8_block"))
    rep = explain_model(model, sm=100, run_sglang=False, speculative_algorithm="EAGLE")["draft_updates"]
    stale = features.DISTRIBUTED_UPDATE_SKIPS_DRAFT.present()
    assert rep["stale_after"] == (["update_weights_from_distributed"] if stale else []), rep
    assert ("keeps serving its old weights" in rep["reason"]) == stale, rep
