"""One verdict for all ranks (issue #52), with 4 gloo ranks (the 2-rank world: tests/test_multirank.py): each rank
checks only the expert tensors it holds, so a bad tensor of an expert some ranks do not hold is seen by those that
do — and still every rank answers the same (False, message) before any rank writes a byte.

Four CPU processes, each a rank as SGLang's scheduler sets one up (gloo world, published ServerArgs, SGLang's own
model-parallel groups: sglang_runtime.init_rank), each with a prepared NVFP4 FusedMoE of 8 experts and SGLang's own
WeightUpdater around it (tests/support/verdict_worker.py), take the same requests through every update path — tensor
list, flattened bucket, disk, distributed (a trainer process broadcasting over gloo), IPC (checkpoint-engine's loop)
— at TP 4 / EP 2 (experts 4-7 on ranks 2 and 3, each a TP half): a request with a NaN block-scale byte of expert 5
is refused on every rank with the same message naming it, and no byte changes on any rank; the good request after it
leaves every rank's bytes those of a layer freshly loaded through SGLang's own loader. Then a check that raises on
one rank, and one rank that answers after the others' time-out: every rank refuses, nothing is written, and the next
request goes through on every rank.
"""

from __future__ import annotations

import pytest

from .support import ranks, releases
from .support import verdict_worker as V
from .support.gloo_trainer import running

pytestmark = pytest.mark.skipif(
    not releases.SPAWN_RANKS.present(),
    reason=f"a world of SGLang ranks on a CPU needs per-rank placement (SpawnRanks, {releases.SPAWN_RANKS.releases})",
)

WORLD = 4
#: TP 4 / EP 2: ranks 2 and 3 hold expert 5 (a TP half each); ranks 0 and 1 never check it
SCENARIOS = [V.scenario("tp4-ep2", 4, 2, bad_expert=5, failures=True)]


@pytest.fixture(scope="module")
def world4(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("verdicts")
    buckets = V.prepare(SCENARIOS, tmp)
    with running(buckets, V.GROUP, world_size=WORLD + 1) as (port, trainer):
        for sc in SCENARIOS:
            sc["verdict"]["port"] = port
        procs = ranks.launch("tests.support.multirank_worker", WORLD, {"scenarios": SCENARIOS}, tmp)
        results = ranks.collect(procs, tmp, timeout=600)
    assert trainer.exitcode == 0
    return results


def _ok(results, name):
    for r, res in enumerate(results):
        assert "error" not in res[name], f"rank {r}: {res[name]['error']}\n{res[name].get('traceback', '')}"
    return [res[name] for res in results]


@pytest.mark.parametrize("sc", SCENARIOS, ids=[sc["name"] for sc in SCENARIOS])
def test_a_bad_tensor_of_some_ranks_expert_is_refused_alike_on_every_rank_and_every_path(world4, sc):
    per_rank = _ok(world4, sc["name"])
    bad = sc["verdict"]["bad_expert"]
    holders = [r for r, res in enumerate(per_rank) if res["ep_rank"] == bad // res["local_experts"]]
    assert 0 < len(holders) < WORLD, holders  # only some ranks hold (and check) the bad tensor
    V.assert_agreed(per_rank, sc)


def test_a_rank_that_raises_or_answers_late_makes_every_rank_refuse(world4):
    per_rank = _ok(world4, "tp4-ep2")
    for case, says in (("raises", "rank 1 could not check it"), ("late", "not every rank answered its check")):
        answers = [r[(case, "refused")] for r in per_rank]
        assert not any(a["ok"] for a in answers) and all(says in a["msg"] for a in answers), answers
        assert len({a["msg"] for a in answers}) == 1, [a["msg"] for a in answers]
        assert [a["changed"] for a in answers] == [[]] * WORLD
        after = [r[(case, "after")] for r in per_rank]
        assert all(a["ok"] for a in after), [a["msg"] for a in after]
