"""Issue #37 through the door users use: the README's online NVFP4 recipe — a BF16 checkpoint served by a plain
`python -m sglang.launch_server --quantization nvfp4_online --device cpu ...` with the two test-only switches — on
the plugin's runner, and an RL loop against it over HTTP:

- the recipe's commands run as written (paths and port replaced); the log shows the plugin's decision line
  (flashinfer_trtllm) and every MoE layer "nvfp4_online prepared in place for flashinfer_trtllm";
- disk updates A -> B (the recipe's own curl) -> A: on each, `/weights_checker` checksums and greedy tokens == a
  fresh load of that checkpoint (SGLang's ModelRunner with the same --quantization in another process:
  support/http_reference.py) — what a fresh server of it serves;
- a BF16 tensor update in a `/begin_weight_update` ... `/end_weight_update` session, two buckets (slime's way):
  checksums and tokens == a fresh load of those weights; then a bucket holding one NaN in a BF16 expert weight:
  HTTP 400 with the refusal, the checksums and tokens unchanged.

The byte-for-byte proofs of the same flows (every parameter and buffer vs a fresh get_model(), storage kept, every
RL entry point, wrong shapes, inf, failed disk updates) are tests/test_models.py's qwen3_moe:nvfp4_online job; this
file proves the server the README starts does what that model does. One server, about a minute on a 2-core box.
"""

from __future__ import annotations

import pytest

from sglang_trtllm_moe.sandbox.releases import ENGINE_RELEASES

from .support import http_server as hs

#: within features.NVFP4_ONLINE's releases (--quantization nvfp4_online exists from 0.5.14)
pytestmark = pytest.mark.sglang(
    str(ENGINE_RELEASES),
    reason="the README's CPU server recipe: SGLang's HTTP server with begin/end weight-update sessions and the "
    "weight-checker endpoint (sandbox/releases.py ENGINE_RELEASES)",
)

ARCH, QUANT = "qwen3_moe", "nvfp4_online"
PROMPTS = [[5, 17, 42, 99], [5, 17, 42, 99, 260, 311, 7], [100, 200, 300, 400], [3, 9, 27, 81, 243, 480, 11, 13, 15]]
NEW_TOKENS = 4
NAN_TENSOR = "model.layers.1.mlp.experts.3.down_proj.weight"


def _spec(seed=0):
    from sglang_trtllm_moe.sandbox import checkpoints as ck

    return ck.TinySpec(arch=ARCH, quant=QUANT, seed=seed)


class Run(hs.RecipeRun):
    def client(self, steps: list[dict], name: str, timeout=600) -> dict:  # type: ignore[override]
        """The tensor client's answers by label."""
        answers = super().client(steps, name, timeout=timeout)
        return {x["label"] or f"{i}:{x['path']}": x for i, x in enumerate(answers)}


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    pytest.importorskip(
        "xgrammar", reason="SGLang's detokenizer imports xgrammar (ci/releases.tsv installs the pin of 0.5.23)"
    )
    pytest.importorskip("jsonschema", reason="SGLang's HTTP server imports jsonschema (ci/make-env base recipe)")
    work = tmp_path_factory.mktemp("http-online")
    r = Run(work, ARCH, QUANT, PROMPTS, NEW_TOKENS)
    r.dirs = {"A": str(work / "tiny-moe-bf16"), "B": str(work / "tiny-moe-bf16-step1")}
    assert any("--quantization nvfp4_online" in c for c in hs.recipe(mark=hs.HTTP_ONLINE_MARK))

    def before_server() -> dict:
        from sglang_trtllm_moe.sandbox import checkpoints as ck

        r.dirs["C"] = ck.write(str(work / "c"), _spec(2))  # what the tensor session sends (seed 2)
        return {
            "first": r.dirs["A"],
            "targets": {k: r.dirs[k] for k in ("A", "B", "C")},
            "prompts": PROMPTS,
            "new_tokens": NEW_TOKENS,
            "alone": ["A"],
            "server_args": _spec().server_args(),
        }

    yield from hs.serve_recipe(r, hs.HTTP_ONLINE_MARK, str(work / "tiny-moe"), before_server)


def test_the_online_recipe_serves_bf16_through_the_plugins_runner(run):
    gen, update = run.recipe_out
    assert gen["output_ids"] == run.ref["A"]["alone"], gen  # the recipe's prompt alone: a fresh load's tokens
    assert update["success"], update
    log = run.srv.log_tail(10**7)
    decision = [line for line in log.splitlines() if "sglang-trtllm-moe: Qwen3MoeForCausalLM MoE" in line]
    assert decision and "nvfp4_online" in decision[0], decision
    assert "moe_runner_backend=flashinfer_trtllm" in decision[0], decision  # the plugin's runner, not cutedsl
    assert log.count("nvfp4_online prepared in place for flashinfer_trtllm") == 2, log[-3000:]  # both MoE layers
    assert "stood down" not in log and "sandbox was not activated" not in log


def test_disk_updates_a_b_a_serve_a_fresh_servers_checksums_and_tokens(run):
    """The recipe's update left B: a fresh load of B's checksums and tokens; back to A: A's, exactly. A and B hash
    apart (the comparison can fail)."""
    assert run.state == "B"
    run.assert_serves("B")
    r = run.disk("A")
    assert r.ok and r.body["success"], r
    run.assert_serves("A")
    a, b = run.ref["A"]["checksums"], run.ref["B"]["checksums"]
    experts = [n for n in a if n.endswith((".experts.w13_weight", ".experts.w2_weight"))]
    assert experts and all(a[n] != b[n] for n in experts)


def test_bf16_tensor_session_equals_a_fresh_load_and_a_nan_bucket_is_refused(run):
    """slime's way: BF16 tensors of checkpoint C (seed 2) in two buckets of one session — the server then serves a
    fresh load of C; a bucket of B (seed 1) with one NaN in an expert's BF16 weight — HTTP 400, the whole bucket
    refused, C still served."""
    if run.state != "A":
        assert run.disk("A").ok
    begin, end = {"path": "/begin_weight_update"}, {"path": "/end_weight_update"}
    t = "/update_weights_from_tensor"

    def served(label):
        return [
            {"label": f"{label}: checksum", "path": "/weights_checker", "body": {"action": "checksum"}},
            {"label": f"{label}: generate", "path": "/generate", "body": hs.gen_body(PROMPTS, NEW_TOKENS)},
        ]

    steps = [
        begin,
        {"label": "C 1", "path": t, "tensors": {"seed": 2, "bucket": [0, 2]}},
        {"label": "C 2", "path": t, "tensors": {"seed": 2, "bucket": [1, 2]}},
        end,
        *served("C"),
        begin,
        {"label": "nan", "path": t, "tensors": {"seed": 1, "bucket": [0, 1], "nan": NAN_TENSOR}},
        end,
        *served("C after the refusal"),
    ]
    res = run.client(steps, "trainer")
    run.state = "C"
    assert res["C 1"]["status"] == 200 and res["C 2"]["status"] == 200, (res["C 1"], res["C 2"])
    refused = res["nan"]
    assert refused["status"] == 400 and refused["body"]["message"].startswith("refused the whole weight-update bucket")
    assert "non-finite" in refused["body"]["message"] and "expert 3" in refused["body"]["message"], refused
    for label in ("C", "C after the refusal"):
        (rank,) = res[f"{label}: checksum"]["body"]["ranks"]
        theirs = run.ref["C"]["checksums"]
        assert rank["checksums"] == theirs, (label, [n for n in theirs if rank["checksums"].get(n) != theirs[n]][:8])
        assert [o["output_ids"] for o in res[f"{label}: generate"]["body"]] == run.ref["C"]["tokens"], label
