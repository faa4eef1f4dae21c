"""verl's rollout weight sync on `sglang.Engine(device="cpu", tp_size=2)` with SGLang's own client helpers, in the
processes verl has: trainer rank 0 holds the Engine, trainer rank 1 (a process of its own) only pushes its copy of
each bucket; the two form verl's device mesh ("infer_tp", gloo).

* `sglang.srt.weight_sync.utils.update_weights(engine, params_batch, "infer_tp", mesh)`: every rank serializes its
  tensors with MultiprocessingSerializer, rank 0 gathers them into one `LocalSerializedTensor(values=[rank 0's,
  rank 1's])` per name and sends one `UpdateWeightsFromTensorReqInput` (each SGLang TP rank reads its own entry);
  verl's `engine` is an Engine whose `update_weights_from_tensor` awaits the tokenizer manager (SGLang's own test
  `test_utils_update_weights.py` does the same).
* flattened buckets: each rank serializes a `FlattenedTensorBucket` of the bucket; rank 0 sends them as
  `serialized_named_tensors` (one per TP rank) with `load_format="flattened_bucket"`.

Both inside `begin_weight_update` / `end_weight_update` (0.5.21+). Every trainer process runs SGLang's
`load_plugins()` with the CPU sandbox's switches (the Engine's rank does so itself): on a CPU tensor, SGLang's
CUDA-only reduction patch (`utils/patch_torch.py`, applied by `update_weights`) needs the sandbox's stand-in.

    python -m tests.support.verl_worker JOB.json OUT.json
"""

from __future__ import annotations

import asyncio
import json
import os
import sys

TP = 2


def _buckets(seed: int, n: int, bad: str | None = None):
    import torch

    from sglang_trtllm_moe.sandbox import checkpoints as ck

    spec = ck.TinySpec(arch="qwen3_moe", quant="nvfp4", seed=seed)
    named = sorted(ck.checkpoint(spec).items())
    if bad:
        named = [(k, v.to(torch.float32) if k.endswith(bad) else v) for k, v in named]
    size = -(-len(named) // n)
    return [named[i : i + size] for i in range(0, len(named), size)]


#: (label, seed, buckets, how, bad tensor): what both ranks push, in this order
ROUNDS = (
    ("C", 2, 2, "update_weights", None),
    ("B", 1, 2, "flattened_bucket", None),
    ("A", 0, 3, "update_weights", None),
    ("refused", 1, 1, "update_weights", "layers.0.mlp.experts.3.down_proj.weight"),
    ("refused flat", 1, 1, "flattened_bucket", "layers.0.mlp.experts.3.down_proj.weight"),
)


def _push(engine, bucket, how: str, mesh):
    """One bucket from this rank; on rank 0 (engine given) the answer, (success, message)."""
    import torch.distributed as dist
    from sglang.srt.utils import MultiprocessingSerializer
    from sglang.srt.weight_sync.utils import update_weights

    run = asyncio.run if engine is None else engine.loop.run_until_complete  # the Engine's own event loop
    if how == "update_weights":
        return run(update_weights(engine, bucket, device_mesh_key="infer_tp", device_mesh=mesh))
    from sglang.srt.managers.io_struct import UpdateWeightsFromTensorReqInput
    from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket

    flat = FlattenedTensorBucket(named_tensors=bucket)
    mine = MultiprocessingSerializer.serialize(
        {"flattened_tensor": flat.get_flattened_tensor(), "metadata": flat.get_metadata()}
    )
    group = mesh["infer_tp"].get_group()
    gathered = [None] * TP if engine is not None else None
    dist.gather_object(mine, gathered, dst=mesh["infer_tp"].mesh.tolist()[0], group=group)
    if engine is None:
        return None
    req = UpdateWeightsFromTensorReqInput(serialized_named_tensors=gathered, load_format="flattened_bucket")
    return run(engine.update_weights_from_tensor(req))


def _mesh(rank: int, port: int):
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=TP)
    return init_device_mesh("cpu", (TP,), mesh_dim_names=("infer_tp",))


def rank1(port: int) -> None:
    """Trainer rank 1: no engine; pushes its copy of every bucket of every round (a spawned process)."""
    import torch.distributed as dist
    from sglang.srt.plugins import load_plugins

    load_plugins()
    mesh = _mesh(1, port)
    keep = []  # the tensors stay alive until the scheduler has fetched them (the barrier after each bucket)
    for _label, seed, n, how, bad in ROUNDS:
        dist.barrier()  # rank 0 opened the session
        for bucket in _buckets(seed, n, bad):
            keep.append(bucket)
            _push(None, bucket, how, mesh)
            dist.barrier()  # rank 0's request is answered
        dist.barrier()  # the session is closed, the checks done
    dist.destroy_process_group()


def main(argv=None) -> int:
    import multiprocessing

    import torch.distributed as dist
    from sglang.srt.entrypoints.engine import Engine
    from sglang.srt.managers.io_struct import CheckWeightsReqInput

    job_path, out_path = (argv or sys.argv[1:])[:2]
    with open(job_path) as f:
        job = json.load(f)

    class AsyncEngine(Engine):
        """verl's engine: update_weights_from_tensor takes the request and awaits the tokenizer manager."""

        async def update_weights_from_tensor(self, update_weights_request):  # type: ignore[override]
            return await self.tokenizer_manager.update_weights_from_tensor(update_weights_request, None)

    peer = multiprocessing.get_context("spawn").Process(target=rank1, args=(job["port"],))
    peer.start()
    engine = AsyncEngine(
        model_path=job["dirs"]["A"],
        device="cpu",
        tp_size=TP,
        attention_backend="torch_native",
        bf16_gemm_backend="torch",
        max_total_tokens=2048,
        skip_tokenizer_init=True,
        log_level="error",
    )
    out: dict = {"rounds": {}}
    try:

        def check(action):
            req = CheckWeightsReqInput(action=action)
            res = engine.loop.run_until_complete(engine.tokenizer_manager.check_weights(req, None))
            return {"success": bool(res[0]), "message": str(res[1]), "ranks": res[2]}

        def sums():
            r = check("checksum")
            assert r["success"], r
            return [dict(x["checksums"] if isinstance(x, dict) else x.checksums) for x in r["ranks"]]

        def tokens():
            o = engine.generate(input_ids=job["prompts"], sampling_params={"temperature": 0, "max_new_tokens": 4})
            return [list(x["output_ids"]) for x in o]

        mesh = _mesh(0, job["port"])
        out["fresh A"] = {"tokens": tokens()}
        out["snapshot"] = check("snapshot")
        for label, seed, n, how, bad in ROUNDS:
            engine.begin_weight_update()
            dist.barrier()
            answers = []
            for bucket in _buckets(seed, n, bad):
                ok, msg = _push(engine, bucket, how, mesh)[:2]
                answers.append({"success": bool(ok), "message": str(msg)})
                dist.barrier()
            engine.end_weight_update()
            res = {"answers": answers, "checksums": sums(), "tokens": tokens()}
            if label == "A":  # back on A: the served bytes against the snapshot of the fresh load (raw)
                res["compare"] = check("compare")
            elif not bad:  # the same checkpoint through SGLang's own disk loader on this engine
                ok, msg = engine.update_weights_from_disk(job["dirs"][label])[:2]
                res["disk"] = {"success": bool(ok), "message": str(msg), "checksums": sums(), "tokens": tokens()}
            out["rounds"][label] = res
            dist.barrier()
        dist.destroy_process_group()
    finally:
        peer.join(120)  # before the Engine's shutdown, which ends every child process of this one
        if peer.exitcode is None:
            peer.kill()
        out["peer_exitcode"] = peer.exitcode
        engine.shutdown()
    with open(out_path, "w") as f:
        json.dump(out, f)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
