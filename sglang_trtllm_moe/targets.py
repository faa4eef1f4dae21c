"""SGLang hook targets and the proof that they landed.

SGLang's HookRegistry logs and swallows a failed target (a moved path, a typo, a class attribute that changed
kind), so registering is not evidence. After `apply_hooks` we resolve each dotted path again and look for our hook
inside the wrapper chain that HookRegistry installed (`__wrapped__` links, the hook held in the wrapper's closure).
"""

from __future__ import annotations

import inspect
import pkgutil
from collections.abc import Callable
from dataclasses import dataclass, field

from packaging.specifiers import SpecifierSet
from packaging.version import Version

LANDED = "landed"
MISSING = "missing"
NOT_APPLICABLE = "not_applicable"
#: the target's module was never imported in this process, so the hook waits for it (installer.py)
NOT_IMPORTED = "not_imported"
STATES = (LANDED, MISSING, NOT_APPLICABLE, NOT_IMPORTED)


def module_of(target: str) -> str:
    """The module that defines a dotted target: everything before its first CamelCase part (a class), else all
    but the last part. SGLang's module names are lower case (checked for every built-in target by the tests)."""
    parts = target.split(".")
    for i, p in enumerate(parts[1:], start=1):
        if p[:1].isupper():
            return ".".join(parts[:i])
    return ".".join(parts[:-1])


@dataclass(frozen=True)
class HookTarget:
    #: dotted path HookRegistry resolves, e.g. "sglang.srt.layers.moe.utils.initialize_moe_config"
    target: str
    hook: Callable
    #: "before" | "after" | "around" | "replace" (HookRegistry.HookType values)
    hook_type: str = "around"
    #: the SGLang releases this target exists on (PEP 440 specifier); other releases record "not_applicable"
    releases: str = ""
    #: which capability this serves (for `doctor` and the compat matrix)
    capability: str = "core"
    why: str = ""
    source: str = field(default="", compare=False)
    #: the capability group this target must land with (capabilities.py `GROUPS`); "" = its `capability`
    group: str = field(default="", compare=False)
    #: the weight formats (registry names) whose layers this hook takes over or keeps exact; () = every format whose
    #: `hook_module` registered it (capabilities.py: a format's group)
    formats: tuple[str, ...] = field(default=(), compare=False)
    #: the module that defines the target (derived from the path); the hook is applied when it is imported
    module: str = field(default="", compare=False)

    def __post_init__(self) -> None:
        if not self.module:
            object.__setattr__(self, "module", module_of(self.target))

    def applies_to(self, release: Version) -> bool:
        return not self.releases or SpecifierSet(self.releases).contains(
            Version(release.base_version), prereleases=True
        )


def _resolve_attr(target: str) -> object:
    obj_path, attr = target.rsplit(".", 1)
    obj = pkgutil.resolve_name(obj_path)
    raw = inspect.getattr_static(obj, attr)
    if isinstance(raw, (classmethod, staticmethod)):
        raw = raw.__func__
    return raw


def _chain_holds(fn: object, hook: object) -> bool:
    seen: set[int] = set()
    while fn is not None and id(fn) not in seen:
        seen.add(id(fn))
        if fn is hook:
            return True
        for cell in getattr(fn, "__closure__", None) or ():
            try:
                if cell.cell_contents is hook:
                    return True
            except ValueError:  # empty cell
                pass
        fn = getattr(fn, "__wrapped__", None)
    return False


def target_state(t: HookTarget) -> tuple[str, str]:
    """(state, reason) for a registered target whose module is imported, checked against what is installed now
    (a target still waiting for its module is NOT_IMPORTED: installer.pending says so)."""
    try:
        current = _resolve_attr(t.target)
    except Exception as e:  # noqa: BLE001 - any resolution failure means the hook is not there
        return MISSING, f"cannot resolve {t.target}: {type(e).__name__}: {e}"
    if t.hook_type == "replace" and isinstance(t.hook, type):
        ok = current is t.hook
    else:
        ok = _chain_holds(current, t.hook)
    if ok:
        return LANDED, ""
    return (
        MISSING,
        f"{t.target} resolves, but our {t.hook_type} hook is not in its wrapper chain (HookRegistry did not apply it)",
    )
