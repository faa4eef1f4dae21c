"""The 128x4 scale-factor swizzle (NVFP4 / MXFP8 block scales, one byte each; INT4's bf16 block scales, two), out of
place and in place, fused with the row permutation in one pass, with its inverse.

The swizzle moves groups of 4 scales of one row (flashinfer's `block_scale_interleave`, its host loop per element:
the same index map for uint8 and bfloat16), so in place it is a permutation of 4-scale words: int32 words for 1-byte
scales, int64 for 2-byte ones."""

from __future__ import annotations

import math

import torch

from .fastpath import fast_path_for
from .inplace import bytes3d, check_row_map, copy_bytes_, plan, unpermute_rows_
from .maps import SF_COL_TILE, SF_ROW_TILE, Experts, closed_block, expert_ids_tensor, map_i32, round_up


def _sf_view_swizzled(x: torch.Tensor, k: int, rp: int, cp: int) -> torch.Tensor:
    """Linear [k, Rp, Cp] seen in swizzled element order: [k, Rp/128, Cp/4, 32, 4(row group), 4(col)]."""
    return x.view(k, rp // 128, 4, 32, cp // 4, 4).permute(0, 1, 4, 3, 2, 5)


def _sf_view_linear(x: torch.Tensor, k: int, rp: int, cp: int) -> torch.Tensor:
    """Swizzled [k, Rp, Cp] seen in linear element order: [k, Rp/128, 4, 32, Cp/4, 4] (the permute is an involution)."""
    return x.view(k, rp // 128, cp // 4, 32, 4, 4).permute(0, 1, 4, 3, 2, 5)


def _as3d(sf: torch.Tensor, name: str) -> tuple[torch.Tensor, bool]:
    if sf.dim() == 2:
        return sf.unsqueeze(0), True
    if sf.dim() != 3:
        raise ValueError(f"{name} must be [E, rows, cols] (or [rows, cols]), got shape {tuple(sf.shape)}")
    return sf, False


def swizzle_sf_128x4(sf: torch.Tensor) -> torch.Tensor:
    """[E, R, C] -> [E, ceil128(R), ceil4(C)] zero padded; per expert the bytes of flashinfer block_scale_interleave.

    Element-order permutation, so any dtype works; the kernels use 1-byte e4m3 / ue8m0.
    """
    x, squeeze = _as3d(sf, "sf")
    e, r, c = x.shape
    rp, cp = round_up(r, SF_ROW_TILE), round_up(c, SF_COL_TILE)
    if (rp, cp) != (r, c):
        padded = torch.zeros((e, rp, cp), dtype=x.dtype, device=x.device)
        padded[:, :r, :c] = x
        x = padded
    out = _sf_view_swizzled(x.contiguous(), e, rp, cp).reshape(e, rp, cp)
    return out[0] if squeeze else out


def unswizzle_sf_128x4(swz: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """[E, Rp, Cp] swizzled -> [E, rows, cols] linear, dropping the padding."""
    x, squeeze = _as3d(swz, "swz")
    e, rp, cp = x.shape
    if rp % SF_ROW_TILE or cp % SF_COL_TILE or rows > rp or cols > cp:
        raise ValueError(
            f"swizzled scales of shape {tuple(swz.shape)} cannot hold rows={rows} cols={cols}: "
            f"need rows <= Rp, cols <= Cp with Rp % 128 == 0 and Cp % 4 == 0"
        )
    out = _sf_view_linear(x.contiguous(), e, rp, cp).reshape(e, rp, cp)[:, :rows, :cols].contiguous()
    return out[0] if squeeze else out


#: the word holding 4 scales of one row, per scale size in bytes
_WORDS = {1: torch.int32, 2: torch.int64}


def _word(sf: torch.Tensor) -> torch.dtype:
    word = _WORDS.get(sf.element_size())
    if word is None:
        raise ValueError(f"in-place scale swizzle takes 1- or 2-byte scales, got {sf.dtype}")
    return word


def _check_inplace_sf(sf: torch.Tensor) -> tuple[int, int, int]:
    if sf.dim() != 3:
        raise ValueError(f"in-place scale swizzle needs [E, R, C], got shape {tuple(sf.shape)}")
    e, r, c = sf.shape
    if r % SF_ROW_TILE or c % SF_COL_TILE:
        raise ValueError(
            f"cannot swizzle scales of shape {tuple(sf.shape)} in place: the 128x4 layout needs R % 128 == 0 and "
            f"C % 4 == 0; allocate the scale parameter padded to [{e}, {round_up(r, 128)}, {round_up(c, 4)}] "
            f"(pad I / H), or use the out-of-place swizzle_sf_128x4()"
        )
    if not sf.is_contiguous():
        raise ValueError(f"scales of shape {tuple(sf.shape)} must be contiguous to be swizzled in place")
    return e, r, c


def _sf_fast(sf: torch.Tensor, experts: Experts, row_map: torch.Tensor | None, forward: bool) -> bool:
    """The one-pass kernel (CUDA): forward = rows by row_map then swizzle; else its exact inverse."""
    u8 = bytes3d(sf, "sf")
    word = _word(sf)
    fast = fast_path_for(u8, word_bytes=4 * sf.element_size())  # 4 scales a word
    if fast is None:
        return False
    block = SF_ROW_TILE
    if row_map is not None:
        row_map = check_row_map(row_map, u8.shape[1], sf)
        b = closed_block(row_map)
        block = b * SF_ROW_TILE // math.gcd(b, SF_ROW_TILE)
    eids = expert_ids_tensor(u8.shape[0], experts, u8.device)
    return fast.sf_(u8.view(word), None if row_map is None else map_i32(row_map), eids, block, inverse=not forward)


def _sf_inplace(
    sf: torch.Tensor, experts: Experts, chunk: int | None, row_map: torch.Tensor | None, swizzle: bool
) -> torch.Tensor:
    e, r, c = _check_inplace_sf(sf)
    word = _word(sf)
    if _sf_fast(sf, experts, row_map if swizzle else None, swizzle):
        return sf
    u8 = bytes3d(sf, "sf")
    runs, scratch = plan(u8, sf, row_map, experts, chunk)
    for s, t in runs:
        k = t - s
        # The 128x4 swizzle moves groups of 4 scales of one row, so it is a permutation of words (int32 for 1-byte
        # scales): copying 4x fewer, wider elements measured 2x faster on CPU than the uint8 6-D permute.
        tmp = scratch.load(s, t).view(word).view(k, r // 128, 4, 32, c // 4)
        dst = u8[s:t].view(word)
        if swizzle:  # write the linear scratch straight into swizzled order: no second temporary
            copy_bytes_(dst.view(k, r // 128, c // 4, 32, 4), tmp.permute(0, 1, 4, 3, 2))
        else:
            back = tmp.view(k, r // 128, c // 4, 32, 4).permute(0, 1, 4, 3, 2)
            copy_bytes_(dst.view(k, r // 128, 4, 32, c // 4), back)
    return sf


def swizzle_sf_128x4_(sf: torch.Tensor, experts: Experts = None, chunk: int | None = None) -> torch.Tensor:
    """In place 128x4 swizzle (same storage); scratch is one chunk of experts."""
    return _sf_inplace(sf, experts, chunk, None, True)


def unswizzle_sf_128x4_(sf: torch.Tensor, experts: Experts = None, chunk: int | None = None) -> torch.Tensor:
    """In place inverse of `swizzle_sf_128x4_`."""
    return _sf_inplace(sf, experts, chunk, None, False)


def permute_rows_and_swizzle_sf_(
    sf: torch.Tensor, row_map: torch.Tensor, experts: Experts = None, chunk: int | None = None
) -> torch.Tensor:
    """Scale prep in one pass: rows by `row_map`, then 128x4 swizzle, written straight back (one scratch copy;
    on CUDA one gather through `composed_sf_map`, no scratch)."""
    return _sf_inplace(sf, experts, chunk, row_map, True)


def unswizzle_sf_and_unpermute_rows_(
    sf: torch.Tensor, row_map: torch.Tensor, experts: Experts = None, chunk: int | None = None
) -> torch.Tensor:
    """Exact inverse of `permute_rows_and_swizzle_sf_` with the same map (one pass on CUDA, two elsewhere)."""
    _check_inplace_sf(sf)
    if _sf_fast(sf, experts, row_map, False):
        return sf
    unswizzle_sf_128x4_(sf, experts, chunk)
    return unpermute_rows_(sf, row_map, experts, chunk)
