"""Fault injection for issue #50: a hook target made to fail to apply as SGLang's HookRegistry fails (logged, skipped:
SGLang's own function stays where it was), a name the plugin reaches renamed in SGLang's source, a module moved — and
the update flows a layer-level model goes through afterwards (disk, tensor outside a session, a begin/end session,
distributed, load_format="direct", checkpoint-engine IPC, the scheduler's manager), each classified against a fresh
load of what it was asked to write:

* "exact": the update answered True and every parameter byte equals a fresh load's (made under the same fault, so a
  layer the plugin stepped aside for is compared with SGLang's own preparation);
* "refused": it answered False and no byte changed;
* anything else is a failure: "garbage" (True, bytes differ), "lost" (False, bytes changed), "crash" (raised).
A model load that stops with the plugin's TrtllmLayerError is "refused at start-up".

In-process and layer-level (TinyMoeModel: one real FusedMoE of each format behind SGLang's own WeightUpdater, runner
shell and scheduler manager: tests/support/spec_worker.py), so a fault is a context manager and a case costs what
its flows cost. Runs on releases with begin/end sessions and the runner selector (0.5.21+); the suite runs on the
newest release (docs/TESTING.md)."""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import os
import pkgutil
import sys
import tempfile
import textwrap
import types

import torch

from sglang_trtllm_moe import capabilities
from sglang_trtllm_moe.errors import TrtllmLayerError
from sglang_trtllm_moe.sandbox import layers as cpu_layers

from . import checkpoint_engine as ce
from . import sglang_runtime, spec_worker

EXACT, REFUSED, START = "exact", "refused", "refused at start-up"
FLOWS = ("session", "tensor", "disk", "distributed", "direct", "ipc", "scheduler")


# ---- faults -----------------------------------------------------------------------------------------------------


def _registry_file() -> str:
    from sglang.srt.plugins import hook_registry

    return hook_registry.__file__


def _strip(fn):
    """`fn` without the wrappers SGLang's HookRegistry put around it (SGLang's own decorators are kept)."""
    registry = _registry_file()
    while getattr(getattr(fn, "__code__", None), "co_filename", None) == registry and hasattr(fn, "__wrapped__"):
        fn = fn.__wrapped__
    return fn


@contextlib.contextmanager
def not_applied(path: str):
    """As SGLang's HookRegistry leaves a target it failed to apply: SGLang's own function at `path` (and in every
    module that imported it by name, as HookRegistry's propagation would have left them), none of the plugin's
    hooks on it. Decisions are made again inside and after the block."""
    obj_path, attr = path.rsplit(".", 1)
    obj = pkgutil.resolve_name(obj_path)
    raw = vars(obj)[attr] if isinstance(obj, (type, types.ModuleType)) and attr in vars(obj) else getattr(obj, attr)
    kind = type(raw) if isinstance(raw, (classmethod, staticmethod)) else None
    fn = raw.__func__ if kind is not None else raw
    original = _strip(fn)
    copies = []
    if isinstance(obj, types.ModuleType):
        for mod in list(sys.modules.values()):
            if isinstance(mod, types.ModuleType) and mod is not obj:
                copies += [(mod, k) for k, v in list(vars(mod).items()) if v is fn]
    setattr(obj, attr, kind(original) if kind is not None else original)
    for mod, k in copies:
        setattr(mod, k, original)
    capabilities.refresh()
    try:
        yield
    finally:
        setattr(obj, attr, raw)
        for mod, k in copies:
            setattr(mod, k, fn)
        capabilities.refresh()


def _recompiled(fn, old: str, new: str):
    """SGLang's function `fn` as if its source said `new` where it says `old` (compiled in its module's globals)."""
    src = textwrap.dedent(inspect.getsource(fn))
    assert old in src, (fn, old)
    scope: dict = {}
    exec(compile(src.replace(old, new), inspect.getsourcefile(fn), "exec"), fn.__globals__, scope)  # noqa: S102
    return scope[fn.__name__]


@contextlib.contextmanager
def renamed_weight_loader_impl():
    """SGLang renames FusedMoE._weight_loader_impl (to `_weight_loader_impl_v2`) in its source: its weight_loader
    calls the new name, the old one is gone; the plugin's hooks stay on weight_loader (re-applied as HookRegistry
    applies them), the one on the old name has nothing to land on."""
    from sglang.srt.layers.moe.fused_moe_triton.layer import FusedMoE
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType, _wrap_fn

    saved = {k: FusedMoE.__dict__[k] for k in ("weight_loader", "_weight_loader_impl")}
    loader = _recompiled(_strip(saved["weight_loader"]), "self._weight_loader_impl(", "self._weight_loader_impl_v2(")
    hooks = HookRegistry._hooks.get(f"{FusedMoE.__module__}.FusedMoE.weight_loader", [])
    wrapped = loader
    for hook_type, hook, _ in sorted(hooks, key=lambda h: 0 if h[0] == HookType.REPLACE else 1):
        wrapped = _wrap_fn(wrapped, hook, hook_type)
    FusedMoE.weight_loader = wrapped
    FusedMoE._weight_loader_impl_v2 = _strip(saved["_weight_loader_impl"])
    del FusedMoE._weight_loader_impl
    capabilities.refresh()
    try:
        yield
    finally:
        for k, v in saved.items():
            setattr(FusedMoE, k, v)
        del FusedMoE._weight_loader_impl_v2
        capabilities.refresh()


@contextlib.contextmanager
def moved_module(path: str):
    """The module that defines target `path` moved in SGLang (its new name below): SGLang's own function stays
    unhooked, and the plugin's target waits for a module that can never be imported under its old name."""
    from sglang_trtllm_moe import installer, plugin

    st = plugin.state()
    real = [t for t in st.targets if t.target == path]
    moved_targets = [
        dataclasses.replace(t, target=t.target.replace(t.module, t.module + "_moved"), module="") for t in real
    ]
    with not_applied(path):
        st.targets = [t for t in st.targets if t.target != path] + moved_targets
        installer.install(moved_targets)
        capabilities.refresh()
        try:
            yield
        finally:
            st.targets = [t for t in st.targets if t not in moved_targets] + real
            installer.forget(moved_targets)
            capabilities.refresh()


# ---- the model and its flows ------------------------------------------------------------------------------------

SPECS = {
    kind: cpu_layers.MoeSpec(num_experts=4, hidden=256 if kind.startswith("mxfp4") else 128, intermediate=128, fmt=kind)
    for kind in cpu_layers.LAYERS
}


def backend_of(kind: str) -> str:
    return "flashinfer_mxfp4" if kind.startswith("mxfp4") else "flashinfer_trtllm"


def checkpoint(kind: str, seed: int, experts=None) -> dict:
    spec = SPECS[kind]
    t = cpu_layers.random_checkpoint(spec, seed, experts)
    return cpu_layers.below_block(t) if spec.kind.format.fused else t


def build(kind: str, tensors: dict, prepare: bool = True, cls=cpu_layers.TinyMoeModel):
    sglang_runtime.ensure(backend_of(kind))
    model = cls(SPECS[kind])
    model.load_weights([(model.prefix + k, v) for k, v in tensors.items()])
    if prepare:
        model.experts.quant_method.process_weights_after_loading(model.experts)
    return model


def state(model) -> dict:
    return {n: p.detach().contiguous().reshape(-1).view(torch.uint8).clone() for n, p in model.named_parameters()}


_FRESH: dict = {}


def fresh(kind: str, tensors_key: tuple, tensors: dict) -> dict:
    """A fresh load's bytes under the current faults (keyed by how the plugin decides the format now)."""
    fmt = SPECS[kind].kind.format
    key = (kind, tensors_key, capabilities.decide(fmt.name).status)
    if key not in _FRESH:
        _FRESH[key] = state(build(kind, tensors))
    return _FRESH[key]


def _differs(a: dict, b: dict) -> list[str]:
    return [n for n in b if n not in a or a[n].shape != b[n].shape or not torch.equal(a[n], b[n])]


class Run:
    """One model of `kind` under the current faults: its flows, each classified (module docstring)."""

    def __init__(self, kind: str, workdir: str):
        self.kind, self.workdir = kind, workdir
        self.outcomes: dict = {}
        self.intended: dict = checkpoint(kind, 0)
        self.key: tuple = (0,)
        try:
            self.model = build(kind, self.intended)
        except TrtllmLayerError as e:
            self.model = None
            self.outcomes["start"] = f"{START}: {e}"
            return
        except Exception as e:  # noqa: BLE001 - classified: a crash
            self.model = None
            self.outcomes["start"] = f"crash: {type(e).__name__}: {e}"
            return
        self.outcomes["start"] = "ok"
        self.runner = spec_worker.runner(self.model)
        self.updater = self.runner.weight_updater

    @property
    def prefix(self) -> str:
        return self.model.prefix

    def named(self, tensors: dict) -> list:
        return [(self.prefix + k, v) for k, v in tensors.items()]

    def _write(self, tensors: dict, name: str) -> str:
        from safetensors.torch import save_file

        d = os.path.join(self.workdir, name)
        sglang_runtime.write_safetensors_checkpoint(d, {}, SPECS[self.kind])
        save_file({k: v.contiguous() for k, v in self.named(tensors)}, os.path.join(d, "model.safetensors"))
        return d

    def flow(self, name: str, seed: int) -> str:
        """Run flow `name` writing checkpoint `seed` (one expert of it for disk), classify, remember."""
        new = checkpoint(self.kind, seed)
        if name == "disk" and not SPECS[self.kind].kind.format.fused:
            new = {k: v for k, v in new.items() if k.startswith("experts.1.")}
        intended = {**self.intended, **new}
        before = state(self.model)
        try:
            answer = getattr(self, f"_{name}")(new, seed)
            ok, msg = bool(answer[0]), str(answer[1])
        except Exception as e:  # noqa: BLE001 - classified: a crash
            self.outcomes[name] = f"crash: {type(e).__name__}: {e}"
            return self.outcomes[name]
        after = state(self.model)
        if ok:
            want = fresh(self.kind, (*self.key, seed), intended)
            bad = _differs(after, want)
            out = EXACT if not bad else f"garbage: {bad[:6]} differ from a fresh load ({msg[:200]})"
            if not bad:
                self.intended, self.key = intended, (*self.key, seed)
        else:
            changed = _differs(after, before)
            out = f"{REFUSED}: {msg[:400]}" if not changed else f"lost: {changed[:6]} changed ({msg[:200]})"
        self.outcomes[name] = out
        return out

    # each flow: (ok, message) as SGLang answers it
    def _tensor(self, new, seed):
        return self.updater.update_weights_from_tensor(self.named(new))

    def _disk(self, new, seed):
        d = self._write(new, f"disk{seed}")
        return sglang_runtime.updater(self.model, d).update_weights_from_disk(d, "auto")[:2]

    def _session(self, new, seed):
        with self._in_session():
            return self.updater.update_weights_from_tensor(self.named(new))

    @contextlib.contextmanager
    def _in_session(self):
        """A begin/end weight-update session where the release has them (the scheduler requires one for tensor and
        distributed updates from 0.5.21); `end_weight_update(run_post_load=True)` as after a load."""
        if not hasattr(self.updater, "begin_weight_update"):
            yield
            return
        self.updater.begin_weight_update()
        try:
            yield
        finally:
            self.updater.end_weight_update(run_post_load=True)

    def _distributed(self, new, seed):
        with self._in_session():
            return self.updater.load_weights_from_distributed(self.named(new))

    def _direct(self, new, seed):
        raw = build(self.kind, {**self.intended, **new}, prepare=False)
        params = [("experts." + n, p.data) for n, p in raw.experts.named_parameters()]
        with self._in_session():
            return self.updater.update_weights_from_tensor(params, load_format="direct")

    def _ipc(self, new, seed):
        with ce.installed(ce.ParameterServer([self.named(new)])):
            return self.updater.update_weights_from_ipc(ce.request())

    def _scheduler(self, new, seed):
        from sglang.srt.managers.io_struct import UpdateWeightFromDiskReqInput

        d = self._write(new, f"sched{seed}")
        self.runner.weight_updater = sglang_runtime.updater(self.model, d, runner=self.runner)
        manager = spec_worker.scheduler(spec_worker.tp_worker(self.runner), None)
        out = manager.update_weights_from_disk(UpdateWeightFromDiskReqInput(model_path=d, load_format="auto"))
        self.runner.weight_updater = self.updater
        return out.success, out.message


def flows_for(kind: str) -> tuple[str, ...]:
    """The flows a model of `kind` takes on this release: every one, except a tensor update outside a session where
    SGLang prepares the format itself and the release's scheduler only takes tensor updates inside one (not a door a
    user has; SGLang's own 4-D BF16 layer cannot take one)."""
    from sglang_trtllm_moe import aside
    from sglang_trtllm_moe.compat import features

    fmt = SPECS[kind].kind.format
    if features.UPDATE_SESSIONS.present() and not aside.must_serve(fmt):
        return tuple(f for f in FLOWS if f != "tensor")
    return FLOWS


def run(kind: str, flows=None) -> dict:
    """Every flow of `flows` on a fresh model of `kind`, under the faults in force: {"start": ..., flow: outcome}."""
    with tempfile.TemporaryDirectory(prefix="trtllm-moe-faults-") as workdir:
        r = Run(kind, workdir)
        if r.model is not None:
            for i, name in enumerate(flows or flows_for(kind)):
                r.flow(name, seed=i + 1)
        return r.outcomes


def failures(outcomes: dict) -> dict:
    """The outcomes that are neither exact, refused nor refused at start-up."""
    ok = (EXACT, REFUSED, START, "ok")
    return {k: v for k, v in outcomes.items() if not any(v == o or v.startswith(o + ":") for o in ok)}


# ---- a scheduler request with a speculative draft, on a release that renamed what the plugin reads -----------------


class _Worker:
    """A target or draft worker of a release that renamed `weight_update_runners` (here: `_v2`)."""

    def __init__(self, runners: list):
        self._runners = runners

    def weight_update_runners_v2(self):
        return self._runners


def draft_request_with_unknown_runners() -> dict:
    """A disk request for a target and its draft through SGLang's own SchedulerWeightUpdaterManager, whose
    `_select_runners` (recompiled as if its source said so) calls the renamed `weight_update_runners_v2`: what the
    plugin's request-checks read by name is gone. Returns whether it was refused, its message, and whether both
    models kept every byte."""
    from safetensors.torch import save_file
    from sglang.srt.managers.io_struct import UpdateWeightFromDiskReqInput
    from sglang.srt.managers.scheduler_components.weight_updater import SchedulerWeightUpdaterManager

    kind = "nvfp4"
    target = build(kind, checkpoint(kind, 0), cls=spec_worker.Target)
    draft = build(kind, checkpoint(kind, 100), cls=spec_worker.Draft)
    runners = [spec_worker.runner(m) for m in (target, draft)]
    plain = spec_worker.scheduler(_Worker([("target", runners[0])]), _Worker([("draft", runners[1])]))
    select = _recompiled(
        SchedulerWeightUpdaterManager._select_runners, ".weight_update_runners()", ".weight_update_runners_v2()"
    )
    renamed = type("SchedulerWeightUpdaterManager", (SchedulerWeightUpdaterManager,), {"_select_runners": select})
    manager = renamed(**{f.name: getattr(plain, f.name) for f in dataclasses.fields(plain) if f.init})
    before = [state(target), state(draft)]
    with tempfile.TemporaryDirectory(prefix="trtllm-moe-faults-") as d:
        sglang_runtime.write_safetensors_checkpoint(d, {}, SPECS[kind])
        named = {**spec_worker.named(spec_worker.Target, checkpoint(kind, 1))}
        named.update(spec_worker.named(spec_worker.Draft, checkpoint(kind, 101)))
        save_file({k: v.contiguous() for k, v in named.items()}, os.path.join(d, "model.safetensors"))
        for r, m in zip(runners, (target, draft), strict=True):
            r.weight_updater = sglang_runtime.updater(m, d, runner=r)
        out = manager.update_weights_from_disk(UpdateWeightFromDiskReqInput(model_path=d, load_format="auto"))
    after = [state(target), state(draft)]
    return {
        "refused": not out.success,
        "message": out.message,
        "unchanged": all(not _differs(a, b) for a, b in zip(after, before, strict=True)),
        "request-checks": capabilities.decide("request-checks").status,
    }
