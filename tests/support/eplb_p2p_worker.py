"""One EP rank of a two-rank CPU world in which SGLang's own EPLB updater moves plugin-prepared experts BETWEEN ranks
(P2P): run by tests/test_eplb_p2p.py as `python -m tests.support.eplb_p2p_worker JOB RANK WORLD PORT OUT_DIR`.

Why two processes: on a GPU server each EP rank holds a slice of the physical expert slots, and a rebalance that
puts an expert on a rank that had no copy of it sends the expert's tensors there with torch.distributed P2P ops
(`expert_location_updater.py` `update_expert_weights_single_layer`, case same-node: `P2POp(irecv/isend)` then
`batch_isend_irecv`). What arrives is the other rank's laid-out bytes and per-expert kernel scalars, so the plugin's
layout must be rank-independent for the receiver to serve it. One process (tests/test_eplb_layers.py) only reaches
the same-rank cases.

Each rank is set up as a scheduler does (`sglang_runtime.init_rank`: gloo world, ServerArgs with tp 2 / ep 2, SGLang's
model-parallel groups), builds a FusedMoE with E + R physical slots (R redundant, `ep_num_redundant_experts`), loads
the whole checkpoint through SGLang's own weight_loader under the placement (each rank keeps its slots, every replica
written) and is prepared by the plugin. Then, per format: SGLang's own `ExpertLocationUpdater.update` to a placement
that forces moves both ways, forwards, an RL tensor update through SGLang's WeightUpdater, a second rebalance.

Oracle after every step, per rank: a layer freshly built, loaded and prepared under the placement of the moment
(every parameter byte equal), the layout state clean, and the all-reduced forward equal to that fresh layer's. The
P2P ops the updater submitted are recorded (peer, bytes) so the test can see experts really crossed ranks.

One stand-in, the CUDA-only `torch.cpu.empty_cache` (tests/support/eplb_placement.py `cpu_empty_cache`); the P2P path
itself is SGLang's, over gloo (torch's `batch_isend_irecv` issues each op on its own where the backend does not
coalesce, as gloo does not).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
import traceback

import torch

from .. import conftest  # noqa: F401  (torchvision shim before SGLang is imported)

E, R, EP = 8, 4, 2
#: physical slot -> logical expert; 6 slots per rank. INIT: rank 0 holds 0-5, rank 1 holds 6, 7 and replicas of 0-3.
INIT = list(range(E)) + list(range(R))
#: rank 0 needs 6 and 7 (only on rank 1), rank 1 needs 4 and 5 (only on rank 0); also unchanged (slot 3), same-rank
#: (slots 2, 5, 8, 11) and free-rider (slots 4, 9, 10) moves, and a logical expert three times (5)
FIRST = [7, 6, 2, 3, 6, 0, 5, 4, 1, 5, 5, 0]
#: after the update: rank 0 gets 4, 5, 1 from rank 1, rank 1 gets 3, 6, 7 from rank 0
SECOND = [4, 5, 1, 1, 0, 2, 3, 6, 7, 7, 0, 1]
#: experts the RL step changes after the first rebalance: 0 (on both ranks), 5 (three slots, arrived on rank 1),
#: 7 (arrived on rank 0)
UPDATED = [0, 5, 7]


def _bytes(t):
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def _model(spec, tensors):
    """A TinyMoeModel with E + R slots loaded with `tensors` (E logical experts) under the installed placement,
    reducing its output across ranks as SGLang's model code does."""
    from sglang_trtllm_moe.sandbox import layers as cpu_layers

    model = cpu_layers.TinyMoeModel(dataclasses.replace(spec, num_experts=E + R))
    model.experts.reduce_results = True
    model.load_weights(cpu_layers.checkpoint_names(tensors).items())
    model.experts.quant_method.process_weights_after_loading(model.experts)
    return model


def _forward(layer, spec, p2l, x, logits):
    """The same logical experts per token, each sent to its last replica slot under `p2l` (global physical ids: each
    rank's kernel serves its own slots), all-reduced."""
    from sglang.srt.layers.moe.topk import StandardTopKOutput

    weights, logical = torch.topk(torch.softmax(logits, dim=-1), spec.top_k, dim=-1)
    weights = weights / weights.sum(-1, keepdim=True)
    last = {lg: max(i for i, x in enumerate(p2l) if x == lg) for lg in range(E)}
    physical = logical.clone().apply_(lambda lg: last[lg]).to(torch.int32)
    return layer(x, StandardTopKOutput(weights, physical, logits))


def _clean(layer) -> bool:
    from sglang_trtllm_moe import layer_state

    st = layer_state.state_of(layer)
    return st is None or st.clean


def _compare(layer, spec, tensors, p2l, x, logits) -> dict:
    """This rank's layer vs a fresh load of `tensors` under the installed placement `p2l`."""
    fresh = _model(spec, tensors).experts
    theirs = dict(fresh.named_parameters())
    return dict(
        differs=[n for n, p in layer.named_parameters() if not torch.equal(_bytes(p), _bytes(theirs[n]))],
        clean=_clean(layer),
        out=_forward(layer, spec, p2l, x, logits),
        fresh_out=_forward(fresh, spec, p2l, x, logits),
    )


@contextlib.contextmanager
def _p2p_log(log: list):
    """Record every P2P op SGLang's updater submits: (isend|irecv, peer, bytes)."""
    dist = torch.distributed
    own = dist.batch_isend_irecv

    def wrapped(ops):
        log.extend(("isend" if op.op is dist.isend else "irecv", op.peer, op.tensor.nbytes) for op in ops)
        return own(ops)

    dist.batch_isend_irecv = wrapped
    try:
        yield log
    finally:
        dist.batch_isend_irecv = own


def _slots_hold_their_experts(layer, p2l, rank) -> dict:
    """This rank's slots of one logical expert hold the same w13 bytes, slots of different experts differ (so the
    fresh-load compare cannot pass on slots that all hold the same thing)."""
    w = _bytes(layer.w13_weight).reshape(layer.num_local_experts, -1)
    mine = p2l[rank * layer.num_local_experts : (rank + 1) * layer.num_local_experts]
    return {
        "replicas_equal": all(torch.equal(w[i], w[mine.index(lg)]) for i, lg in enumerate(mine)),
        "experts_distinct": all(
            not torch.equal(w[i], w[j]) for i in range(len(mine)) for j in range(len(mine)) if mine[i] != mine[j]
        ),
    }


def run_spec(spec_kw: dict, rank: int, x, logits) -> dict:
    from sglang_trtllm_moe import layer_state
    from sglang_trtllm_moe.sandbox import layers as cpu_layers

    from . import sglang_runtime
    from .eplb_placement import installed, metadata, moe_weights, rebalance

    spec = cpu_layers.MoeSpec(**spec_kw)
    ck = cpu_layers.random_checkpoint(spec, 0)
    res: dict = {}
    with installed([metadata(INIT, E, EP)]) as current:
        model = _model(spec, ck)
        layer = model.experts
        res["meta"] = dict(ep_rank=layer.moe_ep_rank, ep_size=layer.moe_ep_size, local=layer.num_local_experts)
        # the plugin lays the layer out (managed), or observes one SGLang prepares itself on this release
        res["managed"] = layer_state.state_of(layer) is not None
        res["observed"] = layer_state.observed(layer) is not None
        ptrs = {n: p.data_ptr() for n, p in layer.named_parameters()}
        moved = moe_weights(layer)
        res["moved"] = {"names": sorted(moved), "slot_bytes": sum(t[0].nbytes for t in moved.values())}
        res["load"] = {**_compare(layer, spec, ck, INIT, x, logits), **_slots_hold_their_experts(layer, INIT, rank)}

        for step, p2l in (("rebalance", FIRST), ("tensor_update", FIRST), ("second_rebalance", SECOND)):
            log: list = []
            if step == "tensor_update":
                new = cpu_layers.random_checkpoint(spec, 1, experts=UPDATED)
                names = list(cpu_layers.checkpoint_names(new).items())
                ok, msg = sglang_runtime.updater(model).update_weights_from_tensor(names)[:2]
                assert ok, msg
                ck = {**ck, **new}
            else:
                with _p2p_log(log):
                    rebalance(layer, metadata(p2l, E, EP), rank)
            res[step] = {
                "placement_installed": current[0].physical_to_logical_map_cpu.tolist() == [p2l],
                "p2p": log,
                "ptrs_same": ptrs == {n: p.data_ptr() for n, p in layer.named_parameters()},
                **_slots_hold_their_experts(layer, p2l, rank),
                **_compare(layer, spec, ck, p2l, x, logits),
            }
    return res


def main(argv):
    job_file, rank, world, port, out_dir = argv[0], int(argv[1]), int(argv[2]), int(argv[3]), argv[4]
    os.environ["SGLANG_TRTLLM_MOE_EMULATE"] = "1"
    torch.set_num_threads(1)  # two ranks share the box's cores
    from sglang.srt.plugins import load_plugins

    from .sglang_runtime import init_rank

    load_plugins()  # SGLang's own entry-point discovery runs our register(), as in every scheduler process
    job = torch.load(job_file, weights_only=False)
    init_rank(rank, world, EP, EP, port, moe_runner_backend=job["backend"])
    results: dict = {}
    for name, spec_kw in job["specs"].items():
        try:
            results[name] = run_spec(spec_kw, rank, job["x"], job["logits"])
        except Exception as e:  # a failure on one rank: report it, keep the other formats
            results[name] = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    torch.distributed.barrier()  # no rank leaves while another may still be in a collective


if __name__ == "__main__":
    main(sys.argv[1:])
