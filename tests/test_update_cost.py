"""What the plugin does per RL weight update, counted, never timed (issue #29): through SGLang's own update entry
points, each written tensor is validated once per request, the values of a bucket are checked with at most one
device synchronisation (nothing per tensor), and what a request's check recorded lives only while it runs.

Device synchronisations are counted on the CPU as CUDA would make them: the request's tensors are a tensor subclass
(`Counted`: what any op on them returns is one too) that counts every tensor -> Python conversion (`bool`, `float`,
`int`, `item`, `tolist`: each waits for the device when the tensor is on a GPU) made by the plugin's code, and
value_checks takes the path of device tensors for CPU tensors too (`PER_TENSOR_DEVICES` emptied: on the CPU it reads
scalars one by one, as nothing is to be synchronised there). The layer's per-expert layout masks live on the CPU on
every device; they are not the request's tensors and are not counted.
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import sys
import threading

import pytest
import torch

from sglang_trtllm_moe.errors import WeightUpdateRefused
from sglang_trtllm_moe.sandbox import layers as cpu_layers
from sglang_trtllm_moe.updates import (
    batched_writes,
    bucket_validation,
    checked_writes,
    checkpoint_headers,
    validation,
    value_checks,
    write_plans,
)

from .support import bad_updates as B
from .support import sglang_runtime

BUCKETS = 3
_PLUGIN = "sglang_trtllm_moe"
_COUNTS: collections.Counter = collections.Counter()
_LOCK = threading.Lock()


def _caller_is_the_plugin() -> bool:
    f = sys._getframe(3)
    while f is not None and f.f_globals.get("__name__", "").startswith("torch"):
        f = f.f_back  # torch's own Python wrappers (Tensor.__bool__ -> ...)
    name = f.f_globals.get("__name__", "") if f is not None else ""
    return name.startswith(_PLUGIN) and not name.startswith(f"{_PLUGIN}.sandbox")


class Counted(torch.Tensor):
    """A tensor whose conversions to Python by the plugin are counted (a device synchronisation each on CUDA)."""

    @staticmethod
    def _count(what: str) -> None:
        if _caller_is_the_plugin():
            with _LOCK:
                _COUNTS[what] += 1

    def __bool__(self):
        Counted._count("bool")
        return super().__bool__()

    def __float__(self):
        Counted._count("float")
        return super().__float__()

    def __int__(self):
        Counted._count("int")
        return super().__int__()

    def __index__(self):
        Counted._count("index")
        return super().__index__()

    def item(self):
        Counted._count("item")
        return super().item()

    def tolist(self):
        Counted._count("tolist")
        return super().tolist()


@pytest.fixture(scope="module", autouse=True)
def runtime():
    # torch's thread count is tests/conftest.py's (SGLANG_TRTLLM_MOE_TEST_THREADS): these tests count, never time
    sglang_runtime.ensure("flashinfer_trtllm")


@pytest.fixture
def device_path(monkeypatch):
    """value_checks as on CUDA: every tensor in groups, one read-back per device per request."""
    monkeypatch.setattr(value_checks, "PER_TENSOR_DEVICES", set())
    _COUNTS.clear()
    yield _COUNTS


def _checkpoint(spec, seed):
    """The test checkpoint, with one input scale for gate and up (one activation feeds both; SGLang keeps one per
    expert, so with distinct ones the last write would win, and a thread pool writes in any order)."""
    tensors = B.checkpoint(spec, seed=seed)
    for name in list(tensors):
        if name.endswith("up_proj.input_scale"):
            tensors[name] = tensors[name.replace("up_proj", "gate_proj")].clone()
    return tensors


def _buckets(config, seed=1, counted=True):
    spec = B.CONFIGS[config]
    items = list(cpu_layers.checkpoint_names(_checkpoint(spec, seed)).items())
    if counted:
        items = [(n, t.as_subclass(Counted)) for n, t in items]
    per = -(-len(items) // BUCKETS)
    return [items[k : k + per] for k in range(0, len(items), per)]


def _same_as_fresh(model, config, seed):
    spec = B.CONFIGS[config]
    fresh = sglang_runtime.prepared_model(spec, _checkpoint(spec, seed))
    return B.changed(model.experts, B.snapshot(fresh.experts, only=B.compared(fresh.experts))) == []


class Checks:
    """Every validation of a write while `counting` (the plans' `accepts` and the full checks), per (parameter,
    shard, expert) and per caller."""

    def __init__(self):
        self.on = False
        self.seen: collections.Counter = collections.Counter()
        self.where: collections.Counter = collections.Counter()
        self.alive: list = []

    @contextlib.contextmanager
    def counting(self):
        self.on = True
        try:
            yield self
        finally:
            self.on = False


@pytest.fixture
def checks(monkeypatch):
    """Counts the request's per-tensor check (a plan's `tensor_code`, where the name's own checks were made once; the
    next tensor of a run of one buffer compared to the run's first), a plan's `accepts` (the loader hooks, and a
    request's writes SGLang converts) and the full checks."""
    c = Checks()
    code, accepts, full = write_plans.WritePlan.tensor_code, write_plans.WritePlan.accepts, validation._check_write
    inside = threading.local()

    def counted_code(plan, loaded, *a):
        if c.on and not getattr(inside, "on", False):
            c.alive.append(loaded)  # no id reused while counting
            c.seen[(plan.name, id(loaded))] += 1
            c.where["entry"] += 1
        return code(plan, loaded, *a)

    def counted_accepts(plan, layer, param, loaded, weight_name, shard_id, expert_id, scope, *a):
        if c.on:
            c.alive.append(loaded)
            c.seen[(plan.name, id(loaded))] += 1
            c.where["entry" if isinstance(a[-1], list) else f"loader/{scope}"] += 1
        inside.on = True
        try:
            return accepts(plan, layer, param, loaded, weight_name, shard_id, expert_id, scope, *a)
        finally:
            inside.on = False

    def counted_full(layer, param, loaded, weight_name, shard_id, expert_id, scope, headers, values):
        if c.on:
            c.where[f"full/{scope}"] += 1
        return full(layer, param, loaded, weight_name, shard_id, expert_id, scope, headers, values)

    takes = bucket_validation._Run.takes

    def counted_takes(run, tensor):  # the next tensor of a run of one buffer, compared to its first
        ok = takes(run, tensor)
        if ok and c.on:
            c.alive.append(tensor)
            c.seen[("run", id(tensor))] += 1
            c.where["entry"] += 1
        return ok

    monkeypatch.setattr(bucket_validation._Run, "takes", counted_takes)
    monkeypatch.setattr(write_plans.WritePlan, "tensor_code", counted_code)
    monkeypatch.setattr(write_plans.WritePlan, "accepts", counted_accepts)
    monkeypatch.setattr(validation, "_check_write", counted_full)
    return c


def _model(config="nvfp4"):
    spec = B.CONFIGS[config]
    return sglang_runtime.prepared_model(spec, B.checkpoint(spec, seed=0))


@pytest.mark.parametrize(
    "config",
    [
        "nvfp4",
        pytest.param(
            "fp8_block", marks=pytest.mark.sglang("capability:fp8-prep", reason="the plugin prepares FP8 from 0.5.19")
        ),
    ],
)
def test_each_tensor_is_validated_once_and_a_bucket_synchronises_once(config, device_path, checks):
    model = _model(config)
    u = sglang_runtime.updater(model)
    buckets = _buckets(config)
    expert_tensors = sum(len(b) for b in buckets)
    with checks.counting():
        for b in buckets:
            ok, msg = u.update_weights_from_tensor(b)
            assert ok, msg
    assert _same_as_fresh(model, config, 1)
    assert len(checks.seen) == expert_tensors and set(checks.seen.values()) == {1}, "validated twice, or never"
    assert checks.where == {"entry": expert_tensors}, checks.where  # the loader hooks checked nothing again
    # the values: one read-back per bucket (each holds every kind of scale), none per tensor
    assert dict(device_path) == {"tolist": BUCKETS}, dict(device_path)
    assert not checked_writes._ACTIVE and not checked_writes._FROM_FILES  # nothing of the requests is kept


def test_flattened_buckets_are_validated_once_when_load_weights_gets_them(device_path, checks):
    """SGLang re-creates the tensors of a flattened bucket (views of one buffer): they are checked when the model's
    load_weights receives them, and the loader hooks do not check them again."""
    from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket

    model = _model()
    u = sglang_runtime.updater(model)
    buckets = _buckets("nvfp4", counted=False)
    with checks.counting():
        for b in buckets:
            flat = FlattenedTensorBucket(named_tensors=b)
            payload = {
                "flattened_tensor": flat.get_flattened_tensor().as_subclass(Counted),
                "metadata": flat.get_metadata(),
            }
            ok, msg = u.update_weights_from_tensor(payload, load_format="flattened_bucket")
            assert ok, msg
    assert _same_as_fresh(model, "nvfp4", 1)
    assert set(checks.seen.values()) == {1}
    assert checks.where == {"entry": sum(len(b) for b in buckets)}, checks.where
    assert dict(device_path) == {"tolist": BUCKETS}, dict(device_path)


def test_the_loader_hooks_of_a_thread_pool_see_the_request(monkeypatch, checks):
    """DeepSeek's loader writes CPU tensors from a thread pool: the writes of every thread are the request's. (The
    tensors SGLang's loader still writes one by one: expert tensors of managed layers are written batched by the
    entry point since issue #38, so the per-tensor path is asked for here; tests/test_batched_writes.py covers the
    batched one.)"""
    model = _model()
    u = sglang_runtime.updater(model)
    real = cpu_layers.load_checkpoint
    threads: set = set()

    def one(layer, name, t, num_experts):
        threads.add(threading.get_ident())
        return real(layer, {name: t}, num_experts)

    def pooled(layer, tensors, num_experts):
        with concurrent.futures.ThreadPoolExecutor(max_workers=4) as pool:
            for f in [pool.submit(one, layer, n, t, num_experts) for n, t in tensors.items()]:
                f.result()
        return len(tensors)

    with monkeypatch.context() as m, checks.counting(), batched_writes.disabled():
        m.setattr(cpu_layers, "load_checkpoint", pooled)
        for b in _buckets("nvfp4", counted=False):
            ok, msg = u.update_weights_from_tensor(b)
            assert ok, msg
    assert threads and threading.get_ident() not in threads
    assert _same_as_fresh(model, "nvfp4", 1)
    assert set(checks.seen.values()) == {1} and set(checks.where) == {"entry"}, checks.where


def test_writes_outside_a_request_are_checked_whole_every_time(checks):
    """A user's own load_weights (no entry point): every write is checked in the loader hook, values included — the
    same tensor objects a finished request validated too (what a request recorded ends with it)."""
    model = _model()
    u = sglang_runtime.updater(model)
    bucket = [item for b in _buckets("nvfp4", counted=False) for item in b]
    ok, msg = u.update_weights_from_tensor(bucket)
    assert ok, msg
    _, scale = next((n, t) for n, t in bucket if n.endswith("experts.2.down_proj.weight_scale_2"))
    scale.fill_(float("nan"))  # the tensor that request validated, changed after it
    with checks.counting(), pytest.raises(WeightUpdateRefused, match="w2_weight_scale_2.*finite and > 0"):
        model.load_weights(bucket)
    assert checks.where["loader/global"] >= 1 and "entry" not in checks.where, checks.where


def test_a_disk_update_checks_each_tensor_once_and_reads_each_scale_once(tmp_path, checks, monkeypatch):
    """The disk path: every tensor checked from its header; the values of every scale read from the files once and
    checked at once, and written from what was read (issue #52); SGLang's writes of those tensors (the same dtype and
    shape, from the unchanged files) are not checked again."""
    spec = B.CONFIGS["nvfp4"]
    model = _model()
    d = str(tmp_path / "ckpt")
    sglang_runtime.write_safetensors_checkpoint(d, _checkpoint(spec, 1), spec)
    u = sglang_runtime.updater(model, d)
    finds = []
    real = value_checks.find_bad

    def counted_find_bad(items):
        finds.append(len(items))
        return real(items)

    read, written = {}, []
    real_read, real_write = checkpoint_headers.read_tensors, batched_writes.write

    def read_tensors(headers, names):
        for name, t in real_read(headers, names):
            read[name] = t
            yield name, t

    def write(items, *a, **k):
        written.extend(n for n, t in items if read.get(n) is t)
        return real_write(items, *a, **k)

    with monkeypatch.context() as m, checks.counting():
        m.setattr(value_checks, "find_bad", counted_find_bad)
        m.setattr(value_checks, "bad_one", lambda *a: pytest.fail("a value checked on its own"))
        m.setattr(checkpoint_headers, "read_tensors", read_tensors)
        m.setattr(batched_writes, "write", write)
        ok, msg = u.update_weights_from_disk(d, "auto")
        assert ok, msg
    assert _same_as_fresh(model, "nvfp4", 1)
    # the values the pre-check read are what was written (SGLang's own tensors of them, views of the mapped file,
    # never read): each scale read from the files once
    assert sorted(written) == sorted(read) and len(read) == spec.num_experts * 9, (len(written), len(read))
    expert_tensors = spec.num_experts * 12
    # (a checkpoint's headers share one meta tensor per dtype and shape: counted per check, not per object)
    assert sum(checks.seen.values()) == expert_tensors, checks.seen
    assert checks.where == {"entry": expert_tensors}, checks.where
    assert finds == [spec.num_experts * 9]  # every scale (3 kinds x 3 projections per expert), in one call
    assert not checked_writes._ACTIVE and not checked_writes._FROM_FILES


def test_a_refused_bucket_records_nothing():
    model = _model()
    u = sglang_runtime.updater(model)
    bucket = [item for b in _buckets("nvfp4", counted=False) for item in b]
    i = next(i for i, (n, _) in enumerate(bucket) if n.endswith("experts.3.up_proj.weight"))
    bucket[i] = (bucket[i][0], bucket[i][1].float())
    snap = B.snapshot(model.experts)
    ok, msg = u.update_weights_from_tensor(bucket)
    assert not ok and "refused the whole weight-update bucket" in msg
    assert B.changed(model.experts, snap) == []
    assert not checked_writes._ACTIVE
    record = checked_writes.Checked()
    with pytest.raises(bucket_validation.BucketRefused):
        bucket_validation.check_bucket(model, bucket, record=record)
    assert len(record) == 0


def test_a_flattened_bucket_is_checked_per_run_of_experts(monkeypatch):
    """Tensors that are views of one buffer (a flattened bucket) at a constant stride, one parameter's of consecutive
    experts: their values are checked as one strided view per run (issue #52: Python per run, not per tensor), and
    a bad byte in the middle of a run still names its own expert and nothing is written."""
    from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket

    spec = B.CONFIGS["nvfp4"]
    model = _model()
    u = sglang_runtime.updater(model)
    items = list(cpu_layers.checkpoint_names(_checkpoint(spec, 1)).items())
    scales = [n for n, _ in items if "scale" in n]
    jobs: list = []
    real = value_checks.find_bad

    def counted_find_bad(found):
        jobs.append(len(found))
        return real(found)

    def flat(bucket):
        f = FlattenedTensorBucket(named_tensors=bucket)
        return {"flattened_tensor": f.get_flattened_tensor(), "metadata": f.get_metadata()}

    from sglang_trtllm_moe.updates import slot_writes

    written: list = []
    real_runs = slot_writes.runs

    def counted_runs(writes):
        out = real_runs(writes)
        written.extend(k for _, k, _, _ in out)
        return out

    monkeypatch.setattr(value_checks, "find_bad", counted_find_bad)
    monkeypatch.setattr(slot_writes, "runs", counted_runs)
    ok, msg = u.update_weights_from_tensor(flat(items), load_format="flattened_bucket")
    assert ok, msg
    assert _same_as_fresh(model, "nvfp4", 1)
    # one job per (parameter, shard) run: 9 kinds of scale (3 per projection), not one per expert
    assert jobs == [9] and len(scales) == 9 * spec.num_experts, (jobs, len(scales))
    # and every group of writes (one per parameter, shard and plan) is one run of all the experts
    assert written and set(written) == {spec.num_experts}, written
    bad = dict(cpu_layers.checkpoint_names(_checkpoint(spec, 2)))
    key = next(n for n in bad if n.endswith("experts.2.up_proj.weight_scale"))
    bad[key] = bad[key].clone()
    bad[key].view(torch.uint8).view(-1)[3] = 0xFF  # an e4m3 NaN, inside the run of experts 0-3
    snap = B.snapshot(model.experts)
    ok, msg = u.update_weights_from_tensor(flat(list(bad.items())), load_format="flattened_bucket")
    assert not ok and "expert 2" in msg and "w13_weight_scale" in msg and "1 refused" in msg, msg
    assert B.changed(model.experts, snap) == []
