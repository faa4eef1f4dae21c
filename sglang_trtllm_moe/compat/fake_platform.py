"""Make SGLang see a GPU of a given SM on a machine without one: the one place that fakes a platform.

The product needs it itself: `explain --sm N` runs SGLang's own resolution as it would run on such a GPU (a test
harness that fakes a GPU for a whole process uses the same `rebind` / `legacy_tables`). How a release asks "which
GPU is this?" is a release difference (compat.features.PLATFORM_OVERRIDE):
0.5.19+ read `runtime_context.get_platform()`, which `override_platform(**facts)` fakes; before, lru-cached
`is_sm100_supported()`-style functions in `sglang.srt.utils.common` are imported by name into many modules, so the
fake is bound wherever the original is.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator

from . import features

#: Platform facts SGLang 0.5.23 reads (`runtime_context._PLATFORM_PROBES`), per faked SM. Every flag is given
#: explicitly so a faked SM90 on a real Blackwell box still reads as SM90.
_FLAGS = (
    "is_sm90",
    "is_sm100",
    "is_sm100_or_sm110",
    "is_sm110",
    "is_sm120",
    "is_blackwell",
    "is_hopper_with_cuda_12_3",
)


def platform_facts(sm: int) -> dict:
    major, minor = divmod(int(sm), 10)
    facts: dict[str, bool | int | tuple[int, int]] = {f: False for f in _FLAGS}
    if major == 10:
        facts.update(is_sm100=True, is_sm100_or_sm110=True, is_blackwell=True)
    elif major == 11:
        facts.update(is_sm110=True, is_sm100_or_sm110=True, is_blackwell=True)
    elif major == 12:
        facts.update(is_sm120=True, is_blackwell=True)
    elif major == 9:
        facts.update(is_sm90=True)
    facts["device_capability"] = (major, minor)
    facts["device_sm"] = int(sm)
    return facts


def _probe_values(sm: int) -> dict:
    """The same facts as the pre-0.5.19 probe functions answer them."""
    f = platform_facts(sm)
    return {
        "is_sm90_supported": f["is_sm90"],
        "is_sm100_supported": f["is_sm100"],
        "is_sm120_supported": f["is_sm120"],
        "is_blackwell_supported": f["is_blackwell"],
        "is_blackwell": f["is_blackwell"],
        "get_device_sm": f["device_sm"],
        "get_device_capability": f["device_capability"],
    }


class _Answer:
    """A platform probe's stand-in: answers `value` whatever the arguments."""

    def __init__(self, value: object) -> None:
        self.value = value

    def __call__(self, *args: object, **kwargs: object) -> object:
        return self.value

    def cache_clear(self) -> None:
        """Callers of the lru-cached originals may clear them: nothing to clear here."""


def _answer(value: object) -> _Answer:
    return _Answer(value)


def rebind(table_from: dict, table_to: dict) -> None:
    """In every loaded sglang module (and `common` itself, so later imports bind it), each name bound to
    table_from[name] is rebound to table_to[name] — what HookRegistry's `_propagate_patch` does for its hooks."""
    for mod in list(sys.modules.values()):
        if not getattr(mod, "__name__", "").startswith("sglang"):
            continue
        for name in table_from:
            if getattr(mod, name, None) is table_from[name]:
                setattr(mod, name, table_to[name])


def legacy_tables(values: dict) -> tuple[dict, dict]:
    """Before 0.5.19: (the probe functions of `sglang.srt.utils.common` named in `values`, their stand-ins answering
    `values[name]`), for `rebind`."""
    from sglang.srt.utils import common

    originals = {name: getattr(common, name) for name in values if hasattr(common, name)}
    return originals, {name: _answer(values[name]) for name in originals}


@contextlib.contextmanager
def fake_platform(sm: int) -> Iterator[None]:
    """SGLang sees an SM `sm` GPU inside the block; everything as it was after."""
    if not features.PLATFORM_OVERRIDE.present():
        originals, fakes = legacy_tables(_probe_values(sm))
        rebind(originals, fakes)
        try:
            yield
        finally:
            # also the modules first imported inside the block: they copied the fakes by name and must not keep them
            rebind(fakes, originals)
        return
    from sglang.srt import runtime_context as rc

    with rc.override_platform(**_known_facts(rc, sm)):
        yield


def _known_facts(rc, sm: int) -> dict:
    """Each release knows its own set of facts (0.5.19-0.5.21 have no is_sm110) and rejects unknown ones; a fact
    the release does not know is one nothing in it reads, so it is dropped rather than faked."""
    known = set(getattr(rc, "_PLATFORM_PROBES", {})) | set(getattr(rc, "_PLATFORM_VALUES", {}))
    return {k: v for k, v in platform_facts(sm).items() if not known or k in known}


__all__ = ["fake_platform", "legacy_tables", "platform_facts", "rebind"]
