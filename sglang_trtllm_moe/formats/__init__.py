"""The format registry: one module per weight format, each declaring what it serves and how it is laid out.

Like vLLM's per-quantization "oracle" modules: every rule of a format lives in its file (`base.WeightFormat` says
what each MUST and MAY define), and selection, explain, the quant-method hooks and the runner ask the registry —
the generic machinery (`layer_state`, `runner`, `selection`) never asks "which format is this?".
"""

from __future__ import annotations

from .base import BACKENDS, TRTLLM, TRTLLM_ROUTED, Checkpoint, KernelCall, ParamLayout, WeightFormat
from .bf16 import BF16
from .ct_nvfp4 import CT_NVFP4
from .fp8_block import FP8_BLOCK
from .fp8_tensor import FP8_TENSOR, FP8_TENSOR_MODELOPT
from .mxfp4_experts import MXFP4_EXPERTS
from .mxfp4_gptoss import MXFP4_GPTOSS
from .mxfp8 import MXFP8
from .nvfp4 import NVFP4

#: every format the plugin prepares, in the order a checkpoint is matched against them
FORMATS: tuple[WeightFormat, ...] = (
    NVFP4,
    CT_NVFP4,
    FP8_TENSOR_MODELOPT,
    FP8_TENSOR,
    MXFP4_EXPERTS,
    FP8_BLOCK,
    MXFP8,
    MXFP4_GPTOSS,
    BF16,
)


def by_name(name: str) -> WeightFormat:
    for f in FORMATS:
        if f.name == name:
            return f
    raise KeyError(f"no weight format {name!r}; known: {[f.name for f in FORMATS]}")


def prepared_on(fmt: WeightFormat) -> tuple[str, ...]:
    """The runner backends on which the plugin prepares `fmt` in place (the TRT-LLM-Gen ones SGLang serves it on)."""
    return tuple(fmt.quantizations)


def for_checkpoint(checkpoint: Checkpoint) -> tuple[WeightFormat | None, str]:
    """(the format holding such a checkpoint's experts on the TRT-LLM-Gen path, its title) — or (None, why not)."""
    for f in FORMATS:
        if f.describes(checkpoint):
            return f, f.title
    q = checkpoint.quantization
    if q == "mxfp8" and checkpoint.online:
        return None, (
            "online MXFP8 (--quantization mxfp8 on a BF16 checkpoint): SGLang quantizes at load time and "
            "rebinds the Parameters to fp8, so the plugin leaves the layer to SGLang's own preparation"
        )
    if q == "compressed-tensors":
        return None, f"compressed-tensors scheme {checkpoint.quant_scheme or 'unknown'!r} is not NVFP4"
    if q == "fp8":
        if checkpoint.weight_block_size is not None:
            return None, f"fp8 with weight_block_size {list(checkpoint.weight_block_size)} (only [128, 128] is served)"
        return None, (
            f"fp8 per-tensor with {checkpoint.activation_scheme or 'unstated'} activation scales: the "
            "TRT-LLM per-tensor kernel takes one static input scale"
        )
    return None, f"quantization {q!r} is not a format the plugin prepares"


__all__ = [
    "BACKENDS",
    "TRTLLM",
    "TRTLLM_ROUTED",
    "Checkpoint",
    "KernelCall",
    "ParamLayout",
    "WeightFormat",
    "FORMATS",
    "by_name",
    "for_checkpoint",
    "prepared_on",
    "NVFP4",
    "CT_NVFP4",
    "FP8_TENSOR",
    "FP8_TENSOR_MODELOPT",
    "FP8_BLOCK",
    "MXFP8",
    "MXFP4_EXPERTS",
    "MXFP4_GPTOSS",
    "BF16",
]
