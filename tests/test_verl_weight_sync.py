"""verl's weight sync with SGLang's own client helpers (issue #28), on `sglang.Engine(device="cpu", tp_size=2)`
through the plugin's path (the CPU sandbox's two switches): trainer rank 0 holds the Engine, trainer rank 1 is a
process of its own, the two form verl's "infer_tp" device mesh over gloo (tests/support/verl_worker.py).

- `weight_sync.utils.update_weights` (a `LocalSerializedTensor` per name, one serialized tensor per SGLang TP rank)
  and flattened buckets (one `FlattenedTensorBucket` per TP rank, `load_format="flattened_bucket"`), inside
  begin / end weight-update sessions;
- a whole new checkpoint each way: the served weights (SGLang's weight-checker checksums, both TP ranks) and greedy
  tokens are the ones SGLang's own disk loader gives the same engine for that checkpoint;
- back on the start-up checkpoint: the weight checker's raw compare against the snapshot of the fresh load passes
  (the served bytes == the fresh load's, bit for bit, on both ranks);
- a bucket with one bad tensor, each way: answered (False, "refused ..."), the served weights unchanged.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from sglang_trtllm_moe.sandbox.releases import RL_LOOP_RELEASES

from .support.helpers import REPO
from .support.http_server import free_port

pytestmark = pytest.mark.sglang(
    str(RL_LOOP_RELEASES),
    reason="sglang.Engine with begin/end weight-update sessions and the weight-checker request (the sandbox's "
    "Engine flow: sandbox/releases.py RL_LOOP_RELEASES)",
)

PROMPTS = [[5, 17, 42, 99], [100, 200, 300, 400], [3, 9, 27, 81, 243, 480, 11, 13, 15]]
REFUSED = "refused the whole weight-update bucket"


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    pytest.importorskip("xgrammar", reason="sglang.Engine's detokenizer imports xgrammar (ci/releases.tsv pin)")
    if (os.cpu_count() or 1) < 2:
        pytest.skip("needs 2 CPU cores: SGLang's CPU tensor parallelism binds one core per rank")
    from sglang_trtllm_moe.sandbox import checkpoints as ck

    work = tmp_path_factory.mktemp("verl")
    spec = ck.TinySpec(arch="qwen3_moe", quant="nvfp4")
    dirs = {k: ck.write(str(work / k), spec.with_seed(s)) for k, s in (("A", 0), ("B", 1), ("C", 2))}
    job = work / "job.json"
    job.write_text(json.dumps({"port": free_port(), "dirs": dirs, "prompts": PROMPTS}))
    env = {k: v for k, v in os.environ.items() if not k.startswith("SGLANG_TRTLLM_MOE_")}
    env.update(
        SGLANG_TRTLLM_MOE_EMULATE="1",
        SGLANG_TRTLLM_MOE_TEST_FAKE_SM="100",
        SGLANG_CPU_OMP_THREADS_BIND="0|1",  # SGLang's CPU TP: one core per rank
        OMP_NUM_THREADS="1",
        PYTHONPATH=os.pathsep.join([str(REPO)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])),
    )
    log = work / "worker.log"
    with open(log, "w") as f:
        proc = subprocess.run(
            [sys.executable, "-m", "tests.support.verl_worker", str(job), str(work / "out.json")],
            cwd=str(REPO),
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=f,
            stderr=subprocess.STDOUT,
            timeout=1200,
            check=False,
        )
    text = log.read_text(errors="replace")
    assert proc.returncode == 0 and (work / "out.json").exists(), text[-6000:]
    out = json.loads((work / "out.json").read_text())
    assert out["peer_exitcode"] == 0, text[-4000:]
    out["_log"] = text
    return out


@pytest.mark.parametrize("label", ["C", "B"], ids=["update_weights", "flattened_bucket"])
def test_a_whole_checkpoint_each_way_serves_what_sglang_loads_from_disk(run, label):
    r = run["rounds"][label]
    assert [a["success"] for a in r["answers"]] == [True] * len(r["answers"]), r["answers"]
    assert r["disk"]["success"], r["disk"]
    assert len(r["checksums"]) == 2  # both TP ranks
    assert r["checksums"] == r["disk"]["checksums"]
    assert r["tokens"] == r["disk"]["tokens"]


def test_back_on_the_first_checkpoint_the_served_bytes_are_the_fresh_loads(run):
    r = run["rounds"]["A"]
    assert run["snapshot"]["success"], run["snapshot"]
    assert all(a["success"] for a in r["answers"]), r["answers"]
    assert r["compare"]["success"], r["compare"]["message"][-3000:]
    assert r["tokens"] == run["fresh A"]["tokens"]


@pytest.mark.parametrize("label", ["refused", "refused flat"], ids=["update_weights", "flattened_bucket"])
def test_a_bucket_with_one_bad_tensor_is_refused_and_changes_nothing(run, label):
    r = run["rounds"][label]
    (answer,) = r["answers"]
    assert not answer["success"] and answer["message"].startswith(REFUSED), answer
    assert r["checksums"] == run["rounds"]["A"]["checksums"]
    assert r["tokens"] == run["fresh A"]["tokens"]
