"""gpt-oss MXFP4 FusedMoE layers (quant_method mxfp4 -> Mxfp4MoEMethod on flashinfer_mxfp4, SM100 trtllm-gen) of
the installed SGLang on CPU, prepared in place by the plugin (formats/mxfp4_gptoss.py).

gpt-oss loads fused all-expert tensors (`expert_id=None`), w13 rows interleaved gate/up, bf16 biases. SGLang's own
prep builds new Parameters (scales viewed e4m3, biases fp32), after which its loader raises TypeError on every
tensor, and forcing the original loader value-converts every scale byte (pinned below). Oracles: SGLang's own prep
of the same checkpoint, FlashInfer's own w3_w1 / w2 permute indices on the de-interleaved [up; gate] checkpoint,
SGLang's MXFP4QuantizeUtil.dequantize, and a fresh load after every update.
The scenarios every format shares (updates, refusals, the checker, threads, ...): tests/test_layer_contract.py.
"""

from __future__ import annotations

import pytest
import torch

from sglang_trtllm_moe import layer_state
from sglang_trtllm_moe.formats import mxfp4_gptoss
from sglang_trtllm_moe.sandbox import layers as cpu_layers
from sglang_trtllm_moe.sandbox import sglang_oracle
from sglang_trtllm_moe.sandbox.layers import MoeSpec

from .support import mx_reference, sglang_runtime

PARAMS = cpu_layers.GPTOSS_PARAMS
SCALARS = ("gemm1_alpha", "gemm1_beta", "gemm1_clamp_limit")
BACKEND = "flashinfer_mxfp4"
#: hidden 192 -> 256 and I 96 -> 128 (256 before 0.5.17): padded both ways, as gpt-oss (2880) is
SPEC = MoeSpec(num_experts=4, hidden=192, intermediate=96, fmt="mxfp4_gptoss")
ALIGNED = MoeSpec(num_experts=4, hidden=256, intermediate=128, fmt="mxfp4_gptoss")


@pytest.fixture(scope="module", autouse=True)
def runtime():
    sglang_runtime.ensure(BACKEND)


def as_bytes(t):
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def prepared_layer(spec, ck):
    layer = cpu_layers.build_layer(spec)
    cpu_layers.load_fused(layer, ck)
    objs = {n: (p, p.data_ptr(), tuple(p.shape), p.weight_loader) for n, p in layer.named_parameters()}
    layer.quant_method.process_weights_after_loading(layer)
    st = layer_state.state_of(layer)
    assert st is not None and st.clean and st.fmt.name == "mxfp4_gptoss", "the plugin did not take the layer"
    for n, (obj, ptr, shape, loader) in objs.items():
        p = getattr(layer, n)
        assert p is obj and p.data_ptr() == ptr and tuple(p.shape) == shape and p.weight_loader is loader, n
    return layer


def sglang_prepared(spec, ck):
    layer = sglang_oracle.sglang_layer(spec)
    cpu_layers.load_fused(layer, ck)
    sglang_oracle.sglang_prepare(layer)
    return layer


def assert_same_bytes(ours, other, what, scalars=True):
    for n in PARAMS + (SCALARS if scalars else ()):
        a, b = getattr(ours, n), getattr(other, n)
        assert a.shape == b.shape and a.dtype.itemsize == b.dtype.itemsize, (n, a.shape, b.shape, a.dtype, b.dtype)
        assert torch.equal(as_bytes(a), as_bytes(b)), f"{n} differs from {what}"


# ---- preparation --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("spec", [pytest.param(SPEC, id="H192-I96-padded"), pytest.param(ALIGNED, id="H256-I128")])
def test_prepared_bytes_equal_sglang_own_preparation(spec):
    ck = cpu_layers.random_checkpoint(spec, 0)
    ours = prepared_layer(spec, ck)
    upstream = sglang_prepared(spec, ck)
    assert_same_bytes(ours, upstream, "SGLang's own gpt-oss MXFP4 trtllm preparation")
    # deliberate: the plugin keeps SGLang's uint8 scale Parameters (the kernel gets an e4m3 view of them)
    assert ours.w13_weight_scale.dtype == torch.uint8 and upstream.w13_weight_scale.dtype == torch.float8_e4m3fn
    assert ours.w13_weight_bias.dtype == upstream.w13_weight_bias.dtype == torch.float32


def test_prepared_bytes_equal_flashinfer_permute_indices_on_the_up_gate_checkpoint():
    """gpt-oss's interleaved rows de-interleaved to [up; gate] halves are what FlashInfer's own w3_w1 permute
    indices (gated reorder + shuffle) and w2 indices take; weights, scale rows (+ 128x4) and biases alike."""
    from flashinfer.fused_moe.core import _maybe_get_cached_w3_w1_permute_indices, get_w2_permute_indices_with_cache

    from sglang_trtllm_moe import layouts

    ck = cpu_layers.random_checkpoint(SPEC, 0)
    ours = prepared_layer(SPEC, ck)
    fresh = cpu_layers.build_layer(SPEC)
    cpu_layers.load_fused(fresh, ck)  # checkpoint layout, padded as SGLang allocates
    m = fresh.w13_weight.shape[1]
    up_gate = torch.cat([torch.arange(1, m, 2), torch.arange(0, m, 2)])
    cache = {}
    p13 = _maybe_get_cached_w3_w1_permute_indices(cache, fresh.w13_weight.data[0], 128)
    p2 = get_w2_permute_indices_with_cache(cache, fresh.w2_weight.data[0], 128)
    r13 = up_gate[p13]
    want = {
        "w13_weight": fresh.w13_weight.data[:, r13],
        "w2_weight": fresh.w2_weight.data[:, p2],
        "w13_weight_scale": layouts.swizzle_sf_128x4(fresh.w13_weight_scale.data[:, r13]),
        "w2_weight_scale": layouts.swizzle_sf_128x4(fresh.w2_weight_scale.data[:, p2]),
        "w13_weight_bias": fresh.w13_weight_bias.data[:, r13],
        "w2_weight_bias": fresh.w2_weight_bias.data[:, p2],
    }
    for n, t in want.items():
        assert torch.equal(as_bytes(getattr(ours, n)), as_bytes(t)), n


# ---- RL updates (whole-layer by construction) ------------------------------------------------------------------------


def _model(ck):
    model = cpu_layers.TinyMoeModel(SPEC)
    model.load_weights(cpu_layers.checkpoint_names(ck).items())
    model.experts.quant_method.process_weights_after_loading(model.experts)
    return model


@pytest.mark.parametrize("what", ["all", "w2-only"])
def test_update_from_tensor_equals_a_fresh_load_with_storage_and_loaders_kept(what):
    base, new = cpu_layers.random_checkpoint(SPEC, 0), cpu_layers.random_checkpoint(SPEC, 1)
    model = _model(base)
    layer = model.experts
    objs = {n: (p, p.data_ptr(), p.weight_loader) for n, p in layer.named_parameters() if n in PARAMS}
    objs.update({n: (p, p.data_ptr(), None) for n, p in layer.named_parameters() if n in SCALARS})
    sent = new if what == "all" else {k: v for k, v in new.items() if k.startswith("w2_")}
    ok, msg = sglang_runtime.updater(model).update_weights_from_tensor(list(cpu_layers.checkpoint_names(sent).items()))
    assert ok, msg
    assert layer_state.state_of(layer).clean
    for n, (obj, ptr, loader) in objs.items():
        p = getattr(layer, n)
        assert p is obj and p.data_ptr() == ptr and getattr(p, "weight_loader", None) is loader, n
    assert_same_bytes(layer, prepared_layer(SPEC, {**base, **sent}), "a fresh load of the intended checkpoint")


def test_reload_then_sglang_prep_equals_sglang_prep_of_the_new_checkpoint_and_sglang_alone_cannot_reload():
    base, new = cpu_layers.random_checkpoint(SPEC, 0), cpu_layers.random_checkpoint(SPEC, 1)
    layer = prepared_layer(SPEC, base)
    cpu_layers.load_fused(layer, new)
    layer.quant_method.process_weights_after_loading(layer)  # what update_weights_from_disk runs after loading
    assert_same_bytes(layer, sglang_prepared(SPEC, new), "SGLang's own prep of the new checkpoint")
    # fp32 biases from an RL trainer are kept exactly (SGLang's bf16 bias Parameter would round them first)
    f32 = cpu_layers.random_checkpoint(SPEC, 2, bias_dtype=torch.float32)
    cpu_layers.load_fused(layer, {"w2_weight_bias": f32["w2_weight_bias"]})
    layer_state.flush_all()
    from sglang_trtllm_moe import layouts

    b2 = layer.w2_weight_bias.data
    stored = b2[:, layouts.invert_map(layouts.w2_row_map(b2.shape[1]))][:, : SPEC.hidden]
    assert torch.equal(stored, f32["w2_weight_bias"])
    upstream = sglang_prepared(SPEC, base)
    with pytest.raises(TypeError):  # SGLang's prep replaced the Parameters: default_weight_loader takes no kwargs
        cpu_layers.load_fused(upstream, new)


# ---- emulator -----------------------------------------------------------------------------------------------------


def _forward(layer, x, logits):
    from sglang.srt.layers.moe.topk import TopK, TopKOutputFormat

    # SGLang's CPU dispatch of TopK always materializes; the CUDA path only wraps the logits (what gpt-oss runs on)
    bypassed = TopK(top_k=2, renormalize=True, layer_id=0, output_format=TopKOutputFormat.BYPASSED).forward_cuda(
        x, logits
    )
    standard = TopK(top_k=2, renormalize=True, layer_id=0)(x, logits)
    return layer(x, bypassed), standard


@pytest.mark.parametrize("precision", ["default", "bf16"], ids=["mxfp8-activations", "bf16-activations"])
def test_emulated_forward_matches_the_dequantized_reference(precision, monkeypatch):
    monkeypatch.setenv("SGLANG_TRTLLM_MOE_EMULATE", "1")
    ck = cpu_layers.random_checkpoint(SPEC, 0)
    layer = prepared_layer(SPEC, ck)
    layer.quant_method.flashinfer_mxfp4_moe_precision = precision
    g = torch.Generator().manual_seed(1)
    x = torch.randn(6, SPEC.hidden, generator=g).to(torch.bfloat16)
    logits = torch.randn(6, SPEC.num_experts, generator=g)
    out, topk = _forward(layer, x, logits)
    assert out.shape == x.shape  # the kernel's output is as wide as the unpadded hidden size
    w = mx_reference.dequantized_experts(SPEC, ck)
    kw = dict(alpha=mxfp4_gptoss.ALPHA, beta=1.0, limit=mxfp4_gptoss.LIMIT, biases=w)
    ref = mx_reference.reference_moe(x, topk.topk_ids, topk.topk_weights, w, SPEC, **kw)
    tight = mx_reference.reference_moe(
        x,
        topk.topk_ids,
        topk.topk_weights,
        w,
        SPEC,
        **kw,
        round_like_kernel="mxfp8" if precision == "default" else "bf16",
    )
    # gpt-oss's SwiGLU (alpha 1.702, beta 1, clamp 7) with both biases, on the exact MXFP4 weights: measured on
    # 0.5.23 0.044 (MXFP8 activations, bound 0.08) and 0.0037 (bf16, bound 0.01) against the float reference;
    # against a reference rounding at the same points 0.0030 (bound 0.01). A wrong layout gives ~1.
    rel = float((out.float() - ref).norm() / ref.norm())
    rel_tight = float((out.float() - tight).norm() / tight.norm())
    assert rel < (0.08 if precision == "default" else 0.01), rel
    assert rel_tight < 0.01, rel_tight
    layer_state.state_of(layer).fmt.unprepare_(layer, "w13", list(range(SPEC.num_experts)))
    bad, _ = _forward(layer, x, logits)
    assert float((bad.float() - ref).norm() / ref.norm()) > 0.5


# ---- the real kernel (SM100) ----------------------------------------------------------------------------------------


@pytest.mark.requires_sm100
@pytest.mark.parametrize("precision", ["default", "bf16"])
def test_kernel_matches_the_emulator_on_the_same_prepared_bytes(precision):
    """flashinfer's trtllm_fp4_block_scale_moe on the plugin's storage (uint8 weights, uint8 scale Parameters handed
    over with float8_e4m3fn metadata, fp32 biases, alpha/beta/clamp) against the emulator on the same bytes."""
    from types import SimpleNamespace

    import flashinfer.fused_moe as fi
    from sglang.srt.layers.moe.topk import TopK, TopKOutputFormat

    from sglang_trtllm_moe import emulator
    from sglang_trtllm_moe.formats import KernelCall
    from sglang_trtllm_moe.runner import routing_kwargs

    spec = MoeSpec(num_experts=8, hidden=2880 // 10 * 2, intermediate=2880 // 10, fmt="mxfp4_gptoss")
    ck = cpu_layers.random_checkpoint(spec, 0)
    layer = cpu_layers.build_layer(spec).cuda()
    cpu_layers.load_fused(layer, {k: v.cuda() for k, v in ck.items()})
    layer.quant_method.process_weights_after_loading(layer)
    fmt = layer_state.state_of(layer).fmt
    x = torch.randn(16, spec.hidden, device="cuda").to(torch.bfloat16)
    topk = TopK(top_k=2, renormalize=True, layer_id=0, output_format=TopKOutputFormat.BYPASSED).forward_cuda(
        x, torch.randn(16, spec.num_experts, device="cuda")
    )
    qi = SimpleNamespace(global_num_experts=8, local_num_experts=8, local_expert_offset=0, precision=precision)
    outs = []
    for mod, on_kernel in ((fi, True), (emulator, False)):
        routing, routed = routing_kwargs(topk, 1, layer.moe_runner_config, False)
        kw = fmt.kernel_args(KernelCall(layer, qi, layer.moe_runner_config, x, on_kernel), routing, routed)
        assert kw["gemm1_weights_scale"].dtype == torch.float8_e4m3fn and kw["gemm1_bias"].dtype == torch.float32
        out = mod.trtllm_fp4_block_scale_moe(**kw, do_finalize=True, activation_type=3)
        outs.append((out[0] if isinstance(out, (list, tuple)) else out).float())
    rel = float((outs[0] - outs[1]).norm() / outs[1].norm())
    assert rel < 0.05, rel
