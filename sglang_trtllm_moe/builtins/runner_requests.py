"""One scheduler request, several runners: a speculative draft's runners load the same update as the target's.

SGLang's scheduler loads one disk / tensor / IPC request (from 0.5.21 distributed too) into the target's runner and the
draft's, one after another, and stops at the first that answers False: a tensor only a later runner refuses would
already be in an earlier one (disk and IPC load the target first, tensor before 0.5.21 the draft first). While the
scheduler serves such a request, each runner's entry-point check (weight_updates.py) also covers the runners still
to load, and the request remembers what was checked for which runner so nothing is checked twice
(updates/request.py: the request object, with the ranks that answer it together). Which runners a request reaches,
per release: compat/update_runners.py.
"""

from __future__ import annotations

import logging

from .. import hookimpl
from ..compat import features, update_runners
from ..targets import HookTarget
from ..updates import request
from .weight_updates import MANAGER, MIXIN, model_of

logger = logging.getLogger("sglang_trtllm_moe")


def selected_models(manager, recv_req, method: str) -> tuple:
    """The models of the runners SGLang's scheduler loads the request into, once each; () where a worker does not
    say, or asking it fails (the request is then checked per runner, as SGLang loads it: never an error of ours in
    the scheduler's update)."""
    try:
        runners = update_runners.selected_runners(manager, recv_req, method)
    except Exception:  # noqa: BLE001 - a worker of a release or kind not read here: SGLang's own behaviour
        logger.debug("sglang-trtllm-moe: the runners of %s not told; checked per runner", method, exc_info=True)
        return ()
    models = [] if runners is None else [model_of(r) for r in runners]
    return tuple({id(m): m for m in models if m is not None}.values())


def _selected_runners_around(method: str):
    def selected_runners_around(original, manager, recv_req, *args, **kwargs):
        """While SGLang's scheduler serves the request: every runner's check covers the runners still to load."""
        with request.serving(selected_models(manager, recv_req, method)):
            return original(manager, recv_req, *args, **kwargs)

    selected_runners_around.__qualname__ = f"selected_runners_around[{method}]"
    return selected_runners_around


# (class, method, releases): where the scheduler serves a request that loads into more than one runner (target and
# speculative draft): the Scheduler's mixin before 0.5.13, the manager after; distributed only from 0.5.21 (before, it
# loads the target alone: features.DISTRIBUTED_UPDATE_SKIPS_DRAFT)
_TO_EVERY_RUNNER = ("update_weights_from_disk", "update_weights_from_tensor", "update_weights_from_ipc")
SCHEDULER_ENTRY_POINTS = (
    *((MIXIN, m, features.SCHEDULER_UPDATE_MANAGER.before) for m in _TO_EVERY_RUNNER),
    *((MANAGER, m, features.SCHEDULER_UPDATE_MANAGER.releases) for m in _TO_EVERY_RUNNER),
    (MANAGER, "update_weights_from_distributed", features.UPDATE_RUNNER_SELECTOR.releases),
)


@hookimpl
def register_sglang_hooks(register, release):
    for target, method, rel in SCHEDULER_ENTRY_POINTS:
        register(
            HookTarget(
                f"{target}.{method}",
                _selected_runners_around(method),
                "around",
                releases=rel,
                capability="rl-update",
                why="check a request against every runner it loads before the first loads it (a bad draft tensor "
                "would otherwise leave the target written, or a bad target tensor the draft)",
            )
        )
