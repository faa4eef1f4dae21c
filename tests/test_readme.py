"""The README says what is true: it is short (MAX_LINES), every command it shows runs, its support table is the one
the compat-matrix results give, it lists every error class and environment variable the plugin has, and its links
(and those of the docs it sends users to) lead somewhere.

Every code block of the README follows a `<!-- readme-test: KIND -->` line naming who runs it (RUNNERS):
- `run`: the ```python block runs as a script in a fresh interpreter of this env (a tiny checkpoint, a real
  `sglang.Engine(device="cpu")` with the emulated kernels, an RL update, a refused bucket, the weight check: about a
  minute on a 2-core box); `ci/wheel-check` runs it against the installed wheel;
- `http`: the CPU server recipe, run line by line by tests/test_http_server.py (tests/support/http_server.py);
- `install`, `gpu`: run here, as far as a CPU can (`test_the_install_block_runs`, `test_the_gpu_block_runs_...`).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys

import pytest

from sglang_trtllm_moe.sandbox.releases import RL_LOOP_RELEASES

from .support.helpers import REPO

README = REPO / "README.md"
RUN_MARK = "<!-- readme-test: run -->"
#: the README stays a page a newcomer reads in five minutes; the manual is docs/RL.md, docs/CPU.md, docs/COMPAT.md
MAX_LINES = 200
#: who runs each kind of README code block
RUNNERS = {
    "run": "test_readme_example_runs here, and ci/wheel-check against the installed wheel",
    "http": "tests/test_http_server.py (the CPU server recipe, line by line)",
    "install": "test_the_install_block_runs",
    "gpu": "test_the_gpu_block_runs_as_far_as_a_cpu_can",
}
BLOCK = re.compile(r"<!-- readme-test: ([a-z-]+) -->\s*\n```(\w+)\n(.*?)\n```", re.DOTALL)


def block(kind: str) -> list[str]:
    """The commands of the README's block of `kind`, one per line (continuations joined, comments dropped)."""
    from .support.http_server import recipe

    return recipe(README.read_text(), mark=f"<!-- readme-test: {kind} -->")


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
    "weight-update sessions and the weight-checker request (sandbox/releases.py RL_LOOP_RELEASES)",
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


def test_the_readme_is_short_and_every_code_block_in_it_is_run():
    text = README.read_text()
    assert len(text.splitlines()) <= MAX_LINES, f"README.md has {len(text.splitlines())} lines (at most {MAX_LINES})"
    fences = len(re.findall(r"^```\w+$", text, re.MULTILINE))
    marked = BLOCK.findall(text)
    assert len(marked) == fences, f"{fences - len(marked)} README code block(s) with no <!-- readme-test: KIND -->"
    unknown = sorted({kind for kind, _, _ in marked} - set(RUNNERS))
    assert not unknown, f"README blocks of kinds no test runs: {unknown} (RUNNERS: {RUNNERS})"


def _env_with_bin(extra: dict | None = None) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SGLANG_TRTLLM_MOE_")}
    env["PATH"] = os.pathsep.join([os.path.dirname(sys.executable), env.get("PATH", "")])
    env["PYTHONPATH"] = os.pathsep.join([str(REPO)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    env.update(extra or {})
    return env


def test_the_install_block_runs(tmp_path):
    """`pip install <checkout>` (into a scratch target, from a copy of the checkout, so nothing here changes), then
    `sglang-trtllm-moe doctor` (every hook target landed). The wheel route the block's comment names is what
    ci/wheel-check runs: `python -m build`, then the wheel installed in a fresh env."""
    pip, doctor = block("install")
    argv = pip.split()
    assert argv[:2] == ["pip", "install"] and len(argv) == 3, pip
    src, site = tmp_path / "src", tmp_path / "site"
    files = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True).stdout.split(b"\0")
    for name in filter(None, (f.decode() for f in files)):
        if (REPO / name).is_file():
            (src / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, src / name)
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "--target", site, src],
        capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    (info,) = site.glob("sglang_trtllm_moe-*.dist-info")
    assert "trtllm_moe = sglang_trtllm_moe.plugin:register" in (info / "entry_points.txt").read_text()
    assert (site / "sglang_trtllm_moe" / "plugin.py").is_file()
    out = subprocess.run(
        doctor.split(), capture_output=True, text=True, timeout=300, cwd=tmp_path, env=_env_with_bin(), check=False
    )
    assert out.returncode == 0 and "\ntally: " in out.stdout and " 0 missing" in out.stdout, out.stdout[-3000:]


def test_the_gpu_block_runs_as_far_as_a_cpu_can(tmp_path):
    """`explain` runs as written on a tiny model; SGLang's own launcher parser accepts the serve line's every flag
    (the serve itself needs B200s); the ready and stop lines are the CPU recipe's, which tests/test_http_server.py
    runs against a live server."""
    pytest.importorskip("sglang.srt.server_args", reason="the serve line is parsed by the installed SGLang")
    import argparse
    import shlex

    from sglang.srt.server_args import ServerArgs

    from sglang_trtllm_moe.sandbox import checkpoints as ck

    explain, serve, ready, stop = block("gpu")
    model = ck.write(str(tmp_path / "model"), ck.TinySpec(arch="qwen3_moe", quant="nvfp4"))
    argv = shlex.split(explain.replace("$MODEL", model))
    out = subprocess.run(argv, capture_output=True, text=True, timeout=300, env=_env_with_bin(), check=False)
    assert out.returncode == 0 and "flashinfer_trtllm" in out.stdout, (out.stdout[-2000:], out.stderr[-3000:])
    argv = shlex.split(serve.replace("$MODEL", model))
    assert argv[:3] == ["python", "-m", "sglang.launch_server"] and argv[-1] == "&", serve
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    parsed = parser.parse_args(argv[3:-1])
    assert parsed.moe_runner_backend == "flashinfer_trtllm" and parsed.model_path == model, parsed
    http = block("http")
    assert stop == http[-1] == "kill %1", (stop, http[-1])
    wait = [c for c in http if c.startswith("until ")]
    assert wait and ready.split(";")[0] == wait[0].split(";")[0], (ready, wait)


def test_the_cpu_pages_tiny_quants_are_the_registrys():
    """docs/CPU.md lists every tiny-checkpoint quant, with its architectures and how it is served, as the format
    registry declares them (sandbox/tiny_spec.py): a new quant fails here until the page names it."""
    from sglang_trtllm_moe.sandbox import tiny_spec as t

    rows = ["| `--quant` | `--arch` | serve it |", "|---|---|---|"]
    for q in t.QUANTS:
        archs = ", ".join(a for a in t.ARCHS if q in t.SUPPORTED[a])
        served = f"a {t.ONLINE[q][0]} checkpoint, with `--quantization {t.ONLINE[q][1]}`" if q in t.ONLINE else "as is"
        rows.append(f"| `{q}` | {archs} | {served} |")
    text = (REPO / "docs" / "CPU.md").read_text()
    shown = text.split("<!-- tiny-quants:begin", 1)[1].split("-->", 1)[1].split("<!-- tiny-quants:end -->", 1)[0]
    assert shown.strip() == "\n".join(rows), "docs/CPU.md's tiny-quants table should read:\n" + "\n".join(rows)


def test_compat_md_keeps_its_hand_written_part():
    """docs/COMPAT.md is generated, but for what follows matrix.HAND_WRITTEN, which every rendering keeps."""
    from .support import matrix

    text = (REPO / "docs" / "COMPAT.md").read_text()
    assert text.count(matrix.HAND_WRITTEN) == 1
    hand = text.split(matrix.HAND_WRITTEN, 1)[1]
    for heading in ("## What the plugin cannot serve", "## Log lines and what they mean", "## Switching it off"):
        assert heading in hand, heading


def _slug(heading: str) -> str:
    """GitHub's anchor of a Markdown heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


@pytest.mark.parametrize("page", ["README.md", "CONTRIBUTING.md", "docs/RL.md", "docs/CPU.md", "docs/COMPAT.md"])
def test_links_lead_somewhere(page):
    """Every relative link of the page names a file that exists, and its #anchor a heading of that file."""
    path = REPO / page
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.DOTALL)
    bad = []
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if target.startswith(("http://", "https://", "mailto:")):
            continue
        file, _, anchor = target.partition("#")
        dest = (path.parent / file).resolve() if file else path
        if not dest.exists():
            bad.append(target)
        elif anchor and dest.suffix == ".md":
            heads = re.findall(r"^#+ (.+)$", re.sub(r"```.*?```", "", dest.read_text(), flags=re.DOTALL), re.M)
            if anchor not in {_slug(h) for h in heads}:
                bad.append(target)
    assert not bad, f"{page}: links that lead nowhere: {bad}"
