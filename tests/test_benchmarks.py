"""Every script under benchmarks/ runs at tiny sizes and prints its JSON, so a benchmark cannot rot unnoticed
(issue #29: validation_overhead.py had stopped running when `check_bucket` moved). Each script's `--tiny` mode runs
on this CPU; the scripts run two at a time in fresh processes, once for the module. Nothing here asserts a timing:
each test asserts that the script exited 0, that its last JSON line parses, and a fact of its result that does not
depend on the machine's speed (bytes equal, counts, the model exact after its updates)."""

from __future__ import annotations

import concurrent.futures
import os
import subprocess
import sys

import pytest

from .support.helpers import REPO, last_json

BENCHMARKS = REPO / "benchmarks"


def _release_at_least(spec: str) -> bool:
    from packaging.specifiers import SpecifierSet
    from packaging.version import Version

    from sglang_trtllm_moe.compat.releases import installed_version

    v = installed_version()
    return v is not None and Version(v.base_version) in SpecifierSet(spec)


def _check_h200_layouts(out):
    assert all(out["whole_layer_checks"].values()), out["whole_layer_checks"]
    assert all(out["cuda_equals_cpu_bytes_and_in_place"].values())


def _check_ncu(out):
    assert out["profiled"] == ["w13_weight", "w13_weight_scale", "w2_weight", "w2_weight_scale"]


def _check_layouts_cpu(out):
    assert [r["same_bytes"] for r in out["rows"]] == [True]


def _check_validation_overhead(out):
    assert out["loader_calls"] == 4 * 12  # 4 experts x (w1, w3, w2) x (weight, scale, scale_2, input_scale)
    # the per-tensor and input scales (24) and the e4m3 block scales (12: checked on their bytes since #27)
    assert out["check_write_breakdown_us_per_call"]["value-checked calls"] == "36 of 48"
    # the profile is of the plugin's checks (which of their functions ranks first depends on the box's threads)
    assert any("validation.py" in r["function"] for r in out["profile_check_write"]), out["profile_check_write"]


def _check_h200_update_path(out):
    s = out["session"]
    assert s["same_bytes_plugin_vs_bare"] is True
    assert out["request"]["loader_calls"] == 4 * 12
    # the plugin's checks read back once per bucket (counted on the device path: CUDA's synchronisations)
    assert s["checks_read_backs_device_path"] == s["buckets"] == out["request"]["buckets"]
    rows = out["value_checks"]["rows"]
    assert rows["float_scales_per_tensor"]["syncs"] == out["value_checks"]["float_scale_tensors"]
    assert rows["float_scales_batched"]["syncs"] == 1
    assert rows["all_scales_find_bad"]["syncs"] == 1
    assert rows["byte_scales_nan_one_reduction_per_buffer"]["syncs"] == 1
    # through the entry point the one bucket's values are read back once, nothing per write; through a bare
    # load_weights every scale is
    assert sum(out["partial"]["tensor_to_python"].get("checks", {}).values()) == 1
    assert sum(out["partial"]["tensor_to_python_no_entry_point"]["checks"].values()) >= 2 * 9


def _check_value_checks(out):
    rows = {(r["format"], r.get("device", "disk")): r for r in out["rows"]}
    assert {f for f, _ in rows} == {"nvfp4", "fp8_block", "mxfp8"}
    assert all(r["scale_tensors"] == 2 * 3 for r in out["rows"] if "scale_tensors" in r)
    assert rows[("nvfp4", "disk")]["checkpoint_MiB"] > 0


def _check_model_update(out):
    (rep,) = out["reports"]
    assert rep["quant"] == "nvfp4" and rep["layers_prepared_by"] == ["plugin"]
    assert rep["model_equals_fresh_load_of_the_update"] is True
    for flow in ("tensor", "disk"):
        e = rep["flows"][flow]
        calls = 2 * 8 * 12  # 2 MoE layers x 8 experts x 12 expert tensors
        batched = calls  # tensor buckets and disk checkpoints: every expert tensor written batched
        assert e["counts_plugin"]["batched_expert_tensors"] == batched
        assert e["counts_plugin"]["fused_moe_weight_loader_calls"] == calls - batched
        assert e["counts_per_tensor"]["fused_moe_weight_loader_calls"] == calls
        assert e["counts_bypassed"]["fused_moe_weight_loader_calls"] == calls
        assert e["counts_bypassed"]["value_checks"] == 0  # bypass() replaced every check
        assert set(e["modes"]) >= {"plugin", "per_tensor", "bypassed"}


def _check_custom_loader(out):
    assert all(out["equal_to_a_fresh_load"].values()) and len(out["equal_to_a_fresh_load"]) == 3, out
    assert out["layer_mib"] > 0


def _check_h200_loader_free(out):
    rows = out["rows"]
    assert rows["check"]["read_backs"] == 1 and rows["hint_check"]["read_backs"] == 1  # one per session end
    assert out["hint_experts"] == 2
    assert rows["refused"] == {**rows["refused"], "answered": True, "fenced_expert_zero": True, "layer_clean": True}


#: script -> (arguments, SGLang releases it needs or None, check of its JSON)
SCRIPTS = {
    "h200_layouts.py": (["--tiny"], None, _check_h200_layouts),
    "h200_layouts_ncu.py": (["--tiny"], None, _check_ncu),
    "h200_update_path.py": (["--tiny"], None, _check_h200_update_path),
    "h200_loader_free.py": (["--tiny"], None, _check_h200_loader_free),
    "layouts_cpu.py": (["--tiny"], ">=0.5.11", _check_layouts_cpu),
    "validation_overhead.py": (["--tiny"], ">=0.5.11", _check_validation_overhead),
    "model_update.py": (["--tiny"], ">=0.5.21", _check_model_update),
    "value_checks.py": (["--tiny", "--disk"], ">=0.5.11", _check_value_checks),
    "custom_loader.py": (["--tiny"], ">=0.5.11", _check_custom_loader),
}

_RESULTS: dict = {}


def _env() -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SGLANG_TRTLLM_MOE_") and k != "SGLANG_PLUGINS"}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    env["OMP_NUM_THREADS"] = "1"
    return env


def _run(script: str):
    args, _, _ = SCRIPTS[script]
    return subprocess.run(
        [sys.executable, str(BENCHMARKS / script), *args],
        cwd=str(REPO),
        env=_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )


def _results() -> dict:
    """Every script that applies here, two at a time (the box has two cores; each script runs one torch thread)."""
    if not _RESULTS:
        todo = [s for s, (_, needs, _) in SCRIPTS.items() if needs is None or _release_at_least(needs)]
        with concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:
            # the slowest (a whole SGLang model) first
            order = sorted(todo, key=lambda s: s != "model_update.py")
            _RESULTS.update(zip(order, pool.map(_run, order), strict=True))
    return _RESULTS


def test_every_script_under_benchmarks_is_smoke_tested():
    scripts = sorted(p.name for p in BENCHMARKS.glob("*.py"))
    assert scripts == sorted(SCRIPTS), "add the new script (with a --tiny mode) to SCRIPTS"


@pytest.mark.parametrize("script", sorted(SCRIPTS))
def test_benchmark_runs_at_tiny_size_and_prints_its_json(script):
    _, needs, check = SCRIPTS[script]
    if needs is not None and not _release_at_least(needs):
        pytest.skip(f"{script} needs SGLang {needs} (sandbox/models.py builds whole models from 0.5.21)")
    proc = _results()[script]
    assert proc.returncode == 0, f"{script} exited {proc.returncode}\nstderr:\n{proc.stderr[-4000:]}"
    check(last_json(proc))
