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

The contract is `Spec` below: what every format MUST declare (seven data members, two methods) and the few members
most formats MAY set; every other member of the roles is derived from these (the kernel family from the encoding,
the checker's dequantization from the encoding, the load rules from `params`) or has a default that holds for a
dense weight with float block scales, overridden only where a format differs (each role's docstring lists them).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from typing import ClassVar

import torch

from ..compat import defer
from .encodings import Encoding
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
from .roles import MUST, Checking, Kernel, Layout, Loading, Serving, missing, set_scalar_


class Spec(ABC):
    """What a weight format MUST declare and the few members most formats MAY set (the rest of `WeightFormat`'s
    members are its roles', derived from these or defaulted)."""

    REQUIRED: ClassVar[tuple[str, ...]] = (
        "name",
        "title",
        "quantizations",
        "encoding",
        "params",
        "hook_module",
        "upstream_verdicts",
    )

    # ---- MUST ------------------------------------------------------------------------------------------------------
    # name, title and quantizations are plain attributes, not ClassVars: one class may serve several formats, set
    # per instance (Fp8PerTensor)
    #: MUST: the format's unique name (reports, `formats.by_name`, capability groups)
    name: str = MUST
    #: MUST: a sentence naming the format in reports: "NVFP4 (modelopt_fp4)"
    title: str = MUST
    #: MUST: {runner backend: the SGLang quantization names} this format serves (`records.BACKENDS`, or its own
    #: `own_backend`)
    quantizations: Mapping[str, frozenset] = MUST
    #: MUST: how its experts are stored (`encodings.Encoding`): the kernel family that consumes them (`kernel`), the
    #: checker's dequantization (`dequantize_param`), the sandbox's checkpoint writers
    encoding: Encoding = MUST
    #: MUST: a `ParamLayout` per laid-out parameter (group, row permutation, scale swizzle or block-major K)
    params: ClassVar[tuple[ParamLayout, ...]] = MUST
    #: MUST: the built-in module whose hooks on SGLang's quant method take such layers over (registered like an
    #: extension: `plugin.builtin_modules()`); formats of one SGLang quant-method family share one
    hook_module: ClassVar[str] = MUST
    #: MUST, declared by the format's own class: whether SGLang's own preparation and reload are right for it, one
    #: `compat.defer.Verdict` per release range (compat/'s named boundaries, no two on one release; measured by
    #: tests/support/upstream_rl.py, re-measured per release by tests/test_defer.py)
    upstream_verdicts: tuple[defer.Verdict, ...] = MUST

    @abstractmethod
    def describes(self, checkpoint: Checkpoint) -> bool:
        """MUST: True when a checkpoint of this kind is held in this format on the TRT-LLM-Gen path."""

    @abstractmethod
    def kernel_args(self, call: KernelCall, routing: dict, routed: bool) -> dict:
        """MUST: every argument of `trtllm_<kernel>[_routed]_moe` except `activation_type` and `do_finalize` (the
        runner's), given the routing arguments (which a format may adjust)."""

    # ---- MAY (what most formats set; every other override is listed in its role's docstring) -----------------------
    #: MAY: what the kernel family computes gated for this format on every flashinfer the supported releases pin
    #: (names of `kernel_api.GATED`; default SwiGLU only)
    gated_activations: ClassVar[frozenset[str]] = frozenset({"silu"})
    #: MAY: the same non-gated (`kernel_api.NON_GATED`; default none)
    non_gated_activations: ClassVar[frozenset[str]] = frozenset()
    #: MAY: (gated, non-gated) per-rank intermediate alignment as SGLang allocates the layer (default 128: FusedMoE's
    #: rounding on the trtllm path; a multiple of `layouts.GATED_ALIGN` / `NON_GATED_ALIGN`)
    intermediate_align: ClassVar[tuple[int, int]] = (128, 128)
    #: MAY: kernel scalars recomputed from the parameters at every flush (`compute_scalars`)
    scalar_params: ClassVar[tuple[str, ...]] = ()

    def compute_scalars(self, layer: Layer) -> dict[str, torch.Tensor]:
        """MAY: the kernel scalars (`scalar_params`' values and any of the format's own) from the layer's
        parameters, set in place at every flush (`set_scalar_`)."""
        return {}


class WeightFormat(Spec, Serving, Layout, Loading, Kernel, Checking):
    """Base of every format: `Spec`'s MUST / MAY members and the five roles (each role's docstring lists what else
    a format MAY override). How the CPU sandbox builds a layer or a tiny checkpoint of a format is the sandbox's own
    table, keyed by the format's name (`sglang_trtllm_moe/sandbox/format_examples.py`): nothing here serves only
    tests."""

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
    "Spec",
    "WeightFormat",
    "check_complete",
    "set_scalar_",
]
