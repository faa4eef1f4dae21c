"""One rank of a two-rank CPU world ending a loader-free weight-update session (tests/test_loader_free.py):

    python -m tests.support.loader_free_ranks JOB_FILE RANK WORLD_SIZE PORT OUT_DIR

Per (tp, ep) of the job: the rank builds its NVFP4 FusedMoE (TinyMoeModel: SGLang's loader keeps its shard / its
experts), prepared by the plugin; a session through SGLang's WeightUpdater; the writer copies the rank's own bytes of
checkpoint 1 (what SGLang's loader leaves in the same layer not laid out) raw into the parameters — rank 1 with one
NaN e4m3 byte in its first local expert's w13 block scale —; `end_weight_update(run_post_load=True)`. Saved per
scenario: the refusal this rank answers, which of its local experts are all-zero bytes now, and whether every other
expert equals a fresh prepared load of checkpoint 1 on this rank.
"""

from __future__ import annotations

import sys
import traceback

import torch

from .. import conftest  # noqa: F401  (torchvision shim before SGLang is imported)


def run(sc: dict, rank: int) -> dict:
    from sglang_trtllm_moe import layer_state
    from sglang_trtllm_moe.builtins import sessions
    from sglang_trtllm_moe.sandbox import layers as cpu_layers

    from . import sglang_runtime

    spec = cpu_layers.MoeSpec(num_experts=4, hidden=256, intermediate=256, fmt="nvfp4")  # 128 per TP rank: unpadded
    model = sglang_runtime.prepared_model(spec, spec.kind.checkpoint(spec, seed=0))
    staged = cpu_layers.TinyMoeModel(spec)
    staged.load_weights(cpu_layers.checkpoint_names(spec.kind.checkpoint(spec, seed=1)).items())
    fresh = sglang_runtime.prepared_model(spec, spec.kind.checkpoint(spec, seed=1))
    if rank == 1:
        staged.experts.w13_weight_scale.data[0].view(torch.uint8).reshape(-1)[-1] = 0x7F
    u = sglang_runtime.updater(model)
    u.begin_weight_update()
    src = dict(staged.experts.named_parameters())
    for name, p in model.experts.named_parameters():
        if name in src and src[name].shape == p.shape:
            p.data.copy_(src[name].data)
    u.end_weight_update(run_post_load=True)
    fmt = layer_state.state_of(model.experts).fmt
    e = model.experts.w13_weight.shape[0]
    views = [fmt.tensor(model.experts, p) for p in fmt.params]
    zero = [i for i in range(e) if not any(bool(v[i].view(torch.uint8).any()) for v in views)]
    same = [
        i
        for i in range(e)
        if all(
            torch.equal(
                fmt.tensor(model.experts, p)[i].view(torch.uint8), fmt.tensor(fresh.experts, p)[i].view(torch.uint8)
            )
            for p in fmt.params
        )
    ]
    clean = layer_state.state_of(model.experts).clean
    return {"refusal": sessions.last_refusal(), "zero": zero, "same": same, "local": e, "clean": clean}


def main() -> int:
    import os

    job_file, rank, world, port, out = sys.argv[1:6]
    rank, world, port = int(rank), int(world), int(port)
    os.environ["SGLANG_TRTLLM_MOE_EMULATE"] = "1"
    torch.set_num_threads(1)
    from sglang.srt.plugins import load_plugins

    from . import sglang_runtime

    load_plugins()  # SGLang's own entry-point discovery runs the plugin's register(), as in a scheduler process
    job = torch.load(job_file, weights_only=False)
    res: dict = {}
    for sc in job["scenarios"]:
        sglang_runtime.init_rank(rank, world, sc["tp"], sc["ep"], port)
        try:
            res[sc["name"]] = run(sc, rank)
        except Exception as e:  # noqa: BLE001 - reported per scenario
            res[sc["name"]] = {"error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()[-3000:]}
    torch.save(res, f"{out}/rank{rank}.pt")
    torch.distributed.barrier()  # no rank leaves while the other may still be in a collective
    return 0


if __name__ == "__main__":
    sys.exit(main())
