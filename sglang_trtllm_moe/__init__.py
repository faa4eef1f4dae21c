"""sglang-trtllm-moe: FlashInfer TRT-LLM-Gen fused MoE for SGLang on Blackwell, as an out-of-tree plugin.

The import is kept cheap (no torch, no sglang): SGLang imports this package in every process through its
`sglang.srt.plugins` entry point, and most processes never touch an MoE layer.
"""

import pluggy

from .errors import KernelUnavailableError, TrtllmLayerError, WeightPrepError, WeightUpdateRefused

__version__ = "0.1.0"

PROJECT_NAME = "sglang_trtllm_moe"

#: Marker for implementations of the plugin's own hook specifications (see `hookspecs`).
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)

__all__ = [
    "__version__",
    "PROJECT_NAME",
    "hookimpl",
    "TrtllmLayerError",
    "WeightUpdateRefused",
    "WeightPrepError",
    "KernelUnavailableError",
]
