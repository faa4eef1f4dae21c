"""In place: experts cut into chunks of consecutive slices, one reused scratch per call, rows gathered on the
byte view (so one row map serves packed FP4, FP8 and BF16 alike), storage and `data_ptr()` unchanged."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .fastpath import fast_path_for
from .maps import Experts, closed_block, expert_ids, expert_ids_tensor, invert_map, map_i32

_SCRATCH_PEAK = [0]

#: every byte move of the plugin's own (layouts, kernel scalars): `Tensor.copy_` as torch defines it, never a
#: replacement of `torch.Tensor.copy_` someone installed for the writes of a load (verl's delta loader masks NaN
#: sources in one and records every destination in another): a custom loader sees SGLang's writes, not the plugin's
#: layout moves (tests/test_custom_loaders.py)
copy_bytes_ = torch._C.TensorBase.copy_


def _note_scratch(*tensors: torch.Tensor) -> None:
    n = sum(t.numel() * t.element_size() for t in tensors)
    if n > _SCRATCH_PEAK[0]:
        _SCRATCH_PEAK[0] = n


def scratch_peak_bytes() -> int:
    """Largest scratch (temporary copies + index tensors alive together) any in-place transform allocated."""
    return _SCRATCH_PEAK[0]


def reset_scratch_peak() -> None:
    _SCRATCH_PEAK[0] = 0


def bytes3d(t: torch.Tensor, name: str = "t") -> torch.Tensor:
    """[E, M, ...] -> its uint8 view [E, M, row_bytes]; same storage, so writes land in `t`."""
    if t.dim() < 2:
        raise ValueError(f"{name} must be [E, M, ...] with a leading expert dim, got shape {tuple(t.shape)}")
    if not t.is_contiguous():
        raise ValueError(
            f"{name} of shape {tuple(t.shape)} must be contiguous to be laid out in place; "
            "parameters are allocated contiguous, pass the parameter itself, not a view of it"
        )
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


def _expert_runs(num_experts: int, experts: Experts, chunk: int | None) -> list[tuple[int, int]]:
    """[start, stop) expert slices: consecutive runs of the requested experts, cut to at most `chunk` experts."""
    if chunk is None:
        chunk = max(1, num_experts // 8)
    if chunk < 1:
        raise ValueError(f"chunk must be >= 1 expert, got {chunk}")
    ids = expert_ids(num_experts, experts)
    runs: list[tuple[int, int]] = []
    run_start: int | None = None
    prev = 0  # read only while a run is open, i.e. after the first id
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


def check_row_map(row_map: torch.Tensor, m: int, t: torch.Tensor) -> torch.Tensor:
    if row_map.dim() != 1 or row_map.numel() != m:
        raise ValueError(
            f"row map of shape {tuple(row_map.shape)} does not fit tensor rows M={m} "
            f"(tensor shape {tuple(t.shape)}); build it for M={m}"
        )
    if row_map.device != t.device:
        row_map = row_map.to(t.device)
    return row_map.long()


class _Scratch:
    """One scratch buffer per in-place call, reused by every chunk of experts.

    A fresh allocation per chunk pays page faults on first touch: measured on the 2-core CPU, an out-of-place
    index_select ran at 2.9 GB/s and the same gather into a preallocated buffer at 19 GB/s.
    Rows are gathered flat (`[E*M, C].index_select(0, map + e*M)`, the fastest gather measured on CPU:
    benchmarks/layouts_cpu.py); rows under 64 bytes gather along dim 1 instead, where a flat int64 index would be
    bigger than the data.
    """

    def __init__(self, u8: torch.Tensor, runs: Sequence[tuple[int, int]], row_map: torch.Tensor | None = None) -> None:
        e, m, c = u8.shape
        k = max((t - s for s, t in runs), default=0)
        self.u8, self.m, self.c, self.row_map = u8, m, c, row_map
        self.buf = torch.empty((k, m, c), dtype=torch.uint8, device=u8.device)
        self.flat = row_map is not None and c >= 64
        parts = [self.buf]
        if self.flat and row_map is not None:
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
            copy_bytes_(out, self.u8[s:t])
        elif self.flat:
            src = torch.add(self.base[:k], s * m, out=self.src[:k])
            torch.index_select(self.u8.view(-1, c), 0, src.view(-1), out=out.view(k * m, c))
        else:
            torch.index_select(self.u8[s:t], 1, self.row_map, out=out)
        return out


def plan(
    u8: torch.Tensor, t: torch.Tensor, row_map: torch.Tensor | None, experts: Experts, chunk: int | None
) -> tuple[list[tuple[int, int]], _Scratch]:
    """Every in-place transform starts alike: check the row map (if any), cut the experts into chunks, take one
    scratch sized for the largest chunk."""
    if row_map is not None:
        row_map = check_row_map(row_map, u8.shape[1], t)
    runs = _expert_runs(u8.shape[0], experts, chunk if chunk is not None else _default_chunk(u8))
    return runs, _Scratch(u8, runs, row_map)


def permute_rows_(
    t: torch.Tensor, row_map: torch.Tensor, experts: Experts = None, chunk: int | None = None
) -> torch.Tensor:
    """In place: t[e] = t[e][row_map] for each selected expert; storage and shape unchanged.

    On CUDA one Triton pass (no scratch, `chunk` unused); elsewhere gather a chunk of experts into scratch, copy
    back."""
    u8 = bytes3d(t)
    fast = fast_path_for(u8)
    if fast is not None:
        row_map = check_row_map(row_map, u8.shape[1], t)
        eids = expert_ids_tensor(u8.shape[0], experts, u8.device)
        if fast.permute_rows_(u8.view(torch.int32), map_i32(row_map), eids, closed_block(row_map)):
            return t
    runs, scratch = plan(u8, t, row_map, experts, chunk)
    for start, stop in runs:
        copy_bytes_(u8[start:stop], scratch.load(start, stop))
    return t


def unpermute_rows_(
    t: torch.Tensor, row_map: torch.Tensor, experts: Experts = None, chunk: int | None = None
) -> torch.Tensor:
    """Exact inverse of `permute_rows_` with the same map."""
    u8 = bytes3d(t)
    return permute_rows_(t, invert_map(check_row_map(row_map, u8.shape[1], t)), experts, chunk)
