"""The errors the plugin raises into SGLang, each naming the layer, the problem and the fix (README: Troubleshooting).

No torch or SGLang import here: `from sglang_trtllm_moe import TrtllmLayerError` stays cheap.
"""


class TrtllmLayerError(ValueError):
    """A layer explicitly put on flashinfer_trtllm that the TRT-LLM-Gen kernels cannot serve."""


class WeightUpdateRefused(ValueError):
    """A weight update refused before a byte changed (wrong shard id, expert id, dtype, shape, device, scale)."""


class WeightPrepError(RuntimeError):
    """Preparing a layer's weights failed; the message names the layer and what is left to do."""


class KernelUnavailableError(RuntimeError):
    """No TRT-LLM-Gen kernel on this device (not SM 10.x) and the emulator was not asked for."""


__all__ = ["TrtllmLayerError", "WeightUpdateRefused", "WeightPrepError", "KernelUnavailableError"]
