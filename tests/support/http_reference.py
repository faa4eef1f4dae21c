"""Fresh loads for tests/test_http_server.py: what a NEW server would serve for each checkpoint, computed apart from
the server under test by SGLang's own ModelRunner (the bench_one_batch flow of sandbox.models; the model tests prove
that load plugin-managed and bit-exact).

Per target directory: SGLang's weight-checker checksum of the fresh model (`WeightChecker.handle("checksum")`: the
per-tensor hashes `POST /weights_checker {"action": "checksum"}` answers for the served model — each weight in
checkpoint layout, dequantized, so a prepared layout and a fresh prepared load hash alike exactly when they hold the
same weights), and its greedy tokens for PROMPTS as one batch (for the targets under "alone", also the first
prompt's alone: a batch of one, as the README's curl sends it); for the targets under "routed_experts", also the
routed experts a server returns for that batch and SGLang's own top-k for them (tests/support/r3.py). With "direct":
the fresh model of that directory in SGLang's own checkpoint layout (every parameter by its model name, the plugin's
layers un-prepared), written as safetensors: the payload of a `load_format="direct"` update.

    python -m tests.support.http_reference JOB.json OUT.json
"""

from __future__ import annotations

import json
import sys


def main(argv=None) -> int:
    import torch

    from sglang_trtllm_moe import layer_state
    from sglang_trtllm_moe.sandbox import models

    from . import r3
    from .sglang_runtime import weight_checker

    job_path, out_path = (argv or sys.argv[1:])[:2]
    with open(job_path) as f:
        job = json.load(f)
    models.prepare_process()
    # the server under test returns routed experts (the README recipe's --enable-return-routed-experts); so does the
    # reference. With chunked prefill off (the harness's -1) SGLang would size its capture buffer from
    # max_running_requests alone, which a batch of the test's prompts overflows
    # "server_args": what the server under test is started with besides (e.g. --quantization nvfp4_online)
    m = models.TinyModel(
        job["first"], enable_return_routed_experts=True, chunked_prefill_size=4096, **job.get("server_args", {})
    )
    out: dict = {}
    for key, d in job["targets"].items():
        fresh = m.fresh(d)
        with torch.no_grad():
            res = weight_checker(fresh).handle("checksum", role="target")
        tokens, _ = m.generate(job["prompts"], job["new_tokens"], model=fresh)
        out[key] = {"checksums": dict(res["checksums"]), "tokens": tokens}
        if key in job.get("alone", ()):  # the first prompt alone: what the README's single-prompt curl generates
            out[key]["alone"] = m.generate(job["prompts"][:1], job["new_tokens"], model=fresh)[0][0]
        if key in job.get("routed_experts", ()):
            out[key]["r3"] = r3.routed_generation(m, job["prompts"], job["new_tokens"], model=fresh)
        del fresh
    direct = job.get("direct")
    if direct:
        from safetensors.torch import save_file

        src = m.fresh(direct["dir"])
        layer_state.unprepare_all()  # every managed layer of this process in checkpoint layout, as begin_weight_update
        payload = {n: p.detach().clone().contiguous() for n, p in src.named_parameters()}
        layer_state.flush_all(end_session=True)
        save_file(payload, direct["out"])
    with open(out_path, "w") as f:
        json.dump(out, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
