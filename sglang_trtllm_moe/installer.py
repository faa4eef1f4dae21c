"""Hand each hook target to SGLang's HookRegistry when the module that defines it is imported, not before.

Why: SGLang's `load_plugins()` ends in `HookRegistry.apply_hooks()`, which imports the module of every registered
target. Registering all of ours up front made every SGLang process import FusedMoE, the quant methods, the weight
updater and checker (~2,400 modules, +2.7 to +4.0 s of CPU and +138 MiB in a launcher-like process) although the
launcher, the detokenizer and the data-parallel controller never build a MoE layer.

So a target whose module is already imported is registered at once (SGLang's own `apply_hooks` applies it); every
other target waits for its module: an import-system finder sees that module being loaded and, as soon as its code
has run and before the `import` statement that asked for it returns, registers the target with HookRegistry and
applies it with HookRegistry's own machinery (the same wrapper chain, class-attribute handling and `from X import Y`
propagation as `apply_hooks`). Nothing can use the module before that, so no MoE layer is ever built unhooked.
"Landed" keeps its meaning: `targets.target_state` checks the wrapper chain after the fact; a target whose module
was never imported in this process is reported as such (`NOT_IMPORTED`), not as missing.
"""

from __future__ import annotations

import importlib.abc
import logging
import sys
import threading
from collections.abc import Callable

from .targets import HookTarget

logger = logging.getLogger("sglang_trtllm_moe")

_LOCK = threading.RLock()
#: module name -> targets waiting for it, with the HookRegistry source they were registered under
_PENDING: dict[str, list[tuple[HookTarget, object]]] = {}
#: bumped whenever targets are handed to HookRegistry (capabilities.py re-decides what it decided before)
_GENERATION = [0]


def generation() -> int:
    return _GENERATION[0]


def _imported(module: str) -> bool:
    return module in sys.modules


def _register_and_apply(targets: list[tuple[HookTarget, object]]) -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    _GENERATION[0] += 1

    for t, source in targets:
        HookRegistry.register(t.target, t.hook, HookType(t.hook_type), source=source)
    for t, _ in targets:
        if t.target in HookRegistry._patched:
            continue
        try:
            HookRegistry._apply_target(t.target, HookRegistry._hooks[t.target])
            HookRegistry._patched.add(t.target)
        except Exception:  # noqa: BLE001 - exactly what apply_hooks does: log; doctor reports it missing
            logger.exception("sglang-trtllm-moe: failed to apply hooks to %s", t.target)


def _on_imported(module: str) -> None:
    with _LOCK:
        targets = _PENDING.pop(module, None)
    if targets:
        try:
            _register_and_apply(targets)
        except Exception:  # noqa: BLE001 - HookRegistry itself changed: never break the import that called us
            logger.exception(
                "sglang-trtllm-moe: could not hand the hooks of %s to SGLang's HookRegistry; doctor reports them "
                "missing",
                module,
            )


class _AfterImport(importlib.abc.MetaPathFinder):
    """Finds nothing itself: for a module with pending targets it asks the other finders, then makes the loader
    call back once the module's code has run."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname not in _PENDING:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        loader = spec.loader
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        exec_module: Callable = loader.exec_module

        def exec_then_hook(module, _exec=exec_module, _name=fullname):
            _exec(module)
            _on_imported(_name)

        try:  # a loader instance belongs to this one spec (SourceFileLoader, ExtensionFileLoader)
            loader.exec_module = exec_then_hook  # type: ignore[method-assign]  # patches this one loader instance
        except (AttributeError, TypeError):
            return spec  # a loader we cannot instrument: apply_hooks-on-demand below still covers it
        return spec


_FINDER = _AfterImport()


def install(targets: list[HookTarget], source: object = None) -> tuple[list[HookTarget], list[HookTarget]]:
    """Register `targets` with SGLang's HookRegistry now where their module is imported, else when it is.

    Returns (registered now, deferred)."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    now, later = [], []
    with _LOCK:
        for t in targets:
            if _imported(t.module):
                HookRegistry.register(t.target, t.hook, HookType(t.hook_type), source=source)
                now.append(t)
            else:
                _PENDING.setdefault(t.module, []).append((t, source))
                later.append(t)
        if _PENDING and _FINDER not in sys.meta_path:
            sys.meta_path.insert(0, _FINDER)
    # A module imported between the check above and the finder's insertion would never call back: catch up.
    for module in [m for m in list(_PENDING) if _imported(m)]:
        _on_imported(module)
    return now, later


def pending(target: HookTarget) -> bool:
    """True while `target` waits for its module (not imported in this process yet)."""
    with _LOCK:
        return any(t is target for t, _ in _PENDING.get(target.module, ()))


def importable(module: str) -> bool | None:
    """Can `module` be imported under that name in this process? Asked without importing anything: True when it is
    imported, else importlib.util.find_spec's answer once its parent package is imported (the module itself is not
    run); None when that parent is not imported either (finding out would import it: start-up stays free). False
    for a module a release moved or removed: a target waiting for it would wait forever, so it counts as missing
    (targets.MISSING), not as not imported."""
    import importlib.util

    if module in sys.modules:
        return True
    parent = module.rpartition(".")[0]
    if parent and parent not in sys.modules:
        return None
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a parent that is not a package
        return False


def import_all(modules: list[str] | None = None) -> list[str]:
    """Import every module that still has waiting targets (what `doctor` does to prove they land), or those of
    `modules` that do (capabilities.py, deciding at first use). Returns the modules that could not be imported,
    with the error."""
    import importlib

    failed = []
    for module in [m for m in list(_PENDING) if modules is None or m in modules]:
        try:
            importlib.import_module(module)
        except Exception as e:  # noqa: BLE001 - reported, the targets stay not imported
            failed.append(f"{module}: {type(e).__name__}: {e}")
            continue
        _on_imported(module)  # a no-op unless the module came in without our finder seeing it
    return failed


def forget(targets: list[HookTarget]) -> None:
    """Stop waiting for the modules of `targets` (tests that registered targets of a module that never comes)."""
    with _LOCK:
        for t in targets:
            waiting = [(w, src) for w, src in _PENDING.get(t.module, ()) if w is not t]
            if waiting:
                _PENDING[t.module] = waiting
            else:
                _PENDING.pop(t.module, None)


def reset_for_tests() -> None:
    """Forget every pending target and remove the import finder (tests only; `plugin.reset_for_tests` calls it)."""
    with _LOCK:
        _PENDING.clear()
        if _FINDER in sys.meta_path:
            sys.meta_path.remove(_FINDER)
