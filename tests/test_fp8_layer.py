"""FP8 per-tensor (ModelOpt FP8, SGLang fp8 static) and FP8 128x128 block (DeepSeek) FusedMoE layers of the
installed SGLang on CPU, prepared in place by the plugin, against SGLang's and flashinfer's own preparation.

Facts these tests pin (SGLang 0.5.23, read in its code and measured here):
* FusedMoE pads the intermediate to a multiple of 128 for every non-NVFP4 method on flashinfer_trtllm at
  create_weights, and loads each half into its own padded region (pad rows zeroed by the loader);
* ModelOptFp8MoEMethod loads w13 as [gate; up] (scale columns [gate, up]); Fp8MoEMethod on flashinfer_trtllm has
  its shard ids swapped by FusedMoE._weight_loader_impl, so w13 (and block scale rows) load as [up; gate] with scale
  columns [up, gate] — the kernel's order (flashinfer's own prepare_trtllm_fp8_block_weights takes [up, gate]).
The scenarios every format shares (updates, refusals, the checker, threads, ...): tests/test_layer_contract.py.
"""

from __future__ import annotations

import pytest
import torch

from sglang_trtllm_moe import layer_state
from sglang_trtllm_moe.compat import features
from sglang_trtllm_moe.sandbox import layers as cpu_layers
from sglang_trtllm_moe.sandbox.layers import DOWN, GATE, UP, MoeSpec

from .support import sglang_runtime

SCALARS = ("output1_scales_scalar", "output1_scales_gate_scalar", "output2_scales_scalar")
TENSOR_WEIGHTS = ("w13_weight", "w2_weight")
BLOCK_WEIGHTS = ("w13_weight", "w13_weight_scale_inv", "w2_weight", "w2_weight_scale_inv")

PER_TENSOR = (
    [pytest.param(MoeSpec(intermediate=128, fmt=f), id=f"{f}-gated-I128") for f in ("fp8_modelopt", "fp8_tensor")]
    + [
        pytest.param(MoeSpec(intermediate=96, fmt=f), id=f"{f}-gated-I96-padded")
        for f in ("fp8_modelopt", "fp8_tensor")
    ]
    + [
        pytest.param(
            MoeSpec(intermediate=128, activation="relu2", gated=False, fmt="fp8_modelopt"), id="fp8_modelopt-relu2-I128"
        ),
        pytest.param(
            MoeSpec(intermediate=200, activation="relu2", gated=False, fmt="fp8_tensor"),
            id="fp8_tensor-relu2-I200-padded",
        ),
    ]
)
BLOCK = [
    pytest.param(MoeSpec(intermediate=128, fmt="fp8_block"), id="fp8_block-gated-I128"),
    pytest.param(MoeSpec(intermediate=96, fmt="fp8_block"), id="fp8_block-gated-I96-padded"),
]


@pytest.fixture(scope="module", autouse=True)
def runtime():
    sglang_runtime.ensure("flashinfer_trtllm")


@pytest.fixture(autouse=True)
def plugin_prepares(monkeypatch):
    """Where SGLang's own preparation is right the plugin defers (compat/defer.py); these tests prove the plugin's
    own preparation, which serves the releases where it is not, on every release."""
    sglang_runtime.plugin_prepares(monkeypatch, "fp8_block")


def loaded_layer(spec, ck=None, seed=0, **kw):
    layer = cpu_layers.build_layer(spec)
    ck = cpu_layers.random_fp8_checkpoint(spec, seed=seed, **kw) if ck is None else ck
    cpu_layers.load_checkpoint(layer, ck, spec.num_experts)
    return layer


def as_bytes(t):
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def upstream_process_weights_after_loading(method, layer, monkeypatch):
    """SGLang's own post-load (the hooked method keeps it at `__wrapped__`). Its only CUDA-only step is sgl_kernel's
    static `scaled_fp8_quant`; it is replaced by the pure-torch formula SGLang itself uses on its non-CUDA path
    (fp8_kernel.py `_native_static_quant_fp8`: clamp(x / scale, ±448) -> e4m3). flashinfer's shuffle_matrix_a and
    reorder_rows_for_gated_act_gemm run on CPU as they are."""
    import sglang.srt.layers.quantization.fp8 as fp8_mod
    import sglang.srt.layers.quantization.modelopt_quant as mo

    def native(x, scale):
        fmax = torch.finfo(torch.float8_e4m3fn).max
        return torch.clamp(x / scale, -fmax, fmax).to(torch.float8_e4m3fn), scale

    monkeypatch.setattr(mo, "scaled_fp8_quant", native)
    monkeypatch.setattr(fp8_mod, "scaled_fp8_quant", native)
    original = type(method).process_weights_after_loading
    while hasattr(original, "__wrapped__"):
        original = original.__wrapped__
    original(method, layer)


def prepared(spec, **kw):
    layer = loaded_layer(spec, **kw)
    ptrs = {n: (p, p.data_ptr(), tuple(p.shape)) for n, p in layer.named_parameters()}
    layer.quant_method.process_weights_after_loading(layer)
    st = layer_state.state_of(layer)
    assert st is not None and st.clean, "the plugin did not take over preparation"
    for n, (obj, ptr, shape) in ptrs.items():  # (c) in place: same objects, storage and shapes
        p = getattr(layer, n)
        assert p is obj and p.data_ptr() == ptr and tuple(p.shape) == shape, n
        assert hasattr(p, "weight_loader"), f"{n} lost SGLang's weight_loader"
    return layer


# ---- (a) bytes against SGLang's own preparation and flashinfer's ------------------------------------------------


@pytest.mark.parametrize("spec", PER_TENSOR)
def test_per_tensor_bytes_equal_sglang_own_preparation_when_gate_and_up_share_a_scale(spec, monkeypatch):
    # With s_w1 == s_w3 SGLang's requant to max(s_w1, s_w3) is the identity, so its bytes and scalars are the
    # kernel's lossless answer and ours must match them exactly.
    ours = prepared(spec, equal_gate_up_scale=True)
    upstream = loaded_layer(spec, equal_gate_up_scale=True)
    upstream_process_weights_after_loading(upstream.quant_method, upstream, monkeypatch)
    for n in TENSOR_WEIGHTS:
        a, b = getattr(ours, n), getattr(upstream, n)
        assert a.shape == b.shape, (n, a.shape, b.shape)
        assert torch.equal(as_bytes(a), as_bytes(b)), f"{n} differs from SGLang's own trtllm preparation"
    for n in SCALARS:
        torch.testing.assert_close(getattr(ours, n).data, getattr(upstream, n).data, rtol=0, atol=0, msg=n)
    # the activation quant scale SGLang's runner uses (w13_input_scale after its max-reduction)
    assert torch.equal(ours.w13_input_scale_max.data, upstream.w13_input_scale.data.float())


@pytest.mark.parametrize("gated", [True, False], ids=["gated", "relu2"])
def test_per_tensor_bytes_and_scalars_match_flashinfer_prepare(gated):
    """flashinfer's prepare_trtllm_fp8_per_tensor_weights quantizes canonical [up, gate] bf16 weights and lays them
    out; its quantized bytes, un-laid with flashinfer's own permute indices, become our checkpoint. The plugin must
    give back flashinfer's bytes, and its scalars (dequant form) must equal flashinfer's (multiplier form)."""
    from flashinfer.fused_moe import api, prepare
    from flashinfer.fused_moe.core import _maybe_get_cached_w3_w1_permute_indices, get_w2_permute_indices_with_cache

    spec = MoeSpec(intermediate=128, fmt="fp8_tensor", gated=gated, activation="silu" if gated else "relu2")
    E, H, inter = spec.num_experts, spec.hidden, spec.intermediate
    M = 2 * inter if gated else inter
    g = torch.Generator().manual_seed(7)
    w1 = (torch.randn(E, M, H, generator=g) * 0.03).to(torch.bfloat16)
    w2 = (torch.randn(E, H, inter, generator=g) * 0.03).to(torch.bfloat16)
    q_in, q_int = 70.0, 200.0
    kw = {}
    if hasattr(api, "SwiGLU"):  # flashinfer >= 0.7 (SGLang 0.5.22+); 0.6.x's prepare is gated SwiGLU only
        kw["activation"] = api.SwiGLU() if gated else api.ReLU2()
    fi = prepare.prepare_trtllm_fp8_per_tensor_weights(
        w1,
        w2,
        hidden_states_scale_global=q_in,
        intermediate_scale_global=q_int,
        num_local_experts=E,
        hidden_size=H,
        intermediate_size=inter,
        **kw,
    )
    cache = {}
    p1 = _maybe_get_cached_w3_w1_permute_indices(
        cache, fi["gemm1_weights"][0].view(torch.uint8), 128, is_gated_act_gemm=gated
    )
    p2 = get_w2_permute_indices_with_cache(cache, fi["gemm2_weights"][0].view(torch.uint8), 128)
    g1 = torch.empty_like(fi["gemm1_weights"])
    g1[:, p1] = fi["gemm1_weights"]
    g2 = torch.empty_like(fi["gemm2_weights"])
    g2[:, p2] = fi["gemm2_weights"]
    # flashinfer's multipliers -> checkpoint dequant scales: gate = 1 / (q_w1 q_in), out2 = 1 / (q_int q_w2)
    s1 = fi["output1_scales_gate_scalar"] * q_in  # = 1 / q_w1
    s2 = fi["output2_scales_scalar"] * q_int  # = 1 / q_w2
    ck = {}
    for e in range(E):
        halves = {UP: g1[e, :inter], GATE: g1[e, inter:]} if gated else {UP: g1[e]}
        for proj, w in list(halves.items()) + [(DOWN, g2[e])]:
            base = f"experts.{e}.{proj}."
            ck[base + "weight"] = w.contiguous()
            ck[base + "weight_scale"] = (s2[e] if proj == DOWN else s1[e]).float()
            ck[base + "input_scale"] = torch.tensor(1.0 / (q_int if proj == DOWN else q_in))
    layer = loaded_layer(spec, ck=ck)
    layer.quant_method.process_weights_after_loading(layer)
    assert torch.equal(as_bytes(layer.w13_weight), as_bytes(fi["gemm1_weights"]))
    assert torch.equal(as_bytes(layer.w2_weight), as_bytes(fi["gemm2_weights"]))
    for n in SCALARS:
        torch.testing.assert_close(
            getattr(layer, n).data, fi[n].float(), rtol=1e-6, atol=0, msg=lambda m, n=n: f"{n}: {m}"
        )


def _fi_block_checkpoint_and_prepare(spec, seed=3):
    """Canonical bf16 weights -> (a DeepSeek checkpoint quantized by flashinfer's own block quantizer, flashinfer's
    prepare_trtllm_fp8_block_weights of the same weights). I not a multiple of 128: the weights are zero-padded per
    half to SGLang's allocation (128), quantized, and the checkpoint keeps the real rows and the partial block."""
    from flashinfer.fused_moe import api, prepare

    E, H, inter = spec.num_experts, spec.hidden, spec.intermediate
    ip = -(-inter // 128) * 128
    g = torch.Generator().manual_seed(seed)
    up = torch.zeros(E, ip, H)
    gate = torch.zeros(E, ip, H)
    down = torch.zeros(E, H, ip)
    up[:, :inter] = torch.randn(E, inter, H, generator=g) * 0.03
    gate[:, :inter] = torch.randn(E, inter, H, generator=g) * 0.02
    down[:, :, :inter] = torch.randn(E, H, inter, generator=g) * 0.03
    bf = lambda t: t.to(torch.bfloat16)  # noqa: E731
    if hasattr(api, "QuantFormat"):  # flashinfer >= 0.7 (SGLang 0.5.22+)
        variant = dict(
            quant=api.QuantConfig(weight=api.QuantFormat.DeepSeekFp8, activation=api.QuantFormat.DeepSeekFp8)
        )
    else:  # flashinfer 0.6.x: same function, the format named by QuantVariant
        variant = dict(variant=api.QuantVariant.DeepSeekFp8)
    fi = prepare.prepare_trtllm_fp8_block_weights(
        bf(torch.cat([up, gate], 1)), bf(down), num_local_experts=E, hidden_size=H, intermediate_size=ip, **variant
    )
    ck = {}
    for proj, w in ((UP, up), (GATE, gate), (DOWN, down)):
        q, s = prepare._deepseek_fp8_quantize_weights(bf(w))
        for e in range(E):
            base = f"experts.{e}.{proj}."
            ck[base + "weight"] = (q[e, :, :inter] if proj == DOWN else q[e, :inter]).contiguous()
            ck[base + "weight_scale_inv"] = s[e].contiguous()
    return ck, fi


@pytest.mark.parametrize("spec", BLOCK)
def test_block_bytes_equal_flashinfer_prepare_and_sglang_own_preparation(spec, monkeypatch):
    ck, fi = _fi_block_checkpoint_and_prepare(spec)
    ours = cpu_layers.build_layer(spec)
    ptrs = {n: p.data_ptr() for n, p in ours.named_parameters()}
    cpu_layers.load_checkpoint(ours, ck, spec.num_experts)
    ours.quant_method.process_weights_after_loading(ours)
    assert layer_state.state_of(ours).clean
    assert {n: p.data_ptr() for n, p in ours.named_parameters()} == ptrs
    for n, k in zip(
        BLOCK_WEIGHTS, ("gemm1_weights", "gemm1_weights_scale", "gemm2_weights", "gemm2_weights_scale"), strict=True
    ):
        assert torch.equal(as_bytes(getattr(ours, n)), as_bytes(fi[k])), f"{n} differs from flashinfer's {k}"
    upstream = loaded_layer(spec, ck=ck)
    upstream_process_weights_after_loading(upstream.quant_method, upstream, monkeypatch)
    for n in BLOCK_WEIGHTS:
        assert torch.equal(as_bytes(getattr(ours, n)), as_bytes(getattr(upstream, n))), n
    # SGLang's apply reads these optional SwiGLU tensors off the layer (None = plain SwiGLU)
    if features.FP8_TRTLLM_ACTIVATION_PARAMS.present():
        assert ours._flashinfer_trtllm_gemm1_alpha is None and ours._flashinfer_trtllm_gemm1_clamp_limit is None


def test_modelopt_unequal_scales_ours_lossless_upstream_requant_is_not():
    """Measured: with s_w1 != s_w3, SGLang re-quantizes the smaller-scale half to the larger scale. The plugin keeps
    the checkpoint bytes and hands the kernel separate gate/up scalars, so its dequantized GEMM1 is exact."""
    from flashinfer.fused_moe.core import _maybe_get_cached_w3_w1_permute_indices

    spec = MoeSpec(intermediate=128, fmt="fp8_modelopt")
    ck = cpu_layers.random_fp8_checkpoint(spec)
    ours = prepared(spec)
    upstream = loaded_layer(spec)
    mp = pytest.MonkeyPatch()
    try:
        upstream_process_weights_after_loading(upstream.quant_method, upstream, mp)
    finally:
        mp.undo()
    E, inter = spec.num_experts, spec.intermediate
    idx = _maybe_get_cached_w3_w1_permute_indices({}, ours.w13_weight.data[0].view(torch.uint8), 128)

    def logical(w):  # flashinfer's own permute indices undone: [up; gate] rows
        out = torch.empty_like(w)
        out[:, idx] = w
        return out.float()

    a1 = ours.w13_input_scale_max.data
    ours_l, up_l = logical(ours.w13_weight.data), logical(upstream.w13_weight.data)
    s_up_ours = (ours.output1_scales_scalar.data * ours.output2_scales_scalar.data / ours.w2_weight_scale.data) / a1
    s_gate_ours = ours.output1_scales_gate_scalar.data / a1
    s_max = upstream.output1_scales_gate_scalar.data / upstream.w13_input_scale.data
    err_ours = err_up = 0.0
    for e in range(E):
        ref_up = ck[f"experts.{e}.{UP}.weight"].float() * ck[f"experts.{e}.{UP}.weight_scale"]
        ref_gate = ck[f"experts.{e}.{GATE}.weight"].float() * ck[f"experts.{e}.{GATE}.weight_scale"]
        ref = torch.cat([ref_up, ref_gate])
        mine = torch.cat([ours_l[e, :inter] * s_up_ours[e], ours_l[e, inter:] * s_gate_ours[e]])
        theirs = up_l[e] * s_max[e]
        err_ours = max(err_ours, float((mine - ref).norm() / ref.norm()))
        err_up = max(err_up, float((theirs - ref).norm() / ref.norm()))
    assert err_ours < 1e-6, err_ours
    assert err_up > 0.005, err_up  # measured 1.6 % (worst expert): the smaller-scale half re-rounded to a coarser grid


# ---- (b) forward through SGLang's own layer with the emulator ----------------------------------------------------


def _forward(layer, x, logits, bypass):
    return sglang_runtime.forward(layer, x, logits, bypass)[0]


def _dequant(ck, name, fmt):
    w = ck[name + "weight"].float()
    if fmt != "fp8_block":
        return w * ck[name + "weight_scale"]
    s = ck[name + "weight_scale_inv"].repeat_interleave(128, 0).repeat_interleave(128, 1)
    return w * s[: w.shape[0], : w.shape[1]]


def reference_moe(x, logits, ck, spec):
    """Float MoE from the checkpoint (renormalized softmax top-2), all experts for all tokens, then gathered."""
    x = x.float()
    p = torch.softmax(logits.float(), dim=-1)
    w, ids = p.topk(2, dim=-1)
    w = w / w.sum(-1, keepdim=True)
    ys = []
    for e in range(spec.num_experts):
        base = f"experts.{e}."
        u = x @ _dequant(ck, base + UP + ".", spec.fmt).t()
        h = (
            torch.nn.functional.silu(x @ _dequant(ck, base + GATE + ".", spec.fmt).t()) * u
            if spec.gated
            else torch.relu(u) ** 2
        )
        ys.append(h @ _dequant(ck, base + DOWN + ".", spec.fmt).t())
    y = torch.stack(ys)  # [E, T, H]
    t = torch.arange(x.shape[0])
    return sum(w[:, k, None] * y[ids[:, k], t] for k in range(2))


# ModelOptFp8MoEMethod's trtllm apply refuses materialized top-k (SGLang raises), so it runs from logits only.
FORWARD = [
    pytest.param(p.values[0], bypass, id=f"{p.id}-{'logits' if bypass else 'routed'}")
    for p in PER_TENSOR + BLOCK
    for bypass in (True, False)
    if bypass or p.values[0].fmt != "fp8_modelopt"
]


@pytest.mark.parametrize("spec, bypass", FORWARD)
def test_forward_through_sglang_layer_with_emulator_matches_dequantized_reference(spec, bypass, monkeypatch):
    monkeypatch.setenv("SGLANG_TRTLLM_MOE_EMULATE", "1")
    layer = prepared(spec)
    ck = cpu_layers.random_fp8_checkpoint(spec)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(8, spec.hidden, generator=g).to(torch.bfloat16)
    logits = torch.randn(8, spec.num_experts, generator=g).to(torch.bfloat16).float()  # same routing in bf16/fp32
    out = _forward(layer, x, logits, bypass)
    ref = reference_moe(x, logits, ck, spec)
    # The kernel re-quantizes to e4m3 (3 mantissa bits: <= 6.25 % per element, ~2-3 % rms) the activations and the
    # GEMM1 output (per tensor with the static scales, or per 1x128 block; the DeepSeek path also writes GEMM1 itself
    # in e4m3), against a float reference from the same dequantized weights. Measured: per-tensor 3.8-5.6 %, block
    # 6.2-6.5 %; a wrong layout (other half / other rows) gives ~100 %.
    rel = float((out.float() - ref).norm() / ref.norm())
    assert rel < 0.1, rel
    # The same check fails on bytes not in kernel layout: per-tensor, w13 back in checkpoint layout; block, the
    # [gate; up] order SGLang's loader would have left without its w1/w3 swap.
    fmt = layer_state.state_of(layer).fmt
    if spec.fmt == "fp8_block":
        for n in ("w13_weight", "w13_weight_scale_inv"):
            t = getattr(layer, n).data
            t.copy_(torch.cat(t.chunk(2, dim=1)[::-1], dim=1))
    else:
        fmt.unprepare_(layer, "w13", list(range(spec.num_experts)))
    bad = _forward(layer, x, logits, bypass)
    assert float((bad.float() - ref).norm() / ref.norm()) > 0.5


# ---- (e) real kernel --------------------------------------------------------------------------------------------


@pytest.mark.requires_sm100
@pytest.mark.parametrize(
    "spec",
    [
        pytest.param(MoeSpec(intermediate=96, fmt="fp8_modelopt"), id="fp8_modelopt-gated-I96"),
        pytest.param(
            MoeSpec(intermediate=200, activation="relu2", gated=False, fmt="fp8_tensor"), id="fp8_tensor-relu2-I200"
        ),
        pytest.param(MoeSpec(intermediate=96, fmt="fp8_block"), id="fp8_block-gated-I96"),
    ],
)
def test_real_kernel_matches_emulator_on_the_same_prepared_bytes(spec, monkeypatch):
    layer = prepared(spec).to("cuda")
    g = torch.Generator().manual_seed(1)
    x = torch.randn(32, spec.hidden, generator=g).to(torch.bfloat16).cuda()
    logits = torch.randn(32, spec.num_experts, generator=g).to(torch.bfloat16).float().cuda()
    monkeypatch.delenv("SGLANG_TRTLLM_MOE_EMULATE", raising=False)
    real = _forward(layer, x, logits, bypass=True).float()
    monkeypatch.setenv("SGLANG_TRTLLM_MOE_EMULATE", "1")
    emu = _forward(layer, x, logits, bypass=True).float()
    assert float((real - emu).norm() / emu.norm()) < 0.03
