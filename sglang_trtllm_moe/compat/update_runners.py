"""The runners one scheduler-side weight-update request loads into, as each release's scheduler picks them.

Why the plugin needs it: SGLang loads one request into the target's runner and the speculative draft's runners one
after another, and stops at the first that answers False. A tensor the draft refuses would already be in the target
(or, on the tensor path before 0.5.21, which loads the draft first, a tensor the target refuses would already be in
the draft). The plugin checks the request against every runner before the first loads it
(builtins/runner_requests.py `selected_runners_around`); this module says which runners those are.

Which runners, read from each release's scheduler (`SchedulerUpdateWeightsMixin` before 0.5.13,
`SchedulerWeightUpdaterManager` after) and spec workers:

* 0.5.21+ (features.UPDATE_RUNNER_SELECTOR): the request's `selector` ("target" / "draft" / "all"; disk and IPC take
  none: every runner), each worker's runners from its public `weight_update_runners()`;
* before: disk and IPC load the target, then the draft; tensor the draft, then the target (the target alone under
  `disable_draft_model`); distributed the target alone (features.DISTRIBUTED_UPDATE_SKIPS_DRAFT: nothing to check
  across runners). The draft worker names its runners one of `DRAFT_RUNNER_SPELLINGS`.

A worker that has none of the spellings answers None: the request is then checked runner by runner, as SGLang
loads it (never a wrong cross-check).
"""

from __future__ import annotations

from typing import Any

#: (attribute path on the scheduler's `draft_worker`, which spec workers spell their draft runners so, before
#: `weight_update_runners()` (0.5.21); read from each worker's own update_weights_from_disk), tried in order: the first
#: found answers
DRAFT_RUNNER_SPELLINGS: tuple[tuple[str, str], ...] = (
    ("draft_worker.draft_runners", "BaseSpecWorker 0.5.16-0.5.20: EAGLEWorkerV2, MultiLayerEagleWorkerV2 (a list)"),
    ("_draft_worker.draft_runner_list", "MultiLayerEagleWorkerV2 0.5.11-0.5.15, one runner per draft step"),
    ("_draft_worker.draft_runner", "EAGLEWorkerV2 0.5.11-0.5.15 (SGLang's own _get_draft_model_runner reads it)"),
    ("draft_model_runner", "the DFlash / FrozenKVMTP workers"),
    ("model_runner", "the v1 EAGLEWorker (0.5.11-0.5.12): a TpModelWorker over the draft's runner"),
)


def _at(obj: Any, path: str) -> Any:
    for part in path.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            return None
    return obj


#: how the target's TpModelWorker names its runner before `weight_update_runners()`
TARGET_RUNNER_SPELLINGS: tuple[tuple[str, str], ...] = (("model_runner", "TpModelWorker"),)


def _runners(worker: Any, spellings: tuple) -> list | None:
    listed = getattr(worker, "weight_update_runners", None)
    if callable(listed):
        return [runner for _, runner in listed()]
    for path, _ in spellings:
        found = _at(worker, path)
        if found is not None:
            return list(found) if isinstance(found, (list, tuple)) else [found]
    return None


def _roles(recv_req: Any, method: str) -> tuple[str, ...]:
    selector = getattr(recv_req, "selector", None)
    if selector is not None:  # 0.5.21+ tensor / distributed
        return ("target", "draft") if selector == "all" else (selector,)
    if method == "update_weights_from_distributed":  # before 0.5.21: the target alone
        return ("target",)
    if getattr(recv_req, "disable_draft_model", False):  # a tensor request that asks for the target alone
        return ("target",)
    return ("target", "draft")


def selected_runners(scheduler: Any, recv_req: Any, method: str) -> list | None:
    """The runners `scheduler` (the object whose update_weights_from_* serve the request: the manager, or the
    Scheduler before 0.5.13) loads `recv_req` into by `method`, the target's first; None where a worker does not say
    (then each runner checks only its own layers, as before)."""
    roles = _roles(recv_req, method)
    out: list = []
    for role, spellings in (("target", TARGET_RUNNER_SPELLINGS), ("draft", DRAFT_RUNNER_SPELLINGS)):
        worker = getattr(scheduler, "tp_worker" if role == "target" else "draft_worker", None)
        if role not in roles or worker is None:
            continue
        runners = _runners(worker, spellings)
        if runners is None:
            return None
        out += runners
    return out
