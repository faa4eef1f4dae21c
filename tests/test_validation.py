"""Every bad weight update is refused before a byte changes (issue #22), through SGLang's own loader and update
entry points, on every format the plugin prepares.

* the catalogue (tests/support/bad_updates.py): for every managed parameter of every format — weights, block
  scales, per-tensor / global scales, input scales — wrong shard ids, expert ids of every wrong type and range,
  meta tensors, non-tensors, a weight_name naming another parameter, wrong dtypes, wrong shapes (short, long,
  transposed, 1-D, 3-D, ...) and non-finite / non-positive scales: each raises WeightUpdateRefused naming the
  layer and the parameter, and leaves every byte and the per-expert layout state as they were;
* hypothesis: random sequences of those refused updates, then a correct update (with the valid edge cases:
  non-contiguous views, 0-dim tensor and numpy expert ids, [1]-shaped and 0-dim scalars, wider float dtypes):
  the layer equals a fresh load of the intended checkpoint, byte for byte;
* the entry points: a bucket with one bad tensor is refused whole (update_weights_from_tensor, flattened buckets,
  load_weights_from_distributed, load_format="direct"), with SGLang's (False, message) and no byte written.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sglang_trtllm_moe import layer_state
from sglang_trtllm_moe.errors import WeightUpdateRefused
from sglang_trtllm_moe.sandbox import layers as cpu_layers
from sglang_trtllm_moe.updates import layer_params

from .support import bad_updates as B
from .support import sglang_runtime

LAYER = "model.layers.0.mlp.experts"
PREFIX = cpu_layers.TinyMoeModel.prefix


@pytest.fixture(scope="module", autouse=True)
def runtime():
    sglang_runtime.ensure("flashinfer_trtllm")
    # many tiny tensor ops: intra-op threads only contend on a shared 2-core box (measured 40x slower)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


_LAYERS: dict = {}


def layer_for(config: str):
    """A prepared layer per config, shared by the tests of this module; `state` = checkpoint seed per expert."""
    if config not in _LAYERS:
        spec, _, layer = B.build(config)
        _LAYERS[config] = {
            "spec": spec,
            "layer": layer,
            "state": [0] * spec.num_experts,
            "catalogue": B.catalogue(layer, spec),
        }
    return _LAYERS[config]


def assert_refused_unchanged(layer, w: B.Write, snap=None):
    snap = B.snapshot(layer) if snap is None else snap
    with pytest.raises(WeightUpdateRefused) as e:
        w.call(layer)
    msg = str(e.value)
    assert LAYER in msg and w.param in msg and "expected" in msg and "nothing was written" in msg, msg
    assert B.changed(layer, snap) == [], f"bytes or layout state changed by a refused update: {msg}"
    return msg


# ---- the catalogue: every case, every format --------------------------------------------------------------------

FP8 = pytest.mark.sglang("capability:fp8-prep", reason="the plugin prepares FP8 layers from 0.5.19")


def configs(*names):
    names = names or sorted(B.CONFIGS)
    return [pytest.param(c, marks=[FP8] if c.startswith("fp8") else [], id=c) for c in names]


@pytest.mark.parametrize("config", configs())
def test_every_invalid_update_is_refused_naming_the_layer_and_changes_nothing(config):
    L = layer_for(config)
    layer, spec = L["layer"], L["spec"]
    snap = B.snapshot(layer)
    params = set()
    for _case, w in L["catalogue"]:
        assert_refused_unchanged(layer, w, snap)
        params.add(w.param)
    # every parameter the format loads, of every kind, is covered
    fmt = layer_params.format_of(layer)
    loaded = {w.param for w in B.writes(spec, B.checkpoint(spec, experts=[0])) if B.managed(spec, w.param)}
    assert params == loaded and all(fmt.load_rule(p) is not None for p in loaded)
    assert {w.kind for _, w in L["catalogue"]} == {fmt.load_rule(p).kind for p in loaded}


def _write(config, param, **changes):
    spec = B.CONFIGS[config]
    w = next(w for w in B.writes(spec, B.checkpoint(spec, seed=1, experts=[1])) if w.param == param)
    w.__dict__.update(changes)
    return w


@pytest.mark.parametrize(
    "config,param,shard",
    [
        ("nvfp4", "w13_weight_scale_2", "w2"),  # would broadcast over the gate and up scales
        ("nvfp4", "w2_weight_scale_2", "w1"),  # would end in a raw IndexError
        pytest.param("fp8_modelopt", "w13_weight_scale", "w2", marks=FP8),
        pytest.param("fp8_tensor", "w13_weight_scale", "w2", marks=FP8),
        pytest.param("fp8_tensor", "w2_weight_scale", "w3", marks=FP8),
        ("nvfp4", "w13_input_scale", "w2"),
        ("ct_nvfp4", "w13_weight_global_scale", "w2"),
    ],
)
def test_issue_22_per_tensor_scales_check_the_shard_id(config, param, shard):
    layer = layer_for(config)["layer"]
    msg = assert_refused_unchanged(layer, _write(config, param, shard_id=shard))
    assert f"does not take shard '{shard}'" in msg


@pytest.mark.parametrize(
    "expert_id",
    ["1", None, 2.5, 1.0, True, torch.tensor(1.0), torch.tensor([1])],
    ids=["str", "None", "float-2.5", "float-1.0", "bool", "float-tensor", "1-elem-tensor"],
)
@pytest.mark.parametrize(
    "config,param",
    [
        ("nvfp4", "w13_weight"),
        ("nvfp4", "w2_input_scale"),
        pytest.param("fp8_tensor", "w13_weight", marks=FP8),
        pytest.param("fp8_tensor", "w13_weight_scale", marks=FP8),
    ],
)
def test_issue_22_expert_ids_are_type_checked(config, param, expert_id):
    layer = layer_for(config)["layer"]
    msg = assert_refused_unchanged(layer, _write(config, param, expert_id=expert_id))
    assert "is not an integer expert index" in msg


@pytest.mark.parametrize(
    "config,param",
    [
        ("nvfp4", "w13_weight"),
        ("nvfp4", "w13_weight_scale_2"),
        pytest.param("fp8_modelopt", "w2_weight", marks=FP8),
        ("bf16", "w13_weight"),
    ],
)
def test_issue_22_the_device_is_checked(config, param):
    layer = layer_for(config)["layer"]
    w = _write(config, param)
    w.tensor = w.tensor.to("meta")
    assert "the tensor is on meta" in assert_refused_unchanged(layer, w)


def test_short_tensor_into_an_unpadded_layer_is_refused_and_the_padded_layer_takes_both_sizes():
    # unpadded (I = 128): one row of 128 would be zero-filled by SGLang
    layer = layer_for("bf16")["layer"]
    w = _write("bf16", "w13_weight")
    w.tensor = w.tensor[:1]
    assert "SGLang would zero-fill the rest" in assert_refused_unchanged(layer, w)
    # padded (I = 96 -> 128): the checkpoint's 96 rows and the layer's 128 are both valid; 64 is not
    layer = layer_for("bf16-I96-padded")["layer"]
    w = _write("bf16-I96-padded", "w13_weight")
    w.tensor = w.tensor[:64]
    assert "expected [96 (the checkpoint's) or 128 (the layer's padded size), 128]" in assert_refused_unchanged(
        layer, w
    )


# ---- hypothesis: refused sequences, then a correct update equals a fresh load ------------------------------------

_FRESH: dict = {}


def _fp8_prepared() -> bool:
    from sglang_trtllm_moe.sandbox.runtime import release

    from .support import matrix

    return "fp8-prep" in matrix.plugin_capabilities(release())


def intended_tensors(config, state):
    spec = B.CONFIGS[config]
    out = B.checkpoint(spec, seed=0)
    for e, seed in enumerate(state):
        if seed:
            out.update(B.checkpoint(spec, seed=seed, experts=[e]))
    return out


def fresh_bytes(config, state):
    key = (config, tuple(state))
    if key not in _FRESH:
        spec = B.CONFIGS[config]
        layer = cpu_layers.build_layer(spec)
        B.load(layer, B.writes(spec, intended_tensors(config, state)))
        layer.quant_method.process_weights_after_loading(layer)
        _FRESH[key] = B.snapshot(layer, only=B.compared(layer))
    return _FRESH[key]


def valid_variant(w: B.Write, data, scalar: bool, managed: bool) -> B.Write:
    """The same write in a form that must keep working: non-contiguous view, 0-dim tensor / numpy expert id,
    [1]-shaped or 0-dim scalar, a wider float dtype where the storage is float, the bare parameter name as
    weight_name where the plugin prepares the layer."""
    t = w.tensor
    if t.dim() == 2 and t.shape[0] > 1 and data.draw(st.booleans(), label="non-contiguous"):
        t = t.t().contiguous().t()
        assert not t.is_contiguous()
    if scalar:
        t = t.reshape(data.draw(st.sampled_from([(), (1,)]), label="scalar shape"))
    if t.dtype in (torch.bfloat16, torch.float32) and data.draw(st.booleans(), label="wider float"):
        t = t.to(torch.float64 if t.dtype == torch.float32 else torch.float32)  # exact: values are representable
    eid = data.draw(st.sampled_from(["int", "int64-tensor", "int32-tensor", "numpy"]), label="expert id type")
    expert = {
        "int": w.expert_id,
        "int64-tensor": torch.tensor(w.expert_id),
        "numpy": np.int64(w.expert_id),
        "int32-tensor": torch.tensor(w.expert_id, dtype=torch.int32),
    }[eid]
    # the bare parameter name works where the plugin prepares the layer; SGLang's own BF16 restore (a watched
    # layer) needs the ".experts.<param>" suffix its model loaders always pass
    name = w.param if managed and data.draw(st.booleans(), label="bare name") else w.weight_name
    return B.Write(w.param, t, name, w.shard_id, expert)


@settings(
    max_examples=60,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(data=st.data(), config=st.sampled_from(sorted(B.CONFIGS)))
def test_property_refused_updates_change_nothing_and_a_correct_one_equals_a_fresh_load(data, config):
    if config.startswith("fp8") and not _fp8_prepared():
        return  # the plugin prepares FP8 layers from 0.5.19 (the catalogue tests say so per config)
    try:
        _refused_then_correct(data, config)
    except BaseException:
        _LAYERS.pop(config, None)  # a failed example may leave the shared layer half-updated: start afresh
        raise


def _refused_then_correct(data, config):
    L = layer_for(config)
    layer, spec = L["layer"], L["spec"]
    fmt = layer_params.format_of(layer)
    managed = layer_state.state_of(layer) is not None
    snap = B.snapshot(layer)
    n_bad = data.draw(st.integers(0, 4), label="refused updates")
    for _ in range(n_bad):
        _case, w = data.draw(st.sampled_from(L["catalogue"]), label="bad update")
        assert_refused_unchanged(layer, w, snap)
    e = data.draw(st.integers(0, spec.num_experts - 1), label="expert")
    seed = data.draw(st.sampled_from([s for s in (0, 1, 2) if s != L["state"][e]]), label="seed")
    for w in B.writes(
        spec,
        B.checkpoint(spec, seed=seed, experts=[e])
        if seed
        else {k: v for k, v in B.checkpoint(spec, seed=0).items() if k.startswith(f"experts.{e}.")},
    ):
        rule = fmt.load_rule(w.param)
        if rule is None:  # a parameter the format does not load (compressed-tensors' weight_shape): SGLang's write
            w.call(layer)
            continue
        valid_variant(w, data, rule.scalar, managed).call(layer)
    layer.quant_method.process_weights_after_loading(layer)  # a flush, or SGLang's own prep of a watched layer
    L["state"][e] = seed
    want = fresh_bytes(config, L["state"])
    diff = B.changed(layer, want)
    assert diff == [], f"differs from a fresh load of the intended checkpoint: {diff}"


# ---- EP: an expert this rank does not own -------------------------------------------------------------------------


def test_expert_of_another_ep_rank_is_dropped_when_valid_and_refused_when_not(monkeypatch):
    """SGLang's documented EP behaviour: a rank drops the shards of experts it does not own (the owning rank writes
    them). Validation runs before that mapping, so a bad tensor is refused on every rank alike. Simulated here by
    SGLang's own mapping answering -1 (not local) for experts >= 2."""
    L = layer_for("nvfp4")
    layer = L["layer"]
    real = layer._map_global_expert_id_to_local_expert_id
    monkeypatch.setattr(
        layer, "_map_global_expert_id_to_local_expert_id", lambda e: real(e) if e < 2 else -1, raising=False
    )
    snap = B.snapshot(layer)
    w = _write("nvfp4", "w13_weight", expert_id=3)
    w.call(layer)  # valid, not owned: dropped here
    assert B.changed(layer, snap) == []
    w.tensor = w.tensor.float()
    assert_refused_unchanged(layer, w, snap)


# ---- entry points: whole buckets ----------------------------------------------------------------------------------


def _model(config):
    spec = B.CONFIGS[config]
    return sglang_runtime.prepared_model(spec, B.checkpoint(spec, seed=0))


def _bucket(config, seed=1):
    spec = B.CONFIGS[config]
    return list(cpu_layers.checkpoint_names(B.checkpoint(spec, seed=seed)).items())


def _same_as_fresh(model, config, seed):
    spec = B.CONFIGS[config]
    fresh = sglang_runtime.prepared_model(spec, B.checkpoint(spec, seed=seed))
    return B.changed(model.experts, B.snapshot(fresh.experts, only=B.compared(fresh.experts))) == []


BAD_BUCKET_ENTRIES = {
    "wrong dtype": lambda name, t: (name, t.float()),
    "wrong shape": lambda name, t: (name, t[:1]),
    "expert beyond the model": lambda name, t: (name.replace("experts.3.", "experts.99."), t),
    "unknown parameter": lambda name, t: (name.rsplit(".", 1)[0] + ".weight_zero_point", t),
    "parameter name into load_weights": lambda name, t: (f"{PREFIX}experts.w13_weight", t),
    "meta tensor": lambda name, t: (name, t.to("meta")),
}


@pytest.mark.parametrize("bad", sorted(BAD_BUCKET_ENTRIES))
@pytest.mark.parametrize("config", configs("nvfp4", "fp8_tensor"))
def test_bucket_with_one_bad_tensor_is_refused_whole_before_any_write(config, bad):
    model = _model(config)
    u = sglang_runtime.updater(model)
    bucket = _bucket(config)
    i = next(i for i, (n, _) in enumerate(bucket) if ".experts.3.gate_proj.weight" in n)
    assert i >= 4, "the bad tensor must come after tensors SGLang would already have written"
    bucket[i] = BAD_BUCKET_ENTRIES[bad](*bucket[i])
    snap = B.snapshot(model.experts)
    ok, msg = u.update_weights_from_tensor(bucket)
    assert not ok and "refused the whole weight-update bucket" in msg and "nothing of it was written" in msg
    assert "nothing was written" not in msg, msg  # said once, for the whole bucket
    assert B.changed(model.experts, snap) == []
    ok, msg = u.update_weights_from_tensor(_bucket(config))  # the corrected bucket loads exactly
    assert ok, msg
    assert _same_as_fresh(model, config, 1)


@pytest.mark.sglang(">=0.5.21", reason="WeightUpdater.load_weights_from_distributed exists upstream from 0.5.21")
def test_distributed_and_flattened_buckets_are_refused_whole():
    from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket

    model = _model("nvfp4")
    u = sglang_runtime.updater(model)
    bucket = _bucket("nvfp4")
    i = next(i for i, (n, _) in enumerate(bucket) if ".experts.3.gate_proj.weight" in n)
    bucket[i] = (bucket[i][0], bucket[i][1].float())
    snap = B.snapshot(model.experts)
    ok, msg = u.load_weights_from_distributed(bucket)
    assert not ok and "refused the whole weight-update bucket" in msg and "partially updated" not in msg
    assert B.changed(model.experts, snap) == []
    flat = FlattenedTensorBucket(named_tensors=bucket)
    ok, msg = u.update_weights_from_tensor(
        {"flattened_tensor": flat.get_flattened_tensor(), "metadata": flat.get_metadata()},
        load_format="flattened_bucket",
    )
    assert not ok and "refused the whole weight-update bucket" in msg
    assert B.changed(model.experts, snap) == []


def test_direct_whole_parameter_writes_are_validated_and_exact_outside_a_session():
    spec = B.CONFIGS["nvfp4"]
    staged = cpu_layers.TinyMoeModel(spec)
    staged.load_weights(_bucket("nvfp4", seed=2))  # checkpoint layout, not prepared
    direct = [(n, p.detach().clone()) for n, p in staged.named_parameters()]
    model = _model("nvfp4")
    u = sglang_runtime.updater(model)
    snap = B.snapshot(model.experts)
    for n, t in direct:
        if n.endswith("w13_weight_scale_2"):
            bad = [(m, s) for m, s in direct]
            bad[[m for m, _ in direct].index(n)] = (n, torch.zeros_like(t))
    ok, msg = u.update_weights_from_tensor(bad, load_format="direct")
    assert not ok and "w13_weight_scale_2" in msg and "finite and > 0" in msg
    assert B.changed(model.experts, snap) == []
    ok, msg = u.update_weights_from_tensor(direct, load_format="direct")
    assert ok, msg
    assert layer_state.state_of(model.experts).clean
    assert _same_as_fresh(model, "nvfp4", 2)


def test_a_model_without_load_weights_is_updated_by_sglang_alone(tmp_path):
    """SGLang's direct writes need no `model.load_weights` (SGLang's own unit test
    `test_weight_updater_post_load_weights.py` drives such a model): with nothing of the plugin's in the model, the
    request check hands the call to SGLang unchanged (it read `model.load_weights` and raised AttributeError)."""

    class Plain(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.zeros(4), requires_grad=False)

    sglang_runtime.write_safetensors_checkpoint(str(tmp_path), {}, B.CONFIGS["nvfp4"])  # ModelConfig's config.json
    model = Plain()
    u = sglang_runtime.updater(model, str(tmp_path))
    ok, msg = u.update_weights_from_tensor([("w", torch.ones(4))], load_format="direct")
    assert ok, msg
    assert torch.equal(model.w, torch.ones(4))
