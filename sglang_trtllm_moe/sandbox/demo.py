"""`sglang-trtllm-moe demo` (what `ci/demo` runs): the plugin's whole job on a whole SGLang model, on a CPU-only
machine, in a few minutes.

A tiny Qwen3-MoE NVFP4 checkpoint (ModelOpt layout, written here) is served by `sglang.Engine(device="cpu")` with
`--moe-runner-backend auto` on a faked SM100, and driven the way an RL framework drives a rollout engine: load and
generate, three RL rounds (a new checkpoint from disk; a whole checkpoint from tensors in buckets inside a
begin/end weight-update session; experts of every MoE layer as flattened buckets), a partial update from disk,
SGLang's weight checker (snapshot, reset, replay, compare), and a corrupted update caught by it. After every step
the served model is read back through the Engine (save_sharded_model) and compared byte for byte with a fresh load
of the intended checkpoint, and its greedy tokens with that fresh model's (SGLang's ModelRunner in a forked
process). The kernels are the plugin's emulator (SGLANG_TRTLLM_MOE_EMULATE=1): there is no Blackwell GPU here.

Each step prints a line with its time as it runs; a summary table ends the run; the exit code is 0 only when every
check passed. `--arch nemotron_h` runs the same loop on Nemotron-H NVFP4 (relu2 experts).
"""

from __future__ import annotations

import sys


def run(out=None, arch: str = "qwen3_moe", quant: str = "nvfp4", sglang_log: str | None = None) -> int:
    """`sglang_log`: where the Engine's own processes write (SGLang's log lines, and the traceback its weight checker
    prints when the corrupted update is caught); default `sglang-engine.log` in the current directory."""
    import os

    from . import engine, rl_loop

    out = out if out is not None else sys.stdout
    log = os.path.abspath(sglang_log or "sglang-engine.log")
    steps = rl_loop.Steps(out=out)
    steps.say(
        f'sglang-trtllm-moe demo: a whole {arch} {quant} model on sglang.Engine(device="cpu"), driven like an '
        f"RL rollout engine (emulated TRT-LLM-Gen kernels, faked SM100)\n"
        f"SGLang's own output (the Engine's scheduler and detokenizer): {log}"
    )
    try:
        rl_loop.rl_loop(arch, quant, steps=steps, sglang_log=log)
    except engine.EngineUnavailable as e:
        steps.check("sglang.Engine available", False, str(e))
    except Exception as e:  # noqa: BLE001 - a crash is a failed step with its reason, then the summary
        import traceback

        traceback.print_exc()
        steps.check("demo ran to the end", False, f"{type(e).__name__}: {str(e)[:400]}")
    code = steps.summary()
    if code:
        steps.say(f"SGLang's own output: {log}")
    return code


__all__ = ["run"]
