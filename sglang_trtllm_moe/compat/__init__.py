"""What differs between SGLang releases, in one place.

Every release-dependent fact the plugin relies on (is this release supported, which dotted path to hook, how to
fake a platform in tests) is looked up here with `packaging` specifiers instead of `if version < ...` scattered
through the code, so adding a release means adding table rows.
"""

from .releases import (
    NEWEST_TESTED,
    OLDEST_SUPPORTED,
    TESTED,
    FlashinferStatus,
    ReleaseStatus,
    check_flashinfer,
    check_release,
    installed_flashinfer,
    installed_version,
)

__all__ = [
    "NEWEST_TESTED",
    "OLDEST_SUPPORTED",
    "TESTED",
    "FlashinferStatus",
    "ReleaseStatus",
    "check_flashinfer",
    "check_release",
    "installed_flashinfer",
    "installed_version",
]
