"""`register()`: what SGLang's `load_plugins()` calls through the `sglang.srt.plugins` entry point.

It builds a pluggy PluginManager, registers the built-in capability modules exactly as extensions are registered,
loads extensions from our own entry-point group (filtered by SGLANG_TRTLLM_MOE_LOAD_PLUGINS; the entry points this
distribution declares itself are parts of the plugin and always loaded), collects the SGLang hook targets they
declare for the running release, hands them to SGLang's HookRegistry, and then lets every extension set the process
up (`process_setup`). It never raises into SGLang: a failure of the plugin itself is logged once and the plugin
stands down; a failing extension is recorded and skipped, the built-ins keep working.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import logging
import os
from dataclasses import dataclass, field

import pluggy
from packaging.utils import canonicalize_name
from packaging.version import Version

from . import PROJECT_NAME, env, hookspecs, installer
from .compat import ReleaseStatus, check_release
from .targets import LANDED, MISSING, NOT_APPLICABLE, NOT_IMPORTED, HookTarget, target_state

logger = logging.getLogger(PROJECT_NAME)

ENV_DISABLE = "SGLANG_TRTLLM_MOE_DISABLE"
ENV_LOAD_PLUGINS = "SGLANG_TRTLLM_MOE_LOAD_PLUGINS"
EXTENSION_GROUP = PROJECT_NAME
#: this distribution: the extensions it declares in its own entry-point group are parts of the plugin (each switched
#: on by its own settings), loaded whatever SGLANG_TRTLLM_MOE_LOAD_PLUGINS allows of third-party ones
DISTRIBUTION = "sglang-trtllm-moe"

#: Built-in capabilities that are not a weight format's, registered the same way as extensions (one module per
#: capability). Each format declares its own hook module (`WeightFormat.hook_module`): `builtin_modules()`.
CORE_MODULES = (
    "sglang_trtllm_moe.builtins.loader_hooks",
    "sglang_trtllm_moe.builtins.runner_hooks",
    "sglang_trtllm_moe.builtins.weight_updates",
    "sglang_trtllm_moe.builtins.sessions",
    "sglang_trtllm_moe.builtins.remote_instance",
    "sglang_trtllm_moe.builtins.runner_requests",
    "sglang_trtllm_moe.builtins.draft_updates",
    "sglang_trtllm_moe.builtins.selection_hooks",
    "sglang_trtllm_moe.builtins.checker_hooks",
    "sglang_trtllm_moe.builtins.checker_legacy_hooks",
)


def builtin_modules() -> tuple[str, ...]:
    """Every built-in module, in registration order: the loader hooks, each format family's quant-method hooks (in
    registry order, from the formats' own declarations), then the other capabilities. Imports the registry, so it is
    asked at `register()`, not at import (the CLI's `doctor` imports this module without torch)."""
    from .formats import FORMATS

    families = tuple(dict.fromkeys(f.hook_module for f in FORMATS))
    return (*CORE_MODULES[:1], *families, *CORE_MODULES[1:])


@dataclass
class Extension:
    name: str
    value: str
    dist: str | None
    #: "loaded" | "failed" | "skipped" (not in the allowlist)
    state: str
    error: str = ""


@dataclass
class PluginState:
    #: "not_loaded" | "enabled" | "disabled" (env switch) | "stood_down" (unsupported release or own failure)
    status: str = "not_loaded"
    reason: str = ""
    release: ReleaseStatus | None = None
    targets: list[HookTarget] = field(default_factory=list)
    not_applicable: list[HookTarget] = field(default_factory=list)
    extensions: list[Extension] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    #: what each extension set up in this process (`process_setup`), by its entry-point name; empty when none did
    set_up: dict[str, str] = field(default_factory=dict)

    @property
    def enabled(self) -> bool:
        return self.status == "enabled"

    def target_report(self) -> list[dict]:
        """Per target: landed / missing / not_applicable, checked now (call after SGLang's apply_hooks)."""
        rows = []
        for t in self.targets:
            rows.append(_row(t, *current_state(t)))
        for t in self.not_applicable:
            assert self.release is not None  # not_applicable is filled only once a release was checked
            rows.append(_row(t, NOT_APPLICABLE, f"not present in sglang {self.release.version} (needs {t.releases})"))
        return rows


def current_state(t: HookTarget) -> tuple[str, str]:
    """(state, reason) of a registered target now: landed / missing, or not_imported while it waits for a module
    that can still be imported (one that cannot is missing: it moved, or is gone)."""
    if installer.pending(t):
        if installer.importable(t.module) is False:
            return MISSING, (
                f"{t.module} cannot be imported under that name (moved or removed in this SGLang): the hook waiting "
                "for it would never be applied"
            )
        return NOT_IMPORTED, (
            f"{t.module} is not imported in this process: the hook is applied when it is (`sglang-trtllm-moe "
            "doctor` imports it to prove that)"
        )
    return target_state(t)


def _row(t: HookTarget, state: str, reason: str) -> dict:
    return {
        "target": t.target,
        "module": t.module,
        "state": state,
        "reason": reason,
        "capability": t.capability,
        "hook_type": t.hook_type,
        "source": t.source,
        "group": t.group or t.capability,
    }


_STATE = PluginState()


def state() -> PluginState:
    return _STATE


def _allowlist() -> set[str] | None:
    raw = os.environ.get(ENV_LOAD_PLUGINS)
    if raw is None:
        return None  # unset: every installed extension
    return {x.strip() for x in raw.split(",") if x.strip()}  # empty string: none


def _ours(dist: str | None) -> bool:
    return dist is not None and canonicalize_name(dist) == DISTRIBUTION


def load_extensions(pm: pluggy.PluginManager) -> list[Extension]:
    """Register every extension of our entry-point group with `pm` (as `ext:<name>`), each isolated: one that fails
    to load is recorded and skipped. Third-party ones are filtered by SGLANG_TRTLLM_MOE_LOAD_PLUGINS; this
    distribution's own are parts of the plugin and always registered. `register()` and the command line both call
    it."""
    allowed = _allowlist()
    out = []
    for ep in importlib.metadata.entry_points(group=EXTENSION_GROUP):
        dist = ep.dist.name if ep.dist else None
        if allowed is not None and ep.name not in allowed and not _ours(dist):
            out.append(Extension(ep.name, ep.value, dist, "skipped", f"not in {ENV_LOAD_PLUGINS}"))
            continue
        try:
            pm.register(ep.load(), name=f"ext:{ep.name}")
            out.append(Extension(ep.name, ep.value, dist, "loaded"))
        except Exception as e:  # noqa: BLE001 - an extension must never break SGLang or the built-ins
            logger.warning("sglang-trtllm-moe: extension %r (%s) failed to load, skipped: %s", ep.name, ep.value, e)
            out.append(Extension(ep.name, ep.value, dist, "failed", f"{type(e).__name__}: {e}"))
    return out


def _collect_targets(pm: pluggy.PluginManager, release: Version, st: PluginState) -> list[HookTarget]:
    """Ask every plugin for its targets, one plugin at a time so a broken extension is isolated."""
    collected: list[HookTarget] = []
    for impl in pm.hook.register_sglang_hooks.get_hookimpls():
        name = impl.plugin_name
        mine: list[HookTarget] = []

        def register_target(t: HookTarget, _mine: list[HookTarget] = mine, _name: str = name) -> None:
            if not isinstance(t, HookTarget):
                raise TypeError(f"register() takes a HookTarget, got {type(t).__name__}")
            object.__setattr__(t, "source", _name)
            _mine.append(t)

        try:
            impl.function(register=register_target, release=release)
        except Exception as e:  # noqa: BLE001
            if name.startswith("ext:"):
                msg = (
                    f"extension {name[4:]!r} failed in register_sglang_hooks, its targets are skipped: "
                    f"{type(e).__name__}: {e}"
                )
                logger.warning("sglang-trtllm-moe: %s", msg)
                st.errors.append(msg)
                for ext in st.extensions:
                    if f"ext:{ext.name}" == name:
                        ext.state, ext.error = "failed", f"{type(e).__name__}: {e}"
                continue
            raise  # a built-in failing is our bug: stand down as a whole
        collected.extend(mine)
    return collected


def _set_up_process(pm: pluggy.PluginManager, release: Version, st: PluginState) -> None:
    """Each extension's `process_setup`, one at a time (a failing one is recorded, the others and the built-ins
    keep working). After the hook targets are installed, so the modules a set-up imports are hooked as they load."""
    for impl in pm.hook.process_setup.get_hookimpls():
        name = impl.plugin_name.removeprefix("ext:")
        try:
            done = impl.function(release=release)
        except Exception as e:  # noqa: BLE001 - an extension's set-up must not take the plugin down; say what to fix
            msg = f"extension {name!r} did not set this process up: {type(e).__name__}: {e}"
            logger.warning("sglang-trtllm-moe: %s", msg)
            st.errors.append(msg)
            continue
        if done:
            st.set_up[name] = str(done)
            logger.info("sglang-trtllm-moe: %s", done)


def register() -> None:
    """SGLang entry point. Idempotent, cheap, never raises."""
    global _STATE
    if _STATE.status != "not_loaded":
        return
    st = PluginState()
    try:
        if env.flag(ENV_DISABLE):
            st.status, st.reason = "disabled", f"{ENV_DISABLE}=1: nothing registered"
            logger.info("sglang-trtllm-moe: %s", st.reason)
            return
        st.release = check_release()
        release = st.release.version
        if not st.release.runs or release is None:  # a release that runs always has a version
            st.status, st.reason = "stood_down", st.release.message
            logger.warning("sglang-trtllm-moe: %s", st.reason)
            return
        if st.release.status == "untested":
            logger.warning("sglang-trtllm-moe: %s", st.release.message)

        pm = pluggy.PluginManager(PROJECT_NAME)
        pm.add_hookspecs(hookspecs)
        for mod in builtin_modules():
            pm.register(importlib.import_module(mod), name=mod)
        st.extensions = load_extensions(pm)
        targets = _collect_targets(pm, release, st)

        for t in targets:
            (st.targets if t.applies_to(release) else st.not_applicable).append(t)
        # Each target goes to SGLang's HookRegistry when its module is imported (start-up stays free in processes
        # that never build a MoE layer); SGLang's source for this plugin is kept for its logs.
        from sglang.srt.plugins.hook_registry import _current_plugin_source

        installer.install(st.targets, source=_current_plugin_source.get())
        st.status = "enabled"
        _set_up_process(pm, release, st)
        logger.info(
            "sglang-trtllm-moe: enabled on sglang %s: %d hook targets registered, %d not applicable, %d extensions",
            st.release.version,
            len(st.targets),
            len(st.not_applicable),
            sum(e.state == "loaded" for e in st.extensions),
        )
    except Exception as e:  # noqa: BLE001 - never raise into SGLang
        st.status = "stood_down"
        st.reason = f"plugin failed during registration and stood down: {type(e).__name__}: {e}"
        st.targets, st.not_applicable = [], []
        logger.exception("sglang-trtllm-moe: %s", st.reason)
    finally:
        _STATE = st


def reset_for_tests() -> None:
    """Forget registration state (tests only; SGLang's HookRegistry has its own reset())."""
    global _STATE
    _STATE = PluginState()
    installer.reset_for_tests()
    from . import capabilities

    capabilities.reset_for_tests()


__all__ = ["load_extensions", "register", "state", "PluginState", "LANDED", "MISSING", "NOT_APPLICABLE", "NOT_IMPORTED"]
