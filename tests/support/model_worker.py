"""Whole SGLang models (architecture x format) through every RL flow, each in its own process.

SGLang's process state (published ServerArgs resolved for one model, the parallel runtime, expert-location
metadata) is built once per process and is specific to one model, so each (arch, quant) runs in a process of its
own and yields one report: {check: {"ok": bool, "detail": str, ...}}. tests/test_models.py asserts it.

    python -m tests.support.model_worker ARCH QUANT [--checks a,b,...] [--workdir DIR]   # one model, this process
    python -m tests.support.model_worker --jobs ARCH:QUANT[:check+check],... [--parallel N]

`--jobs`: one parent imports SGLang, the stand-ins and the plugin once (`models.prepare_process(preload=True)`),
then forks one child per job (at most N at a time, default: the CPU count, at most 2), so each model gets a fresh
SGLang process state without paying the imports again; prints {"ARCH:QUANT": report, ...}. Every process runs
single-threaded torch (`models.threads()`), which is what makes a 2-core box fast.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import shutil
import sys
import tempfile
import time

os.environ.setdefault("OMP_NUM_THREADS", os.environ.get("SGLANG_TRTLLM_MOE_TEST_THREADS", "1"))

from .helpers import fork_json
from .model_base import PROMPTS, VARIANTS, WorkerBase
from .model_checks import Checks
from .model_flows import UpdateFlows
from .model_rounds import RankFlows

__all__ = ["PROMPTS", "Worker", "JOBS", "CHECKSUM_JOBS", "job_key"]


class Worker(Checks, UpdateFlows, RankFlows, WorkerBase):
    """One (arch, quant) through every check: the checkpoints and the run (model_base), what is served
    (model_checks), the update flows (model_flows), across processes and threads (model_rounds)."""

    ON_REQUEST = ("threaded_disk_ab", "routed_experts", "checksum", "batch_invariance", "disk_a_b_a", "ipc_buckets")

    ORDER = (
        "load",
        "forward",
        "batch_invariance",
        "disk_a_b_a",
        "disk_full",
        "disk_partial",
        "tensor_buckets",
        "tensor_flattened_bucket",
        "tensor_split_shards",
        "session_forward",  # before session_direct, which leaves DeepSeek's MLA w_kc / w_vc stale (docs/TESTING.md)
        "session_direct",
        "distributed",
        "random_rounds",
        "ipc_buckets",
        "weight_checker",
        "greedy",
        "checksum",
        "refused_updates",
        "disk_failures",
        "threaded_disk_ab",
        "explain",
        "routed_experts",
    )


# ---- jobs: one forked child per model ------------------------------------------------------------------------------

#: what tests/test_models.py runs (arch, quant, extra on-request checks): every architecture with its NVFP4 and FP8
#: checkpoint where SGLang builds them with FusedMoE, Mixtral BF16, and the quantized Mixtral SGLang builds without
#: FusedMoE (explain must say so).
#: the models whose weight-checker checksum is compared with SGLang alone's (check_checksum; each in its own job's
#: process: a process's resolved quantization turns another checkpoint's BF16 experts into online NVFP4 / FP8)
CHECKSUM_JOBS = (("qwen3_moe", "nvfp4"), ("qwen3_moe", "fp8"), ("mixtral", "bf16"))

JOBS = (
    # batch_invariance: the models sglang.Engine and the HTTP server serve in the tests (docs/TESTING.md "Exact
    # comparisons": measured, not assumed; Mixtral BF16 and DeepSeek's prefill-vs-decode are not batch-invariant)
    ("qwen3_moe", "nvfp4", ("checksum", "batch_invariance")),
    ("qwen3_moe", "fp8", ("checksum",)),
    # ipc_buckets: checkpoint-engine's flow on a DeepSeek-V3 of each kind of owner (NVFP4: the plugin prepares it;
    # FP8 block: SGLang prepares it, the plugin observes it, compat/defer.py)
    ("deepseek_v3", "nvfp4", ("threaded_disk_ab", "ipc_buckets")),
    ("deepseek_v3", "fp8_block", ("ipc_buckets",)),
    ("deepseek_v3", "fp8_block@wide", ()),
    # issue #51: Kimi-K2's INT4 (compressed-tensors W4A16 group 32) on a DeepSeek-V3, with DeepSeek's threaded loader
    # and checkpoint-engine's IPC flow
    ("deepseek_v3", "ct_int4", ("threaded_disk_ab", "ipc_buckets")),
    ("nemotron_h", "nvfp4", ("batch_invariance",)),
    ("nemotron_h", "fp8", ()),
    ("mixtral", "bf16", ("checksum",)),
    ("mixtral", "fp8_static", ()),
    ("mixtral", "nvfp4", ()),
    # issue #37: a BF16 checkpoint served with --quantization nvfp4_online (experts quantized to NVFP4 as they load)
    ("qwen3_moe", "nvfp4_online", ("disk_a_b_a",)),
    # the same BF16 checkpoint served with --quantization modelopt_fp4 (0.5.18+: online, per-tensor activations)
    ("qwen3_moe", "nvfp4_online_tensor", ("disk_a_b_a",)),
    # R3: routed experts through the fused runner, per routing method and format (one check each)
    ("qwen3_moe", "nvfp4@r3", ()),
    ("qwen3_moe", "fp8@r3", ()),
    ("qwen3_moe", "bf16@r3", ()),
    ("deepseek_v3", "nvfp4@r3", ()),
    ("deepseek_v3", "fp8_block@r3", ()),
    ("deepseek_v3", "ct_int4@r3", ()),
    ("nemotron_h", "nvfp4@r3", ()),
    ("nemotron_h", "fp8@r3", ()),
    ("mixtral", "bf16@r3", ()),
)


def job_key(arch: str, quant: str) -> str:
    return f"{arch}:{quant}"


def _run_job(arch: str, quant: str, extra: tuple, workdir: str) -> dict:
    checks = None if not extra else [c for c in Worker.ORDER if c not in Worker.ON_REQUEST or c in extra]
    only = VARIANTS.get(quant.partition("@")[2], {}).get("checks")
    if only:
        checks = [c for c in (checks or Worker.ORDER) if c in only]
    return Worker(arch, quant, workdir).run(checks)


def _timed_job(arch, quant, extra, workdir) -> dict:
    t = time.perf_counter()
    rep = _run_job(arch, quant, extra, workdir)
    rep["_seconds"] = round(time.perf_counter() - t, 2)
    return rep


def run_jobs(jobs, parallel: int, workdir: str) -> dict:
    """Fork one child per job from this (prepared, preloaded) process; at most `parallel` at a time."""
    from sglang_trtllm_moe.sandbox import models

    models.prepare_process(preload=True)
    pending = list(jobs)
    running: dict[int, tuple] = {}
    reports: dict = {}
    while pending or running:
        while pending and len(running) < parallel:
            arch, quant, extra = pending.pop(0)
            key = job_key(arch, quant)
            out = os.path.join(workdir, f"{arch}-{quant}.json")
            job = functools.partial(_timed_job, arch, quant, extra, os.path.join(workdir, f"{arch}-{quant}"))
            pid = fork_json(out, job)
            running[pid] = (key, out, time.perf_counter())
        pid, status = os.wait()
        if pid not in running:
            continue
        key, out, t0 = running.pop(pid)
        try:
            with open(out) as f:
                reports[key] = json.load(f)
        except (OSError, ValueError):
            reports[key] = {
                "_crash": {
                    "ok": False,
                    "error": f"the job's process ended with status {status} "
                    f"after {time.perf_counter() - t0:.0f} s, no report",
                }
            }
    return reports


def _parse_jobs(text: str):
    jobs = []
    for item in text.split(","):
        arch, quant, *extra = item.split(":")
        jobs.append((arch, quant, tuple(extra[0].split("+")) if extra else ()))
    return jobs


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("arch", nargs="?")
    p.add_argument("quant", nargs="?")
    p.add_argument("--checks", default=None)
    p.add_argument("--workdir", default=None)
    p.add_argument("--jobs", default=None, help="ARCH:QUANT[:check+check],...; 'all' = JOBS")
    p.add_argument("--parallel", type=int, default=min(2, os.cpu_count() or 1))
    a = p.parse_args(argv)
    # the jobs write ~3.4 GB of checkpoints per run: a directory of our own is removed at the end (a full /tmp
    # stops every later run on the machine)
    own = a.workdir is None
    workdir = a.workdir or tempfile.mkdtemp(prefix="trtllm-moe-models-")
    try:
        if a.jobs:
            jobs = JOBS if a.jobs == "all" else _parse_jobs(a.jobs)
            t = time.perf_counter()
            reports = run_jobs(jobs, max(1, a.parallel), workdir)
            reports["_total_seconds"] = round(time.perf_counter() - t, 2)
            print(json.dumps(reports, default=str))
            return 0
        report = Worker(a.arch, a.quant, workdir).run(a.checks.split(",") if a.checks else None)
        print(json.dumps(report, default=str))
        return 0
    finally:
        if own:
            shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
