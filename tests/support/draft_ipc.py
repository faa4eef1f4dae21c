"""`update_weights_from_ipc` (checkpoint-engine) with a speculative draft (issue #39): the draft_worker's target and
draft runners behind SGLang's `SchedulerWeightUpdaterManager`, checkpoint-engine's worker loop on this side of the
socket (tests/support/checkpoint_engine.py: its parameter server answers each runner's loop in turn).

What SGLang does (0.5.21-0.5.23 `update_weights_from_ipc`): every runner, no selector, target then draft, each
through its own WeightUpdater (SGLang's checkpoint-engine extension around that runner: the buckets to its model's
`load_weights`, then its post hook), stopping at the first that answers False. So a bucket whose draft expert is
malformed, beside the target's experts, would be in the target before the draft's load refused it; the plugin
checks each bucket against every runner before the first loads it (builtins/runner_requests.py
`selected_runners_around`, on the IPC entry point too).
"""

from __future__ import annotations

from . import checkpoint_engine as ce


def _ipc(w, buckets):
    server = ce.ParameterServer(buckets)
    with ce.installed(server):
        out = w.manager.update_weights_from_ipc(ce.request())
    return out, server


def check_ipc(w) -> dict:
    """A good run (seed 9: the tensors outside the experts in one bucket, the experts in four), both runners equal a
    fresh load of it; then one bucket with the target's experts and the draft's, the draft's expert 3 malformed
    last: (False, the draft layer named), neither runner changed, no post hook ran."""
    from sglang_trtllm_moe.sandbox import models

    from .draft_worker import _nextn_tensors, bad_expert_bucket, changed_by

    ptrs = w.pointers()
    named = _nextn_tensors(w, 9)
    rest, experts = [kv for kv in named if ".experts." not in kv[0]], [kv for kv in named if ".experts." in kv[0]]
    out, server = _ipc(w, [rest, *models.buckets(experts, 4)])
    good = {"returned": [out.success, out.message[:300]], "post_hook_ran": server.post_hook_ran, **w.state(9, 9, ptrs)}
    good["ok"] &= out.success and server.post_hook_ran
    servers = []

    def bad():
        o, s = _ipc(w, [bad_expert_bucket(w, 10, target_too=True)])
        servers.append(s)
        return o

    out, changed = changed_by(w, bad)
    refused = {
        "returned": [out.success, out.message[:300]],
        "changed": changed[:8],
        "post_hook_ran": servers[0].post_hook_ran,
        "ok": not out.success
        and "model.decoder.mlp.experts" in out.message
        and not changed
        and not servers[0].post_hook_ran,
    }
    return {"ok": good["ok"] and refused["ok"], "good": good, "refused": refused}
