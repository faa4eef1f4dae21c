"""The README says what is true: its runnable example runs, its support table is the one the compat-matrix results
give, and it lists every error class and environment variable the plugin has.

The runnable blocks are the ```python blocks right after a `<!-- readme-test: run -->` line. Each runs as a script in
a fresh interpreter of this env (the tiny-checkpoint generator, a real `sglang.Engine(device="cpu")` with the
emulated kernels, one RL update, a refused bucket, the weight check: about a minute on a 2-core box).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from sglang_trtllm_moe.compat.sandbox_releases import RL_LOOP_RELEASES

from .support.helpers import REPO

README = REPO / "README.md"
RUN_MARK = "<!-- readme-test: run -->"


def runnable_blocks(text: str) -> list[str]:
    """The code of every ```python block that directly follows the run mark."""
    blocks = []
    for m in re.finditer(re.escape(RUN_MARK) + r"\s*\n```python\n(.*?)\n```", text, re.DOTALL):
        blocks.append(m.group(1) + "\n")
    return blocks


def test_the_readme_has_a_runnable_example_and_it_compiles():
    blocks = runnable_blocks(README.read_text())
    assert blocks, f"no ```python block after {RUN_MARK!r} in README.md"
    for i, code in enumerate(blocks):
        compile(code, f"README.md block {i}", "exec")


@pytest.mark.sglang(
    str(RL_LOOP_RELEASES),
    reason='the README example drives sglang.Engine(device="cpu") with begin/end '
    "weight-update sessions and the weight-checker request (compat/sandbox_releases.py RL_LOOP_RELEASES)",
)
@pytest.mark.parametrize("index", range(len(runnable_blocks(README.read_text()))))
def test_readme_example_runs(tmp_path, index):
    pytest.importorskip(
        "xgrammar",
        reason="sglang.Engine's detokenizer imports xgrammar (ci/releases.tsv installs "
        "the pin of 0.5.23); this env has none",
    )
    script = tmp_path / f"readme_example_{index}.py"
    script.write_text(runnable_blocks(README.read_text())[index])
    env = {k: v for k, v in os.environ.items() if not k.startswith("SGLANG_TRTLLM_MOE_") and k != "SGLANG_PLUGINS"}
    env["PYTHONPATH"] = os.pathsep.join(
        [str(REPO)] + ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else [])
    )
    env.setdefault("OMP_NUM_THREADS", "1")
    proc = subprocess.run(
        [sys.executable, str(script)],
        cwd=str(tmp_path),
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert proc.returncode == 0, (
        f"README example {index} failed (exit {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    )


def test_the_support_table_is_rendered_from_the_compat_results():
    """README's table == support_table.render(docs/compat.json): regenerate with `python -m tests.support.matrix
    render` after changing the renderer or the rows (ci/matrix does it after every run)."""
    from .support import matrix, support_table

    text = README.read_text()
    assert matrix.BEGIN in text and matrix.END in text, "README.md lost its support-table markers"
    shown = text.split(matrix.BEGIN, 1)[1].split(matrix.END, 1)[0].strip()
    data = json.loads((REPO / "docs" / "compat.json").read_text())
    assert shown == support_table.render(data).strip(), (
        "README.md's support table is stale: run `python -m tests.support.matrix render`"
    )


def test_every_error_class_has_a_remedy_in_the_readme():
    from sglang_trtllm_moe import errors

    text = README.read_text()
    troubleshooting = text.split("## Troubleshooting", 1)[1]
    for name in errors.__all__:
        assert f"`{name}`" in troubleshooting, f"{name} is not in the README's Troubleshooting section"


def test_every_environment_variable_the_plugin_reads_is_in_the_readme():
    pattern = re.compile(r"SGLANG_TRTLLM_MOE_[A-Z][A-Z_]*[A-Z]")
    names = set()
    for path in (REPO / "sglang_trtllm_moe").rglob("*.py"):
        names.update(pattern.findall(path.read_text()))
    for path in (REPO / "ci").iterdir():
        if path.is_file():
            names.update(pattern.findall(path.read_text()))
    text = README.read_text()
    missing = sorted(n for n in names if f"`{n}" not in text)
    assert not missing, f"environment variables not in README.md: {missing}"


def test_the_release_range_in_the_prose_is_the_tested_one():
    """The README's prose names the supported range, the newest tested release and where the CPU recipe runs; when a
    release is added (compat/releases.py TESTED, sandbox RL_LOOP_RELEASES) this fails until the prose follows."""
    from sglang_trtllm_moe.compat.releases import NEWEST_TESTED, OLDEST_SUPPORTED

    text = README.read_text()
    prose = re.sub(r"<!-- support-table:begin.*?<!-- support-table:end -->", "", text, flags=re.DOTALL)
    ranges = re.findall(r"\b(\d+\.\d+\.\d+) (?:to|-) (\d+\.\d+\.\d+)\b", prose)
    assert ranges, "the README names no release range"
    assert set(ranges) == {(str(OLDEST_SUPPORTED), str(NEWEST_TESTED))}, ranges
    newest = re.findall(r"(?:[Nn]ewer than|newest tested release) (\d+\.\d+\.\d+)", prose)
    assert newest and set(newest) == {str(NEWEST_TESTED)}, newest
    older = re.findall(r"Older than (\d+\.\d+\.\d+)", prose)
    assert older == [str(OLDEST_SUPPORTED)], older
    engine_floor = re.match(r">=\s*(\S+)$", str(RL_LOOP_RELEASES)).group(1)
    cpu = re.findall(r"SGLang (\d+\.\d+\.\d+) or newer", prose)
    assert cpu and set(cpu) == {engine_floor}, (cpu, str(RL_LOOP_RELEASES))
