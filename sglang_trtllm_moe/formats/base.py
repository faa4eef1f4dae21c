"""What every weight format shares: per-parameter layout rules applied in place, per group of experts.

A format declares its parameters as `ParamLayout`s. Parameters of one `group` ("w13" or "w2") share a row map
and are prepared / un-prepared together for an expert: the gated row interleave mixes the w1 and w3 halves, so
a loader writing one half of one expert must first return the whole group of that expert to checkpoint layout.
Everything else (scalars, input scales) is recomputed from the parameters after every flush.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import ClassVar

import torch

from .. import layouts


@dataclass(frozen=True)
class ParamLayout:
    name: str
    #: "w13" | "w2": which row map (and which group of prepared state)
    group: str
    #: 128x4 scale-factor swizzle after the row permutation (NVFP4 / MXFP8 block scales)
    sf_swizzle: bool = False
    #: BlockMajorK after the row permutation (BF16), in place: shape stays [E, M, K]
    block_major_k: bool = False
    #: some formats (DeepSeek FP8 block) keep checkpoint row order
    permute_rows: bool = True


class WeightFormat:
    """Base class; subclasses set `name` and `params` and implement the scalar rules."""

    name: ClassVar[str] = "base"
    params: ClassVar[tuple[ParamLayout, ...]] = ()
    #: parameters whose writes only change scalars (recomputed at every flush)
    scalar_params: ClassVar[tuple[str, ...]] = ()

    # ---- geometry -------------------------------------------------------------------------------------------
    @staticmethod
    def is_gated(layer) -> bool:
        return bool(layer.moe_runner_config.is_gated)

    def groups(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(p.group for p in self.params))

    def group_of(self, param_name: str) -> str | None:
        for p in self.params:
            if p.name == param_name:
                return p.group
        return None

    def row_map(self, layer, p: ParamLayout, t: torch.Tensor) -> torch.Tensor:
        m = t.shape[1]
        if p.group == "w13":
            return layouts.w13_row_map(m, self.is_gated(layer), device=t.device)
        return layouts.w2_row_map(m, device=t.device)

    def check_layout(self, layer) -> str | None:
        """None when every parameter can be laid out in place; else a sentence naming the problem."""
        for p in self.params:
            t = getattr(layer, p.name, None)
            if t is None:
                return f"parameter {p.name} is missing"
            if t.dim() != 3:
                return f"{p.name} has shape {tuple(t.shape)}, expected [experts, rows, cols]"
            m = t.shape[1]
            if p.permute_rows and m % 32:
                return f"{p.name} has {m} rows; the kernel's row shuffle needs a multiple of 32 (pad the intermediate size)"
            if p.sf_swizzle and (m % layouts.SF_ROW_TILE or t.shape[2] % layouts.SF_COL_TILE):
                return (
                    f"{p.name} is {tuple(t.shape)}; the 128x4 scale layout needs rows % 128 == 0 and cols % 4 == 0 "
                    "to be prepared in place (allocate the scales padded)"
                )
        return None

    # ---- layout, per group and experts ----------------------------------------------------------------------
    def prepare_(self, layer, group: str, experts) -> None:
        for p in self.params:
            if p.group != group:
                continue
            t = getattr(layer, p.name).data
            rmap = self.row_map(layer, p, t) if p.permute_rows else None
            if p.sf_swizzle:
                if rmap is None:
                    layouts.swizzle_sf_128x4_(t, experts=experts)
                else:
                    layouts.permute_rows_and_swizzle_sf_(t, rmap, experts=experts)
            elif p.block_major_k:
                if rmap is None:
                    layouts.to_block_major_k_(t, experts=experts)
                else:
                    layouts.permute_rows_to_block_major_k_(t, rmap, experts=experts)
            elif rmap is not None:
                layouts.permute_rows_(t, rmap, experts=experts)

    def unprepare_(self, layer, group: str, experts) -> None:
        for p in self.params:
            if p.group != group:
                continue
            t = getattr(layer, p.name).data
            if p.sf_swizzle and p.permute_rows:
                layouts.unswizzle_sf_and_unpermute_rows_(t, self.row_map(layer, p, t), experts=experts)
                continue
            if p.sf_swizzle:
                layouts.unswizzle_sf_128x4_(t, experts=experts)
            elif p.block_major_k:
                layouts.from_block_major_k_(t, experts=experts)
            if p.permute_rows:
                layouts.unpermute_rows_(t, self.row_map(layer, p, t), experts=experts)

    # ---- weight checker -------------------------------------------------------------------------------------
    def scale_of(self, name: str) -> str | None:
        """The laid-out parameter holding `name`'s block scales (a `*scale*` parameter of its group), if any.

        The checker compares a weight and its block scales as one entry: a weight alone has no value, and
        SGLang's checker likewise consumes `*_weight_scale_inv` into its weight's comparison. Matches
        w13_weight -> w13_weight_scale(_inv), and compressed-tensors' w13_weight_packed -> w13_weight_scale."""
        if "scale" in name:
            return None
        group = self.group_of(name)
        cands = [p.name for p in self.params if p.group == group and p.name != name and "scale" in p.name]
        common = lambda a: len(os.path.commonprefix([a, name]))  # noqa: E731
        return max(cands, key=common) if cands else None

    def dequantize_param(self, name: str, weight: torch.Tensor, scale: torch.Tensor | None):
        """Checkpoint-layout `[E, M, K]` (+ its block scales) -> (float32 values, float32 per-element tolerance).

        The tolerance is one step of the quantization grid at each value (SGLang's `_quant_ulp` rule), so two
        quantizations of the same weight that differ by rounding stay within tolerance of each other. Values are in
        block-scale units: per-tensor / global scales are scalar parameters, compared bit for bit on their own.
        Default: a dense weight (BF16, FP8 per-tensor), or float block scales that tile the weight (DeepSeek FP8).
        """
        q = weight.float()
        finfo = torch.finfo(weight.dtype) if weight.dtype.is_floating_point else None
        if finfo is None:
            tol = torch.zeros_like(q)
        else:
            _, exp = torch.frexp(q.abs())
            tol = torch.exp2((exp - 1).float()).masked_fill(q.abs() < finfo.smallest_normal, finfo.smallest_normal)
            tol = tol * finfo.eps
        if scale is None:
            return q, tol
        s = scale.float()
        bm, bk = -(-q.shape[-2] // s.shape[-2]), -(-q.shape[-1] // s.shape[-1])
        s = s.repeat_interleave(bm, dim=-2).repeat_interleave(bk, dim=-1)[..., : q.shape[-2], : q.shape[-1]]
        return q * s, tol * s

    # ---- scalars --------------------------------------------------------------------------------------------
    def compute_scalars(self, layer) -> dict[str, torch.Tensor]:
        return {}


def set_scalar_(layer, name: str, value: torch.Tensor) -> None:
    """Create a kernel scalar once, then update it in place forever after (storage-stable for CUDA graphs)."""
    value = value.detach()
    cur = getattr(layer, name, None)
    if isinstance(cur, torch.Tensor) and cur.shape == value.shape and cur.dtype == value.dtype:
        cur.data.copy_(value)
        return
    if cur is not None and isinstance(cur, torch.Tensor):
        raise RuntimeError(
            f"{name} changed shape/dtype from {tuple(cur.shape)}/{cur.dtype} to {tuple(value.shape)}/{value.dtype}; "
            "a kernel scalar must keep its storage"
        )
    layer.register_parameter(name, torch.nn.Parameter(value.clone().contiguous(), requires_grad=False))
