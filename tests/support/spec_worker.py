"""A speculative target + draft behind SGLang's own scheduler and spec worker of releases before 0.5.21, at the layer.

The sandbox stands a whole draft ModelRunner up from 0.5.21 only (sandbox/releases.MODEL_RUNNER_RELEASES);
what decides which runner an update reaches before 0.5.21 is SGLang's scheduler entry points and spec worker, and
those run here as the release has them:

* the scheduler: 0.5.13+ `SchedulerWeightUpdaterManager` (constructed with its own dataclass fields), before a
  `Scheduler` (no __init__: it would start ZMQ sockets, a tokenizer and a model) whose `SchedulerUpdateWeightsMixin`
  methods read `tp_worker`, `draft_worker`, `flush_cache`, `tp_cpu_group`;
* the target's `TpModelWorker` and the draft's spec worker, no __init__ (each builds a ModelRunner, KV pools and CUDA
  graphs): `EAGLEWorkerV2` (with its `EagleDraftWorker`), `MultiLayerEagleWorkerV2` (with its
  `MultiLayerEagleDraftWorker`, one runner per draft step) or, where the release has it, the v1 `EAGLEWorker` (a
  TpModelWorker over the draft's runner) — the fields their update methods read: `model_runner` / `tp_rank` / `ps`,
  `target_worker` / `_draft_worker.draft_runner(_list)` / `speculative_num_steps` / `server_args`;
* each runner: the object that owns SGLang's update entry points on the release (tests/support/sglang_runtime.py
  `weight_updater`: the ModelRunner shell before 0.5.16, a ModelRunner shell over a real WeightUpdater after)
  around a TinyMoeModel whose FusedMoE layer the plugin prepares: the target's at layer 0, the draft's at layer 1
  (`Target` / `Draft`), each loading its own layer's names and skipping the other's, as SGLang's DeepSeek target
  skips its NextN layer's names and the NextN draft loads that layer alone. So one request carries both runners'
  tensors, and a tensor can be malformed for one runner only.

Stand-ins, each for a CUDA-only or process-level piece an update never reads: the __init__s above, `flush_cache`
(the KV cache), the metrics collector (None), the scheduler's weight-version record, and before 0.5.13 an
import-only `sgl_kernel.kvcacheio` (sandbox/standins.py: the scheduler module imports it; no CPU build exists).
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

from sglang_trtllm_moe.compat import features
from sglang_trtllm_moe.sandbox import layers as cpu_layers
from sglang_trtllm_moe.sandbox import standins

from . import sglang_runtime

DRAFT_PATH = "/models/tiny-draft-nextn"


class Target(cpu_layers.TinyMoeModel):
    """The target: its MoE layer at layer 0; names below other layers skipped (the draft's)."""

    def load_weights(self, weights):
        return super().load_weights((n, t) for n, t in weights if n.startswith(self.prefix))


class Draft(Target):
    """The draft: its MoE layer at layer 1 (a NextN layer's place: the layer after the target's last)."""

    prefix = "model.layers.1.mlp."


def named(cls, tensors) -> dict:
    """`tensors` (below the MoE block) under `cls`'s layer, by their full checkpoint names."""
    return {cls.prefix + k: v for k, v in cpu_layers.below_block(tensors).items()}


def runner(model):
    """SGLang's ModelRunner as the spec worker and TpModelWorker of this release reach a model's update entry points."""
    if not features.WEIGHT_UPDATER.present():
        return sglang_runtime.updater(model)  # the ModelRunner shell, whose own methods are the entry points
    from sglang.srt.model_executor.model_runner import ModelRunner

    shell = object.__new__(ModelRunner)
    # the runner SGLang's WeightUpdater asks for (get_model_runner): the checkpoint-engine extension reads its model
    shell.__dict__.update(model=model, tp_rank=0, device="cpu", gpu_id=0)
    shell.weight_updater = sglang_runtime.updater(model, runner=shell)
    return shell


def tp_worker(model_runner):
    # before 0.5.13 the managers import sgl_kernel.kvcacheio at module level (no CPU build): sandbox/standins.py
    standins.sgl_kernel_kvcacheio_import_stub()
    from sglang.srt.managers.tp_worker import TpModelWorker

    w = object.__new__(TpModelWorker)
    # `model_runner`: an attribute on some releases, a property over `_model_runner` on others
    w.__dict__.update(model_runner=model_runner, _model_runner=model_runner, tp_rank=0, ps=SimpleNamespace(tp_rank=0))
    return w


#: the spec workers a scheduler of these releases may hold (`spec_worker`'s `kind`): SGLang's class, what it serves
WORKERS = {
    "eagle_v2": ("eagle_worker_v2", "EAGLEWorkerV2", "DeepSeek MTP / NextN's worker with the overlap scheduler"),
    "multi_layer_v2": ("multi_layer_eagle_worker_v2", "MultiLayerEagleWorkerV2", "one draft runner per step"),
    "eagle_v1": ("eagle_worker", "EAGLEWorker", "without the overlap scheduler: a TpModelWorker over the draft"),
}


def worker_class(kind: str):
    """SGLang's class for `kind`, or None where this release has none (the v1 EAGLEWorker is gone from 0.5.13)."""
    import importlib

    standins.sgl_kernel_kvcacheio_import_stub()  # the speculative modules import the managers (tp_worker above)
    module, name, _ = WORKERS[kind]
    try:
        found = importlib.import_module(f"sglang.srt.speculative.{module}")
    except ModuleNotFoundError as e:
        if e.name != f"sglang.srt.speculative.{module}":
            raise
        return None
    return getattr(found, name, None)


def spec_worker(target_worker, draft_runners: list, kind: str = "eagle_v2"):
    """SGLang's spec worker of `kind` over the target's worker and the draft's runners (one, except per-step
    MultiLayerEagleWorkerV2), with the fields its update methods read."""
    import importlib

    cls = worker_class(kind)
    w = object.__new__(cls)
    fields = dict(
        target_worker=target_worker,  # an attribute before 0.5.17, a property over _target_worker after
        _target_worker=target_worker,
        tp_rank=0,
        ps=SimpleNamespace(tp_rank=0),
        server_args=SimpleNamespace(speculative_draft_model_path=DRAFT_PATH, speculative_algorithm="EAGLE"),
    )
    if kind == "eagle_v1":  # the TpModelWorker's own update methods, on the draft's runner
        fields.update(model_runner=draft_runners[0], _model_runner=draft_runners[0])
    else:
        module = importlib.import_module(f"sglang.srt.speculative.{WORKERS[kind][0]}")
        inner_cls = module.EagleDraftWorker if kind == "eagle_v2" else module.MultiLayerEagleDraftWorker
        inner = object.__new__(inner_cls)
        inner.__dict__.update(
            draft_runner=draft_runners[0], _draft_runner=draft_runners[0], draft_runner_list=list(draft_runners)
        )
        fields.update(_draft_worker=inner, speculative_num_steps=len(draft_runners))
    w.__dict__.update(fields)
    return w


def scheduler(target_worker, draft_worker):
    """The object whose update_weights_from_* methods serve the scheduler's requests on this release."""
    from sglang.srt.distributed import get_tp_group

    fields = dict(
        tp_worker=target_worker,
        draft_worker=draft_worker,
        tp_cpu_group=get_tp_group().cpu_group,
        flush_cache=lambda empty_cache=False: True,
    )
    if not features.SCHEDULER_UPDATE_MANAGER.present():
        from sglang.srt.managers.scheduler import Scheduler

        s = object.__new__(Scheduler)
        s.__dict__.update(fields)
        return s
    from sglang.srt.managers.scheduler_components.weight_updater import SchedulerWeightUpdaterManager

    class Versions:  # the scheduler's record of weight versions (0.5.14+ asks it after a successful update)
        def record_weight_version_change(self, new_version=None):
            return None

    have = {f.name for f in dataclasses.fields(SchedulerWeightUpdaterManager) if f.init}
    extra = dict(memory_saver_adapter=None, is_fully_idle=lambda **kw: True, scheduler=Versions())
    return SchedulerWeightUpdaterManager(**{k: v for k, v in {**fields, **extra}.items() if k in have})
