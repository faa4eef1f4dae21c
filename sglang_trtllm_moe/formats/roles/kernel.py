"""The kernel role: which TRT-LLM-Gen entry-point family runs a format, and the arguments of one call.

The runner reads only this role (and `formats.sglang_prepared`); the arguments' names and order are the entry
points' own (`kernel_api`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar

from ..records import KernelCall
from .required import MUST


class Kernel(ABC):
    """MUST define: `kernel` (the flashinfer kernel family, `kernel_api.FAMILIES`) and `kernel_args`.

    MAY define: `accepts_prequantized`, `routes_in_kernel`, `routing_method` (where the layer's routing method is
    kept)."""

    REQUIRED: ClassVar[tuple[str, ...]] = ("kernel",)

    kernel: ClassVar[str] = MUST
    #: the runner may hand `kernel_args` activations the dispatcher already quantized (KernelCall.hidden_scale)
    accepts_prequantized: ClassVar[bool] = False

    def routes_in_kernel(self, call: KernelCall) -> bool:
        """True when SGLang's own call of this format routes bypassed logits in the kernel whatever the layer
        declares (gpt-oss: Renormalize); False: the runner asks the layer (runner.routing_declared)."""
        return False

    def routing_method(self, call: KernelCall) -> int | None:
        """The layer's routing method (SGLang's QuantInfo carries it for the quantized leaves)."""
        return call.quant_info.routing_method_type

    @abstractmethod
    def kernel_args(self, call: KernelCall, routing: dict, routed: bool) -> dict:
        """Every argument of `trtllm_<kernel>[_routed]_moe` except `activation_type` and `do_finalize` (the runner's),
        given the routing arguments (which a format may adjust)."""
