"""MXFP8 FusedMoE layers (quant_method mxfp8 -> Fp8MoEMethod.use_mxfp8) of the installed SGLang on CPU, on
flashinfer_trtllm and flashinfer_trtllm_routed, prepared in place by the plugin (formats/mxfp8.py).

Oracles: SGLang's own preparation of the same checkpoint (`align_mxfp8_moe_weights_for_flashinfer_trtllm`, run on
CPU with flashinfer's index helpers and a torch 128x4 interleave: sandbox/cpu_layers.py), FlashInfer's own
`prepare_trtllm_fp8_block_weights(MXFP8)`, SGLang's `dequant_mxfp8_2d_to_bf16`, and a fresh load of the intended
checkpoint after every RL update. Facts pinned (read in SGLang's code, measured here): FusedMoE's loader swaps the
w1/w3 shard ids for Fp8MoEMethod on the trtllm backends, so w13 loads [up; gate] per 128-padded half with pad rows
and pad scale bytes zeroed; SGLang's own prep re-shuffles every expert at every flush (the RL bug this fixes).
The scenarios every format shares (updates, refusals, the checker, threads, ...): tests/test_layer_contract.py.
"""

from __future__ import annotations

import pytest
import torch

from sglang_trtllm_moe import layer_state
from sglang_trtllm_moe.sandbox import layers as cpu_layers
from sglang_trtllm_moe.sandbox import sglang_oracle
from sglang_trtllm_moe.sandbox.layers import MoeSpec

from .support import mx_reference, sglang_runtime

PARAMS = ("w13_weight", "w13_weight_scale_inv", "w2_weight", "w2_weight_scale_inv")
TRTLLM, ROUTED = "flashinfer_trtllm", "flashinfer_trtllm_routed"
CASES = [
    pytest.param(TRTLLM, MoeSpec(num_experts=4, intermediate=128, fmt="mxfp8"), id="trtllm-gated-I128"),
    pytest.param(TRTLLM, MoeSpec(num_experts=4, intermediate=96, fmt="mxfp8"), id="trtllm-gated-I96-padded"),
    pytest.param(ROUTED, MoeSpec(num_experts=4, intermediate=96, fmt="mxfp8"), id="routed-gated-I96-padded"),
    pytest.param(
        TRTLLM,
        MoeSpec(num_experts=4, intermediate=128, activation="relu2", gated=False, fmt="mxfp8"),
        id="trtllm-relu2-I128",
        marks=pytest.mark.sglang(
            ">=0.5.19",
            reason="before 0.5.19 SGLang allocates a non-gated MXFP8 w13 "
            "with 2I rows and slices it at prep: the plugin leaves it to SGLang",
        ),
    ),
]


def as_bytes(t):
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def loaded_layer(backend, spec, ck=None, seed=0):
    sglang_runtime.ensure(backend)
    layer = cpu_layers.build_layer(spec)
    cpu_layers.load_checkpoint(layer, cpu_layers.random_checkpoint(spec, seed) if ck is None else ck, spec.num_experts)
    return layer


def prepared_layer(backend, spec, ck=None, seed=0):
    layer = loaded_layer(backend, spec, ck, seed)
    objs = {n: (p, p.data_ptr(), tuple(p.shape), p.weight_loader) for n, p in layer.named_parameters()}
    layer.quant_method.process_weights_after_loading(layer)
    st = layer_state.state_of(layer)
    assert st is not None and st.clean and st.fmt.name == "mxfp8", "the plugin did not take the MXFP8 layer"
    for n, (obj, ptr, shape, loader) in objs.items():  # in place: same objects, storage, shapes and loaders
        p = getattr(layer, n)
        assert p is obj and p.data_ptr() == ptr and tuple(p.shape) == shape and p.weight_loader is loader, n
    return layer


def assert_same_bytes(a, b, what):
    for n in PARAMS:
        x, y = getattr(a, n), getattr(b, n)
        assert x.shape == y.shape and x.dtype == y.dtype, (n, x.shape, y.shape, x.dtype, y.dtype)
        assert torch.equal(as_bytes(x), as_bytes(y)), f"{n} differs from {what}"


# ---- preparation --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("backend,spec", CASES)
def test_prepared_bytes_equal_sglang_own_preparation(backend, spec):
    ours = prepared_layer(backend, spec)
    upstream = loaded_layer(backend, spec)
    sglang_oracle.sglang_prepare(upstream)
    assert_same_bytes(ours, upstream, "SGLang's own MXFP8 trtllm preparation")
    # what SGLang's apply and dispatcher read after its own prep
    assert ours.w13_weight_scale_inv.format_ue8m0 and ours.w2_weight_scale_inv.format_ue8m0
    assert ours.w13_input_scale is None and ours.w2_input_scale is None
    for n in ("gemm1_alpha", "gemm1_beta", "gemm1_clamp_limit"):
        if hasattr(upstream, f"_flashinfer_trtllm_{n}"):
            a, b = getattr(ours, f"_flashinfer_trtllm_{n}"), getattr(upstream, f"_flashinfer_trtllm_{n}")
            assert (a is None and b is None) or torch.equal(a, b), n


@pytest.mark.sglang(
    ">=0.5.18",
    reason="flashinfer's prepare_trtllm_fp8_block_weights (the oracle) ships with the "
    "flashinfer 0.6.17+ that SGLang 0.5.18+ pins",
)
def test_prepared_bytes_equal_flashinfer_prepare_trtllm_fp8_block_weights():
    """FlashInfer's own MXFP8 preparation of bf16 [up; gate] weights (its CUDA quantizer and interleave replaced by
    torch ones of the same math); the same quantized numbers as a checkpoint through SGLang's loader and the plugin
    must give FlashInfer's bytes."""
    import flashinfer.quantization.fp4_quantization as fq4
    import flashinfer.quantization.fp8_quantization as fq8
    from flashinfer.fused_moe import api, prepare

    from sglang_trtllm_moe import quant

    spec = MoeSpec(num_experts=4, intermediate=128, fmt="mxfp8")
    E, H, inter = spec.num_experts, spec.hidden, spec.intermediate
    g = torch.Generator().manual_seed(3)
    w1 = (torch.randn(E, 2 * inter, H, generator=g) * 0.05).to(torch.bfloat16)  # [up; gate]
    w2 = (torch.randn(E, H, inter, generator=g) * 0.05).to(torch.bfloat16)

    def mxfp8_quantize(x, is_sf_swizzled_layout=True, *args, **kwargs):
        assert not is_sf_swizzled_layout
        q, s = quant.mxfp8_quantize(x.float())
        return q, s.reshape(-1)

    saved = fq8.mxfp8_quantize, fq4.block_scale_interleave
    fq8.mxfp8_quantize, fq4.block_scale_interleave = mxfp8_quantize, sglang_oracle.torch_block_scale_interleave
    try:
        if hasattr(api, "QuantFormat"):  # flashinfer 0.7
            how = dict(quant=api.QuantConfig(api.QuantFormat.MXFP8, api.QuantFormat.MXFP8))
        else:  # 0.6.x
            how = dict(variant=api.QuantVariant.MxFp8)
        fi = prepare.prepare_trtllm_fp8_block_weights(
            w1, w2, num_local_experts=E, hidden_size=H, intermediate_size=inter, **how
        )
    finally:
        fq8.mxfp8_quantize, fq4.block_scale_interleave = saved
    ck = {}
    for e in range(E):
        for proj, w in (("up_proj", w1[e, :inter]), ("gate_proj", w1[e, inter:]), ("down_proj", w2[e])):
            q, s = quant.mxfp8_quantize(w.float())
            ck[f"experts.{e}.{proj}.weight"], ck[f"experts.{e}.{proj}.weight_scale_inv"] = q, s
    ours = prepared_layer(TRTLLM, spec, ck)
    for n, k in (
        ("w13_weight", "gemm1_weights"),
        ("w13_weight_scale_inv", "gemm1_weights_scale"),
        ("w2_weight", "gemm2_weights"),
        ("w2_weight_scale_inv", "gemm2_weights_scale"),
    ):
        assert torch.equal(as_bytes(getattr(ours, n)), as_bytes(fi[k])), f"{n} differs from flashinfer's {k}"


# ---- RL updates -----------------------------------------------------------------------------------------------------


def _mixed(base, new, experts):
    return {k: (new[k] if int(k.split(".")[1]) in experts else v) for k, v in base.items()}


def test_one_expert_update_equals_sglang_own_preparation_of_the_mixed_checkpoint():
    """Where SGLang's own flow (reload + its prep over every expert) shuffles the other experts a second time."""
    spec = MoeSpec(num_experts=4, intermediate=128, fmt="mxfp8")
    base, new = cpu_layers.random_checkpoint(spec, 0), cpu_layers.random_checkpoint(spec, 1)
    layer = prepared_layer(TRTLLM, spec, base)
    one = {k: v for k, v in new.items() if k.startswith("experts.3.")}
    cpu_layers.load_checkpoint(layer, one, spec.num_experts)
    layer.quant_method.process_weights_after_loading(layer)  # what update_weights_from_disk runs after loading
    upstream = loaded_layer(TRTLLM, spec, _mixed(base, new, {3}))
    sglang_oracle.sglang_prepare(upstream)
    assert_same_bytes(layer, upstream, "SGLang's own preparation of the mixed checkpoint")
    # SGLang's own flow on the same update: the experts that were not reloaded are laid out twice
    stale = loaded_layer(TRTLLM, spec, base)
    sglang_oracle.sglang_prepare(stale)
    cpu_layers.load_checkpoint(stale, one, spec.num_experts)
    sglang_oracle.sglang_prepare(stale)
    assert not torch.equal(as_bytes(stale.w13_weight[0]), as_bytes(upstream.w13_weight[0]))


# ---- emulator -----------------------------------------------------------------------------------------------------

EMULATED = [
    pytest.param(TRTLLM, MoeSpec(num_experts=4, intermediate=96, fmt="mxfp8"), {}, id="trtllm-swiglu-I96"),
    pytest.param(ROUTED, MoeSpec(num_experts=4, intermediate=128, fmt="mxfp8"), {}, id="routed-swiglu-I128"),
    pytest.param(
        TRTLLM,
        MoeSpec(num_experts=4, intermediate=128, fmt="mxfp8"),
        dict(gemm1_alpha=1.702, gemm1_clamp_limit=0.2),
        id="trtllm-swiglu-alpha-clamp",
        marks=pytest.mark.sglang(
            ">=0.5.18",
            reason="Fp8MoEMethod passes gemm1_alpha/beta/clamp_limit to "
            "the MXFP8 kernel from SGLang 0.5.18 (FlashInferTrtllmFp8MoeQuantInfo)",
        ),
    ),
    pytest.param(
        TRTLLM,
        MoeSpec(num_experts=4, intermediate=128, activation="relu2", gated=False, fmt="mxfp8"),
        {},
        id="trtllm-relu2-I128",
        marks=CASES[-1].marks,
    ),
]


@pytest.mark.parametrize("backend,spec,act", EMULATED)
def test_emulated_forward_matches_the_dequantized_reference(backend, spec, act, monkeypatch):
    monkeypatch.setenv("SGLANG_TRTLLM_MOE_EMULATE", "1")
    sglang_runtime.ensure(backend)
    ck = cpu_layers.random_checkpoint(spec, 0)
    layer = cpu_layers.build_layer(spec, **act)
    cpu_layers.load_checkpoint(layer, ck, spec.num_experts)
    layer.quant_method.process_weights_after_loading(layer)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(6, spec.hidden, generator=g).to(torch.bfloat16)
    logits = torch.randn(6, spec.num_experts, generator=g)
    out, topk = sglang_runtime.forward(layer, x, logits)
    ref = mx_reference.reference_moe(
        x,
        topk.topk_ids,
        topk.topk_weights,
        mx_reference.dequantized_experts(spec, ck),
        spec,
        alpha=act.get("gemm1_alpha"),
        limit=act.get("gemm1_clamp_limit"),
    )
    tight = mx_reference.reference_moe(
        x,
        topk.topk_ids,
        topk.topk_weights,
        mx_reference.dequantized_experts(spec, ck),
        spec,
        alpha=act.get("gemm1_alpha"),
        limit=act.get("gemm1_clamp_limit"),
        round_like_kernel="mxfp8",
    )
    # The kernel quantizes the activations and the intermediate to MXFP8 (e4m3: 3 mantissa bits) and rounds each
    # expert's output to bf16: measured 0.038-0.061 relative to the float reference of the dequantized checkpoint
    # (bound 0.1). Against a reference that rounds at the same points only the accumulation order is left: measured
    # < 0.003 (bound 0.01). A wrong layout (rows of the other half, another block) gives ~1.
    rel = float((out.float() - ref).norm() / ref.norm())
    rel_tight = float((out.float() - tight).norm() / tight.norm())
    assert rel < 0.1, rel
    assert rel_tight < 0.01, rel_tight
    layer_state.state_of(layer).fmt.unprepare_(layer, "w13", list(range(spec.num_experts)))
    bad, _ = sglang_runtime.forward(layer, x, logits)
    assert float((bad.float() - ref).norm() / ref.norm()) > 0.5


# ---- the real kernel (SM100) ----------------------------------------------------------------------------------------


@pytest.mark.requires_sm100
@pytest.mark.parametrize("backend", [TRTLLM, ROUTED])
def test_kernel_matches_the_emulator_on_the_same_prepared_bytes(backend):
    """flashinfer's MxFp8 kernel on the plugin's bytes (uint8 weight and activation scales, as its launcher demands)
    against the emulator on the same bytes and the dequantized reference."""
    import flashinfer.fused_moe as fi

    from sglang_trtllm_moe import emulator
    from sglang_trtllm_moe.formats import KernelCall
    from sglang_trtllm_moe.runner import routing_kwargs

    spec = MoeSpec(num_experts=8, hidden=512, intermediate=256, fmt="mxfp8")
    sglang_runtime.ensure(backend)
    ck = cpu_layers.random_checkpoint(spec, 0)
    layer = cpu_layers.build_layer(spec).cuda()
    cpu_layers.load_checkpoint(layer, {k: v.cuda() for k, v in ck.items()}, spec.num_experts)
    layer.quant_method.process_weights_after_loading(layer)
    fmt = layer_state.state_of(layer).fmt
    x = torch.randn(16, spec.hidden, device="cuda").to(torch.bfloat16)
    logits = torch.randn(16, spec.num_experts, device="cuda")
    from sglang.srt.layers.moe.topk import TopK

    topk = TopK(top_k=2, renormalize=True, layer_id=0)(x, logits)
    outs = []
    for mod, on_kernel in ((fi, True), (emulator, False)):
        qi = type(
            "QI",
            (),
            dict(
                global_num_experts=spec.num_experts,
                local_expert_offset=0,
                local_num_experts=spec.num_experts,
                gemm1_alpha=None,
                gemm1_beta=None,
                gemm1_clamp_limit=None,
            ),
        )()
        routing, routed = routing_kwargs(topk, None, layer.moe_runner_config, True)
        kw = fmt.kernel_args(KernelCall(layer, qi, layer.moe_runner_config, x, on_kernel), routing, routed)
        assert kw["gemm1_weights_scale"].dtype == torch.uint8 and kw["hidden_states_scale"].dtype == torch.uint8
        out = mod.trtllm_fp8_block_scale_routed_moe(**kw, do_finalize=True, activation_type=3)
        outs.append((out[0] if isinstance(out, (list, tuple)) else out).float())
    rel = float((outs[0] - outs[1]).norm() / outs[1].norm())
    assert rel < 0.05, rel


# ---- layers the plugin does not take -------------------------------------------------------------------------------


def test_online_mxfp8_stays_on_sglang_own_preparation_with_one_log_line(monkeypatch, caplog):
    """--quantization mxfp8 on a BF16 checkpoint: SGLang quantizes at prep and rebinds the Parameters to fp8."""
    import logging

    from sglang.srt.layers.moe.fused_moe_triton.layer import FusedMoE
    from sglang.srt.layers.moe.utils import RoutingMethodType
    from sglang.srt.layers.quantization.fp8 import Fp8Config

    from sglang_trtllm_moe.builtins import mx_hooks

    sglang_runtime.ensure(TRTLLM)
    spec = MoeSpec(num_experts=4, intermediate=128, fmt="mxfp8")
    layer = FusedMoE(
        num_experts=4,
        hidden_size=spec.hidden,
        intermediate_size=128,
        top_k=2,
        layer_id=0,
        params_dtype=torch.bfloat16,
        quant_config=Fp8Config(is_checkpoint_fp8_serialized=False, use_mxfp8=True),
        prefix="model.layers.0.mlp.experts",
        routing_method_type=RoutingMethodType.Renormalize,
    )
    ran = []
    monkeypatch.setattr(mx_hooks, "_LOGGED", set())
    with caplog.at_level(logging.INFO, logger="sglang_trtllm_moe"):
        mx_hooks.fp8_method_process_weights_after_loading(
            lambda _method, lyr: ran.append(lyr), layer.quant_method, layer
        )
    assert ran == [layer] and layer_state.state_of(layer) is None
    assert any("online MXFP8" in r.message and "stays on SGLang's own preparation" in r.message for r in caplog.records)


@pytest.mark.sglang(">=0.5.12", reason="FP4 experts on an FP8 config (Fp8Config.is_fp4_experts) arrive in 0.5.12")
def test_fp4_experts_explicitly_on_flashinfer_trtllm_is_a_clear_error():
    from sglang_trtllm_moe import TrtllmLayerError

    sglang_runtime.ensure(TRTLLM)
    layer = cpu_layers.build_layer(MoeSpec(num_experts=4, intermediate=128, fmt="mxfp4_experts"))
    assert type(layer.quant_method).__name__ == "Fp8MoEMethod" and layer.quant_method.is_fp4_expert
    with pytest.raises(TrtllmLayerError) as e:
        layer.quant_method.process_weights_after_loading(layer)
    msg = str(e.value)
    assert "model.layers.0.mlp.experts" in msg and "flashinfer_mxfp4" in msg and "Fix:" in msg
