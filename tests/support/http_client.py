"""A trainer pushing tensors into SGLang's HTTP server the way slime does: each bucket serialized with SGLang's
MultiprocessingSerializer (one base64 string per TP rank), as a plain list of (name, tensor) or as a
FlattenedTensorBucket (`load_format="flattened_bucket"`), POSTed to `/update_weights_from_tensor`, inside
`/begin_weight_update` ... `/end_weight_update` (0.5.21+); and the NCCL-style path (verl, OpenRLHF, slime), gloo
on a CPU: `/init_weights_update_group` with this process as rank 0 of SGLang's `init_custom_process_group`, then per
bucket `/update_weights_from_distributed` (names, dtypes, shapes) while this process broadcasts the bucket's
flattened bytes (gloo cannot broadcast float8_e4m3fn, which NVFP4 block scales are: one uint8 broadcast per bucket).

CPU tensors cross processes through torch's shared-memory reductions, which need two things nobody documents
(README "RL loops"): the client sets `torch.multiprocessing.set_sharing_strategy("file_system")` — with the default
`file_descriptor` strategy the scheduler cannot fetch the descriptors (`AuthenticationError: digest sent was
rejected`) — and that strategy's `torch_shm_manager` helper inherits this process's stdout / stderr and lives as
long as the server holds the tensors' files, so this script's output goes to a file, never a pipe.

    python -m tests.support.http_client JOB.json OUT.json

JOB: {"url", "spec": {"arch", "quant"}, "steps": [{"path", "body"?, "tensors"?, "label"?}, ...]}; a step's "tensors":
{"seed": S, "bucket": [i, n]} (the i-th of n consecutive buckets of the whole checkpoint of seed S), or {"file":
path.safetensors}; with "bad": NAME-SUFFIX (that tensor sent as float32), "nan": NAME-SUFFIX (one NaN in it),
"load_format" and "tp" (copies, one per
rank). {"init_group": {"port", "group"}} and {"distributed": {the same tensor choice, "group"}} steps drive the
NCCL-style path. Steps without tensors are plain POSTs (a checksum, a generate: what the test checks between updates).
OUT: [{"label", "path", "status", "body"}, ...].
"""

from __future__ import annotations

import json
import sys


def _tensors(spec, t: dict):
    import torch

    from sglang_trtllm_moe.sandbox import checkpoints as ck

    if "file" in t:
        from safetensors.torch import load_file

        named = sorted(load_file(t["file"]).items())
    else:
        named = sorted(ck.checkpoint(spec.with_seed(t["seed"])).items())
    if "bucket" in t:
        i, n = t["bucket"]
        size = -(-len(named) // n)
        named = named[i * size : (i + 1) * size]
    if t.get("bad"):
        named = [(k, v.to(torch.float32) if k.endswith(t["bad"]) else v) for k, v in named]
        assert any(k.endswith(t["bad"]) for k, _ in named), t["bad"]
    if t.get("nan"):  # one NaN in that (floating) tensor: a trainer's diverged BF16 weight
        named = [(k, _with_nan(v) if k.endswith(t["nan"]) else v) for k, v in named]
        assert any(k.endswith(t["nan"]) for k, _ in named), t["nan"]
    return named


def _with_nan(t):
    t = t.clone()
    t.view(-1)[t.numel() // 3] = float("nan")
    return t


def _while_posting(url: str, body: dict, collective, timeout: float = 300):
    """POST `body` to `url` from a thread while this process runs `collective()` (the server's side of a gloo
    collective is inside that request); returns (collective's result, the answer)."""
    import concurrent.futures

    from .http_server import request

    with concurrent.futures.ThreadPoolExecutor(1) as ex:
        answer = ex.submit(request, url, body, timeout)
        out = collective()
        return out, answer.result(timeout=timeout)


def run(url: str, spec: dict, steps: list[dict], work, name: str, logs: list, timeout: float = 600) -> list[dict]:
    """This client in its own process against the server at `url` (the tests' way to run it): the job written as
    `work`/`name`.json, its output to `name`.log — appended to `logs` first: the torch_shm_manager it starts
    inherits that file and outlives it (the caller ends it, tests/support/http_server.py `shm_managers`). Returns
    its answers in order."""
    import os
    import subprocess
    from pathlib import Path

    from .helpers import REPO
    from .http_server import recipe_env

    work = Path(work)
    job, out, log = (work / f"{name}{x}" for x in (".json", ".out.json", ".log"))
    job.write_text(json.dumps({"url": url, "spec": spec, "steps": steps}))
    logs.append(log)
    with open(log, "w") as f:
        proc = subprocess.run(
            [sys.executable, "-m", "tests.support.http_client", str(job), str(out)],
            cwd=str(REPO),
            env=recipe_env(),
            stdin=subprocess.DEVNULL,
            stdout=f,
            stderr=subprocess.STDOUT,
            timeout=timeout,
            check=False,
        )
    assert proc.returncode == 0, log.read_text()[-4000:]
    assert os.path.exists(out), log.read_text()[-4000:]
    return json.loads(out.read_text())


def main(argv=None) -> int:
    import torch.distributed as dist
    import torch.multiprocessing

    torch.multiprocessing.set_sharing_strategy("file_system")
    from sglang.srt.utils.common import MultiprocessingSerializer

    from sglang_trtllm_moe.sandbox import checkpoints as ck
    from sglang_trtllm_moe.sandbox import models

    from .http_server import request

    job_path, out_path = (argv or sys.argv[1:])[:2]
    with open(job_path) as f:
        job = json.load(f)
    spec = ck.TinySpec(**job["spec"])
    keep = []  # the tensors stay alive until the server has read them (the whole run)
    results = []
    groups: dict = {}
    for step in job["steps"]:
        body = dict(step.get("body") or {})
        url = job["url"] + step["path"]
        if "init_group" in step:  # rank 0 of the update group, the server's ranks from rank_offset 1 (verl, slime)
            g = step["init_group"]
            from sglang.srt.utils.common import init_custom_process_group

            body.update(
                master_address="127.0.0.1",
                master_port=g["port"],
                rank_offset=1,
                world_size=2,
                group_name=g["group"],
                backend="gloo",
            )
            groups[g["group"]], r = _while_posting(
                url,
                body,
                lambda g=g: init_custom_process_group(
                    backend="gloo",
                    init_method=f"tcp://127.0.0.1:{g['port']}",
                    world_size=2,
                    rank=0,
                    group_name=g["group"],
                ),
            )
            results.append({"label": step.get("label", ""), "path": step["path"], "status": r.status, "body": r.body})
            continue
        if "distributed" in step:  # names / dtypes / shapes by HTTP, the bytes by one gloo broadcast per bucket
            from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket

            d = step["distributed"]
            # ordered by element size, so every tensor starts aligned in the flattened bytes
            named = sorted(_tensors(spec, d), key=lambda nt: (-nt[1].element_size(), nt[0]))
            body.update(
                names=[n for n, _ in named],
                dtypes=[str(t.dtype).replace("torch.", "") for _, t in named],
                shapes=[list(t.shape) for _, t in named],
                group_name=d["group"],
                load_format="flattened_bucket",
            )
            flat = FlattenedTensorBucket(named_tensors=named).get_flattened_tensor()
            pg = groups[d["group"]]
            _, r = _while_posting(url, body, lambda flat=flat, pg=pg: dist.broadcast(flat, src=0, group=pg))
            results.append({"label": step.get("label", ""), "path": step["path"], "status": r.status, "body": r.body})
            continue
        t = step.get("tensors")
        if t is not None:
            named = _tensors(spec, t)
            keep.append(named)
            fmt = t.get("load_format")
            obj = models.flattened_bucket(named) if fmt == "flattened_bucket" else named
            payload = MultiprocessingSerializer.serialize(obj, output_str=True)
            body.update(serialized_named_tensors=[payload] * int(t.get("tp", 1)), load_format=fmt)
        r = request(url, body, timeout=step.get("timeout", 180))
        results.append({"label": step.get("label", ""), "path": step["path"], "status": r.status, "body": r.body})
    with open(out_path, "w") as f:
        json.dump(results, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
