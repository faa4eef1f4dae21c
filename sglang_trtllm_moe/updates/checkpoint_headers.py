"""A safetensors checkpoint directory as SGLang's disk update will read it: every tensor's name, dtype and shape
from the file headers (no data read), whether each file holds all the bytes its header promises, and — for the
tensors whose values validation checks — the values, read one tensor at a time.

`update_weights_from_disk` lets SGLang return every layer to checkpoint layout before it reads the first tensor
(0.5.23 `restore_weights_before_loading`), and on a failure it rolls back by loading the same path again: one
malformed tensor leaves the model in checkpoint layout, or half old and half new. So the whole directory is checked
before SGLang touches the model (checkpoint_checks.check_checkpoint): names, dtypes and shapes from the headers; a
file shorter than its header says (a shard still being written, a copy cut short) refused; and every scale of a
layer the plugin manages or watches read and value-checked (all of them, of any size: NVFP4 block scales are 1/8 of
the packed weight bytes, FP8 block scales 1/16384 of the weight's), streamed: at most `CHUNK_BYTES` of values held at
a time, read straight into one buffer per chunk (one positioned read per tensor; a file that became shorter than its
header says since is an error, not a crash).
"""

from __future__ import annotations

import glob
import json
import math
import os
import struct
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

import torch

#: safetensors header dtype codes -> torch dtypes (the ones a MoE checkpoint holds; others are skipped)
DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
if hasattr(torch, "float8_e8m0fnu"):
    DTYPES["F8_E8M0"] = torch.float8_e8m0fnu

#: load formats whose weights come from *.safetensors files of the directory (SGLang's DefaultModelLoader)
SAFETENSORS_FORMATS = (None, "auto", "safetensors")

#: a safetensors header is at most this long (the format's own limit: 100 MB)
MAX_HEADER = 100_000_000
#: `read_tensors` reads at most this many bytes into one buffer
CHUNK_BYTES = 64 * 2**20


def files_of(model_path, load_format) -> list[str]:
    """The *.safetensors files SGLang would read for (model_path, load_format); [] when it would not read local
    safetensors (a hub id, .bin / .pt weights, another loader): those are left to the per-tensor checks."""
    if load_format not in SAFETENSORS_FORMATS or not isinstance(model_path, str) or not os.path.isdir(model_path):
        return []
    return sorted(glob.glob(os.path.join(model_path, "*.safetensors")))


@dataclass
class Headers:
    """What the headers of a checkpoint's files say."""

    #: (name, meta tensor of the header's dtype and shape: one object per dtype and shape), file by file, in header
    #: order
    tensors: list[tuple[str, torch.Tensor]]
    #: name -> the file holding it
    file_of: dict[str, str]
    #: files that cannot be read whole: "<file>: <why>"
    problems: list[str]
    #: name -> (first byte, end) of its data in its file
    spans: dict[str, tuple[int, int]] = field(default_factory=dict)


def _header(path: str) -> tuple[dict, int]:
    """(the parsed JSON header, the byte offset where the data starts)."""
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ValueError(f"{len(head)} bytes, shorter than a safetensors header")
        (n,) = struct.unpack("<Q", head)
        if n > MAX_HEADER:
            raise ValueError(f"header length {n} is not a safetensors header")
        raw = f.read(n)
        if len(raw) < n:
            raise ValueError(f"the header is cut short ({len(raw)} of {n} bytes)")
    return json.loads(raw), 8 + n


def read_headers(files: Iterable[str], keep: Callable[[str], bool] | None = None) -> Headers:
    """Every tensor of `files` whose name `keep` accepts (all when None) as a meta tensor, and a problem for every file
    that is shorter than its header says or whose header cannot be read."""
    out = Headers([], {}, [])
    metas: dict = {}  # (dtype, shape) -> one meta tensor for every tensor of that header (read only: shared)
    for path in files:
        try:
            header, start = _header(path)
            size = os.path.getsize(path)
        except (OSError, ValueError) as e:
            out.problems.append(f"{path}: cannot be read as safetensors ({type(e).__name__}: {e})")
            continue
        end = start
        for name, info in header.items():
            if name == "__metadata__" or not isinstance(info, dict):
                continue
            offsets = info.get("data_offsets") or (0, 0)
            end = max(end, start + int(offsets[1]))
            if keep is not None and not keep(name):
                continue
            dtype = DTYPES.get(str(info.get("dtype")))
            if dtype is None:
                continue
            shape = tuple(int(d) for d in info.get("shape", ()))
            if int(offsets[1]) - int(offsets[0]) != math.prod(shape) * dtype.itemsize:
                out.problems.append(
                    f"{path}: {name}: its header gives {shape} {info.get('dtype')} in "
                    f"{int(offsets[1]) - int(offsets[0])} bytes"
                )
                continue
            meta = metas.get((dtype, shape))
            if meta is None:
                meta = metas[(dtype, shape)] = torch.empty(shape, dtype=dtype, device="meta")
            out.tensors.append((name, meta))
            out.file_of[name] = path
            out.spans[name] = (start + int(offsets[0]), start + int(offsets[1]))
        if size < end:
            out.problems.append(
                f"{path}: truncated: {size} bytes, its header says {end} (a shard still being written, or a copy cut "
                "short)"
            )
    return out


def read_tensors(headers: Headers, names: Iterable[str]) -> Iterator[tuple[str, torch.Tensor]]:
    """The values of `names` (CPU tensors of their headers' dtypes and shapes), file by file in file order, read into
    one buffer per `CHUNK_BYTES` (the tensors yielded are views of it). Raises OSError when a file no longer holds the
    bytes its header promised."""
    by_file: dict[str, list[str]] = {}
    for name in names:
        by_file.setdefault(headers.file_of[name], []).append(name)
    metas = dict(headers.tensors)
    for path, wanted in by_file.items():
        wanted.sort(key=lambda n: headers.spans[n][0])
        with open(path, "rb", buffering=0) as f:
            chunk: list[str] = []
            size = 0
            for name in wanted:
                start, end = headers.spans[name]
                n = -(-(end - start) // 8) * 8  # every tensor 8-byte aligned in the buffer
                if chunk and size + n > CHUNK_BYTES:
                    yield from _read_chunk(f, path, chunk, headers.spans, metas, size)
                    chunk, size = [], 0
                chunk.append(name)
                size += n
            if chunk:
                yield from _read_chunk(f, path, chunk, headers.spans, metas, size)


def _read_chunk(f, path: str, names: list[str], spans: dict, metas: dict, size: int):
    buf = torch.empty(max(size, 8), dtype=torch.uint8)
    mv = memoryview(buf.numpy())  # type: ignore[arg-type]  # numpy arrays are buffers
    typed: dict = {}
    at = 0
    placed = []
    for name in names:
        start, end = spans[name]
        n = end - start
        got = _read_into(f, mv[at : at + n], start)
        if got != n:
            raise OSError(
                f"{path}: {name}: {got} of its {n} bytes could be read (the file changed after its header was read)"
            )
        placed.append((name, at))
        at += -(-n // 8) * 8
    for name, at in placed:
        meta = metas[name]
        dtype = meta.dtype
        base = typed.get(dtype)
        if base is None:
            base = typed[dtype] = buf.view(dtype)
        shape = tuple(meta.shape)
        stride, acc = [], 1
        for d in reversed(shape):
            stride.append(acc)
            acc *= d
        yield name, torch.as_strided(base, shape, tuple(reversed(stride)), at // dtype.itemsize)


def _read_into(f, view: memoryview, offset: int) -> int:
    """Bytes read into `view` from `offset` (fewer only at the end of the file)."""
    done = 0
    while done < len(view):
        if hasattr(os, "preadv"):
            got = os.preadv(f.fileno(), [view[done:]], offset + done)
        else:
            f.seek(offset + done)
            got = f.readinto(view[done:]) or 0
        if not got:
            break
        done += got
    return done


def meta_tensors(files, keep=None) -> list[tuple[str, torch.Tensor]]:
    """[(name, meta tensor)] of every tensor in `files` whose name `keep` accepts (all when None)."""
    return read_headers(files, keep).tensors


__all__ = ["DTYPES", "Headers", "SAFETENSORS_FORMATS", "files_of", "meta_tensors", "read_headers", "read_tensors"]
