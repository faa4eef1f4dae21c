"""The installed SGLang release, as the compat matrix sees it: the plugin loads through SGLang's own
`load_plugins()`, every hook target it registers lands, every target it leaves out is really absent from this
release (or superseded, with the reason written down), and the CPU runtime stands SGLang up the way a scheduler
would. Runs unchanged on every release 0.5.11 ... 0.5.23 (ci/matrix)."""

from __future__ import annotations

import json

from sglang_trtllm_moe.compat.releases import installed_version

from .support import probes
from .support.helpers import REPO

#: not-applicable targets whose dotted path still resolves on the releases they are left out of, and why
SUPERSEDED = {
    # From 0.5.16 ModelRunner keeps thin delegates; the work (and our hooks) moved to WeightUpdater.
    "sglang.srt.model_executor.model_runner.ModelRunner.update_weights_from_tensor": (
        "0.5.16+: delegates to WeightUpdater.update_weights_from_tensor, which is hooked"
    ),
    "sglang.srt.model_executor.model_runner.ModelRunner.update_weights_from_distributed": (
        "0.5.16+: delegates to WeightUpdater, which is hooked"
    ),
    "sglang.srt.model_executor.model_runner.ModelRunner.update_weights_from_disk": (
        "0.5.16+: delegates to WeightUpdater.update_weights_from_disk, which is hooked"
    ),
    # Before 0.5.16 a global auto is either kept (< 0.5.13) or resolved with apply falling back to sgl-kernel's
    # cutlass_moe_fp4 for a CUTLASS-laid-out layer (0.5.13-0.5.15): no runner/layout mismatch to repair there.
    # The scheduler's update manager exists from 0.5.13; from 0.5.21 it fans requests out to the runners its
    # `selector` names (disk / IPC: every runner). Before, the spec worker's own methods reach the draft (disk / IPC
    # target then draft, tensor draft then target; each runner's WeightUpdater hooks check its own load) and the
    # distributed request reaches the target alone (builtins/draft_updates.py says so: its own target, landed).
    **{
        f"sglang.srt.managers.scheduler_components.weight_updater.SchedulerWeightUpdaterManager.{m}": (
            "< 0.5.21: no runner selector (features.UPDATE_RUNNER_SELECTOR); the WeightUpdater hooks check each load"
        )
        for m in (
            "update_weights_from_disk",
            "update_weights_from_tensor",
            "update_weights_from_distributed",
            "update_weights_from_ipc",
        )
    },
    "sglang.srt.layers.quantization.modelopt_quant.ModelOptNvFp4FusedMoEMethod.create_moe_runner": (
        "< 0.5.16: no runner/layout mismatch on a global auto (features.NVFP4_AUTO_RUNNER_MISMATCH)"
    ),
}

#: capabilities that must be complete on every release 0.5.11+ (plugin loads, NVFP4 prep, RL updates, runner);
#: format-specific targets of other quant methods (BF16 / compressed-tensors restore hooks) belong to those formats
ESSENTIAL = {"core", "nvfp4-prep", "rl-update", "runner"}
OTHER_FORMATS = ("fp8", "Fp8", "bf16", "unquant", "compressed_tensors")


def _report():
    """doctor's report of a fresh process that ran SGLang's load_plugins() (the session's shared one: probes.DOCTOR)."""
    return probes.result("plain", "doctor")


def test_plugin_loads_through_sglang_and_every_target_lands_or_is_absent_upstream():
    r = _report()
    assert r["status"] == "enabled", r.get("reason")
    assert r["release_status"] == "tested" and r["sglang_version"] == str(installed_version())
    by_state: dict[str, list] = {}
    for t in r["targets"]:
        by_state.setdefault(t["state"], []).append(t)
    assert not by_state.get("missing"), [(t["target"], t["reason"]) for t in by_state["missing"]]
    assert by_state.get("landed"), "no target landed"
    for t in by_state["landed"]:
        assert t["resolves"], t["target"]
    # Left out although the path exists here: either superseded (reason above), or a capability the plugin does not
    # provide on this release yet (the matrix reports it per capability). The first-priority capabilities must be
    # complete on every release: nothing of theirs may be left out where SGLang has it.
    gaps = [t for t in by_state.get("not_applicable", []) if t["resolves"] and t["target"] not in SUPERSEDED]
    essential = [
        (t["target"], t["capability"])
        for t in gaps
        if t["capability"] in ESSENTIAL and not any(f in t["target"] for f in OTHER_FORMATS)
    ]
    assert essential == [], f"left out on sglang {installed_version()} although present there: {essential}"


def test_every_capability_has_a_landed_target_where_the_plugin_claims_it():
    from packaging.version import Version

    from tests.support.matrix import plugin_capabilities

    release = Version(installed_version().base_version)
    claimed = plugin_capabilities(release)
    landed = {t["capability"] for t in _report()["targets"] if t["state"] == "landed"}
    assert ESSENTIAL <= claimed
    assert claimed == landed, (sorted(claimed), sorted(landed))


RUNTIME = probes.section(
    "plain",
    "runtime",
    """
    import torch
    from sglang.srt.plugins import load_plugins
    load_plugins()
    from sglang_trtllm_moe.sandbox.runtime import init_single_process
    from sglang_trtllm_moe import layer_state
    from sglang_trtllm_moe.sandbox import layers as cpu_layers
    init_single_process("flashinfer_trtllm")
    from sglang.srt.layers.moe.utils import get_moe_runner_backend
    from sglang.srt.distributed import parallel_state
    spec = cpu_layers.MoeSpec(num_experts=4, hidden=128, intermediate=64)
    layer = cpu_layers.build_layer(spec)
    calls = cpu_layers.load_checkpoint(layer, cpu_layers.random_nvfp4_checkpoint(spec), spec.num_experts)
    layer.quant_method.process_weights_after_loading(layer)
    st = layer_state.state_of(layer)
    RESULT = {
        "backend": get_moe_runner_backend().value,
        "world": torch.distributed.get_world_size(),
        "tp": parallel_state.get_tensor_model_parallel_world_size(),
        "trtllm_method": bool(getattr(layer.quant_method, "enable_flashinfer_trtllm_moe", False)),
        "calls": calls, "prepared": bool(st is not None and st.clean),
        "w13": list(layer.w13_weight.shape), "device": str(layer.w13_weight.device),
        "inter": layer.intermediate_size_per_partition,
    }
""",
    # it publishes SGLang's ServerArgs and the parallel runtime of its process: after doctor's imports of the hooked
    # modules (hooks landing lazily, as its modules are imported, is what every in-process layer test relies on)
    order=probes.LAST,
)


def test_single_process_runtime_builds_and_prepares_a_real_nvfp4_layer():
    """SGLang's own getters say what a scheduler process would: world of one, flashinfer_trtllm chosen, and the
    NVFP4 quant method (which refuses non-Blackwell platforms) took the TRT-LLM path."""
    r = probes.result("plain", RUNTIME)  # its process's own rendezvous port: probes.ENVS
    assert r["backend"] == "flashinfer_trtllm"
    assert r["world"] == 1 and r["tp"] == 1
    assert r["trtllm_method"] is True
    assert r["calls"] == 4 * 3 * 4  # experts x projections x (weight, scale, scale_2, input_scale)
    assert r["prepared"] is True and r["device"] == "cpu"
    # SGLang decides the (padded) intermediate: <= 0.5.22 FusedMoE rounds it up to 128 for flashinfer_trtllm,
    # 0.5.23 aligns NVFP4 in create_weights. Prepared in place, w13 keeps both halves at SGLang's size.
    assert r["inter"] >= 64 and r["inter"] % 16 == 0
    assert r["w13"] == [4, 2 * r["inter"], 128 // 2]


def test_matrix_skip_reasons_name_the_release():
    """A test that does not apply says which release and why (the contract ci/matrix relies on)."""
    from packaging.version import Version

    from tests.support import matrix

    release = Version(installed_version().base_version)
    caps = matrix.plugin_capabilities(release)
    for req in matrix.REQUIREMENTS:
        assert req.reason and (req.needs.startswith(("capability:", "flashinfer:")) or str(req.needs)[0] in "<>=!~")
        why = matrix.skip_reason(req.needs, req.reason, release, caps)
        if why is not None:  # does not apply here: the reason names the release, the kind and the requirement
            assert why.startswith(f"sglang {release}: ") and req.reason in why and f"(needs {req.needs})" in why
            kind = "not provided by the plugin" if req.needs.startswith("capability:") else "absent upstream"
            assert kind in why
    assert matrix.skip_reason(">=0.0.1", "x", release, caps) is None
    assert "absent upstream: old" in matrix.skip_reason("<0.0.1", "old", release, caps)
    assert "not provided by the plugin: nope" in matrix.skip_reason(
        "capability:no-such-capability", "nope", release, caps
    )
    json.dumps([c[:2] for c in matrix.CAPABILITIES])


def test_the_plugin_provides_every_capability_the_tests_need_on_every_release():
    """Issue #17: no "not provided by the plugin" cell in the compat matrix. Every capability a test needs (a row of
    REQUIREMENTS, a fixture's, a marker's) has a hook target the built-ins register on every release of
    ci/releases.tsv; what remains n/a anywhere is absent upstream (or from the flashinfer a release pins)."""
    import ast

    from packaging.version import Version

    from tests.support import matrix

    needed = {r.needs for r in matrix.REQUIREMENTS} | {n for n, _ in matrix.FIXTURE_REQUIREMENTS.values()}
    for path in (REPO / "tests").glob("test_*.py"):  # @pytest.mark.sglang("capability:...") markers
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.Call)
                and getattr(node.func, "attr", "") == "sglang"
                and node.args
                and isinstance(node.args[0], ast.Constant)
                and str(node.args[0].value).startswith("capability:")
            ):
                needed.add(node.args[0].value)
    needed = {n.split(":", 1)[1] for n in needed if n.startswith("capability:")}
    rows = [r["release"] for r in matrix.releases_tsv(REPO / "ci" / "releases.tsv") if not r["lane"]]
    for rel in rows:
        missing = needed - matrix.plugin_capabilities(Version(rel))
        assert not missing, f"sglang {rel}: not provided by the plugin: {sorted(missing)}"


def test_newest_tested_and_oldest_supported_are_the_matrix_ends():
    """One constant each (compat/releases.py); ci/releases.tsv's first and last release rows must agree with them."""
    from sglang_trtllm_moe.compat import NEWEST_TESTED, OLDEST_SUPPORTED
    from tests.support import matrix

    rows = [r["release"] for r in matrix.releases_tsv(REPO / "ci" / "releases.tsv") if not r["lane"]]
    assert (rows[0], rows[-1]) == (str(OLDEST_SUPPORTED), str(NEWEST_TESTED))


def test_tested_versions_are_the_ones_ci_releases_tsv_runs():
    """compat/releases.py's TESTED (what `doctor` reports a flashinfer as tested against) is generated from
    ci/releases.tsv (release pins + lanes) by ci/add-release: the two must agree, byte for byte."""
    from sglang_trtllm_moe.compat import TESTED
    from tests.support import matrix

    tsv = REPO / "ci" / "releases.tsv"
    assert TESTED == matrix.tested_versions(tsv)
    text = (REPO / "sglang_trtllm_moe" / "compat" / "releases.py").read_text()
    start, end = matrix.tested_block(text)
    assert text[start:end] == matrix.render_tested(tsv), "run: ci/add-release --row-only <release> (or write_tested)"


def test_doctor_reports_this_envs_flashinfer_as_the_matrix_runs_it():
    """In every env of the matrix `doctor` says whether this (SGLang, flashinfer) pair is one the matrix runs: its
    release's pin or a lane's flashinfer is "tested"; the oracle of a release whose pin cannot be imported on CPU is
    not (the matrix runs SGLang there without flashinfer)."""
    import importlib.metadata

    from tests.support import matrix

    r = _report()
    release = str(installed_version().base_version) if installed_version() else None
    runs = {row["flashinfer"] for row in matrix.releases_tsv(REPO / "ci" / "releases.tsv") if row["sglang"] == release}
    try:
        here = importlib.metadata.version("flashinfer-python")
    except importlib.metadata.PackageNotFoundError:
        here = None
    assert r["flashinfer_version"] == here
    if here is None:
        assert r["flashinfer_status"] == "missing"
    elif here in runs:
        assert r["flashinfer_status"] == "tested", r["flashinfer_message"]
    else:
        assert runs == {"-"}, f"sglang {release} runs flashinfer {runs}, this env has {here}"
        assert r["flashinfer_status"] == "untested" and "without flashinfer" in r["flashinfer_message"]
