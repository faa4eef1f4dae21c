"""Issue #50: when an SGLang release moves a hook target, the plugin never half-owns a layer.

Every hook target that lands on this release is made to fail to apply, one at a time, as SGLang's HookRegistry fails
(logged, skipped: SGLang's own function stays); names the plugin reaches outside the hook table are renamed in
SGLang's source; a module is moved. After each fault, a layer-level model of the formats the fault concerns goes
through every update flow of the release (tests/support/faults.py): each ends exact, refused (nothing changed), or the
model load stops with the reason — never success with wrong bytes, never an exception — and `doctor` says which
capability stepped aside and why. Formats: the ones whose capability group holds the target; a target every format's
preparation needs is run with NVFP4 (only the plugin keeps it exact on this release) and BF16 (SGLang's own path is
right here: stepping aside leaves it exact).
"""

from __future__ import annotations

import pytest

from sglang_trtllm_moe import capabilities
from sglang_trtllm_moe.compat import features
from sglang_trtllm_moe.sandbox.format_examples import example_of

from .support import faults, sglang_runtime

pytestmark = pytest.mark.sglang(
    features.UPDATE_RUNNER_SELECTOR.releases,
    reason="the fault suite drives the update flows of releases with begin/end sessions and the runner selector "
    "(0.5.21+); it runs on the newest release",
)


def _landed_paths() -> list[str]:
    """The dotted paths of the built-in targets on this release (each is checked landed before its fault)."""
    if not features.UPDATE_RUNNER_SELECTOR.present():
        return []
    from sglang.srt.plugins import load_plugins

    from sglang_trtllm_moe import plugin

    load_plugins()
    return sorted({t.target for t in plugin.state().targets if not t.source.startswith("ext:")})


PATHS = _landed_paths()


@pytest.fixture(scope="module", autouse=True)
def runtime():
    from sglang_trtllm_moe import installer

    sglang_runtime.ensure("flashinfer_trtllm")
    assert installer.import_all() == []
    capabilities.reset_for_tests()
    yield
    capabilities.reset_for_tests()


def _groups_of(path: str) -> list:
    from sglang_trtllm_moe import plugin

    st = plugin.state()
    return [
        g
        for g in capabilities.all_groups(st.targets)
        if any(t.target == path for t in capabilities.members(g, st.targets))
    ]


def _prep_closure() -> set[str]:
    groups = {g.name: g for g in capabilities.all_groups()}
    out: set[str] = set()
    todo = list(capabilities.PREP_NEEDS)
    while todo:
        n = todo.pop()
        if n not in out:
            out.add(n)
            todo += list(groups[n].needs)
    return out


def kinds_for(path: str) -> list[str]:
    from sglang_trtllm_moe.formats import by_name

    groups = _groups_of(path)
    fmts = [g.fmt for g in groups if g.fmt]
    if fmts:
        return list(dict.fromkeys(example_of(by_name(f)).kind for f in fmts))[:3]
    if any(g.name in _prep_closure() for g in groups):
        return ["nvfp4", "bf16"]
    return ["nvfp4"]


def _doctor_row(name: str) -> dict:
    return next(r for r in capabilities.report() if r["capability"] == name)


def _id(path: str) -> str:
    """`Class.method` (or `module.function`): short and unique among the built-in targets."""
    return ".".join(path.split(".")[-2:])


@pytest.mark.parametrize("path", PATHS, ids=[_id(p) for p in PATHS])
def test_a_target_that_fails_to_apply_leaves_nothing_half_owned(path):
    from sglang_trtllm_moe import plugin

    rows = [r for r in plugin.state().target_report() if r["target"] == path and r["state"] != "not_applicable"]
    assert rows and {r["state"] for r in rows} == {"landed"}, rows
    groups = _groups_of(path)
    assert groups, f"{path} belongs to no capability group (capabilities.py)"
    with faults.not_applied(path):
        now = {r["state"] for r in plugin.state().target_report() if r["target"] == path}
        assert now - {"not_applicable"} == {"missing"}, now
        for g in groups:  # doctor: the group stepped aside, naming the target
            row = _doctor_row(g.name)
            assert row["status"] == capabilities.STEPPED_ASIDE and any(path in w for w in row["why"]), row
        results = {kind: faults.run(kind) for kind in kinds_for(path)}
    bad = {kind: faults.failures(out) for kind, out in results.items() if faults.failures(out)}
    assert not bad, (path, bad, results)
    assert capabilities.decide(groups[0].name).status in (capabilities.ACTIVE, capabilities.NOT_APPLICABLE)


# ---- the four cases issue #50 measured, by name -------------------------------------------------------------------

MODELOPT_PWAL = (
    "sglang.srt.layers.quantization.modelopt_quant.ModelOptNvFp4FusedMoEMethod.process_weights_after_loading"
)
UPDATER = "sglang.srt.model_executor.model_runner_components.weight_updater.WeightUpdater"


@pytest.mark.parametrize(
    "path",
    [MODELOPT_PWAL, f"{UPDATER}.update_weights_from_tensor", f"{UPDATER}.end_weight_update"],
    ids=["nvfp4-prep", "tensor-entry", "session-end"],
)
def test_the_issues_garbage_cases_now_stop_at_start_up_with_the_reason(path):
    """Each left 16-20 NVFP4 tensors wrong with success reported; now the NVFP4 model load stops, naming the layer,
    the capability, the target and the fix."""
    with faults.not_applied(path):
        out = faults.run("nvfp4")
    assert out["start"].startswith(faults.START), out
    msg = out["start"]
    assert "model.layers.0.mlp.experts" in msg and "stepped aside for nvfp4" in msg and path in msg, msg
    assert "Fix:" in msg and "--moe-runner-backend" in msg, msg


def test_a_renamed_weight_loader_impl_steps_aside_never_drops_writes():
    """SGLang renames FusedMoE._weight_loader_impl: the loader capability (its un-prepare hook) and the batched
    writer's slot trace (which reached the old name) step aside; NVFP4 stops at start-up, BF16 and DeepSeek FP8
    block (SGLang's own path is right for them on 0.5.23) stay on it, every update of them exact or refused — no
    write dropped as another rank's."""
    with faults.renamed_weight_loader_impl():
        for name in ("loader", "batched-writes"):
            row = _doctor_row(name)
            assert row["status"] == capabilities.STEPPED_ASIDE, row
        assert any("_weight_loader_impl" in w for w in _doctor_row("batched-writes")["why"])
        results = {kind: faults.run(kind) for kind in ("nvfp4", "bf16", "fp8_block")}
    from sglang_trtllm_moe import aside

    for kind, out in results.items():  # a format only the plugin keeps exact stops; SGLang's own path runs the others
        fmt = faults.SPECS[kind].kind.format
        assert out["start"].startswith(faults.START) if aside.must_serve(fmt) else out["start"] == "ok", (kind, out)
    bad = {k: faults.failures(v) for k, v in results.items() if faults.failures(v)}
    assert not bad, results


PROBES = [p for p in capabilities.PROBES if p.feature is None or p.feature.present()]


@pytest.mark.parametrize("probe", PROBES, ids=[f"{p.group}:{p.name.split(' ')[0]}" for p in PROBES])
def test_a_name_the_plugin_reaches_that_is_gone_steps_its_capability_aside(probe, monkeypatch):
    """Each name the plugin reaches outside the hook table, found missing: its capability steps aside (doctor names
    it), and the formats it concerns end every flow exact or refused, or stop at start-up. The batched writer's slot
    trace alone: only the batched writer steps aside, every update goes through SGLang's per-tensor loader, exact."""
    from sglang_trtllm_moe.formats import by_name
    from sglang_trtllm_moe.updates import batched_writes

    gone = capabilities.Probe(probe.group, probe.name, probe.module, lambda: "renamed in this test", probe.why)
    monkeypatch.setattr(capabilities, "PROBES", tuple(gone if p is probe else p for p in capabilities.PROBES))
    capabilities.refresh()
    try:
        row = _doctor_row(probe.group)
        assert row["status"] == capabilities.STEPPED_ASIDE and probe.name in row["why"][0], row
        group = next(g for g in capabilities.all_groups() if g.name == probe.group)
        kinds = [example_of(by_name(group.fmt)).kind] if group.fmt else ["nvfp4", "bf16"]
        before = batched_writes.counts().get("tensors", 0)
        results = {kind: faults.run(kind) for kind in kinds}
        bad = {k: faults.failures(v) for k, v in results.items() if faults.failures(v)}
        assert not bad, results
        if probe.group == "batched-writes":
            assert _doctor_row("nvfp4")["status"] == capabilities.ACTIVE
            assert results["nvfp4"]["tensor"] == faults.EXACT, results
            assert batched_writes.counts().get("tensors", 0) == before  # nothing written batched
    finally:
        monkeypatch.undo()
        capabilities.refresh()
        batched_writes.step_aside(None)


def test_a_moved_module_is_missing_not_waiting():
    """The module of ModelOpt's NVFP4 method moves: its target would wait for a module never imported under the old
    name. It is reported missing (not not_imported), the NVFP4 group steps aside, and the model load says so."""
    from sglang_trtllm_moe import plugin

    with faults.moved_module(MODELOPT_PWAL):
        moved = [
            r
            for r in plugin.state().target_report()
            if r["target"].endswith(".process_weights_after_loading") and "_moved" in r["target"]
        ]
        assert moved and {r["state"] for r in moved} == {"missing"}, moved
        assert "cannot be imported under that name" in moved[0]["reason"]
        assert _doctor_row("nvfp4")["status"] == capabilities.STEPPED_ASIDE
        out = faults.run("nvfp4")
    assert out["start"].startswith(faults.START), out


def test_a_request_whose_runners_cannot_be_told_is_refused_before_any_runner_loads():
    """SGLang renames the workers' `weight_update_runners` (its scheduler calls the new name): with a speculative
    draft the plugin can no longer check a request against both runners before the first loads, so every runner's
    entry point refuses it — target and draft unchanged — and request-checks is reported stepped aside."""
    out = faults.draft_request_with_unknown_runners()
    assert out["refused"] and out["unchanged"], out
    assert "cannot be checked against the target and the speculative draft" in out["message"], out
    capabilities.reset_for_tests()


def test_doctor_and_explain_say_what_stepped_aside_and_why(tmp_path):
    """The NVFP4 capability without its post-load hook: `doctor` (text and JSON) and `explain` for an NVFP4 model
    name the capability, the missing target and what that leaves; with every target landed, explain says all the
    capabilities its path needs are active."""
    from sglang_trtllm_moe import doctor, explain

    sglang_runtime.write_safetensors_checkpoint(str(tmp_path), {}, faults.SPECS["nvfp4"])
    with faults.not_applied(MODELOPT_PWAL):
        r = doctor.report(load=False, import_targets=False)
        row = next(c for c in r["capabilities"] if c["capability"] == "nvfp4")
        assert row["status"] == "stepped_aside" and MODELOPT_PWAL in row["why"][0] and row["consequence"], row
        text = doctor.format_text(r)
        assert "[ stepped_aside] nvfp4:" in text and "stops at model load" in text, text
        rep = explain.explain_model(str(tmp_path), sm=100)
        caps = {c["capability"]: c for c in rep["capabilities"]}
        assert caps["nvfp4"]["status"] == "stepped_aside" and MODELOPT_PWAL in caps["nvfp4"]["why"][0], caps
        assert set(capabilities.PREP_NEEDS) <= set(caps), sorted(caps)
    rep = explain.explain_model(str(tmp_path), sm=100)
    assert {c["status"] for c in rep["capabilities"]} <= {"active", "not_applicable"}, rep["capabilities"]
