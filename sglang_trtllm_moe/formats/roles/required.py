"""How a role says "every format MUST define this": data members default to `MUST` (methods are abstract).

Abstract methods are enforced by `abc` when a format is instantiated; data members cannot be (a format may set its
name per instance, as `Fp8PerTensor` does), so the registry asks `missing()` of each registered format at import
and refuses one that left a required member unset, naming it.
"""

from __future__ import annotations

from typing import Any


class _Must:
    """The value of a required data member no format has set yet."""

    def __repr__(self) -> str:
        return "<MUST be defined by the format>"

    def __bool__(self) -> bool:
        return False


#: the default of every data member a format MUST define
MUST: Any = _Must()


def required_members(cls: type) -> tuple[str, ...]:
    """Every data member a role of `cls` declares required (each role's `REQUIRED`), in MRO order."""
    names: list[str] = []
    for klass in cls.__mro__:
        names.extend(n for n in vars(klass).get("REQUIRED", ()) if n not in names)
    return tuple(names)


def missing(obj: object) -> tuple[str, ...]:
    """The required data members `obj` (a format instance) leaves unset, and its abstract methods."""
    unset = tuple(n for n in required_members(type(obj)) if getattr(obj, n, MUST) is MUST)
    return unset + tuple(sorted(getattr(type(obj), "__abstractmethods__", ())))
