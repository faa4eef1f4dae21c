"""RL weight updates through SGLang's own update paths, on a real NVFP4 FusedMoE prepared by the plugin.

Every check compares with a fresh load of the intended checkpoint, byte for byte."""

from __future__ import annotations

import tempfile

import pytest
import torch

from sglang_trtllm_moe import layer_state
from sglang_trtllm_moe.formats.nvfp4 import NvFp4
from sglang_trtllm_moe.sandbox import layers as cpu_layers

from .support import sglang_runtime

SPEC = cpu_layers.MoeSpec(intermediate=96)  # gated, padded 96 -> 128 per half
PREPARED = ("w13_weight", "w13_weight_scale", "w2_weight", "w2_weight_scale")
SCALARS = ("g1_alphas", "g1_alphas_up", "g2_alphas", "w13_input_scale_quant", "w2_input_scale_quant", "g1_scale_c")


@pytest.fixture(scope="module", autouse=True)
def runtime():
    sglang_runtime.ensure("flashinfer_trtllm")


def ckpt(seed):
    return cpu_layers.random_nvfp4_checkpoint(SPEC, seed=seed)


def prepared_model(tensors):
    return sglang_runtime.prepared_model(SPEC, tensors)


def mix(base, new, experts=None, projections=None):
    out = dict(base)
    for k, v in new.items():
        e = int(k.split(".")[1])
        proj = k.split(".")[2]
        if (experts is None or e in experts) and (projections is None or proj in projections):
            out[k] = v
    return out


def assert_same_as_fresh(model, intended):
    fresh = prepared_model(intended)
    for n in PREPARED:
        a, b = getattr(model.experts, n).data, getattr(fresh.experts, n).data
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), f"{n} differs from a fresh load"
    for n in SCALARS:
        assert torch.equal(getattr(model.experts, n).data, getattr(fresh.experts, n).data), n


def pointers(model):
    return {n: p.data_ptr() for n, p in model.named_parameters()}


updater = sglang_runtime.updater


def from_disk(model, tensors):
    d = tempfile.mkdtemp(prefix="trtllm-moe-ckpt-")
    sglang_runtime.write_safetensors_checkpoint(d, tensors, SPEC)
    ok, msg = updater(model, d).update_weights_from_disk(d, "auto")
    assert ok, msg


def from_tensor(model, tensors):
    named = list(cpu_layers.checkpoint_names(tensors).items())
    ok, msg = updater(model).update_weights_from_tensor(named)
    assert ok, msg


def test_full_update_from_disk_through_sglang_weight_updater():
    model = prepared_model(ckpt(0))
    ptrs = pointers(model)
    from_disk(model, ckpt(1))
    assert_same_as_fresh(model, ckpt(1))
    assert pointers(model) == ptrs


def test_update_from_tensor_is_prepared_at_the_end_of_the_entry_point():
    model = prepared_model(ckpt(0))
    ptrs = pointers(model)
    from_tensor(model, ckpt(2))
    assert layer_state.state_of(model.experts).clean  # no forward needed: the entry point flushed
    assert_same_as_fresh(model, ckpt(2))
    assert pointers(model) == ptrs


def test_partial_update_of_one_expert_prepares_only_that_expert():
    model = prepared_model(ckpt(0))
    st = layer_state.state_of(model.experts)
    before = st.experts_prepared_total
    one = {k: v for k, v in ckpt(3).items() if k.startswith("experts.5.")}
    from_disk(model, one)
    assert st.experts_prepared_total - before == 2  # expert 5's w13 group and w2 group, nothing else
    assert_same_as_fresh(model, mix(ckpt(0), ckpt(3), experts={5}))


def test_w2_only_update_leaves_w13_untouched():
    model = prepared_model(ckpt(0))
    st = layer_state.state_of(model.experts)
    w13_before = model.experts.w13_weight.data.clone()
    before = st.experts_prepared_total
    down = {k: v for k, v in ckpt(4).items() if ".down_proj." in k}
    from_tensor(model, down)
    assert st.experts_prepared_total - before == SPEC.num_experts  # w2 group of every expert, no w13
    assert torch.equal(model.experts.w13_weight.data, w13_before)
    assert_same_as_fresh(model, mix(ckpt(0), ckpt(4), projections={"down_proj"}))


def test_five_updates_in_a_row_stay_exact_and_storage_stable():
    model = prepared_model(ckpt(0))
    ptrs = pointers(model)
    intended = ckpt(0)
    steps = [
        (from_tensor, ckpt(10), None),
        (from_disk, ckpt(11), {2}),
        (from_tensor, ckpt(12), {0, 7}),
        (from_disk, ckpt(13), None),
        (from_tensor, ckpt(14), {3}),
    ]
    for update, new, experts in steps:
        payload = new if experts is None else {k: v for k, v in new.items() if int(k.split(".")[1]) in experts}
        update(model, payload)
        intended = mix(intended, new, experts=experts)
        assert pointers(model) == ptrs
    assert_same_as_fresh(model, intended)


@pytest.mark.parametrize("bad", ["shape", "dtype", "expert", "shard"])
def test_refused_bad_update_leaves_every_byte(bad):
    model = prepared_model(ckpt(0))
    snapshot = {n: p.detach().clone() for n, p in model.named_parameters()}
    layer = model.experts
    good = ckpt(5)["experts.1.gate_proj.weight"]
    param = layer.w13_weight
    kwargs = dict(weight_name="w13_weight", shard_id="w1", expert_id=1)
    loaded = good
    if bad == "shape":
        loaded = good[:, :-8]
    elif bad == "dtype":
        loaded = good.float()
    elif bad == "expert":
        kwargs["expert_id"] = 99
    elif bad == "shard":
        kwargs["shard_id"] = "w2"
    with pytest.raises(ValueError) as e:
        layer.weight_loader(param, loaded, **kwargs)
    assert "model.layers.0.mlp.experts" in str(e.value) or bad == "expert"
    for n, p in model.named_parameters():
        assert torch.equal(p.data.reshape(-1).view(torch.uint8), snapshot[n].reshape(-1).view(torch.uint8)), (
            f"{n} changed"
        )
    assert layer_state.state_of(layer).clean


def test_failure_while_preparing_is_raised_naming_the_layer_and_retried(monkeypatch):
    model = prepared_model(ckpt(0))
    st = layer_state.state_of(model.experts)
    real = NvFp4.prepare_
    calls = {"n": 0}

    def flaky(self, layer, group, experts):
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("injected failure")
        return real(self, layer, group, experts)

    monkeypatch.setattr(NvFp4, "prepare_", flaky)
    with pytest.raises(layer_state.WeightPrepError) as e:
        from_tensor(model, ckpt(6))
    assert "model.layers.0.mlp.experts" in str(e.value) and "injected failure" in str(e.value)
    assert not st.clean and st.dirty_experts(), "the failure must leave the unfinished experts marked dirty"
    monkeypatch.setattr(NvFp4, "prepare_", real)
    layer_state.flush_all()  # the next flush point retries exactly what is left
    assert st.clean
    assert_same_as_fresh(model, ckpt(6))


def test_begin_end_session_with_direct_writes_into_parameters():
    # 0.5.21+: begin_weight_update promises checkpoint layout, so a refit may write whole parameters directly
    # (load_format="direct" -> default_weight_loader, no FusedMoE loader). The plugin un-prepares every managed
    # layer at begin and prepares at end.
    staged = cpu_layers.TinyMoeModel(SPEC)
    staged.load_weights(cpu_layers.checkpoint_names(ckpt(7)).items())  # checkpoint layout, not prepared
    direct = [(n, p.detach().clone()) for n, p in staged.named_parameters()]
    model = prepared_model(ckpt(0))
    ptrs = pointers(model)
    u = updater(model)
    u.begin_weight_update()
    assert layer_state.state_of(model.experts).dirty_experts(), "begin must return the layer to checkpoint layout"
    # two writes in one session: nothing may be prepared between them, or the second lands on kernel layout
    for part in (direct[: len(direct) // 2], direct[len(direct) // 2 :]):
        ok, msg = u.update_weights_from_tensor(part, load_format="direct")
        assert ok, msg
        assert not layer_state.state_of(model.experts).clean, "prepared inside an open begin/end session"
    u.end_weight_update(run_post_load=False)
    assert layer_state.state_of(model.experts).clean
    assert_same_as_fresh(model, ckpt(7))
    assert pointers(model) == ptrs
