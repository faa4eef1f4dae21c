"""Capabilities that land whole or not at all: which hook targets only work together, and whether each group is
active in this process or the plugin stepped aside for what it serves.

Why: SGLang's HookRegistry logs a target it cannot apply and goes on (a moved path, a renamed method, a module that
moved), and so would the plugin, half-owning layers: it prepares NVFP4 experts in place, but the update entry point
that lays a tensor update out again is SGLang's own — success reported, garbage served (issue #50: 4 of 25 single
faults on 0.5.23). So the hooks that only work together are declared once here: `GROUPS` (shared capabilities and
what each needs), one group per weight format derived from the registry (the targets that name the format in
`HookTarget.formats`, or, naming none, come from its `hook_module`: a new format's hook module is a group by itself),
and `PROBES` (what the plugin reaches by name outside the hook table: a probe that finds nothing is a missing target,
not an empty answer). A group is active only when every target and probe of it and of the groups it needs landed;
otherwise the plugin steps aside for what it serves, and says so once in the log, in `doctor` and in `explain`:

* a format's layers stay on SGLang's own path (no in-place preparation, no batched writes, nothing watched) — or,
  where the user explicitly asked for flashinfer_trtllm(_routed) and SGLang's own path is not right for that format
  on this release (compat/defer.py: the plugin must serve it), the model load stops at the first such layer with the
  reason and the fix (`check_layer`, `check_built`);
* a weight update of a model holding such a layer is refused before anything is written, at every update entry point
  whose hook landed (`at_update`), where SGLang's own path would not keep it exact;
* the batched writer leaves every tensor to SGLang's per-tensor loader (`batched-writes`), a request whose runners
  cannot be told is refused before any runner loads it (`request-checks`).

Decided at first use (a layer built or taken over, an update served, `doctor`): the pending modules of the targets
involved are imported then (a scheduler building a MoE layer has them anyway; a launcher never asks), so nothing is
decided on a target that may never land. Decisions are cached until another target is applied
(`installer.generation()`) or `refresh()`.
"""

from __future__ import annotations

import contextvars
import logging
import sys
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from . import PROJECT_NAME, installer
from .compat import features
from .compat.features import Feature
from .targets import MISSING, NOT_IMPORTED, HookTarget

logger = logging.getLogger(PROJECT_NAME)

ACTIVE = "active"
STEPPED_ASIDE = "stepped_aside"
#: none of its targets exists on this release (a group it needs counts as satisfied)
NOT_APPLICABLE = "not_applicable"
#: a target of it waits for a module this process has not imported (doctor without imports, a launcher)
UNDECIDED = "undecided"
#: the plugin is not enabled in this process (disabled, stood down, not loaded)
OFF = "off"


@dataclass(frozen=True)
class Group:
    name: str
    #: what the plugin takes over with it (doctor, explain, the log line when it steps aside)
    serves: str
    #: the groups it cannot work without: their missing targets and probes are its own
    needs: tuple[str, ...] = ()
    #: a weight format's group (derived from formats.FORMATS): the format's registry name
    fmt: str | None = None


#: what a weight format's in-place preparation needs besides its own targets: its layers named, the runner, the
#: loader that un-prepares an expert before a write, the entry points that lay an update out again at their end,
#: the sessions that keep loader-free writes off kernel-layout bytes
PREP_NEEDS = ("core", "runner", "loader", "update-entry", "update-session")

GROUPS: tuple[Group, ...] = (
    Group("core", "each MoE layer's checkpoint prefix and logical intermediate size; the layer its runner runs"),
    Group("runner", "the layers the plugin prepared run on their format's kernel (or the emulator)", ("core",)),
    Group("loader", "every expert write validated; a prepared expert returned to checkpoint layout first", ("core",)),
    Group("update-entry", "each update entry point validates a request whole and lays out what it wrote", ("loader",)),
    Group("update-session", "begin/end weight-update sessions: checkpoint layout inside, laid out at the end"),
    Group("request-checks", "one scheduler request checked against every runner it loads", ("update-entry",)),
    Group("rollback", "a failed disk update puts the served weights back", ("update-entry",)),
    Group("draft-note", "a distributed update that leaves the speculative draft stale is said"),
    Group("batched-writes", "a validated bucket's experts written per (layer, parameter)", ("loader", "update-entry")),
    Group("auto-select", "flashinfer_trtllm chosen on SM100 where the kernels serve the model"),
    Group("weight-check", "SGLang's weight checker compares the layers the plugin lays out"),
    Group(
        "remote-instance",
        "a new instance booted from a running one's memory adopts the seed's layout; a seed sends SGLang's "
        "parameters only",
        ("core",),
    ),
)

FUSED_MOE_MODULE = "sglang.srt.layers.moe.fused_moe_triton.layer"


@dataclass(frozen=True)
class Probe:
    """Something the plugin reaches in SGLang by name outside the hook table."""

    group: str
    #: what is reached (doctor shows it)
    name: str
    #: the module it lives in (imported at first use, as a target's)
    module: str
    #: None when found; else what is missing
    find: Callable[[], str | None]
    why: str
    #: the releases it is reached on (None: every release)
    feature: Feature | None = None


def _slot_trace() -> str | None:
    """batched_writes.local_slots runs SGLang's own FusedMoE.weight_loader on a stand-in whose `_weight_loader_impl`
    records the slot: SGLang's loader must still reach the write under that name."""
    from sglang.srt.layers.moe.fused_moe_triton.layer import FusedMoE

    from .updates.slot_plans import unwrapped

    if getattr(FusedMoE, "_weight_loader_impl", None) is None:
        return "FusedMoE has no _weight_loader_impl"
    code = getattr(unwrapped(FusedMoE.weight_loader), "__code__", None)
    if code is None or "_weight_loader_impl" not in code.co_names:
        return "FusedMoE.weight_loader no longer calls self._weight_loader_impl"
    return None


def _has(path: str) -> Callable[[], str | None]:
    """A probe of the attribute `path` ("module:Class.attr"), looked up on the class without running anything."""

    def find() -> str | None:
        import importlib
        import inspect

        module, _, qual = path.partition(":")
        obj: object = importlib.import_module(module)
        for part in qual.split("."):
            try:
                obj = inspect.getattr_static(obj, part)
            except AttributeError:
                return f"{qual} is not there"
        return None

    return find


HOOK_REGISTRY = "sglang.srt.plugins.hook_registry"
FP8 = "sglang.srt.layers.quantization.fp8"

PROBES: tuple[Probe, ...] = (
    Probe(
        "batched-writes",
        "FusedMoE.weight_loader -> self._weight_loader_impl",
        FUSED_MOE_MODULE,
        _slot_trace,
        "the slot trace catches SGLang's write under this name: under another it would record no slot and drop every "
        "expert write as another rank's",
    ),
    *(
        Probe(
            "core",
            f"HookRegistry.{name}",
            HOOK_REGISTRY,
            _has(f"{HOOK_REGISTRY}:HookRegistry.{name}"),
            "installer.py applies a target whose module loads after SGLang's apply_hooks through it",
        )
        for name in ("_hooks", "_patched", "_apply_target")
    ),
    *(
        Probe(
            group,
            "Fp8MoEMethod._prepare_flashinfer_trtllm_activation_params",
            FP8,
            _has(f"{FP8}:Fp8MoEMethod._prepare_flashinfer_trtllm_activation_params"),
            "the prepared layer gets the SwiGLU tensors SGLang's FP8 apply reads through it",
            flag,
        )
        for group, flag in (
            ("fp8_tensor", features.FP8_TRTLLM_ACTIVATION_PARAMS),
            ("fp8_block", features.FP8_TRTLLM_ACTIVATION_PARAMS),
            ("mxfp8", features.MXFP8_ACTIVATION_PARAMS),
        )
    ),
)


@dataclass
class Decision:
    group: Group
    status: str
    #: why it stepped aside (or is undecided): missing targets and probes, its own and those of what it needs
    why: list[str] = field(default_factory=list)
    #: its own targets on this release
    targets: list[HookTarget] = field(default_factory=list)

    @property
    def active(self) -> bool:
        return self.status in (ACTIVE, NOT_APPLICABLE)


_LOCK = threading.RLock()
_CACHE: dict = {"key": None, "decisions": {}}
#: probes that failed when the plugin used what they reach (group -> lines), e.g. a draft worker's runners
_RUNTIME: dict[str, list[str]] = {}
#: groups whose stepping aside was logged (once per process)
_LOGGED: set[str] = set()
_EPOCH = [0]


def refresh() -> None:
    """Forget every decision (tests that make a target fail; a later use decides again)."""
    with _LOCK:
        _EPOCH[0] += 1
        _CACHE["key"] = None


def reset_for_tests() -> None:
    with _LOCK:
        _RUNTIME.clear()
        _LOGGED.clear()
    refresh()


def probe_missing(group: str, name: str, why: str) -> None:
    """A name the plugin reached at run time (not at start-up) is not there: `group` steps aside from now on."""
    line = f"{name}: {why}"
    with _LOCK:
        lines = _RUNTIME.setdefault(group, [])
        if line in lines:
            return
        lines.append(line)
    refresh()


def _tag(t: HookTarget) -> str:
    """The group a target joins by its tag: its `group`, else its `capability`; an extension's targets form groups of
    their own (a broken extension never takes a built-in capability down with it)."""
    tag = t.group or t.capability
    return f"{t.source[4:]}: {tag}" if t.source.startswith("ext:") else tag


def all_groups(targets: Sequence[HookTarget] = ()) -> list[Group]:
    """GROUPS, one group per registered format, and one per tag of `targets` no group declares (an extension's)."""
    from .formats import FORMATS

    groups = list(GROUPS) + [
        Group(
            f.name,
            f"{f.title or f.name} layers on {'/'.join(f.quantizations)}: prepared in place by the plugin "
            "(watched where SGLang's own preparation is right on this release)",
            PREP_NEEDS,
            f.name,
        )
        for f in FORMATS
    ]
    hook_modules = {f.hook_module for f in FORMATS}
    known = {g.name for g in groups}
    for t in targets:
        if not t.formats and t.source not in hook_modules and _tag(t) not in known:
            groups.append(Group(_tag(t), f"what the targets tagged {_tag(t)!r} serve"))
            known.add(_tag(t))
    return groups


def members(group: Group, targets: list[HookTarget]) -> list[HookTarget]:
    """The targets of `group` among `targets`."""
    if group.fmt is not None:
        from .formats import by_name

        module = by_name(group.fmt).hook_module
        return [t for t in targets if (group.fmt in t.formats if t.formats else t.source == module)]
    return [t for t in targets if not t.formats and _tag(t) == group.name]


def _own(group: Group, st, load: bool) -> Decision:
    targets = members(group, st.targets)
    probes = [p for p in PROBES if p.group == group.name and (p.feature is None or p.feature.present())]
    if load:
        modules = sorted({t.module for t in targets} | {p.module for p in probes})
        installer.import_all(modules)
        for m in (p.module for p in probes):
            if m not in sys.modules and installer.importable(m) is not False:
                try:
                    __import__(m)
                except Exception:  # noqa: BLE001 - then the probe finds nothing: missing
                    pass
    from .plugin import current_state

    missing: list[str] = []
    undecided = False
    for t in targets:
        state, reason = current_state(t)
        if state == MISSING:
            missing.append(f"{t.target} ({t.hook_type}) is missing: {reason}")
        elif state == NOT_IMPORTED:
            undecided = True
    for p in probes:
        if p.module not in sys.modules:
            if installer.importable(p.module) is False:
                missing.append(f"{p.name}: {p.module} cannot be imported")
            else:
                undecided = True
            continue
        try:
            why = p.find()
        except Exception as e:  # noqa: BLE001 - a probe that cannot look finds nothing
            why = f"{type(e).__name__}: {e}"
        if why:
            missing.append(f"{p.name}: {why} ({p.why})")
    with _LOCK:
        missing += _RUNTIME.get(group.name, [])
    if missing:
        status = STEPPED_ASIDE
    elif undecided:
        status = UNDECIDED
    elif not targets and not probes:
        status = NOT_APPLICABLE  # nothing of it on this release: nothing to serve, and satisfied as a need
    else:
        status = ACTIVE
    return Decision(group, status, missing, targets)


def decide(name: str, load: bool = True) -> Decision:
    """The decision for group `name` now (with the groups it needs); `load`: import the pending modules involved
    first (first use). Cached until a target is applied or `refresh()`."""
    from .plugin import state

    st = state()
    key = (installer.generation(), _EPOCH[0], id(st), st.status)
    with _LOCK:
        if _CACHE["key"] != key:
            _CACHE["key"], _CACHE["decisions"] = key, {}
        cached = _CACHE["decisions"].get((name, load))
        if cached is not None:
            return cached
    groups = {g.name: g for g in all_groups(st.targets + st.not_applicable)}
    group = groups.get(name) or Group(name, "unknown")
    if not st.enabled:
        d = Decision(group, OFF, [f"the plugin is {st.status}" + (f": {st.reason}" if st.reason else "")])
    else:
        d = _combine(group, groups, st, load, set())
    with _LOCK:
        _CACHE["decisions"][(name, load)] = d
    if d.status == STEPPED_ASIDE:
        _log_once(d)
    return d


def _combine(group: Group, groups: dict, st, load: bool, seen: set) -> Decision:
    d = _own(group, st, load)
    seen = seen | {group.name}
    for need in group.needs:
        if need in seen or need not in groups:
            continue
        n = _combine(groups[need], groups, st, load, seen)
        if n.status == STEPPED_ASIDE:
            d.status = STEPPED_ASIDE
            d.why += [f"needs {need}: {w}" for w in n.why]
        elif n.status == UNDECIDED and d.status != STEPPED_ASIDE:
            d.status = UNDECIDED
    return d


def _log_once(d: Decision) -> None:
    with _LOCK:
        if d.group.name in _LOGGED:
            return
        _LOGGED.add(d.group.name)
    logger.warning(
        "sglang-trtllm-moe: stepped aside for %s (%s): %s. %s",
        d.group.name,
        d.group.serves,
        "; ".join(d.why),
        consequence(d.group),
    )


def consequence(group: Group) -> str:
    """What stepping aside for `group` leaves, in one sentence (the log, doctor, explain)."""
    if group.fmt is not None:
        return (
            f"{group.fmt} layers stay on SGLang's own path (its preparation, its loader); an explicit "
            f"--moe-runner-backend flashinfer_trtllm where SGLang's own path is not right for {group.fmt} stops at "
            "model load, and a weight update of such a layer is refused"
        )
    if group.name == "batched-writes":
        return "every tensor of an update goes through SGLang's per-tensor loader (the plugin's hooks on it still run)"
    if group.name == "request-checks":
        return "a request whose runners cannot be told is refused before any runner loads it"
    return "SGLang's own behaviour there; every format that needs it stays on SGLang's own path too"


def report(load: bool = False) -> list[dict]:
    """Per group: name, status (active / stepped_aside / not_applicable / undecided / off), what it serves, why, its
    target count and what it needs (doctor, explain)."""
    from .plugin import state

    st = state()
    out = []
    for g in all_groups(st.targets + st.not_applicable):
        d = decide(g.name, load=load)
        out.append(
            {
                "capability": g.name,
                "status": d.status,
                "serves": g.serves,
                "why": list(d.why),
                "needs": list(g.needs),
                "targets": len(d.targets),
                "format": g.fmt,
                "consequence": consequence(g) if d.status == STEPPED_ASIDE else "",
            }
        )
    return out


#: why an update inside the current scheduler request must be refused before any runner loads it (set while the
#: scheduler serves a request whose runners cannot be told: builtins/runner_requests.py; read by aside.at_update)
REQUEST_REFUSAL: contextvars.ContextVar[str | None] = contextvars.ContextVar("trtllm_moe_request_refusal", default=None)

__all__ = [
    "ACTIVE",
    "GROUPS",
    "NOT_APPLICABLE",
    "OFF",
    "PREP_NEEDS",
    "PROBES",
    "REQUEST_REFUSAL",
    "STEPPED_ASIDE",
    "UNDECIDED",
    "Decision",
    "Group",
    "Probe",
    "all_groups",
    "consequence",
    "decide",
    "members",
    "probe_missing",
    "refresh",
    "report",
]
