"""Index maps of the TRT-LLM-Gen layouts and their cache: which source row (or 4-byte scale word) each
prepared row comes from, per shape and device, with inverses; `clear_caches()` drops them all (sglang#28676).
Formulas: flashinfer 0.7.2 `get_reorder_rows_for_gated_act_gemm_row_indices`, `get_shuffle_matrix_a_row_indices`
and the TRT-LLM `get_sf_out_offset_128x4` swizzle (SGLang `swizzle_blockscale`)."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Sequence
from typing import TypeAlias, TypeVar, cast

import torch
from torch.types import Device

SF_ROW_TILE = 128
SF_COL_TILE = 4
GATED_ALIGN = 16
NON_GATED_ALIGN = 128

#: the experts a transform touches: None (all of them), or their ids (a tensor or any iterable of ints)
Experts: TypeAlias = "torch.Tensor | Iterable[int] | None"

_T = TypeVar("_T")


def round_up(x: int, m: int) -> int:
    return (x + m - 1) // m * m


def padded_intermediate(i: int, gated: bool, align: int | None = None) -> int:
    """The per-rank intermediate `i` rounded up to `align` (per half for gated w13). Default: the kernel's own tiling,
    16-row (gated, per half) or 128-row (non-gated) units; a weight format passes the alignment SGLang allocates its
    layers with (`WeightFormat.intermediate_align`, a multiple of the kernel's: `WeightFormat.padded_intermediate`)."""
    if i <= 0:
        raise ValueError(f"intermediate size must be positive, got {i}")
    if align is None:
        align = GATED_ALIGN if gated else NON_GATED_ALIGN
    return round_up(int(i), align)


# key -> map; (id(map), what) -> (map, derived value: its inverse, its closed block, its int32 copy). Holding `map`
# in the second dict keeps its id() from being reused.
_MAPS: dict[tuple, torch.Tensor] = {}
_DERIVED: dict[tuple[int, str], tuple[torch.Tensor, object]] = {}
#: loaders run on thread pools (DeepSeek) and `clear_caches` runs at every update entry point: the two dicts
#: change together, never while another thread iterates them
CACHE_LOCK = threading.RLock()


def norm_device(device: Device) -> torch.device:
    """'cuda' and 'cuda:N' must be one cache entry per physical device, never a map on the wrong GPU."""
    dev = torch.device("cpu" if device is None else device)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    return dev


def clear_caches() -> None:
    """Drop every cached index map on every device: call on weight reload / engine resume (sglang#28676)."""
    with CACHE_LOCK:
        _MAPS.clear()
        _DERIVED.clear()
        _EIDS.clear()


def cached(key: tuple, build: Callable[[], torch.Tensor], cache: bool = True) -> torch.Tensor:
    """The map `build()` makes, on the device `key[-1]`, kept under `key` until `clear_caches()`. `cache=False`: made
    afresh and kept nowhere (a map first made inside CUDA-graph capture holds its values only in the graph's replays,
    so it must not serve later calls; the emulator's forward asks for its maps that way)."""
    if not cache:
        return build().to(key[-1])
    with CACHE_LOCK:
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
            f"M must be a positive multiple of {b}; pad to {round_up(max(m, 1), b)} rows "
            f"(pad the intermediate with padded_intermediate(), per half for gated w13)"
        )


# The maps are built on their device from torch.arange (no host->device copy), so `cache=False` serves code that runs
# under CUDA-graph capture (see `cached`).


def gated_reorder_map(m: int, device: Device = None, cache: bool = True) -> torch.Tensor:
    """[top; bottom] halves -> rows t0,b0,t1,b1,... so one tile load holds matching up and gate rows."""
    if m <= 0 or m % 2:
        raise ValueError(f"gated w13 needs an even row count (2 halves), got M={m}; pad each half to the same size")
    dev = norm_device(device)

    def build() -> torch.Tensor:
        half = torch.arange(m // 2, dtype=torch.long, device=dev)
        return torch.stack([half, half + m // 2], dim=1).reshape(m)

    return cached(("reorder", m, True, None, dev), build, cache)


def shuffle_map(m: int, epilogue_tile_m: int = 128, device: Device = None, cache: bool = True) -> torch.Tensor:
    """flashinfer `shuffle_matrix_a` rows: within each block of b rows, out row d = in row (d % 8) * (b/8) + d // 8.

    Closed form of inverting flashinfer's srcToDstBlk{16,32}RowMap (src s goes to (s % k) * 8 + s // k, k = b/8).
    """
    _check_shuffle_rows(m, epilogue_tile_m)
    dev = norm_device(device)
    b = shuffle_block_size(epilogue_tile_m)

    def build() -> torch.Tensor:
        d = torch.arange(m, dtype=torch.long, device=dev)
        within = d % b
        return d - within + (within % 8) * (b // 8) + within // 8

    return cached(("shuffle", m, None, epilogue_tile_m, dev), build, cache)


def w13_row_map(
    m: int, gated: bool, device: Device = None, epilogue_tile_m: int = 128, cache: bool = True
) -> torch.Tensor:
    """GEMM1 rows (weights and scale rows alike): gated = reorder then shuffle (idx_R[idx_S]); else shuffle."""
    if not gated:
        return shuffle_map(m, epilogue_tile_m, device, cache)
    _check_shuffle_rows(m, epilogue_tile_m, "gated w13 rows")
    dev = norm_device(device)
    return cached(
        ("w13", m, True, epilogue_tile_m, dev),
        lambda: gated_reorder_map(m, dev, cache)[shuffle_map(m, epilogue_tile_m, dev, cache)],
        cache,
    )


def w2_row_map(m: int, device: Device = None, epilogue_tile_m: int = 128, cache: bool = True) -> torch.Tensor:
    """GEMM2 rows (m = hidden): shuffle only; kept as its own name so callers never pass `gated` by mistake."""
    return shuffle_map(m, epilogue_tile_m, device, cache)


def _derived(idx: torch.Tensor, what: str, build: Callable[[], _T]) -> _T:
    """A value computed from a map, cached while the map itself is one of this module's cached maps."""
    with CACHE_LOCK:
        hit = _DERIVED.get((id(idx), what))
        if hit is not None and hit[0] is idx:
            return cast(_T, hit[1])
        value = build()
        # maps of the cache, and maps derived from them (the inverse's closed block, its int32 copy)
        if any(v is idx for v in _MAPS.values()) or any(d[1] is idx for d in _DERIVED.values()):
            _DERIVED[(id(idx), what)] = (idx, value)
        return value


def invert_map(idx: torch.Tensor) -> torch.Tensor:
    """inv with in[r] = out[inv[r]] for out = in[idx]. Cached for maps that come from this module's cache."""

    def build() -> torch.Tensor:  # scatter == argsort for a permutation, in O(M)
        inv = torch.empty_like(idx)
        inv[idx] = torch.arange(idx.numel(), dtype=idx.dtype, device=idx.device)
        return inv

    return _derived(idx, "inverse", build)


def closed_block(idx: torch.Tensor) -> int:
    """Smallest B dividing M such that the row map keeps every B-row block to itself (idx[r] // B == r // B).

    In place, a block is the unit that must be read completely before any of it is written: 32 for the w2 shuffle,
    M for gated w13 (the halves interleave). Cached with the map."""

    def build() -> int:
        m = idx.numel()
        rows = torch.arange(m)
        src = idx.detach().to("cpu", torch.long)
        for b in range(1, m + 1):
            if m % b == 0 and torch.equal(src // b, rows // b):
                return b
        return m

    return _derived(idx, "closed_block", build)


def map_i32(idx: torch.Tensor) -> torch.Tensor:
    return _derived(idx, "int32", lambda: idx.to(torch.int32).contiguous())


def composed_sf_map(row_map: torch.Tensor | None, m: int, c: int, device: Device = None) -> torch.Tensor:
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


_EIDS: dict[tuple, torch.Tensor] = {}  # (ids, device) -> int32 ids on that device; a prep re-uses them per param


def expert_ids_tensor(num_experts: int, experts: Experts, device: Device) -> torch.Tensor:
    ids = tuple(expert_ids(num_experts, experts))
    key = (ids if experts is not None else ("all", num_experts), norm_device(device))
    with CACHE_LOCK:
        hit = _EIDS.get(key)
        if hit is None:
            hit = torch.tensor(ids, dtype=torch.int32).to(key[1])
            if len(_EIDS) < 64:  # kept until clear_caches (never freed under a kernel that may still read it)
                _EIDS[key] = hit
        return hit


def expert_ids(num_experts: int, experts: Experts) -> Sequence[int]:
    """Sorted, validated expert ids (a range when all)."""
    if experts is None:
        return range(num_experts)
    ids = experts.tolist() if isinstance(experts, torch.Tensor) else list(experts)
    ids = sorted(int(i) for i in ids)
    if any(i < 0 or i >= num_experts for i in ids) or len(set(ids)) != len(ids):
        raise ValueError(f"experts must be distinct ids in [0, {num_experts}), got {ids}")
    return ids
