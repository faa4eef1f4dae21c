"""Weight-checker comparators on real SGLang NVFP4 layers, through SGLang's own WeightChecker where it applies.

Oracles nobody here wrote: flashinfer's CPU NVFP4 dequantizer (`_e2m1_and_ufp8sf_scale_to_float_cpu`) on the
checkpoint layout SGLang's loader produced; SGLang's own trtllm preparation (where each checkpoint byte lands in
the kernel layout); SGLang's loader (where a checkpoint tensor's byte lands in the parameter); SGLang's
WeightChecker / WeightUpdater for the snapshot -> reset -> update -> compare flow.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sglang_trtllm_moe import checker, layer_state, plugin
from sglang_trtllm_moe.sandbox import layers as cpu_layers

from .support import sglang_runtime
from .test_rl_updates import from_tensor

SPEC = cpu_layers.MoeSpec(num_experts=4, hidden=256, intermediate=128)
PADDED = cpu_layers.MoeSpec(num_experts=4, hidden=256, intermediate=96)  # 96 -> 128 per half
PARAMS = ("w13_weight", "w13_weight_scale", "w2_weight", "w2_weight_scale")
WEIGHTS = ("w13_weight", "w2_weight")


@pytest.fixture(scope="module", autouse=True)
def runtime():
    sglang_runtime.ensure("flashinfer_trtllm")


@pytest.fixture(autouse=True)
def plugin_prepares(monkeypatch):
    """The plugin's own preparation of formats SGLang prepares correctly on some releases (compat/defer.py) stays
    tested on every release."""
    sglang_runtime.plugin_prepares(monkeypatch, "bf16", "fp8_block")


def loaded(spec, seed=0, tensors=None):
    """SGLang's loader only: checkpoint layout, not managed by the plugin."""
    model = cpu_layers.TinyMoeModel(spec)
    model.load_weights(cpu_layers.checkpoint_names(tensors or cpu_layers.random_nvfp4_checkpoint(spec, seed)).items())
    return model


def prepared(spec, seed=0, tensors=None):
    model = loaded(spec, seed, tensors)
    model.experts.quant_method.process_weights_after_loading(model.experts)
    return model


def clone_params(layer):
    return {n: getattr(layer, n).data.clone() for n in PARAMS}


def weight_checker(model):
    from .support.sglang_runtime import weight_checker

    return weight_checker(model)


def test_every_checker_hook_landed_on_this_release():
    import sglang.srt.utils.weight_checker  # noqa: F401 - what a server running the checker has imported

    from sglang_trtllm_moe.builtins import checker_hooks, checker_legacy_hooks

    declared = []
    for module in (checker_hooks, checker_legacy_hooks):
        module.register_sglang_hooks(register=declared.append, release=plugin.state().release.version)
    rows = [
        r
        for r in plugin.state().target_report()
        if r["capability"] == "weight-check" and r["state"] != "not_applicable"
    ]
    here = [t for t in declared if t.capability == "weight-check" and t.applies_to(plugin.state().release.version)]
    # the comparator module's hooks (0.5.15+), or SGLang's _compare / _postprocess_tensors / _check_tensors + _snapshot
    assert len(rows) == len(here) >= 4, rows
    assert all(r["state"] == "landed" for r in rows), rows


@pytest.mark.parametrize(
    "spec",
    [PADDED, cpu_layers.MoeSpec(num_experts=4, intermediate=128, activation="relu2", gated=False)],
    ids=["gated-padded", "relu2"],
)
def test_layout_aware_dequant_equals_flashinfer_on_sglang_checkpoint_layout(spec):
    """Undo + dequantize of the prepared bytes == flashinfer's CPU dequantizer on what SGLang's loader wrote."""
    from flashinfer.quantization.fp4_quantization import _e2m1_and_ufp8sf_scale_to_float_cpu as fi_dequant

    model = loaded(spec)
    ckpt = clone_params(model.experts)
    model.experts.quant_method.process_weights_after_loading(model.experts)
    assert layer_state.state_of(model.experts).clean
    for name in WEIGHTS:
        side = checker.live_side(model.experts, name)
        assert not torch.equal(side.tensors[name], ckpt[name])  # really prepared
        got = torch.cat([v for _, v, _ in checker.iter_dequantized(side)])
        for e in range(spec.num_experts):
            want = fi_dequant(ckpt[name][e], ckpt[name + "_scale"][e].view(torch.uint8), None, 16, 1, False)
            assert torch.equal(got[e], want), (name, e)


def test_sglang_prepared_bytes_compare_equal_to_checkpoint_layout_only_layout_aware(monkeypatch):
    """SGLang's own trtllm preparation is the forward; the plugin's inverse must bring it back exactly."""
    ckpt_model = loaded(PADDED, seed=1)
    ckpt = clone_params(ckpt_model.experts)
    sglang_runtime.upstream_process_weights_after_loading(
        ckpt_model.experts.quant_method, ckpt_model.experts, monkeypatch
    )
    sglang_prepared = clone_params(ckpt_model.experts)
    geometry = prepared(PADDED, seed=1).experts  # a managed layer of the same shape
    for name in WEIGHTS:
        ours = checker.live_side(geometry, name)
        theirs = checker.snapshot_side(geometry, name, sglang_prepared)
        ck = checker.snapshot_side(geometry, name, ckpt, checkpoint=True)
        assert checker.compare_raw(theirs, ours).equal  # plugin bytes == SGLang bytes
        assert checker.compare_layout(ck, theirs).equal
        assert checker.compare(ck, ours).mode == "layout" and checker.compare(ck, ours).equal  # auto
        raw = checker.compare_raw(ck, ours)
        assert not raw.equal and raw.num_mismatch > raw.numel // 2


# ---- locating a flipped byte ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def stored_position():
    """For each parameter: checkpoint flat index -> stored flat index, as SGLang's own preparation moves bytes.

    Three base-256 digit tensors of the checkpoint index go through SGLang's trtllm prep (pure byte moves)."""
    model = loaded(SPEC)
    layer = model.experts
    digits = {}
    with pytest.MonkeyPatch.context() as mp:
        for d in range(3):
            for n in PARAMS:
                p = getattr(layer, n).data
                idx = torch.arange(p.numel()).reshape(p.shape)
                p.view(torch.uint8).copy_(((idx >> (8 * d)) & 0xFF).to(torch.uint8))
            sglang_runtime.upstream_process_weights_after_loading(layer.quant_method, layer, mp)
            for n in PARAMS:
                digits.setdefault(n, []).append(getattr(layer, n).data.view(torch.uint8).reshape(-1).long())
    out = {}
    for n, ds in digits.items():
        ckpt_index = ds[0] | (ds[1] << 8) | (ds[2] << 16)  # stored position -> checkpoint index
        assert torch.equal(ckpt_index.sort().values, torch.arange(ckpt_index.numel()))  # a permutation
        inv = torch.empty_like(ckpt_index)
        inv[ckpt_index] = torch.arange(ckpt_index.numel())
        assert not torch.equal(inv, torch.arange(inv.numel())), f"SGLang's prep left {n} in place?"
        out[n] = inv
    return out


@pytest.fixture(scope="module")
def clean_model():
    return prepared(SPEC, seed=2)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_one_flipped_byte_is_found_at_its_checkpoint_coordinates(data, stored_position, clean_model):
    layer = clean_model.experts
    name = data.draw(st.sampled_from(PARAMS), label="param")
    shape = getattr(layer, name).shape
    e, r, c = (data.draw(st.integers(0, n - 1), label=lbl) for n, lbl in zip(shape, "erc", strict=True))
    xor = data.draw(st.integers(1, 255), label="xor")
    weight = name.replace("_scale", "")
    snap = clone_params(layer)
    flipped = {k: v.clone() for k, v in snap.items()}
    flat = flipped[name].view(torch.uint8).reshape(-1)
    flat[stored_position[name][(e * shape[1] + r) * shape[2] + c]] ^= xor
    expect = checker.snapshot_side(layer, weight, snap)
    actual = checker.snapshot_side(layer, weight, flipped)
    rep = checker.compare_raw(expect, actual)
    assert rep.num_mismatch == 1 and rep.experts == [e]
    m = rep.first[0]
    assert (m.param, m.expert, m.row, m.col) == (name, e, r, c)
    pos = stored_position[name][(e * shape[1] + r) * shape[2] + c]
    assert m.expect ^ m.actual == xor and m.expect == snap[name].view(torch.uint8).reshape(-1)[pos].item()


def test_flipped_byte_through_sglang_weight_checker_names_expert_row_col(stored_position):
    model = prepared(SPEC, seed=3)
    layer = model.experts
    wc = weight_checker(model)
    wc.handle("snapshot", role="target")
    wc.handle("compare", role="target")  # identical weights pass
    wc.handle("snapshot", role="target")
    e, r, c = 2, 77, 5
    _, rows, cols = layer.w2_weight_scale.shape
    layer.w2_weight_scale.data.view(torch.uint8).reshape(-1)[
        stored_position["w2_weight_scale"][(e * rows + r) * cols + c]
    ] ^= 0x08
    with pytest.raises(Exception) as err:
        wc.handle("compare", role="target")
    msg = str(err.value)
    assert "experts.w2_weight:" in msg and "1 of" in msg and "in experts [2]" in msg
    assert f"w2_weight_scale[expert {e}, row {r}, col {c}]" in msg
    assert "experts.w13_weight:" not in msg  # only the corrupted entry fails


@pytest.mark.sglang(
    "<0.5.15",
    reason="SGLang's module-level _check_tensors / _postprocess_tensors compare exists "
    "upstream before 0.5.15 only (the comparator module replaces it)",
)
def test_before_0_5_15_other_tensors_stream_through_sglangs_own_check_with_cuda(stored_position, monkeypatch):
    """With CUDA (faked here: `.cuda()` is the identity), every pair that is not the plugin's goes through SGLang's
    own _check_tensors, pair by pair as SGLang streams them, and its failures and ours come back as one error."""
    model = prepared(SPEC, seed=3)
    layer = model.experts
    wc = weight_checker(model)
    wc.handle("snapshot", role="target")
    e, r, c = 1, 5, 3
    _, rows, cols = layer.w2_weight_scale.shape
    layer.w2_weight_scale.data.view(torch.uint8).reshape(-1)[
        stored_position["w2_weight_scale"][(e * rows + r) * cols + c]
    ] ^= 0x08
    layer.w2_input_scale.data[2] *= 2  # not laid out by the plugin: SGLang's own bitwise compare finds it
    seen = []
    real = torch.Tensor.cuda

    def fake_cuda(self, *a, **k):
        seen.append(self.shape)
        return self

    from sglang_trtllm_moe.builtins import checker_legacy_hooks

    monkeypatch.setattr(checker_legacy_hooks, "_sglang_can_compare", lambda: True)
    monkeypatch.setattr(torch.Tensor, "cuda", fake_cuda)
    try:
        with pytest.raises(Exception) as err:
            wc.handle("compare", role="target")
    finally:
        monkeypatch.setattr(torch.Tensor, "cuda", real)
    msg = str(err.value)
    assert msg.startswith("check tensor equality failed:") and msg.count("check tensor equality failed") == 1
    assert "name=experts.w2_input_scale max_abs_err" in msg  # SGLang's message for its pair
    assert f"w2_weight_scale[expert {e}, row {r}, col {c}]" in msg and "in experts [1]" in msg  # ours
    assert "name=experts.w13_weight " not in msg
    assert seen and all(s != layer.w13_weight.shape for s in seen)  # laid-out weights never reached SGLang's compare


def test_sglang_prepared_fp8_block_layer_through_sglang_weight_checker(monkeypatch):
    """DeepSeek FP8 block layers on flashinfer_trtllm are SGLang's own (compat/defer.py); SGLang's checker compares
    them (0.5.11's asserts on their float32 scales: there the plugin dequantizes them as 0.5.12 does), and a
    corrupted byte fails the compare, naming the weight."""
    from sglang_trtllm_moe.compat import defer
    from sglang_trtllm_moe.formats import FP8_BLOCK

    monkeypatch.undo()  # the layer stays SGLang's (the autouse fixture makes the plugin prepare it)
    assert defer.upstream_prepares(FP8_BLOCK)
    # SGLang's 0.5.15+ block comparator moves chunks with .cuda() (a GPU feature): on this CPU box, in place
    monkeypatch.setattr(torch.Tensor, "cuda", lambda self, *a, **k: self)
    spec = cpu_layers.MoeSpec(num_experts=4, intermediate=128, fmt="fp8_block")
    model = prepared(spec, tensors=cpu_layers.random_fp8_checkpoint(spec, seed=9))
    layer = model.experts
    assert layer_state.state_of(layer) is None and layer_state.observed(layer) is not None
    wc = weight_checker(model)
    wc.handle("snapshot", role="target")
    wc.handle("compare", role="target")
    wc.handle("snapshot", role="target")
    layer.w13_weight.data.view(torch.uint8)[2, 7, 9] ^= 0x11
    with pytest.raises(Exception) as err:
        wc.handle("compare", role="target")
    assert "experts.w13_weight" in str(err.value) and "experts.w2_weight" not in str(err.value)


# ---- SGLang's snapshot -> reset_tensors -> update -> compare flow -----------------------------------------------


def sglang_loader_location(spec, clean, corrupted):
    """Where SGLang's loader puts the differing checkpoint byte: (param, expert, row, col)."""
    a, b = loaded(spec, tensors=clean).experts, loaded(spec, tensors=corrupted).experts
    for n in PARAMS:
        diff = (getattr(a, n).data.view(torch.uint8) != getattr(b, n).data.view(torch.uint8)).nonzero().tolist()
        if diff:
            assert len(diff) == 1
            return (n, *diff[0])
    raise AssertionError("the corruption did not reach any parameter")


def test_snapshot_reset_update_compare_passes_after_a_correct_update_and_fails_after_a_corrupted_one():
    good = cpu_layers.random_nvfp4_checkpoint(SPEC, seed=4)
    model = prepared(SPEC, tensors=good)
    ptrs = {n: p.data_ptr() for n, p in model.named_parameters()}
    wc = weight_checker(model)

    wc.handle("snapshot", role="target")
    wc.handle("reset_tensors", role="target")
    from_tensor(model, good)  # SGLang's WeightUpdater.update_weights_from_tensor
    wc.handle("compare", role="target")

    bad = dict(good)
    w = bad["experts.3.gate_proj.weight"].clone()
    w[41, 7] ^= 0x30
    bad["experts.3.gate_proj.weight"] = w
    want = sglang_loader_location(SPEC, good, bad)
    wc.handle("snapshot", role="target")
    wc.handle("reset_tensors", role="target")
    from_tensor(model, bad)
    with pytest.raises(Exception) as err:
        wc.handle("compare", role="target")
    msg = str(err.value)
    name, e, r, c = want
    assert name == "w13_weight" and e == 3
    assert f"w13_weight[expert {e}, row {r}, col {c}]" in msg and "in experts [3]" in msg and "1 of" in msg
    assert {n: p.data_ptr() for n, p in model.named_parameters()} == ptrs


def test_snapshot_with_an_expert_mid_update_is_undone_with_the_layout_it_was_taken_in(monkeypatch):
    """A snapshot holding expert 1 in checkpoint layout (written, not yet flushed) still equals the flushed
    weights under auto (layout-aware); forced raw, it differs in expert 1 only."""
    tensors = cpu_layers.random_nvfp4_checkpoint(SPEC, seed=5)
    model = prepared(SPEC, tensors=tensors)
    layer = model.experts
    one = {k: v for k, v in tensors.items() if k.startswith("experts.1.")}
    cpu_layers.load_checkpoint(layer, one, SPEC.num_experts)  # same bytes again, through SGLang's loader
    assert layer_state.state_of(layer).dirty_experts() == {"w13": [1], "w2": [1]}
    wc = weight_checker(model)
    wc.handle("snapshot", role="target")
    layer_state.flush_all()
    wc.handle("compare", role="target")

    wc.handle("snapshot", role="target")
    layer_state.before_write(layer, "w13_weight", 1)  # snapshot prepared; the live expert 1 back in checkpoint layout
    monkeypatch.setenv(checker.ENV_MODE, "raw")
    with pytest.raises(Exception) as err:
        wc.handle("compare", role="target")
    assert "in experts [1]" in str(err.value)
    layer_state.flush_all()


# ---- tolerance: layout-aware compare follows SGLang's allow_quant_error rule ----------------------------------------


def _nudge_code(layer, e, r, new_code, old_code):
    """Rewrite one FP4 code (low nibble) of a prepared w13 expert row, via checkpoint layout (whole group)."""
    layer_state.before_write(layer, "w13_weight", e)
    b = layer.w13_weight.data[e, r, 0].item()
    assert b & 0x0F == old_code
    layer.w13_weight.data[e, r, 0] = (b & 0xF0) | new_code
    layer_state.flush(layer)


def test_layout_aware_tolerance_one_grid_step_passes_only_with_allow_quant_error(monkeypatch):
    model = loaded(SPEC, seed=6)
    ckpt = clone_params(model.experts)
    model.experts.quant_method.process_weights_after_loading(model.experts)
    layer = model.experts
    # a checkpoint element with e2m1 code 2 (+1.0): one grid step up is code 3 (1.5), far is code 7 (6.0)
    codes = ckpt["w13_weight"][..., 0] & 0x0F
    e, r = ((codes == 2) & (ckpt["w13_weight_scale"][..., 0].float() > 0)).nonzero()[0].tolist()
    monkeypatch.setenv(checker.ENV_MODE, "layout")
    wc = weight_checker(model)
    wc.handle("snapshot", role="target")
    _nudge_code(layer, e, r, 3, 2)
    with pytest.raises(Exception) as err:
        wc.handle("compare", allow_quant_error=False, role="target")
    msg = str(err.value)
    assert "layout compare, 0 beyond tolerance" in msg and "1 of" in msg
    sf = ckpt["w13_weight_scale"][e, r, 0].float().item()
    assert f"w13_weight[expert {e}, row {r}, col 0] expect {sf:.6g} actual {1.5 * sf:.6g} (within tolerance)" in msg
    wc.handle("compare", allow_quant_error=True, role="target")  # one grid step: SGLang logs it, passes

    wc.handle("snapshot", role="target")
    _nudge_code(layer, e, r, 7, 3)
    with pytest.raises(Exception) as err:
        wc.handle("compare", allow_quant_error=True, role="target")
    assert "layout compare, 1 beyond tolerance" in str(err.value)


# ---- BF16: the same comparators, generic over the format (BlockMajorK layout, no scales) ------------------------

BF16_CASES = [
    pytest.param(cpu_layers.MoeSpec(num_experts=4, intermediate=96, fmt="bf16"), id="bf16-gated-padded"),
    pytest.param(
        cpu_layers.MoeSpec(num_experts=4, intermediate=128, activation="relu2", gated=False, fmt="bf16"),
        id="bf16-relu2",
    ),
]


def flashinfer_bf16(spec, w13, w2):
    """flashinfer's own pure-torch BF16 preparation, as [E, M, K]-shaped tensors over the same bytes."""
    from flashinfer.fused_moe.api import ReLU2, SwiGLU
    from flashinfer.fused_moe.prepare import prepare_trtllm_bf16_weights

    out = prepare_trtllm_bf16_weights(
        w13.clone(),
        w2.clone(),
        num_local_experts=spec.num_experts,
        hidden_size=spec.hidden,
        intermediate_size=w2.shape[2],
        activation=SwiGLU() if spec.gated else ReLU2(),
        permute_cache={},
    )
    return {
        "w13_weight": out["gemm1_weights"].contiguous().reshape(w13.shape),
        "w2_weight": out["gemm2_weights"].contiguous().reshape(w2.shape),
    }


@pytest.mark.parametrize("spec", BF16_CASES)
def test_bf16_prepared_vs_checkpoint_and_a_changed_element_located_through_flashinfer_prep(spec):
    model = cpu_layers.TinyMoeModel(spec)
    model.load_weights(cpu_layers.checkpoint_names(cpu_layers.random_bf16_checkpoint(spec, 7)).items())
    ck = {n: getattr(model.experts, n).data.clone() for n in WEIGHTS}
    model.experts.quant_method.process_weights_after_loading(model.experts)
    layer = model.experts
    assert layer_state.state_of(layer).fmt.name == "bf16"
    fi = flashinfer_bf16(spec, ck["w13_weight"], ck["w2_weight"])
    g = torch.Generator().manual_seed(0)
    for name in WEIGHTS:
        live = checker.live_side(layer, name)
        theirs = checker.snapshot_side(layer, name, fi)
        ckpt_side = checker.snapshot_side(layer, name, ck, checkpoint=True)
        assert checker.compare_raw(theirs, live).equal  # plugin bytes == flashinfer's
        assert checker.compare(ckpt_side, live).equal  # auto -> layout-aware
        assert not checker.compare_raw(ckpt_side, live).equal
        got = torch.cat([v for _, v, _ in checker.iter_dequantized(live)])
        assert torch.equal(got, ck[name].float())
        for _ in range(3):
            e, r, c = (int(torch.randint(0, n, (1,), generator=g)) for n in ck[name].shape)
            changed = {k: v.clone() for k, v in ck.items()}
            changed[name][e, r, c] = -changed[name][e, r, c] - 1
            rep = checker.compare_raw(
                theirs,
                checker.snapshot_side(
                    layer, name, flashinfer_bf16(spec, **{"w13": changed["w13_weight"], "w2": changed["w2_weight"]})
                ),
            )
            assert rep.num_mismatch == 1 and (rep.first[0].expert, rep.first[0].row, rep.first[0].col) == (e, r, c)


# ---- every other format the plugin prepares: FP8 per-tensor (ModelOpt, fp8 static), FP8 block, CT NVFP4, INT4 ----

OTHER_FORMATS = {
    "fp8_modelopt": cpu_layers.random_fp8_checkpoint,
    "fp8_tensor": cpu_layers.random_fp8_checkpoint,
    "fp8_block": cpu_layers.random_fp8_checkpoint,
    "ct_nvfp4": cpu_layers.random_ct_nvfp4_checkpoint,
    "ct_int4": cpu_layers.random_ct_int4_checkpoint,
}
_INTS = {1: torch.uint8, 2: torch.int16, 4: torch.int32}


def reference_dequant(fmt, weight, scale):
    """Checkpoint-layout dequantization by code nobody here wrote (block-scale units, as the checker compares)."""
    if scale is None:  # FP8 per-tensor: the e4m3 values; the per-tensor scale is a scalar param compared raw
        return weight.float()
    if fmt == "fp8_block":
        from sglang.srt.layers.quantization.fp8_utils import block_quant_dequant

        return block_quant_dequant(weight, scale, [128, 128], torch.float32)
    if fmt == "ct_int4":  # compressed-tensors' own unpacking of its int32 words (w/s + 8 -> w/s), x the bf16 scale
        from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32

        e, m, k8 = weight.shape
        q = torch.stack([unpack_from_int32(weight[i], 4, torch.Size((m, k8 * 8))) for i in range(e)]).float()
        return q * scale.float().repeat_interleave(32, dim=-1)
    from flashinfer.quantization.fp4_quantization import _e2m1_and_ufp8sf_scale_to_float_cpu as fi_dequant

    return torch.stack(
        [fi_dequant(weight[e], scale[e].view(torch.uint8), None, 16, 1, False) for e in range(weight.shape[0])]
    )


@pytest.mark.parametrize("fmt", list(OTHER_FORMATS))
def test_other_formats_layout_aware_dequant_and_a_corrupted_update_located_through_sglang(fmt):
    spec = cpu_layers.MoeSpec(num_experts=4, fmt=fmt)  # the kind's intermediate (128; INT4: 256)
    good = OTHER_FORMATS[fmt](spec, seed=8)
    model = cpu_layers.TinyMoeModel(spec)
    model.load_weights(cpu_layers.checkpoint_names(good).items())
    layer = model.experts
    ck = {n: p.data.clone() for n, p in layer.named_parameters(recurse=False)}
    layer.quant_method.process_weights_after_loading(layer)
    st = layer_state.state_of(layer)
    assert st is not None and st.clean, f"{fmt}: the plugin did not take the layer"
    laid_out = [p.name for p in st.fmt.params]
    names = [n for n in laid_out if st.fmt.scale_of(n) is not None or "scale" not in n]
    for name in names:
        scale = st.fmt.scale_of(name)
        live = checker.live_side(layer, name)
        got = torch.cat([v for _, v, _ in checker.iter_dequantized(live)])
        assert torch.equal(got, reference_dequant(fmt, ck[name], None if scale is None else ck[scale])), name
        ckpt_side = checker.snapshot_side(layer, name, ck, checkpoint=True)
        assert checker.compare_layout(ckpt_side, live).equal
        moved = any(not torch.equal(ck[n].view(torch.uint8), live.tensors[n].view(torch.uint8)) for n in live.tensors)
        assert checker.compare_raw(ckpt_side, live).equal == (
            not moved
        )  # FP8 block: the kernel layout is the loaded one

    # SGLang's flow: snapshot, then a corrupted expert-2 shard through SGLang's loader (+ the plugin's flush)
    key = next(
        k
        for k in good
        if k.startswith("experts.2.gate_proj.weight")
        and good[k].element_size() in (1, 4)
        and "scale" not in k
        and "shape" not in k
    )
    bad = dict(good)
    w = good[key].clone()
    w.view(torch.uint8)[5, 3] ^= 0x11
    bad[key] = w

    def where():
        a, b = (cpu_layers.TinyMoeModel(spec) for _ in range(2))
        a.load_weights(cpu_layers.checkpoint_names(good).items())
        b.load_weights(cpu_layers.checkpoint_names(bad).items())
        for n in laid_out:  # in stored elements (INT4: int32 words of 8 values), as the checker reports them
            pa, pb = getattr(a.experts, n).data, getattr(b.experts, n).data
            d = pa.view(_INTS[pa.element_size()]) != pb.view(_INTS[pb.element_size()])
            if d.any():
                assert int(d.sum()) == 1
                return (n, *d.nonzero()[0].tolist())
        raise AssertionError("corruption not loaded")

    n, e, r, c = where()
    wc = weight_checker(model)
    wc.handle("snapshot", role="target")
    cpu_layers.load_checkpoint(layer, {key: bad[key]}, spec.num_experts)
    layer_state.flush_all()
    with pytest.raises(Exception) as err:
        wc.handle("compare", role="target")
    msg = str(err.value)
    assert f"{n}[expert {e}, row {r}, col {c}]" in msg and "in experts [2]" in msg and " 1 of " in msg, msg[-600:]
