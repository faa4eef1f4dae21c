"""MXFP4 routed experts on an FP8 config (DeepSeek-V4 / MiMo-V2: Fp8Config.is_fp4_experts on flashinfer_mxfp4 ->
SGLang's Mxfp4FlashinferTrtllmMoEMethod, 0.5.12+) on CPU, prepared in place by the plugin
(formats/mxfp4_experts.py): storage allocated once at the kernel's width (e8m0 scales, weights padded per half),
filled by SGLang's own loader, laid out per dirty expert.

Oracles: SGLang's own preparation of the same checkpoint (new Parameters: the bytes it hands the kernel), FlashInfer's
own `prepare_trtllm_fp4_weights(MXFP4 x MXFP8)`, SGLang's `MXFP4QuantizeUtil.dequantize`, and a fresh load after
every RL update. SGLang itself cannot take an RL update here: its prep replaces the Parameters without
`weight_loader` (AttributeError on the next load, pinned below).
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
BACKEND = "flashinfer_mxfp4"
PADDED = pytest.mark.sglang(
    ">=0.5.17",
    reason="FusedMoE's plain loader writes a smaller shard into a larger expert "
    "buffer from 0.5.17; before, an intermediate that is not a multiple of 128 cannot be "
    "padded (and SGLang's own prep asserts until 0.5.21): the plugin leaves such layers to SGLang",
)
SGLANG_PADS = pytest.mark.sglang(
    ">=0.5.21",
    reason="SGLang's own FP4-expert prep pads the intermediate to 128 from "
    "0.5.21 (it asserts before), so there is no SGLang answer to compare with",
)


@pytest.fixture(scope="module", autouse=True)
def runtime():
    sglang_runtime.ensure(BACKEND)


def spec_of(intermediate=128, experts=4):
    return MoeSpec(num_experts=experts, intermediate=intermediate, fmt="mxfp4_experts")


def as_bytes(t):
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def prepared_layer(spec, ck):
    layer = cpu_layers.build_layer(spec)
    cpu_layers.load_checkpoint(layer, ck, spec.num_experts)
    objs = {n: (p, p.data_ptr(), tuple(p.shape), p.weight_loader) for n, p in layer.named_parameters()}
    layer.quant_method.process_weights_after_loading(layer)
    st = layer_state.state_of(layer)
    assert st is not None and st.clean and st.fmt.name == "mxfp4_experts", "the plugin did not take the layer"
    for n, (obj, ptr, shape, loader) in objs.items():
        p = getattr(layer, n)
        assert p is obj and p.data_ptr() == ptr and tuple(p.shape) == shape and p.weight_loader is loader, n
    return layer


def sglang_prepared(spec, ck):
    layer = sglang_oracle.sglang_layer(spec)
    cpu_layers.load_checkpoint(layer, ck, spec.num_experts)
    sglang_oracle.sglang_prepare(layer)
    return layer


def assert_same_bytes(ours, other, what):
    for n in PARAMS:
        a, b = getattr(ours, n), getattr(other, n)
        assert a.shape == b.shape, (n, a.shape, b.shape)
        assert torch.equal(as_bytes(a), as_bytes(b)), f"{n} differs from {what}"


# ---- storage and preparation --------------------------------------------------------------------------------------


def test_storage_is_allocated_at_the_kernel_width_with_sglang_attributes():
    spec = spec_of(128)
    ours, upstream = cpu_layers.build_layer(spec), sglang_oracle.sglang_layer(spec)
    for n in PARAMS:
        a, b = getattr(ours, n), getattr(upstream, n)
        assert a.shape == b.shape
        assert a.dtype == (torch.float8_e8m0fnu if "scale" in n else torch.int8)
        assert {k: v for k, v in vars(a).items()}.keys() == vars(b).keys(), n  # weight_loader, quant_method, ...
        assert a.weight_loader.__func__ is b.weight_loader.__func__ and a.weight_loader.__self__ is ours
    assert bool((ours.w13_weight_scale_inv.data.view(torch.uint8) == 127).all())  # 1.0 until loaded


@pytest.mark.parametrize("scale_dtype", [torch.float8_e8m0fnu, torch.float32], ids=["e8m0-scales", "f32-scales"])
@pytest.mark.parametrize(
    "intermediate", [pytest.param(128, id="I128"), pytest.param(96, id="I96-padded", marks=[PADDED, SGLANG_PADS])]
)
def test_prepared_bytes_equal_sglang_own_preparation(intermediate, scale_dtype):
    spec = spec_of(intermediate)
    ck = cpu_layers.random_checkpoint(spec, 0, scale_dtype=scale_dtype)
    ours = prepared_layer(spec, ck)
    upstream = sglang_prepared(spec, ck)
    assert_same_bytes(ours, upstream, "SGLang's own MXFP4-expert preparation")
    for n in ("output1_scale_scalar", "output1_scale_gate_scalar", "output2_scale_scalar"):
        assert torch.equal(getattr(ours, n), getattr(upstream, n)) and n in dict(ours.named_buffers()), n
    if intermediate % 128:
        assert ours.intermediate_size_per_partition == upstream.intermediate_size_per_partition == 128


@pytest.mark.sglang(
    ">=0.5.18",
    reason="flashinfer's prepare_trtllm_fp4_weights (the oracle) takes an MXFP4 variant "
    "from the flashinfer 0.6.17 SGLang 0.5.18 pins (NVFP4 only before)",
)
def test_prepared_bytes_equal_flashinfer_prepare_trtllm_fp4_weights():
    """FlashInfer's own MXFP4 x MXFP8 preparation of bf16 [up; gate] weights (its CUDA quantizer and interleave
    replaced by torch ones); the same numbers as a checkpoint through SGLang's loader and the plugin give its bytes."""
    import flashinfer.fp4_quantization as fq4stub
    import flashinfer.quantization.fp4_quantization as fq4
    from flashinfer.fused_moe import api, prepare

    from sglang_trtllm_moe import quant

    spec = spec_of(128)
    E, H, inter = spec.num_experts, spec.hidden, spec.intermediate
    g = torch.Generator().manual_seed(3)
    w1 = (torch.randn(E, 2 * inter, H, generator=g) * 0.05).to(torch.bfloat16)  # [up; gate]
    w2 = (torch.randn(E, H, inter, generator=g) * 0.05).to(torch.bfloat16)

    def fp4_quantize(x, global_scale=None, sf_vec_size=16, sf_use_ue8m0=False, is_sf_swizzled_layout=True, *a, **k):
        assert sf_vec_size == 32 and sf_use_ue8m0 and not is_sf_swizzled_layout
        q, s = quant.mxfp4_quantize(x.float())
        return q, s.reshape(-1)

    saved = fq4stub.fp4_quantize, fq4.block_scale_interleave
    fq4stub.fp4_quantize, fq4.block_scale_interleave = fp4_quantize, sglang_oracle.torch_block_scale_interleave
    try:
        if hasattr(api, "QuantFormat"):  # flashinfer 0.7
            how = dict(quant=api.QuantConfig(api.QuantFormat.MXFP4, api.QuantFormat.MXFP8))
        else:  # 0.6.x: MXFP4 weights x MXFP8 activations
            how = dict(variant=api.QuantVariant.MXFP4)
        fi = prepare.prepare_trtllm_fp4_weights(
            w1, w2, num_local_experts=E, hidden_size=H, intermediate_size=inter, **how
        )
    finally:
        fq4stub.fp4_quantize, fq4.block_scale_interleave = saved
    ck = {}
    for e in range(E):
        for proj, w in (("up_proj", w1[e, :inter]), ("gate_proj", w1[e, inter:]), ("down_proj", w2[e])):
            q, s = quant.mxfp4_quantize(w.float())
            ck[f"experts.{e}.{proj}.weight"] = q.view(torch.int8)
            ck[f"experts.{e}.{proj}.weight_scale_inv"] = s.view(torch.float8_e8m0fnu)
    ours = prepared_layer(spec, ck)
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


def test_one_expert_update_equals_sglang_own_preparation_and_sglang_alone_cannot_reload():
    spec = spec_of(128)
    base, new = cpu_layers.random_checkpoint(spec, 0), cpu_layers.random_checkpoint(spec, 1)
    layer = prepared_layer(spec, base)
    one = {k: v for k, v in new.items() if k.startswith("experts.3.")}
    cpu_layers.load_checkpoint(layer, one, spec.num_experts)
    layer.quant_method.process_weights_after_loading(layer)
    assert_same_bytes(layer, sglang_prepared(spec, _mixed(base, new, {3})), "SGLang's prep of the mixed checkpoint")
    upstream = sglang_prepared(spec, base)  # SGLang alone: its Parameters were replaced without weight_loader
    with pytest.raises(AttributeError):
        cpu_layers.load_checkpoint(upstream, one, spec.num_experts)


# ---- emulator -----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("precision", ["default", "bf16"], ids=["mxfp8-activations", "bf16-activations"])
@pytest.mark.parametrize(
    "intermediate", [pytest.param(128, id="I128"), pytest.param(96, id="I96-padded", marks=PADDED)]
)
def test_emulated_forward_matches_the_dequantized_reference(precision, intermediate, monkeypatch):
    monkeypatch.setenv("SGLANG_TRTLLM_MOE_EMULATE", "1")
    spec = spec_of(intermediate)
    ck = cpu_layers.random_checkpoint(spec, 0)
    layer = prepared_layer(spec, ck)
    layer.quant_method.flashinfer_mxfp4_moe_precision = precision
    limit = float(layer.quant_method._gemm1_clamp_limit_tensor[0])
    g = torch.Generator().manual_seed(1)
    x = torch.randn(6, spec.hidden, generator=g).to(torch.bfloat16)
    logits = torch.randn(6, spec.num_experts, generator=g)
    out, topk = sglang_runtime.forward(layer, x, logits)
    w = mx_reference.dequantized_experts(spec, ck)
    ref = mx_reference.reference_moe(x, topk.topk_ids, topk.topk_weights, w, spec, limit=limit)
    tight = mx_reference.reference_moe(
        x,
        topk.topk_ids,
        topk.topk_weights,
        w,
        spec,
        limit=limit,
        round_like_kernel="mxfp8" if precision == "default" else "bf16",
    )
    # The weights are exact (the reference dequantizes the same MXFP4 bytes); only the kernel's own roundings
    # remain: MXFP8 activations and intermediate (measured 0.044-0.047 on 0.5.23, bound 0.08) or bf16 (measured
    # 0.0033-0.0038, bound 0.01). Against a reference rounding at the same points: measured <= 0.0028 (bound 0.01).
    # A wrong layout gives ~1.
    rel = float((out.float() - ref).norm() / ref.norm())
    rel_tight = float((out.float() - tight).norm() / tight.norm())
    assert rel < (0.08 if precision == "default" else 0.01), rel
    assert rel_tight < 0.01, rel_tight
    layer_state.state_of(layer).fmt.unprepare_(layer, "w13", list(range(spec.num_experts)))
    bad, _ = sglang_runtime.forward(layer, x, logits)
    assert float((bad.float() - ref).norm() / ref.norm()) > 0.5


# ---- the real kernel (SM100) ----------------------------------------------------------------------------------------


@pytest.mark.requires_sm100
@pytest.mark.parametrize("precision", ["default", "bf16"])
def test_kernel_matches_the_emulator_on_the_same_prepared_bytes(precision):
    """flashinfer's trtllm_fp4_block_scale_routed_moe on the plugin's storage views (uint8 weights, UE8M0 scale bytes
    with float8_e4m3fn metadata, MXFP8 activations with e4m3-viewed linear scales) against the emulator."""
    from types import SimpleNamespace

    import flashinfer.fused_moe as fi

    from sglang_trtllm_moe import emulator
    from sglang_trtllm_moe.formats import KernelCall
    from sglang_trtllm_moe.runner import routing_kwargs

    spec = MoeSpec(num_experts=8, hidden=512, intermediate=256, fmt="mxfp4_experts")
    ck = cpu_layers.random_checkpoint(spec, 0)
    layer = cpu_layers.build_layer(spec).cuda()
    cpu_layers.load_checkpoint(layer, {k: v.cuda() for k, v in ck.items()}, spec.num_experts)
    layer.quant_method.process_weights_after_loading(layer)
    fmt = layer_state.state_of(layer).fmt
    x = torch.randn(16, spec.hidden, device="cuda").to(torch.bfloat16)
    from sglang.srt.layers.moe.topk import TopK

    topk = TopK(top_k=2, renormalize=True, layer_id=0)(x, torch.randn(16, spec.num_experts, device="cuda"))
    qi = SimpleNamespace(
        global_num_experts=8,
        local_num_experts=8,
        local_expert_offset=0,
        routing_method_type=None,
        gemm1_clamp_limit=layer.quant_method._gemm1_clamp_limit_tensor,
        precision=precision,
        bypassed_routing={},
    )
    outs = []
    for mod, on_kernel in ((fi, True), (emulator, False)):
        routing, routed = routing_kwargs(topk, None, layer.moe_runner_config, True)
        kw = fmt.kernel_args(KernelCall(layer, qi, layer.moe_runner_config, x, on_kernel), routing, routed)
        assert kw["gemm1_weights"].dtype == torch.uint8 and kw["gemm1_weights_scale"].dtype == torch.float8_e4m3fn
        out = mod.trtllm_fp4_block_scale_routed_moe(**kw, do_finalize=True, activation_type=3)
        outs.append((out[0] if isinstance(out, (list, tuple)) else out).float())
    rel = float((outs[0] - outs[1]).norm() / outs[1].norm())
    assert rel < 0.05, rel
