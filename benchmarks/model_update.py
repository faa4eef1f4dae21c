"""What the plugin adds to an RL weight update of a whole model, through SGLang's own update entry points (CPU, real
SGLang 0.5.21+): a DeepSeek-V3-architecture model in NVFP4 and in 128x128 block FP8, updated from tensor buckets in a
begin/end session and from disk, with the plugin as shipped, with its checks bypassed, and (where that stays exact)
with its loader hooks unwrapped — interleaved in one process per format. The code, and exactly what each mode
replaces: `sglang_trtllm_moe/sandbox/bench_update.py` (`sglang-trtllm-moe bench` shows the same rows at small sizes).

    PYTHONPATH=. <venv>/bin/python benchmarks/model_update.py [--tiny] [--quant nvfp4 --quant fp8_block]
        [--size default|small|tiny] [--experts 256] [--hidden 2048] [--intermediate 512] [--repeats 5]
        [--bucket-mib 256] [--flows tensor,disk] [--sglang-threads] [--profile-top N] [--out FILE]

Prints one JSON line: {"reports": [one per format: timings per flow and mode (wall and CPU seconds, min / median,
layout work / entry-point checks / loader checks on their own), overheads, and the counts of one update]}.
--tiny: NVFP4 only (unless --quant is given), 8 experts, H 256, one repeat — a smoke run.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # this checkout's package first

from sglang_trtllm_moe.sandbox import bench_update  # noqa: E402

if __name__ == "__main__":
    raise SystemExit(bench_update.main())
