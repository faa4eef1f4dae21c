"""ci/make-env's post-steps (outside the hashed recipe blocks), run alone against a scratch root.

`ensure_oracle`: an env whose release pins a flashinfer that cannot be imported on CPU (ci/releases.tsv "-") gets
the newest row's flashinfer, installed once into a directory shared by such envs and put on the env's path by a
.pth; an env with its own importable pin gets nothing; every call is idempotent. pip is a stand-in here that
records its arguments and writes a minimal flashinfer package (the real install is what ci/make-env runs)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

from .support.helpers import REPO

FAKE_PIP = """#!/bin/sh
echo "$@" >> "{log}"
# python -m pip install -q --no-deps --target DIR SPEC
while [ $# -gt 0 ]; do
  if [ "$1" = "--target" ]; then target=$2; shift; fi
  spec=$1; shift
done
mkdir -p "$target/flashinfer"
echo "__version__ = '${{spec#*==}}'" > "$target/flashinfer/__init__.py"
"""


def _post_block() -> str:
    text = (REPO / "ci" / "make-env").read_text()
    start, end = text.index("# >>> post"), text.index("# <<< post")
    return text[start:end]


def _ensure(tmp_path, fi: str, venv):
    script = tmp_path / "run.sh"
    script.write_text(
        _post_block() + f'\nensure_oracle "{tmp_path}/pip" "{venv}" "{tmp_path}/root" "{REPO}/ci/releases.tsv" "{fi}"\n'
    )
    return subprocess.run(["bash", str(script)], capture_output=True, text=True, timeout=60)


def _newest_pin() -> str:
    rows = [
        line.split()
        for line in (REPO / "ci" / "releases.tsv").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    return rows[-1][4]


def test_ensure_oracle_puts_the_newest_flashinfer_on_the_path_of_envs_without_their_own(tmp_path):
    log = tmp_path / "pip.log"
    (tmp_path / "pip").write_text(FAKE_PIP.format(log=log))
    (tmp_path / "pip").chmod(0o755)
    (tmp_path / "root").mkdir()
    venvs = {}
    for name in ("old", "new"):
        venvs[name] = tmp_path / name
        subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venvs[name])], check=True, timeout=120)
    pin = _newest_pin()
    oracle = tmp_path / "root" / f"flashinfer-oracle-{pin}"

    for _ in range(2):  # idempotent: the second call installs nothing and rewrites nothing
        r = _ensure(tmp_path, "-", venvs["old"])
        assert r.returncode == 0, r.stderr
    assert log.read_text().splitlines() == [f"-m pip install -q --no-deps --target {oracle} flashinfer-python=={pin}"]
    assert (oracle / ".complete").exists()
    found = subprocess.run(
        [
            str(venvs["old"] / "bin" / "python"),
            "-c",
            textwrap.dedent("""
        import flashinfer; print(flashinfer.__file__); print(flashinfer.__version__)"""),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert found.returncode == 0, found.stderr
    origin, version = found.stdout.split()
    assert origin.startswith(str(oracle)) and version == pin

    r = _ensure(tmp_path, "0.6.14", venvs["new"])  # a release with its own importable pin: untouched
    assert r.returncode == 0, r.stderr
    assert len(log.read_text().splitlines()) == 1
    none = subprocess.run(
        [str(venvs["new"] / "bin" / "python"), "-c", "import flashinfer"], capture_output=True, text=True, timeout=60
    )
    assert none.returncode != 0 and "No module named 'flashinfer'" in none.stderr
