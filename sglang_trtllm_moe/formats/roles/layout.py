"""The layout role: how a format's parameters are laid out for its kernel and prepared in place per expert, with
exact inverses, and the kernel scalars recomputed from them.

Parameters of one `group` ("w13" or "w2") share a row map and are prepared / un-prepared together for an expert:
the gated row interleave mixes the w1 and w3 halves, so a loader writing one half of one expert must first return
the whole group of that expert to checkpoint layout. Scalars are recomputed from the parameters after every flush.
layer_state.py drives this role; the runner never does.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, ClassVar

import torch

from ... import layouts
from ...compat.defer import Verdict
from ..records import Layer, ParamLayout, Support


class Layout:
    """Its MUST members are `Spec`'s (formats/base.py): `params` (a ParamLayout per laid-out parameter) and
    `upstream_verdicts` (who prepares it on each release: compat/defer.py); MAY there: `scalar_params` +
    `compute_scalars` (kernel scalars recomputed at every flush).

    MAY define here: `recomputed_params` (the scalar parameters `compute_scalars` rewrites itself), `check_layout`
    (extra shape rules; call super), `row_map` (a format-specific half order), `tensor` / `on_layout` (a release
    that shows a prepared parameter in another shape), `prepared_at_attach`, `sglang_leaf`."""

    # declared by formats/base.py Spec
    params: ClassVar[tuple[ParamLayout, ...]]
    upstream_verdicts: tuple[Verdict, ...]
    scalar_params: ClassVar[tuple[str, ...]]
    #: of those, the ones `compute_scalars` rewrites itself at every flush (what was loaded into them is never read:
    #: nvfp4_online's static input scales, refilled with 1.0): not a loader-free writer's to write, and not checked
    #: at the end of its session (updates/loader_free.py, the writer's contract: formats/contract.py)
    recomputed_params: ClassVar[tuple[str, ...]] = ()
    #: SGLang's fused-MoE leaf ("fp4" | "fp8" | "bf16") on which a layer SGLang prepared itself holds exactly this
    #: format's kernel layout, so the emulator can run it as this format (`formats.sglang_prepared`); None = no leaf
    #: of SGLang's own preparation is read as this format (FP8 layers SGLang prepares are MXFP8 or its own
    #: requantized per-tensor layout: they stay on SGLang's leaf)
    sglang_leaf: ClassVar[str | None] = None
    if TYPE_CHECKING:  # the serving role's

        def supports_activation(self, activation: str, gated: bool) -> Support: ...

    # ---- geometry -------------------------------------------------------------------------------------------
    @staticmethod
    def is_gated(layer: Layer) -> bool:
        return bool(layer.moe_runner_config.is_gated)

    def groups(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(p.group for p in self.params))

    def group_of(self, param_name: str) -> str | None:
        for p in self.params:
            if p.name == param_name:
                return p.group
        return None

    def row_map(self, layer: Layer, p: ParamLayout, t: torch.Tensor) -> torch.Tensor:
        m = t.shape[1]
        if p.group == "w13":
            return layouts.w13_row_map(m, self.is_gated(layer), device=t.device)
        return layouts.w2_row_map(m, device=t.device)

    # ---- how a parameter is seen --------------------------------------------------------------------------------
    def tensor(self, layer: Layer, p: ParamLayout) -> torch.Tensor:
        """Parameter `p`'s storage as the layout machinery works on it, [experts, rows, cols] (MAY be overridden
        where the release shows the prepared parameter in another shape: BF16's 4-D block layout)."""
        return getattr(layer, p.name).data

    def prepared_at_attach(self, layer: Layer, group: str) -> bool:
        """True when `group` already holds kernel layout when the plugin first sees the layer (SGLang prepared it)."""
        return False

    def on_layout(self, layer: Layer, group: str, all_prepared: bool) -> None:
        """After `group`'s layout state changed: give its Parameters the shape this release shows for that state
        (same storage; only a view changes). Default: shapes never change."""

    def check_layout(self, layer: Layer) -> str | None:
        """None when every parameter can be laid out in place and the kernel computes the layer's activation;
        else a sentence naming the problem. Reads everything a flush will read first: an object that lacks any of
        it raises (AttributeError) — the caller hands such a layer back to SGLang, it is not a kernel limitation.
        The activation is the serving role's to judge (`Serving.supports_activation`)."""
        cfg = layer.moe_runner_config
        activation, gated = cfg.activation, bool(cfg.is_gated)
        for name in (*(p.name for p in self.params), *self.scalar_params):
            getattr(layer, name)
        ok, problem = self.supports_activation(activation, gated)
        if not ok:
            return problem
        for p in self.params:
            if getattr(layer, p.name) is None:
                return f"parameter {p.name} is not allocated on this layer"
            t = self.tensor(layer, p)
            if t.dim() != 3:
                return f"{p.name} has shape {tuple(t.shape)}, expected [experts, rows, cols]"
            m = t.shape[1]
            if p.permute_rows and m % 32:
                return (
                    f"{p.name} has {m} rows; the kernel's row shuffle needs a multiple of 32 (pad the intermediate "
                    "size)"
                )
            if p.sf_swizzle and (m % layouts.SF_ROW_TILE or t.shape[2] % layouts.SF_COL_TILE):
                return (
                    f"{p.name} is {tuple(t.shape)}; the 128x4 scale layout needs rows % 128 == 0 and cols % 4 == 0 "
                    "to be prepared in place (allocate the scales padded)"
                )
        return None

    # ---- layout, per group and experts ----------------------------------------------------------------------
    def prepare_(self, layer: Layer, group: str, experts: Sequence[int]) -> None:
        for p in self.params:
            if p.group != group:
                continue
            t = self.tensor(layer, p)
            rmap = self.row_map(layer, p, t) if p.permute_rows else None
            if p.sf_swizzle:
                if rmap is None:
                    layouts.swizzle_sf_128x4_(t, experts=experts)
                else:
                    layouts.permute_rows_and_swizzle_sf_(t, rmap, experts=experts)
            elif p.block_major_k:
                if rmap is None:
                    layouts.to_block_major_k_(t, experts=experts, xor=p.byte_xor)
                else:
                    layouts.permute_rows_to_block_major_k_(t, rmap, experts=experts, xor=p.byte_xor)
            elif rmap is not None:
                layouts.permute_rows_(t, rmap, experts=experts)

    def unprepare_(self, layer: Layer, group: str, experts: Sequence[int]) -> None:
        for p in self.params:
            if p.group != group:
                continue
            t = self.tensor(layer, p)
            if p.sf_swizzle and p.permute_rows:
                layouts.unswizzle_sf_and_unpermute_rows_(t, self.row_map(layer, p, t), experts=experts)
                continue
            if p.sf_swizzle:
                layouts.unswizzle_sf_128x4_(t, experts=experts)
            elif p.block_major_k:
                layouts.from_block_major_k_(t, experts=experts, xor=p.byte_xor)
            if p.permute_rows:
                layouts.unpermute_rows_(t, self.row_map(layer, p, t), experts=experts)


def set_scalar_(layer: Layer, name: str, value: torch.Tensor) -> None:
    """Create a kernel scalar once, then update it in place forever after (storage-stable for CUDA graphs). A
    registered Parameter with an expert dimension, not a buffer or attribute: SGLang's EPLB rebalance moves every
    per-expert parameter between slots (its `filter_moe_weight_param_global_expert`), so per-expert scalars follow
    their expert only as Parameters (tests/test_eplb*.py)."""
    value = value.detach()
    cur = getattr(layer, name, None)
    if isinstance(cur, torch.Tensor) and cur.shape == value.shape and cur.dtype == value.dtype:
        layouts.copy_bytes_(cur.data, value)
        return
    if cur is not None and isinstance(cur, torch.Tensor):
        raise RuntimeError(
            f"{name} changed shape/dtype from {tuple(cur.shape)}/{cur.dtype} to {tuple(value.shape)}/{value.dtype}; "
            "a kernel scalar must keep its storage"
        )
    layer.register_parameter(name, torch.nn.Parameter(value.clone().contiguous(), requires_grad=False))
