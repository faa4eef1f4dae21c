"""SGLang's HTTP server as slime drives it (issue #28): the README's CPU recipe — a plain `python -m
sglang.launch_server --device cpu ...` with the two test-only switches, nothing of the harness on PYTHONPATH — then
slime's flows end to end against that one server on 127.0.0.1. What each flow proves, and how:

- the recipe: its commands run as written (paths and port replaced): tiny checkpoints, the server, its curl lines;
  the log shows the plugin's decision line and every MoE layer "prepared in place";
- generate: greedy tokens == a fresh load's (SGLang's ModelRunner in another process: support/http_reference.py);
- disk update A -> B -> A: on B, the weight checker's per-tensor checksums == a fresh load of B's; back on A, tokens
  restored exactly, and `/weights_checker` compare against the snapshot taken of the fresh load at start-up passes
  (raw: the served bytes == the fresh load's, bit for bit);
- a partial checkpoint (two experts of one layer): checksums == a fresh load of A with those experts;
- a refused checkpoint / bucket: HTTP 400 with the refusal in the body; checksums unchanged; the same tokens;
- tensors as slime sends them: `/update_weights_from_tensor` inside `/begin_weight_update` ... `/end_weight_update`
  sessions, a plain bucket then a `flattened_bucket` (MultiprocessingSerializer, one base64 string per rank), then
  `direct` (whole parameters): checksums == fresh loads;
- the weight checker: snapshot / reset_tensors / replay from disk / compare passes; after a corrupted replay the
  compare fails with HTTP 400 naming the checkpoint tensor, expert, row and column;
- pause / continue: `retract` around an update: every request answered, the tokens of each weight version
  (meta_info.weight_versions) that version's greedy continuation; `abort`: answered as aborted, a prefix of the old
  weights' output; `in_place`: SGLang answers a successful update with HTTP 400 "Weights were updated, but the
  cache was not flushed" (not a refusal: clients key on the message);
- requests in flight around a disk update: all answered, each from one weight version, its tokens that version's;
- the README's RL recipe under load: `/pause_generation` (retract) around a tensor session of two buckets while
  requests run: every span of every answer is A's or B's greedy continuation; a `/generate` between the buckets of
  an unpaused session answers neither (why the recipe pauses).

Every request has a timeout; the server runs in its own process group and is stopped by its PID at the end, with
the torch_shm_manager helpers of the tensor clients; nothing is left running.
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import subprocess
import time
from pathlib import Path

import pytest

from sglang_trtllm_moe.sandbox.releases import RL_LOOP_RELEASES

from .support import http_server as hs

pytestmark = pytest.mark.sglang(
    str(RL_LOOP_RELEASES),
    reason="the README's CPU server recipe: SGLang's HTTP server with begin/end weight-update sessions, "
    "weight versions per token span and the weight-checker endpoint (sandbox/releases.py RL_LOOP_RELEASES)",
)

ARCH, QUANT = "qwen3_moe", "nvfp4"
PROMPTS = [[5, 17, 42, 99], [5, 17, 42, 99, 260, 311, 7], [100, 200, 300, 400], [3, 9, 27, 81, 243, 480, 11, 13, 15]]
NEW_TOKENS = 4
#: decode steps of the requests kept in flight around an update (long enough that the update lands mid-way)
LONG = 64
REFUSED_BUCKET = "refused the whole weight-update bucket"
REFUSED_CHECKPOINT = "refused the whole checkpoint"


def _spec(seed=0):
    from sglang_trtllm_moe.sandbox import checkpoints as ck

    return ck.TinySpec(arch=ARCH, quant=QUANT, seed=seed)


class Run(hs.RecipeRun):
    """The one server of this module and what the tests need around it (tests/support/http_server.py RecipeRun)."""

    def __init__(self, work: Path):
        super().__init__(work, ARCH, QUANT, PROMPTS, NEW_TOKENS)
        #: the trainer process's answers, by label (run once: tests/support/http_client.py)
        self.trainer: dict = {}

    # ---- requests -------------------------------------------------------------------------------------------
    # generate(prompts, n): one batched request (SGLang 0.5.23 hands a batch of input_ids to the scheduler as one
    # message: one prefill batch, then decode steps of the same requests). `n`: new tokens, one number or one per prompt

    def flush(self) -> None:
        r = self.srv.post("/flush_cache", {}, timeout=60)
        assert r.ok, r

    def reference(self, prompts, n) -> list[list[int]]:
        """The served weights' greedy tokens for `prompts` in the batch shape the requests under test ran in: one
        batch, nothing of the radix cache (flushed first; the requests under test are sent after a flush too), so
        the reference runs the same prefill and decode batches at the same positions (like with like, docs/TESTING.md
        "Exact comparisons")."""
        self.flush()
        return self.generate(prompts, n)

    def check(self, action: str) -> hs.HTTPResult:
        return self.srv.post("/weights_checker", {"action": action}, timeout=300)

    def disk(self, key: str, version: str | None = None, timeout=300) -> hs.HTTPResult:
        return super().disk(key, version or key, timeout=timeout)  # the weight version: the checkpoint's key

    def at(self, key: str) -> None:
        """The server on checkpoint `key` (a disk update unless it already is)."""
        if self.state != key:
            r = self.disk(key)
            assert r.ok and r.body["success"], r


def _write_checkpoints(work: Path, dirs: dict[str, str]) -> None:
    """Beside the recipe's A (seed 0) and B (seed 1): a partial checkpoint and the full one it makes, C and D for
    the tensor updates, and three bad ones."""
    import torch

    from sglang_trtllm_moe.sandbox import checkpoints as ck

    spec = _spec()
    layer = spec.moe_layers[-1]
    part = ck.checkpoint(spec.with_seed(1), layers=[layer], experts=[2, 5], dense=False)
    dirs["partial"] = ck.write_tensors(str(work / "partial"), spec, part)
    dirs["A+partial"] = ck.write_tensors(str(work / "a-plus-partial"), spec, {**ck.checkpoint(spec), **part})
    dirs["C"] = ck.write(str(work / "c"), spec.with_seed(2))
    dirs["D"] = ck.write(str(work / "d"), spec.with_seed(3))
    a = ck.checkpoint(spec)
    bad = dict(a)
    name = f"model.layers.{spec.moe_layers[0]}.mlp.experts.3.down_proj.weight"
    bad[name] = bad[name].float()  # float32 for packed FP4 bytes
    dirs["bad"] = ck.write_tensors(str(work / "bad"), spec, bad)
    nan = dict(a)  # issue #27: one NaN byte (e4m3 0x7F) in the last block scale of an expert, in the second shard
    name = f"model.layers.{spec.moe_layers[-1]}.mlp.experts.6.gate_proj.weight_scale"
    t = nan[name].clone()
    t.view(torch.uint8)[-1, -1] = 0x7F
    nan[name] = t
    dirs["nan-scale"] = ck.write_tensors(str(work / "nan-scale"), spec, nan, shards=2)
    corrupt = dict(a)
    name = f"model.layers.{spec.moe_layers[0]}.mlp.experts.5.up_proj.weight"
    t = corrupt[name].clone()
    t[10, 20] ^= 0x01  # one bit of the low FP4 value of byte [10, 20]: value column 40
    corrupt[name] = t
    dirs["corrupt"] = ck.write_tensors(str(work / "corrupt"), spec, corrupt)


def _reference_job(work: Path, dirs: dict[str, str]) -> dict:
    return {
        "first": dirs["A"],
        "targets": {k: dirs[k] for k in ("A", "B", "A+partial", "C", "D")},
        "prompts": PROMPTS,
        "new_tokens": NEW_TOKENS,
        "routed_experts": ["A", "B"],
        "alone": ["A"],
        "direct": {"dir": dirs["D"], "out": str(work / "direct-D.safetensors")},
    }


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    pytest.importorskip(
        "xgrammar", reason="SGLang's detokenizer imports xgrammar (ci/releases.tsv installs the pin of 0.5.23)"
    )
    pytest.importorskip("jsonschema", reason="SGLang's HTTP server imports jsonschema (ci/make-env base recipe)")
    work = tmp_path_factory.mktemp("http-server")
    r = Run(work)
    r.dirs = {"A": str(work / "tiny-moe"), "B": str(work / "tiny-moe-step1")}

    def before_server() -> dict:
        _write_checkpoints(work, r.dirs)
        return _reference_job(work, r.dirs)

    def when_ready() -> None:
        assert r.check("snapshot").ok  # a copy of the fresh load's bytes inside the server (compared after A -> B -> A)

    yield from hs.serve_recipe(r, hs.HTTP_MARK, str(work / "tiny-moe"), before_server, when_ready)


# ---- the recipe ----------------------------------------------------------------------------------------------------


def test_the_readme_recipe_serves_through_the_plugin(run):
    gen, update = run.recipe_out
    assert gen["output_ids"] == run.ref["A"]["alone"], gen  # the recipe's prompt, alone: the reference's batch of one
    assert update["success"], update
    log = run.srv.log_tail(10**7)
    assert "moe_runner_backend=flashinfer_trtllm" in log  # the plugin's decision line (the launcher)
    assert log.count("nvfp4 prepared in place for flashinfer_trtllm") == 2  # the scheduler: both MoE layers
    assert "stood down" not in log and "sandbox was not activated" not in log
    # `explain --sm 100` in the server's environment names the same environment fingerprint as its decision line
    proc = subprocess.run(
        ["sglang-trtllm-moe", "explain", "--model", run.dirs["A"], "--sm", "100", "--json", "--no-sglang"],
        env=run.env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    fingerprint = json.loads(proc.stdout)["fingerprint"]["id"]
    assert f"| fingerprint {fingerprint}" in log, (fingerprint, [x for x in log.splitlines() if "fingerprint" in x])


# ---- disk ----------------------------------------------------------------------------------------------------------


def routed_experts(body) -> list:
    """`meta_info["routed_experts"]` of one answer, decoded as SGLang's own helper does, as [tokens][layers][k]."""
    from sglang.srt.state_capturer.routed_experts import extract_routed_experts_from_meta_info

    flat = extract_routed_experts_from_meta_info(body).tolist()
    return flat


def test_routed_experts_are_the_ones_the_fused_kernel_routed(run):
    """R3 on the README's recipe (`--enable-return-routed-experts`, the auto-selected fused flashinfer_trtllm
    runner): for every prompt token and generated token of a batch, every layer, the experts the server returns are
    the ones a fresh load of the same checkpoint reports for the same batch (the reference), and those are SGLang's
    own top-k on the router logits each layer saw there, per token as sets (ties at the cut either way, counted).
    The recipe's update left B served."""
    ref = run.ref["B"]["r3"]
    for check in ref["checks"]:
        assert check["n_mismatches"] == 0 and check["rows"] > 0, check
    body = dict(hs.gen_body(PROMPTS, NEW_TOKENS), return_routed_experts=True)
    r = run.srv.post("/generate", body, timeout=300)
    assert r.ok, r
    assert [list(o["output_ids"]) for o in r.body] == ref["tokens"]
    for i, (answer, prompt) in enumerate(zip(r.body, PROMPTS, strict=True)):
        flat = routed_experts(answer)
        expected = ref["routed"][i]
        assert len(expected) == len(prompt) + NEW_TOKENS - 1
        layers, k = len(expected[0]), len(expected[0][0])
        assert len(flat) == len(expected) * layers * k, (len(flat), len(expected), layers, k)
        per_token = [flat[t * layers * k : (t + 1) * layers * k] for t in range(len(expected))]
        got = [[row[lay * k : (lay + 1) * k] for lay in range(layers)] for row in per_token]
        assert got == expected, (i, got, expected)
        assert any(e != 0 for token in got for layer in token for e in layer), "all zeros"


def test_disk_update_to_b_and_back_restores_the_fresh_load_exactly(run):
    run.assert_serves("B")  # the recipe's update: B as a fresh load of B
    r = run.disk("A")
    assert r.ok and r.body["success"], r
    run.assert_serves("A")
    assert run.generate(PROMPTS[:1])[0] == run.recipe_out[0]["output_ids"]  # tokens restored exactly (a batch of one)
    r = run.check("compare")  # vs the snapshot of the fresh load taken at start-up: raw, bit for bit
    assert r.ok and r.body["success"], r


def test_partial_checkpoint(run):
    run.at("A")
    r = run.disk("partial")
    assert r.ok and r.body["success"], r
    run.assert_serves("A+partial")
    assert run.disk("A").ok
    run.assert_serves("A")


def test_a_refused_checkpoint_changes_nothing_and_the_server_keeps_serving(run):
    run.at("A")
    before = run.checksums()
    r = run.disk("bad")
    assert r.status == 400 and not r.body["success"], r
    assert r.body["message"].startswith(REFUSED_CHECKPOINT) and "expert 3" in r.body["message"], r
    assert run.checksums() == before
    assert run.generate() == run.ref["A"]["tokens"]


def test_a_writers_hint_reaches_the_scheduler_in_the_begin_requests_rid(run):
    """Issue #53 through the HTTP door: a loader-free writer says which experts its session writes in the `rid` of
    `/begin_weight_update` (sglang_trtllm_moe.session_writes_rid). A malformed hint is refused before the session
    opens (HTTP 400 naming it); a hinted session in which nothing is written returns exactly the named experts to
    checkpoint layout and lays them out again at `/end_weight_update`: checksums and tokens unchanged."""
    import sglang_trtllm_moe
    from sglang_trtllm_moe.updates import session_writes

    run.at("A")
    before = run.checksums()
    r = run.srv.post("/begin_weight_update", {"rid": session_writes.RID_PREFIX + "{not json"})
    assert r.status == 400 and "not JSON" in r.body["message"], r
    r = run.srv.post("/begin_weight_update", {"rid": sglang_trtllm_moe.session_writes_rid({"*": [0, 3]})})
    assert r.ok, r
    r = run.srv.post("/end_weight_update", {})
    assert r.ok, r
    assert run.checksums() == before
    assert run.generate() == run.ref["A"]["tokens"]


def test_a_nan_block_scale_is_refused_and_the_server_keeps_serving(run):
    """Issue #27 through slime's door: one NaN e4m3 byte in an NVFP4 block scale (2048 of them in that tensor; the
    old pre-check read none) — before, answered 200 and then every prompt came back as token 0; now HTTP 400 with
    the tensor and its index named, checksums unchanged, the same tokens."""
    run.at("A")
    before = run.checksums()
    r = run.disk("nan-scale")
    assert r.status == 400 and not r.body["success"], r
    msg = r.body["message"]
    assert msg.startswith(REFUSED_CHECKPOINT) and "w13_weight_scale" in msg and "NaN in e4m3" in msg, r
    assert "expert 6" in msg, r
    assert run.checksums() == before
    assert run.generate() == run.ref["A"]["tokens"]


# ---- tensors, as slime sends them ----------------------------------------------------------------------------------


def _trainer_steps(run) -> list[dict]:
    """One trainer process (what slime / verl run): C (seed 2) whole as a plain bucket then a flattened one, in a
    session; buckets with one bad tensor, plain and flattened, refused whole; D (seed 3) as whole parameters
    (`direct`, SGLang's names in checkpoint layout: the reference's fresh load of D) in two calls; then the
    NCCL-style path: the update group, B (seed 1) in two broadcast buckets in a session, and a refused bucket.
    After each session the trainer asks the checksums and greedy tokens, which must be a fresh load's."""
    spec = _spec()
    bad = f"{spec.moe_layers[0]}.mlp.experts.3.down_proj.weight"  # float32 for packed FP4 bytes
    direct = str(run.work / "direct-D.safetensors")
    begin, end = {"path": "/begin_weight_update"}, {"path": "/end_weight_update"}
    t, dist = "/update_weights_from_tensor", "/update_weights_from_distributed"
    port = hs.free_port()

    def served(label):
        return [
            {"label": f"{label}: checksum", "path": "/weights_checker", "body": {"action": "checksum"}},
            {"label": f"{label}: generate", "path": "/generate", "body": hs.gen_body(PROMPTS, NEW_TOKENS)},
        ]

    return [
        begin,
        {"label": "C plain", "path": t, "tensors": {"seed": 2, "bucket": [0, 2]}, "body": {"weight_version": "C"}},
        {"label": "C flat", "path": t, "tensors": {"seed": 2, "bucket": [1, 2], "load_format": "flattened_bucket"}},
        end,
        *served("C"),
        begin,
        {"label": "bad plain", "path": t, "tensors": {"seed": 1, "bucket": [0, 1], "bad": bad}},
        {
            "label": "bad flat",
            "path": t,
            "tensors": {"seed": 1, "bucket": [0, 1], "bad": bad, "load_format": "flattened_bucket"},
        },
        end,
        *served("C after the refusals"),
        begin,
        {"label": "D direct 1", "path": t, "tensors": {"file": direct, "bucket": [0, 2], "load_format": "direct"}},
        {"label": "D direct 2", "path": t, "tensors": {"file": direct, "bucket": [1, 2], "load_format": "direct"}},
        end,
        *served("D"),
        # NCCL-style (gloo on a CPU)
        {"label": "init group", "path": "/init_weights_update_group", "init_group": {"port": port, "group": "rl"}},
        begin,
        {"label": "B dist 1", "path": dist, "distributed": {"seed": 1, "bucket": [0, 2], "group": "rl"}},
        {"label": "B dist 2", "path": dist, "distributed": {"seed": 1, "bucket": [1, 2], "group": "rl"}},
        end,
        *served("B"),
        begin,
        {"label": "bad dist", "path": dist, "distributed": {"seed": 4, "bucket": [0, 1], "bad": bad, "group": "rl"}},
        end,
        *served("B after the refusal"),
        {"label": "destroy group", "path": "/destroy_weights_update_group", "body": {"group_name": "rl"}},
    ]


def _trainer(run) -> dict:
    if not run.trainer:
        res = run.client(_trainer_steps(run), "trainer")
        run.trainer = {x["label"] or f"{i}:{x['path']}": x for i, x in enumerate(res)}
        run.state = "B"
    return run.trainer


def _check_served(run, res, label, key):
    (rank,) = res[f"{label}: checksum"]["body"]["ranks"]
    theirs = run.ref[key]["checksums"]
    assert rank["checksums"] == theirs, (label, [n for n in theirs if rank["checksums"].get(n) != theirs[n]][:8])
    tokens = [o["output_ids"] for o in res[f"{label}: generate"]["body"]]
    assert tokens == run.ref[key]["tokens"], label


def _answers(res, labels):
    for label in labels:
        x = res[label]
        if label.startswith("bad"):
            assert x["status"] == 400 and x["body"]["message"].startswith(REFUSED_BUCKET), (label, x)
            assert "expert 3" in x["body"]["message"], x
        else:
            assert x["status"] == 200, (label, x)


def test_tensor_updates_plain_flattened_and_direct_in_sessions_and_refused_buckets(run):
    run.at("A")
    res = _trainer(run)
    _answers(res, ["C plain", "C flat", "bad plain", "bad flat", "D direct 1", "D direct 2"])
    for label, key in (("C", "C"), ("C after the refusals", "C"), ("D", "D")):
        _check_served(run, res, label, key)  # nothing of the refused buckets was written


def test_nccl_style_update_group_over_gloo_and_a_refused_broadcast_bucket(run):
    res = _trainer(run)
    _answers(res, ["init group", "B dist 1", "B dist 2", "bad dist", "destroy group"])
    for label, key in (("B", "B"), ("B after the refusal", "B")):
        _check_served(run, res, label, key)
    run.at("A")
    run.assert_serves("A")


# ---- the weight checker (slime's --check-weight-update-equal) -----------------------------------------------------


def test_weight_checker_passes_a_correct_replay_and_names_a_corrupted_one(run):
    run.at("A")
    spec = _spec()
    for action in ("snapshot", "reset_tensors"):
        assert run.check(action).ok
    assert run.disk("A").ok
    r = run.check("compare")
    assert r.ok and r.body["success"], r

    for action in ("snapshot", "reset_tensors"):
        assert run.check(action).ok
    assert run.disk("corrupt").ok
    r = run.check("compare")
    assert r.status == 400 and not r.body["success"], r
    msg = r.body["message"]
    layer = spec.moe_layers[0]
    # checkpoint coordinates: the tensor's own name, expert, row and byte column, and the FP4 value column
    assert f"model.layers.{layer}.mlp.experts.5.up_proj.weight[10, 20] (packed: value 40)" in msg, msg[-3000:]
    assert run.disk("A").ok
    run.assert_serves("A")


# ---- pause / continue and requests in flight ----------------------------------------------------------------------


def _running(run) -> int:
    r = run.srv.get("/v1/loads?include=core", timeout=30)
    return int(r.body["loads"][0]["num_running_reqs"]) if r.ok else 0


def _in_flight(run, prompts, action, n=LONG):
    """The prompts as one batched request (after a cache flush: the batch shape `Run.reference` gives its
    references); once all of them run, `action()`; every answer (one HTTPResult per prompt).

    One request, not one per prompt: SGLang hands a batch to the scheduler as one message, so the prompts are
    prefilled together and decode in lockstep whatever the machine's load; requests sent apart reach the scheduler
    at moments that depend on the load, and so would the batches they run in (docs/TESTING.md "Exact comparisons")."""
    run.flush()
    with cf.ThreadPoolExecutor(1) as ex:
        future = ex.submit(run.srv.post, "/generate", hs.gen_body(prompts, n), 600)
        t0 = time.monotonic()
        while _running(run) < len(prompts) and time.monotonic() - t0 < 120 and not future.done():
            time.sleep(0.05)
        assert _running(run) == len(prompts), ("the requests did not all run", future.done() and future.result())
        out = action()
        r = future.result()
    assert r.ok and len(r.body) == len(prompts), r
    return out, [hs.HTTPResult(r.status, body) for body in r.body]


def _spans(body) -> list[tuple[str, int, int]]:
    return [(s["version"], s["start"], s["end"]) for s in body["meta_info"]["weight_versions"]]


def _a_then_b(run, prompts, answers, a_long, b_label: str) -> int:
    """Every request answered in full, each span of its tokens A's (the A reference's prefix) or, from its `b_label`
    span on, B's greedy continuation of what it had before: the paused requests are recomputed together on B (one
    prefill of prompt + output so far, then decode), so the reference is that batch. Returns how many requests
    spanned both versions."""
    outs = [a.body["output_ids"] for a in answers]
    spans = [_spans(a.body) for a in answers]
    for a, sp in zip(answers, spans, strict=True):
        assert a.ok and len(a.body["output_ids"]) == LONG, a
        assert sp[-1][0] == b_label and sp[-1][2] == LONG, sp
    starts = [next(s for v, s, _ in sp if v == b_label) for sp in spans]
    b_cont = run.reference(
        [q + o[:s] for q, o, s in zip(prompts, outs, starts, strict=True)], [LONG - s for s in starts]
    )
    mixed = 0
    for i, (sp, out) in enumerate(zip(spans, outs, strict=True)):
        for version, s, e in sp:
            want = b_cont[i][: e - s] if version == b_label else a_long[i][s:e]
            assert out[s:e] == want, (i, sp, version, "B continuation" if version == b_label else "A prefix")
        mixed += len(sp) > 1
    return mixed


def test_pause_retract_abort_and_in_place_around_an_update(run):
    run.at("A")
    prompts = PROMPTS[:4]
    a_long = run.reference(prompts, LONG)  # the old weights' greedy continuation of each prompt, the same batch

    def paused(mode, key):
        def act():
            p = run.srv.post("/pause_generation", {"mode": mode})
            u = run.disk(key, version=f"{key}-{mode}")
            c = run.srv.post("/continue_generation", {})
            return p, u, c

        return act

    # retract: running requests go back to the queue; after continue they are recomputed on the new weights
    (p, u, c), answers = _in_flight(run, prompts, paused("retract", "B"))
    assert p.ok and u.ok and u.body["success"] and c.ok, (p, u, c)
    assert _a_then_b(run, prompts, answers, a_long, "B-retract"), "no request spanned the update"

    # abort: running requests are answered as aborted, with what the old weights had generated
    b_long = run.reference(prompts, LONG)
    (p, u, c), answers = _in_flight(run, prompts, paused("abort", "A"))
    assert p.ok and u.ok and u.body["success"] and c.ok, (p, u, c)
    for want_b, a in zip(b_long, answers, strict=True):
        assert a.ok and a.body["meta_info"]["finish_reason"]["type"] == "abort", a
        out = a.body["output_ids"]
        assert len(out) < LONG and out == want_b[: len(out)] and {v for v, _, _ in _spans(a.body)} == {"B-retract"}
    run.assert_serves("A")

    # in_place: the requests keep their old KV cache; SGLang updates the weights but cannot flush the cache and
    # answers HTTP 400 — not a refusal (the README: key on the refusal message, not on the status alone)
    (p, u, c), answers = _in_flight(run, prompts, paused("in_place", "B"))
    assert p.ok and c.ok, (p, c)
    assert u.status == 400 and not u.body["success"], u
    assert "Weights were updated, but the cache was not flushed" in u.body["message"], u
    assert not u.body["message"].startswith(("refused", REFUSED_BUCKET, REFUSED_CHECKPOINT))
    for want_a, a in zip(a_long, answers, strict=True):
        assert a.ok and len(a.body["output_ids"]) == LONG, a
        (v0, s0, e0), *rest = _spans(a.body)
        assert v0 == "A-abort" and a.body["output_ids"][s0:e0] == want_a[s0:e0] and rest and rest[-1][0] == "B-in_place"
    assert run.srv.post("/flush_cache", {}).ok
    run.assert_serves("B")  # the update did land
    assert run.disk("A").ok
    run.assert_serves("A")


def test_a_paused_tensor_session_under_load_answers_only_old_or_new_tokens(run):
    """The README's RL recipe (slime-style): `/pause_generation` (retract) around a begin/end session of two tensor
    buckets of B, while four requests run. Every request is answered in full; each span of its tokens
    (meta_info.weight_versions) is A's greedy continuation or B's greedy continuation of what came before (the same
    batch of four as the references), never a half-written model's; the served weights are B's afterwards.
    Why the pause: a `/generate` between the two buckets of an unpaused session (SGLang takes its writer lock per
    call, not per session) answers tokens that are neither A's nor B's — the control below."""
    run.at("A")
    prompts = PROMPTS[:4]
    a_long = run.reference(prompts, LONG)
    begin, end = {"path": "/begin_weight_update"}, {"path": "/end_weight_update"}
    t = "/update_weights_from_tensor"
    session = [
        begin,
        {"label": "B 1", "path": t, "tensors": {"seed": 1, "bucket": [0, 2]}},
        {"label": "B 2", "path": t, "tensors": {"seed": 1, "bucket": [1, 2]}, "body": {"weight_version": "B-session"}},
        end,
    ]

    def paused_session():
        p = run.srv.post("/pause_generation", {"mode": "retract"})
        res = run.client(session, "paused-session")
        c = run.srv.post("/continue_generation", {})
        return p, res, c

    (p, res, c), answers = _in_flight(run, prompts, paused_session)
    run.state = "B"
    assert p.ok and c.ok and all(x["status"] == 200 for x in res), (p, c, res)
    assert _a_then_b(run, prompts, answers, a_long, "B-session"), "no request spanned the session"
    run.assert_serves("B")

    # the control: generation inside an unpaused session, between its two buckets, serves a half-written model
    b_tokens = run.ref["B"]["tokens"]
    run.at("A")
    gen = {"path": "/generate", "body": hs.gen_body(PROMPTS, NEW_TOKENS)}
    steps = [begin, session[1], {**gen, "label": "inside"}, session[2], end, {**gen, "label": "after"}]
    res = run.client(steps, "unpaused-session")
    run.state = "B"
    inside, after = ([o["output_ids"] for o in x["body"]] for x in res if x["label"] in ("inside", "after"))
    assert after == b_tokens
    assert inside != run.ref["A"]["tokens"] and inside != b_tokens, inside
    run.at("A")
    run.assert_serves("A")


def test_requests_in_flight_during_an_update_are_all_answered_each_from_one_version(run):
    run.at("A")
    prompts = [PROMPTS[i % 4][: 3 + i % 5] + [i + 1] for i in range(8)]
    a_long = run.reference(prompts[:4], LONG) + [None] * 4  # the batch the requests in flight run as

    def update():
        return run.disk("B", version="B-live")

    u, answers = _in_flight(run, prompts[:4], update)
    assert u.ok and u.body["success"], u
    # the update waited for the requests in flight (SGLang's writer lock): they finished on A; the next are B's
    # (one batch after the update, which flushed the cache: the shape of the reference below)
    r = run.srv.post("/generate", hs.gen_body(prompts[4:], LONG), 600)
    assert r.ok, r
    later = [hs.HTTPResult(r.status, body) for body in r.body]
    b_long = [None] * 4 + run.reference(prompts[4:], LONG)
    for i, a in enumerate(answers + later):
        assert a.ok, a
        (version, s, e), *rest = _spans(a.body)
        assert not rest and (s, e) == (0, LONG), _spans(a.body)
        want = a_long[i] if version == "A" else b_long[i]
        assert version in ("A", "B-live") and a.body["output_ids"] == want, (i, version)
    assert {_spans(a.body)[0][0] for a in answers} == {"A"} and {_spans(a.body)[0][0] for a in later} == {"B-live"}
    assert run.disk("A").ok
    run.assert_serves("A")
