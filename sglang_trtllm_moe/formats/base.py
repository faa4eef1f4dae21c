"""What every weight format is: the five roles it plays, each saying what a format MUST and MAY define.

A format is the one place for everything the plugin knows about a weight format: what it serves (`roles.serving`:
the quantization names SGLang gives such checkpoints, per runner backend; activations per gating; alignment), how
its parameters are laid out for the kernel and prepared in place per expert with exact inverses, and its kernel
scalars (`roles.layout`), what an RL update may write into them (`roles.loading`), the arguments of its kernel family
(`roles.kernel`) and how the weight checker dequantizes it (`roles.checker`). Selection, explain, the hooks and the
runner derive from the registry (`formats/__init__.py`); no format name appears outside `formats/`.

Split by role so that each caller reads one role and a new format sees, role by role, what it must provide: the
required methods are abstract (a format lacking one cannot be instantiated) and the required data members default
to `roles.MUST` (the registry refuses a format that leaves one unset, naming it: `roles.missing`).
"""

from __future__ import annotations

from ..compat import defer
from .records import (
    BACKENDS,
    SUPPORTED,
    TRTLLM,
    TRTLLM_ROUTED,
    Checkpoint,
    KernelCall,
    Layer,
    ParamLayout,
    Support,
)
from .roles import Checking, Kernel, Layout, Loading, Serving, missing, set_scalar_


class WeightFormat(Serving, Layout, Loading, Kernel, Checking):
    """Base of every format: all five roles (see each role's docstring for its MUST / MAY members). How the CPU
    sandbox builds a layer or a tiny checkpoint of a format is the sandbox's own table, keyed by the format's name
    (`sglang_trtllm_moe/sandbox/format_examples.py`): nothing here serves only tests."""

    def __repr__(self) -> str:
        return f"<weight format {self.name}>"


def check_complete(fmt: WeightFormat) -> None:
    """Refuse a registered format that leaves a required member of a role unset (see `roles.missing`), or whose
    defer verdicts disagree with themselves (two on one release: which one holds would depend on their order)."""
    unset = missing(fmt)
    if unset:
        raise TypeError(f"weight format {type(fmt).__name__} ({fmt.name}) does not define: {', '.join(unset)}")
    both = defer.overlap(fmt)
    if both is not None:
        raise TypeError(f"weight format {fmt.name}: two of its upstream_verdicts hold on SGLang {both}")


__all__ = [
    "BACKENDS",
    "SUPPORTED",
    "TRTLLM",
    "TRTLLM_ROUTED",
    "Checkpoint",
    "KernelCall",
    "Layer",
    "ParamLayout",
    "Support",
    "WeightFormat",
    "check_complete",
    "set_scalar_",
]
