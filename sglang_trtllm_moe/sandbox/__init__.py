"""The CPU sandbox: SGLang stood up on a machine without a GPU, serving through the plugin's path (a faked SM100,
the PyTorch emulator in place of the TRT-LLM-Gen kernels), with tiny real checkpoints to serve.

Optional and never imported by `register()` (a test asserts it): nothing here runs in a server process.

What users may call is `__all__` (README "Try it on a CPU"): tiny checkpoints of SGLang's MoE model classes
(`TinySpec`, `checkpoint` — the tensors —, `write` — a model directory; `sglang-trtllm-moe tiny-checkpoint` writes
the same), and `TinyEngine`, `sglang.Engine(device="cpu")` on such a checkpoint through the Engine's public API
(`EngineUnavailable` when this release or environment cannot run it: releases.py ENGINE_RELEASES).
The modules behind them and the rest (`runtime`, `layers`, `models`, `demo`, `bench*`, `rl_loop`, ...) serve the
demo, the benchmarks and the tests; they promise nothing to users. The names load on first use: importing the
package imports neither torch nor SGLang.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .checkpoints import TinySpec, checkpoint, write
    from .engine import EngineUnavailable, TinyEngine

__all__ = ["EngineUnavailable", "TinyEngine", "TinySpec", "checkpoint", "write"]

_HOMES = {
    "TinySpec": "checkpoints",
    "checkpoint": "checkpoints",
    "write": "checkpoints",
    "EngineUnavailable": "engine",
    "TinyEngine": "engine",
}


def __getattr__(name: str) -> Any:
    if name not in _HOMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(f"{__name__}.{_HOMES[name]}"), name)
