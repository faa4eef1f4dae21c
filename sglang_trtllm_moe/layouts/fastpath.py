"""The CUDA fast path: one-pass Triton kernels for the in-place transforms, chosen per call, same bytes as the
pure-torch reference (`set_fast_path(False)` forces the reference)."""

from __future__ import annotations

from types import ModuleType

import torch

from .maps import CACHE_LOCK

FAST_PATH = {"enabled": True, "cpu_interpret": False}
_TRITON: list[ModuleType | None] = []  # [module or None] once tried


def set_fast_path(enabled: bool) -> bool:
    """Turn the Triton kernels on CUDA on or off (off: the pure-torch reference everywhere); returns the old value."""
    old = FAST_PATH["enabled"]
    FAST_PATH["enabled"] = bool(enabled)
    return old


def triton_layouts() -> ModuleType | None:
    with CACHE_LOCK:
        if not _TRITON:
            mod: ModuleType | None
            try:
                from . import _triton

                mod = _triton
            except Exception:  # no triton, or a triton that cannot build here: the torch path serves
                mod = None
            _TRITON.append(mod)
        return _TRITON[0]


def fast_path_for(t: torch.Tensor, word_bytes: int = 4) -> ModuleType | None:
    """The Triton module when `t` (its uint8 [E, M, C] view) can take the one-pass kernels, which move words of
    `word_bytes` (4: int32; 8: int64, the 4-scale words of 2-byte scales), else None."""
    if not FAST_PATH["enabled"]:
        return None
    if t.device.type != "cuda" and not (t.device.type == "cpu" and FAST_PATH["cpu_interpret"]):
        return None
    if t.dim() != 3 or t.shape[2] % word_bytes or t.data_ptr() % word_bytes:
        return None
    return triton_layouts()
