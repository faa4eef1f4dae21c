"""The command line says what it knows (issue #54): `--version` with what the plugin runs with, and the sandbox
commands (`tiny-checkpoint`, `demo`) name what to install when a package they need is missing — one line, exit 2,
before anything starts — instead of a traceback halfway through.

A package is made missing the cheap way: the command runs in a fresh interpreter of this env whose `sys.modules`
holds None for it (Python's own marker for "import fails"), so the same env stands for one without it.
"""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys

import pytest

import sglang_trtllm_moe

from .support.helpers import REPO


def _run_without(missing: tuple[str, ...], argv: list[str]) -> subprocess.CompletedProcess:
    code = (
        "import sys\n"
        f"for name in {missing!r}:\n"
        "    sys.modules[name] = None\n"
        "from sglang_trtllm_moe.cli import main\n"
        f"sys.exit(main({argv!r}))\n"
    )
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=str(REPO), check=False
    )


def test_version_names_the_plugin_and_what_it_runs_with():
    proc = subprocess.run(
        [sys.executable, "-m", "sglang_trtllm_moe", "--version"], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    line = proc.stdout.strip()
    assert line.startswith(f"sglang-trtllm-moe {sglang_trtllm_moe.__version__} (") and "\n" not in line, line
    for dist in ("sglang", "flashinfer-python", "torch"):
        try:
            version = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            version = "not installed"
        assert f"{dist} {version}" in line, (dist, line)


TINY = ["tiny-checkpoint", "--arch", "qwen3_moe", "--quant", "nvfp4", "--out", "OUT"]


@pytest.mark.parametrize(
    "missing, argv, named",
    [
        (("safetensors",), TINY, "safetensors"),
        (("tokenizers",), TINY, "tokenizers"),
        (("sglang", "safetensors"), ["demo"], "sglang, safetensors"),
        (("sglang",), ["demo"], "sglang"),
    ],
)
def test_sandbox_commands_say_what_to_install(tmp_path, missing, argv, named):
    out = tmp_path / "tiny"
    proc = _run_without(missing, [str(out) if a == "OUT" else a for a in argv])
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    line = proc.stderr.strip()
    assert "\n" not in line and f"sglang-trtllm-moe {argv[0]} needs {named}, not installed here: pip install " in line
    assert line.split("pip install ", 1)[1].split(",")[0].split() == named.replace(",", "").split(), line
    assert not out.exists() and not (tmp_path / "sglang-engine.log").exists()
    if argv[0] == "demo":
        assert "ci/make-env" in line, line
