"""The start-up cost the plugin adds to an SGLang process: `load_plugins()` with the plugin and with
SGLANG_TRTLLM_MOE_DISABLE=1, in fresh processes (a row of `sglang-trtllm-moe bench`; docs/PERFORMANCE.md).

Why fresh processes alternated A/B: what is measured is imports, which a warm process has already paid; CPU time of
the process (not wall) so that other work on a shared box does not count.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys

#: what each SGLang process has imported before it calls load_plugins(): the launcher (`sglang serve`,
#: `python -m sglang.launch_server`) has `sglang.launch_server`; a scheduler then builds the model, which imports
#: the MoE layer, the quant methods and the weight-update components (the modules the plugin hooks)
_PROCESS_KINDS = {
    "launcher": ("import sglang.launch_server", ""),
    "scheduler": (
        "import sglang.launch_server",
        "import importlib\n"
        "for m in ('sglang.srt.layers.quantization.fp8', 'sglang.srt.layers.moe.fused_moe_triton.layer',\n"
        "          'sglang.srt.layers.quantization.modelopt_quant', 'sglang.srt.layers.quantization.unquant',\n"
        "          'sglang.srt.utils.weight_checker', 'sglang.srt.layers.moe.moe_runner.flashinfer_trtllm'):\n"
        "    importlib.import_module(m)\n",
    ),
}

_MEASURE = """
import json, resource, time
{before}
r0 = resource.getrusage(resource.RUSAGE_SELF)
from sglang.srt.plugins import load_plugins
load_plugins()
{after}
r1 = resource.getrusage(resource.RUSAGE_SELF)
print(json.dumps({{"cpu_s": (r1.ru_utime + r1.ru_stime) - (r0.ru_utime + r0.ru_stime),
                  "peak_rss_added_mib": (r1.ru_maxrss - r0.ru_maxrss) / 1024}}))
"""


def bench_load_plugins(repeats: int = 3) -> list[dict]:
    """CPU time and peak RSS that `load_plugins()` (and, for a scheduler, the model's own imports after it) add to
    a process, with the plugin and with SGLANG_TRTLLM_MOE_DISABLE=1, in fresh processes alternated A/B."""

    def once(kind: str, disabled: bool) -> dict:
        env = dict(os.environ)
        env.pop("SGLANG_TRTLLM_MOE_DISABLE", None)
        if disabled:
            env["SGLANG_TRTLLM_MOE_DISABLE"] = "1"
        before, after = _PROCESS_KINDS[kind]
        code = _MEASURE.format(before=before, after=after)
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
        return json.loads(out.stdout.strip().splitlines()[-1])

    rows = []
    for kind in _PROCESS_KINDS:
        runs: dict[bool, list[dict]] = {False: [], True: []}
        for _ in range(repeats):
            for disabled in (False, True):
                runs[disabled].append(once(kind, disabled))
        med = {d: {k: statistics.median(r[k] for r in runs[d]) for k in ("cpu_s", "peak_rss_added_mib")} for d in runs}
        rows.append(
            dict(
                name=f"SGLang load_plugins() in a {kind}-like process (plugin vs SGLANG_TRTLLM_MOE_DISABLE=1; CPU s)",
                plugin_s=med[False]["cpu_s"],
                upstream_s=med[True]["cpu_s"],
                ratio=med[True]["cpu_s"] / max(med[False]["cpu_s"], 1e-9),
                added_s=med[False]["cpu_s"] - med[True]["cpu_s"],
                added_peak_rss_mib=med[False]["peak_rss_added_mib"] - med[True]["peak_rss_added_mib"],
                repeats=repeats,
            )
        )
    return rows
