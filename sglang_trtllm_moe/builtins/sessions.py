"""Weight-update sessions (SGLang 0.5.21+: `begin_weight_update` ... `end_weight_update`), loader-free ones included.

A session may write straight into the served parameters: through the loader (`update_weights_from_tensor` /
`_distributed` inside it, each checked by the loader hooks), or around it (P2P / RDMA writers; SGLang then ends the
session with `run_post_load=True`: "post_load_weights only if no load ran"). So:

* `begin`: the session's model returns to checkpoint layout (every managed layer; only the experts a writer said it
  writes, where it said so: updates/session_writes.py, carried by the begin request's `rid` or `expect()`);
* `end` of a loader-free session: before anything is laid out, every value a load would refuse is looked for in the
  written experts (updates/loader_free.py: one reduction per parameter, one read-back per device for the session);
  the ranks of the TP group agree on what was refused (one all-gather of the refusals); a refused expert is served
  as a zero expert, the rest laid out as written, and the scheduler answers `(False, message)` naming the layer, the
  parameter, the expert and the value (SGLang's own end answers success whatever its runners did);
* `end`: the session's layers laid out (SGLang's postprocess_weights reaches the quant-method hooks, which flush),
  the rest of the model's managed layers after it.
"""

from __future__ import annotations

import logging
import threading

from .. import hookimpl, layer_state
from ..compat import features
from ..targets import HookTarget
from ..updates import loader_free, rollback, session_writes

logger = logging.getLogger("sglang_trtllm_moe")

UPDATER = "sglang.srt.model_executor.model_runner_components.weight_updater.WeightUpdater"
MANAGER = "sglang.srt.managers.scheduler_components.weight_updater.SchedulerWeightUpdaterManager"

#: the refusals of the session ending in this process (its runners' ends), for the scheduler's answer
_REFUSED: list[str] = []
#: the scheduler's begin / end is running (its runners' hooks leave the hint and the answer to it)
_IN_MANAGER = threading.local()


def _managed() -> bool:
    return bool(getattr(_IN_MANAGER, "on", False))


def _experts_of(hint):
    if hint is None:
        return None
    return lambda layer: hint.local_ids(layer, layer_state.layer_name(layer))


def begin_before(updater, *args, **kwargs):
    """begin_weight_update: the session's model (WeightUpdater.get_model) to checkpoint layout — all of it, or the
    experts the writer's hint names."""
    if not _managed():
        session_writes.opened(session_writes.take())
    hint = session_writes.current()
    layer_state.on_reload_start()
    model = updater.get_model()
    rollback.forget(model)
    n = layer_state.unprepare_all(model, _experts_of(hint))
    if hint is not None:
        logger.info(
            "sglang-trtllm-moe: a session that writes %d expert(s) (hint): %d returned to checkpoint layout",
            hint.total,
            n,
        )


def end_around(original, updater, *args, **kwargs):
    """end_weight_update(run_post_load=...): a loader-free session's written experts checked before SGLang's
    post-processing lays anything out (refused experts fenced: updates/loader_free.py), then the session's layers
    laid out."""
    run_post_load = bool(kwargs.get("run_post_load", args[0] if args else False))
    if not _managed():
        _REFUSED.clear()
    model = updater.get_model()
    hint = session_writes.current()
    if run_post_load and model is not None:
        bad = _agreed(loader_free.check(model, _experts_of(hint)))
        if bad:
            n = loader_free.fence(model, bad)
            message = loader_free.message(bad)
            logger.error("%s (%d expert(s) fenced on this rank)", message, n)
            _REFUSED.append(message)
    result = original(updater, *args, **kwargs)
    layer_state.flush_all(end_session=True, model=model)
    if not _managed():
        session_writes.opened(None)
    return result


def _agreed(bad: list) -> list:
    """The refusals of every rank of the TP group (each rank checks its own shard of every expert: all must fence
    the same experts and answer the same). One all-gather over the group's CPU (gloo) group; none alone."""
    group = _tp_cpu_group()
    if group is None:
        return bad
    import torch.distributed as dist

    gathered: list = [None] * dist.get_world_size(group=group)
    dist.all_gather_object(gathered, bad, group=group)
    out: list = []
    for part in gathered:
        out += [b for b in part or () if b not in out]
    return out


def _tp_cpu_group():
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        return None
    try:
        from sglang.srt.distributed import get_tp_group

        tp = get_tp_group()
    except (ImportError, AssertionError, AttributeError):
        return None
    return tp.cpu_group if getattr(tp, "world_size", 1) > 1 else None


def manager_begin_around(original, manager, recv_req, *args, **kwargs):
    """The scheduler's begin: the writer's hint from the request's `rid` (or `session_writes.expect`) for every
    runner the session opens."""
    try:
        hint = session_writes.from_rid(getattr(recv_req, "rid", None))
    except ValueError as e:  # refused before the session opens: nothing changed
        from sglang.srt.managers.io_struct import BeginWeightUpdateReqOutput

        return BeginWeightUpdateReqOutput(success=False, message=str(e))
    pending = session_writes.take()
    session_writes.opened(hint if hint is not None else pending)
    _IN_MANAGER.on = True
    try:
        return original(manager, recv_req, *args, **kwargs)
    finally:
        _IN_MANAGER.on = False


def manager_end_around(original, manager, recv_req, *args, **kwargs):
    """The scheduler's end: `(False, message)` when a runner refused what the session wrote."""
    _REFUSED.clear()
    _IN_MANAGER.on = True
    try:
        out = original(manager, recv_req, *args, **kwargs)
    finally:
        _IN_MANAGER.on = False
        session_writes.opened(None)
    if _REFUSED and getattr(out, "success", False):
        message = "; ".join(dict.fromkeys(_REFUSED))
        _REFUSED.clear()
        return _answered(out, message)
    return out


def _answered(out, message: str):
    """SGLang's answer with success False and `message`, every other field kept (the request's routing fields)."""
    try:
        import msgspec

        return msgspec.structs.replace(out, success=False, message=message)
    except (ImportError, TypeError):  # not a msgspec Struct: a dataclass, or a plain object
        import dataclasses

        if dataclasses.is_dataclass(out) and not isinstance(out, type):
            return dataclasses.replace(out, success=False, message=message)
        return type(out)(success=False, message=message)


def last_refusal() -> str | None:
    """The refusal of the last session that ended in this process outside a scheduler request (a runner's
    `end_weight_update` called directly: tests, harnesses), or None."""
    return _REFUSED[-1] if _REFUSED else None


@hookimpl
def register_sglang_hooks(register, release):
    sessions = features.UPDATE_SESSIONS.releases
    register(
        HookTarget(
            f"{UPDATER}.begin_weight_update",
            begin_before,
            "before",
            releases=sessions,
            capability="rl-update",
            group="update-session",
            why="a begin/end session may write straight into parameters: the managed layers (or the experts the "
            "writer names) to checkpoint layout",
        )
    )
    register(
        HookTarget(
            f"{UPDATER}.end_weight_update",
            end_around,
            "around",
            releases=sessions,
            capability="loader-free-session",
            group="update-session",
            why="the session is over: what a loader-free session wrote is checked before it is laid out (refused "
            "experts fenced), then everything it wrote is prepared",
        )
    )
    register(
        HookTarget(
            f"{MANAGER}.begin_weight_update",
            manager_begin_around,
            "around",
            releases=features.LOADER_FREE_SESSIONS.releases,
            capability="loader-free-session",
            group="update-session",
            why="the writer's hint (which experts the session writes) from the begin request's rid",
        )
    )
    register(
        HookTarget(
            f"{MANAGER}.end_weight_update",
            manager_end_around,
            "around",
            releases=features.LOADER_FREE_SESSIONS.releases,
            capability="loader-free-session",
            group="update-session",
            why="answer (False, message) when the end refused what a loader-free session wrote (SGLang's own end "
            "always answers success)",
        )
    )
