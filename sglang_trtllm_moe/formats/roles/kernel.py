"""The kernel role: which TRT-LLM-Gen entry-point family runs a format, and the arguments of one call.

The runner reads only this role (and `formats.sglang_prepared`); the arguments' names and order are the entry
points' own (`kernel_api`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

from ..records import KernelCall

if TYPE_CHECKING:
    from ..encodings import Encoding


class Kernel:
    """Its MUST member is `Spec`'s (formats/base.py) `kernel_args`; the kernel family (`kernel`,
    `kernel_api.FAMILIES`) is the encoding's (`Encoding.kernel`).

    MAY define: `accepts_prequantized`, `routes_in_kernel`, `routing_method` (where the layer's routing method is
    kept)."""

    # declared by formats/base.py Spec
    encoding: Encoding
    #: the runner may hand `kernel_args` activations the dispatcher already quantized (KernelCall.hidden_scale)
    accepts_prequantized: ClassVar[bool] = False

    @property
    def kernel(self) -> str:
        """The flashinfer kernel family that runs this format: its encoding's."""
        return self.encoding.kernel

    def routes_in_kernel(self, call: KernelCall) -> bool:
        """True when SGLang's own call of this format routes bypassed logits in the kernel whatever the layer
        declares (gpt-oss: Renormalize); False: the runner asks the layer (runner.routing_declared)."""
        return False

    def routing_method(self, call: KernelCall) -> int | None:
        """The layer's routing method (SGLang's QuantInfo carries it for the quantized leaves)."""
        return call.quant_info.routing_method_type
