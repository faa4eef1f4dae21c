"""`doctor`: what is installed, and whether the plugin is really wired into SGLang in this process.

The JSON form is a stable contract (tests and CI read it): keys `enabled` (bool), `status`, `reason`,
`plugin_version`, `sglang_version`, `release_status`, `release_message`, `flashinfer_version`, `flashinfer_status`
(tested | untested | missing: whether the CI matrix runs this SGLang release with this flashinfer),
`flashinfer_message`, `versions`, `device`, `targets` (list of
{target, state in landed|missing|not_applicable|not_imported, reason, capability, hook_type, source, module}),
`extensions`, `errors`, `capabilities` (per capability group: {capability, status in active|stepped_aside|
not_applicable|undecided|off, serves, why, needs, targets, format, consequence}: capabilities.py),
`extension_points` ({patches, official, points}: extension_points.py), `tally` ({state: count} of `targets`),
`switches` ({`emulator`: bool, `set_up`: {extension: what it set up in this process} — the test-only CPU sandbox's
line when its two switches are set —, `env`: every SGLANG_TRTLLM_MOE_* variable set in this process}).

Hooks are applied when their module is imported (installer.py), so a fresh process holds most of them as
`not_imported`; `doctor` imports every hooked module first (as a scheduler building a MoE model would), so its
report shows each target `landed` or `missing` — proof after the fact, not a promise.
"""

from __future__ import annotations

import importlib.metadata

from . import __version__


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _device() -> dict:
    try:
        import torch
    except Exception as e:  # noqa: BLE001
        return {"type": "unknown", "error": str(e)}
    if not torch.cuda.is_available():
        return {"type": "cpu", "name": "cpu", "compute_capability": None, "sm100": False}
    major, minor = torch.cuda.get_device_capability()
    return {
        "type": "cuda",
        "name": torch.cuda.get_device_name(),
        "compute_capability": f"{major}.{minor}",
        "sm100": major == 10,
    }


def load_into_this_process() -> None:
    """Run SGLang's own plugin loading (entry points + apply_hooks), as every SGLang process does."""
    try:
        from sglang.srt.plugins import load_plugins
    except Exception:  # noqa: BLE001 - sglang missing or too old: register() reports it
        from .plugin import register

        register()
        return
    load_plugins()


def report(load: bool = True, import_targets: bool | None = None) -> dict:
    """`load`: run SGLang's plugin loading first. `import_targets` (default: same as `load`): import every hooked
    module so each target reports landed / missing instead of not_imported."""
    from . import installer, plugin

    if load:
        load_into_this_process()
    import_errors = installer.import_all() if (load if import_targets is None else import_targets) else []
    st = plugin.state()
    rel = st.release
    if rel is None:
        from .compat import check_release

        rel = check_release()
    from .compat import check_flashinfer

    fi = check_flashinfer(rel.version)
    return {
        "enabled": st.enabled,
        "status": st.status,
        "reason": st.reason,
        "plugin_version": __version__,
        "sglang_version": str(rel.version) if rel.version else None,
        "release_status": rel.status,
        "release_message": rel.message,
        "flashinfer_version": fi.version,
        "flashinfer_status": fi.status,
        "flashinfer_message": fi.message,
        "versions": {d: _version(d) for d in ("sglang", "flashinfer-python", "torch", "pluggy", "sglang-trtllm-moe")},
        "device": _device(),
        "targets": (rows := st.target_report() if st.enabled else []),
        **_capability_report(st.enabled, rows),
        "extensions": [e.__dict__ for e in st.extensions],
        "errors": list(st.errors) + [f"could not import hooked module {e}" for e in import_errors],
        **_summary(st),
    }


def _summary(st) -> dict:
    """The tally of the hook targets' states and the switches in force (the emulator, what extensions set up in this
    process — the test-only CPU sandbox with its two switches — and every SGLANG_TRTLLM_MOE_* variable of this
    process): what a bug report needs at a glance."""
    import os

    from . import env

    tally: dict[str, int] = {}
    for t in st.target_report() if st.enabled else []:
        tally[t["state"]] = tally.get(t["state"], 0) + 1
    variables = {k: v for k, v in sorted(os.environ.items()) if k.startswith("SGLANG_TRTLLM_MOE_")}
    switches = {"emulator": env.emulating(), "set_up": dict(st.set_up), "env": variables}
    return {"tally": tally, "switches": switches}


def summary_lines(r: dict) -> list[str]:
    """doctor's text lines for `_summary`: the tally, then the switches."""
    shown = ("landed", "missing", "not_applicable")
    counts = [(s, r["tally"].get(s, 0)) for s in shown] + [(s, n) for s, n in r["tally"].items() if s not in shown]
    sw = r["switches"]
    kernels = "emulated (SGLANG_TRTLLM_MOE_EMULATE=1)" if sw["emulator"] else "TRT-LLM-Gen (SM 10.x GPUs only)"
    set_up = "; ".join(f"{name} ({line})" for name, line in sw["set_up"].items()) or "nothing"
    return [
        "tally: " + ", ".join(f"{n} {state.replace('_', ' ')}" for state, n in counts),
        f"kernels: {kernels}; set up by extensions: {set_up}",
        "SGLANG_TRTLLM_MOE_* set: " + (", ".join(f"{k}={v}" for k, v in sw["env"].items()) or "none"),
    ]


def format_text(r: dict) -> str:
    lines = [
        f"sglang-trtllm-moe {r['plugin_version']}: {r['status']}" + (f" ({r['reason']})" if r["reason"] else ""),
        f"sglang {r['sglang_version']} [{r['release_status']}]: {r['release_message']}",
        f"flashinfer {r['flashinfer_version'] or '-'} [{r['flashinfer_status']}]: {r['flashinfer_message']}",
        "versions: " + ", ".join(f"{k} {v or 'not installed'}" for k, v in r["versions"].items()),
    ]
    d = r["device"]
    lines.append(
        f"device: {d.get('name')}" + (f" (SM {d['compute_capability']})" if d.get("compute_capability") else "")
    )
    if r["targets"]:
        lines.append("hook targets:")
        for t in r["targets"]:
            extra = f" — {t['reason']}" if t["reason"] else ""
            lines.append(f"  [{t['state']:>14}] {t['target']} ({t['capability']}, {t['hook_type']}){extra}")
    lines += capability_lines(r)
    lines.append("extensions: " + (", ".join(f"{e['name']} [{e['state']}]" for e in r["extensions"]) or "none"))
    lines.extend(summary_lines(r))
    for e in r["errors"]:
        lines.append(f"error: {e}")
    return "\n".join(lines)


def _capability_report(enabled: bool, rows: list[dict]) -> dict:
    """Per capability group: active / stepped aside / why (capabilities.py), and patches vs official registrations."""
    from . import capabilities, extension_points

    return {
        "capabilities": capabilities.report() if enabled else [],
        "extension_points": extension_points.summary(rows),
    }


def capability_lines(r: dict) -> list[str]:
    """The text form of `capabilities` and `extension_points`."""
    lines = []
    if r.get("capabilities"):
        lines.append("capabilities (hooks that only work together land together, or the plugin steps aside):")
        for c in r["capabilities"]:
            why = f" — {'; '.join(c['why'])}. {c['consequence']}" if c["status"] == "stepped_aside" else ""
            lines.append(f"  [{c['status']:>14}] {c['capability']}: {c['serves']}{why}")
    ep = r.get("extension_points")
    if ep:
        lines.append(
            f"hooks: {ep['patches']} patched targets (SGLang's HookRegistry), {ep['official']} official registrations"
        )
        for p in ep["points"]:
            if p["present"]:
                lines.append(f"  official point {p['name']} not used: {p['why_not']}")
    return lines
