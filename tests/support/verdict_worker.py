"""One rank's side of the cross-rank verdict tests (issue #52): run by tests/support/multirank_worker.py for a scenario
with a `verdict` entry (tests/test_multirank.py with 2 ranks, tests/test_rank_verdicts.py with 4).

Every rank builds the scenario's prepared FusedMoE in a one-layer model and SGLang's own WeightUpdater around it (its
tp_rank this rank's), then takes the same requests through each path SGLang offers — `update_weights_from_tensor`
(a list, and a flattened bucket), `update_weights_from_disk`, `update_weights_from_distributed` (a trainer process
broadcasting flattened buckets over gloo: tests/support/gloo_trainer.py), `update_weights_from_ipc`
(checkpoint-engine's loop, its transport stood in: tests/support/checkpoint_engine.py) — first a request with one
bad tensor (of an expert only some ranks hold), then a good one. It saves what each request answered and which of
its parameters' bytes changed, and after the good one its bytes and those of a layer freshly loaded with the same
checkpoint through SGLang's own loader (and prepared). Then, on the tensor path: a check that raises on one rank, and
one rank that answers late.
"""

from __future__ import annotations

import os
import tempfile
import time
from types import SimpleNamespace

import torch

#: the paths each scenario takes, in order
PATHS = ("tensor", "flattened", "disk", "distributed", "ipc")


def _bytes(layer) -> dict:
    return {n: p.detach().reshape(-1).view(torch.uint8).clone() for n, p in layer.named_parameters()}


def _changed(a: dict, b: dict) -> list[str]:
    return sorted(n for n in a if not torch.equal(a[n], b[n]))


def named(spec, tensors) -> list:
    from sglang_trtllm_moe.sandbox import layers as cpu_layers

    return list(cpu_layers.checkpoint_names(tensors).items())


def spoiled(spec, tensors, expert: int) -> dict:
    """`tensors` with one NaN byte in expert `expert`'s gate block scale (an e4m3 NaN: refused by its values)."""
    out = dict(tensors)
    key = f"experts.{expert}.gate_proj.weight_scale"
    bad = out[key].clone()
    bad.view(torch.uint8).view(-1)[-1] = 0x7F
    out[key] = bad
    return out


def requests(spec, v: dict):
    """(bad checkpoint, good checkpoint) of a path, by its seeds (the same on every rank and in the trainer)."""
    from .multirank_worker import checkpoint

    good = checkpoint(spec, v["seed"])
    return spoiled(spec, checkpoint(spec, v["seed"] + 100), v["bad_expert"]), good


def updater(model, path=None):
    """SGLang's WeightUpdater around `model` as this rank's scheduler builds it (its tp_rank this rank's); `path`: the
    model directory a disk update reads (else one with the config only)."""
    import torch.distributed as dist
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.model_executor.model_runner_components.weight_updater import WeightUpdater

    from . import sglang_runtime

    if path is None:
        if "cfg" not in _DIRS:
            _DIRS["cfg"] = tempfile.mkdtemp(prefix="trtllm-moe-verdict-cfg-")
            sglang_runtime.write_safetensors_checkpoint(_DIRS["cfg"], {}, model.spec)
        path = _DIRS["cfg"]
    u = WeightUpdater(
        tp_rank=dist.get_rank(),
        device="cpu",
        gpu_id=0,
        model_config=ModelConfig(model_path=path),
        custom_weight_loaders={},
        get_model=lambda: model,
        update_model_fields=lambda *a, **k: None,
        recapture_cuda_graph=lambda: None,
        get_model_runner=lambda: SimpleNamespace(model=model),  # what checkpoint-engine's extension reads
    )
    return u


_DIRS: dict = {}


def run(sc: dict, build_loaded) -> dict:
    """The scenario's requests on this rank (build_loaded: the multirank worker's loader of a checkpoint into a
    fresh layer)."""
    from sglang_trtllm_moe.sandbox import layers as cpu_layers

    from .multirank_worker import checkpoint

    spec = cpu_layers.MoeSpec(**sc["spec"])
    v = sc["verdict"]
    layer = build_loaded(spec, checkpoint(spec, sc["seed"]))
    layer.quant_method.process_weights_after_loading(layer)
    model = cpu_layers.TinyMoeModel.__new__(cpu_layers.TinyMoeModel)
    torch.nn.Module.__init__(model)
    model.spec, model.experts, model.quant_config = spec, layer, layer.quant_config
    out: dict = {"ep_rank": layer.moe_ep_rank, "local_experts": layer.num_local_experts}
    for k, path in enumerate(v["paths"]):
        bad, good = requests(spec, {**v, "seed": v["seed"] + k})
        for kind, tensors in (("bad", bad), ("good", good)):
            before = _bytes(layer)
            ok, msg = _through(path, model, spec, tensors, v, k, kind)
            after = _bytes(layer)
            res = {"ok": ok, "msg": msg, "changed": _changed(before, after)}
            if kind == "good":
                fresh = build_loaded(spec, tensors)
                fresh.quant_method.process_weights_after_loading(fresh)
                from .bad_updates import compared

                res["differs_from_fresh"] = _changed({n: after[n] for n in compared(fresh)}, _bytes(fresh))
            out[(path, kind)] = res
    if v.get("failures"):
        out.update(_failures(model, spec, v))
    return out


def _through(path: str, model, spec, tensors, v: dict, k: int, kind: str):
    if path in ("tensor", "flattened"):
        u = updater(model)
        items = named(spec, tensors)
        if path == "tensor":
            return u.update_weights_from_tensor(items)[:2]
        from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket

        flat = FlattenedTensorBucket(named_tensors=items)
        payload = {"flattened_tensor": flat.get_flattened_tensor(), "metadata": flat.get_metadata()}
        return u.update_weights_from_tensor(payload, load_format="flattened_bucket")[:2]
    if path == "disk":
        d = os.path.join(v["dirs"], f"{k}-{kind}")  # written by the test process, the same files for every rank
        return updater(model, d).update_weights_from_disk(d, "auto")[:2]
    if path == "distributed":
        import torch.distributed as dist

        from .gloo_trainer import request_fields

        u = updater(model)
        if "groups" not in _DIRS:  # this rank joins the trainer's group once (rank 0 of it: the trainer)
            ok, msg = u.init_weights_update_group(
                "127.0.0.1", v["port"], 1, dist.get_world_size() + 1, v["group"], backend="gloo"
            )
            assert ok, msg
            _DIRS["groups"] = u._model_update_group
        u._model_update_group.update(_DIRS["groups"])  # (later scenarios' updaters, around their own models)
        bucket = v["distributed"][kind]  # the trainer's flattened bucket: names, dtypes, shapes
        fields = request_fields(bucket, group=v["group"])
        if hasattr(u, "receive_weights_from_distributed"):
            return u.load_weights_from_distributed(u.receive_weights_from_distributed(**fields))[:2]
        return u.update_weights_from_distributed(**fields)[:2]
    if path == "ipc":
        from . import checkpoint_engine as ce

        server = ce.ParameterServer([named(spec, tensors)])
        with ce.installed(server):
            try:
                return updater(model).update_weights_from_ipc(ce.request())[:2]
            except RuntimeError as e:  # checkpoint-engine's answer to a bucket that raised on this worker
                return False, f"{e}: {server.replies[-1][-600:]}"
    raise KeyError(path)


def _failures(model, spec, v: dict) -> dict:
    """A check that raises on rank 1 only, then a rank that answers after the others gave up; a good request after
    each (the ranks' collectives stay paired)."""
    import torch.distributed as dist

    from sglang_trtllm_moe.updates import bucket_validation, verdicts

    from .multirank_worker import checkpoint

    out: dict = {}
    rank = dist.get_rank()
    real = bucket_validation.check_items
    for case in ("raises", "late"):
        if case == "late":  # a short time-out for the case (the others keep the default)
            os.environ[verdicts.TIMEOUT_ENV] = str(v["timeout_s"])
        tensors = checkpoint(spec, v["seed"] + 50 + len(out))

        def spoiled_check(*a, _case=case, **k):
            bucket_validation.check_items = real  # once
            if _case == "raises":
                raise RuntimeError("a check that fails on rank 1 only")
            time.sleep(float(v["late_s"]))
            return real(*a, **k)

        if rank == 1:
            bucket_validation.check_items = spoiled_check
        before = _bytes(model.experts)
        try:
            ok, msg = updater(model).update_weights_from_tensor(named(spec, tensors))[:2]
        finally:
            bucket_validation.check_items = real
            os.environ.pop(verdicts.TIMEOUT_ENV, None)
        out[(case, "refused")] = {"ok": ok, "msg": msg, "changed": _changed(before, _bytes(model.experts))}
        dist.barrier()  # (the test's own: the next request starts together on every rank)
        ok, msg = updater(model).update_weights_from_tensor(named(spec, tensors))[:2]
        out[(case, "after")] = {"ok": ok, "msg": msg}
    return out


def checkpoint_dirs(spec, v: dict, root: str) -> str:
    """The disk path's checkpoints, one directory per request, written once (by the test process)."""
    from . import sglang_runtime

    k = v["paths"].index("disk")
    bad, good = requests(spec, {**v, "seed": v["seed"] + k})
    for kind, tensors in (("bad", bad), ("good", good)):
        sglang_runtime.write_safetensors_checkpoint(os.path.join(root, f"{k}-{kind}"), tensors, spec)
    return root


def trainer_buckets(spec, v: dict) -> dict:
    """The distributed path's buckets (the trainer's flattened-bucket order), bad then good."""
    from .gloo_trainer import ordered

    k = v["paths"].index("distributed")
    bad, good = requests(spec, {**v, "seed": v["seed"] + k})
    return {"bad": ordered(named(spec, bad)), "good": ordered(named(spec, good))}


# ---- the test process's side: the scenarios, their files and trainer, what every rank must have answered -----------

SPEC = dict(num_experts=8, hidden=128, intermediate=128)
GROUP = "verdict"


def scenario(name: str, tp: int, ep: int, bad_expert: int, seed: int = 0, failures: bool = False) -> dict:
    """A verdict scenario for multirank_worker: every path, a bad tensor of expert `bad_expert`, then a good request;
    `failures`: then a check that raises on rank 1 and a rank that answers late (tensor path)."""
    v = dict(paths=PATHS, seed=seed + 10, bad_expert=bad_expert, group=GROUP, failures=failures)
    if failures:
        v.update(timeout_s=1.0, late_s=5.0)  # late: past the time-out and its margin (verdicts.MARGIN_S)
    return dict(name=name, tp=tp, ep=ep, spec=dict(SPEC), seed=seed, verdict=v)


def prepare(scenarios: list[dict], tmp) -> list:
    """Writes each scenario's disk checkpoints under `tmp` (into its `verdict`); returns the trainer's buckets, in the
    order the ranks receive them."""
    from sglang_trtllm_moe.sandbox import layers as cpu_layers

    buckets = []
    for sc in scenarios:
        spec, v = cpu_layers.MoeSpec(**sc["spec"]), sc["verdict"]
        if "disk" in v["paths"]:
            v["dirs"] = checkpoint_dirs(spec, v, str(tmp / sc["name"]))
        if "distributed" in v["paths"]:
            v["distributed"] = trainer_buckets(spec, v)
            buckets += [v["distributed"]["bad"], v["distributed"]["good"]]
    return buckets


def assert_agreed(per_rank: list[dict], sc: dict) -> None:
    """Every path: the bad request answered (False, the same message) on every rank, naming the bad expert, with no
    byte changed anywhere; the good one accepted everywhere, each rank's bytes those of SGLang's own loader."""
    bad = sc["verdict"]["bad_expert"]
    for path in sc["verdict"]["paths"]:
        answers = [r[(path, "bad")] for r in per_rank]
        assert not any(a["ok"] for a in answers), (path, [a["msg"] for a in answers])
        assert len({a["msg"] for a in answers}) == 1, (path, [a["msg"] for a in answers])
        assert f"expert {bad}" in answers[0]["msg"] and "refused the whole" in answers[0]["msg"], answers[0]["msg"]
        assert [a["changed"] for a in answers] == [[]] * len(answers), path
        good = [r[(path, "good")] for r in per_rank]
        assert all(g["ok"] for g in good), (path, [g["msg"] for g in good])
        assert [g["differs_from_fresh"] for g in good] == [[]] * len(good), path
