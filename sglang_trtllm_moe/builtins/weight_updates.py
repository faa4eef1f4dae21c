"""Flush points: the end of every weight-update entry point of the running release.

`update_weights_from_disk` re-runs process_weights_after_loading, which our quant-method hook turns into a flush
of the dirty experts. The tensor / distributed / IPC paths only call `model.load_weights`: without a flush their
experts would stay in checkpoint layout (upstream: silent garbage, vllm#42821), so they get an AFTER hook.
Every entry point also drops the cached index maps first (sglang#28676).
"""

from __future__ import annotations

from .. import hookimpl, layer_state
from ..targets import HookTarget

UPDATER = "sglang.srt.model_executor.model_runner_components.weight_updater.WeightUpdater"
MODEL_RUNNER = "sglang.srt.model_executor.model_runner.ModelRunner"


def drop_caches_before(*args, **kwargs):
    layer_state.on_reload_start()


def unprepare_all_before(updater, *args, **kwargs):
    """begin_weight_update: the session's model (WeightUpdater.get_model) to checkpoint layout."""
    layer_state.on_reload_start()
    layer_state.unprepare_all(updater.get_model())


def flush_after(result, *args, **kwargs):
    layer_state.flush_all()
    return None


def end_session_after(result, *args, **kwargs):
    layer_state.flush_all(end_session=True)
    return None


# (dotted path, releases): where each release keeps its weight-update entry points (read from each release's
# model_runner.py / model_runner_components/weight_updater.py; compat/features.py WEIGHT_UPDATER, DISTRIBUTED_UPDATE_RENAMED).
LOAD_ONLY_ENTRY_POINTS = (
    (f"{UPDATER}.update_weights_from_tensor", ">=0.5.16"),
    (f"{UPDATER}.update_weights_from_distributed", ">=0.5.16,<0.5.21"),  # renamed in 0.5.21:
    (f"{UPDATER}.load_weights_from_distributed", ">=0.5.21"),
    (f"{UPDATER}.update_weights_from_ipc", ">=0.5.16"),
    (f"{MODEL_RUNNER}.update_weights_from_tensor", "<0.5.16"),
    (f"{MODEL_RUNNER}.update_weights_from_distributed", "<0.5.16"),
)
RELOAD_START = (
    (f"{UPDATER}.update_weights_from_disk", ">=0.5.16"),
    (f"{MODEL_RUNNER}.update_weights_from_disk", "<0.5.16"),
)


@hookimpl
def register_sglang_hooks(register, release):
    for target, rel in LOAD_ONLY_ENTRY_POINTS:
        register(HookTarget(target, flush_after, "after", releases=rel, capability="rl-update",
                            why="prepare the experts this update wrote (load_weights alone never does)"))
    for target, rel in RELOAD_START + LOAD_ONLY_ENTRY_POINTS:
        register(HookTarget(target, drop_caches_before, "before", releases=rel, capability="rl-update",
                            why="drop cached layout index maps so none survives a pause/resume"))
    register(HookTarget(f"{UPDATER}.end_weight_update", end_session_after, "after", releases=">=0.5.21",
                        capability="rl-update", why="the session is over: prepare everything it wrote"))
    register(HookTarget(f"{UPDATER}.begin_weight_update", unprepare_all_before, "before", releases=">=0.5.21",
                        capability="rl-update",
                        why="a begin/end session may write straight into parameters: every managed layer to checkpoint layout"))
