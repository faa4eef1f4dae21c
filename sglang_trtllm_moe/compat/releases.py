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
NEWEST_TESTED = Version("0.5.23")


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
