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

from typing import ClassVar

from .records import (
    BACKENDS,
    SUPPORTED,
    TRTLLM,
    TRTLLM_ROUTED,
    Checkpoint,
    Example,
    KernelCall,
    Layer,
    ParamLayout,
    Support,
)
from .roles import MUST, Checking, Kernel, Layout, Loading, Serving, missing, set_scalar_


class WeightFormat(Serving, Layout, Loading, Kernel, Checking):
    """Base of every format: all five roles (see each role's docstring for its MUST / MAY members), and MUST
    define `example`: a layer of the format as SGLang builds it from a checkpoint (`records.Example`), from which
    the CPU harness and the tests derive their kinds."""

    REQUIRED: ClassVar[tuple[str, ...]] = ("example",)
    example: Example = MUST

    def __repr__(self) -> str:
        return f"<weight format {self.name}>"


def check_complete(fmt: WeightFormat) -> None:
    """Refuse a registered format that leaves a required member of a role unset (see `roles.missing`)."""
    unset = missing(fmt)
    if unset:
        raise TypeError(f"weight format {type(fmt).__name__} ({fmt.name}) does not define: {', '.join(unset)}")


__all__ = [
    "BACKENDS",
    "SUPPORTED",
    "TRTLLM",
    "TRTLLM_ROUTED",
    "Checkpoint",
    "Example",
    "KernelCall",
    "Layer",
    "ParamLayout",
    "Support",
    "WeightFormat",
    "check_complete",
    "set_scalar_",
]
