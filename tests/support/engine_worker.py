"""The whole-model RL loop on sglang.Engine(device="cpu") for each asked model, one after the other in this
process (each Engine spawns and shuts down its own scheduler and detokenizer), printing one JSON report:
{"ARCH:QUANT": [step, ...]} with each step {"step", "ok", "detail", "seconds", ...}. tests/test_engine.py asserts it.

    python -m tests.support.engine_worker qwen3_moe:nvfp4,nemotron_h:nvfp4
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import traceback

os.environ.setdefault("OMP_NUM_THREADS", os.environ.get("SGLANG_TRTLLM_MOE_TEST_THREADS", "1"))


def main(argv=None) -> int:
    from sglang_trtllm_moe.sandbox import rl_loop

    argv = sys.argv[1:] if argv is None else argv
    jobs = [tuple(j.split(":")) for j in argv[0].split(",")]
    out: dict = {}
    for i, (arch, quant) in enumerate(jobs):
        steps = rl_loop.Steps(out=sys.stderr)
        try:
            rl_loop.rl_loop(arch, quant, steps=steps, workdir=tempfile.mkdtemp(prefix=f"engine-{arch}-"), doctor=i == 0)
        except Exception as e:  # noqa: BLE001 - reported as a failed step
            steps.check("loop", False, f"{type(e).__name__}: {str(e)[:500]}", traceback=traceback.format_exc()[-3000:])
        out[f"{arch}:{quant}"] = steps.checks
    print(json.dumps(out, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
