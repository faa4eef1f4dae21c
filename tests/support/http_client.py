"""A trainer pushing tensors into SGLang's HTTP server the way slime does: each bucket serialized with SGLang's
MultiprocessingSerializer (one base64 string per TP rank), as a plain list of (name, tensor) or as a
FlattenedTensorBucket (`load_format="flattened_bucket"`), POSTed to `/update_weights_from_tensor`, inside
`/begin_weight_update` ... `/end_weight_update` (0.5.21+).

CPU tensors cross processes through torch's shared-memory reductions, which need two things nobody documents
(README "RL loops"): the client sets `torch.multiprocessing.set_sharing_strategy("file_system")` — with the default
`file_descriptor` strategy the scheduler cannot fetch the descriptors (`AuthenticationError: digest sent was
rejected`) — and that strategy's `torch_shm_manager` helper inherits this process's stdout / stderr and lives as
long as the server holds the tensors' files, so this script's output goes to a file, never a pipe.

    python -m tests.support.http_client JOB.json OUT.json

JOB: {"url", "spec": {"arch", "quant"}, "steps": [{"path", "body"?, "tensors"?}, ...]}; a step's "tensors":
{"seed": S, "bucket": [i, n]} (the i-th of n consecutive buckets of the whole checkpoint of seed S), or {"file":
path.safetensors}; with "bad": NAME-SUFFIX (that tensor sent as float32), "load_format" and "tp" (copies, one per
rank). OUT: [{"path", "status", "body"}, ...].
"""

from __future__ import annotations

import json
import sys


def _tensors(spec, t: dict):
    import torch

    from sglang_trtllm_moe.testing import checkpoints as ck

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
    return named


def main(argv=None) -> int:
    import torch.multiprocessing

    torch.multiprocessing.set_sharing_strategy("file_system")
    from sglang.srt.utils.common import MultiprocessingSerializer

    from sglang_trtllm_moe.testing import checkpoints as ck
    from sglang_trtllm_moe.testing import models

    from .http_server import request

    job_path, out_path = (argv or sys.argv[1:])[:2]
    with open(job_path) as f:
        job = json.load(f)
    spec = ck.TinySpec(**job["spec"])
    keep = []  # the tensors stay alive until the server has read them (the whole run)
    results = []
    for step in job["steps"]:
        body = dict(step.get("body") or {})
        t = step.get("tensors")
        if t is not None:
            named = _tensors(spec, t)
            keep.append(named)
            fmt = t.get("load_format")
            obj = models.flattened_bucket(named) if fmt == "flattened_bucket" else named
            payload = MultiprocessingSerializer.serialize(obj, output_str=True)
            body.update(serialized_named_tensors=[payload] * int(t.get("tp", 1)), load_format=fmt)
        r = request(job["url"] + step["path"], body, timeout=step.get("timeout", 180))
        results.append({"path": step["path"], "status": r.status, "body": r.body})
    with open(out_path, "w") as f:
        json.dump(results, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
