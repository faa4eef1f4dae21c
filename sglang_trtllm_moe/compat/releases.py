"""The release gate: which SGLang releases the plugin runs on.

0.5.11 is the first release with `sglang.srt.plugins` (entry-point loading + HookRegistry), so nothing older can
load us at all. Releases newer than the newest we test still run — the hook targets are checked one by one after
they are applied, so a moved path shows up as "missing" in `doctor` instead of silently doing nothing.
"""

from __future__ import annotations

import importlib.metadata
from dataclasses import dataclass

from packaging.version import InvalidVersion, Version

OLDEST_SUPPORTED = Version("0.5.11")

# >>> tested (generated from ci/releases.tsv by ci/add-release; tests/test_compat_release.py checks that they agree)
#: every SGLang release the CI matrix runs, with the flashinfer-python versions it runs that release with (its
#: pin, and the newest flashinfer on the newest release); none where the release's pin cannot be imported on CPU
TESTED: dict[str, tuple[str, ...]] = {
    "0.5.11": (),
    "0.5.12": (),
    "0.5.13": (),
    "0.5.14": (),
    "0.5.15": (),
    "0.5.16": ("0.6.14",),
    "0.5.17": ("0.6.15.post1",),
    "0.5.18": ("0.6.17",),
    "0.5.19": ("0.6.18",),
    "0.5.20": ("0.6.18",),
    "0.5.21": ("0.6.18",),
    "0.5.22": ("0.7.1",),
    "0.5.23": ("0.7.2.post1", "0.7.4"),
}
# <<< tested

NEWEST_TESTED = max(map(Version, TESTED))


@dataclass(frozen=True)
class ReleaseStatus:
    version: Version | None
    #: "tested" | "untested" (newer than NEWEST_TESTED: runs) | "unsupported" (older: stands down) | "missing"
    status: str
    message: str

    @property
    def runs(self) -> bool:
        return self.status in ("tested", "untested")


def installed_version() -> Version | None:
    try:
        return Version(importlib.metadata.version("sglang"))
    except (importlib.metadata.PackageNotFoundError, InvalidVersion):
        return None


def check_release(version: Version | str | None = None) -> ReleaseStatus:
    if version is None:
        version = installed_version()
    elif isinstance(version, str):
        version = Version(version)
    if version is None:
        return ReleaseStatus(None, "missing", "sglang is not installed: the plugin registers nothing")
    # Compare on the release tuple so 0.5.23.post1 or a dev build of 0.5.23 counts as 0.5.23.
    base = Version(version.base_version)
    if base < OLDEST_SUPPORTED:
        return ReleaseStatus(
            version,
            "unsupported",
            f"sglang {version} is older than {OLDEST_SUPPORTED}, the first release with a plugin framework: "
            f"the plugin registers nothing (upgrade sglang to >= {OLDEST_SUPPORTED})",
        )
    if base > NEWEST_TESTED:
        return ReleaseStatus(
            version,
            "untested",
            f"sglang {version} is newer than the newest tested release {NEWEST_TESTED}: running; "
            "check `sglang-trtllm-moe doctor` for hook targets that moved",
        )
    return ReleaseStatus(version, "tested", f"sglang {version} is a tested release")


@dataclass(frozen=True)
class FlashinferStatus:
    version: str | None
    #: "tested" (the CI matrix runs this SGLang release with this flashinfer) | "untested" | "missing"
    status: str
    message: str


def installed_flashinfer() -> str | None:
    try:
        return importlib.metadata.version("flashinfer-python")
    except importlib.metadata.PackageNotFoundError:
        return None


def check_flashinfer(sglang: Version | str | None = None, flashinfer: str | None = None) -> FlashinferStatus:
    """Whether the CI matrix runs `sglang` (default: the installed release) with `flashinfer` (default: the
    installed flashinfer-python). Untested is not refused: users upgrade flashinfer for a kernel fix, and the
    plugin checks every hook target it applies either way; this says whether the matrix vouches for the pair."""
    if sglang is None:
        sglang = installed_version()
    if flashinfer is None:
        flashinfer = installed_flashinfer()
    if flashinfer is None:
        return FlashinferStatus(None, "missing", "flashinfer-python is not installed: the kernels cannot run")
    if sglang is None:
        return FlashinferStatus(flashinfer, "untested", "sglang is not installed")
    release = Version(Version(str(sglang)).base_version)
    tested = TESTED.get(str(release))
    if tested is None:
        return FlashinferStatus(
            flashinfer, "untested", f"flashinfer {flashinfer}: sglang {sglang} is not a release the CI matrix runs"
        )
    if Version(flashinfer) in {Version(v) for v in tested}:
        return FlashinferStatus(flashinfer, "tested", f"flashinfer {flashinfer} is tested with sglang {release}")
    ran = (
        f"the CI matrix runs sglang {release} with flashinfer {', '.join(tested)}"
        if tested
        else f"the CI matrix runs sglang {release} without flashinfer: its pin cannot be imported on CPU"
    )
    return FlashinferStatus(
        flashinfer,
        "untested",
        f"flashinfer {flashinfer} is untested with sglang {release} ({ran})",
    )
