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

from .. import capabilities, hookimpl
from ..compat import features, update_runners
from ..targets import HookTarget
from ..updates import request
from .weight_updates import MANAGER, MIXIN, model_of

logger = logging.getLogger("sglang_trtllm_moe")


def selected_models(manager, recv_req, method: str) -> tuple | None:
    """The models of the runners SGLang's scheduler loads the request into, once each; None where a worker does not
    say (none of the spellings compat/update_runners.py reads), or asking it fails."""
    try:
        runners = update_runners.selected_runners(manager, recv_req, method)
    except Exception:  # noqa: BLE001 - a worker of a release or kind not read here
        logger.debug("sglang-trtllm-moe: the runners of %s not told", method, exc_info=True)
        return None
    if runners is None:
        return None
    models = [model_of(r) for r in runners]
    return tuple({id(m): m for m in models if m is not None}.values())


#: what the request-checks probe reaches by name when SGLang's workers do not list their runners
DRAFT_RUNNERS = "the draft worker's runners (compat/update_runners.py DRAFT_RUNNER_SPELLINGS)"


def unknown_runners(manager, method: str) -> str | None:
    """Why a request whose runners cannot be told must be refused before any runner loads it: the scheduler has a
    speculative draft (a tensor only the draft refuses would already be in the target), or None (the target alone:
    its own checks keep it whole). The probe that found nothing counts as a missing target (capabilities.py)."""
    if getattr(manager, "draft_worker", None) is None:
        return None
    why = "the scheduler's workers name their runners in none of the ways this plugin reads"
    capabilities.probe_missing("request-checks", DRAFT_RUNNERS, why)
    return (
        f"sglang-trtllm-moe refused this {method} request before any runner loaded it: {why}, so it cannot be "
        "checked against the target and the speculative draft before the first of them loads it. Fix: run "
        "sglang-trtllm-moe with an SGLang release it was tested on (`sglang-trtllm-moe doctor`)"
    )


def _selected_runners_around(method: str):
    def selected_runners_around(original, manager, recv_req, *args, **kwargs):
        """While SGLang's scheduler serves the request: every runner's check covers the runners still to load (or,
        where the runners cannot be told and a draft is there, every runner's entry point refuses it)."""
        models = selected_models(manager, recv_req, method)
        token = capabilities.REQUEST_REFUSAL.set(unknown_runners(manager, method) if models is None else None)
        try:
            with request.serving(models or ()):
                return original(manager, recv_req, *args, **kwargs)
        finally:
            capabilities.REQUEST_REFUSAL.reset(token)

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
                group="request-checks",
                why="check a request against every runner it loads before the first loads it (a bad draft tensor "
                "would otherwise leave the target written, or a bad target tensor the draft)",
            )
        )
