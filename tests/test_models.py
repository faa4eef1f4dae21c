"""Whole SGLang models on CPU, driven the way RL frameworks drive them (issue #19; #20 in test_model_threaded_load).

Every model runs in a process of its own, forked from one parent that imported SGLang once
(tests/support/model_worker.py `--jobs all`): SGLang's own ModelRunner loads a tiny real checkpoint
(sandbox/checkpoints.py) through get_model() with `--moe-runner-backend auto` on a faked SM100, the plugin's
auto-selection picks the runner, the plugin prepares every MoE layer, and every RL flow runs through the runner's
WeightUpdater as SGLang's scheduler calls it. After each flow the whole model (every parameter and buffer, byte for
byte) equals a fresh get_model() of the checkpoint that was intended, every data_ptr is kept, every MoE layer is
clean. The forward is compared with transformers' own model class on the float32 dequantized checkpoint. `explain`
names the runner every built FusedMoE layer really got; for the quantized Mixtral SGLang builds without FusedMoE it
says so instead of naming a winner.

Models (model_worker.JOBS): each architecture with its NVFP4 and FP8 checkpoint where SGLang builds FusedMoE layers
for it — Qwen3-MoE, DeepSeek-V3 (128x128 block FP8, its own recipe), Nemotron-H (relu2) — and Mixtral BF16 +
FP8 (`quant_method: fp8`); Mixtral NVFP4 is SGLang's QuantMixtralForCausalLM (no FusedMoE). Every flow for every
one of them.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from sglang_trtllm_moe.compat import features
from sglang_trtllm_moe.sandbox.releases import MODEL_RUNNER_RELEASES

from .support.helpers import REPO, last_json
from .support.model_worker import CHECKSUM_JOBS, JOBS, job_key

pytestmark = pytest.mark.sglang(
    str(MODEL_RUNNER_RELEASES),
    reason="sandbox.models spells SGLang's runner set-up of these releases "
    "(bench_one_batch flow: bootstrap.init_parallel_runtime, "
    "runtime_context.publish; sandbox/releases.py MODEL_RUNNER_RELEASES); older releases set up the process "
    "differently",
)

#: models SGLang builds with FusedMoE layers, and the one it builds without; variants (other sizes, a few checks)
FUSED = [(a, q) for a, q, _ in JOBS if not (a == "mixtral" and q == "nvfp4") and "@" not in q]
FUSED_IDS = [job_key(a, q) for a, q in FUSED]
#: every model, variants included, for the checks every job runs (load, malformed updates, failed disk updates)
ALL_FUSED = [(a, q) for a, q, _ in JOBS if not (a == "mixtral" and q == "nvfp4") and not q.endswith("@r3")]
ALL_FUSED_IDS = [job_key(a, q) for a, q in ALL_FUSED]
#: the models served with --enable-return-routed-experts (R3): their one check is the routed experts
R3 = [(a, q) for a, q, _ in JOBS if q.endswith("@r3")]
R3_IDS = [job_key(a, q) for a, q in R3]
#: the models checkpoint-engine's IPC flow runs on (model_worker.JOBS: the "ipc_buckets" check)
IPC = [(a, q) for a, q, extra in JOBS if "ipc_buckets" in extra]

#: relative error of the prefill next-token logits vs transformers (float32, dequantized experts), measured on this
#: box with the emulated kernels (docs/TESTING.md), asserted with ~1.5x margin. NVFP4 quantizes the activations to
#: FP4 at both GEMMs (W4A4), FP8 to e4m3 (static per-tensor scales, or dynamic per 1x128 block): those dominate;
#: BF16 rounds the activations only.
FORWARD_BOUND = {
    ("qwen3_moe", "nvfp4"): 0.22,
    ("deepseek_v3", "nvfp4"): 0.22,
    ("nemotron_h", "nvfp4"): 0.25,
    ("mixtral", "bf16"): 0.04,
    ("qwen3_moe", "fp8"): 0.08,
    ("nemotron_h", "fp8"): 0.1,
    ("mixtral", "fp8_static"): 0.11,
    ("deepseek_v3", "fp8_block"): 0.055,
    # INT4 weights, BF16 activations (W4A16): only bf16 roundings of the activations (measured 0.009 on 0.5.23)
    ("deepseek_v3", "ct_int4"): 0.015,
    # BF16 checkpoint, experts quantized to NVFP4 as they load, activations per token (measured 0.195 on 0.5.23)
    ("qwen3_moe", "nvfp4_online"): 0.3,
    # the same, served with --quantization modelopt_fp4: static per-tensor activation scales (1.0)
    ("qwen3_moe", "nvfp4_online_tensor"): 0.3,
}

FULL_FLOWS = (
    "disk_full",
    "disk_partial",
    "tensor_buckets",
    "tensor_flattened_bucket",
    "tensor_split_shards",
    "session_forward",
    "session_direct",
    "distributed",
    "random_rounds",
    "weight_checker",
    "greedy",
)

#: what is known not to work on older releases, by cause: (release specifier, formats, checks, reason). A test of a
#: listed (release, format, check) is a strict xfail: it must fail, so a fix shows up as a failure to remove here.
KNOWN: tuple = (
    (
        str(features.NVFP4_ONLINE_LOADER_4OVER6.releases),
        ("qwen3_moe:nvfp4_online", "qwen3_moe:nvfp4_online_tensor"),
        (
            "tensor_buckets",
            "tensor_flattened_bucket",
            "tensor_split_shards",
            "session_forward",
            "distributed",
            "random_rounds",
            "weight_checker",
        ),
        "SGLang's model loader quantizes an online NVFP4 load (nvfp4_online, modelopt_fp4 on BF16) and its disk "
        "updates with the 4over6 recipe, its "
        "update_weights_from_tensor / _distributed with the plain one (features.NVFP4_ONLINE_LOADER_4OVER6): a "
        "tensor update is not a fresh load's bytes on these releases (weight_checker replays such a state from disk)",
    ),
)


def _release():
    from packaging.version import Version

    from sglang_trtllm_moe.compat.releases import installed_version

    return Version(installed_version().base_version)


def known(request, arch: str, quant: str, check: str) -> None:
    """Mark this test a strict xfail where KNOWN lists (release, model, check)."""
    from packaging.specifiers import SpecifierSet

    for spec, jobs, checks, reason in KNOWN:
        if _release() in SpecifierSet(spec) and job_key(arch, quant) in jobs and check in checks:
            request.applymarker(pytest.mark.xfail(strict=True, reason=reason))
            return


_REPORTS: dict = {}


def reports() -> dict:
    """Every model's report, from one `model_worker --jobs all` run (about a minute on a 2-core box), and beside it
    SGLang alone's checksums of the same weights (tests/support/checksum_reference.py, plugin disabled: ~15 s)."""
    if not _REPORTS:
        import tempfile

        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join(
                [str(REPO)] + ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else [])
            ),
        }
        work = tempfile.mkdtemp(prefix="trtllm-moe-checksum-")
        job, out = os.path.join(work, "job.json"), os.path.join(work, "out.json")
        with open(job, "w") as f:
            json.dump({"models": [list(j) for j in CHECKSUM_JOBS], "workdir": work}, f)
        ref = subprocess.Popen(
            [sys.executable, "-m", "tests.support.checksum_reference", job, out],
            cwd=str(REPO),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            env={**env, "SGLANG_TRTLLM_MOE_DISABLE": "1"},
        )
        cmd = [sys.executable, "-m", "tests.support.model_worker", "--jobs", "all"]
        proc = subprocess.run(cmd, cwd=str(REPO), capture_output=True, text=True, timeout=900, env=env)
        _REPORTS.update(last_json(proc))
        _REPORTS["_stderr_tail"] = proc.stderr[-3000:]
        _, err = ref.communicate(timeout=600)
        try:
            if ref.returncode == 0:
                with open(out) as f:
                    _REPORTS["_checksum_reference"] = json.load(f)
            else:
                _REPORTS["_checksum_reference"] = {"_error": f"exit {ref.returncode}: {err[-3000:]}"}
        finally:
            shutil.rmtree(work, ignore_errors=True)  # its checkpoints (~13 MB a run) were left in /tmp before
    return _REPORTS


def report(arch: str, quant: str) -> dict:
    rep = reports().get(job_key(arch, quant))
    assert rep is not None, f"no report for {arch}:{quant}\n{reports().get('_stderr_tail')}"
    assert "_crash" not in rep, f"{rep['_crash']}\n{reports().get('_stderr_tail')}"
    return rep


def _check(rep: dict, name: str) -> dict:
    res = rep[name]
    assert res.get("ok"), (
        f"{name}: {json.dumps({k: v for k, v in res.items() if k != 'traceback'}, default=str)[:3000]}"
        f"\n{res.get('traceback', '')}"
    )
    return res


@pytest.mark.parametrize("arch,quant", ALL_FUSED, ids=ALL_FUSED_IDS)
def test_model_loads_with_every_moe_layer_managed(arch, quant):
    """Every FusedMoE layer is prepared by the plugin, or (compat/defer.py) by SGLang and observed by the plugin."""
    res = _check(report(arch, quant), "load")
    assert res["moe_layers"], "no FusedMoE layer was built"


@pytest.mark.parametrize("arch,quant", FUSED, ids=FUSED_IDS)
def test_model_forward_matches_transformers(request, arch, quant):
    known(request, arch, quant, "forward")
    res = _check(report(arch, quant), "forward")
    assert res["rel_err"] <= FORWARD_BOUND[(arch, quant)], res


@pytest.mark.parametrize("flow", FULL_FLOWS)
@pytest.mark.parametrize("arch,quant", FUSED, ids=FUSED_IDS)
def test_model_rl_flow_equals_fresh_load(request, arch, quant, flow):
    known(request, arch, quant, flow)
    _check(report(arch, quant), flow)


#: the models sglang.Engine and the HTTP server serve in their tests, whose token comparisons rely on batch invariance
SERVED = [(a, q) for a, q, extra in JOBS if "batch_invariance" in extra]


@pytest.mark.parametrize("arch,quant", SERVED, ids=[job_key(a, q) for a, q in SERVED])
def test_served_models_are_batch_invariant(arch, quant):
    """What keeps the Engine's and the HTTP server's greedy-token comparisons from depending on the machine's load
    (issue #40; docs/TESTING.md "Exact comparisons"): every next-token logit of the prompts, prefill and decode, is
    bit-for-bit the same batched, alone, in reverse order and prefilled again from the request's own output (as a
    retracted request or a radix-cache hit is run). A near-tie then cannot flip: the tiny models' smallest top-1 /
    top-2 margin is 0 (an exact tie, broken the same way on both sides)."""
    res = _check(report(arch, quant), "batch_invariance")
    assert set(res["max_abs_diff"]) == {"alone", "reversed", "prefilled_again"}, res
    assert all(d == 0 for d in res["max_abs_diff"].values()), res


@pytest.mark.parametrize("arch,quant", CHECKSUM_JOBS, ids=[job_key(a, q) for a, q in CHECKSUM_JOBS])
def test_checksum_equals_sglang_alone_holding_the_same_weights(arch, quant):
    """SGLang's weight-checker `checksum` (0.5.23: per-tensor hashes of each weight dequantized, in checkpoint layout;
    trainers compare it across engines) of a plugin-prepared model — NVFP4, FP8 per-tensor, BF16 — equals, tensor by
    tensor, what SGLang alone answers for the same weights held unquantized: the checkpoint with its experts
    dequantized by flashinfer's CPU dequantizer, a BF16 model on SGLang's triton runner, plugin disabled, in another
    process (tests/support/checksum_reference.py). The plugin's model reports its quantization scales and kernel
    scalars besides (a quantized engine holds them; an unquantized one does not)."""
    res = _check(report(arch, quant), "checksum")
    ref = reports()["_checksum_reference"]
    assert "_error" not in ref, ref.get("_error")
    theirs, mine = ref[job_key(arch, quant)]["checksums"], res["checksums"]
    assert not set(theirs) - set(mine), sorted(set(theirs) - set(mine))
    differ = [n for n in theirs if mine[n] != theirs[n]]
    assert not differ, differ
    weights = [n for n in theirs if n.endswith((".experts.w13_weight", ".experts.w2_weight"))]
    assert len(weights) == 2 * len(ref[job_key(arch, quant)]["moe_layers"]) > 0, weights
    extra = sorted(set(mine) - set(theirs))
    assert all(".experts." in n and not n.endswith(("w13_weight", "w2_weight")) for n in extra), extra


def test_checksum_references_tell_the_weights_apart():
    """The comparison can fail: the same architecture's NVFP4 and FP8 checkpoints hold other expert weights, and
    SGLang alone hashes them apart (while their BF16 dense tensors, drawn alike, hash the same)."""
    ref = reports()["_checksum_reference"]
    assert "_error" not in ref, ref.get("_error")
    a, b = ref["qwen3_moe:nvfp4"]["checksums"], ref["qwen3_moe:fp8"]["checksums"]
    experts = [n for n in a if ".experts." in n]
    assert experts and all(a[n] != b[n] for n in experts)
    assert all(a[n] == b[n] for n in a if ".experts." not in n)


@pytest.mark.parametrize("arch,quant", IPC, ids=[job_key(a, q) for a, q in IPC])
def test_checkpoint_engine_buckets_then_finish_equal_a_fresh_load(arch, quant):
    """checkpoint-engine's flow through SGLang's update_weights_from_ipc (its worker loop on CPU:
    tests/support/checkpoint_engine.py): a malformed expert tensor in the middle bucket refuses that bucket whole
    (the worker answers the plugin's refusal, the update answers (False, message), no later bucket, no post hook)
    and the model equals a fresh load of what the buckets before it wrote; the full checkpoint in 9 buckets then
    SGLang's post hook equals a fresh load of it, storage kept, layers clean; SGLang's WeightChecker compare passes
    across an IPC replay."""
    res = _check(report(arch, quant), "ipc_buckets")
    bad = res["bad_bucket"]
    assert not bad["returned"][0] and "refused the whole weight-update bucket" in bad["returned"][1], bad
    assert bad["replies"][:-1] == ["ok"] * (len(bad["replies"]) - 1) and not bad["post_hook_ran"], bad
    assert res["full"]["post_hook_ran"] and res["full"]["n_differs"] == 0 and not res["full"]["moved"], res["full"]
    assert res["checker"]["compare"] == "passed" and not res["post_hook_warnings"], res


@pytest.mark.parametrize("arch,quant", FUSED, ids=FUSED_IDS)
def test_explain_names_the_runner_every_built_layer_gets(arch, quant):
    """explain's verdict (faked SM100) == SGLang's resolution with the plugin == the runner backend of every
    FusedMoE layer the model was built with, and the plugin manages each of them."""
    res = _check(report(arch, quant), "explain")
    assert res["explain"]["code"] in ("AUTO_SELECTED", "UPSTREAM_AGREES"), res
    assert set(res["built"].values()) == {res["explain"]["winner"]} == {res["server_args_moe_runner_backend"]}


def test_quantized_mixtral_is_built_without_fused_moe_and_explain_says_so():
    """Mixtral NVFP4 (ModelOpt) is QuantMixtralForCausalLM in SGLang: per-expert linear layers, no FusedMoE. explain
    must not name a winner (NO_FUSED_MOE, no candidates) and the plugin must leave SGLang's resolution alone."""
    res = _check(report("mixtral", "nvfp4"), "built_without_fused_moe")
    assert res["model_class"] == "QuantMixtralForCausalLM" and res["fused_moe_layers"] == []
    assert res["explain"]["code"] == "NO_FUSED_MOE"
    assert res["sglang"]["with_plugin"] == res["sglang"]["upstream_alone"]


#: the online quants (a BF16 checkpoint served with --quantization nvfp4_online): their A -> B -> A disk check
ONLINE = [(a, q) for a, q, extra in JOBS if "disk_a_b_a" in extra]


@pytest.mark.parametrize("arch,quant", ONLINE, ids=[job_key(a, q) for a, q in ONLINE])
def test_online_disk_updates_a_b_a_serve_a_fresh_loads_bytes_tokens_and_checksum(arch, quant):
    """Issue #37: a BF16 checkpoint served with --quantization nvfp4_online on the plugin's runner (explain and the
    built layers say flashinfer_trtllm, every layer plugin-prepared: test_explain / test_model_loads above);
    update_weights_from_disk A -> B -> A, the BF16 experts quantized by SGLang's online loader and laid out by the
    plugin in place. On B and back on A: every byte, SGLang's WeightChecker `checksum` (what `/weights_checker`
    answers) and the greedy tokens equal a fresh get_model() of that checkpoint (a fresh server's), storage kept;
    A's and B's expert checksums differ (the comparison can fail)."""
    res = _check(report(arch, quant), "disk_a_b_a")
    assert res["a_b_checksums_apart"] and not res["moved"], res
    for key in ("B", "A"):
        step = res["steps"][key]
        assert not step["differs"] and not step["checksums_differ"] and step["n_checksums"] > 0, (key, step)
        assert step["tokens"] == step["fresh_tokens"], (key, step)
    assert res["steps"]["A"]["tokens"] != res["steps"]["B"]["tokens"]


@pytest.mark.parametrize("case", ("nan_source", "inf_source"))
@pytest.mark.parametrize("how", ("tensor", "disk"))
@pytest.mark.parametrize("arch,quant", ONLINE, ids=[job_key(a, q) for a, q in ONLINE])
def test_online_non_finite_source_weight_is_refused_and_changes_nothing(arch, quant, how, case):
    """One NaN / inf in a BF16 expert weight an online quant quantizes as it loads (it would become a NaN or
    saturated amax-derived global scale): answered (False, message), nothing of the model changed."""
    c = _refused(arch, quant)[f"{case}/{how}"]
    assert c["refused"] and c["returned_failure"] and not c["raised"] and not c["changed"], c


@pytest.mark.parametrize("arch,quant", ONLINE, ids=[job_key(a, q) for a, q in ONLINE])
def test_online_checkpoint_with_a_gate_but_not_its_up_is_refused(arch, quant):
    """A disk update whose checkpoint holds an expert's gate (w1) and not its up (w3): SGLang's online loader would
    hold the gate unwritten (it quantizes the pair with one scale) and fail the next update that sends it. Refused
    from the headers, nothing changed. (In a tensor session the halves may come in different calls:
    test_model_rl_flow_equals_fresh_load's tensor_split_shards / tensor_buckets.)"""
    c = _refused(arch, quant)["gate_alone/disk"]
    assert c["refused"] and c["returned_failure"] and not c["changed"], c
    assert "w1 (gate) without w3 (up)" in c["message"], c


def test_model_threaded_load_deepseek_nvfp4_ten_runs():
    """Issue #20: DeepSeek-V3 NVFP4 update_weights_from_disk A->B with SGLang's default threaded loading (one pool
    task per CPU tensor) equals a fresh load of B in every one of 10 runs, storage kept, and the pool really wrote."""
    res = _check(report("deepseek_v3", "nvfp4"), "threaded_disk_ab")
    assert res["runs"] >= 10 and res["async_load_on_cpu"] and res["pool_used_every_run"]


# ---- malformed updates ---------------------------------------------------------------------------------------------


def _refused(arch, quant) -> dict:
    res = report(arch, quant)["refused_updates"]
    assert "cases" in res, res
    assert res["restored"], res  # the intended checkpoint loads again over whatever the cases left
    return res["cases"]


@pytest.mark.parametrize("case", ("extra_column/tensor", "extra_column/disk", "wrong_dtype/tensor", "wrong_dtype/disk"))
@pytest.mark.parametrize("arch,quant", ALL_FUSED, ids=ALL_FUSED_IDS)
def test_malformed_update_is_refused_before_a_byte_changes(request, arch, quant, case):
    """A tensor the loader would value-convert (float32 into byte storage) or broadcast (one column too many) is
    refused, by tensor and by disk, and the model is untouched."""
    cases = _refused(arch, quant)
    if case not in cases:
        pytest.skip(f"{quant} weights are not byte storage: a float32 tensor is converted like a load")
    known(request, arch, quant, f"refused:{case}")
    c = cases[case]
    assert c["refused"] and not c["changed"], c


@pytest.mark.parametrize("arch,quant", ALL_FUSED, ids=ALL_FUSED_IDS)
def test_update_one_row_short_is_refused(arch, quant):
    """One row short would leave the old last row: a silently mixed expert. Refused, by tensor and by disk."""
    cases = _refused(arch, quant)
    for how in ("tensor", "disk"):
        c = cases[f"missing_row/{how}"]
        assert c["refused"] and not c["changed"], (how, c)


@pytest.mark.parametrize("arch,quant", ALL_FUSED, ids=ALL_FUSED_IDS)
def test_refused_request_writes_nothing(arch, quant):
    """Well-formed tensors of the same expert before the malformed one: the whole request is refused (a bucket at
    the tensor entry point, the checkpoint's headers before SGLang restores anything on a disk update)."""
    cases = _refused(arch, quant)
    for how in ("tensor", "disk"):
        c = cases[f"mixed/{how}"]
        assert c["refused"] and not c["changed"], (how, c)


@pytest.mark.parametrize("arch,quant", [(a, q) for a, q in FUSED if q in ("nvfp4", "fp8", "fp8_static")])
def test_non_finite_scale_is_refused_before_a_byte_changes(arch, quant):
    """A NaN per-tensor scale, by tensor and by disk. On disk every scale is read and checked before SGLang restores
    anything, so the whole checkpoint is refused as (False, message): refused while loading, SGLang's rollback would
    re-read the same NaN and the entry point raise."""
    cases = _refused(arch, quant)
    for how in ("tensor", "disk"):
        c = cases[f"nan_scale/{how}"]
        assert c["refused"] and not c["changed"], (how, c)
        assert c["returned_failure"] and "nan" in c["message"].lower(), (how, c)


@pytest.mark.parametrize("arch,quant", ALL_FUSED, ids=ALL_FUSED_IDS)
def test_refused_update_is_reported_not_raised(arch, quant):
    """SGLang's update_weights_from_tensor does not catch loader exceptions (a refusal would escape the scheduler
    and sglang.Engine exit), and its disk rollback re-reads the refused checkpoint: the plugin answers both entry
    points with (False, message) before anything is loaded, as SGLang reports its own failures — every case."""
    cases = _refused(arch, quant)
    for key, c in cases.items():
        assert c["returned_failure"] and not c["raised"], (key, c)


BLOCK_SCALED = [(a, q) for a, q in ALL_FUSED if q.partition("@")[0] in ("nvfp4", "fp8_block")]


@pytest.mark.parametrize("arch,quant", BLOCK_SCALED, ids=[job_key(a, q) for a, q in BLOCK_SCALED])
def test_one_bad_block_scale_is_refused_at_real_scale_sizes(arch, quant):
    """Issue #27: one NaN in an expert's block scale — NVFP4's e4m3 byte 0x7F of a [rows, H/16] scale, DeepSeek FP8
    block's float32 NaN in weight_scale_inv ([8, 9] on the wide variant: more values than the old 64-value header
    read) — refused by tensor and by disk as (False, message) naming the parameter, nothing changed. Before: the NVFP4
    byte was served (every prompt then answered token 0), the FP8 one killed the server on a disk update."""
    cases = _refused(arch, quant)
    for how in ("tensor", "disk"):
        c = cases[f"nan_block_scale/{how}"]
        assert c["returned_failure"] and not c["raised"] and not c["changed"], (how, c)
        assert "weight_scale" in c["message"] and ("nan" in c["message"].lower()), (how, c)
    if quant.endswith("@wide"):
        assert cases["nan_block_scale/disk"]["shape"] == [8, 9], cases["nan_block_scale/disk"]


@pytest.mark.parametrize("arch,quant", ALL_FUSED, ids=ALL_FUSED_IDS)
def test_a_disk_update_that_fails_after_the_check_changes_nothing(arch, quant):
    """Issue #27: a shard cut short (refused before SGLang touches anything), removed after the plugin's check
    (SGLang loads what is left and calls it a success), gone when SGLang opens it, or unreadable (an I/O error):
    answered (False, message), never raised into the scheduler, every byte of the model the previous one — put back
    by reloading the checkpoints the served weights came from when they are unchanged on disk, from a host snapshot
    when they came as tensors — and a good update afterwards equals a fresh load."""
    res = report(arch, quant)["disk_failures"]
    assert "cases" in res, res
    for key, c in res["cases"].items():
        assert c["answered"] and not c["raised"] and not c["changed"], (key, c)
        case, served = key.split("/")
        want = "refused first" if case == "truncated" else ("reloaded" if served == "from_disk" else "snapshot")
        assert c["put_back"] == want, (key, c)
    assert res["good_update_after"] and res["ok"], res


@pytest.mark.parametrize("arch,quant", R3, ids=R3_IDS)
def test_routed_experts_equal_sglangs_own_topk_on_the_same_logits(arch, quant):
    """R3 (--enable-return-routed-experts) through SGLang's own ModelRunner and capturer: for every MoE layer, in a
    prefill and two decode steps, the experts in SGLang's capture buffer (what the server returns) equal SGLang's own
    select_experts on the router logits that layer saw, per token (ties at the cut either way, counted); with the
    plugin's capture off the same buffer does not (the check can fail). Routing methods: Renormalize (Qwen3-MoE),
    DeepSeekV3 grouped with correction bias (DeepSeek-V3, Nemotron-H relu2), undeclared (Mixtral: SGLang's top-k)."""
    res = _check(report(arch, quant), "routed_experts")
    assert res["moe_layers"], res
    # the fused runner's layers report through the plugin; a layer without a declared routing method is routed
    # (and captured) by SGLang's own top-k
    assert res["reported_by_plugin"] == ([] if arch == "mixtral" else res["moe_layers"]), res
