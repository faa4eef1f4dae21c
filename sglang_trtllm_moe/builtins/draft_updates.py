"""A speculative draft that SGLang's distributed update leaves stale before 0.5.21: said at update time, not served.

Read from each release's scheduler (0.5.11-0.5.12 `SchedulerUpdateWeightsMixin`, 0.5.13-0.5.20
`SchedulerWeightUpdaterManager`) and spec workers: disk and IPC requests load the target, then the draft
(`draft_worker.update_weights_from_disk / _ipc`: `BaseSpecWorker`, `EAGLEWorkerV2`, `MultiLayerEagleWorkerV2`, the
v1 `EAGLEWorker` through `TpModelWorker`); a tensor request loads the draft, then the target (`EAGLEWorkerV2` /
v1 `EAGLEWorker.update_weights_from_tensor`; the target alone under `disable_draft_model`, as asked);
`update_weights_from_distributed` reaches `tp_worker` alone (features.DISTRIBUTED_UPDATE_SKIPS_DRAFT).

The plugin does not load the broadcast into the draft itself: SGLang of those releases has no way to say whether the
tensors are meant for the draft at all (a separately trained EAGLE draft is not the target's NextN layer: 0.5.21
added the request's `selector` for exactly that), and the broadcast is consumed by the target's receive; a hook
serves a call as the release does or hands it back unchanged. So after a distributed update SGLang answered as a
success, with a draft in the scheduler, the plugin logs a warning naming the draft and what to do (once per draft
worker, i.e. per scheduler: an RL step sends many buckets), and `explain` / the start-up log say the same
(updates/stale_draft.py).
"""

from __future__ import annotations

import logging
import threading
import weakref

from .. import hookimpl
from ..compat import features
from ..targets import HookTarget
from ..updates import stale_draft
from .weight_updates import MANAGER, MIXIN

logger = logging.getLogger("sglang_trtllm_moe")

_WARNED: weakref.WeakSet = weakref.WeakSet()  # the draft workers already named (one per scheduler)
_LOCK = threading.Lock()


def warn_stale_draft_after(result, scheduler, *args, **kwargs):
    """After SGLang's distributed update: if it succeeded and the scheduler has a draft, say that the draft was not
    updated and what to do. The answer is SGLang's, unchanged."""
    draft = getattr(scheduler, "draft_worker", None)
    if draft is None or not getattr(result, "success", False):
        return None
    if not stale_draft.has_draft_model(stale_draft.algorithm_of(draft)):
        return None  # an n-gram worker: no draft weights
    with _LOCK:
        try:
            if draft in _WARNED:
                return None
            _WARNED.add(draft)
        except TypeError:  # a draft worker without weak references: told every time
            pass
    text = stale_draft.note(stale_draft.draft_name(draft))
    if text is not None:
        logger.warning("sglang-trtllm-moe: %s (said once per scheduler)", text)
    return None


_SKIPS = features.DISTRIBUTED_UPDATE_SKIPS_DRAFT.releases
ENTRY_POINTS = (
    (f"{MIXIN}.update_weights_from_distributed", f"{features.SCHEDULER_UPDATE_MANAGER.before},{_SKIPS}"),
    (f"{MANAGER}.update_weights_from_distributed", f"{features.SCHEDULER_UPDATE_MANAGER.releases},{_SKIPS}"),
)


@hookimpl
def register_sglang_hooks(register, release):
    for target, rel in ENTRY_POINTS:
        register(
            HookTarget(
                target,
                warn_stale_draft_after,
                "after",
                releases=rel,
                capability="rl-update",
                group="draft-note",
                why="say that the speculative draft keeps its old weights after a distributed update, and what to do "
                "(SGLang loads it into the target alone on these releases)",
            )
        )
