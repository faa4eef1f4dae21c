"""`update_weights_from_distributed` with a speculative draft (issue #39): the draft_worker's target and draft runners
behind SGLang's `SchedulerWeightUpdaterManager`, and a trainer process (forked from the worker: SGLang is imported
already) that is rank 0 of SGLang's `init_custom_process_group` over gloo and broadcasts flattened buckets (gloo
cannot broadcast float8_e4m3fn).

What SGLang does (0.5.21-0.5.23 alike: the manager's `init_weights_update_group` and `update_weights_from_distributed`
are the same code in the three releases): only the target runner joins the update group (`init_weights_update_group`
goes to `tp_worker` alone; the draft runner never has a group); each update call receives one broadcast through the
target's `receive_weights_from_distributed` (a list of tensors), then hands that same list to
`load_weights_from_distributed` of every runner the request's `selector` names (target first, then draft), stopping
at the first runner that answers False. So the draft is updated on this path, from the target's receive; a
runner the selector leaves out keeps its bytes. Before 0.5.21 (no selector, outside MODEL_RUNNER_RELEASES) the
scheduler's distributed update reached the target alone: a draft stayed stale.

What it means for a bad draft tensor: SGLang's fan-out is per runner, so under selector all the target would have
loaded its part of the bucket before the draft's load refused the rest (the request answering False, the target
changed); the plugin checks the bucket against every runner the selector names before the first loads
(builtins/runner_requests.py `selected_runners_around`), so neither runner changes.
"""

from __future__ import annotations

from .gloo_trainer import GROUP, ordered, request_fields, running


def _session(w, buckets: list, selector: str) -> list:
    """begin / one update_weights_from_distributed per bucket / end, as the tokenizer manager sends them; the
    outputs. Every update call takes one broadcast (the receive comes before any load), whatever it answers."""
    from sglang.srt.managers.io_struct import (
        BeginWeightUpdateReqInput,
        EndWeightUpdateReqInput,
        UpdateWeightsFromDistributedReqInput,
    )

    outs = [w.manager.begin_weight_update(BeginWeightUpdateReqInput(selector=selector))]
    try:
        for bucket in buckets:
            req = UpdateWeightsFromDistributedReqInput(**request_fields(bucket), selector=selector)
            outs.append(w.manager.update_weights_from_distributed(req))
    finally:
        outs.append(w.manager.end_weight_update(EndWeightUpdateReqInput()))
    return outs


def _whole(named: list) -> list:
    """A whole checkpoint in two buckets: everything outside the experts (SGLang's DeepSeek loader fuses q_a_proj
    with kv_a_proj_with_mqa within one call only), then the experts."""
    return [ordered([kv for kv in named if (".experts." in kv[0]) == experts]) for experts in (False, True)]


def check_distributed(w) -> dict:
    """Sessions with selector all / draft / target, each a whole checkpoint of a new seed in two buckets: each runner
    equals a fresh load of the checkpoint meant for it, a runner left out keeps its bytes, storage kept, layers
    clean. Then three one-bucket sessions with a bad draft expert tensor (module docstring): draft experts only
    under selector draft and under all, and target + draft experts under all: refused, neither runner changed a
    byte."""
    from sglang.srt.managers.io_struct import DestroyWeightsUpdateGroupReqInput, InitWeightsUpdateGroupReqInput

    from .draft_worker import _nextn_tensors, _ok, bad_expert_bucket, changed_by

    plan = (("all", 9, (9, 9)), ("draft", 10, (9, 10)), ("target", 11, (11, 10)))
    bad_draft, bad_mixed = ordered(bad_expert_bucket(w, 12)), ordered(bad_expert_bucket(w, 13, target_too=True))
    refusals = (("draft", "draft", bad_draft), ("all", "draft", bad_draft), ("all", "mixed", bad_mixed))
    buckets = [b for _, seed, _ in plan for b in _whole(_nextn_tensors(w, seed))] + [b for _, _, b in refusals]
    steps, ptrs = {}, w.pointers()
    with running(buckets) as (port, trainer):
        init = w.manager.init_weights_update_group(
            InitWeightsUpdateGroupReqInput(
                master_address="127.0.0.1",
                master_port=port,
                rank_offset=1,
                world_size=2,
                group_name=GROUP,
                backend="gloo",
            )
        )
        if not init.success:
            return {"ok": False, "init": init.message}
        for selector, seed, intended in plan:
            outs = _session(w, _whole(_nextn_tensors(w, seed)), selector)
            res = {"returned": [[o.success, o.message[:200]] for o in outs], **w.state(*intended, ptrs)}
            res["ok"] &= _ok(outs)
            steps[f"distributed:{selector}"] = res
        for selector, what, bucket in refusals:
            outs, changed = changed_by(w, lambda: _session(w, [bucket], selector))  # noqa: B023 - called at once
            steps[f"refused:{selector}:{what}"] = {
                "returned": [outs[1].success, outs[1].message[:300]],
                "changed": changed[:8],
            }
        w.manager.destroy_weights_update_group(DestroyWeightsUpdateGroupReqInput(group_name=GROUP))
    refused = [s for n, s in steps.items() if n.startswith("refused:")]
    return {
        "ok": trainer.exitcode == 0
        and len(steps) == len(plan) + len(refusals)
        and all(s["ok"] for n, s in steps.items() if n.startswith("distributed:"))
        and all(not s["returned"][0] and not s["changed"] for s in refused),
        "steps": steps,
        "trainer_exit": trainer.exitcode,
    }
