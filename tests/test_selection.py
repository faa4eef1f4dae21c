"""Auto-selection of flashinfer_trtllm(_routed) on SM 10.x: the rules, the report, and SGLang's real resolution.

Oracles nobody here wrote:
* SGLang 0.5.23's own `ServerArgs.resolve_once()` on config.json-only model directories, platform faked with its
  own `override_platform` — with the plugin loaded by `load_plugins()`, with it disabled, and with the switch off;
* SGLang's ModelConfig naming of the checkpoint's quantization (our config reader must agree);
* SGLang's per-runner quantization asserts (explicit backend + quantization: accepted or AssertionError);
* SGLang's `get_activation_type` + flashinfer's ActivationType, and the runners' `_SUPPORTED_*_ACTIVATIONS` sets;
* SGLang's `FusedOpPool` registry (which a2a backends have a fused func for these runners).
All SGLang resolutions run in two fresh processes, asked together (plugin loading is once per process): the
session's shared processes of their environment (tests/support/probes.py), one with the plugin — where the
resolutions run first, right after SGLang's load_plugins(), then again with the auto switch off — and one with the
plugin disabled.
"""

from __future__ import annotations

import atexit
import functools
import json
import re
import shutil
import subprocess
import sys
import tempfile
import textwrap
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sglang_trtllm_moe import selection as sel
from sglang_trtllm_moe.formats import FORMATS
from sglang_trtllm_moe.selection import Code, DeviceInfo, MoeProblem, can_implement, resolve

from .support import probes

SM100 = DeviceInfo(sm=100, flashinfer_version="0.7.2.post1", source="test")

# --- config.json-only model directories -------------------------------------------------------------------------

NVFP4 = {"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16}
MODELOPT_FP8 = {"quant_method": "modelopt", "quant_algo": "FP8"}
FP8_BLOCK = {"quant_method": "fp8", "weight_block_size": [128, 128], "activation_scheme": "dynamic"}
FP8_TENSOR = {"quant_method": "fp8", "activation_scheme": "dynamic"}
CT_NVFP4 = {
    "quant_method": "compressed-tensors",
    "format": "nvfp4-pack-quantized",
    "config_groups": {
        "group_0": {
            "targets": ["Linear"],
            "weights": {
                "num_bits": 4,
                "type": "float",
                "group_size": 16,
                "strategy": "tensor_group",
                "symmetric": True,
            },
            "input_activations": {
                "num_bits": 4,
                "type": "float",
                "group_size": 16,
                "strategy": "tensor_group",
                "dynamic": "local",
                "symmetric": True,
            },
        }
    },
    "ignore": ["lm_head"],
}
QUANTS = {
    "nvfp4": NVFP4,
    "modelopt_fp8": MODELOPT_FP8,
    "fp8_block": FP8_BLOCK,
    "fp8_tensor": FP8_TENSOR,
    "ct_nvfp4": CT_NVFP4,
    "bf16": None,
}

BASE = dict(
    hidden_size=256,
    num_attention_heads=4,
    num_key_value_heads=4,
    num_hidden_layers=2,
    vocab_size=1000,
    max_position_embeddings=4096,
    torch_dtype="bfloat16",
)
ARCHS = {
    "mixtral": dict(
        architectures=["MixtralForCausalLM"],
        model_type="mixtral",
        intermediate_size=512,
        num_local_experts=8,
        num_experts_per_tok=2,
        hidden_act="silu",
    ),
    "qwen2_moe": dict(
        architectures=["Qwen2MoeForCausalLM"],
        model_type="qwen2_moe",
        intermediate_size=512,
        moe_intermediate_size=256,
        shared_expert_intermediate_size=512,
        num_experts=8,
        num_experts_per_tok=2,
        hidden_act="silu",
    ),
    "qwen3_moe": dict(
        architectures=["Qwen3MoeForCausalLM"],
        model_type="qwen3_moe",
        intermediate_size=512,
        moe_intermediate_size=256,
        num_experts=8,
        num_experts_per_tok=2,
        hidden_act="silu",
        head_dim=64,
    ),
    "deepseek_v3": dict(
        architectures=["DeepseekV3ForCausalLM"],
        model_type="deepseek_v3",
        intermediate_size=1024,
        moe_intermediate_size=256,
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_shared_experts=1,
        hidden_act="silu",
        kv_lora_rank=64,
        q_lora_rank=None,
        qk_rope_head_dim=16,
        qk_nope_head_dim=32,
        v_head_dim=32,
        n_group=1,
        topk_group=1,
        first_k_dense_replace=0,
    ),
    "nemotron_h": dict(
        architectures=["NemotronHForCausalLM"],
        model_type="nemotron_h",
        intermediate_size=512,
        moe_intermediate_size=512,
        n_routed_experts=8,
        num_experts_per_tok=2,
        mlp_hidden_act="relu2",
        hybrid_override_pattern="ME",
        mamba_num_heads=8,
        mamba_head_dim=32,
        ssm_state_size=16,
        mamba_n_groups=1,
        head_dim=64,
    ),
    "eagle_draft": dict(
        architectures=["LlamaForCausalLMEagle3"], model_type="llama", intermediate_size=512, hidden_act="silu"
    ),
}
NEMOTRON_KW = {"disable_radix_cache": True}  # the mamba extra_buffer snapshot check needs a real GPU platform

#: (id, arch, quant, sm, ServerArgs kwargs, upstream alone, with the plugin, plugin decision code)
CASES = [
    # quantized Mixtral other than fp8 / compressed-tensors is QuantMixtralForCausalLM (no FusedMoE): no winner,
    # whatever the platform, the switch or an explicit flag say (model_loader/utils.py get_model_architecture)
    ("mixtral-nvfp4", "mixtral", "nvfp4", 100, {}, "auto", "auto", Code.NO_FUSED_MOE),
    ("mixtral-modelopt_fp8", "mixtral", "modelopt_fp8", 100, {}, "auto", "auto", Code.NO_FUSED_MOE),
    ("mixtral-fp8_block", "mixtral", "fp8_block", 100, {}, "auto", "flashinfer_trtllm", Code.AUTO_SELECTED),
    ("mixtral-ct_nvfp4", "mixtral", "ct_nvfp4", 100, {}, "auto", "flashinfer_trtllm", Code.AUTO_SELECTED),
    ("mixtral-bf16", "mixtral", "bf16", 100, {}, "auto", "flashinfer_trtllm", Code.AUTO_SELECTED),
    ("mixtral-fp8_tensor", "mixtral", "fp8_tensor", 100, {}, "auto", "auto", Code.NO_ELIGIBLE_BACKEND),
    ("mixtral-nvfp4-sm120", "mixtral", "nvfp4", 120, {}, "auto", "auto", Code.NO_FUSED_MOE),
    (
        "mixtral-nvfp4-sm120-q",
        "mixtral",
        "nvfp4",
        120,
        {"quantization": "modelopt_fp4"},
        "flashinfer_cutlass",
        "flashinfer_cutlass",
        Code.NO_FUSED_MOE,
    ),
    ("mixtral-bf16-sm90", "mixtral", "bf16", 90, {}, "auto", "auto", Code.NOT_SM100),
    # SGLang's weight cache (0.5.17+): the daemon prepares without the plugin, the scheduler skips the preparation
    (
        "mixtral-bf16-weight-cache",
        "mixtral",
        "bf16",
        100,
        {"weight_cache_mode": "client"},
        "auto",
        "auto",
        Code.WEIGHT_CACHE_KEEPS_UPSTREAM,
    ),
    (
        "mixtral-nvfp4-explicit",
        "mixtral",
        "nvfp4",
        100,
        {"moe_runner_backend": "triton"},
        "triton",
        "triton",
        Code.NO_FUSED_MOE,
    ),
    (
        "mixtral-fp8_block-explicit",
        "mixtral",
        "fp8_block",
        100,
        {"moe_runner_backend": "triton"},
        "triton",
        "triton",
        Code.EXPLICIT,
    ),
    ("qwen2_moe-modelopt_fp8", "qwen2_moe", "modelopt_fp8", 100, {}, "auto", "flashinfer_trtllm", Code.AUTO_SELECTED),
    ("qwen3_moe-nvfp4", "qwen3_moe", "nvfp4", 100, {}, "flashinfer_trtllm", "flashinfer_trtllm", Code.UPSTREAM_AGREES),
    ("qwen3_moe-modelopt_fp8", "qwen3_moe", "modelopt_fp8", 100, {}, "auto", "flashinfer_trtllm", Code.AUTO_SELECTED),
    ("qwen3_moe-ct_nvfp4", "qwen3_moe", "ct_nvfp4", 100, {}, "auto", "flashinfer_trtllm", Code.AUTO_SELECTED),
    (
        "qwen3_moe-nvfp4-deepep",
        "qwen3_moe",
        "nvfp4",
        100,
        {"moe_a2a_backend": "deepep", "tp_size": 2},
        "auto",
        "auto",
        Code.NO_ELIGIBLE_BACKEND,
    ),
    (
        "qwen3_moe-nvfp4-fi_a2a",
        "qwen3_moe",
        "nvfp4",
        100,
        {"moe_a2a_backend": "flashinfer", "tp_size": 2, "attn_dp_size": 2},  # SGLang alone rejects auto here
        "AssertionError: FlashInfer MoE A2A is supported with",
        "flashinfer_trtllm_routed",
        Code.AUTO_SELECTED,
    ),
    ("qwen3_moe-modelopt_fp8-sm90", "qwen3_moe", "modelopt_fp8", 90, {}, "auto", "auto", Code.NOT_SM100),
    (
        "deepseek_v3-nvfp4",
        "deepseek_v3",
        "nvfp4",
        100,
        {},
        "flashinfer_trtllm",
        "flashinfer_trtllm",
        Code.UPSTREAM_AGREES,
    ),
    (
        "deepseek_v3-nvfp4-eplb",
        "deepseek_v3",
        "nvfp4",
        100,
        {"enable_eplb": True, "tp_size": 2, "ep_size": 2},
        "flashinfer_trtllm",
        "flashinfer_trtllm_routed",
        Code.AUTO_SELECTED,
    ),
    ("deepseek_v3-fp8_block-sm120", "deepseek_v3", "fp8_block", 120, {}, "auto", "auto", Code.NOT_SM100),
    (
        "nemotron_h-nvfp4",
        "nemotron_h",
        "nvfp4",
        100,
        NEMOTRON_KW,
        "flashinfer_trtllm",
        "flashinfer_trtllm",
        Code.UPSTREAM_AGREES,
    ),
    (
        "nemotron_h-nvfp4-redundant",
        "nemotron_h",
        "nvfp4",
        100,
        {**NEMOTRON_KW, "ep_num_redundant_experts": 2, "tp_size": 2, "ep_size": 2},
        "flashinfer_trtllm_routed",
        "flashinfer_trtllm_routed",
        Code.UPSTREAM_AGREES,
    ),
    (
        "nemotron_h-modelopt_fp8-sm90",
        "nemotron_h",
        "modelopt_fp8",
        90,
        NEMOTRON_KW,
        "flashinfer_cutlass",
        "flashinfer_cutlass",
        Code.NOT_SM100,
    ),
    (
        "qwen3_moe-fp8-eagle",
        "qwen3_moe",
        "modelopt_fp8",
        100,
        {"speculative_algorithm": "EAGLE3", "draft": True},
        "auto",
        "flashinfer_trtllm",
        Code.AUTO_SELECTED,
    ),
]
#: Where an older release's own rules answer differently for the same model and flags:
#: case id -> [(release specifier, upstream alone, with the plugin, plugin decision code)], first match wins.
#: Nemotron-H's "redundant experts -> flashinfer_trtllm_routed" rule (arg_groups/model_overrides/nemotron_h.py) is
#: new in 0.5.23; before it SGLang keeps flashinfer_trtllm, which cannot apply the remap, and the plugin moves it.
RELEASE_DIFFS = {
    "nemotron_h-nvfp4-redundant": [("<0.5.23", "flashinfer_trtllm", "flashinfer_trtllm_routed", Code.AUTO_SELECTED)],
    # the same refusal of auto under FlashInfer A2A, worded by ServerArgs._handle_a2a_moe before the pipeline
    # before 0.5.15 there is no TRT-LLM runner behind FlashInfer A2A (SGLang asserts flashinfer_cutlass): the plugin
    # finds nothing eligible and SGLang refuses the launch as it does alone
    "qwen3_moe-nvfp4-fi_a2a": [
        (
            "<0.5.15",
            "AssertionError: Flashinfer MoE A2A is only supported with flashinfer_cutlass",
            "AssertionError: Flashinfer MoE A2A is only supported with flashinfer_cutlass",
            Code.NO_ELIGIBLE_BACKEND,
        ),
        (
            "<0.5.19",
            "AssertionError: Flashinfer MoE A2A is only supported with flashinfer_cutlass",
            "flashinfer_trtllm_routed",
            Code.AUTO_SELECTED,
        ),
    ],
    # no --weight-cache-mode before 0.5.17 (the case runs without it there)
    "mixtral-bf16-weight-cache": [("<0.5.17", "auto", "flashinfer_trtllm", Code.AUTO_SELECTED)],
    # SGLang's "modelopt_fp4 on SM120 -> flashinfer_cutlass" rule is new in 0.5.13
    "mixtral-nvfp4-sm120-q": [("<0.5.13", "auto", "auto", Code.NO_FUSED_MOE)],
}


#: Where an older release spells the same flags differently: case id -> [(release specifier, ServerArgs kwargs)].
#: Attention-DP size is `attn_dp_size` from 0.5.22; before it, `dp_size` with `enable_dp_attention`.
RELEASE_KWARGS = {
    "mixtral-bf16-weight-cache": [("<0.5.17", {})],
    "qwen3_moe-nvfp4-fi_a2a": [
        ("<0.5.22", {"moe_a2a_backend": "flashinfer", "tp_size": 2, "dp_size": 2, "enable_dp_attention": True})
    ],
}


def _sel_features():
    from sglang_trtllm_moe.compat import features

    return features


def _sel_installed():
    from sglang_trtllm_moe.compat.releases import installed_version

    return installed_version()


def _kwargs(cid, kw):
    from packaging.specifiers import SpecifierSet

    for spec, release_kw in RELEASE_KWARGS.get(cid, []):
        if _release() in SpecifierSet(spec):
            return dict(release_kw)
    return dict(kw)


def _release():
    from packaging.version import Version

    from sglang_trtllm_moe.compat.releases import installed_version

    return Version(installed_version().base_version)


def _expectations(cid, upstream, expected, code):
    """(upstream, expected, code) for the installed release: CASES is 0.5.23's answer, RELEASE_DIFFS the others'."""
    from packaging.specifiers import SpecifierSet

    for spec, *answer in RELEASE_DIFFS.get(cid, []):
        if _release() in SpecifierSet(spec):
            return tuple(answer)
    return upstream, expected, code


#: SGLang's per-runner assert: explicit backend x --quantization (matching checkpoint) -> accepted?
ASSERT_CASES = [(b, q) for b in sel.BACKENDS for q in ("nvfp4", "modelopt_fp8", "fp8_block", "bf16")]
SGLANG_QUANT_NAME = {"nvfp4": "modelopt_fp4", "modelopt_fp8": "modelopt_fp8", "fp8_block": "fp8", "bf16": None}


def _write_model(root, arch: str, quant: str | None):
    d = root / f"{arch}-{quant}"
    if not d.exists():
        d.mkdir(parents=True)
        cfg = dict(BASE, **ARCHS[arch])
        if quant and QUANTS[quant]:
            cfg["quantization_config"] = QUANTS[quant]
        (d / "config.json").write_text(json.dumps(cfg))
    return str(d)


RESOLVE = """
    import json, os
    from sglang.srt.plugins import load_plugins
    load_plugins()
    from sglang.srt.server_args import ServerArgs
    from sglang_trtllm_moe.compat.platform import model_config_of, resolve_server_args
    from sglang_trtllm_moe.compat.fake_platform import fake_platform
    from sglang_trtllm_moe import doctor
    spec = json.loads(os.environ["SEL_SPEC"])
    decisions = None
    try:
        from sglang_trtllm_moe.builtins.selection_hooks import DECISIONS as decisions
    except Exception:
        pass
    out = {"cases": {}, "asserts": {}}
    for cid, path, sm, kw in spec["cases"]:
        n = len(decisions) if decisions is not None else 0
        try:
            with fake_platform(sm):
                sa = ServerArgs(model_path=path, device="cpu", **kw)
                r = resolve_server_args(sa)
                q = model_config_of(sa).quantization
            row = {k: r[k] for k in ("moe_runner_backend", "speculative_moe_runner_backend",
                                     "disable_shared_experts_fusion")}
            row["model_quantization"] = q
        except Exception as e:
            row = {"error": f"{type(e).__name__}: {e}"[:500]}
        row["decisions"] = [{k: d[k] for k in ("what", "code", "winner", "upstream")}
                            for d in (decisions[n:] if decisions is not None else [])]
        out["cases"][cid] = row
    for cid, path, sm, kw in spec["asserts"]:
        try:
            with fake_platform(sm):
                out["asserts"][cid] = resolve_server_args(ServerArgs(model_path=path, device="cpu", **kw))[
                    "moe_runner_backend"]
        except AssertionError as e:
            out["asserts"][cid] = "AssertionError: " + str(e)[:200]
    out["doctor"] = doctor.report(load=False)
    RESULT = out
"""


@functools.cache
def _models() -> tuple[str, str, str]:
    """The config.json-only model directories, written once per session: (SEL_SPEC, the Mixtral FP8-block directory,
    the Mixtral NVFP4 directory)."""
    root = Path(tempfile.mkdtemp(prefix="trtllm-moe-selection-"))
    atexit.register(shutil.rmtree, root, True)
    cases = []
    for cid, arch, quant, sm, kw, *_ in CASES:
        kw = _kwargs(cid, kw)
        if kw.pop("draft", False):
            kw["speculative_draft_model_path"] = _write_model(root, "eagle_draft", None)
        cases.append((cid, _write_model(root, arch, quant), sm, kw))
    asserts = [
        (
            f"{b}|{q}",
            _write_model(root, "mixtral", q),
            100,
            {"moe_runner_backend": b, "quantization": SGLANG_QUANT_NAME[q]},
        )
        for b, q in ASSERT_CASES
    ]
    spec = json.dumps({"cases": cases, "asserts": asserts})
    return spec, _write_model(root, "mixtral", "fp8_block"), _write_model(root, "mixtral", "nvfp4")


#: the same resolutions with the auto switch off: SGLANG_TRTLLM_MOE_AUTO=0 in the process's environment while they
#: run. The plugin reads the switch at each decision (selection/rules.py `auto_enabled()`), never at load time, so a
#: process started with it and the plugin's process with it set before its resolutions decide alike (`explain`
#: sets it the same way to show SGLang's own answer); this saves a process of its own (~10 s on every release)
RESOLVE_AUTO_OFF = (
    """
    import os
    os.environ["SGLANG_TRTLLM_MOE_AUTO"] = "0"
    try:
"""
    + textwrap.indent(textwrap.dedent(RESOLVE), " " * 8)
    + """
    finally:
        del os.environ["SGLANG_TRTLLM_MOE_AUTO"]
"""
)


def _spec_env() -> dict:
    return {"SEL_SPEC": _models()[0]}


#: SGLang's resolution of every case in a fresh process: with the plugin (the session's shared plain process, where
#: it runs right after load_plugins(), before any other section imports more of SGLang), then in the same process
#: with the auto switch off, and with the plugin disabled (the shared SGLang-alone process)
RESOLUTIONS = {
    "plugin": ("plain", probes.section("plain", "selection", RESOLVE, order=10, prepare=_spec_env)),
    "auto_off": ("plain", probes.section("plain", "selection_auto_off", RESOLVE_AUTO_OFF, order=11, prepare=_spec_env)),
    "upstream": ("disabled", probes.section("disabled", "selection", RESOLVE, order=10, prepare=_spec_env)),
}


#: `sglang-trtllm-moe explain --model MIXTRAL --sm 100 --json`: the CLI's own `main()` (argument parsing, the report,
#: its JSON on stdout) in the session's shared plain process, after the resolutions (a process of its own cost ~10 s
#: on every release; `python -m sglang_trtllm_moe explain` as its own process: test_explain_cli_text_rules_only and
#: tests/test_explain_messages.py)
EXPLAIN = probes.section(
    "plain",
    "explain_cli",
    """
    import contextlib, io, os
    from sglang_trtllm_moe import cli
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = cli.main(["explain", "--model", os.environ["SEL_MIXTRAL"], "--sm", "100", "--json"])
    RESULT = {"code": code, "stdout": out.getvalue(), "stderr": err.getvalue()[-3000:]}
    """,
    order=40,
    prepare=lambda: {"SEL_MIXTRAL": _models()[1]},
)


@pytest.fixture(scope="module")
def sglang_runs():
    """Two fresh SGLang processes, asked together: plugin on (in it, the auto switch off, then the explain CLI's
    main()), plugin disabled. Returns {"plugin": ..., "upstream": ..., "auto_off": ..., "explain": ...,
    "model_dir": ...}."""
    _spec, mixtral, quant_mixtral = _models()

    def explain():
        r = probes.result("plain", EXPLAIN)
        assert r["code"] == 0, f"explain: {r['stderr']}"
        return json.loads(r["stdout"])

    jobs = {k: functools.partial(probes.result, env, name) for k, (env, name) in RESOLUTIONS.items()}
    jobs["explain"] = explain
    with ThreadPoolExecutor(max_workers=2) as pool:
        futures = {k: pool.submit(f) for k, f in jobs.items()}
        out = {k: f.result() for k, f in futures.items()}
    out["model_dir"] = mixtral
    out["quant_mixtral_dir"] = quant_mixtral
    return out


# --- SGLang's real resolution -------------------------------------------------------------------------------------


def test_the_hook_lands_in_sglang(sglang_runs):
    from sglang_trtllm_moe.compat.platform import adapter

    ours = [t for t in sglang_runs["plugin"]["doctor"]["targets"] if t["target"] == adapter().hook_target]
    assert len(ours) == 1 and ours[0]["state"] == "landed", ours
    assert ours[0]["hook_type"] == "before" and ours[0]["capability"] == "auto-select"
    assert sglang_runs["upstream"]["doctor"]["targets"] == []  # disabled: nothing registered, upstream alone


@pytest.mark.parametrize("cid,arch,quant,sm,kw,upstream,expected,code", CASES, ids=[c[0] for c in CASES])
def test_sglang_resolution_with_and_without_plugin(sglang_runs, cid, arch, quant, sm, kw, upstream, expected, code):
    plug, up, off = (sglang_runs[k]["cases"][cid] for k in ("plugin", "upstream", "auto_off"))
    upstream, expected, code = _expectations(cid, upstream, expected, code)
    for row, want in ((up, upstream), (off, upstream), (plug, expected)):
        # SGLang alone, with the switch off, with the plugin: an answer, or SGLang's own refusal
        if want.startswith("AssertionError"):
            assert row["error"].startswith(want), row
        else:
            assert "error" not in row and row["moe_runner_backend"] == want, row
    # exactly one decision for the target (plus one for a speculative draft), with the expected reason code
    target = [d for d in plug["decisions"] if d["what"] == "target"]
    assert len(target) == 1 and target[0]["code"] == code, plug["decisions"]
    if code in (Code.AUTO_SELECTED, Code.UPSTREAM_AGREES, Code.EXPLICIT):
        assert target[0]["winner"] == expected
    else:  # kept: whatever SGLang had at that step (its quantization rules may still decide later, e.g. SM120)
        assert target[0]["winner"] == target[0]["upstream"]
    # the switch: SGLANG_TRTLLM_MOE_AUTO=0 gives SGLang's own answer (checked above), and says so
    assert [d["code"] for d in off["decisions"] if d["what"] == "target"] == [
        code if code in (Code.EXPLICIT, Code.NO_FUSED_MOE) else Code.AUTO_DISABLED
    ]
    if expected.startswith("flashinfer_trtllm"):
        # SGLang's own step ran on our choice: its shared-expert-fusion disable for trtllm runners fired
        assert plug["disable_shared_experts_fusion"] is True


def test_speculative_draft_keeps_what_upstream_would_give_it(sglang_runs):
    plug = sglang_runs["plugin"]["cases"]["qwen3_moe-fp8-eagle"]
    up = sglang_runs["upstream"]["cases"]["qwen3_moe-fp8-eagle"]
    draft = [d for d in plug["decisions"] if d["what"] == "draft"]
    assert len(draft) == 1 and draft[0]["code"] == Code.SPEC_DRAFT_KEEPS_UPSTREAM
    # upstream's default gives the draft the target's runner (auto); moving the target must not move the draft
    assert up["speculative_moe_runner_backend"] == "auto"
    assert plug["speculative_moe_runner_backend"] == "auto"
    assert plug["moe_runner_backend"] == "flashinfer_trtllm"


def test_config_reader_names_quantization_like_sglang(sglang_runs):
    """detect_quantization vs SGLang's ModelConfig on the very same config.json files."""
    for cid, _arch, quant, *_ in CASES:
        row = sglang_runs["plugin"]["cases"][cid]
        if "error" in row:  # SGLang refused the launch (checked above); the same config.json is read by other cases
            continue
        ours, block, scheme = sel.detect_quantization(QUANTS[quant])
        assert ours == row["model_quantization"], (cid, ours, row)
        if quant == "fp8_block":
            assert block == (128, 128)
        if quant == "ct_nvfp4":
            assert scheme == "nvfp4"


def test_backend_quantization_table_matches_sglang_asserts(sglang_runs):
    got = sglang_runs["upstream"]["asserts"]
    for b, q in ASSERT_CASES:
        accepted = not got[f"{b}|{q}"].startswith("AssertionError")
        served = any(SGLANG_QUANT_NAME[q] in f.quantizations.get(b, ()) for f in FORMATS)
        assert accepted == served, (b, q, got[f"{b}|{q}"])
        if accepted:
            assert got[f"{b}|{q}"] == b  # an explicit backend survives resolution untouched


def test_explain_cli_json(sglang_runs):
    r = sglang_runs["explain"]
    assert r["winner"] == "flashinfer_trtllm" and r["code"] == Code.AUTO_SELECTED
    assert {c["backend"] for c in r["candidates"]} == set(sel.BACKENDS)
    for c in r["candidates"]:
        assert set(c) >= {"backend", "eligible", "reason", "code"} and c["eligible"] is True
    assert r["sglang"]["upstream_alone"] == "auto" and r["sglang"]["with_plugin"] == "flashinfer_trtllm"
    assert r["upstream"] == "auto" and r["changed"] is True
    fp = r["fingerprint"]
    assert fp["sm"] == 100 and fp["sglang"] == str(_release()) and fp["flashinfer"] and len(fp["id"]) == 12
    assert r["problem"]["architecture"] == "MixtralForCausalLM" and r["problem"]["quantization"] == "fp8"
    assert r["problem"]["weight_block_size"] == [128, 128] and r["problem"]["no_fused_moe"] is None


def test_explain_says_when_sglang_builds_no_fused_moe(sglang_runs):
    """Mixtral NVFP4 is built as QuantMixtralForCausalLM: explain names no winner and no candidate (the whole-model
    check that SGLang really builds it so is tests/test_models.py)."""
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "sglang_trtllm_moe",
            "explain",
            "--model",
            sglang_runs["quant_mixtral_dir"],
            "--sm",
            "100",
            "--no-sglang",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "no FusedMoE layer  [NO_FUSED_MOE]" in proc.stdout and "QuantMixtralForCausalLM" in proc.stdout
    assert "winner:" not in proc.stdout and "candidates:" in proc.stdout and "eligible" not in proc.stdout
    for quant, fused in (
        ("nvfp4", False),
        ("modelopt_fp8", False),
        ("fp8_block", True),
        ("ct_nvfp4", True),
        ("bf16", True),
    ):
        cfg = dict(BASE, **ARCHS["mixtral"])
        if QUANTS[quant]:
            cfg["quantization_config"] = QUANTS[quant]
        p = sel.problem_from_hf_config(cfg)
        assert (p.no_fused_moe is None) == fused, quant
        r = resolve(p, SM100, upstream="auto")
        assert (r.code == Code.NO_FUSED_MOE) == (not fused) and (fused or (r.winner == "auto" and not r.candidates))
    # the rule is SGLang's model class choice, not the checkpoint: --quantization decides as it does in SGLang
    cfg = dict(BASE, **ARCHS["mixtral"])
    assert sel.problem_from_hf_config(cfg, quantization="modelopt_fp4").no_fused_moe
    assert sel.problem_from_hf_config(dict(BASE, **ARCHS["qwen3_moe"], quantization_config=NVFP4)).no_fused_moe is None


def test_explain_cli_text_rules_only(sglang_runs):
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "sglang_trtllm_moe",
            "explain",
            "--model",
            sglang_runs["model_dir"],
            "--sm",
            "120",
            "--tp",
            "2",
            "--no-sglang",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "winner: auto  [NOT_SM100]" in proc.stdout
    assert proc.stdout.count("rejected SM_UNSUPPORTED") == 2 and "SM12x" in proc.stdout
    assert "environment:" in proc.stdout and "tp 2" in proc.stdout


# --- rules checked against SGLang's and flashinfer's code ----------------------------------------------------------


def test_activation_table_matches_sglang_and_flashinfer():
    """What each format accepts on this release is what SGLang's runners and its flashinfer enum mapping take.

    From 0.5.13 (get_activation_type(activation, is_gated)) every accepted activation must be in SGLang's runner
    set and map to a flashinfer ActivationType. 0.5.11-0.5.12 name silu (gated) and relu2 (non-gated) only and have
    no BF16 set: there the plugin's runner (its leaf hooks) serves what it prepares with its own flashinfer
    activation ints, and SGLang's sets bind the formats SGLang prepares itself (compat/defer.py)."""
    import inspect

    import sglang.srt.layers.quantization.fp8  # noqa: F401  (<= 0.5.15: flashinfer_trtllm is circular imported alone)
    from sglang.srt.layers.moe.moe_runner import flashinfer_trtllm as fit

    from sglang_trtllm_moe.compat import defer

    src = inspect.getsource(fit)
    runner_sets = {}
    for name in ("FP4", "FP8", "BF16"):
        m = re.search(rf"_SUPPORTED_{name}_ACTIVATIONS = \{{([^}}]*)\}}", src)
        runner_sets[name] = set(re.findall(r'"(\w+)"', m.group(1))) if m else None
    takes_gated = "is_gated" in inspect.signature(fit.get_activation_type).parameters
    per_kernel = {"fp4_block_scale": "FP4", "fp8_per_tensor_scale": "FP8", "fp8_block_scale": "FP8", "bf16": "BF16"}
    for fmt in FORMATS:
        accepted = [
            (a, g)
            for g, acts in ((True, fmt.gated_activations), (False, fmt.non_gated_activations))
            for a in sorted(acts)
            if not fmt.activation_problem(a, g)
        ]
        if fmt.kernel == "mxint4_block_scale":  # SGLang's INT4 scheme calls its kernel itself, gated SwiGLU only
            from sglang.srt.layers.quantization.compressed_tensors.schemes import (
                compressed_tensors_w4a4_mxint4_moe as mxint4,
            )

            assert "Only gated MoEs are supported" in inspect.getsource(mxint4), fmt.name
            assert accepted == [("silu", True)], (fmt.name, accepted)
            continue
        runner = runner_sets[per_kernel[fmt.kernel]]
        if takes_gated or defer.upstream_prepares(fmt):
            assert runner is not None and {a for a, _ in accepted} <= runner, (fmt.name, accepted, runner)
        for act, gated in accepted:
            if takes_gated:
                fit.get_activation_type(act, is_gated=gated)
            elif (act, gated) in (("silu", True), ("relu2", False)):  # 0.5.11-0.5.12's whole table
                fit.get_activation_type(act)
    if takes_gated:
        with pytest.raises(ValueError):
            fit.get_activation_type("relu2", is_gated=True)  # why gated relu2 is never eligible


def test_a2a_table_matches_sglang_fused_op_pool():
    from sglang.srt.layers.moe.moe_runner import flashinfer_trtllm  # noqa: F401 - registers the fused funcs
    from sglang.srt.layers.moe.moe_runner.base import FusedOpPool
    from sglang.srt.layers.moe.utils import MoeA2ABackend

    ok = set(sel.A2A_OK) if _FI_A2A else set(sel.A2A_OK) - {"flashinfer"}  # 'flashinfer' from 0.5.15
    for a2a in MoeA2ABackend:
        p = MoeProblem(256, 512, 8, quantization="modelopt_fp4", a2a_backend=a2a.value, tp_size=2, ep_size=2)
        for b in sel.BACKENDS:
            has = (a2a.value, b) in FusedOpPool._fused_funcs
            if b == sel.TRTLLM_ROUTED or a2a.value != "flashinfer":
                assert has == (a2a.value in ok), (a2a.value, b)
            elif (
                _FI_A2A
            ):  # ('flashinfer', 'flashinfer_trtllm') is registered from 0.5.19 only; the plugin never picks it
                assert can_implement(b, p, SM100).code == Code.A2A_NEEDS_ROUTED
            if can_implement(b, p, SM100).eligible:
                assert has, (a2a.value, b)  # whatever the plugin may pick, SGLang can run
        if a2a.value not in ok:
            assert can_implement(sel.TRTLLM_ROUTED, p, SM100).code == Code.A2A_UNSUPPORTED


def _a2a_choices() -> list[str]:
    """`--moe-a2a-backend`'s choices, as the installed SGLang's own argument parser offers them."""
    import argparse

    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    (action,) = [a for a in parser._actions if "--moe-a2a-backend" in a.option_strings]
    return list(action.choices)


def test_every_a2a_choice_of_the_release_gets_a_specific_answer():
    """Every `--moe-a2a-backend` the installed SGLang offers is answered by name: eligible only for none / flashinfer
    (flashinfer on the routed runner, from 0.5.15), every other one A2A_UNSUPPORTED with its own reason
    (`A2A_REJECTIONS`) and what to use instead. A backend a future release adds fails here until it has a line."""
    choices = _a2a_choices()
    assert "none" in choices and "deepep" in choices, choices
    missing = [c for c in choices if c not in sel.A2A_OK and c not in sel.A2A_REJECTIONS]
    assert not missing, f"A2A backends of this SGLang release without a reason in selection.A2A_REJECTIONS: {missing}"
    for a2a in choices:
        p = MoeProblem(256, 512, 8, quantization="modelopt_fp4", a2a_backend=a2a, tp_size=2, ep_size=2)
        answers = {b: can_implement(b, p, SM100) for b in sel.BACKENDS}
        if a2a == "none":
            assert all(e.code == Code.OK for e in answers.values()), answers
        elif a2a == "flashinfer" and _FI_A2A:
            assert answers[sel.TRTLLM_ROUTED].code == Code.OK, answers
            assert answers[sel.TRTLLM].code == Code.A2A_NEEDS_ROUTED, answers
        else:
            for e in answers.values():
                assert not e.eligible and e.code == Code.A2A_UNSUPPORTED, (a2a, e)
                assert f"--moe-a2a-backend {a2a}" in e.reason and "--moe-a2a-backend none" in e.reason, e.reason
                if a2a != "flashinfer":
                    assert sel.A2A_REJECTIONS[a2a] in e.reason, e.reason
    # a name this plugin release does not know is still refused, saying so
    unknown = can_implement(
        sel.TRTLLM_ROUTED, MoeProblem(256, 512, 8, quantization="modelopt_fp4", a2a_backend="next_a2a"), SM100
    )
    assert unknown.code == Code.A2A_UNSUPPORTED and "does not know" in unknown.reason, unknown


# --- the rules themselves -----------------------------------------------------------------------------------------

P = MoeProblem(hidden_size=256, intermediate_size=512, num_experts=8, top_k=2, quantization="modelopt_fp4")
#: FlashInfer A2A has a TRT-LLM (routed) runner on the installed release (features.FLASHINFER_A2A_TRTLLM_ROUTED)
_FI_A2A = _sel_features().FLASHINFER_A2A_TRTLLM_ROUTED.present() or _sel_installed() is None
#: ModelOpt NVFP4 gelu runs on the installed release (features.MODELOPT_NVFP4_GELU)
_NVFP4_GELU = _sel_features().MODELOPT_NVFP4_GELU.present() or _sel_installed() is None
RULES = [
    # (problem changes, device, backend, expected code)
    ({}, SM100, sel.TRTLLM, Code.OK),
    ({}, replace(SM100, sm=103), sel.TRTLLM, Code.OK),
    ({}, replace(SM100, sm=120), sel.TRTLLM, Code.SM_UNSUPPORTED),
    ({}, replace(SM100, sm=90), sel.TRTLLM_ROUTED, Code.SM_UNSUPPORTED),
    ({}, replace(SM100, sm=None), sel.TRTLLM, Code.SM_UNSUPPORTED),
    ({}, replace(SM100, flashinfer_version=None), sel.TRTLLM, Code.FLASHINFER_MISSING),
    (
        {"gated": False, "activation": "relu2"},
        replace(SM100, flashinfer_version="0.6.1"),
        sel.TRTLLM,
        Code.FLASHINFER_TOO_OLD,
    ),
    ({}, SM100, "triton", Code.UNKNOWN_BACKEND),
    ({"speculative_draft": True}, SM100, sel.TRTLLM, Code.SPEC_DRAFT_KEEPS_UPSTREAM),
    ({"quantization": "fp8"}, SM100, sel.TRTLLM, Code.QUANT_UNSUPPORTED),
    ({"quantization": "fp8", "weight_block_size": (1, 32)}, SM100, sel.TRTLLM, Code.QUANT_UNSUPPORTED),
    ({"quantization": "fp8", "weight_block_size": (128, 128)}, SM100, sel.TRTLLM_ROUTED, Code.OK),
    ({"quantization": "modelopt_fp8"}, SM100, sel.TRTLLM, Code.OK),
    ({"quantization": "modelopt_fp8"}, SM100, sel.TRTLLM_ROUTED, Code.QUANT_UNSUPPORTED_BY_BACKEND),
    ({"quantization": "compressed-tensors", "quant_scheme": "nvfp4"}, SM100, sel.TRTLLM, Code.OK),
    (
        {"quantization": "compressed-tensors", "quant_scheme": "nvfp4"},
        SM100,
        sel.TRTLLM_ROUTED,
        Code.QUANT_UNSUPPORTED_BY_BACKEND,
    ),
    ({"quantization": "compressed-tensors", "quant_scheme": "int4"}, SM100, sel.TRTLLM, Code.QUANT_UNSUPPORTED),
    # Kimi-K2's INT4 W4A16 group 32 (SGLang's CompressedTensorsMxInt4MoE: flashinfer_trtllm only)
    (
        {"quantization": "compressed-tensors", "quant_scheme": "mxint4", "intermediate_size": 2048},
        SM100,
        sel.TRTLLM,
        Code.OK,
    ),
    (
        {"quantization": "compressed-tensors", "quant_scheme": "mxint4", "intermediate_size": 2048},
        SM100,
        sel.TRTLLM_ROUTED,
        Code.QUANT_UNSUPPORTED_BY_BACKEND,
    ),
    ({"quantization": "awq"}, SM100, sel.TRTLLM, Code.QUANT_UNSUPPORTED),
    ({"quantization": None}, SM100, sel.TRTLLM, Code.OK),
    ({"activation": "gelu"}, SM100, sel.TRTLLM, Code.OK if _NVFP4_GELU else Code.ACTIVATION_UNSUPPORTED),
    ({"activation": "gelu", "quantization": None}, SM100, sel.TRTLLM, Code.ACTIVATION_UNSUPPORTED),
    ({"activation": "relu2"}, SM100, sel.TRTLLM, Code.ACTIVATION_UNSUPPORTED),  # gated relu2
    ({"activation": "relu2", "gated": False, "quantization": "modelopt_fp8"}, SM100, sel.TRTLLM, Code.OK),
    (
        {"activation": "gelu", "gated": False, "quantization": "modelopt_fp8"},
        SM100,
        sel.TRTLLM,
        Code.ACTIVATION_UNSUPPORTED,
    ),
    ({"hidden_size": 2688}, SM100, sel.TRTLLM, Code.OK),  # Nemotron-H 2688 = 21 * 128
    ({"hidden_size": 200}, SM100, sel.TRTLLM, Code.HIDDEN_ALIGNMENT),
    ({"intermediate_size": 500, "tp_size": 8}, SM100, sel.TRTLLM, Code.INTERMEDIATE_SPLIT),
    ({"intermediate_size": 704, "tp_size": 8}, SM100, sel.TRTLLM, Code.OK),  # 88 per rank, padded
    ({"intermediate_size": 704, "tp_size": 8, "ep_size": 8}, SM100, sel.TRTLLM, Code.OK),  # EP: no split
    (
        {"quantization": "fp8", "weight_block_size": (128, 128), "intermediate_size": 1536, "tp_size": 8},
        SM100,
        sel.TRTLLM,
        Code.BLOCK_ALIGNMENT,
    ),  # 192 per rank cuts a 128x128 scale block
    ({"num_experts": 10, "tp_size": 4, "ep_size": 4}, SM100, sel.TRTLLM, Code.EXPERT_SPLIT),
    ({"a2a_backend": "deepep", "tp_size": 2, "ep_size": 2}, SM100, sel.TRTLLM, Code.A2A_UNSUPPORTED),
    ({"a2a_backend": "mooncake", "tp_size": 2, "ep_size": 2}, SM100, sel.TRTLLM_ROUTED, Code.A2A_UNSUPPORTED),
    (
        {"a2a_backend": "flashinfer", "tp_size": 2, "ep_size": 2},
        SM100,
        sel.TRTLLM,
        Code.A2A_NEEDS_ROUTED if _FI_A2A else Code.A2A_UNSUPPORTED,
    ),
    (
        {"a2a_backend": "flashinfer", "tp_size": 2, "ep_size": 2},
        SM100,
        sel.TRTLLM_ROUTED,
        Code.OK if _FI_A2A else Code.A2A_UNSUPPORTED,
    ),
    ({"enable_eplb": True}, SM100, sel.TRTLLM, Code.EXPERT_REMAP_NEEDS_ROUTED),
    ({"num_redundant_experts": 8}, SM100, sel.TRTLLM, Code.EXPERT_REMAP_NEEDS_ROUTED),
    ({"init_expert_location": "/x.json"}, SM100, sel.TRTLLM, Code.EXPERT_REMAP_NEEDS_ROUTED),
    ({"enable_eplb": True}, SM100, sel.TRTLLM_ROUTED, Code.OK),
]


@pytest.mark.parametrize("changes,device,backend,code", RULES, ids=[f"{i}-{r[3]}" for i, r in enumerate(RULES)])
def test_can_implement_rules(changes, device, backend, code):
    e = can_implement(backend, replace(P, **changes), device)
    assert (e.code, e.eligible, e.backend) == (code, code == Code.OK, backend)
    assert e.reason and isinstance(e.reason, str)


@pytest.mark.parametrize(
    "quant,scheme,gated,inter,tp,padded",
    [
        ("modelopt_fp4", None, True, 704, 8, 128),  # 88 -> 128: 2*Ip % 128 for the NVFP4 scale rows (flashinfer#3206)
        ("compressed-tensors", "nvfp4", True, 960, 8, 128),  # 120 -> 128
        ("modelopt_fp8", None, True, 704, 8, 128),  # 88 -> 128: SGLang's FusedMoE allocates non-NVFP4 padded to 128
        ("modelopt_fp8", None, False, 704, 8, 128),  # non-gated: 128
        (None, None, True, 704, 8, 128),  # BF16 gated: 128 likewise (the kernel alone needs 64)
        ("modelopt_fp4", None, True, 512, 4, None),  # 128: aligned already, no padding
    ],
)
def test_padding_is_reported(quant, scheme, gated, inter, tp, padded):
    p = replace(
        P,
        quantization=quant,
        quant_scheme=scheme,
        gated=gated,
        activation="silu" if gated else "relu2",
        intermediate_size=inter,
        tp_size=tp,
    )
    e = can_implement(sel.TRTLLM, p, SM100)
    assert e.eligible, e
    assert (f"padded to {padded}" in e.reason) if padded else ("padded" not in e.reason)
    assert f"I/rank {inter // tp}" in e.reason


def test_resolve_policy(monkeypatch):
    monkeypatch.delenv(sel.ENV_AUTO, raising=False)
    assert resolve(P, SM100).winner == sel.TRTLLM and resolve(P, SM100).code == Code.AUTO_SELECTED
    r = resolve(P, SM100, requested="flashinfer_cutlass", upstream="flashinfer_cutlass")
    assert (r.winner, r.code) == ("flashinfer_cutlass", Code.EXPLICIT)
    r = resolve(P, SM100, upstream="marlin")
    assert (r.winner, r.code) == ("marlin", Code.UPSTREAM_MODEL_RULE)
    r = resolve(P, SM100, upstream=sel.TRTLLM)
    assert (r.winner, r.code, r.changed) == (sel.TRTLLM, Code.UPSTREAM_AGREES, False)
    r = resolve(replace(P, enable_eplb=True), SM100, upstream=sel.TRTLLM)
    assert (r.winner, r.code, r.changed) == (sel.TRTLLM_ROUTED, Code.AUTO_SELECTED, True)
    assert [c.backend for c in r.candidates] == [sel.TRTLLM_ROUTED, sel.TRTLLM]
    r = resolve(P, replace(SM100, flashinfer_version=None), upstream="auto")
    assert (r.winner, r.code) == ("auto", Code.NO_ELIGIBLE_BACKEND) and "FLASHINFER_MISSING" in r.reason
    r = resolve(replace(P, speculative_draft=True), SM100, upstream="auto")
    assert (r.winner, r.code) == ("auto", Code.SPEC_DRAFT_KEEPS_UPSTREAM) and "sglang#30209" in r.reason
    r = resolve(P, replace(SM100, sm=120), upstream="flashinfer_cutlass")
    assert (r.winner, r.code) == ("flashinfer_cutlass", Code.NOT_SM100)
    for mode in ("client", "daemon"):  # weights from SGLang's weight-cache daemon: SGLang's choice stands
        r = resolve(replace(P, weight_cache_mode=mode), SM100, upstream="auto")
        assert (r.winner, r.code) == ("auto", Code.WEIGHT_CACHE_KEEPS_UPSTREAM), r
        assert f"--weight-cache-mode {mode}" in r.reason and "process_weights_after_loading" in r.reason
    r = resolve(replace(P, weight_cache_mode="client"), SM100, requested=sel.TRTLLM, upstream=sel.TRTLLM)
    assert (r.winner, r.code) == (sel.TRTLLM, Code.EXPLICIT)  # an explicit choice is the user's
    monkeypatch.setenv(sel.ENV_AUTO, "0")
    r = resolve(P, SM100, upstream="auto")
    assert (r.winner, r.code) == ("auto", Code.AUTO_DISABLED)
    assert r.fingerprint["env"] == {sel.ENV_AUTO: "0"}


def test_one_log_line_per_decision(caplog):
    caplog.set_level("INFO", logger="sglang_trtllm_moe")
    res = resolve(replace(P, enable_eplb=True), SM100, upstream=sel.TRTLLM)
    sel.log_decision(res, P)
    lines = [r for r in caplog.records if r.name == "sglang_trtllm_moe"]
    assert len(lines) == 1
    msg = lines[0].getMessage()
    assert "moe_runner_backend=flashinfer_trtllm_routed" in msg and "EXPERT_REMAP_NEEDS_ROUTED" in msg
    assert res.fingerprint["id"] in msg


def test_problem_from_config_reads_sizes_and_gating():
    nh = sel.problem_from_hf_config(dict(BASE, **ARCHS["nemotron_h"], quantization_config=NVFP4), tp_size=2)
    assert (nh.gated, nh.activation, nh.intermediate_size, nh.num_experts, nh.quantization) == (
        False,
        "relu2",
        512,
        8,
        "modelopt_fp4",
    )
    ds = sel.problem_from_hf_config(dict(BASE, **ARCHS["deepseek_v3"], quantization_config=FP8_BLOCK))
    assert (ds.gated, ds.intermediate_size, ds.weight_block_size, ds.top_k) == (True, 256, (128, 128), 2)
    mx = sel.problem_from_hf_config(dict(BASE, **ARCHS["mixtral"]), quantization="modelopt_fp8")
    assert (mx.intermediate_size, mx.num_experts, mx.quantization) == (512, 8, "modelopt_fp8")
    assert sel.problem_from_hf_config(dict(BASE, architectures=["LlamaForCausalLM"], intermediate_size=512)) is None


CHECKPOINTS = st.sampled_from(
    [
        ("modelopt_fp4", None, None),
        ("modelopt_fp8", None, None),
        ("fp8", (128, 128), None),
        ("fp8", None, None),
        ("compressed-tensors", None, "nvfp4"),
        (None, None, None),
        ("compressed-tensors", None, "int4"),
        ("compressed-tensors", None, "mxint4"),
        ("awq", None, None),
    ]
)


@st.composite
def problems(draw):
    quant, block, scheme = draw(CHECKPOINTS)
    gated = draw(st.booleans())
    tp = draw(st.sampled_from([1, 2, 4, 8]))
    return MoeProblem(
        hidden_size=draw(st.sampled_from([256, 2688, 7168, 200, 4000])),
        intermediate_size=draw(st.sampled_from([120, 512, 704, 1536, 2048, 1000])),
        num_experts=draw(st.sampled_from([8, 64, 10, 256])),
        top_k=2,
        quantization=quant,
        weight_block_size=block,
        quant_scheme=scheme,
        activation=draw(st.sampled_from(["silu", "gelu", "relu2", "situ"])),
        gated=gated,
        tp_size=tp,
        ep_size=draw(st.sampled_from([1, tp])),
        a2a_backend=draw(st.sampled_from(["none", "none", "flashinfer", "deepep", "mooncake"])),
        enable_eplb=draw(st.booleans()),
        num_redundant_experts=draw(st.sampled_from([0, 0, 4])),
        speculative_draft=draw(st.booleans()),
    )


devices = st.builds(
    DeviceInfo,
    sm=st.sampled_from([100, 103, 110, 120, 90, 80, None]),
    flashinfer_version=st.sampled_from(["0.7.2.post1", "0.6.1", None]),
    source=st.just("h"),
)


@settings(max_examples=50, deadline=None)
@given(
    problems(),
    devices,
    st.sampled_from(["auto", "auto", "triton", sel.TRTLLM]),
    st.sampled_from(["auto", sel.TRTLLM, sel.TRTLLM_ROUTED, "marlin", "flashinfer_cutlass"]),
)
def test_resolution_invariants(problem, device, requested, upstream):
    res = resolve(problem, device, requested=requested, upstream=upstream)
    eligible = {c.backend for c in res.candidates if c.eligible}
    assert {c.backend for c in res.candidates} == set(sel.BACKENDS)
    if requested != "auto":
        assert res.winner == requested and res.code == Code.EXPLICIT
    elif res.winner != upstream:
        # the plugin only ever moves an auto choice on SM 10.x to an eligible TRT-LLM runner
        assert res.code == Code.AUTO_SELECTED and res.winner in eligible and device.sm100_family
        assert upstream in ("auto", *sel.BACKENDS) and not problem.speculative_draft
    if eligible:
        fmt, _ = problem.weight_format()
        assert device.sm100_family and device.flashinfer_version and fmt is not None
        assert problem.hidden_size % 128 == 0 and problem.a2a_backend in ("none", "flashinfer")
        assert not problem.speculative_draft and not (problem.gated and problem.activation == "relu2")
    if problem.expert_remap or problem.a2a_backend == "flashinfer":
        assert sel.TRTLLM not in eligible
    d = json.loads(json.dumps(res.to_dict()))
    assert set(d) >= {"winner", "code", "reason", "candidates", "fingerprint"}
    assert all(set(c) >= {"backend", "eligible", "reason", "code"} for c in d["candidates"])
