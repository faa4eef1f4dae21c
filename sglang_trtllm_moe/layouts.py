"""Pure-torch TRT-LLM-Gen weight layouts, batched over experts, each with its exact inverse.

Why this module exists: FlashInfer's TRT-LLM-Gen MoE kernels read weights in a layout that differs from the
checkpoint (gated row interleave, `shuffle_matrix_a` row blocks, 128x4 scale swizzle, block-major K). SGLang
builds it per expert in Python loops, allocates fresh tensors (moving storage under captured CUDA graphs) and
keeps index caches alive across weight reloads (sglang#28676). Here every transform is:

* one gather for many experts at once (the map depends only on the shape, so all experts share it);
* applied to the raw byte view, so one row map serves packed FP4, FP8 and BF16 alike;
* available in place (same storage, same `data_ptr()`), chunked over experts so the scratch memory is at most
  `chunk` experts' worth, and restricted to a subset of experts when only some were updated;
* exactly invertible, so a weight checker can undo it.

On CUDA (with Triton importable) the in-place transforms run as one-pass Triton kernels instead (_triton_layouts.py):
each program gathers its piece of the destination through the composed index map (row map, and for block scales the
128x4 swizzle) and writes it back once, with no scratch; the pure-torch code below stays the reference, the CPU path
and the fallback, and the two give identical bytes (`set_fast_path(False)` forces the reference).

Index maps are cached per (kind, m, gated, epilogue_tile_m, device); `clear_caches()` drops them all.
Formulas: flashinfer 0.7.2 `get_reorder_rows_for_gated_act_gemm_row_indices`, `get_shuffle_matrix_a_row_indices`,
`convert_to_block_layout`, and the TRT-LLM `get_sf_out_offset_128x4` swizzle (SGLang `swizzle_blockscale`).
"""

from __future__ import annotations

import math
import threading
from typing import Sequence

import torch

SF_ROW_TILE = 128
SF_COL_TILE = 4
GATED_ALIGN = 16
NON_GATED_ALIGN = 128

__all__ = [
    "SF_ROW_TILE", "SF_COL_TILE", "GATED_ALIGN", "NON_GATED_ALIGN",
    "padded_intermediate", "gated_reorder_map", "shuffle_map", "shuffle_block_size", "w13_row_map", "w2_row_map",
    "invert_map", "clear_caches", "cache_size", "permute_rows_", "unpermute_rows_",
    "swizzle_sf_128x4", "unswizzle_sf_128x4", "swizzle_sf_128x4_", "unswizzle_sf_128x4_",
    "permute_rows_and_swizzle_sf_", "to_block_major_k", "from_block_major_k", "to_block_major_k_",
    "from_block_major_k_", "block_major_k_view", "permute_rows_to_block_major_k_",
    "pad_gated_halves", "unpad_gated_halves", "scratch_peak_bytes", "reset_scratch_peak",
    "unswizzle_sf_and_unpermute_rows_", "closed_block", "composed_sf_map", "set_fast_path", "fast_path_for",
]


def _round_up(x: int, m: int) -> int:
    return (x + m - 1) // m * m


def padded_intermediate(i: int, gated: bool) -> int:
    """The kernel tiles the intermediate dim in 16-row (gated: per half) or 128-row (non-gated) units."""
    if i <= 0:
        raise ValueError(f"intermediate size must be positive, got {i}")
    return _round_up(int(i), GATED_ALIGN if gated else NON_GATED_ALIGN)


# ----------------------------------------------------------------------------------------------------------------
# Index maps and their cache
# ----------------------------------------------------------------------------------------------------------------

# key -> map; (id(map), what) -> (map, derived value: its inverse, its closed block, its int32 copy). Holding `map`
# in the second dict keeps its id() from being reused.
_MAPS: dict[tuple, torch.Tensor] = {}
_DERIVED: dict[tuple[int, str], tuple[torch.Tensor, object]] = {}
#: loaders run on thread pools (DeepSeek) and `clear_caches` runs at every update entry point: the two dicts
#: change together, never while another thread iterates them
_CACHE_LOCK = threading.RLock()


def _norm_device(device) -> torch.device:
    """'cuda' and 'cuda:N' must be one cache entry per physical device, never a map on the wrong GPU."""
    dev = torch.device("cpu" if device is None else device)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    return dev


def clear_caches() -> None:
    """Drop every cached index map on every device: call on weight reload / engine resume (sglang#28676)."""
    with _CACHE_LOCK:
        _MAPS.clear()
        _DERIVED.clear()
        _EIDS.clear()


def cache_size() -> int:
    """Number of cached maps (tests and `doctor` use it to prove `clear_caches` works)."""
    return len(_MAPS)


def _cached(key: tuple, build) -> torch.Tensor:
    with _CACHE_LOCK:
        idx = _MAPS.get(key)
        if idx is None:
            idx = build().to(key[-1])
            _MAPS[key] = idx
        return idx


def shuffle_block_size(epilogue_tile_m: int = 128) -> int:
    """flashinfer `get_shuffle_block_size`: 32-row blocks when the epilogue tile is a multiple of 128, else 16."""
    return 32 if epilogue_tile_m % 128 == 0 else 16


def _check_shuffle_rows(m: int, epilogue_tile_m: int, what: str = "rows") -> None:
    b = shuffle_block_size(epilogue_tile_m)
    if m <= 0 or m % b:
        raise ValueError(
            f"cannot shuffle {what} M={m} for the TRT-LLM-Gen kernel (epilogue_tile_m={epilogue_tile_m}): "
            f"M must be a positive multiple of {b}; pad to {_round_up(max(m, 1), b)} rows "
            f"(pad the intermediate with padded_intermediate(), per half for gated w13)")


def gated_reorder_map(m: int, device=None) -> torch.Tensor:
    """[top; bottom] halves -> rows t0,b0,t1,b1,... so one tile load holds matching up and gate rows."""
    if m <= 0 or m % 2:
        raise ValueError(f"gated w13 needs an even row count (2 halves), got M={m}; pad each half to the same size")
    dev = _norm_device(device)

    def build():
        half = torch.arange(m // 2, dtype=torch.long)
        return torch.stack([half, half + m // 2], dim=1).reshape(m)

    return _cached(("reorder", m, True, None, dev), build)


def shuffle_map(m: int, epilogue_tile_m: int = 128, device=None) -> torch.Tensor:
    """flashinfer `shuffle_matrix_a` rows: within each block of b rows, out row d = in row (d % 8) * (b/8) + d // 8.

    Closed form of inverting flashinfer's srcToDstBlk{16,32}RowMap (src s goes to (s % k) * 8 + s // k, k = b/8).
    """
    _check_shuffle_rows(m, epilogue_tile_m)
    dev = _norm_device(device)
    b = shuffle_block_size(epilogue_tile_m)

    def build():
        d = torch.arange(m, dtype=torch.long)
        within = d % b
        return d - within + (within % 8) * (b // 8) + within // 8

    return _cached(("shuffle", m, None, epilogue_tile_m, dev), build)


def w13_row_map(m: int, gated: bool, device=None, epilogue_tile_m: int = 128) -> torch.Tensor:
    """GEMM1 rows (weights and scale rows alike): gated = reorder then shuffle (idx_R[idx_S]); else shuffle."""
    if not gated:
        return shuffle_map(m, epilogue_tile_m, device)
    _check_shuffle_rows(m, epilogue_tile_m, "gated w13 rows")
    dev = _norm_device(device)
    return _cached(("w13", m, True, epilogue_tile_m, dev),
                   lambda: gated_reorder_map(m, dev)[shuffle_map(m, epilogue_tile_m, dev)])


def w2_row_map(m: int, device=None, epilogue_tile_m: int = 128) -> torch.Tensor:
    """GEMM2 rows (m = hidden): shuffle only; kept as its own name so callers never pass `gated` by mistake."""
    return shuffle_map(m, epilogue_tile_m, device)


def _derived(idx: torch.Tensor, what: str, build):
    """A value computed from a map, cached while the map itself is one of this module's cached maps."""
    with _CACHE_LOCK:
        hit = _DERIVED.get((id(idx), what))
        if hit is not None and hit[0] is idx:
            return hit[1]
        value = build()
        # maps of the cache, and maps derived from them (the inverse's closed block, its int32 copy)
        if any(v is idx for v in _MAPS.values()) or any(d[1] is idx for d in _DERIVED.values()):
            _DERIVED[(id(idx), what)] = (idx, value)
        return value


def invert_map(idx: torch.Tensor) -> torch.Tensor:
    """inv with in[r] = out[inv[r]] for out = in[idx]. Cached for maps that come from this module's cache."""

    def build():  # scatter == argsort for a permutation, in O(M)
        inv = torch.empty_like(idx)
        inv[idx] = torch.arange(idx.numel(), dtype=idx.dtype, device=idx.device)
        return inv

    return _derived(idx, "inverse", build)


def closed_block(idx: torch.Tensor) -> int:
    """Smallest B dividing M such that the row map keeps every B-row block to itself (idx[r] // B == r // B).

    In place, a block is the unit that must be read completely before any of it is written: 32 for the w2 shuffle,
    M for gated w13 (the halves interleave). Cached with the map."""

    def build():
        m = idx.numel()
        rows = torch.arange(m)
        src = idx.detach().to("cpu", torch.long)
        for b in range(1, m + 1):
            if m % b == 0 and torch.equal(src // b, rows // b):
                return b
        return m

    return _derived(idx, "closed_block", build)


def _map_i32(idx: torch.Tensor) -> torch.Tensor:
    return _derived(idx, "int32", lambda: idx.to(torch.int32).contiguous())


def composed_sf_map(row_map: torch.Tensor | None, m: int, c: int, device=None) -> torch.Tensor:
    """The one gather behind `permute_rows_and_swizzle_sf_` on an [M, C] scale matrix (C % 4 == 0, M % 128 == 0):
    flat 4-byte word w of the prepared expert = word composed[w] of the linear one.

    This is the map the CUDA kernel applies (row map composed with the 128x4 swizzle, in 4-byte words); on CPU it
    documents and tests the composition: `lin.view(int32).flatten()[composed].view(...)` equals the two-step path."""
    if m % SF_ROW_TILE or c % SF_COL_TILE:
        raise ValueError(f"composed scale map needs M % 128 == 0 and C % 4 == 0, got M={m} C={c}")
    c4 = c // 4
    rows = torch.arange(m, dtype=torch.long) if row_map is None else row_map.detach().to("cpu", torch.long)
    w = torch.arange(m * c4, dtype=torch.long)
    tile, rem = w // (SF_ROW_TILE * c4), w % (SF_ROW_TILE * c4)
    col, r32, r4 = rem // SF_ROW_TILE, (rem % SF_ROW_TILE) // 4, rem % 4
    r = tile * SF_ROW_TILE + r4 * 32 + r32
    return (rows[r] * c4 + col).to(device if device is not None else "cpu")


# ----------------------------------------------------------------------------------------------------------------
# The CUDA fast path (Triton): chosen per call, same bytes as the reference
# ----------------------------------------------------------------------------------------------------------------

_FAST_PATH = {"enabled": True, "cpu_interpret": False}
_TRITON: list = []  # [module or None] once tried


def set_fast_path(enabled: bool) -> bool:
    """Turn the Triton kernels on CUDA on or off (off: the pure-torch reference everywhere); returns the old value."""
    old = _FAST_PATH["enabled"]
    _FAST_PATH["enabled"] = bool(enabled)
    return old


def _triton_layouts():
    with _CACHE_LOCK:
        if not _TRITON:
            try:
                from . import _triton_layouts as mod
            except Exception:  # no triton, or a triton that cannot build here: the torch path serves
                mod = None
            _TRITON.append(mod)
        return _TRITON[0]


def fast_path_for(t: torch.Tensor):
    """The Triton module when `t` (its uint8 [E, M, C] view) can take the one-pass kernels, else None."""
    if not _FAST_PATH["enabled"]:
        return None
    if t.device.type != "cuda" and not (t.device.type == "cpu" and _FAST_PATH["cpu_interpret"]):
        return None
    if t.dim() != 3 or t.shape[2] % 4 or t.data_ptr() % 4:
        return None
    return _triton_layouts()


_EIDS: dict[tuple, torch.Tensor] = {}  # (ids, device) -> int32 ids on that device; a prep re-uses them per param


def _expert_ids_tensor(num_experts: int, experts, device) -> torch.Tensor:
    ids = tuple(_expert_ids(num_experts, experts))
    key = (ids if experts is not None else ("all", num_experts), _norm_device(device))
    with _CACHE_LOCK:
        hit = _EIDS.get(key)
        if hit is None:
            hit = torch.tensor(ids, dtype=torch.int32).to(key[1])
            if len(_EIDS) < 64:  # kept until clear_caches (never freed under a kernel that may still read it)
                _EIDS[key] = hit
        return hit


# ----------------------------------------------------------------------------------------------------------------
# Scratch accounting (the benchmark reports it; it proves the in-place promise on CPU where no allocator stats exist)
# ----------------------------------------------------------------------------------------------------------------

_SCRATCH_PEAK = [0]


def _note_scratch(*tensors: torch.Tensor) -> None:
    n = sum(t.numel() * t.element_size() for t in tensors)
    if n > _SCRATCH_PEAK[0]:
        _SCRATCH_PEAK[0] = n


def scratch_peak_bytes() -> int:
    """Largest scratch (temporary copies + index tensors alive together) any in-place transform allocated."""
    return _SCRATCH_PEAK[0]


def reset_scratch_peak() -> None:
    _SCRATCH_PEAK[0] = 0


# ----------------------------------------------------------------------------------------------------------------
# In-place machinery: experts -> chunks of consecutive expert slices
# ----------------------------------------------------------------------------------------------------------------


def _bytes3d(t: torch.Tensor, name: str = "t") -> torch.Tensor:
    """[E, M, ...] -> its uint8 view [E, M, row_bytes]; same storage, so writes land in `t`."""
    if t.dim() < 2:
        raise ValueError(f"{name} must be [E, M, ...] with a leading expert dim, got shape {tuple(t.shape)}")
    if not t.is_contiguous():
        raise ValueError(f"{name} of shape {tuple(t.shape)} must be contiguous to be laid out in place; "
                         "parameters are allocated contiguous, pass the parameter itself, not a view of it")
    return t.view(torch.uint8).reshape(t.shape[0], t.shape[1], -1)


#: Default scratch cap per device type. On CPU a scratch that stays in the last-level cache makes the copy back
#: nearly free: measured on a 2-core EPYC (32 MiB L3), w13 rows in place ran at 21 GB/s with 1 expert (14.7 MB)
#: per chunk and at 5.8 GB/s with 4. On CUDA bigger chunks mean fewer launches.
SCRATCH_CAP_BYTES = {"cpu": 16 << 20, "cuda": 512 << 20}


def _default_chunk(u8: torch.Tensor) -> int:
    """max(1, E // 8) experts (the memory promise), fewer if that would exceed the device's scratch cap."""
    per_expert = max(1, u8[0].numel())
    cap = SCRATCH_CAP_BYTES.get(u8.device.type, SCRATCH_CAP_BYTES["cuda"])
    return max(1, min(u8.shape[0] // 8, cap // per_expert))


def _expert_ids(num_experts: int, experts):
    """Sorted, validated expert ids (a range when all)."""
    if experts is None:
        return range(num_experts)
    ids = experts.tolist() if isinstance(experts, torch.Tensor) else list(experts)
    ids = sorted(int(i) for i in ids)
    if any(i < 0 or i >= num_experts for i in ids) or len(set(ids)) != len(ids):
        raise ValueError(f"experts must be distinct ids in [0, {num_experts}), got {ids}")
    return ids


def _expert_runs(num_experts: int, experts, chunk) -> list[tuple[int, int]]:
    """[start, stop) expert slices: consecutive runs of the requested experts, cut to at most `chunk` experts."""
    if chunk is None:
        chunk = max(1, num_experts // 8)
    if chunk < 1:
        raise ValueError(f"chunk must be >= 1 expert, got {chunk}")
    ids = _expert_ids(num_experts, experts)
    runs: list[tuple[int, int]] = []
    run_start = prev = None
    for i in ids:
        if run_start is not None and (i != prev + 1 or i - run_start >= chunk):
            runs.append((run_start, prev + 1))
            run_start = None
        if run_start is None:
            run_start = i
        prev = i
    if run_start is not None:
        runs.append((run_start, prev + 1))
    return runs


def _check_row_map(row_map: torch.Tensor, m: int, t: torch.Tensor) -> torch.Tensor:
    if row_map.dim() != 1 or row_map.numel() != m:
        raise ValueError(f"row map of shape {tuple(row_map.shape)} does not fit tensor rows M={m} "
                         f"(tensor shape {tuple(t.shape)}); build it for M={m}")
    if row_map.device != t.device:
        row_map = row_map.to(t.device)
    return row_map.long()


class _Scratch:
    """One scratch buffer per in-place call, reused by every chunk of experts.

    A fresh allocation per chunk pays page faults on first touch: measured on the 2-core CPU, an out-of-place
    index_select ran at 2.9 GB/s and the same gather into a preallocated buffer at 19 GB/s.
    Rows are gathered flat (`[E*M, C].index_select(0, map + e*M)`, fastest on CPU, notes §6); rows under 64 bytes
    gather along dim 1 instead, where a flat int64 index would be bigger than the data.
    """

    def __init__(self, u8: torch.Tensor, runs: Sequence[tuple[int, int]], row_map: torch.Tensor | None = None):
        e, m, c = u8.shape
        k = max((t - s for s, t in runs), default=0)
        self.u8, self.m, self.c, self.row_map = u8, m, c, row_map
        self.buf = torch.empty((k, m, c), dtype=torch.uint8, device=u8.device)
        self.flat = row_map is not None and c >= 64
        parts = [self.buf]
        if self.flat:
            offsets = torch.arange(0, k * m, m, device=u8.device).unsqueeze(1)
            self.base = row_map.unsqueeze(0) + offsets
            self.src = torch.empty_like(self.base)
            parts += [self.base, self.src]
        _note_scratch(*parts)

    def load(self, s: int, t: int) -> torch.Tensor:
        """Experts [s, t) (rows permuted when a map was given), copied out so their storage can be overwritten."""
        k, m, c = t - s, self.m, self.c
        out = self.buf[:k]
        if self.row_map is None:
            out.copy_(self.u8[s:t])
        elif self.flat:
            src = torch.add(self.base[:k], s * m, out=self.src[:k])
            torch.index_select(self.u8.view(-1, c), 0, src.view(-1), out=out.view(k * m, c))
        else:
            torch.index_select(self.u8[s:t], 1, self.row_map, out=out)
        return out


def _plan(u8: torch.Tensor, t: torch.Tensor, row_map, experts, chunk) -> tuple[list[tuple[int, int]], _Scratch]:
    """Every in-place transform starts alike: check the row map (if any), cut the experts into chunks, take one
    scratch sized for the largest chunk."""
    if row_map is not None:
        row_map = _check_row_map(row_map, u8.shape[1], t)
    runs = _expert_runs(u8.shape[0], experts, chunk if chunk is not None else _default_chunk(u8))
    return runs, _Scratch(u8, runs, row_map)


def permute_rows_(t: torch.Tensor, row_map: torch.Tensor, experts=None, chunk: int | None = None) -> torch.Tensor:
    """In place: t[e] = t[e][row_map] for each selected expert; storage and shape unchanged.

    On CUDA one Triton pass (no scratch, `chunk` unused); elsewhere gather a chunk of experts into scratch, copy back."""
    u8 = _bytes3d(t)
    fast = fast_path_for(u8)
    if fast is not None:
        row_map = _check_row_map(row_map, u8.shape[1], t)
        eids = _expert_ids_tensor(u8.shape[0], experts, u8.device)
        if fast.permute_rows_(u8.view(torch.int32), _map_i32(row_map), eids, closed_block(row_map)):
            return t
    runs, scratch = _plan(u8, t, row_map, experts, chunk)
    for start, stop in runs:
        u8[start:stop].copy_(scratch.load(start, stop))
    return t


def unpermute_rows_(t: torch.Tensor, row_map: torch.Tensor, experts=None, chunk: int | None = None) -> torch.Tensor:
    """Exact inverse of `permute_rows_` with the same map."""
    u8 = _bytes3d(t)
    return permute_rows_(t, invert_map(_check_row_map(row_map, u8.shape[1], t)), experts, chunk)


# ----------------------------------------------------------------------------------------------------------------
# 128x4 scale-factor swizzle
# ----------------------------------------------------------------------------------------------------------------

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
    rp, cp = _round_up(r, SF_ROW_TILE), _round_up(c, SF_COL_TILE)
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
        raise ValueError(f"swizzled scales of shape {tuple(swz.shape)} cannot hold rows={rows} cols={cols}: "
                         f"need rows <= Rp, cols <= Cp with Rp % 128 == 0 and Cp % 4 == 0")
    out = _sf_view_linear(x.contiguous(), e, rp, cp).reshape(e, rp, cp)[:, :rows, :cols].contiguous()
    return out[0] if squeeze else out


def _check_inplace_sf(sf: torch.Tensor) -> tuple[int, int, int]:
    if sf.dim() != 3:
        raise ValueError(f"in-place scale swizzle needs [E, R, C], got shape {tuple(sf.shape)}")
    e, r, c = sf.shape
    if r % SF_ROW_TILE or c % SF_COL_TILE:
        raise ValueError(
            f"cannot swizzle scales of shape {tuple(sf.shape)} in place: the 128x4 layout needs R % 128 == 0 and "
            f"C % 4 == 0; allocate the scale parameter padded to [{e}, {_round_up(r, 128)}, {_round_up(c, 4)}] "
            f"(pad I / H), or use the out-of-place swizzle_sf_128x4()")
    if not sf.is_contiguous():
        raise ValueError(f"scales of shape {tuple(sf.shape)} must be contiguous to be swizzled in place")
    return e, r, c


def _sf_fast(sf, experts, row_map, forward: bool) -> bool:
    """The one-pass kernel (CUDA): forward = rows by row_map then swizzle; else its exact inverse."""
    u8 = _bytes3d(sf, "sf")
    fast = fast_path_for(u8)
    if fast is None:
        return False
    block = SF_ROW_TILE
    if row_map is not None:
        row_map = _check_row_map(row_map, u8.shape[1], sf)
        b = closed_block(row_map)
        block = b * SF_ROW_TILE // math.gcd(b, SF_ROW_TILE)
    eids = _expert_ids_tensor(u8.shape[0], experts, u8.device)
    return fast.sf_(u8.view(torch.int32), None if row_map is None else _map_i32(row_map), eids, block,
                    inverse=not forward)


def _sf_inplace(sf, experts, chunk, row_map, swizzle: bool):
    e, r, c = _check_inplace_sf(sf)
    if _sf_fast(sf, experts, row_map if swizzle else None, swizzle):
        return sf
    u8 = _bytes3d(sf, "sf")
    runs, scratch = _plan(u8, sf, row_map, experts, chunk)
    for s, t in runs:
        k = t - s
        # The 128x4 swizzle moves 4-byte groups (4 scales of one row), so it is an int32 permutation: copying
        # 4x fewer, wider elements measured 2x faster on CPU than the uint8 6-D permute.
        tmp = scratch.load(s, t).view(torch.int32).view(k, r // 128, 4, 32, c // 4)
        dst = u8[s:t].view(torch.int32)
        if swizzle:  # write the linear scratch straight into swizzled order: no second temporary
            dst.view(k, r // 128, c // 4, 32, 4).copy_(tmp.permute(0, 1, 4, 3, 2))
        else:
            dst.view(k, r // 128, 4, 32, c // 4).copy_(
                tmp.view(k, r // 128, c // 4, 32, 4).permute(0, 1, 4, 3, 2))
    return sf


def swizzle_sf_128x4_(sf: torch.Tensor, experts=None, chunk: int | None = None) -> torch.Tensor:
    """In place 128x4 swizzle (same storage); scratch is one chunk of experts."""
    return _sf_inplace(sf, experts, chunk, None, True)


def unswizzle_sf_128x4_(sf: torch.Tensor, experts=None, chunk: int | None = None) -> torch.Tensor:
    """In place inverse of `swizzle_sf_128x4_`."""
    return _sf_inplace(sf, experts, chunk, None, False)


def permute_rows_and_swizzle_sf_(sf: torch.Tensor, row_map: torch.Tensor, experts=None,
                                 chunk: int | None = None) -> torch.Tensor:
    """Scale prep in one pass: rows by `row_map`, then 128x4 swizzle, written straight back (one scratch copy;
    on CUDA one gather through `composed_sf_map`, no scratch)."""
    return _sf_inplace(sf, experts, chunk, row_map, True)


def unswizzle_sf_and_unpermute_rows_(sf: torch.Tensor, row_map: torch.Tensor, experts=None,
                                     chunk: int | None = None) -> torch.Tensor:
    """Exact inverse of `permute_rows_and_swizzle_sf_` with the same map (one pass on CUDA, two elsewhere)."""
    _check_inplace_sf(sf)
    if _sf_fast(sf, experts, row_map, False):
        return sf
    unswizzle_sf_128x4_(sf, experts, chunk)
    return unpermute_rows_(sf, row_map, experts, chunk)


# ----------------------------------------------------------------------------------------------------------------
# Block-major K (BF16 weights): [M, K] -> [K/bk, M, bk] per expert, on bytes
# ----------------------------------------------------------------------------------------------------------------

def _block_dims(t: torch.Tensor, block_k_bytes: int) -> tuple[int, int, int]:
    if t.dim() != 3:
        raise ValueError(f"block-major K needs [E, M, K], got shape {tuple(t.shape)}")
    kb = t.shape[2] * t.element_size()
    if block_k_bytes <= 0 or block_k_bytes % t.element_size() or kb % block_k_bytes:
        raise ValueError(
            f"cannot lay out [E, M, K] = {tuple(t.shape)} ({t.dtype}, {kb} bytes per row) block-major with "
            f"block_k_bytes={block_k_bytes}: row bytes must be a multiple of it; pad K to "
            f"{_round_up(kb, block_k_bytes) // t.element_size()} elements")
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


def _block_inplace(t, block_k_bytes, experts, chunk, row_map=None, inverse=False):
    e, m, kb = _block_dims(t, block_k_bytes)
    u8 = _bytes3d(t)
    nb, bk = kb // block_k_bytes, block_k_bytes
    runs, scratch = _plan(u8, t, row_map, experts, chunk)
    for s, stop in runs:
        k = stop - s
        tmp = scratch.load(s, stop)
        if inverse:  # block-major [k, nb, M, bk] -> [k, M, nb, bk]
            u8[s:stop].view(k, m, nb, bk).copy_(tmp.view(k, nb, m, bk).permute(0, 2, 1, 3))
        else:
            u8[s:stop].view(k, nb, m, bk).copy_(tmp.view(k, m, nb, bk).permute(0, 2, 1, 3))
    return t


def to_block_major_k_(t: torch.Tensor, block_k_bytes: int = 128, experts=None, chunk: int | None = None):
    """In place: t keeps shape [E, M, K] and storage, its bytes become block-major (see block_major_k_view)."""
    return _block_inplace(t, block_k_bytes, experts, chunk)


def from_block_major_k_(t: torch.Tensor, block_k_bytes: int = 128, experts=None, chunk: int | None = None):
    """In place inverse of `to_block_major_k_`."""
    return _block_inplace(t, block_k_bytes, experts, chunk, inverse=True)


def permute_rows_to_block_major_k_(t: torch.Tensor, row_map: torch.Tensor, block_k_bytes: int = 128,
                                   experts=None, chunk: int | None = None):
    """BF16 prep in one pass: rows by `row_map`, then block-major K, in place (one scratch copy per chunk)."""
    return _block_inplace(t, block_k_bytes, experts, chunk, row_map=row_map)


# ----------------------------------------------------------------------------------------------------------------
# Per-half padding of the gated intermediate
# ----------------------------------------------------------------------------------------------------------------

def pad_gated_halves(w13: torch.Tensor, ip: int) -> torch.Tensor:
    """[E, 2I, ...] in [up; gate] -> [E, 2*ip, ...]: up at rows [0, I), gate at [ip, ip+I), zeros elsewhere.

    The kernel splits GEMM1 output at innerDim/2 = ip, so padding only at the end (SGLang `_align_fp4_moe_weights`)
    would read gate rows as up rows whenever I != ip.
    """
    if w13.dim() < 2 or w13.shape[1] % 2:
        raise ValueError(f"gated w13 must be [E, 2I, ...] with an even row count, got shape {tuple(w13.shape)}")
    i = w13.shape[1] // 2
    if ip < i:
        raise ValueError(f"padded intermediate ip={ip} is smaller than I={i} (w13 shape {tuple(w13.shape)})")
    out = w13.new_zeros((w13.shape[0], 2 * ip, *w13.shape[2:]))
    out[:, :i] = w13[:, :i]
    out[:, ip:ip + i] = w13[:, i:]
    return out


def unpad_gated_halves(w13p: torch.Tensor, i: int) -> torch.Tensor:
    """Inverse of `pad_gated_halves`: [E, 2*ip, ...] -> [E, 2I, ...]."""
    if w13p.dim() < 2 or w13p.shape[1] % 2 or w13p.shape[1] // 2 < i:
        raise ValueError(f"padded gated w13 of shape {tuple(w13p.shape)} cannot hold two halves of I={i}")
    ip = w13p.shape[1] // 2
    return torch.cat([w13p[:, :i], w13p[:, ip:ip + i]], dim=1)
