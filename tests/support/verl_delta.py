"""verl 0.9.1's sparse delta weight sync (`delta_sharded`) for the tests: its receiver and its sender code, unchanged,
from the wheel on PyPI; only its transport (ray, ZMQ, an NCCL broadcast) stood in.

The receiver: `verl/workers/rollout/sglang_rollout/delta_loader.py` `apply_delta`, which a server registers with
`--custom-weight-loader` and a client names as the `load_format` of `update_weights_from_tensor`; SGLang imports it
in every scheduler process. verl's own package `__init__` files pull in ray (and much more), so `make_site(dir)`
extracts only the files the loader imports — `delta_loader.py` and `checkpoint_engine/delta_sync/` — from the wheel
into a test-side site with empty parent `__init__.py` files; that directory goes on the server's PYTHONPATH. Nothing
of verl is committed here: `ci/make-env` downloads the wheel once into the env root (`ensure_verl`) and `wheel()`
finds it there (or at $SGLANG_TRTLLM_MOE_VERL_WHEEL).

The sender: `verl/checkpoint_engine/delta_checkpoint_engine.py` imports ray, cupy and zmq at module level and
broadcasts over NCCL, so it cannot run on a CPU. What it computes runs here with verl's own functions from the same
wheel: `sparse_gather.shard_delta_indices` (the byte diff of a parameter against the trainer's snapshot),
`encode.DeltaParam` (the manifest entries) and `encode.checksum`; `seed_flushes` / `delta_flushes` assemble them as
`DeltaShardedCheckpointEngine._send_full_seed` / `_assemble_flush` do (one values tensor per flush, int32 positions as
a uint8 blob, flushes of about `bucket_bytes`, the last one `is_last`) and hand each flush over as `receive_weights`
yields it to the rollout worker: `[("__delta_spec__", uint8 JSON), ("__positions__", uint8), ("__values__", ...)]`
(docs/TESTING.md, stand-ins).
"""

from __future__ import annotations

import hashlib
import importlib
import json
import os
import sys
import zipfile
from pathlib import Path

VERSION = "0.9.1"
WHEEL = f"verl-{VERSION}-py3-none-any.whl"
#: PyPI's wheel of verl 0.9.1 (`pip download verl==0.9.1 --no-deps`); ci/make-env checks the same digest
WHEEL_SHA256 = "db6e6f2a8d9d5808d9ec32d357a42319fdc6967df688ff9d9810050f49bfdd14"
#: what a server passes to --custom-weight-loader and a client as load_format (delta_loader.LOADER_FQN)
LOADER_FQN = "verl.workers.rollout.sglang_rollout.delta_loader.apply_delta"
#: the wheel's files the loader and the sender code here import (the rest of verl needs ray)
FILES = (
    "verl/workers/rollout/sglang_rollout/delta_loader.py",
    "verl/checkpoint_engine/delta_sync/__init__.py",
    "verl/checkpoint_engine/delta_sync/encode.py",
    "verl/checkpoint_engine/delta_sync/sparse_gather.py",
)
#: the env variable naming the wheel when it is not in the env root
ENV_WHEEL = "SGLANG_TRTLLM_MOE_VERL_WHEEL"


def wheel() -> Path | None:
    """The verl wheel ci/make-env downloaded into the env root (the parent of this venv), or $ENV_WHEEL; None when
    neither exists."""
    for p in (os.environ.get(ENV_WHEEL), Path(sys.prefix).parent / f"verl-{VERSION}" / WHEEL):
        if p and Path(p).is_file():
            return Path(p)
    return None


def make_site(dest: str | Path, wheel_path: str | Path | None = None) -> str:
    """`FILES` from the wheel, byte for byte, under `dest` with an empty `__init__.py` in each parent package that
    has none of the wheel's; returns `dest` (a PYTHONPATH entry)."""
    src = Path(wheel_path) if wheel_path is not None else wheel()
    if src is None:
        raise FileNotFoundError(f"no verl {VERSION} wheel: run ci/make-env (it downloads {WHEEL}) or set {ENV_WHEEL}")
    digest = hashlib.sha256(src.read_bytes()).hexdigest()
    if digest != WHEEL_SHA256:
        raise AssertionError(f"{src}: sha256 {digest}, not PyPI's verl {VERSION} wheel ({WHEEL_SHA256})")
    dest = Path(dest)
    with zipfile.ZipFile(src) as z:
        for name in FILES:
            out = dest / name
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_bytes(z.read(name))
    for name in FILES:
        parent = (dest / name).parent
        while parent != dest:
            init = parent / "__init__.py"
            if not init.exists():
                init.write_text("")
            parent = parent.parent
    return str(dest)


def modules(site: str):
    """verl's (encode, sparse_gather, delta_loader) modules from `site` (put on sys.path)."""
    if site not in sys.path:
        sys.path.insert(0, site)
    return tuple(
        importlib.import_module(m)
        for m in (
            "verl.checkpoint_engine.delta_sync.encode",
            "verl.checkpoint_engine.delta_sync.sparse_gather",
            "verl.workers.rollout.sglang_rollout.delta_loader",
        )
    )


# ---- the trainer's side: flushes as verl's sender builds them ---------------------------------------------------


def flush_of(spec: dict, values, positions=None) -> list:
    """One flush as `DeltaShardedCheckpointEngine.receive_weights` yields it to the rollout worker."""
    import torch

    spec_t = torch.frombuffer(bytearray(json.dumps(spec).encode()), dtype=torch.uint8)
    named = [("__delta_spec__", spec_t), ("__values__", values)]
    if positions is not None:
        named.insert(1, ("__positions__", positions))
    return named


def _buckets(pieces: list, bucket_bytes: int) -> list[list]:
    """`_FlushBucket`: pieces (name, nbytes, ...) accumulate until `bucket_bytes`, then a flush is sealed."""
    out, cur, size = [], [], 0
    for p in pieces:
        cur.append(p)
        size += p[1]
        if size >= bucket_bytes:
            out.append(cur)
            cur, size = [], 0
    if cur:
        out.append(cur)
    return out


def seed_flushes(site: str, named: list, bucket_bytes: int = 1 << 20, verify: bool = False) -> list[list]:
    """The full seed (or, `verify`, the state-equivalence sweep): `_send_full_seed` over `named` (the trainer's
    (name, tensor) export, one dtype), values-only flushes as `_publish_values_flush` describes them."""
    import torch

    encode, _, _ = modules(site)
    pieces = [(n, t.numel() * t.element_size(), t.detach().contiguous().reshape(-1), list(t.shape)) for n, t in named]
    flushes = []
    groups = _buckets(pieces, bucket_bytes)
    for k, group in enumerate(groups):
        params, off = [], 0
        for name, _, flat, shape in group:
            n = int(flat.numel())
            params.append(
                encode.DeltaParam(
                    name=name,
                    dtype=str(flat.dtype).replace("torch.", ""),
                    shape=shape,
                    pos_start=0,
                    pos_end=0,
                    pos_width=4,
                    val_start=off,
                    val_end=off + n,
                )
            )
            off += n
        values = torch.cat([p[2] for p in group]).contiguous()
        empty = torch.empty(0, dtype=torch.uint8)
        spec = {
            "encoding": "dense",
            "verify": verify,
            "is_last": k == len(groups) - 1,
            "params": [vars(p) for p in params],
            "checksum": int(encode.checksum(empty, values)),
        }
        flushes.append(flush_of(spec, values))
    return flushes


def delta_flushes(site: str, old: dict, new: dict, bucket_bytes: int = 1 << 20) -> list[list]:
    """The steady sync from the trainer's snapshot `old` to `new` (name -> tensor, same names): each parameter
    byte-diffed by verl's `shard_delta_indices`, the changed (position, value) pairs bucketed and assembled as
    `_assemble_flush` does (indices encoding). Parameters with no change are not sent."""
    import torch

    encode, sparse_gather, _ = modules(site)
    pieces = []
    for name in sorted(new):
        idx, val = sparse_gather.shard_delta_indices(new[name].reshape(-1), old[name].reshape(-1), 0)
        if idx.numel():
            pieces.append((name, int(idx.numel()) * (4 + val.element_size()), idx, val, list(new[name].shape)))
    flushes = []
    for group in _buckets(pieces, bucket_bytes):
        params, idx_parts, val_parts, pos_off, val_off = [], [], [], 0, 0
        for name, _, idx, val, shape in group:
            nnz = int(idx.numel())
            idx_parts.append(idx.to(torch.int32))
            val_parts.append(val)
            params.append(
                encode.DeltaParam(
                    name=name,
                    dtype=str(val.dtype).replace("torch.", ""),
                    shape=shape,
                    pos_start=pos_off,
                    pos_end=pos_off + nnz * 4,
                    pos_width=4,
                    val_start=val_off,
                    val_end=val_off + nnz,
                )
            )
            pos_off += nnz * 4
            val_off += nnz
        values = torch.cat(val_parts)
        positions = torch.cat(idx_parts).contiguous().view(torch.uint8)
        spec = {
            "encoding": "indices",
            "params": [vars(p) for p in params],
            "checksum": int(encode.checksum(positions, values)),
        }
        flushes.append(flush_of(spec, values, positions))
    return flushes


def corrupted(flush: list) -> list:
    """`flush` with one value changed after its checksum was computed (what verl's receiver must refuse)."""
    out = []
    for name, t in flush:
        if name == "__values__":
            t = t.clone()
            t.view(-1)[t.numel() // 2] += 1
        out.append((name, t))
    return out


def transposed_last(flush: list, suffix: str) -> list:
    """`flush` with the parameter named `...suffix` moved to the end of its manifest and given its shape transposed
    (the same elements, a shape SGLang's loader refuses): a flush that fails after the others were written. Its
    checksum still holds (it covers positions and values)."""
    spec = json.loads(bytes(flush[0][1].tolist()).decode())
    p = next(p for p in spec["params"] if p["name"].endswith(suffix))
    spec["params"].remove(p)
    p["shape"] = p["shape"][::-1]
    spec["params"].append(p)
    tensors = dict(flush)
    return flush_of(spec, tensors["__values__"], tensors.get("__positions__"))


def perturbed(tensors: dict, names: list, share: float = 0.01, seed: int = 0) -> dict:
    """A copy of `tensors` with about `share` of the elements of each of `names` changed (a training step's
    sparse update): the next checkpoint the delta sync carries."""
    import torch

    g = torch.Generator().manual_seed(seed)
    out = dict(tensors)
    for name in names:
        t = tensors[name].clone()
        flat = t.view(-1)
        k = max(1, int(flat.numel() * share))
        pos = torch.randperm(flat.numel(), generator=g)[:k]
        flat[pos] = (flat[pos].float() + torch.randn(k, generator=g) * 0.05 + 0.01).to(flat.dtype)
        out[name] = t
    return out
