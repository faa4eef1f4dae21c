"""The trainer's side of `update_weights_from_distributed` on a CPU: rank 0 of SGLang's `init_custom_process_group`
over gloo, one flattened-bucket broadcast per bucket (gloo cannot broadcast float8_e4m3fn, which NVFP4 block
scales are, so the verl / slime `flattened_bucket` load format), in a forked process (SGLang is imported already)."""

from __future__ import annotations

import contextlib
import multiprocessing
import socket

import torch

GROUP = "rl"


def ordered(named) -> list[tuple[str, torch.Tensor]]:
    """(name, tensor) pairs of a dict or a list of pairs, by element size (then name), so every tensor starts aligned
    in the flattened bytes."""
    pairs = named.items() if isinstance(named, dict) else named
    return sorted(pairs, key=lambda kv: (-kv[1].element_size(), kv[0]))


def trainer(port: int, buckets: list[list[tuple[str, torch.Tensor]]], group: str = GROUP, world_size: int = 2) -> None:
    import os

    code = 1
    try:
        import torch.distributed as dist
        from sglang.srt.utils.common import init_custom_process_group
        from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket

        torch.set_num_threads(1)
        pg = init_custom_process_group(
            backend="gloo", init_method=f"tcp://127.0.0.1:{port}", world_size=world_size, rank=0, group_name=group
        )
        for bucket in buckets:
            dist.broadcast(FlattenedTensorBucket(named_tensors=bucket).get_flattened_tensor(), src=0, group=pg)
        code = 0
    finally:
        os._exit(code)


def request_fields(bucket: list[tuple[str, torch.Tensor]], group: str = GROUP) -> dict:
    """What an update_weights_from_distributed request says about `bucket`."""
    return dict(
        names=[n for n, _ in bucket],
        dtypes=[str(t.dtype).replace("torch.", "") for _, t in bucket],
        shapes=[list(t.shape) for _, t in bucket],
        group_name=group,
        load_format="flattened_bucket",
    )


@contextlib.contextmanager
def running(buckets: list[list[tuple[str, torch.Tensor]]], group: str = GROUP, world_size: int = 2):
    """`trainer` in a forked process on a free local port, for the block (rank 0 of `world_size`: the engine's ranks
    join as 1, 2, ...): yields (port, the process). At the end it is joined (killed if it has not finished in 120 s);
    the caller asserts its exit code."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = multiprocessing.get_context("fork").Process(target=trainer, args=(port, buckets, group, world_size))
    proc.start()
    try:
        yield port, proc
    finally:
        proc.join(120)
        if proc.exitcode is None:
            proc.kill()
            proc.join()
