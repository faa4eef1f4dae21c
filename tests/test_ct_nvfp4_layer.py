"""Compressed-tensors NVFP4 FusedMoE layers (`CompressedTensorsW4A4Nvfp4MoE`, built from a config dict by SGLang's
own CompressedTensorsConfig) on CPU, prepared in place by the plugin.

Oracles: SGLang 0.5.23's own trtllm preparation of this scheme (`process_weights_after_loading.__wrapped__`, with
flashinfer's CUDA-only scale interleave replaced by SGLang's pure-torch `swizzle_blockscale`, as
tests/support/sglang_runtime.py does), SGLang's `prepare_static_weights_for_trtllm_fp4_moe` where the scheme itself
cannot serve the layer (non-gated), and a float MoE from flashinfer's own CPU NVFP4 dequant
(tests/support/moe_reference.py).
The scenarios every format shares (updates, refusals, the checker, threads, ...): tests/test_layer_contract.py.
"""

from __future__ import annotations

import pytest
import torch

from sglang_trtllm_moe import layer_state
from sglang_trtllm_moe.sandbox import layers as cpu_layers

from .support import sglang_runtime

CASES = [
    pytest.param(cpu_layers.MoeSpec(intermediate=128, fmt="ct_nvfp4"), id="gated-I128"),
    pytest.param(cpu_layers.MoeSpec(intermediate=96, fmt="ct_nvfp4"), id="gated-I96-padded"),
    pytest.param(
        cpu_layers.MoeSpec(intermediate=128, activation="relu2", gated=False, fmt="ct_nvfp4"), id="relu2-I128"
    ),
    # NVFP4 needs I % 16 == 0, so the padded non-gated case is I = 208 -> 256.
    pytest.param(
        cpu_layers.MoeSpec(intermediate=208, activation="relu2", gated=False, fmt="ct_nvfp4"), id="relu2-I208-padded"
    ),
]
PREPARED = ("w13_weight", "w13_weight_scale", "w2_weight", "w2_weight_scale")
SCALARS = ("g1_alphas", "g2_alphas", "g1_scale_c", "w13_input_scale_quant", "w2_input_scale_quant")


@pytest.fixture(scope="module", autouse=True)
def runtime():
    sglang_runtime.ensure("flashinfer_trtllm")


def ckpt(spec, seed=0, **kw):
    return cpu_layers.random_ct_nvfp4_checkpoint(spec, seed=seed, **kw)


def loaded_layer(spec, tensors):
    layer = cpu_layers.build_layer(spec)
    cpu_layers.load_checkpoint(layer, tensors, spec.num_experts)
    return layer


def as_bytes(t):
    return t.detach().contiguous().view(torch.uint8).reshape(-1)


def _interleave_on_cpu(monkeypatch):
    import flashinfer
    from sglang.srt.layers.quantization.utils import swizzle_blockscale

    monkeypatch.setattr(
        flashinfer,
        "nvfp4_block_scale_interleave",
        lambda x: swizzle_blockscale(x.view(torch.float8_e4m3fn)).view(torch.uint8).reshape(-1),
    )


def upstream_prep(layer, monkeypatch):
    from sglang.srt.layers.quantization.compressed_tensors.schemes.compressed_tensors_w4a4_nvfp4_moe import (
        CompressedTensorsW4A4Nvfp4MoE,
    )

    _interleave_on_cpu(monkeypatch)
    original = CompressedTensorsW4A4Nvfp4MoE.process_weights_after_loading
    while hasattr(original, "__wrapped__"):
        original = original.__wrapped__
    original(layer.scheme, layer)


@pytest.mark.parametrize("spec", CASES)
def test_prepared_bytes_equal_sglang_own_preparation_in_place(spec, monkeypatch):
    tensors = ckpt(spec)
    ours = loaded_layer(spec, tensors)
    before = {n: (p, p.data_ptr(), tuple(p.shape)) for n, p in ours.named_parameters()}
    ours.quant_method.process_weights_after_loading(ours)
    assert layer_state.state_of(ours) is not None and layer_state.state_of(ours).clean, "the plugin did not take over"
    for n, (obj, ptr, shape) in before.items():  # same Parameter objects, storage and shapes
        p = getattr(ours, n)
        assert p is obj and p.data_ptr() == ptr and tuple(p.shape) == shape, n
    # SGLang's apply reads w13_weight / w2_weight: aliases of the loaded Parameters, not copies
    assert ours.w13_weight is ours.w13_weight_packed and ours.w2_weight is ours.w2_weight_packed

    upstream = loaded_layer(spec, tensors)
    if spec.gated:
        loaded_storage = upstream.w13_weight_packed.data  # held, so its address cannot be handed out again
        upstream_prep(upstream, monkeypatch)
        # upstream: reorder_w1w3_to_w3w1 allocates, then replace_parameter rebinds; the loaded name is deleted
        assert upstream.w13_weight.data_ptr() != loaded_storage.data_ptr()
        assert not hasattr(upstream, "w13_weight_packed")
        for n in SCALARS:
            assert torch.equal(getattr(ours, n).data, getattr(upstream, n).data.reshape(-1)), n
        expected = {n: getattr(upstream, n) for n in PREPARED}
    else:
        # SGLang's scheme cannot serve non-gated layers (it allocates 2*I GEMM1 rows and prepares them as gated;
        # with the kernel-shaped [E, I, ...] GEMM1 the plugin allocates, its own prep fails on the reshape). The
        # bytes oracle is SGLang's preparation function applied, non-gated, to the same loaded checkpoint bytes.
        from sglang.srt.layers.quantization.utils import prepare_static_weights_for_trtllm_fp4_moe

        _interleave_on_cpu(monkeypatch)
        ip = upstream.w2_weight_packed.shape[2] * 2
        out = prepare_static_weights_for_trtllm_fp4_moe(
            upstream.w13_weight_packed.data,
            upstream.w2_weight_packed.data,
            upstream.w13_weight_scale.data,
            upstream.w2_weight_scale.data,
            spec.hidden,
            ip,
            spec.num_experts,
            is_gated=False,
        )
        expected = dict(zip(PREPARED, out, strict=True))
        # scalars from the checkpoint: a1/a2 = 1/min(input_global_scale), alpha = a * 1/weight_global_scale,
        # and for relu2 the GEMM1 output only needs the 1/a2 re-quantization factor (as ModelOpt on SGLang)
        a1 = 1 / min(float(v) for k, v in tensors.items() if k.endswith("up_proj.input_global_scale"))
        a2 = 1 / min(float(v) for k, v in tensors.items() if k.endswith("down_proj.input_global_scale"))
        for e in range(spec.num_experts):
            wgs = float(tensors[f"experts.{e}.up_proj.weight_global_scale"])
            torch.testing.assert_close(float(ours.g1_alphas[e]), a1 / wgs, rtol=1e-6, atol=0)
            torch.testing.assert_close(float(ours.g1_scale_c[e]), 1 / a2, rtol=1e-6, atol=0)
    for n in PREPARED:
        assert getattr(ours, n).shape == expected[n].shape, n
        assert torch.equal(as_bytes(getattr(ours, n)), as_bytes(expected[n])), f"{n} differs from SGLang's preparation"


def test_non_gated_gemm1_is_allocated_at_kernel_shape():
    spec = cpu_layers.MoeSpec(intermediate=208, activation="relu2", gated=False, fmt="ct_nvfp4")
    layer = cpu_layers.build_layer(spec)
    assert tuple(layer.w13_weight_packed.shape) == (8, 256, 128)  # SGLang alone: (8, 512, 128)
    assert tuple(layer.w13_weight_scale.shape) == (8, 256, 16)
    assert layer.w13_weight_packed.weight_loader == layer.weight_loader  # SGLang's attributes kept


def modelopt_names(tensors):
    """The same checkpoint under ModelOpt's names and scale convention, for tests/support/moe_reference.py."""
    out = {}
    for k, v in tensors.items():
        if k.endswith("weight_packed"):
            out[k[: -len("_packed")]] = v
        elif k.endswith("weight_scale"):
            out[k] = v
        elif k.endswith("weight_global_scale"):
            out[k.replace("weight_global_scale", "weight_scale_2")] = 1 / v
        elif k.endswith("input_global_scale"):
            out[k.replace("input_global_scale", "input_scale")] = 1 / v
    return out


_forward = sglang_runtime.forward


def rel(a, b):
    return float((a.float() - b).norm() / b.norm())


def _inputs(spec):
    g = torch.Generator().manual_seed(1)
    return torch.randn(6, spec.hidden, generator=g).to(torch.bfloat16), torch.randn(6, spec.num_experts, generator=g)


@pytest.mark.parametrize("spec", CASES)
def test_forward_through_sglang_layer_with_emulator_matches_dequantized_reference(spec, monkeypatch):
    from .support.moe_reference import reference_moe

    monkeypatch.setenv("SGLANG_TRTLLM_MOE_EMULATE", "1")
    tensors = ckpt(spec)
    layer = loaded_layer(spec, tensors)
    layer.quant_method.process_weights_after_loading(layer)
    x, logits = _inputs(spec)
    out, topk = _forward(layer, x, logits)
    ref = reference_moe(x, topk.topk_ids, topk.topk_weights, modelopt_names(tensors), spec)
    # The kernel quantizes the activations and the GEMM1 output to NVFP4 (e2m1: 1 mantissa bit, ~12 % worst case
    # per element): ~10 % of the output norm against a float reference; a wrong layout or scale gives ~100 %.
    assert rel(out, ref) < 0.2, rel(out, ref)
    layer_state.state_of(layer).fmt.unprepare_(layer, "w13", list(range(spec.num_experts)))
    bad, _ = _forward(layer, x, logits)
    assert rel(bad, ref) > 0.5


def test_different_gate_and_up_global_scales_are_kept(monkeypatch):
    """SGLang uses the gate's global scale for both halves (warning "Accuracy may be affected"); the kernel takes
    the up scale separately (output1_scale_scalar), so the plugin does not lose it. Up weights quantized with a
    global scale 4x the gate's: ours matches the reference, SGLang's own prep (same emulator) does not."""
    from .support.moe_reference import reference_moe

    monkeypatch.setenv("SGLANG_TRTLLM_MOE_EMULATE", "1")
    spec = cpu_layers.MoeSpec(intermediate=128, fmt="ct_nvfp4")
    tensors = ckpt(spec)
    for k in list(tensors):
        if ".up_proj.weight_global_scale" in k:
            tensors[k] = tensors[k] * 4  # same codes, values / 4: still a valid checkpoint
    x, logits = _inputs(spec)
    ours = loaded_layer(spec, tensors)
    ours.quant_method.process_weights_after_loading(ours)
    out, topk = _forward(ours, x, logits)
    ref = reference_moe(x, topk.topk_ids, topk.topk_weights, modelopt_names(tensors), spec)
    assert rel(out, ref) < 0.2
    upstream = loaded_layer(spec, tensors)
    upstream_prep(upstream, monkeypatch)
    up_out, _ = _forward(upstream, x, logits)
    assert rel(up_out, ref) > 1.0  # up half 4x too large


@pytest.mark.requires_sm100
@pytest.mark.parametrize("spec", CASES)
def test_real_kernel_matches_emulator_on_sm100(spec, monkeypatch):
    import sglang_trtllm_moe.runner as runner

    layer = loaded_layer(spec, ckpt(spec))
    layer.quant_method.process_weights_after_loading(layer)
    layer.to("cuda")
    x, logits = _inputs(spec)
    x, logits = x.cuda(), logits.cuda()
    monkeypatch.delenv("SGLANG_TRTLLM_MOE_EMULATE", raising=False)
    kernel, _ = _forward(layer, x, logits)
    monkeypatch.setattr(runner, "emulating", lambda: True)
    emulated, _ = _forward(layer, x, logits)
    # both re-quantize the intermediate to NVFP4; rounding differences in the fused epilogue stay at FP4 level
    assert rel(kernel, emulated.float()) < 0.1
