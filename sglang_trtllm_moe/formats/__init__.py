"""The format registry: one module per weight format, each declaring what it serves and how it is laid out.

Like vLLM's per-quantization "oracle" modules: every rule of a format lives in its file (`base.WeightFormat` says
what each MUST and MAY define), and selection, explain, the quant-method hooks and the runner ask the registry —
the generic machinery (`layer_state`, `runner`, `selection`) never asks "which format is this?".
"""

from __future__ import annotations

from .base import (
    BACKENDS,
    SUPPORTED,
    TRTLLM,
    TRTLLM_ROUTED,
    Checkpoint,
    KernelCall,
    ParamLayout,
    Support,
    WeightFormat,
    check_complete,
)
from .bf16 import BF16
from .ct_int4 import CT_INT4
from .ct_nvfp4 import CT_NVFP4
from .fp8_block import FP8_BLOCK
from .fp8_tensor import FP8_TENSOR, FP8_TENSOR_MODELOPT
from .mxfp4_experts import MXFP4_EXPERTS
from .mxfp4_gptoss import MXFP4_GPTOSS
from .mxfp8 import MXFP8
from .nvfp4 import NVFP4
from .nvfp4_online import NVFP4_ONLINE, NVFP4_ONLINE_TENSOR

#: every format the plugin prepares, in the order a checkpoint is matched against them
FORMATS: tuple[WeightFormat, ...] = (
    NVFP4,
    NVFP4_ONLINE,
    NVFP4_ONLINE_TENSOR,
    CT_INT4,
    CT_NVFP4,
    FP8_TENSOR_MODELOPT,
    FP8_TENSOR,
    MXFP4_EXPERTS,
    FP8_BLOCK,
    MXFP8,
    MXFP4_GPTOSS,
    BF16,
)
for _fmt in FORMATS:
    check_complete(_fmt)


def by_name(name: str) -> WeightFormat:
    for f in FORMATS:
        if f.name == name:
            return f
    raise KeyError(f"no weight format {name!r}; known: {[f.name for f in FORMATS]}")


#: SGLang's fused-MoE leaf -> the format whose layout a layer SGLang prepared itself holds (WeightFormat.sglang_leaf)
SGLANG_PREPARED: dict[str, WeightFormat] = {f.sglang_leaf: f for f in FORMATS if f.sglang_leaf is not None}
if len(SGLANG_PREPARED) != sum(f.sglang_leaf is not None for f in FORMATS):
    raise AssertionError(f"two formats claim one SGLang leaf: {[(f.name, f.sglang_leaf) for f in FORMATS]}")


def sglang_prepared(leaf: str) -> WeightFormat | None:
    """The format a layer SGLang prepared itself holds on its fused-MoE `leaf`, or None (SGLang's own layout)."""
    return SGLANG_PREPARED.get(leaf)


def prepared_on(fmt: WeightFormat) -> tuple[str, ...]:
    """The runner backends on which the plugin prepares `fmt` in place (the TRT-LLM-Gen ones SGLang serves it on)."""
    return tuple(fmt.quantizations)


def for_checkpoint(checkpoint: Checkpoint) -> tuple[WeightFormat | None, str]:
    """(the format holding such a checkpoint's experts on the TRT-LLM-Gen path, its title) — or (None, why not)."""
    for f in FORMATS:
        if f.describes(checkpoint):
            return f, f.title
    for f in FORMATS:
        why = f.refusal(checkpoint)
        if why is not None:
            return None, why
    return None, f"quantization {checkpoint.quantization!r} is not a format the plugin prepares"


__all__ = [
    "BACKENDS",
    "TRTLLM",
    "TRTLLM_ROUTED",
    "Checkpoint",
    "KernelCall",
    "ParamLayout",
    "SUPPORTED",
    "Support",
    "WeightFormat",
    "FORMATS",
    "SGLANG_PREPARED",
    "by_name",
    "for_checkpoint",
    "prepared_on",
    "sglang_prepared",
    "NVFP4",
    "NVFP4_ONLINE",
    "NVFP4_ONLINE_TENSOR",
    "CT_INT4",
    "CT_NVFP4",
    "FP8_TENSOR",
    "FP8_TENSOR_MODELOPT",
    "FP8_BLOCK",
    "MXFP8",
    "MXFP4_EXPERTS",
    "MXFP4_GPTOSS",
    "BF16",
]
