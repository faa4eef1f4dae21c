"""Batched expert writes (issue #38): through SGLang's update entry points, the expert tensors of a layer the plugin
manages are written per (layer, parameter) by `batched_writes`, not one by one through the model's `load_weights`
and SGLang's FusedMoE loader — and the bytes are exactly those of SGLang's own per-tensor path.

For every kind of layer the sandbox builds (sandbox/layers.py LAYERS: every format of the registry), on a real
SGLang FusedMoE prepared by the plugin (also the formats SGLang prepares itself on some releases: their plugin path
is what serves the others), the same requests go to two models loaded from the same checkpoint: one as shipped,
one with batched writes switched off (`batched_writes.disabled()`: what the plugin did before, SGLang's loader per
tensor). After each request every parameter (bytes), the per-expert layout state and the kernel scalars must be
equal, and the batched model's SGLang loader must not have been asked to write one expert tensor of a managed
layer (a counter at `FusedMoE._weight_loader_impl`). Requests: the whole layer in two buckets, a partial update (two
experts, some projections), split experts (gate, up and down of each expert in three buckets), a slot written twice
in one bucket, a flattened bucket, experts of another EP rank, and writes racing a flusher and a per-tensor writer.
`test_a_broken_batched_write_is_caught` breaks the batched path on purpose and shows the comparison fails.
"""

from __future__ import annotations

import contextlib
import threading

import pytest
import torch

from sglang_trtllm_moe import layer_attrs, layer_state, layouts
from sglang_trtllm_moe.sandbox import layers as cpu_layers
from sglang_trtllm_moe.updates import batched_writes

from .support import bad_updates as B
from .support import sglang_runtime

#: one layer per kind the sandbox builds, and the padded and non-gated variants of the formats that have them
SPECS = {
    **{
        kind: cpu_layers.MoeSpec(num_experts=4, hidden=256, fmt=kind)  # the kind's own intermediate (128; INT4 256)
        for kind in sorted(cpu_layers.LAYERS)
    },
    "nvfp4-I96-padded": cpu_layers.MoeSpec(num_experts=4, hidden=256, intermediate=96, fmt="nvfp4"),
    "nvfp4-relu2": cpu_layers.MoeSpec(
        num_experts=4, hidden=256, intermediate=128, fmt="nvfp4", gated=False, activation="relu2"
    ),
    "fp8_tensor-relu2": cpu_layers.MoeSpec(
        num_experts=4, hidden=256, intermediate=128, fmt="fp8_tensor", gated=False, activation="relu2"
    ),
    "bf16-I96-padded": cpu_layers.MoeSpec(num_experts=4, hidden=256, intermediate=96, fmt="bf16"),
}


@pytest.fixture(scope="module", autouse=True)
def runtime():
    sglang_runtime.ensure("flashinfer_trtllm")


#: kinds whose layers SGLang prepares itself where compat/defer.py says it is right (every release for DeepSeek FP8
#: block, whose loaded layout is the kernel's): batched too (formats' `batched_where_sglang_prepares`)
SGLANG_PREPARES = {"fp8_block-sglang": cpu_layers.MoeSpec(num_experts=4, hidden=256, intermediate=128, fmt="fp8_block")}
SPECS.update(SGLANG_PREPARES)


@pytest.fixture(autouse=True)
def plugin_prepares(monkeypatch, request):
    """The plugin's own path for the formats SGLang prepares itself where it is right (compat/defer.py) is what
    serves the other releases: tested on every release (and SGLang's own, for the kinds of SGLANG_PREPARES)."""
    kind = request.node.callspec.params.get("kind") if hasattr(request.node, "callspec") else None
    sglang_runtime.plugin_prepares(monkeypatch, "bf16", *(() if kind in SGLANG_PREPARES else ("fp8_block",)))


def _tensors(spec, seed):
    return cpu_layers.checkpoint_names(spec.kind.checkpoint(spec, seed=seed))


def _model(spec):
    # the MXFP4 formats are served (and prepared in place) on SGLang's flashinfer_mxfp4 backend
    sglang_runtime.ensure(spec.kind.format.own_backend or "flashinfer_trtllm")
    return sglang_runtime.prepared_model(spec, spec.kind.checkpoint(spec, seed=0))


def _bytes(t: torch.Tensor) -> torch.Tensor:
    t = t.detach()
    return t.contiguous().view(torch.uint8) if t.dtype.itemsize == 1 else t.clone()


def _state(model) -> dict:
    st = layer_state.state_of(model.experts)
    return {} if st is None else {g: m.clone() for g, m in st.prepared.items()}


def differences(a, b) -> list[str]:
    """Parameters (bytes, shapes) and per-expert layout state of two models' MoE layers that differ: every parameter
    a load defines (the format's and the kernel scalars; not the never-written placeholders some releases register,
    NVFP4 `*_blockscale_swizzled` before 0.5.13)."""
    pa, pb = dict(a.experts.named_parameters()), dict(b.experts.named_parameters())
    out = [n for n in sorted(set(pa) ^ set(pb))]
    for n in sorted(B.compared(a.experts) | B.compared(b.experts)):
        x, y = _bytes(pa[n]), _bytes(pb[n])
        if x.shape != y.shape or not torch.equal(x, y):
            out.append(n)
    sa, sb = _state(a), _state(b)
    out += [f"layout state of {g}" for g in sorted(set(sa) | set(sb)) if not torch.equal(sa.get(g), sb.get(g))]
    return out


@contextlib.contextmanager
def sglang_writes(model):
    """Counts SGLang's per-tensor loader writes into the model's MoE layer (FusedMoE.weight_loader hands each one to
    the layer's `_weight_loader_impl`)."""
    layer = model.experts
    calls = [0]
    impl = layer._weight_loader_impl

    def counted(*a, **k):
        calls[0] += 1
        return impl(*a, **k)

    layer.__dict__["_weight_loader_impl"] = counted
    try:
        yield calls
    finally:
        layer.__dict__.pop("_weight_loader_impl", None)


def _experts_of(name: str) -> int:
    return int(name.split(".experts.")[1].split(".")[0])


def _requests(spec, scenario: str) -> list[list]:
    """The buckets of one scenario, as (name, tensor) lists."""
    new = _tensors(spec, seed=1)
    items = list(new.items())
    if spec.kind.format.fused:
        return [items]
    if scenario == "full":
        half = len(items) // 2
        return [items[:half], items[half:]]
    if scenario == "partial":  # expert 1: its GEMM1 projections only; expert 3: its down projection only
        return [
            [
                (n, t)
                for n, t in items
                if (_experts_of(n) == 1 and "down_proj" not in n) or (_experts_of(n) == 3 and "down_proj" in n)
            ]
        ]
    if scenario == "split":  # each expert's projections spread over three buckets
        return [[(n, t) for n, t in items if f".{proj}." in n] for proj in ("gate_proj", "up_proj", "down_proj")]
    if scenario == "twice":  # one bucket writes expert 0's tensors twice: the last write wins, as in SGLang's loop
        other = list(_tensors(spec, seed=2).items())
        return [items + [(n, t) for n, t in other if _experts_of(n) == 0]]
    raise KeyError(scenario)


def _update_from_disk(model, buckets) -> None:
    """Each bucket as a checkpoint directory, through SGLang's update_weights_from_disk."""
    import os
    import shutil
    import tempfile

    from safetensors.torch import save_file

    for b in buckets:
        d = tempfile.mkdtemp(prefix="trtllm-moe-batched-disk-")
        try:
            sglang_runtime.write_safetensors_checkpoint(d, {}, model.spec)  # config.json
            save_file({n: t.contiguous() for n, t in b}, os.path.join(d, "model.safetensors"))
            ok, msg = sglang_runtime.updater(model, d).update_weights_from_disk(d, "auto")
        finally:
            shutil.rmtree(d, ignore_errors=True)
        assert ok, msg


def _update(model, buckets, flattened: bool = False, disk: bool = False) -> None:
    if disk:
        return _update_from_disk(model, buckets)
    u = sglang_runtime.updater(model)
    for b in buckets:
        if flattened:
            from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket

            flat = FlattenedTensorBucket(named_tensors=b)
            payload = {"flattened_tensor": flat.get_flattened_tensor(), "metadata": flat.get_metadata()}
            ok, msg = u.update_weights_from_tensor(payload, load_format="flattened_bucket")
        else:
            ok, msg = u.update_weights_from_tensor(b)
        assert ok, msg


#: kinds whose checkpoint tensors SGLang's own loader converts on every write (formats' `converted_by_sglang`: the
#: BF16 experts of the online NVFP4 kinds, quantized by SGLang's online loader): batched_writes leaves them to it
CONVERTED_BY_SGLANG = {"nvfp4_online", "nvfp4_online_tensor"}


def _laid_out(spec, name: str) -> bool:
    """Does checkpoint tensor `name` ("experts.3.gate_proj.weight_scale") load into a parameter the format manages?"""
    _, _, proj, suffix = name.split(".", 3)
    return spec.kind.format.load_rule(f"{'w2' if proj == 'down_proj' else 'w13'}_{suffix}") is not None


def _batched(model) -> bool:
    return batched_writes.batches(model.experts) and model.spec.fmt not in CONVERTED_BY_SGLANG


def _run_both(spec, buckets, flattened=False, patch=None, disk=False):
    """The same requests on a batched and a per-tensor model; returns (batched model, per-tensor model, SGLang
    loader writes of the batched model, tensors batched)."""
    batched, per_tensor = _model(spec), _model(spec)
    assert differences(batched, per_tensor) == []
    for m in (batched, per_tensor):
        if patch is not None:
            patch(m)
    before = batched_writes.counts().get("tensors", 0)
    with sglang_writes(batched) as calls:
        _update(batched, buckets, flattened, disk)
    taken = batched_writes.counts().get("tensors", 0) - before
    with batched_writes.disabled():
        _update(per_tensor, buckets, flattened, disk)
    return batched, per_tensor, calls[0], taken


#: (kind, scenario): gpt-oss checkpoints hold every expert of a parameter in one tensor, so only whole buckets
CASES = [
    (kind, scenario)
    for kind in sorted(SPECS)
    for scenario in (("full",) if SPECS[kind].kind.format.fused else ("full", "partial", "split", "twice"))
]


@pytest.mark.parametrize("kind, scenario", CASES, ids=[f"{k}-{s}" for k, s in CASES])
def test_batched_writes_give_the_bytes_of_sglangs_per_tensor_loader(kind, scenario):
    spec = SPECS[kind]
    buckets = _requests(spec, scenario)
    batched, per_tensor, sglang_calls, taken = _run_both(spec, buckets)
    assert differences(batched, per_tensor) == []
    n = sum(len(b) for b in buckets)
    st = layer_state.state_of(batched.experts)
    if kind in SGLANG_PREPARES:
        assert st is None and layer_state.observed(batched.experts) is spec.kind.format, "not SGLang's layer"
    if _batched(batched):
        # every expert tensor written batched; SGLang's loader wrote none of them
        assert (taken, sglang_calls) == (n, 0), (taken, sglang_calls)
        assert st is None or st.clean, "the entry point's flush laid the written experts out"
    else:
        # gpt-oss (all experts in one tensor), a format the plugin does not prepare on this release, or one whose
        # writes SGLang converts: SGLang's loader
        assert taken == 0 and (sglang_calls > 0 or spec.kind.format.fused)  # gpt-oss: SGLang's all-experts copy


#: the disk path's cases: every kind whose checkpoint is per expert (gpt-oss: one tensor of all experts), full and split
DISK_CASES = [(kind, s) for kind in sorted(SPECS) if not SPECS[kind].kind.format.fused for s in ("full", "split")]


@pytest.mark.parametrize("kind, scenario", DISK_CASES, ids=[f"{k}-{s}" for k, s in DISK_CASES])
def test_a_disk_update_is_written_batched_with_the_bytes_of_sglangs_loader(kind, scenario):
    """update_weights_from_disk: the expert tensors SGLang's iterator yields, each validated from the files by the
    pre-check, are written batched (batched_writes.stream); bytes and layout state equal SGLang's per-tensor path."""
    spec = SPECS[kind]
    buckets = _requests(spec, scenario)
    if spec.kind.format.pairs_sources and scenario == "split":
        # a checkpoint holds both halves of a gated expert whose w1 and w3 SGLang converts together (nvfp4_online: a
        # checkpoint with one half is refused, checkpoint_checks._unpaired_halves): gate and up in one directory
        buckets = [buckets[0] + buckets[1], buckets[2]]
    batched, per_tensor, sglang_calls, taken = _run_both(spec, buckets, disk=True)
    assert differences(batched, per_tensor) == []
    if _batched(batched):
        # every tensor of a parameter the format lays out is batched; one it does not (compressed-tensors'
        # weight_shape: metadata the kernel never reads) may be SGLang's loader's
        n = sum(len(b) for b in buckets)
        managed = sum(_laid_out(spec, name) for b in buckets for name, _ in b)
        assert taken >= managed and taken + sglang_calls == n, (taken, sglang_calls, managed, n)
    else:
        assert taken == 0 and sglang_calls > 0


def test_a_flattened_bucket_is_written_batched():
    spec = SPECS["nvfp4-I96-padded"]
    buckets = _requests(spec, "split")
    batched, per_tensor, sglang_calls, taken = _run_both(spec, buckets, flattened=True)
    assert differences(batched, per_tensor) == []
    assert (taken, sglang_calls) == (sum(len(b) for b in buckets), 0)


def _ep_rank_1_of_2(model):
    """SGLang's own mapping answers as on EP rank 1 of 2: experts 2, 3 are the local slots 0, 1; 0, 1 are not local."""
    layer = model.experts
    layer.__dict__["_map_global_expert_id_to_local_expert_id"] = lambda e: e - 2 if e >= 2 else -1


def test_experts_of_another_ep_rank_are_dropped_and_the_others_land_in_their_slots():
    spec = SPECS["nvfp4"]
    buckets = _requests(spec, "full")
    before = batched_writes.counts().get("dropped", 0)
    batched, per_tensor, sglang_calls, taken = _run_both(spec, buckets, patch=_ep_rank_1_of_2)
    assert differences(batched, per_tensor) == []
    n = sum(len(b) for b in buckets)
    # the input scales are kept per global expert (every id lands); of the rest, experts 0 and 1 are not local
    dropped = batched_writes.counts().get("dropped", 0) - before
    assert sglang_calls == 0 and taken + dropped == n and 0 < dropped < n // 2, (taken, dropped)
    fresh = _model(spec)
    assert differences(batched, fresh), "the update changed nothing"


def test_a_broken_batched_write_is_caught(monkeypatch):
    """The comparison sees a wrong batched write: expert ids shifted by one slot (where the request's name index
    asks SGLang's loader for an expert's slots)."""
    from sglang_trtllm_moe.updates import name_index

    spec = SPECS["nvfp4"]
    real = name_index.local_slots

    def shifted(layer, param, weight_name, shard_id, expert_id, tensor):
        return tuple(
            (s + 1) % int(param.shape[0]) for s in real(layer, param, weight_name, shard_id, expert_id, tensor)
        )

    monkeypatch.setattr(name_index, "local_slots", shifted)
    batched, per_tensor, _, taken = _run_both(spec, _requests(spec, "partial"))
    assert taken and differences(batched, per_tensor)


def test_batched_writes_race_a_flusher_and_a_per_tensor_writer():
    """A batched request (experts 0-1) while another thread writes experts 2-3 shard by shard through SGLang's loader
    (no entry point) and a third keeps flushing the layer: the layer lock makes each step whole."""
    spec = cpu_layers.MoeSpec(num_experts=4, hidden=256, intermediate=96, fmt="nvfp4")
    new = _tensors(spec, seed=1)
    mine = [(n, t) for n, t in new.items() if _experts_of(n) < 2]
    theirs = [(n, t) for n, t in new.items() if _experts_of(n) >= 2]
    for _ in range(3):
        model = _model(spec)
        done = threading.Event()
        errors: list[BaseException] = []
        barrier = threading.Barrier(3)

        def per_tensor_writer(model=model, barrier=barrier, errors=errors):
            try:
                barrier.wait()
                for item in theirs:
                    model.load_weights([item])
            except BaseException as e:  # noqa: BLE001 - reported below
                errors.append(e)

        def flusher(model=model, barrier=barrier, done=done, errors=errors):
            try:
                barrier.wait()
                while not done.is_set():
                    layer_state.flush(model.experts)
                    layouts.clear_caches()
            except BaseException as e:  # noqa: BLE001
                errors.append(e)

        threads = [threading.Thread(target=per_tensor_writer), threading.Thread(target=flusher)]
        for t in threads:
            t.start()
        barrier.wait()
        _update(model, [mine])
        threads[0].join()
        done.set()
        threads[1].join()
        assert not errors, errors
        layer_state.flush(model.experts)
        fresh = sglang_runtime.prepared_model(spec, spec.kind.checkpoint(spec, seed=1))
        assert differences(model, fresh) == []


def test_a_late_call_through_a_finished_requests_loader_records_nothing():
    """Another thread that looked `model.load_weights` up while a request ran (the request's wrapper) and calls it
    after the request ended: the request's closed record of validated writes is not activated again (it was, and
    stayed active for every later write of the process: tests/test_update_cost.py then failed at random after the
    race test above); the late write is checked in the loader hooks and lands exactly."""
    from sglang_trtllm_moe.updates import checked_writes

    spec = cpu_layers.MoeSpec(num_experts=4, hidden=256, intermediate=96, fmt="nvfp4")
    model = _model(spec)
    new = _tensors(spec, seed=1)
    mine = [(n, t) for n, t in new.items() if _experts_of(n) < 2]
    late = [(n, t) for n, t in new.items() if _experts_of(n) >= 2]
    grabbed = []
    real = type(model).load_weights

    def spy(self, weights, *a, **k):  # the other thread's lookup, made while the request's wrapper is installed
        if "load_weights" in vars(model):
            grabbed.append(vars(model)["load_weights"])
        return real(self, weights, *a, **k)

    type(model).load_weights = spy
    try:
        _update(model, [mine])
    finally:
        type(model).load_weights = real
    assert grabbed and not checked_writes._ACTIVE
    grabbed[0](late)  # after the request closed its record
    assert not checked_writes._ACTIVE, [len(r.tensors) for r in checked_writes._ACTIVE]
    layer_state.flush(model.experts)
    fresh = sglang_runtime.prepared_model(spec, spec.kind.checkpoint(spec, seed=1))
    assert differences(model, fresh) == []


def _tp_rank(rank: int, full: int):
    """The layer as TP rank `rank` of 2 sees itself (SGLang's loader narrows by moe_tp_rank / moe_tp_size; the
    plugin's checks take the checkpoint's whole intermediate `full`)."""

    def patch(model):
        layer = model.experts
        layer.moe_tp_size, layer.moe_tp_rank = 2, rank
        layer_attrs.record(layer, layer_attrs.INTERMEDIATE, full)

    return patch


@pytest.mark.parametrize("rank", [0, 1])
@pytest.mark.parametrize("fmt", ["nvfp4", "fp8_tensor", "bf16"])
def test_tp_ranks_take_sglangs_narrowed_and_zero_filled_shards(fmt, rank):
    """Each rank of TP 2 keeps its shard of a checkpoint of intermediate 192 (96 per rank, padded to 128 per half):
    SGLang's loader narrows w13 rows / w2 columns at the padded shard's offset and zero-fills what is left."""
    spec = cpu_layers.MoeSpec(num_experts=4, hidden=256, intermediate=96, fmt=fmt)  # one rank's layer
    whole = cpu_layers.MoeSpec(num_experts=4, hidden=256, intermediate=192, fmt=fmt)
    buckets = [list(_tensors(whole, seed=1).items())]
    batched, per_tensor, sglang_calls, taken = _run_both(spec, buckets, patch=_tp_rank(rank, 192))
    assert differences(batched, per_tensor) == []
    assert (taken, sglang_calls) == (len(buckets[0]), 0)
    assert differences(batched, _model(spec)), "the update changed nothing"
