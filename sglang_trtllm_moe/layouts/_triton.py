"""Triton kernels for the in-place layouts on CUDA: one pass over the bytes, no scratch tensor.

Why: the pure-torch in-place scheme (layouts.py) gathers a chunk of experts into scratch and copies it back, so every
byte crosses device memory twice (at best 50 % of the copy bandwidth counting each byte once), and the 128x4 scale
swizzle moves 4-byte groups with strided copies (measured at 12-28 % of the copy on an H200). Here each program
loads its piece of the *destination* straight from the source (the row map and, for block scales, the 128x4 swizzle
composed into one gather), and stores it once.

In place needs one rule: no byte of a "closed set" may be written before every byte of that set has been read. A
closed set is a block of rows the row map keeps to itself (w2 and its scales: 32-row shuffle blocks, so one 128-row
tile; gated w13: the whole expert, because the gate and up halves interleave), restricted to a column slice where
the layout keeps columns apart (weights; the 128x4 swizzle mixes the columns of a tile, so scale sets take every
column). When one program holds a whole set it reads, syncs its threads and writes. Otherwise the set's G programs
meet at a counter in device memory (arrive with release, spin with acquire, as torch inductor's grid barrier does)
before any of them writes. Deadlock freedom does not rely on block scheduling order: programs take (set, part)
tickets from an atomic counter in the order they start, so only the newest set can be incomplete and every other
resident program finishes; the only requirement is that G programs fit on the GPU at once, checked before launch
(`_fits`; a DeepSeek-V3 layer needs G = 32 for a 256-byte column slice of a gated w13 expert and G = 56 for an
expert's w13 scales, each program holding 32 KiB; w2 and its scales have G = 1). Measured on an H200 (132 SMs):
the whole NVFP4 layer at 90 % of the device copy bandwidth in GPU time; see docs/PERFORMANCE.md.

Bit-identical to the pure-torch reference (tests/test_layouts_cuda.py on CUDA; tests/test_layouts.py checks the
composed maps and, under TRITON_INTERPRET=1, these kernels on CPU when one program covers a set).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

#: Tile sizes, in 4-byte words. Set by the benchmark to compare variants; the defaults are what it measured best.
CONFIG = {
    "rows_tile_words": 8192,  # words one program of the row kernel holds (32 KiB)
    "rows_slice_words": 64,  # column slice width of a row-kernel set (256 bytes of each row)
    "sf_cols": 16,  # column words (4 scales each) per program of the scale kernel
    "sf_tiles": 4,  # 128-row tiles per program of the scale kernel (4 x 128 rows x 16 words = 32 KiB)
    "num_warps": 4,
    "programs_per_sm": 8,  # sets of G > 1 programs: a persistent grid of this many per SM (0: one per item)
    "tickets": True,  # sets of G > 1 programs: (set, part) from an atomic counter in start order; False: program id
}


# Inside a @triton.jit function every runtime argument, pointer or scalar, is a `tl.tensor`; that is how they are
# annotated below. Never annotate one `int`, `bool` or `float`: Triton reads such annotations as a fixed argument
# type (`int` -> i32) and would stop specialising those arguments on their values.


@triton.jit
def _first_ticket(sync_ptr: tl.tensor, TICKETS: tl.constexpr) -> tl.tensor:
    if TICKETS:
        return tl.atomic_add(sync_ptr, 1)
    else:
        return tl.program_id(0)


@triton.jit
def _next_ticket(sync_ptr: tl.tensor, t: tl.tensor, total: tl.tensor, TICKETS: tl.constexpr) -> tl.tensor:
    if TICKETS:
        return tl.atomic_add(sync_ptr, 1)
    else:  # one (set, part) per program; relies on blocks starting in index order
        return t + total


@triton.jit
def _arrive_and_wait(sync_ptr: tl.tensor, set_id: tl.tensor, G: tl.constexpr) -> None:
    """All G programs of a set have loaded before any of them stores (G == 1: the threads of this program)."""
    tl.debug_barrier()
    if G > 1:
        cnt = tl.atomic_add(sync_ptr + 1 + set_id, 1, sem="acq_rel") + 1
        while cnt < G:
            cnt = tl.atomic_add(sync_ptr + 1 + set_id, 0, sem="acquire")
        tl.debug_barrier()


@triton.jit
def _rows_kernel(
    x_ptr: tl.tensor,
    map_ptr: tl.tensor,
    eid_ptr: tl.tensor,
    sync_ptr: tl.tensor,
    total: tl.tensor,
    M: tl.tensor,
    CW: tl.tensor,
    NS: tl.tensor,
    G: tl.constexpr,
    ROWS: tl.constexpr,
    W: tl.constexpr,
    TICKETS: tl.constexpr,
) -> None:
    """x[e, r, :] = x[e, map[r], :] for the experts in eid; x is [E, M, CW] words, sets = (expert, G*ROWS-row
    block, W-word column slice), each set split into G parts of ROWS rows."""
    t = _first_ticket(sync_ptr, TICKETS)
    while t < total:
        set_id = t // G
        part = t % G
        s = set_id % NS
        rest = set_id // NS
        nrb = M // (ROWS * G)
        rb = rest % nrb
        e = tl.load(eid_ptr + rest // nrb).to(tl.int64)
        base = x_ptr + e * M * CW
        rows = rb * (ROWS * G) + part * ROWS + tl.arange(0, ROWS)
        cols = s * W + tl.arange(0, W)
        cmask = (cols < CW)[None, :]
        src_rows = tl.load(map_ptr + rows)
        vals = tl.load(base + src_rows[:, None] * CW + cols[None, :], mask=cmask)
        _arrive_and_wait(sync_ptr, set_id, G)
        tl.store(base + rows[:, None] * CW + cols[None, :], vals, mask=cmask)
        t = _next_ticket(sync_ptr, t, total, TICKETS)


@triton.jit
def _sf_kernel(
    x_ptr: tl.tensor,
    map_ptr: tl.tensor,
    eid_ptr: tl.tensor,
    sync_ptr: tl.tensor,
    total: tl.tensor,
    M: tl.tensor,
    C4: tl.tensor,
    NKB: tl.tensor,
    G: tl.constexpr,
    K: tl.constexpr,
    TILES: tl.constexpr,
    HAS_MAP: tl.constexpr,
    INVERSE: tl.constexpr,
    TICKETS: tl.constexpr,
) -> None:
    """Block scales as [E, M, C4] words (4 one-byte scales each). Forward: linear rows map[r] -> 128x4-swizzled
    position of row r; INVERSE: back (a scatter to rows map[r]). Sets = (expert, block of G/NKB*TILES tiles of 128
    rows); each program takes TILES tiles x K column words; in the swizzled layout that is TILES runs of 128*K
    contiguous words."""
    t = _first_ticket(sync_ptr, TICKETS)
    while t < total:
        set_id = t // G
        part = t % G
        kb = part % NKB
        tpb = (G // NKB) * TILES
        nblk = M // (128 * tpb)
        blk = set_id % nblk
        e = tl.load(eid_ptr + set_id // nblk).to(tl.int64)
        base = x_ptr + e * M * C4
        tile0 = blk * tpb + (part // NKB) * TILES
        r = tl.arange(0, TILES * 128)  # rows of TILES tiles: (tile, r4, r32)
        cols = kb * K + tl.arange(0, K)
        cmask = (cols < C4)[None, :]
        lin_rows = tile0 * 128 + r
        if HAS_MAP:
            lin_rows = tl.load(map_ptr + lin_rows)
        lin_ptrs = base + lin_rows[:, None] * C4 + cols[None, :]  # [TILES*128, K]
        j = tl.arange(0, 128 * K)  # swizzled order within a tile: [K, 32 (r32), 4 (r4)]
        tt = tl.arange(0, TILES)
        swz_ptrs = base + (tile0 + tt)[:, None] * (128 * C4) + kb * K * 128 + j[None, :]  # [TILES, 128*K]
        smask = (kb * K + j // 128 < C4)[None, :]
        if INVERSE:
            v = tl.load(swz_ptrs, mask=smask)
            v = tl.reshape(tl.permute(tl.reshape(v, (TILES, K, 32, 4)), (0, 3, 2, 1)), (TILES * 128, K))
            _arrive_and_wait(sync_ptr, set_id, G)
            tl.store(lin_ptrs, v, mask=cmask)
        else:
            v = tl.load(lin_ptrs, mask=cmask)
            v = tl.reshape(tl.permute(tl.reshape(v, (TILES, 4, 32, K)), (0, 3, 2, 1)), (TILES, 128 * K))
            _arrive_and_wait(sync_ptr, set_id, G)
            tl.store(swz_ptrs, v, mask=smask)
        t = _next_ticket(sync_ptr, t, total, TICKETS)


def _cdiv(a: int, b: int) -> int:  # host arithmetic in plain Python: triton.cdiv is a JIT function, slow to call
    return -(-a // b)


def _next_pow2(x: int) -> int:
    return 1 << (max(1, int(x)) - 1).bit_length()


def _pow2_floor(x: int) -> int:
    return 1 << (max(1, int(x)).bit_length() - 1)


def _pow2_divisor(x: int, cap: int) -> int:
    """Largest power of two <= cap dividing x."""
    d = 1
    while d * 2 <= cap and x % (d * 2) == 0:
        d *= 2
    return d


def _sms(device: torch.device) -> int:
    if device.type != "cuda":  # Triton's CPU interpreter (tests)
        return 132
    return torch.cuda.get_device_properties(device).multi_processor_count


def _tickets(g: int) -> bool:
    """Programs that wait for others take tickets in start order; a lone program needs none (one per program id)."""
    return g > 1 and bool(CONFIG["tickets"])


def _grid(total: int, g: int, device: torch.device) -> int:
    pps = CONFIG["programs_per_sm"]
    if pps <= 0 or not _tickets(g):
        return max(1, total)
    return max(1, min(total, max(g, pps * _sms(device))))


def _fits(g: int, device: torch.device) -> bool:
    """A set's G programs wait for each other, so all of them must be resident at once: allow 8 warps per SM (2
    programs of 4 warps fit even at 255 registers a thread, the most there is; 64K registers per SM). Larger sets
    take the torch path; none in the models we know (DeepSeek-V3 w13 scales: 56 programs per expert at the default
    tiles; 132 SMs allow 264)."""
    return g <= max(1, 8 // CONFIG["num_warps"]) * _sms(device)


def rows_plan(m: int, cw: int, block: int) -> tuple[int, int, int, int]:
    """(G, ROWS, W, NS) for the row kernel: `block` is the row map's closed block (rows it keeps to themselves)."""
    w = min(CONFIG["rows_slice_words"], _next_pow2(cw))
    rows = _pow2_divisor(block, max(1, CONFIG["rows_tile_words"] // w))
    g = block // rows
    if g == 1:  # one program holds its block: widen the slice instead of splitting rows
        w = min(_next_pow2(cw), max(w, CONFIG["rows_tile_words"] // rows))
    return g, rows, w, _cdiv(cw, w)


def sf_plan(m: int, c4: int, block: int, word_bytes: int = 4) -> tuple[int, int, int, int, int]:
    """(G, K, NKB, TILES, set rows) for the scale kernel; `block` = closed rows, a multiple of 128. `word_bytes`: 8
    for the int64 words of 2-byte scales (INT4's bf16), which hold a program to the same bytes with half the tiles."""
    wide = max(1, word_bytes // 4)
    if block == 128 and 128 * _next_pow2(c4) * wide <= 8192:  # one program per tile: no barrier (w2 scales)
        k = _next_pow2(c4)
    else:
        k = _pow2_divisor(c4, CONFIG["sf_cols"])
        if k < 8:
            k = min(CONFIG["sf_cols"], _next_pow2(c4))
    nkb = _cdiv(c4, k)
    tiles = max(1, _pow2_floor(CONFIG["sf_tiles"]) // wide)  # a program may hold several closed blocks, or part of one
    while tiles > 1 and m % math.lcm(block, 128 * tiles):
        tiles //= 2
    set_rows = math.lcm(block, 128 * tiles)
    return (set_rows // (128 * tiles)) * nkb, k, nkb, tiles, set_rows


def _sync(n_sets: int, g: int, device: torch.device, dummy: torch.Tensor) -> torch.Tensor:
    """[ticket, arrivals per set] for sets that wait; lone programs need no counter (any pointer will do)."""
    if not _tickets(g) and g == 1:
        return dummy
    return torch.zeros(1 + (n_sets if g > 1 else 0), dtype=torch.int32, device=device)


def permute_rows_(x32: torch.Tensor, map32: torch.Tensor, eids: torch.Tensor, block: int) -> bool:
    """x32: [E, M, CW] int32 (a view of the parameter); map32: [M] int32 source row of each row; eids: int32.
    False (nothing done) when a set would need more programs than fit on the GPU at once."""
    _, m, cw = x32.shape
    g, rows, w, ns = rows_plan(m, cw, block)
    if not _fits(g, x32.device):
        return False
    n_sets = eids.numel() * (m // (rows * g)) * ns
    total = n_sets * g
    if total == 0:
        return True
    sync = _sync(n_sets, g, x32.device, eids)
    _rows_kernel[(_grid(total, g, x32.device),)](
        x32,
        map32,
        eids,
        sync,
        total,
        m,
        cw,
        ns,
        G=g,
        ROWS=rows,
        W=w,
        TICKETS=_tickets(g),
        num_warps=CONFIG["num_warps"],
    )
    return True


def sf_(x32: torch.Tensor, map32: torch.Tensor | None, eids: torch.Tensor, block: int, inverse: bool) -> bool:
    """x32: [E, M, C4] words of the scales (int32: four 1-byte scales; int64: four 2-byte ones); map32: [M] int32 row
    map or None; block: closed rows (% 128 == 0). False (nothing done) when a set would need more programs than fit
    on the GPU at once."""
    _, m, c4 = x32.shape
    g, k, nkb, tiles, set_rows = sf_plan(m, c4, block, x32.element_size())
    if not _fits(g, x32.device):
        return False
    n_sets = eids.numel() * (m // set_rows)
    total = n_sets * g
    if total == 0:
        return True
    sync = _sync(n_sets, g, x32.device, eids)
    _sf_kernel[(_grid(total, g, x32.device),)](
        x32,
        map32 if map32 is not None else eids,
        eids,
        sync,
        total,
        m,
        c4,
        nkb,
        G=g,
        K=k,
        TILES=tiles,
        HAS_MAP=map32 is not None,
        INVERSE=inverse,
        TICKETS=_tickets(g),
        num_warps=CONFIG["num_warps"],
    )
    return True
