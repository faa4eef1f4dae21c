"""Start a world of rank processes on CPU and collect what each one saved: used by tests/test_multirank.py and
tests/test_eplb_p2p.py. A worker module is run as `python -m MODULE JOB_FILE RANK WORLD_SIZE PORT OUT_DIR` and
saves its results to OUT_DIR/rank{R}.pt (torch.save)."""

from __future__ import annotations

import os
import subprocess
import sys

import torch

from sglang_trtllm_moe.sandbox.runtime import free_port

from .helpers import REPO


def launch(module: str, world: int, job: dict, tmp) -> list[subprocess.Popen]:
    """`world` processes of `module` sharing a fresh rendezvous port; `job` is saved to tmp/job.pt for them. The
    plugin's own environment switches are not inherited: each worker sets what it runs under."""
    path = tmp / "job.pt"
    torch.save(job, path)
    env = {k: v for k, v in os.environ.items() if not k.startswith("SGLANG_TRTLLM_MOE_")}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    port = free_port()
    return [
        subprocess.Popen(
            [sys.executable, "-m", module, str(path), str(r), str(world), str(port), str(tmp)],
            cwd=str(REPO),
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in range(world)
    ]


def kill(procs) -> None:
    for p in procs:
        if p.poll() is None:
            p.kill()


def collect(procs, tmp, timeout=240) -> list[dict]:
    """Every rank's saved results, after all exited 0 (else the failing rank's log tail)."""
    logs = []
    try:
        for p in procs:
            logs.append(p.communicate(timeout=timeout)[0])
    finally:
        kill(procs)
    for r, p in enumerate(procs):
        assert p.returncode == 0, f"rank {r} failed (rc {p.returncode}):\n{logs[r][-4000:] if r < len(logs) else ''}"
    return [torch.load(tmp / f"rank{r}.pt", weights_only=False) for r in range(len(procs))]
