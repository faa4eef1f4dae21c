"""The sandbox's commands on the `sglang-trtllm-moe` command line (`demo`, `bench`, `tiny-checkpoint`), added through
the plugin's `register_commands` hookspec (extension.py) as any extension adds its own. Each says what it needs
installed before anything starts. Importing this module imports neither torch nor SGLang: every other command of the
command line starts without them.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

#: what each sandbox command imports that the plugin itself does not need: (module, pip package)
NEEDS = {
    "demo": (("sglang", "sglang"), ("transformers", "transformers"), ("safetensors", "safetensors")),
    "tiny-checkpoint": (("torch", "torch"), ("safetensors", "safetensors"), ("tokenizers", "tokenizers")),
}


def missing_requirements(command: str) -> str | None:
    """One line saying what to install when `command` cannot run here (a module of NEEDS not importable), else None:
    said before anything starts, instead of a traceback halfway through."""
    import importlib.util

    def absent(module: str) -> bool:
        try:
            return importlib.util.find_spec(module) is None
        except (ImportError, ValueError):
            return True

    gone = [pkg for module, pkg in NEEDS[command] if absent(module)]
    if not gone:
        return None
    also = ", or run it in the CPU environment `ci/make-env` builds (`ci/demo` does both)" if command == "demo" else ""
    need = f"sglang-trtllm-moe {command} needs {', '.join(gone)}, not installed here"
    return f"{need}: pip install {' '.join(gone)}{also}"


def _cmd_demo(args) -> int:
    if (why := missing_requirements("demo")) is not None:
        print(why, file=sys.stderr)
        return 2
    from . import demo

    return demo.run(arch=args.arch, quant=args.quant)


def _cmd_bench(args) -> int:
    from . import bench

    return bench.main(args)


def _cmd_tiny_checkpoint(args) -> int:
    if (why := missing_requirements("tiny-checkpoint")) is not None:
        print(why, file=sys.stderr)
        return 2
    from . import checkpoints

    return checkpoints.main(args)


_TINY_ARCHS, _TINY_QUANTS = "{tiny archs}", "{tiny quants}"


class _TinyCheckpointHelp(argparse.HelpFormatter):
    """`tiny-checkpoint --help` lists the architectures and quants the sandbox derives from the format registry
    (tiny_spec.py): read when that help is printed, since the registry imports torch and every other command starts
    without it."""

    def _get_help_string(self, action):
        text = super()._get_help_string(action) or ""
        if text in (_TINY_ARCHS, _TINY_QUANTS):
            from . import tiny_spec

            text = " | ".join(tiny_spec.ARCHS) if text == _TINY_ARCHS else tiny_spec.quants_help()
        return text


def add_commands(sub: Any) -> None:
    """`demo`, `bench` and `tiny-checkpoint` on the command line's subparsers."""
    m = sub.add_parser(
        "demo", help='the whole-model RL loop on sglang.Engine(device="cpu"), on this CPU (a few minutes)'
    )
    m.add_argument("--arch", default="qwen3_moe", help="qwen3_moe | nemotron_h | deepseek_v3 (tiny NVFP4 model)")
    m.add_argument("--quant", default="nvfp4", help=argparse.SUPPRESS)
    m.set_defaults(func=_cmd_demo)
    b = sub.add_parser(
        "bench", help="prep and RL-update time vs SGLang's own code in the same run; load_plugins() cost"
    )
    b.add_argument("--json", action="store_true", help="a list of rows with name, plugin_s, upstream_s, ratio, ...")
    b.add_argument("--experts", type=int, default=32, help="experts per layer (scaled down from the real model)")
    b.add_argument("--repeats", type=int, default=3)
    b.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    b.set_defaults(func=_cmd_bench)
    t = sub.add_parser(
        "tiny-checkpoint",
        help="write a tiny random, calibrated checkpoint of an SGLang MoE model "
        "(config.json, safetensors, quant config, tokenizer)",
        formatter_class=_TinyCheckpointHelp,
    )
    t.add_argument("--arch", required=True, help=_TINY_ARCHS)
    t.add_argument("--quant", required=True, help=_TINY_QUANTS)
    t.add_argument("--out", required=True, help="model directory to write")
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--layers", default=None, help="only these MoE layers' experts, e.g. 1,2 (partial checkpoint)")
    t.add_argument("--experts", default=None, help="only these experts, e.g. 0,3 (partial checkpoint)")
    t.add_argument("--experts-only", action="store_true", help="leave out every non-expert tensor")
    t.add_argument("--reference", action="store_true", help="also write OUT-reference: float32, experts dequantized")
    t.add_argument("--force", action="store_true", help="write a combination SGLang does not build with FusedMoE")
    t.set_defaults(func=_cmd_tiny_checkpoint)


__all__ = ["NEEDS", "add_commands", "missing_requirements"]
