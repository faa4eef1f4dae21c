"""INT4 W4A16 experts as Kimi-K2 ships them (compressed-tensors pack-quantized, symmetric, group 32: SGLang's
`CompressedTensorsMxInt4MoE` on flashinfer_trtllm, built from a config dict by SGLang's own CompressedTensorsConfig)
on CPU, prepared in place by the plugin for `trtllm_mxint4_block_scale_moe`.

Oracles: SGLang's own preparation of the release (`process_weights_after_loading` with its CUDA-only names bound to
flashinfer's own CPU functions: sandbox/sglang_oracle.py) for the bytes; compressed-tensors' own `pack_to_int32` for
the checkpoint encoding; a float MoE on the checkpoint dequantized here for the forward. flashinfer's own test
reference for the kernel is checked in tests/test_emulator.py.
The scenarios every format shares (updates, refusals, the checker, threads, ...): tests/test_layer_contract.py.
"""

from __future__ import annotations

import tempfile
from types import SimpleNamespace

import pytest
import torch

from sglang_trtllm_moe import layer_state, quant
from sglang_trtllm_moe.formats import CT_INT4, KernelCall
from sglang_trtllm_moe.sandbox import layers as cpu_layers
from sglang_trtllm_moe.sandbox import sglang_oracle

from .support import sglang_runtime

PREPARED = ("w13_weight_packed", "w13_weight_scale", "w2_weight_packed", "w2_weight_scale")
CASES = [
    pytest.param(cpu_layers.MoeSpec(num_experts=4, hidden=256, fmt="ct_int4"), id="E4-H256-I256"),
    # Kimi-K2's hidden size and its per-rank intermediate at TP 8 (2048 / 8): w13 scales [512, 224] per expert
    pytest.param(cpu_layers.MoeSpec(num_experts=2, hidden=7168, fmt="ct_int4"), id="kimi-k2-H7168-tp8"),
    # FusedMoE pads 192 to 256 on flashinfer_trtllm and zero-fills the pad (weights and scales)
    pytest.param(cpu_layers.MoeSpec(num_experts=3, hidden=256, intermediate=192, fmt="ct_int4"), id="I192-padded"),
]


@pytest.fixture(scope="module", autouse=True)
def runtime():
    sglang_runtime.ensure("flashinfer_trtllm")


def ckpt(spec, seed=0, experts=None):
    return cpu_layers.random_ct_int4_checkpoint(spec, seed=seed, experts=experts)


def loaded_layer(spec, tensors):
    layer = cpu_layers.build_layer(spec)
    cpu_layers.load_checkpoint(layer, tensors, spec.num_experts)
    return layer


def as_bytes(t):
    return t.detach().contiguous().view(torch.uint8).reshape(-1)


def test_checkpoint_words_are_compressed_tensors_own_packing():
    """The sandbox's INT4 words are compressed-tensors' `pack_to_int32` of w/s (its quantizer's layout), and the
    plugin's sign flip (XOR 0x88 of every byte) gives SGLang's `repack`: the kernel's two's-complement nibbles."""
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

    w = torch.randn(64, 256, generator=torch.Generator().manual_seed(3))
    packed, scale = quant.int4_quantize(w)
    q = quant.int4_unpack(packed)
    assert q.min() >= -8 and q.max() <= 7 and torch.equal(pack_to_int32(q, 4), packed)
    kernel = packed.view(torch.uint8) ^ 0x88
    lo, hi = (kernel & 0xF).to(torch.int8), (kernel >> 4).to(torch.int8)
    signed = torch.stack([lo, hi], -1).flatten(-2)
    assert torch.equal(torch.where(signed >= 8, signed - 16, signed), q)
    # half a step of its own group's scale (a bit more at +amax, whose 7.5 clamps to 7 under a bf16-rounded scale)
    step = scale.float().repeat_interleave(32, dim=-1)
    assert bool(((quant.int4_dequantize(packed, scale) - w).abs() <= 0.53 * step).all())


@pytest.mark.parametrize("spec", CASES)
def test_prepared_bytes_equal_sglang_own_preparation_in_place(spec):
    tensors = ckpt(spec)
    ours = loaded_layer(spec, tensors)
    before = {n: (p, p.data_ptr(), tuple(p.shape), p.dtype) for n, p in ours.named_parameters()}
    ours.quant_method.process_weights_after_loading(ours)
    st = layer_state.state_of(ours)
    assert st is not None and st.clean and st.fmt is CT_INT4, "the plugin did not take over"
    for n, (obj, ptr, shape, dtype) in before.items():  # same Parameter objects, storage, shapes and dtypes
        p = getattr(ours, n)
        assert p is obj and p.data_ptr() == ptr and tuple(p.shape) == shape and p.dtype == dtype, n
        assert getattr(p, "weight_loader", None) is not None, n

    upstream = loaded_layer(spec, tensors)
    held = {n: getattr(upstream, n).data for n in PREPARED}  # held, so their addresses cannot be handed out again
    sglang_oracle.sglang_prepare(upstream)
    for n in PREPARED:  # SGLang: new storage, uint8 weights of another shape, flat scales, no weight_loader
        up = getattr(upstream, n)
        assert up.data_ptr() != held[n].data_ptr() and getattr(up, "weight_loader", None) is None, n
        assert as_bytes(getattr(ours, n)).numel() == as_bytes(up).numel(), n
        assert torch.equal(as_bytes(getattr(ours, n)), as_bytes(up)), f"{n} differs from SGLang's preparation"

    # the kernel is handed views of the plugin's storage, in SGLang's shapes and dtypes
    qi = SimpleNamespace(global_num_experts=spec.num_experts, local_expert_offset=0, local_num_experts=spec.num_experts)
    args = CT_INT4.kernel_args(KernelCall(ours, qi, None, None, False), {"routed_scaling_factor": None}, routed=True)
    for arg, n in (
        ("gemm1_weights", "w13_weight_packed"),
        ("gemm1_weights_scale", "w13_weight_scale"),
        ("gemm2_weights", "w2_weight_packed"),
        ("gemm2_weights_scale", "w2_weight_scale"),
    ):
        up = getattr(upstream, n)
        assert args[arg].data_ptr() == getattr(ours, n).data_ptr(), arg
        assert args[arg].dtype == up.dtype and args[arg].shape == up.shape, (arg, args[arg].shape, up.shape)
    assert args["intermediate_size"] == held["w2_weight_packed"].shape[2] * 8 and args["routed_scaling_factor"] == 1


@pytest.mark.parametrize("spec", CASES[:1])
def test_exact_inverse(spec):
    tensors = ckpt(spec)
    loaded = loaded_layer(spec, tensors)
    layer = loaded_layer(spec, tensors)
    layer.quant_method.process_weights_after_loading(layer)
    assert not torch.equal(as_bytes(layer.w13_weight_packed), as_bytes(loaded.w13_weight_packed))
    everyone = list(range(spec.num_experts))
    for group in ("w13", "w2"):
        CT_INT4.unprepare_(layer, group, everyone)
    for n in PREPARED:
        assert torch.equal(as_bytes(getattr(layer, n)), as_bytes(getattr(loaded, n))), n


def test_selection_and_its_reasons():
    """The scheme SGLang serves with CompressedTensorsMxInt4MoE is this format; other INT schemes say why not."""
    from sglang_trtllm_moe.formats import Checkpoint, for_checkpoint

    assert for_checkpoint(Checkpoint("compressed-tensors", quant_scheme="mxint4"))[0] is CT_INT4
    fmt, why = for_checkpoint(Checkpoint("compressed-tensors", quant_scheme="int4"))
    assert fmt is None and "group 32" in why and "Marlin" in why
    assert CT_INT4.supports_intermediate(2048 // 8, True)[0]
    ok, why = CT_INT4.supports_intermediate(2048 // 16, True)
    assert not ok and "256" in why


# ---- the forward: SGLang's layer on the emulator vs a float MoE of the dequantized checkpoint ---------------------


def _inputs(spec, tokens=6):
    g = torch.Generator().manual_seed(1)
    return torch.randn(tokens, spec.hidden, generator=g).to(torch.bfloat16), torch.randn(
        tokens, spec.num_experts, generator=g
    )


def reference(x, ids, weights, tensors):
    """out[t] = sum_k w * W2 @ bf16(silu(gate) * up), every weight the checkpoint's INT4 dequantized in float32."""

    def w(e, proj):
        b = f"experts.{e}.{proj}."
        return quant.int4_dequantize(tensors[b + "weight_packed"], tensors[b + "weight_scale"])

    out = torch.zeros(x.shape[0], x.shape[1])
    for t in range(x.shape[0]):
        for k in range(ids.shape[1]):
            e = int(ids[t, k])
            xt = x[t].float()
            h = torch.nn.functional.silu(w(e, "gate_proj") @ xt) * (w(e, "up_proj") @ xt)
            out[t] += float(weights[t, k]) * (w(e, "down_proj") @ h.to(torch.bfloat16).float())
    return out


def rel(a, b):
    return float((a.float() - b).norm() / b.norm())


@pytest.mark.parametrize("bypass", [False, True], ids=["sglang-topk", "kernel-routing"])
def test_emulated_forward_through_sglang_layer_matches_dequantized_reference(bypass, monkeypatch):
    monkeypatch.setenv("SGLANG_TRTLLM_MOE_EMULATE", "1")
    spec = cpu_layers.MoeSpec(num_experts=4, hidden=256, fmt="ct_int4")
    tensors = ckpt(spec)
    layer = loaded_layer(spec, tensors)
    layer.quant_method.process_weights_after_loading(layer)
    x, logits = _inputs(spec)
    out, topk = sglang_runtime.forward(layer, x, logits, bypass=bypass)
    if bypass:  # the kernel routed (Renormalize, the layer's method): SGLang's own top-k of the same logits
        from sglang_trtllm_moe.emulator.routing import route

        ids, weights = route(1, logits, spec.top_k)
    else:
        ids, weights = topk.topk_ids, topk.topk_weights
    ref = reference(x, ids, weights, tensors)
    # the same INT4 values; the only roundings are bf16 (the intermediate, GEMM2's output, the sum): ~0.3 %
    assert rel(out, ref) < 1e-2, rel(out, ref)
    CT_INT4.unprepare_(layer, "w13", list(range(spec.num_experts)))  # a wrong layout is garbage
    bad, _ = sglang_runtime.forward(layer, x, logits, bypass=bypass)
    assert rel(bad, ref) > 0.5


# ---- RL updates through SGLang's WeightUpdater: each equal to a fresh load, storage kept ----------------------------

RL_SPEC = cpu_layers.MoeSpec(num_experts=4, hidden=256, fmt="ct_int4")
updater = sglang_runtime.updater


def prepared_model(tensors):
    return sglang_runtime.prepared_model(RL_SPEC, tensors)


def assert_fresh(model, intended):
    fresh = prepared_model(intended)
    for n, p in fresh.named_parameters():
        assert torch.equal(as_bytes(getattr(model.experts, n.split(".", 1)[1])), as_bytes(p)), n
    assert layer_state.state_of(model.experts).clean


def pointers(model):
    return {n: p.data_ptr() for n, p in model.named_parameters()}


def test_disk_updates_whole_and_one_expert_equal_a_fresh_load():
    base = ckpt(RL_SPEC, 0)
    model = prepared_model(base)
    ptrs = pointers(model)
    intended = dict(base)
    for tensors in (ckpt(RL_SPEC, 4), ckpt(RL_SPEC, 5, experts=[3])):
        d = tempfile.mkdtemp(prefix="trtllm-moe-int4-")
        sglang_runtime.write_safetensors_checkpoint(d, tensors, RL_SPEC)
        ok, msg = updater(model, d).update_weights_from_disk(d, "auto")
        assert ok, msg
        intended.update(tensors)
        assert_fresh(model, intended)
    assert pointers(model) == ptrs


def _bad(tensors):
    s = "experts.1.down_proj.weight_scale"
    w = "experts.1.up_proj.weight_packed"
    nan, inf, neg = (tensors[s].clone() for _ in range(3))
    nan[3, 0], inf[0, 1], neg[5, 2] = float("nan"), float("inf"), -0.5
    return {
        "NaN scale": {s: nan},
        "infinite scale": {s: inf},
        "negative scale": {s: neg},
        "scale of the wrong shape": {s: tensors[s][:, :-1].contiguous()},
        "weight as uint8 bytes": {w: tensors[w].view(torch.uint8)},
        "weight of the wrong shape": {w: tensors[w][:-8].contiguous()},
    }


@pytest.mark.parametrize("case", list(_bad(ckpt(RL_SPEC, 6))))
def test_bad_tensor_updates_are_refused_before_a_byte_changes(case):
    model = prepared_model(ckpt(RL_SPEC, 0))
    snap = {n: as_bytes(p).clone() for n, p in model.named_parameters()}
    good = ckpt(RL_SPEC, 6, experts=[0])  # a good expert in the same request: nothing of it lands either
    bad = _bad(ckpt(RL_SPEC, 6))[case]
    ok, msg = updater(model).update_weights_from_tensor(list(cpu_layers.checkpoint_names({**good, **bad}).items()))
    assert not ok and "model.layers.0.mlp.experts" in msg, msg
    for n, p in model.named_parameters():
        assert torch.equal(as_bytes(p), snap[n]), f"{case}: {n} changed"
    assert layer_state.state_of(model.experts).clean


def test_a_zero_group_scale_is_a_zero_block():
    """A zero scale is what SGLang's padded loading writes into pad groups: accepted, and that group is zero."""
    model = prepared_model(ckpt(RL_SPEC, 0))
    t = ckpt(RL_SPEC, 6, experts=[1])
    t["experts.1.down_proj.weight_scale"][:, 0] = 0
    ok, msg = updater(model).update_weights_from_tensor(list(cpu_layers.checkpoint_names(t).items()))
    assert ok, msg
    assert_fresh(model, {**ckpt(RL_SPEC, 0), **t})


@pytest.mark.requires_sm100
@pytest.mark.parametrize("spec", CASES[:2])
def test_real_kernel_matches_emulator_on_sm100(spec, monkeypatch):
    import sglang_trtllm_moe.runner as runner

    layer = loaded_layer(spec, ckpt(spec))
    layer.quant_method.process_weights_after_loading(layer)
    layer.to("cuda")
    x, logits = _inputs(spec)
    x, logits = x.cuda(), logits.cuda()
    monkeypatch.delenv("SGLANG_TRTLLM_MOE_EMULATE", raising=False)
    kernel, _ = sglang_runtime.forward(layer, x, logits, bypass=True)
    monkeypatch.setattr(runner, "emulating", lambda: True)
    emulated, _ = sglang_runtime.forward(layer, x, logits, bypass=True)
    # bf16 activations and intermediate on both: only the kernel's accumulation order and its bf16 dequant differ
    assert rel(kernel, emulated.float()) < 2e-2
