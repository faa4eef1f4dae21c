"""What SGLang alone answers to the weight checker's `checksum` for the same weights held unquantized: the reference
of tests/test_models.py's checksum test. Run with the plugin disabled (SGLANG_TRTLLM_MOE_DISABLE=1: the caller sets
it; the script refuses to run otherwise):

    python -m tests.support.checksum_reference JOB.json OUT.json

JOB: {"models": [[ARCH, QUANT], ...], "workdir": DIR}. For each model, in a child forked from this process (one
SGLang ModelRunner per process), the tiny checkpoint of seed 0 with its routed experts dequantized as flashinfer's
CPU dequantizer computes them — NVFP4: `_e2m1_and_ufp8sf_scale_to_float_cpu` (packed e2m1, linear e4m3 block
scales, ModelOpt's weight_scale_2 as the dequantization scale); FP8 per-tensor: the e4m3 weight times its scale;
BF16: as stored — cast to BF16, without a quant config, loaded by SGLang's own ModelRunner (sandbox.models, the
bench_one_batch flow) as a BF16 model on its triton MoE runner, which keeps the checkpoint layout; then
`WeightChecker.handle("checksum")`. OUT: {"ARCH:QUANT": {"checksums": {...}, "moe_layers": [...]}}.
"""

from __future__ import annotations

import functools
import json
import os
import sys

from .helpers import fork_json


def dequantized(spec) -> dict:
    """`spec`'s checkpoint with every routed expert's weight dequantized to BF16 (flashinfer's CPU order)."""
    import torch

    from sglang_trtllm_moe.sandbox import checkpoints as ck

    t = ck.checkpoint(spec)
    out = {n: v for n, v in t.items() if ".experts." not in n}
    for base in sorted({n.rsplit(".", 1)[0] for n in t if ".experts." in n}):
        w = t[base + ".weight"]
        if spec.quant == "nvfp4":
            from flashinfer.quantization.fp4_quantization import _e2m1_and_ufp8sf_scale_to_float_cpu as fi_dequant

            sf = t[base + ".weight_scale"].view(torch.uint8)
            v = fi_dequant(w, sf, t[base + ".weight_scale_2"].reshape(1).float(), 16, 1, False)
        elif spec.quant == "fp8":
            v = w.float() * t[base + ".weight_scale"].float()
        elif spec.quant == "bf16":
            v = w
        else:
            raise NotImplementedError(f"no dequantized reference for {spec.quant!r}")
        out[base + ".weight"] = v.to(torch.bfloat16)
    return out


def _one(arch: str, quant: str, workdir: str) -> dict:
    import dataclasses

    import torch

    from sglang_trtllm_moe import layer_state
    from sglang_trtllm_moe.sandbox import checkpoints as ck
    from sglang_trtllm_moe.sandbox import models

    from .sglang_runtime import weight_checker

    spec = ck.TinySpec(arch, quant, seed=0)
    d = ck.write_tensors(
        os.path.join(workdir, f"dequantized-{arch}-{quant}"), dataclasses.replace(spec, quant="bf16"), dequantized(spec)
    )
    m = models.TinyModel(d, moe_runner_backend="triton", dtype="bfloat16")
    layers = models.moe_layers(m.model)
    if not layers or any(layer_state.state_of(x) or layer_state.observed(x) for x in layers.values()):
        raise SystemExit("no FusedMoE layer, or the plugin touched one: this reference must be SGLang alone's")
    with torch.no_grad():
        res = weight_checker(m.model).handle("checksum", role="target")
    return {"checksums": dict(res["checksums"]), "moe_layers": sorted(layers)}


def main(argv=None) -> int:
    if os.environ.get("SGLANG_TRTLLM_MOE_DISABLE") != "1":
        raise SystemExit("run with SGLANG_TRTLLM_MOE_DISABLE=1: the reference is SGLang alone")
    from sglang_trtllm_moe.sandbox import models

    job_path, out_path = (argv or sys.argv[1:])[:2]
    with open(job_path) as f:
        job = json.load(f)
    models.prepare_process(preload=True)
    out: dict = {}
    for arch, quant in job["models"]:
        part = os.path.join(job["workdir"], f"checksum-{arch}-{quant}.json")
        pid = fork_json(part, functools.partial(_one, arch, quant, job["workdir"]))
        _, status = os.waitpid(pid, 0)
        if status != 0:
            raise SystemExit(f"the reference of {arch}:{quant} failed (status {status})")
        with open(part) as f:
            out[f"{arch}:{quant}"] = json.load(f)
    with open(out_path, "w") as f:
        json.dump(out, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
