"""Small helpers shared by tests: run code in a fresh interpreter of this env (SGLang's plugin loading and
HookRegistry are once-per-process globals, so anything that loads plugins runs in its own process)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def run_python(code: str, env: dict | None = None, pythonpath: list[str] | None = None, timeout: int = 240):
    full_env = dict(os.environ)
    for k in list(full_env):
        if k.startswith("SGLANG_TRTLLM_MOE_") or k == "SGLANG_PLUGINS":
            del full_env[k]
    full_env.update(env or {})
    paths = [str(p) for p in (pythonpath or [])] + [str(REPO)]
    if full_env.get("PYTHONPATH"):
        paths.append(full_env["PYTHONPATH"])
    full_env["PYTHONPATH"] = os.pathsep.join(paths)
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        env=full_env,
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=str(REPO),
    )


def run_module(module: str, *args: str, timeout: int) -> subprocess.CompletedProcess:
    """`python -m module args` in this environment from the checkout (REPO first on PYTHONPATH), output captured: how
    the tests run a worker that prints one JSON report (read it with `last_json`)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])}
    return subprocess.run(
        [sys.executable, "-m", module, *args],
        cwd=str(REPO),
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        check=False,
    )


def fork_json(out: str, work) -> int:
    """Fork a child of this (prepared, preloaded) process that writes `work()` as JSON to `out` and leaves without
    the parent's exit handlers: exit 0, or 1 with the traceback on stderr. Returns the child's pid (the caller
    waits)."""
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid:
        return pid
    code = 0
    try:
        result = work()
        with open(out, "w") as f:
            json.dump(result, f, default=str)
    except BaseException:  # noqa: BLE001 - reported through the exit code and stderr
        traceback.print_exc()
        code = 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def last_json(proc) -> dict:
    """The last stdout line that parses as JSON (SGLang may print its own lines before it)."""
    lines = proc.stdout.strip().splitlines()
    for i in reversed(range(len(lines))):
        if not lines[i].startswith("{"):
            continue
        for chunk in (lines[i], "\n".join(lines[i:])):  # one-line JSON, or an indented document to the end
            try:
                return json.loads(chunk)
            except ValueError:
                pass
    raise AssertionError(f"no JSON in output\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr[-4000:]}")


def make_distribution(root: Path, name: str, version: str, entry_points: str = "", modules: dict | None = None) -> Path:
    """Write an installed distribution as importlib.metadata sees one (a *.dist-info folder) plus its modules.

    This is the real discovery path: `entry_points(group=...)` and `version(...)` read these files exactly as
    they read a pip-installed package."""
    root.mkdir(parents=True, exist_ok=True)
    info = root / f"{name.replace('-', '_')}-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    if entry_points:
        (info / "entry_points.txt").write_text(textwrap.dedent(entry_points))
    for mod, src in (modules or {}).items():
        (root / f"{mod}.py").write_text(textwrap.dedent(src))
    return root
