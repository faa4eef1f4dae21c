"""SGLang's official extension points for what the plugin does, and why each hook target is a patch instead.

The plugin uses an official registration wherever one can carry what a patch (a HookRegistry target) carries. On
every release it supports, none can (docs/COMPAT.md "Patches and SGLang's extension points" has the table per
target): each point is listed here with its range (a flag of compat/features.py) and why it cannot carry the hooks,
and `tests/test_extension_points.py` checks each reason against the installed SGLang, so a release that changes one
fails CI and the patch is replaced by the registration there. `doctor` shows patches vs official registrations.
"""

from __future__ import annotations

from dataclasses import dataclass

from .compat import features
from .compat.defer import EVERY_RELEASE
from .compat.features import Feature


@dataclass(frozen=True)
class ExtensionPoint:
    #: SGLang's name for it
    name: str
    #: where it lives
    where: str
    #: the releases that have it
    feature: Feature
    #: what the plugin would carry through it
    would_carry: str
    #: why it cannot, checked by tests/test_extension_points.py
    why_not: str


EXTENSION_POINTS: tuple[ExtensionPoint, ...] = (
    ExtensionPoint(
        "register_fused_func(a2a, runner)",
        "sglang.srt.layers.moe.moe_runner.base",
        EVERY_RELEASE,
        "the flashinfer_trtllm(_routed) fused functions: the plugin's runner for the layers it prepared",
        "SGLang registers ('none', 'flashinfer_trtllm') and ('none', 'flashinfer_trtllm_routed') itself (and "
        "('flashinfer', ...) from 0.5.15) and refuses a second registration of a key; its fused functions also call "
        "the per-format leaves by name, which ModelOptFp8MoEMethod.apply does too",
    ),
    ExtensionPoint(
        "register_moe_runner_core(backend_name, factory)",
        "sglang.srt.layers.moe.moe_runner.runner",
        features.MOE_RUNNER_CORE_REGISTRY,
        "a runner core for flashinfer_trtllm(_routed)",
        "MoeRunner.run calls the fused func registered for the backend's key before any runner core, and SGLang "
        "registers one for flashinfer_trtllm(_routed): a core registered there is built and never run",
    ),
)

#: official registrations the plugin makes (none: see EXTENSION_POINTS)
OFFICIAL: tuple[str, ...] = ()


def summary(target_rows: list[dict]) -> dict:
    """Patches (landed HookRegistry targets, counted per dotted path as SGLang applies them) vs official
    registrations, and each official point on this release with why it is not used (doctor)."""
    landed = sorted({r["target"] for r in target_rows if r.get("state") == "landed"})
    return {
        "patches": len(landed),
        "official": len(OFFICIAL),
        "points": [
            {"name": p.name, "where": p.where, "present": p.feature.present(), "why_not": p.why_not}
            for p in EXTENSION_POINTS
        ],
    }


#: why the targets of each capability group are patches (capabilities.py's group names; a format's group: "format")
WHY_PATCH = {
    "runner": "SGLang registers the flashinfer_trtllm(_routed) fused funcs itself (register_fused_func refuses a "
    "second) and runs them before any registered runner core (register_moe_runner_core, 0.5.19+)",
    "core": "FusedMoE's constructor: SGLang offers no hook or registry for it",
    "loader": "FusedMoE's weight loader: SGLang offers no hook or registry for it",
    "format": "a quant method's own step: SGLang's quant methods offer no hook or registry for it",
    "update-entry": "a weight-update entry point: SGLang offers no hook or registry for it",
    "update-session": "a weight-update session's begin / end: SGLang offers no hook or registry for it",
    "rollback": "the model loader: SGLang offers no hook or registry for it",
    "request-checks": "the scheduler's update manager: SGLang offers no hook or registry for it",
    "draft-note": "the scheduler's update manager: SGLang offers no hook or registry for it",
    "auto-select": "--moe-runner-backend resolution: SGLang's rules run in ServerArgs, no registry",
    "weight-check": "the weight checker's comparison: SGLang has no comparator registry",
    "remote-instance": "the remote-instance model loader and the seed's weight exporter: SGLang offers no hook or "
    "registry for them",
}


def _group(t) -> str:
    return "format: " + ", ".join(t.formats) if t.formats else (t.group or t.capability)


def patch_table(targets) -> list[str]:
    """docs/ARCHITECTURE.md's table: every built-in hook target (all releases), its hooks, capability group,
    releases, and why it is a patch and not an official registration."""
    rows: dict[str, dict] = {}
    for t in targets:
        if t.source.startswith("ext:"):
            continue
        r = rows.setdefault(t.target, {"hooks": [], "groups": [], "releases": []})
        for key, value in (("hooks", t.hook_type), ("groups", _group(t)), ("releases", t.releases or "every")):
            if value not in r[key]:
                r[key].append(value)
    out = ["| target (below `sglang.srt.`) | hooks | capability group | releases | why a patch |", "|---" * 5 + "|"]
    for path in sorted(rows):
        r = {k: sorted(v) for k, v in rows[path].items()}  # the same table whichever release lists the targets
        why = "; ".join(dict.fromkeys(WHY_PATCH["format" if g.startswith("format") else g] for g in r["groups"]))
        out.append(
            f"| `{path.removeprefix('sglang.srt.')}` | {', '.join(r['hooks'])} | {'; '.join(r['groups'])} | "
            f"{'; '.join(r['releases'])} | {why} |"
        )
    return out


__all__ = ["EXTENSION_POINTS", "ExtensionPoint", "OFFICIAL", "WHY_PATCH", "patch_table", "summary"]
