"""ci/make-env's post-steps (outside the hashed recipe blocks), run alone against a scratch root, and its listing of
ci/releases.tsv.

`ensure_oracle`: an env whose release pins a flashinfer that cannot be imported on CPU (ci/releases.tsv "-") gets
the newest release's flashinfer, from the directory `ensure_flashinfer` installs once per version (shared with every
env that runs that version), put on the env's path by a .pth; an env with its own importable pin gets nothing;
every call is idempotent. pip is a stand-in here that records its arguments and writes a minimal flashinfer package
(the real install is what ci/make-env runs)."""

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
    from .support.matrix import releases_tsv

    return [r for r in releases_tsv(REPO / "ci" / "releases.tsv") if not r["lane"]][-1]["flashinfer"]


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
    oracle = tmp_path / "root" / f"flashinfer-{pin}"

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


def test_make_env_lists_the_releases_and_lanes_the_matrix_reads():
    """`ci/make-env --releases / --lanes / --newest / --all` (what ci/matrix, ci/test, ci/lint and ci/demo iterate)
    agree with tests/support/matrix.py's reader of the same file; a lane names an existing release and runs another
    flashinfer than that release's pin, with every other column taken from the release ("=")."""
    from .support.matrix import releases_tsv

    def listed(flag):
        out = subprocess.run([str(REPO / "ci" / "make-env"), flag], capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        return out.stdout.split()

    rows = releases_tsv(REPO / "ci" / "releases.tsv")
    releases = [r["release"] for r in rows if not r["lane"]]
    assert listed("--releases") == releases and listed("--newest") == releases[-1:]
    assert listed("--lanes") == [r["release"] for r in rows if r["lane"]]
    assert listed("--all") == [r["release"] for r in rows]
    by_name = {r["release"]: r for r in rows}
    for lane in (r for r in rows if r["lane"]):
        base = by_name[lane["sglang"]]
        assert lane["release"] == f"{base['release']}+flashinfer-{lane['flashinfer']}"
        assert lane["flashinfer"] not in ("-", base["flashinfer"])
        assert all(lane[k] == base[k] for k in ("transformers", "tvm_ffi", "openai", "extra"))


FAKE_PIP_DOWNLOAD = """#!/bin/sh
echo "$@" >> "{log}"
# python -m pip download -q --no-deps --only-binary :all: -d DIR SPEC
while [ $# -gt 0 ]; do
  if [ "$1" = "-d" ]; then dir=$2; shift; fi
  spec=$1; shift
done
printf 'wheel of %s' "$spec" > "$dir/verl-${{spec#*==}}-py3-none-any.whl"
"""


def test_ensure_verl_downloads_the_wheel_once_and_checks_its_digest(tmp_path):
    """`ensure_verl`: verl's wheel (tests/test_verl_delta.py's real client) downloaded once per env root into
    verl-<version>/, its sha256 checked (a wheel with another digest fails and is not marked complete), the path
    printed; a second call downloads nothing."""
    import hashlib

    log = tmp_path / "pip.log"
    (tmp_path / "pip").write_text(FAKE_PIP_DOWNLOAD.format(log=log))
    (tmp_path / "pip").chmod(0o755)
    version = next(line.split("=", 1)[1] for line in _post_block().splitlines() if line.startswith("VERL_VERSION="))
    good = hashlib.sha256(f"wheel of verl=={version}".encode()).hexdigest()

    def ensure(root, digest):
        script = tmp_path / "run.sh"
        script.write_text(_post_block() + f'\nVERL_SHA256={digest}\nensure_verl "{tmp_path}/pip" "{root}"\n')
        return subprocess.run(["bash", str(script)], capture_output=True, text=True, timeout=60)

    bad = ensure(tmp_path / "bad", "0" * 64)
    assert bad.returncode != 0 and not (tmp_path / "bad" / f"verl-{version}" / ".complete").exists()
    for _ in range(2):
        r = ensure(tmp_path / "root", good)
        assert r.returncode == 0, r.stderr
        wheel = tmp_path / "root" / f"verl-{version}" / f"verl-{version}-py3-none-any.whl"
        assert r.stdout.strip() == str(wheel) and wheel.is_file()
    downloads = [line for line in log.read_text().splitlines() if str(tmp_path / "root") in line]
    assert downloads == [f"-m pip download -q --no-deps --only-binary :all: -d {wheel.parent} verl=={version}"]
