"""The plugin as SGLang loads it: entry point, pluggy core, release gate, proof that hooks landed, doctor."""

from __future__ import annotations

import importlib.metadata
import json
import os
import subprocess
import sys

import pytest

from sglang_trtllm_moe import env, plugin
from sglang_trtllm_moe.compat import NEWEST_TESTED, OLDEST_SUPPORTED, check_release

from .support import probes
from .support.helpers import last_json, make_distribution, run_python

LOAD_AND_REPORT = """
    import json
    from sglang.srt.plugins import load_plugins
    load_plugins()
    from sglang_trtllm_moe import doctor
    from sglang.srt.plugins.hook_registry import HookRegistry
    r = doctor.report(load=False, import_targets=True)
    r["registry_targets"] = sorted(HookRegistry._hooks)
    print(json.dumps(r))
"""

#: the same report without importing every hooked module (doctor's ~6 s): for the tests that read what was
#: registered (extensions loaded or skipped, their targets, the release status), not whether a target landed
LOAD_AND_LIST = LOAD_AND_REPORT.replace("import_targets=True", "import_targets=False")
assert LOAD_AND_LIST != LOAD_AND_REPORT

EXT_MODULE = """
    from sglang_trtllm_moe import hookimpl
    from sglang_trtllm_moe.targets import HookTarget
    CALLS = []
    def count(original, *a, **k):
        CALLS.append(1)
        return original(*a, **k)
    @hookimpl
    def register_sglang_hooks(register, release):
        register(HookTarget("sglang.srt.layers.moe.utils.get_moe_a2a_backend", count, "around", capability="ext-demo"))
"""


def test_entry_point_is_declared_for_sglang():
    eps = importlib.metadata.entry_points(group="sglang.srt.plugins")
    ours = [ep for ep in eps if ep.name == "trtllm_moe"]
    assert len(ours) == 1
    assert ours[0].value == "sglang_trtllm_moe.plugin:register"
    assert ours[0].load() is plugin.register


#: Witness that SGLang really calls through a landed hook: a weight-update entry point of this release must drop the
#: layout index-map cache before it runs (sglang#28676), whatever the call itself then does. In the process of
#: probes.DOCTOR, after it (the session's shared fresh process).
WITNESS = probes.section(
    "plain",
    "witness",
    """
    import pkgutil
    from packaging.version import Version
    from sglang_trtllm_moe import layouts
    from sglang_trtllm_moe.builtins.weight_updates import LOAD_ONLY_ENTRY_POINTS
    from sglang_trtllm_moe.compat import installed_version
    from sglang_trtllm_moe.targets import HookTarget
    rel = installed_version()
    target = next(t for t, spec in LOAD_ONLY_ENTRY_POINTS if HookTarget(t, None, releases=spec).applies_to(rel))
    cached = layouts.w2_row_map(256)
    before = layouts.w2_row_map(256) is cached  # the map is cached
    try:
        pkgutil.resolve_name(target)(object(), [])
    except Exception:
        pass  # a bare object is no WeightUpdater; the BEFORE hook has run by then
    dropped = layouts.w2_row_map(256) is not cached  # the cache was dropped: the map is built anew
    RESULT = {"target": target, "cached_before": before, "dropped_after": dropped}
    """,
    order=30,
)


def test_sglang_load_plugins_runs_register_and_every_target_lands():
    r, calls = probes.result("plain", "doctor"), probes.result("plain", WITNESS)
    assert r["enabled"] is True and r["status"] == "enabled"
    assert r["sglang_version"] and r["release_status"] == "tested"
    assert r["targets"], "no targets registered"
    assert [t for t in r["targets"] if t["state"] == "missing"] == []
    assert {t["state"] for t in r["targets"]} <= {"landed", "not_applicable"}
    assert calls["target"] in r["registry_targets"]
    assert calls["cached_before"] is True and calls["dropped_after"] is True


#: LOAD_AND_REPORT in the session's shared process started with SGLANG_TRTLLM_MOE_DISABLE=1 (tests/support/probes.py:
#: SGLang alone; its other sections resolve and measure upstream, which importing the hooked modules does not change)
DISABLED = probes.section(
    "disabled",
    "disabled_report",
    LOAD_AND_REPORT.replace("print(json.dumps(r))", "RESULT = r"),
    order=80,
)


def test_disable_switch_registers_nothing():
    r = probes.result("disabled", DISABLED)
    assert r["enabled"] is False and r["status"] == "disabled"
    assert "SGLANG_TRTLLM_MOE_DISABLE" in r["reason"]
    assert r["registry_targets"] == []


#: extensions that fail three ways (their import, their hook function, their target), beside the good one
BROKEN_EXT = {
    "broken_import_mod": "raise RuntimeError('cannot import me')\n",
    "broken_hook_mod": """
        from sglang_trtllm_moe import hookimpl
        @hookimpl
        def register_sglang_hooks(register, release):
            raise ValueError('boom in register_sglang_hooks')
    """,
    "bad_target_mod": """
        from sglang_trtllm_moe import hookimpl
        from sglang_trtllm_moe.targets import HookTarget
        def h(original, *a, **k):
            return original(*a, **k)
        @hookimpl
        def register_sglang_hooks(register, release):
            register(HookTarget("sglang.srt.layers.moe.utils.this_function_does_not_exist", h, "around"))
    """,
}


def _demo_ext(root):
    return make_distribution(
        root,
        "trtllm-moe-demo-ext",
        "0.0.1",
        entry_points="[sglang_trtllm_moe]\ndemo = demo_ext_mod\n",
        modules={"demo_ext_mod": EXT_MODULE},
    )


@pytest.fixture(scope="module")
def extensions_run(tmp_path_factory):
    """One process (no allowlist: every extension of the group is loaded) with the demo extension and three broken
    ones installed side by side: SGLang's load_plugins(), doctor's report with every hooked module imported, then a
    call through the demo extension's hook. (The good and the broken extensions used to get a process each: the
    broken ones must not stop the good one either.)"""
    root = tmp_path_factory.mktemp("extensions")
    _demo_ext(root)
    make_distribution(
        root,
        "trtllm-moe-broken-ext",
        "0.0.1",
        entry_points=(
            "[sglang_trtllm_moe]\n"
            "import_fails = broken_import_mod\n"
            "hook_raises = broken_hook_mod\n"
            "bad_target = bad_target_mod\n"
        ),
        modules=BROKEN_EXT,
    )
    proc = run_python(
        LOAD_AND_REPORT
        + """
    import demo_ext_mod
    from sglang.srt.layers.moe import utils
    try:
        utils.get_moe_a2a_backend()
    except Exception:
        pass
    print(json.dumps({"ext_calls": len(demo_ext_mod.CALLS)}))
    """,
        pythonpath=[root],
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [json.loads(x) for x in proc.stdout.strip().splitlines() if x.startswith("{")]
    return lines[-2], lines[-1]


def test_extension_from_entry_point_group_is_loaded_and_its_hook_lands(extensions_run):
    r, calls = extensions_run
    # exactly the extensions installed: the demo one, the three broken ones (test below) and the plugin's own sandbox,
    # an extension of its group too (setup.cfg), registered the same way
    ext = {e["name"]: e for e in r["extensions"]}
    assert sorted(ext) == ["bad_target", "demo", "hook_raises", "import_fails", "sandbox"], ext
    assert ext["demo"]["state"] == "loaded" and ext["demo"]["dist"] == "trtllm-moe-demo-ext"
    assert ext["sandbox"]["state"] == "loaded" and ext["sandbox"]["value"] == "sglang_trtllm_moe.sandbox.extension"
    ext_targets = [t for t in r["targets"] if t["source"] == "ext:demo"]
    assert len(ext_targets) == 1 and ext_targets[0]["state"] == "landed"
    assert calls["ext_calls"] == 1


@pytest.mark.parametrize("allow,expected", [("", "skipped"), ("other", "skipped"), ("demo", "loaded")])
def test_extension_allowlist(tmp_path, allow, expected):
    _demo_ext(tmp_path)
    r = last_json(run_python(LOAD_AND_LIST, env={"SGLANG_TRTLLM_MOE_LOAD_PLUGINS": allow}, pythonpath=[tmp_path]))
    ext = {e["name"]: e for e in r["extensions"]}
    assert ext["demo"]["state"] == expected
    assert ext["sandbox"]["state"] == "loaded"  # the plugin's own part: SGLANG_TRTLLM_MOE_LOAD_PLUGINS filters others
    assert any(t["source"] == "ext:demo" for t in r["targets"]) == (expected == "loaded")


def test_broken_extensions_break_neither_sglang_nor_builtins(extensions_run):
    r, _calls = extensions_run
    assert r["enabled"] is True
    ext = {e["name"]: e for e in r["extensions"]}
    assert ext["import_fails"]["state"] == "failed" and "cannot import me" in ext["import_fails"]["error"]
    assert ext["hook_raises"]["state"] == "failed" and "boom" in ext["hook_raises"]["error"]
    assert ext["bad_target"]["state"] == "loaded"
    by_source = {}
    for t in r["targets"]:
        by_source.setdefault(t["source"], []).append(t)
    assert all(t["state"] in ("landed", "not_applicable") for t in by_source["sglang_trtllm_moe.builtins.nvfp4_hooks"])
    assert any(t["state"] == "landed" for t in by_source["sglang_trtllm_moe.builtins.nvfp4_hooks"])
    (bad,) = by_source["ext:bad_target"]
    assert bad["state"] == "missing" and "this_function_does_not_exist" in bad["reason"]
    # its capability group is its own: the built-ins' stay active (capabilities.py)
    caps = {c["capability"]: c["status"] for c in r["capabilities"]}
    assert caps["bad_target: core"] == "stepped_aside" and caps["core"] == caps["nvfp4"] == "active", caps


def _next_patch(v) -> str:
    return ".".join(map(str, (*v.release[:2], v.release[2] + 1)))


@pytest.mark.parametrize(
    "version,status,runs",
    [
        ("0.5.10", "unsupported", False),
        ("0.5.4", "unsupported", False),
        (str(OLDEST_SUPPORTED), "tested", True),
        (str(NEWEST_TESTED), "tested", True),
        (f"{NEWEST_TESTED}.post1", "tested", True),
        (_next_patch(NEWEST_TESTED), "untested", True),
    ],
)
def test_release_gate(version, status, runs):
    r = check_release(version)
    assert (r.status, r.runs) == (status, runs)


def test_missing_sglang_is_reported():
    assert check_release(None).status in ("tested", "untested")  # the env has sglang
    import sglang_trtllm_moe.compat.releases as rel

    orig = rel.installed_version
    rel.installed_version = lambda: None
    try:
        r = rel.check_release()
    finally:
        rel.installed_version = orig
    assert r.status == "missing" and not r.runs and "not installed" in r.message


def test_unsupported_release_stands_down(tmp_path):
    # A dist-info ahead of site-packages makes importlib.metadata report sglang 0.5.10 — the same lookup the gate uses.
    make_distribution(tmp_path, "sglang", "0.5.10")
    proc = run_python(
        """
        import json
        from sglang_trtllm_moe import doctor, plugin
        from sglang.srt.plugins.hook_registry import HookRegistry
        plugin.register()
        r = doctor.report(load=False, import_targets=True)
        r["registry_targets"] = sorted(HookRegistry._hooks)
        print(json.dumps(r))
    """,
        pythonpath=[tmp_path],
    )
    r = last_json(proc)
    assert r["status"] == "stood_down" and r["enabled"] is False
    assert "0.5.10" in r["reason"] and "0.5.11" in r["reason"]
    assert r["registry_targets"] == []


def test_newer_release_runs_and_doctor_says_untested(tmp_path):
    make_distribution(tmp_path, "sglang", "0.5.99")
    r = last_json(run_python(LOAD_AND_LIST, pythonpath=[tmp_path]))
    assert r["enabled"] is True and r["release_status"] == "untested"
    assert "untested" in r["release_message"] or "newer" in r["release_message"]


def test_register_is_idempotent_and_never_raises(monkeypatch):
    from sglang.srt.plugins.hook_registry import HookRegistry

    saved_hooks = {k: list(v) for k, v in HookRegistry._hooks.items()}
    saved_state = plugin.state()
    try:
        plugin.reset_for_tests()
        monkeypatch.setattr(plugin, "CORE_MODULES", plugin.CORE_MODULES + ("sglang_trtllm_moe.no_such_module",))
        plugin.register()  # a broken built-in: logged, stands down, no exception
        assert plugin.state().status == "stood_down"
        assert "no_such_module" in plugin.state().reason
        assert plugin.state().targets == []

        plugin.reset_for_tests()
        monkeypatch.undo()
        HookRegistry._hooks.clear()
        plugin.register()
        plugin.register()
        assert plugin.state().enabled
        from sglang_trtllm_moe import installer

        assert installer.import_all() == []  # every deferred target reaches HookRegistry once its module is in
        for t in plugin.state().targets:
            same = [h for ht, h, _src in HookRegistry._hooks[t.target] if h is t.hook and ht.value == t.hook_type]
            assert len(same) == 1, t.target  # registered once, although register() ran twice
    finally:
        HookRegistry._hooks.clear()
        HookRegistry._hooks.update(saved_hooks)
        plugin._STATE = saved_state


def test_doctor_cli_json_loads_the_plugin_through_sglang_and_proves_every_target():
    """`doctor` (its own process) runs SGLang's load_plugins(), imports every hooked module and reports each target
    landed (or absent on this release): proof after the fact, in the process that reports it."""
    proc = subprocess.run(
        [sys.executable, "-m", "sglang_trtllm_moe", "doctor", "--json"], capture_output=True, text=True, timeout=240
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = last_json(proc)
    assert r["enabled"] is True and r["errors"] == []
    assert set(r) >= {"enabled", "sglang_version", "targets", "extensions"}
    states = {t["target"]: t["state"] for t in r["targets"]}
    assert states and set(states.values()) <= {"landed", "not_applicable"}, states
    assert "landed" in states.values()
    for t in r["targets"]:
        assert set(t) >= {"target", "state", "module", "capability", "hook_type", "source"}
    # the tally is the count of the states above; the switches are this process's (no emulator here)
    every = [t["state"] for t in r["targets"]]  # a target hooked twice (BEFORE and AFTER) counts twice
    assert r["tally"] == {s: every.count(s) for s in set(every)}, r["tally"]
    ours = {k: v for k, v in os.environ.items() if k.startswith("SGLANG_TRTLLM_MOE_")}
    assert r["switches"] == {"emulator": env.emulating(), "set_up": {}, "env": ours}, r["switches"]
    # the text form, with the emulator switched on: the tally line and the switches in force
    text = subprocess.run(
        [sys.executable, "-m", "sglang_trtllm_moe", "doctor"],
        capture_output=True,
        text=True,
        timeout=240,
        env={**os.environ, "SGLANG_TRTLLM_MOE_EMULATE": "1"},
    )
    assert text.returncode == 0 and "enabled" in text.stdout and "[        landed]" in text.stdout
    tally = ", ".join(f"{r['tally'].get(s, 0)} {s.replace('_', ' ')}" for s in ("landed", "missing", "not_applicable"))
    assert f"\ntally: {tally}\n" in text.stdout, text.stdout[-2000:]
    assert "\nkernels: emulated (SGLANG_TRTLLM_MOE_EMULATE=1); set up by extensions: nothing\n" in text.stdout
    assert "SGLANG_TRTLLM_MOE_EMULATE=1" in text.stdout.rsplit("SGLANG_TRTLLM_MOE_* set: ", 1)[1]


LAZY = probes.section(
    "plain",
    "lazy",
    """
    import json, sys
    before = set(sys.modules)
    from sglang.srt.plugins import load_plugins
    load_plugins()
    from sglang_trtllm_moe import plugin
    added = sorted(set(sys.modules) - before)
    def states():
        return {t["target"]: t["state"] for t in plugin.state().target_report()}
    out = {"added": [m for m in added if m.startswith(("sglang.", "torch", "sglang_trtllm_moe"))],
           "modules": {t.target: t.module for t in plugin.state().targets}, "after_load": states()}
    import sglang.srt.layers.moe.fused_moe_triton.layer  # what a scheduler building a MoE model imports first
    out["after_fused_moe"] = states()
    RESULT = out
    """,
    order=probes.FIRST,  # sys.modules as SGLang's load_plugins() finds it in a fresh process
)


def test_load_plugins_imports_no_hooked_module_and_no_harness_and_hooks_land_on_import():
    """Start-up is free (issue: +2.7-4.0 s and +138 MiB in every launcher/detokenizer): SGLang's load_plugins()
    with the plugin imports none of the modules it hooks and nothing of the CPU harness but its extension's entry
    point (sandbox/extension.py: the switch is read before anything else of it is imported); a hook lands when its
    module is imported, before anything can use it."""
    r = probes.result("plain", LAZY)
    hooked = set(r["modules"].values())
    assert not hooked & set(r["added"]), sorted(hooked & set(r["added"]))
    sandbox = [m for m in r["added"] if m.startswith("sglang_trtllm_moe.sandbox")]
    assert sandbox == [f"sglang_trtllm_moe.sandbox{m}" for m in ("", ".extension", ".switches")], sandbox
    assert set(r["after_load"].values()) <= {"not_imported", "landed", "not_applicable"}, r["after_load"]
    fused = [t for t, m in r["modules"].items() if m == "sglang.srt.layers.moe.fused_moe_triton.layer"]
    assert fused and all(r["after_load"][t] == "not_imported" for t in fused)
    assert all(r["after_fused_moe"][t] == "landed" for t in fused), {t: r["after_fused_moe"][t] for t in fused}
    # importing FusedMoE's module pulls in the quant methods it needs; whatever came in is hooked, nothing missing
    assert "missing" not in r["after_fused_moe"].values()


@pytest.mark.parametrize(
    "target,module",
    [
        (
            "sglang.srt.layers.moe.fused_moe_triton.layer.FusedMoE.weight_loader",
            "sglang.srt.layers.moe.fused_moe_triton.layer",
        ),
        ("sglang.srt.layers.moe.utils.initialize_moe_config", "sglang.srt.layers.moe.utils"),
        ("sglang.srt.server_args.ServerArgs._handle_moe_kernel_config", "sglang.srt.server_args"),
    ],
)
def test_module_of_a_target(target, module):
    from sglang_trtllm_moe.targets import module_of

    assert module_of(target) == module
