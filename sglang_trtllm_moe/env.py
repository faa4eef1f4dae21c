"""The one reader of the plugin's boolean environment switches (SGLANG_TRTLLM_MOE_DISABLE, _AUTO, _EMULATE, ...).

Imports nothing but `os`: `plugin.register()` reads SGLANG_TRTLLM_MOE_DISABLE before anything else is imported.
"""

from __future__ import annotations

import os

#: run the PyTorch emulator instead of the TRT-LLM-Gen kernels (any device; the runner and the selection ask it)
ENV_EMULATE = "SGLANG_TRTLLM_MOE_EMULATE"

TRUE = ("1", "true", "yes", "on")
FALSE = ("0", "false", "no", "off")


def flag(name: str, default: bool = False) -> bool:
    """The boolean switch `name`: True for 1 / true / yes / on, False for 0 / false / no / off (any case, spaces
    ignored); `default` when it is unset, empty or anything else."""
    value = os.environ.get(name, "").strip().lower()
    if value in TRUE:
        return True
    if value in FALSE:
        return False
    return default


def emulating() -> bool:
    """SGLANG_TRTLLM_MOE_EMULATE=1: the emulator runs in place of the kernels."""
    return flag(ENV_EMULATE)


__all__ = ["ENV_EMULATE", "FALSE", "TRUE", "emulating", "flag"]
