"""A whole SGLang model served with redundant experts, rebalanced by SGLang's own EPLB updater, then updated by an
RL framework: run by tests/test_eplb.py as `python -m tests.support.eplb_worker WORKDIR ARCH:QUANT,...`; prints one JSON
report {"ARCH:QUANT": {step: {...}}}.

Why a process per model (forked from one parent that imported SGLang once): SGLang's expert-location metadata is
process-global and sized for one model.

The model is SGLang's own ModelRunner (sandbox/models.py TinyModel) with `ep_num_redundant_experts=R` and an
`init_expert_location` placement that replicates some experts, so every FusedMoE holds E + R physical slots and
SGLang's own loader writes each replicated expert into all of its slots. A rebalance is what EPLBManager.rebalance
does to the weights (eplb_manager.py `update_expert_location_with_recovery` -> `ExpertLocationUpdater.update`):
SGLang's own updater, on the runner's own `expert_location_updater`, with a new placement built by SGLang's own
`ExpertLocationMetadata.init_by_mapping`; it copies every parameter `get_moe_weights()` lists (the plugin's laid-out
weights and its per-expert scalars included) between slots, then installs the new placement process-wide. Only
the placement itself is chosen here instead of by an EPLB algorithm from recorded loads: the algorithm decides
which slots move, not how they move. `--enable-eplb` itself asserts ep_size > 1 (arg_groups/parallel_hook.py
`handle_eplb_and_dispatch`), which a one-process CPU runner cannot have; with one rank every move is a same-rank
copy (the updater's `same-gpu` / `free-rider` cases), as on each rank of a real EP world after its P2P receive.

Oracle after every step: a fresh `get_model()` of the checkpoint intended, under the placement installed at that
moment (SGLang's own loader and the plugin's preparation): every parameter and buffer byte equal, storage kept,
every layer's layout state clean; greedy tokens equal the fresh model's. The rebalance must also leave the served
tokens unchanged (the same logical experts serve every token), and the router must really reach the replica slots.

One stand-in, for a CUDA-only call: `ExpertLocationUpdater.update` starts with `torch.get_device_module()
.empty_cache()`, which on a CPU box is `torch.cpu.empty_cache`, absent from CPU torch; a no-op there (it only
returns cached CUDA blocks to the driver; tests/support/eplb_placement.py). docs/TESTING.md lists it.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import sys
import time

os.environ.setdefault("OMP_NUM_THREADS", os.environ.get("SGLANG_TRTLLM_MOE_TEST_THREADS", "1"))

import torch  # noqa: E402

from .. import conftest  # noqa: E402,F401  (torchvision shim before SGLang is imported)
from .eplb_placement import cpu_empty_cache  # noqa: E402

#: redundant slots: E + R physical experts per layer (R logical experts served twice)
REDUNDANT = 4


def placements(num_experts: int, num_layers: int) -> dict[str, list[list[int]]]:
    """physical slot -> logical expert per layer: the initial placement (experts 0..R-1 replicated at the end),
    then two rebalances that move every expert to another slot and change which experts are replicated (one
    expert three times), differently per layer."""
    e, r = num_experts, REDUNDANT
    rev = list(reversed(range(e)))
    init = [list(range(e)) + list(range(r)) for _ in range(num_layers)]
    first = [
        (rev + rev[:r]) if layer % 2 == 0 else ([3, 0, 1, 2] + list(range(4, e))[::-1] + [5, 5, 0, 3][:r])
        for layer in range(num_layers)
    ]
    second = [[(i + 1 + layer) % e for i in range(e)] + [e - 1] * r for layer in range(num_layers)]
    return {"init": init, "first": first, "second": second}


def rebalance(m, p2l: list[list[int]]) -> None:
    """SGLang's own weight move of an EPLB rebalance onto placement `p2l`, every MoE layer at once."""
    from sglang.srt.eplb.expert_location import ExpertLocationMetadata

    meta = ExpertLocationMetadata.init_by_mapping(m.model_config, p2l, moe_ep_rank=0)
    weights = m.model.routed_experts_weights_of_layer  # a dict, or SGLang's LazyValue of one (keys() passes through)
    with cpu_empty_cache():
        layer_ids = sorted(weights.keys())
        m.runner.expert_location_updater.update(weights, meta, update_layer_ids=layer_ids, nnodes=1, rank=0)


class Routes:
    """The physical expert ids SGLang's TopK hands the MoE layers (topk_ids_logical_to_physical's output)."""

    def __init__(self):
        self.max_id = -1

    @contextlib.contextmanager
    def recording(self):
        from sglang.srt.layers.moe import topk

        own = topk.topk_ids_logical_to_physical

        def wrapped(ids, info, *a, **k):
            out = own(ids, info, *a, **k)
            if isinstance(out, torch.Tensor) and out.numel():
                self.max_id = max(self.max_id, int(out.max()))
            return out

        topk.topk_ids_logical_to_physical = wrapped
        try:
            yield self
        finally:
            topk.topk_ids_logical_to_physical = own


def _installed(m, p2l: list[list[int]]) -> bool:
    """SGLang's process-wide placement is `p2l` on every MoE layer (the rebalance updates those rows only)."""
    from sglang.srt.eplb.expert_location import get_global_expert_location_metadata

    now = get_global_expert_location_metadata().physical_to_logical_map_cpu.tolist()
    return all(now[i] == p2l[i] for i in m.model.routed_experts_weights_of_layer.keys())


def _backend(layer) -> str:
    """The runner a layer got: FusedMoE.runner_backend (0.5.23+), before it the process-wide backend it reads."""
    from sglang.srt.layers.moe.utils import get_moe_runner_backend

    b = getattr(layer, "runner_backend", None) or get_moe_runner_backend()
    return str(getattr(b, "value", b))


def _moe_weights(m) -> dict:
    """{layer id: the tensors SGLang's rebalance moves} (the model's dict, or the one its LazyValue holds)."""
    weights = m.model.routed_experts_weights_of_layer
    return {k: weights[k] for k in weights.keys()}


def _replicas_equal(m, p2l: list[list[int]]) -> dict:
    """Slots holding the same logical expert hold the same bytes, and different experts differ (the check can
    fail): per parameter SGLang's rebalance moves."""
    same, differ = True, True
    for layer_id, weights in _moe_weights(m).items():
        row = p2l[layer_id]
        for w in weights[:1]:  # w13 weights: the kernel-layout bytes of each slot
            slots = w.reshape(w.shape[0], -1).view(torch.uint8) if w.dtype.itemsize == 1 else w.reshape(w.shape[0], -1)
            for s, logical in enumerate(row):
                first = row.index(logical)
                same &= bool(torch.equal(slots[s], slots[first]))
                if first != s:
                    continue
                others = [t for t, lg in enumerate(row) if lg != logical]
                differ &= not any(torch.equal(slots[s], slots[t]) for t in others)
    return {"replicas_equal": same, "experts_distinct": differ}


def run(arch: str, quant: str, workdir: str) -> dict:
    from sglang_trtllm_moe import layer_state
    from sglang_trtllm_moe.sandbox import models

    from .model_base import PROMPTS
    from .model_worker import Worker

    w = Worker(arch, quant, workdir)
    e = w.spec.num_experts
    d0 = w.write_full(0)
    layers_n = json.load(open(os.path.join(d0, "config.json")))["num_hidden_layers"]
    plan = placements(e, layers_n)
    init = json.dumps({"physical_to_logical_map": plan["init"]})
    m = models.TinyModel(d0, ep_num_redundant_experts=REDUNDANT, init_expert_location=init)
    ptrs = m.pointers()
    routes = Routes()
    rep: dict = {}

    moe = m.moe_layers()
    rep["load"] = {
        "slots": sorted({int(layer.num_local_experts) for layer in moe.values()}),
        "backends": sorted({_backend(layer) for layer in moe.values()}),
        "managed": sorted({layer_state.state_of(layer) is not None for layer in moe.values()}),
        "moved_params": sorted(
            {
                n
                for layer in moe.values()
                for n, p in layer.named_parameters()
                if any(p.data.data_ptr() == x.data_ptr() for ws in _moe_weights(m).values() for x in ws)
            }
        ),
        **_replicas_equal(m, plan["init"]),
        **w.compare(m, w.full(0), ptrs, tokens=True),
    }
    with routes.recording():
        before, _ = m.generate(PROMPTS, 4)
    rep["load"]["max_physical_id"] = routes.max_id

    # 1. a rebalance: the same tokens, every slot a fresh load's expert under the new placement
    rebalance(m, plan["first"])
    routes.max_id = -1
    with routes.recording():
        after, _ = m.generate(PROMPTS, 4)
    rep["rebalance"] = {
        "placement_installed": _installed(m, plan["first"]),
        "tokens_before": before,
        "tokens_after": after,
        "max_physical_id": routes.max_id,
        **_replicas_equal(m, plan["first"]),
        **w.compare(m, w.full(0), ptrs, tokens=True),
    }

    # 2. an RL tensor update of some experts (replicated ones among them): every replica slot gets the new bytes
    part = w.experts_of(1, experts=[0, 4, 5, e - 1])
    m.update_from_tensor(list(part.items()))
    intended = {**w.full(0), **part}
    rep["tensor_update"] = {**_replicas_equal(m, plan["first"]), **w.compare(m, intended, ptrs, tokens=True)}

    # 3. a disk update of a whole new checkpoint
    m.update_from_disk(w.write_full(2))
    rep["disk_update"] = {**_replicas_equal(m, plan["first"]), **w.compare(m, w.full(2), ptrs, tokens=True)}

    # 4. a second rebalance after the updates: the updated bytes move, nothing stale comes back
    rebalance(m, plan["second"])
    rep["second_rebalance"] = {
        "placement_installed": _installed(m, plan["second"]),
        **_replicas_equal(m, plan["second"]),
        **w.compare(m, w.full(2), ptrs, tokens=True),
    }
    return rep


def run_jobs(jobs: list[tuple[str, str]], workdir: str, parallel: int) -> dict:
    """Fork one child per model from this process (SGLang imported once), at most `parallel` at a time."""
    from sglang_trtllm_moe.sandbox import models

    from .helpers import fork_json
    from .model_worker import job_key

    models.prepare_process(preload=True)
    pending, running, reports = list(jobs), {}, {}
    while pending or running:
        while pending and len(running) < parallel:
            arch, quant = pending.pop(0)
            out = os.path.join(workdir, f"{arch}-{quant}.json")
            work = functools.partial(run, arch, quant, os.path.join(workdir, f"{arch}-{quant}"))
            running[fork_json(out, work)] = (job_key(arch, quant), out)
        pid, status = os.wait()
        if pid not in running:
            continue
        key, out = running.pop(pid)
        try:
            with open(out) as f:
                reports[key] = json.load(f)
        except (OSError, ValueError):
            reports[key] = {"error": f"the job's process ended with status {status}, no report"}
    return reports


def main(argv: list[str]) -> int:
    workdir, jobs = argv[0], [tuple(j.split(":")) for j in argv[1].split(",")]
    parallel = min(2, os.cpu_count() or 1)
    t = time.perf_counter()
    reports = run_jobs(jobs, workdir, parallel)
    reports["_seconds"] = round(time.perf_counter() - t, 1)
    print(json.dumps(reports, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
