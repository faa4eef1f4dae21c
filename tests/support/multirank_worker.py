"""One rank of a multi-process CPU "server": run by tests/test_multirank.py as
`python -m tests.support.multirank_worker`.

Why a separate process per rank: SGLang's parallel state (gloo world, published ServerArgs, model-parallel groups)
is per process, and TP/EP bugs only show when every rank builds its own FusedMoE, loads the FULL checkpoint through
SGLang's own weight_loader (keeping only its shard / its experts), is prepared by the plugin and reduces its partial
output with SGLang's own all-reduce. Process start-up (importing SGLang) dominates the cost on CPU, so one process
group runs a whole list of scenarios, re-initialising the model-parallel groups when (tp, ep) changes.

Usage: python -m tests.support.multirank_worker JOB_FILE RANK WORLD_SIZE PORT OUT_DIR
JOB_FILE (torch.save) holds {"scenarios": [...]}; each scenario is a dict with name, tp, ep, spec (MoeSpec fields),
seed, x, logits and optionally rl_update = {"experts": [...], "seed": int}, or a `verdict` entry (the update paths'
cross-rank verdict: tests/support/verdict_worker.py). Results go to OUT_DIR/rank{R}.pt as
{name: {...}} (an "error" entry when SGLang or the plugin refused the scenario on this rank).
"""

from __future__ import annotations

import os
import sys
import traceback

import torch  # noqa: E402

from .. import conftest  # noqa: F401  (torchvision shim before SGLang is imported)

PREPARED = ("w13_weight", "w13_weight_scale", "w2_weight", "w2_weight_scale")
#: the NVFP4 scalars a flush recomputes from the per-expert scales (RL updates must leave them as a fresh load)
SCALARS = ("g1_alphas", "g1_alphas_up", "g2_alphas", "w13_input_scale_quant", "w2_input_scale_quant", "g1_scale_c")


def _raw_params(layer) -> dict:
    return {n: p.detach().clone() for n, p in layer.named_parameters()}


def forward(layer, spec, x, logits, bypass=False):
    """SGLang's TopK then the layer. `bypass`: routing inside the kernel from logits, as a Blackwell server runs it
    (TopK.forward_cuda builds the BypassedTopKOutput; on CPU, TopK would dispatch to forward_native, which always
    materializes top-k). ModelOpt FP8 per-tensor accepts only this; NVFP4 takes the routed kernel otherwise."""
    from sglang.srt.layers.moe.topk import TopK

    topk = TopK(top_k=spec.top_k, renormalize=True, layer_id=0)
    if bypass:
        if hasattr(topk, "bind_runner_backend"):  # 0.5.23+; before, forward_cuda reads the global backend
            topk.bind_runner_backend(layer.runner_backend, routing_method_type=layer.routing_method_type)
        return layer(x, topk.forward_cuda(x, logits))
    return layer(x, topk(x, logits))


def _build_loaded(spec, tensors, **build):
    from sglang_trtllm_moe.sandbox import layers as cpu_layers

    layer = cpu_layers.build_layer(spec, **build)
    # SGLang's model code reduces the MoE output across ranks (FusedMoE's own all-reduce when built with
    # reduce_results=True; models that add shared experts first call the same tensor_model_parallel_all_reduce).
    layer.reduce_results = True
    cpu_layers.load_checkpoint(layer, tensors, spec.num_experts)
    return layer


def checkpoint(spec, seed, experts=None):
    from sglang_trtllm_moe.sandbox import layers as cpu_layers

    return cpu_layers.random_checkpoint(spec, seed, experts)


def _as_bytes(t):
    return t.detach().contiguous().view(torch.uint8).clone()


def run_scenario(sc: dict) -> dict:
    from sglang_trtllm_moe import layer_state
    from sglang_trtllm_moe.sandbox import layers as cpu_layers

    if sc.get("verdict"):  # the cross-rank verdict of update requests: tests/support/verdict_worker.py
        from . import verdict_worker

        return verdict_worker.run(sc, _build_loaded)

    spec = cpu_layers.MoeSpec(**sc["spec"])
    tensors = checkpoint(spec, sc["seed"])
    res: dict = {}
    build = {}
    if sc.get("r3"):  # a model class's declared router: the fused runner routes it in the kernel
        from sglang.srt.layers.moe.utils import RoutingMethodType

        build["routing_method_type"] = RoutingMethodType.Renormalize
    layer = _build_loaded(spec, tensors, **build)
    res["meta"] = dict(
        moe_tp_rank=layer.moe_tp_rank,
        moe_tp_size=layer.moe_tp_size,
        moe_ep_rank=layer.moe_ep_rank,
        moe_ep_size=layer.moe_ep_size,
        num_local_experts=layer.num_local_experts,
        intermediate_size_per_partition=layer.intermediate_size_per_partition,
    )
    res["loaded"] = _raw_params(layer)  # checkpoint layout, as SGLang's loader left it
    layer.quant_method.process_weights_after_loading(layer)
    st = layer_state.state_of(layer)
    res["plugin_prepared"] = st is not None and st.clean
    res["out"] = forward(layer, spec, sc["x"], sc["logits"], sc.get("bypass", False))
    res["runner_ep"] = dict(_LAST_CALL)
    if sc.get("r3"):
        res.update(_routed_experts(layer, spec, sc))

    upd = sc.get("rl_update")
    if upd:
        res.update(_rl_update(layer, spec, tensors, sc, upd))
    return res


def _routed_experts(layer, spec, sc) -> dict:
    """R3 on this rank: what the fused runner hands SGLang's capture site (a recorder as the global capturer), and
    SGLang's own top-k of the same logits — every rank routes all tokens, as SGLang's non-fused path does."""
    from sglang.srt.layers.moe.topk import TopK

    from . import r3

    topk = TopK(top_k=spec.top_k, renormalize=True, layer_id=layer.layer_id)
    if hasattr(topk, "bind_runner_backend"):
        topk.bind_runner_backend(layer.runner_backend, routing_method_type=layer.routing_method_type)
    with r3.recording() as rec:
        out = topk.forward_cuda(sc["x"], sc["logits"])
        layer(sc["x"], out)
    return dict(
        r3_format=type(out).__name__,
        r3_calls=[(lid, ids) for lid, ids in rec.calls],
        r3_ref=r3.topk_ids(sc["x"], sc["logits"], out.topk_config),
    )


def _rl_update(layer, spec, tensors, sc, upd) -> dict:
    """An RL step that only changes some experts: every rank receives the same named tensors (as SGLang's
    update_weights_from_tensor broadcasts them); ranks that do not own an expert drop it in SGLang's loader."""
    from sglang_trtllm_moe.sandbox import layers as cpu_layers

    new = checkpoint(spec, upd["seed"], experts=upd["experts"])
    before = {n: _as_bytes(getattr(layer, n)) for n in PREPARED}
    ptrs = {n: p.data_ptr() for n, p in layer.named_parameters()}
    model = cpu_layers.TinyMoeModel.__new__(cpu_layers.TinyMoeModel)
    torch.nn.Module.__init__(model)
    model.spec, model.experts, model.quant_config = spec, layer, layer.quant_config
    _updater(model, spec).update_weights_from_tensor(list(cpu_layers.checkpoint_names(new).items()))
    after = {n: _as_bytes(getattr(layer, n)) for n in PREPARED}
    merged = dict(tensors)
    merged.update(new)
    fresh = _build_loaded(spec, merged)
    fresh.quant_method.process_weights_after_loading(fresh)
    return dict(
        upd_before=before,
        upd_after=after,
        upd_ptrs_same=ptrs == {n: p.data_ptr() for n, p in layer.named_parameters()},
        upd_fresh={n: _as_bytes(getattr(fresh, n)) for n in PREPARED},
        upd_scalars_equal={n: torch.equal(getattr(layer, n).data, getattr(fresh, n).data) for n in SCALARS},
        upd_out=forward(layer, spec, sc["x"], sc["logits"], sc.get("bypass", False)),
        upd_fresh_out=forward(fresh, spec, sc["x"], sc["logits"], sc.get("bypass", False)),
    )


_CFG_DIR: dict = {}


def _updater(model, spec):
    import tempfile

    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.model_executor.model_runner_components.weight_updater import WeightUpdater

    from . import sglang_runtime

    if "d" not in _CFG_DIR:  # from_tensor never reads the directory, but ModelConfig needs a config.json
        _CFG_DIR["d"] = tempfile.mkdtemp(prefix="trtllm-moe-mr-cfg-")
        sglang_runtime.write_safetensors_checkpoint(_CFG_DIR["d"], {}, spec)
    import torch.distributed as dist

    return WeightUpdater(
        tp_rank=dist.get_rank(),
        device="cpu",
        gpu_id=0,
        model_config=ModelConfig(model_path=_CFG_DIR["d"]),
        custom_weight_loaders={},
        get_model=lambda: model,
        update_model_fields=lambda *a, **k: None,
        recapture_cuda_graph=lambda: None,
        get_model_runner=lambda: None,
    )


def _record_kernel_calls():
    """Wrap the emulator entry points so each rank reports the EP slice and intermediate size the runner passed."""
    from sglang_trtllm_moe import emulator

    for name in [
        f"trtllm_{k}{r}_moe"
        for k in ("fp4_block_scale", "fp8_per_tensor_scale", "fp8_block_scale", "bf16")
        for r in ("", "_routed")
    ]:
        fn = getattr(emulator, name)  # a renamed entry point must fail loudly, not silently record nothing

        def wrapped(*a, __fn=fn, __name=name, **kw):
            _LAST_CALL.clear()
            _LAST_CALL["fn"] = __name
            _LAST_CALL.update(
                {k: kw.get(k) for k in ("local_expert_offset", "local_num_experts", "num_experts", "intermediate_size")}
            )
            return __fn(*a, **kw)

        setattr(emulator, name, wrapped)


_LAST_CALL: dict = {}


def main(argv):
    job_file, rank, world, port, out_dir = argv[0], int(argv[1]), int(argv[2]), int(argv[3]), argv[4]
    os.environ["SGLANG_TRTLLM_MOE_EMULATE"] = "1"

    torch.set_num_threads(1)  # N ranks share 2 cores: oversubscription makes gloo collectives crawl
    from sglang.srt.plugins import load_plugins

    from .sglang_runtime import init_rank

    load_plugins()  # SGLang's own entry-point discovery runs our register(), as in every scheduler process
    _record_kernel_calls()
    job = torch.load(job_file, weights_only=False)
    results: dict = {}
    current = None
    for sc in job["scenarios"]:
        if (sc["tp"], sc["ep"]) != current:
            init_rank(rank, world, sc["tp"], sc["ep"], port)
            current = (sc["tp"], sc["ep"])
        try:
            res = run_scenario(sc)
        except Exception as e:  # refusals are results too (e.g. SGLang's own uneven-EP assert)
            res = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
        results[sc["name"]] = res
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    torch.distributed.barrier()  # no rank leaves while another may still be in a collective


if __name__ == "__main__":
    main(sys.argv[1:])
