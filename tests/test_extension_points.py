"""SGLang's official extension points, checked against the installed release: each reason extension_points.py gives
for not carrying a hook through one still holds (a release where one stops holding fails here, and the patch is
replaced by the registration there), every built-in target has its line in docs/ARCHITECTURE.md's patch table, and
`doctor` counts patches vs official registrations."""

from __future__ import annotations

import inspect
import os

import pytest

from sglang_trtllm_moe import extension_points
from sglang_trtllm_moe.compat import features

from .support import sglang_runtime

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module", autouse=True)
def runtime():
    sglang_runtime.ensure("flashinfer_trtllm")


def test_sglang_registers_the_trtllm_fused_funcs_itself_and_refuses_a_second():
    import sglang.srt.layers.moe.moe_runner.flashinfer_trtllm  # noqa: F401 - registers SGLang's fused funcs
    from sglang.srt.layers.moe.moe_runner.base import FusedOpPool

    for runner in ("flashinfer_trtllm", "flashinfer_trtllm_routed"):
        assert FusedOpPool.get_fused_func("none", runner) is not None, runner
        with pytest.raises(ValueError, match="already registered"):
            FusedOpPool.register_fused_func("none", runner, lambda *a, **k: None)


@pytest.mark.skipif(
    not features.MOE_RUNNER_CORE_REGISTRY.present(),
    reason=f"no register_moe_runner_core before SGLang 0.5.19 ({features.MOE_RUNNER_CORE_REGISTRY.releases})",
)
def test_a_runner_core_for_flashinfer_trtllm_would_never_run():
    """MoeRunner.run calls the fused func first, and one is registered for flashinfer_trtllm: a registered core is
    built and never reached."""
    from sglang.srt.layers.moe.moe_runner import runner

    src = inspect.getsource(runner.MoeRunner.run)
    first_fused = src.index("self.fused_func is not None")
    assert first_fused < src.index("self.runner_core"), src[:400]
    init = inspect.getsource(runner.MoeRunner.__init__)
    assert "_CUSTOM_RUNNER_CORE_FACTORIES.get(" in init and "FusedOpPool.get_fused_func(" in init


def _table_rows() -> list[str]:
    with open(os.path.join(ROOT, "docs", "ARCHITECTURE.md")) as f:
        text = f.read()
    begin, end = "<!-- patch-table:begin -->", "<!-- patch-table:end -->"
    return [line for line in text[text.index(begin) + len(begin) : text.index(end)].splitlines() if line.strip()]


def test_the_patch_table_lists_every_built_in_target_with_why_it_is_a_patch():
    from sglang_trtllm_moe import plugin

    st = plugin.state()
    want = extension_points.patch_table(st.targets + st.not_applicable)
    got = _table_rows()
    assert got == want, "docs/ARCHITECTURE.md's patch table is stale; it should read:\n" + "\n".join(want)


def test_doctor_counts_patches_and_official_registrations():
    from sglang_trtllm_moe import doctor

    r = doctor.report(load=False, import_targets=True)
    ep = r["extension_points"]
    landed = {t["target"] for t in r["targets"] if t["state"] == "landed"}
    assert ep["patches"] == len(landed) > 0 and ep["official"] == len(extension_points.OFFICIAL) == 0
    assert {p["name"] for p in ep["points"]} == {p.name for p in extension_points.EXTENSION_POINTS}
    text = doctor.format_text(r)
    assert f"{ep['patches']} patched targets" in text and "0 official registrations" in text, text
    assert {c["status"] for c in r["capabilities"]} <= {"active", "not_applicable"}, r["capabilities"]


def test_every_built_in_target_of_every_release_is_in_a_capability_group():
    """Nothing outside the table: each target (this release's and the others') belongs to a capability group, and
    each group a format needs exists."""
    from sglang_trtllm_moe import capabilities, plugin

    st = plugin.state()
    targets = [t for t in st.targets + st.not_applicable if not t.source.startswith("ext:")]
    groups = capabilities.all_groups(targets)
    names = {g.name for g in groups}
    assert set(capabilities.PREP_NEEDS) <= names
    assert all(set(g.needs) <= names for g in groups), [(g.name, g.needs) for g in groups]
    lost = [t.target for t in targets if not any(t in capabilities.members(g, targets) for g in groups)]
    assert lost == []
    from sglang_trtllm_moe.formats import FORMATS

    declared = {g.name for g in capabilities.GROUPS}
    hook_modules = {f.hook_module for f in FORMATS}
    shared = [t for t in targets if not t.formats and t.source not in hook_modules]
    assert {t.group or t.capability for t in shared} <= declared, {t.target: t.group or t.capability for t in shared}
