"""The checker role: how SGLang's weight checker sees a format's parameters (compare and checksum).

checker.py reads only this role; every default holds for a dense weight with float block scales.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, ClassVar

import torch

from ..encodings import Encoding, grid_dequantize
from ..records import Layer, ParamLayout


class Checking:
    """Nothing required: the dequantization is the encoding's (`Encoding.grid`). MAY define: `scale_of`,
    `dequant_scales`, `dequantize_param` (a parameter the encoding's grid does not hold, e.g. gpt-oss' biases)."""

    # declared by formats/base.py Spec
    params: ClassVar[tuple[ParamLayout, ...]]
    encoding: Encoding
    if TYPE_CHECKING:

        def group_of(self, param_name: str) -> str | None: ...

    def scale_of(self, name: str) -> str | None:
        """The laid-out parameter holding `name`'s block scales (a `*scale*` parameter of its group), if any.

        The checker compares a weight and its block scales as one entry: a weight alone has no value, and
        SGLang's checker likewise consumes `*_weight_scale_inv` into its weight's comparison. Matches
        w13_weight -> w13_weight_scale(_inv), and compressed-tensors' w13_weight_packed -> w13_weight_scale."""
        if "scale" in name:
            return None
        group = self.group_of(name)
        cands = [p.name for p in self.params if p.group == group and p.name != name and "scale" in p.name]

        def common(a: str) -> int:
            return len(os.path.commonprefix([a, name]))

        return max(cands, key=common) if cands else None

    def dequant_scales(self, layer: Layer) -> dict[str, torch.Tensor]:
        """The per-tensor / global dequantization scales of the layer's checkpoint projections — "w1" (gate_proj),
        "w3" (up_proj), "w2" (down_proj) — one float32 per local expert: what multiplies `dequantize_param`'s values
        (block-scale units) to give the weight's values, as flashinfer's CPU dequantizer applies it ((value * block
        scale) * dequant scale). {} where the block scales are all there is (BF16, DeepSeek FP8 block, MX formats).
        Read by the weight checker's checksum (`checker.TrtllmMoeComparable.dequantize`)."""
        return {}

    def dequantize_param(
        self, name: str, weight: torch.Tensor, scale: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Checkpoint-layout `[E, M, K]` (+ its block scales) -> (float32 values, float32 per-element tolerance).

        The tolerance is one step of the quantization grid at each value (SGLang's `_quant_ulp` rule), so two
        quantizations of the same weight that differ by rounding stay within tolerance of each other. Values are in
        block-scale units: per-tensor / global scales are scalar parameters, compared bit for bit on their own.
        Default: the encoding's grid (`Encoding.grid`) for a weight with block scales, else a dense weight's.
        """
        if scale is None:
            return grid_dequantize(weight, None)
        return self.encoding.grid(weight, scale)
