"""Speculative-draft (NextN / MTP) MoE layers under the plugin (issue #39): a tiny DeepSeek-V3 whose last layer is its
NextN layer, SGLang's target ModelRunner and its draft ModelRunner (`is_draft_worker=True`,
`DeepseekV3ForCausalLMNextN`), updated through SGLang's own scheduler-side update manager with its runner
`selector` (tests/support/draft_worker.py says how each piece is stood up).

What holds, per format: the draft's FusedMoE layer is owned like the target's layers of the same format (the plugin
prepares FP8 per-tensor in place on both; DeepSeek FP8 block is SGLang's on both, watched by the plugin:
compat/defer.py); after a disk update (every runner) and tensor sessions with selector draft / all / target, each
runner's bytes equal a fresh load of the checkpoint meant for it (a runner the selector leaves out keeps its bytes),
storage kept, layers clean; a malformed draft expert tensor after good ones is refused whole with neither runner
changed (the request's names are the checkpoint's `model.layers.{N}.`, the draft's layer is `model.decoder`:
bucket_validation resolves them as SGLang's NextN loader does); SGLang's weight checker compares and hashes the
draft's layers too (its checksum under the `draft.` prefix).

`update_weights_from_distributed` (tests/support/draft_distributed.py, a gloo trainer process as rank 0): SGLang's
manager receives each broadcast once, on the target (the only runner in the update group), and loads that list into
every runner the selector names, so selector all / draft / target each leave every runner equal to a fresh load of
the checkpoint meant for it (the same code in 0.5.21-0.5.23; before 0.5.21 the draft was never updated on this path).
A bad draft expert tensor is refused whole with neither runner changed, under selector all too when the bucket also
carries the target's experts: SGLang loads the runners one after another, and the plugin checks the bucket against
every selected runner's layers before the first loads (runner_requests.py `selected_runners_around`); the tensor and
disk paths the same.

`update_weights_from_ipc` (checkpoint-engine, tests/support/draft_ipc.py): SGLang's manager runs it on every runner,
target then draft; a good run leaves both equal to a fresh load, and a bucket whose draft expert is malformed beside
the target's experts is refused with neither runner changed (without the check against every runner, the target
wrote its experts before the draft refused).

Before 0.5.21 (no selector; the distributed update leaves the draft stale, which the plugin says):
tests/test_draft_before_selector.py.

Not covered here: the Engine / HTTP speculative path (SGLang's EAGLE worker on CPU), and NVFP4 drafts (SGLang builds a
ModelOpt FP4 DeepSeek's NextN layer unquantized: deepseek_nextn.py sets its quant_config to None).
"""

from __future__ import annotations

import json

import pytest

from sglang_trtllm_moe.sandbox.releases import MODEL_RUNNER_RELEASES

from .support.helpers import last_json, run_module

pytestmark = pytest.mark.sglang(
    str(MODEL_RUNNER_RELEASES),
    reason="sandbox.models spells SGLang's runner set-up of these releases (sandbox/releases.py "
    "MODEL_RUNNER_RELEASES); the draft runner and the update manager's selector come with them",
)

#: (quant, who prepares both the target's and the draft's MoE layers)
FORMATS = (("fp8", "plugin"), ("fp8_block", "sglang"))
_REPORTS: dict = {}


def report(quant: str) -> dict:
    if quant not in _REPORTS:
        p = run_module("tests.support.draft_worker", quant, timeout=900)
        _REPORTS[quant] = last_json(p)  # once per format, whatever it holds
    rep = _REPORTS[quant]
    assert "_crash" not in rep, rep["_crash"]
    return rep


def _ok(rep: dict, name: str) -> dict:
    res = rep[name]
    assert res.get("ok"), json.dumps(res, default=str)[:4000]
    return res


@pytest.mark.parametrize("quant,owner", FORMATS, ids=[q for q, _ in FORMATS])
def test_draft_moe_layer_is_owned_like_the_targets(quant, owner):
    res = _ok(report(quant), "built")
    assert res["draft_class"] == "DeepseekV3ForCausalLMNextN"
    assert {r["owner"] for r in res["layers"].values()} == {owner}, res["layers"]
    assert {r["runner"] for r in res["layers"].values()} == {"flashinfer_trtllm"}, res["layers"]
    assert res["fresh"]["ok"], res["fresh"]


@pytest.mark.parametrize("quant,owner", FORMATS, ids=[q for q, _ in FORMATS])
def test_every_selector_leaves_each_runner_equal_to_a_fresh_load(quant, owner):
    steps = _ok(report(quant), "updates")["steps"]
    assert set(steps) == {"disk", "tensor:draft", "tensor:all", "tensor:target"}


@pytest.mark.parametrize("quant,owner", FORMATS, ids=[q for q, _ in FORMATS])
def test_a_bad_draft_expert_is_refused_whole(quant, owner):
    res = _ok(report(quant), "refused")
    assert (
        "refused the whole weight-update bucket" in res["returned"][1]
        and "model.decoder.mlp.experts" in (res["returned"][1])
    )


@pytest.mark.parametrize("quant,owner", FORMATS, ids=[q for q, _ in FORMATS])
def test_a_bad_draft_expert_beside_target_experts_changes_neither_runner(quant, owner):
    """Selector all, one bucket with the target's experts and the draft's, the draft's expert 3 malformed: without
    the check against every selected runner, SGLang's target load wrote its part before the draft refused."""
    res = _ok(report(quant), "refused")["mixed"]
    assert not res["returned"][0] and "model.decoder.mlp.experts" in res["returned"][1], res
    assert res["changed"] == [], res


@pytest.mark.parametrize("quant,owner", FORMATS, ids=[q for q, _ in FORMATS])
def test_a_checkpoint_with_a_bad_draft_expert_changes_neither_runner(quant, owner):
    """A disk update (every runner, target first) of a checkpoint whose draft expert 3 is malformed: refused before
    the target loads it (without the check against every runner, the target served the new checkpoint and only
    the draft was refused and put back)."""
    res = _ok(report(quant), "refused")["disk"]
    assert not res["returned"][0] and "model.decoder.mlp.experts" in res["returned"][1], res
    assert res["changed"] == [], res


@pytest.mark.parametrize("quant,owner", FORMATS, ids=[q for q, _ in FORMATS])
def test_distributed_updates_reach_the_runners_the_selector_names(quant, owner):
    """update_weights_from_distributed over gloo, through SGLang's manager: sessions with selector all / draft /
    target, each runner == a fresh load of its checkpoint, the one left out keeps its bytes."""
    res = report(quant)["distributed"]
    assert "error" not in res and res["trainer_exit"] == 0, json.dumps(res, default=str)[:4000]
    for selector in ("all", "draft", "target"):
        assert res["steps"][f"distributed:{selector}"]["ok"], res["steps"]


@pytest.mark.parametrize("quant,owner", FORMATS, ids=[q for q, _ in FORMATS])
def test_a_bad_draft_tensor_in_a_distributed_bucket_changes_neither_runner(quant, owner):
    """One broadcast bucket with a malformed draft expert tensor: under selector draft, under all with the draft's
    experts only, and under all with the target's experts too: (False, the draft layer named), no byte of either
    runner changed."""
    steps = report(quant)["distributed"]["steps"]
    refused = {n: s for n, s in steps.items() if n.startswith("refused:")}
    assert set(refused) == {"refused:draft:draft", "refused:all:draft", "refused:all:mixed"}, steps
    for name, res in refused.items():
        assert not res["returned"][0] and "refused the whole weight-update bucket" in res["returned"][1], (name, res)
        assert "model.decoder.mlp.experts" in res["returned"][1], (name, res)
        assert res["changed"] == [], (name, res)


@pytest.mark.parametrize("quant,owner", FORMATS, ids=[q for q, _ in FORMATS])
def test_weight_checker_covers_the_draft(quant, owner):
    """SGLang's weight checker over both runners (selector all): compare passes after a replay, a flipped byte of the
    draft's expert weight is caught, and the checksum lists the draft's expert tensors under `draft.`."""
    res = _ok(report(quant), "checker")
    assert any(k.endswith(".experts.w13_weight") for k in res["draft_expert_checksums"]), res


@pytest.mark.parametrize("quant,owner", FORMATS, ids=[q for q, _ in FORMATS])
def test_a_write_refused_mid_load_is_answered_not_raised(quant, owner):
    """The fallback: a name the request's check cannot place (NextN names switched off in the worker), a bad tensor
    after good ones refused by the loader hook while SGLang loads: (False, message saying tensors ahead of it may be
    written), not an exception out of update_weights_from_tensor (SGLang does not catch it there: the scheduler would
    exit); every managed layer laid out, and a good update after it equals a fresh load."""
    res = _ok(report(quant), "unresolved")
    assert not res["returned"][0] and "may be written" in res["returned"][1], res


@pytest.mark.parametrize("quant,owner", FORMATS, ids=[q for q, _ in FORMATS])
def test_ipc_updates_reach_both_runners_and_a_bad_draft_bucket_changes_neither(quant, owner):
    """checkpoint-engine's flow through SGLang's manager (every runner, target first): a good run equals a fresh load
    on both; a bucket with the target's experts and a malformed draft expert: (False, the draft layer named), no byte
    of either runner changed, no post hook."""
    res = _ok(report(quant), "ipc")
    assert res["good"]["post_hook_ran"] and res["refused"]["changed"] == [], res
    assert "model.decoder.mlp.experts" in res["refused"]["returned"][1], res
