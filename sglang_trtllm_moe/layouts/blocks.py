"""Block-major K (BF16 and INT4 weights): [M, K] -> [K/bk, M, bk] per expert, on bytes, in place or out of place.

INT4's prep also flips each nibble's sign bit (`xor=0x88`: compressed-tensors stores w/s + 8, the kernel w/s): on the
scratch copy, so the row gather, the flip and the block-major write are one pass over the bytes; the flip is its own
inverse."""

from __future__ import annotations

import torch

from .inplace import bytes3d, copy_bytes_, plan
from .maps import Experts, round_up

#: the kernels' block of K, in bytes (flashinfer `convert_to_block_layout(x, 128)` on the byte view: 64 bf16, 256 INT4)
BLOCK_K_BYTES = 128


def _block_dims(t: torch.Tensor, block_k_bytes: int) -> tuple[int, int, int]:
    if t.dim() != 3:
        raise ValueError(f"block-major K needs [E, M, K], got shape {tuple(t.shape)}")
    kb = t.shape[2] * t.element_size()
    if block_k_bytes <= 0 or block_k_bytes % t.element_size() or kb % block_k_bytes:
        raise ValueError(
            f"cannot lay out [E, M, K] = {tuple(t.shape)} ({t.dtype}, {kb} bytes per row) block-major with "
            f"block_k_bytes={block_k_bytes}: row bytes must be a multiple of it; pad K to "
            f"{round_up(kb, block_k_bytes) // t.element_size()} elements"
        )
    return t.shape[0], t.shape[1], kb


def to_block_major_k(t: torch.Tensor, block_k_bytes: int = 128) -> torch.Tensor:
    """[E, M, K] -> [E, Kbytes/bk, M, bk/itemsize] (flashinfer convert_to_block_layout per expert, on bytes)."""
    e, m, kb = _block_dims(t, block_k_bytes)
    u8 = t.contiguous().view(torch.uint8).reshape(e, m, kb // block_k_bytes, block_k_bytes)
    return u8.permute(0, 2, 1, 3).contiguous().view(t.dtype)


def from_block_major_k(t: torch.Tensor) -> torch.Tensor:
    """[E, nb, M, bk elems] -> [E, M, nb*bk elems]."""
    if t.dim() != 4:
        raise ValueError(f"block-major tensor must be [E, K/bk, M, bk], got shape {tuple(t.shape)}")
    e, nb, m, bke = t.shape
    return t.permute(0, 2, 1, 3).contiguous().reshape(e, m, nb * bke)


def block_major_k_view(t: torch.Tensor, block_k_bytes: int = 128) -> torch.Tensor:
    """The [E, Kb/bk, M, bk-elems] view of a tensor made block-major in place: what the kernel is given."""
    e, m, kb = _block_dims(t, block_k_bytes)
    if not t.is_contiguous():
        raise ValueError(f"tensor of shape {tuple(t.shape)} must be contiguous")
    return t.view(torch.uint8).view(e, kb // block_k_bytes, m, block_k_bytes).view(t.dtype)


def _block_inplace(
    t: torch.Tensor,
    block_k_bytes: int,
    experts: Experts,
    chunk: int | None,
    row_map: torch.Tensor | None = None,
    inverse: bool = False,
    xor: int = 0,
) -> torch.Tensor:
    e, m, kb = _block_dims(t, block_k_bytes)
    if not 0 <= xor < 256:
        raise ValueError(f"xor must be one byte, got {xor}")
    u8 = bytes3d(t)
    nb, bk = kb // block_k_bytes, block_k_bytes
    runs, scratch = plan(u8, t, row_map, experts, chunk)
    for s, stop in runs:
        k = stop - s
        tmp = scratch.load(s, stop)
        if xor:
            tmp.bitwise_xor_(xor)
        if inverse:  # block-major [k, nb, M, bk] -> [k, M, nb, bk]
            copy_bytes_(u8[s:stop].view(k, m, nb, bk), tmp.view(k, nb, m, bk).permute(0, 2, 1, 3))
        else:
            copy_bytes_(u8[s:stop].view(k, nb, m, bk), tmp.view(k, m, nb, bk).permute(0, 2, 1, 3))
    return t


def to_block_major_k_(
    t: torch.Tensor, block_k_bytes: int = 128, experts: Experts = None, chunk: int | None = None, xor: int = 0
) -> torch.Tensor:
    """In place: t keeps shape [E, M, K] and storage, its bytes become block-major (see block_major_k_view), each
    XORed with `xor`."""
    return _block_inplace(t, block_k_bytes, experts, chunk, xor=xor)


def from_block_major_k_(
    t: torch.Tensor, block_k_bytes: int = 128, experts: Experts = None, chunk: int | None = None, xor: int = 0
) -> torch.Tensor:
    """In place inverse of `to_block_major_k_` (the same `xor`)."""
    return _block_inplace(t, block_k_bytes, experts, chunk, inverse=True, xor=xor)


def permute_rows_to_block_major_k_(
    t: torch.Tensor,
    row_map: torch.Tensor,
    block_k_bytes: int = 128,
    experts: Experts = None,
    chunk: int | None = None,
    xor: int = 0,
) -> torch.Tensor:
    """BF16 / INT4 prep in one pass: rows by `row_map`, each byte XORed with `xor`, then block-major K, in place (one
    scratch copy per chunk)."""
    return _block_inplace(t, block_k_bytes, experts, chunk, row_map=row_map, xor=xor)
