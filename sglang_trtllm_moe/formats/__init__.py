"""One module per weight format: which parameters it has, how each is laid out for the kernel, its scalars.

Like vLLM's per-quant "oracle" modules: every rule of a format lives in its file, and the generic machinery
(`base.py`, `weights.py`) never asks "which format is this?".
"""

from .base import ParamLayout, WeightFormat

__all__ = ["ParamLayout", "WeightFormat"]
