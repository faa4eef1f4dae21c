"""Fresh SGLang processes shared by the tests that ask one the same kind of question.

A process that imports SGLang costs about 8 s of CPU on the 2-core CI box (torch, transformers, torchvision, ...),
doctor's import of every hooked module 6 s more, and the SGLang-dependent subset runs on 13 releases. Tests that
need a fresh process *in the same environment* therefore share one per pytest session: a test module registers a
section (`section()`: a script, run in its own namespace, that sets `RESULT`), and the first test that asks for a
result (`result()`) starts one process for that environment which runs every section registered by then — the
test modules are all imported at collection, before any test runs — in `order`, then in registration order.

What each test sees is what its own process gave it before: its section's result, computed in a process started
with the same environment (run_python: the caller's environment without SGLANG_TRTLLM_MOE_*, plus ENVS[env]).
A section that raises fails the tests of that section only, with its traceback; the other sections still run.
The order is chosen so that no section sees a state another one made that its own process would not have had:
what must see a pristine interpreter comes first (sys.modules before SGLang's `load_plugins()`), what changes the
process-wide SGLang state (a published ServerArgs, the parallel runtime) comes last.
"""

from __future__ import annotations

import json
import socket
import subprocess
import textwrap
import threading
from collections.abc import Callable

from .helpers import last_json, run_python


def _port() -> dict:
    """Its own rendezvous port for sections that stand up SGLang's parallel runtime: this pytest process may hold one
    already (in-process SGLang tests), and children inherit MASTER_PORT from it."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return {"MASTER_PORT": str(s.getsockname()[1])}


#: environment name -> the variables its process gets on top of run_python's (computed when it starts)
ENVS: dict[str, Callable[[], dict]] = {
    "plain": _port,  # what a user's process has: no switch of the plugin set
    "disabled": lambda: {**_port(), "SGLANG_TRTLLM_MOE_DISABLE": "1"},  # SGLang alone: the plugin registers nothing
}

#: sections that must run before anything else in their process (a pristine interpreter)
FIRST = 0
#: sections that publish SGLang's process-wide state (ServerArgs, the parallel runtime): after every other
LAST = 90

_SECTIONS: dict[str, dict[str, tuple[int, str, Callable[[], dict] | None]]] = {}
_RUNS: dict[str, dict] = {}
#: tests may ask from a thread pool (tests/test_selection.py): one process per environment all the same
_LOCK = threading.Lock()
_LOCKS: dict[str, threading.Lock] = {}

RUNNER = """
import json, sys, traceback
results = {}
for name, code in json.loads(SECTIONS):
    ns = {"__name__": "__probe_section__", "RESULT": None}
    try:
        exec(compile(code, f"<probe section {name}>", "exec"), ns)
        results[name] = {"result": ns["RESULT"]}
    except BaseException:  # noqa: BLE001 - reported to that section's tests
        results[name] = {"error": traceback.format_exc()[-4000:]}
print()
print(json.dumps(results))
"""


#: doctor's report in a process that ran SGLang's load_plugins() and imported every hooked module (what `doctor`
#: proves in its own process), with whether each target's dotted path resolves on this release and the targets
#: SGLang's HookRegistry holds
DOCTOR = """
    import inspect, pkgutil
    from sglang.srt.plugins import load_plugins
    load_plugins()
    from sglang_trtllm_moe import doctor
    from sglang.srt.plugins.hook_registry import HookRegistry
    r = doctor.report(load=False, import_targets=True)
    r["registry_targets"] = sorted(HookRegistry._hooks)
    def resolves(path):
        obj, attr = path.rsplit(".", 1)
        try:
            inspect.getattr_static(pkgutil.resolve_name(obj), attr)
            return True
        except Exception:
            return False
    for t in r["targets"]:
        t["resolves"] = resolves(t["target"])
    RESULT = r
"""


def section(env: str, name: str, code: str, order: int = 50, prepare: Callable[[], dict] | None = None) -> str:
    """Register `code` (sets RESULT, JSON-serialisable) to run in the shared process of `env`; returns `name`.
    `prepare()`: run in this process just before the shared one starts; the variables it returns are added to that
    process's environment (e.g. the path of files the section reads)."""
    assert env in ENVS, env
    assert not _RUNS.get(env), f"section {name!r} registered after the {env!r} process ran"
    _SECTIONS.setdefault(env, {})[name] = (order, textwrap.dedent(code), prepare)
    return name


def _run(env: str) -> dict:
    with _LOCK:
        lock = _LOCKS.setdefault(env, threading.Lock())
    with lock:
        return _start(env)


def _start(env: str) -> dict:
    if env not in _RUNS:
        sections = sorted(_SECTIONS.get(env, {}).items(), key=lambda kv: kv[1][0])  # stable: registration order
        variables = ENVS[env]()
        for _name, (_order, _code, prepare) in sections:
            if prepare is not None:
                variables.update(prepare())
        script = f"SECTIONS = {json.dumps(json.dumps([(n, code) for n, (_o, code, _p) in sections]))}\n" + RUNNER
        try:
            proc = run_python(script, env=variables, timeout=900)
        except subprocess.TimeoutExpired as e:
            _RUNS[env] = {"process_error": f"timed out after {e.timeout} s"}
            return _RUNS[env]
        if proc.returncode != 0:
            _RUNS[env] = {"process_error": f"exit {proc.returncode}\n{proc.stderr[-4000:]}"}
        else:
            _RUNS[env] = {"results": last_json(proc)}
    return _RUNS[env]


def result(env: str, name: str):
    """RESULT of section `name` in the shared process of `env` (started by the first caller)."""
    run = _run(env)
    assert "process_error" not in run, f"the shared {env!r} process failed: {run['process_error']}"
    got = run["results"][name]
    assert "error" not in got, f"probe section {name!r} ({env} environment) raised:\n{got['error']}"
    return json.loads(json.dumps(got["result"]))  # each caller its own copy


section("plain", "doctor", DOCTOR, order=20)
