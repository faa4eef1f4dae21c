"""The model-update benchmark's modes and meters (bench_update.py): what each mode replaces (`bypass`,
`unhooked`), where the time of one update goes (`Clock`), and the untimed counts of one update (`counting`,
`summary`): SGLang's per-tensor loader writes, validations per write, value checks, tensor-to-Python conversions
(each a device synchronisation for a GPU tensor: `device_path`)."""

from __future__ import annotations

import contextlib
import functools
import threading
import time
import types
from collections import Counter
from typing import Any

import torch

from .layers import patched

# ---- what the modes replace ---------------------------------------------------------------------------------------


def bypass():
    """The plugin's checks and their bookkeeping replaced by pass-throughs (a context manager):

    * ``request.UpdateRequest.concerns`` -> False: the entry-point hooks (builtins/weight_updates.py
      `check_buckets_around`, `check_disk_around`) skip the request object altogether — the whole-bucket check,
      the `load_weights` wrapper that checks each list SGLang loads and writes its expert tensors batched, the
      request's record of what was checked (checked_writes.Checked), the verdict of the ranks, and the disk path's
      pre-check; ``checkpoint_headers.files_of`` -> [] (no listing of the checkpoint directory for its headers);
    * ``validation.check_write`` -> (the parameter's name, int(expert_id)) for a managed or watched layer, None
      otherwise: only what the loader hooks need to route the write (no name / shard / expert / device / dtype /
      shape / value checks); ``validation.check_local_expert`` -> int(expert_id).
    Kept: the loader hooks themselves (the look-up of the request's record, which is empty; the thread-local
    handshake handing the parameter's name to `_weight_loader_impl`; the layer lock; the per-expert un-prepare
    before a write into a prepared expert; the layout callbacks) and the flushes — the layout work that keeps the
    layer exact."""
    from ..layer_state import observed, state_of
    from ..updates import checkpoint_headers, layer_params, request, validation

    def check_write(layer, param, loaded, weight_name, shard_id, expert_id, scope="local", headers=False, values=True):
        st = state_of(layer)
        fmt = st.fmt if st is not None else observed(layer)
        if fmt is None:
            return None
        return layer_params.param_name(layer, param, fmt), int(expert_id)

    return patched(
        (request.UpdateRequest, "concerns", lambda self, model: False),
        (checkpoint_headers, "files_of", lambda *a, **k: []),
        (validation, "check_write", check_write),
        (validation, "check_local_expert", lambda layer, param, name, expert_id, shard_id: int(expert_id)),
    )


def _set_loader(p, fn) -> None:
    """A Parameter's `weight_loader`: SGLang's BasevLLMParameter keeps it behind a read-only property."""
    if isinstance(getattr(type(p), "weight_loader", None), property):
        p._weight_loader = fn
    else:
        p.weight_loader = fn


def _unwrapped(fn):
    while hasattr(fn, "__wrapped__"):
        fn = fn.__wrapped__
    return fn


@contextlib.contextmanager
def unhooked(model):
    """`bypass()`, and every FusedMoE layer of `model` loads through SGLang's own `weight_loader` and
    `_weight_loader_impl` (the HookRegistry wrappers unwrapped): the Parameters' `weight_loader` (bound at
    create_weights) and the layer's `_weight_loader_impl` point at the originals for the block. Exact only where
    no write lands on a prepared expert: inside a begin/end session, or for layers SGLang prepares itself."""
    from sglang.srt.layers.moe.fused_moe_triton.layer import FusedMoE

    from .models import moe_layers

    loader, impl = _unwrapped(FusedMoE.weight_loader), _unwrapped(FusedMoE._weight_loader_impl)
    saved = []
    for layer in moe_layers(model).values():
        for p in layer.parameters(recurse=False):
            wl = getattr(p, "weight_loader", None)
            if getattr(wl, "__self__", None) is layer and getattr(wl, "__func__", None) is FusedMoE.weight_loader:
                saved.append((p, wl))
                _set_loader(p, types.MethodType(loader, layer))
        layer.__dict__["_weight_loader_impl"] = types.MethodType(impl, layer)
    try:
        with bypass():
            yield
    finally:
        for p, wl in saved:
            _set_loader(p, wl)
        for layer in moe_layers(model).values():
            layer.__dict__.pop("_weight_loader_impl", None)


def unhooked_exact(flow: str, model) -> bool:
    """Whether `unhooked` leaves `model` exact in `flow`: always in a session (tensor, flattened); on disk only where
    no layer has the plugin's layout state (every MoE layer prepared by SGLang itself)."""
    from .. import layer_state
    from .models import moe_layers

    return flow != "disk" or all(layer_state.state_of(m) is None for m in moe_layers(model).values())


# ---- where the time goes, in every mode ---------------------------------------------------------------------------


class Clock:
    """Seconds per kind of work during one update (perf_counter around each call; nested calls of one kind counted
    once):

    * ``layout``: the plugin's layout work: `layer_state.flush` (prepare of the dirty experts, kernel scalars) and
      every `WeightFormat.unprepare_` (before a write into a prepared expert, at begin_weight_update);
    * ``entry_checks``: the entry points' whole-request checks: the request's `check` (tensor buckets: every runner's
      tensors, their values, the verdict of the ranks) and `check_checkpoint` (the disk path's check of the
      checkpoint), and `checkpoint_headers.files_of` (listing it);
    * ``loader_checks``: `validation.check_write` / `check_local_expert` called by the loader hooks (per write);
    * ``batched_writes``: `batched_writes.write` (the expert tensors of managed layers written per group, their
      un-prepare included: that part is counted in ``layout`` too)
    In the bypassed mode the same names time the pass-throughs."""

    KINDS = ("layout", "entry_checks", "loader_checks", "batched_writes")

    def __init__(self, model):
        from .. import layer_state
        from ..updates import batched_writes, checked_writes, checkpoint_headers, request, validation
        from .models import moe_layers

        self.reset()
        self._tls = threading.local()
        self._lock = threading.Lock()
        fmts = {id(st.fmt): st.fmt for m in moe_layers(model).values() if (st := layer_state.state_of(m))}
        self._targets: list[tuple[Any, str, str]] = [(layer_state, "flush", "layout")]
        self._targets += [(f, "unprepare_", "layout") for f in fmts.values()]
        self._targets += [
            (request.UpdateRequest, "check", "entry_checks"),
            (checkpoint_headers, "files_of", "entry_checks"),
            (request.UpdateRequest, "check_checkpoint", "entry_checks"),
            (validation, "check_write", "loader_checks"),
            (checked_writes, "checked_write", "loader_checks"),
            (validation, "check_local_expert", "loader_checks"),
            (batched_writes, "write", "batched_writes"),
        ]
        self._cm = None

    #: kinds also timed in CPU seconds of the calling thread (a few calls per update: `time.thread_time` is a system
    #: call, ~1.5 us here, too dear around each of thousands of loader calls)
    CPU_KINDS = ("layout", "entry_checks")

    def reset(self) -> None:
        self.s = dict.fromkeys(self.KINDS, 0.0)  # wall seconds (the loader calls run in the calling thread)
        self.cpu = dict.fromkeys(self.CPU_KINDS, 0.0)

    def _timed(self, fn, kind):
        @functools.wraps(fn)
        def timed(*a, **k):
            if getattr(self._tls, kind, False):
                return fn(*a, **k)
            setattr(self._tls, kind, True)
            cpu = kind in self.CPU_KINDS
            c = time.thread_time() if cpu else 0.0
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                dt = time.perf_counter() - t
                dc = time.thread_time() - c if cpu else 0.0
                setattr(self._tls, kind, False)
                with self._lock:
                    self.s[kind] += dt
                    if cpu:
                        self.cpu[kind] += dc

        return timed

    def __enter__(self):
        # wraps what is there now (the mode's pass-throughs, when a mode patched them first)
        self._cm = patched(*[(obj, attr, self._timed(getattr(obj, attr), kind)) for obj, attr, kind in self._targets])
        self._cm.__enter__()
        return self

    def __exit__(self, *exc):
        assert self._cm is not None
        return self._cm.__exit__(*exc)


# ---- counting run -----------------------------------------------------------------------------------------------


@contextlib.contextmanager
def device_path():
    """value_checks takes the path of device tensors for CPU tensors too (groups reduced together, one read-back per
    device per call), so that a count of tensor-to-Python conversions on the CPU is the count of device
    synchronisations the same update makes on CUDA tensors."""
    from ..updates import value_checks

    saved = set(value_checks.PER_TENSOR_DEVICES)
    value_checks.PER_TENSOR_DEVICES.clear()
    try:
        yield
    finally:
        value_checks.PER_TENSOR_DEVICES.update(saved)


#: tensor -> Python conversions: each waits for the device when the tensor lives on a GPU
SYNCS = ("__bool__", "__float__", "__int__", "__index__", "item", "tolist")


@contextlib.contextmanager
def counting(model):
    """Counters for one update (untimed): FusedMoE.weight_loader calls, the writes checked per source (a request's
    checks: `bucket_validation.check_items`, one per runner and list; the loader hooks: `check_write`) and per
    written (layer, parameter, shard, expert), value checks, and tensor-to-Python conversions in the validation
    path (inside check_items / check_values / check_write / check_tensor / value_checks.find_bad /
    check_local_expert / expert_index) and outside it."""
    from ..updates import (
        batched_writes,
        bucket_validation,
        checked_writes,
        checkpoint_checks,
        layer_params,
        validation,
        value_checks,
    )
    from .models import moe_layers

    c: dict = {"loader_calls": 0, "check_write": Counter(), "per_write": Counter(), "syncs_in_validation": Counter()}
    c["conversions_elsewhere"] = Counter()
    c["bad_value_calls"] = 0
    c["bucket_checks"] = 0
    tls = threading.local()
    lock = threading.Lock()

    def depth():
        return getattr(tls, "depth", 0)

    def in_validation(fn, tag=None):
        if getattr(fn, "__module__", None) == __name__:
            return fn  # a pass-through of bypass(): validates nothing, counted as nothing

        @functools.wraps(fn)
        def wrapper(*a, **k):
            if tag is not None and tag != "bucket":
                with lock:
                    if tag == "bad_value":
                        c["bad_value_calls"] += 1
                    else:
                        layer, param, _, _, shard, expert = a[:6]
                        scope = k.get("scope", a[6] if len(a) > 6 else "local")
                        c["check_write"][f"loader/{scope}"] += 1
                        key = (id(layer), layer_params.param_name(layer, param), shard, expert)
                        c["per_write"][key] += 1
            tls.depth = depth() + 1
            try:
                out = fn(*a, **k)
            finally:
                tls.depth = depth() - 1
            if tag == "bucket":  # a request's check of one list for one runner: what it checked
                with lock:
                    c["bucket_checks"] += 1
                    for _, t in out.checked:
                        c["check_write"]["bucket"] += 1
                        c["per_write"][(id(t.ps.layer), t.ps.pname, t.ps.shard, t.expert)] += 1
            return out

        return wrapper

    def conversion(name, orig):
        def wrapper(self, *a, **k):
            with lock:
                (c["syncs_in_validation"] if depth() else c["conversions_elsewhere"])[name] += 1
            return orig(self, *a, **k)

        return wrapper

    pairs: list[tuple[Any, str, Any]] = [
        (validation, "check_write", in_validation(validation.check_write, "loader")),
        (bucket_validation, "check_items", in_validation(bucket_validation.check_items, "bucket")),
        (bucket_validation, "check_values", in_validation(bucket_validation.check_values)),
        (validation, "check_tensor", in_validation(validation.check_tensor)),
        (bucket_validation, "check_tensor", in_validation(bucket_validation.check_tensor)),
        (value_checks, "find_bad", in_validation(value_checks.find_bad, "bad_value")),
        (value_checks, "bad_one", in_validation(value_checks.bad_one, "bad_value")),
        (checkpoint_checks, "checkpoint_findings", in_validation(checkpoint_checks.checkpoint_findings)),
        (validation, "check_local_expert", in_validation(validation.check_local_expert)),
        (checked_writes, "checked_write", in_validation(checked_writes.checked_write)),
        (validation, "expert_index", in_validation(validation.expert_index)),
    ]
    pairs += [(torch.Tensor, n, conversion(n, getattr(torch.Tensor, n))) for n in SYNCS]
    # SGLang's per-tensor writes, counted where FusedMoE.weight_loader hands each one to the layer's
    # `_weight_loader_impl` (an instance attribute for the block): the Parameters' weight_loader stay the layer's own,
    # so batched writes (batched_writes.py) still take them
    layers = list(moe_layers(model).values())
    for layer in layers:

        def counted(*a, _impl=layer._weight_loader_impl, **k):
            with lock:
                c["loader_calls"] += 1
            return _impl(*a, **k)

        layer.__dict__["_weight_loader_impl"] = counted
    batched_before = batched_writes.counts()
    try:
        with patched(*pairs):
            yield c
    finally:
        for layer in layers:
            layer.__dict__.pop("_weight_loader_impl", None)
        after = batched_writes.counts()
        c["batched"] = {k: after.get(k, 0) - batched_before.get(k, 0) for k in ("tensors", "dropped", "left")}


def summary(c: dict, expert_tensors: int, buckets: int) -> dict:
    per = c["per_write"]
    syncs = sum(c["syncs_in_validation"].values())
    return {
        # SGLang's per-tensor loader writes (one per tensor and local expert slot; 0 for batched tensors)
        "fused_moe_weight_loader_calls": c["loader_calls"],
        "batched_expert_tensors": c["batched"]["tensors"],
        "expert_tensors_left_to_sglang": c["batched"]["left"],
        "expert_tensors_in_request": expert_tensors,
        "check_write_calls": dict(c["check_write"]),
        "bucket_checks": c["bucket_checks"],
        "validations_per_write": dict(sorted(Counter(per.values()).items())),  # times validated: writes
        "value_checks": c["bad_value_calls"],
        "syncs_in_validation": dict(c["syncs_in_validation"]),
        "syncs_in_validation_total": syncs,
        "syncs_in_validation_per_bucket": round(syncs / buckets, 1) if buckets else None,
        # SGLang's loader, layer_state's CPU masks: not the validation path
        "tensor_to_python_outside_validation": dict(c["conversions_elsewhere"]),
    }
