"""Quantizers against flashinfer's own CPU-capable pure-torch code (bit for bit where it exists).

Oracles nobody here wrote:
* `flashinfer.quantization.fp4_quantization._e2m1_and_ufp8sf_scale_to_float_cpu` (NVFP4 dequant, linear SF,
  e4m3 = type 1)
* `flashinfer.fused_moe.prepare._quantize_mxfp4_linear` (e2m1 code selection + packing; ties round *down* there)
* `flashinfer.fused_moe.prepare._deepseek_fp8_quantize_weights` / `_deepseek_fp8_quantize_activations` (DeepSeek FP8)
* `flashinfer.fused_moe.prepare.prepare_trtllm_fp8_per_tensor_activations` (per-tensor e4m3 cast)
"""

import flashinfer.fused_moe.prepare as prep
import flashinfer.quantization.fp4_quantization as fp4q
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sglang_trtllm_moe import quant

GRID = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6], dtype=torch.float32)


def test_lut_matches_flashinfer_table():
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(1, 256)
    ours = quant.e2m1_to_float(codes)
    lut = fp4q._E2M1_VALUES
    ref = torch.stack([lut[(codes & 0xF).long()], lut[(codes >> 4).long()]], dim=-1).flatten(-2)
    assert torch.equal(ours, ref)


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), rows=st.integers(1, 8), kb=st.integers(1, 6))
def test_float_to_e2m1_matches_flashinfer_mxfp4_codes_off_ties(seed, rows, kb):
    """Same codes and packing as flashinfer's torch MXFP4 quantizer, wherever the value is not an exact midpoint."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, 32 * kb, generator=g) * torch.exp2(torch.randint(-4, 5, (rows, 1), generator=g).float())
    packed_ref, scales_ref = prep._quantize_mxfp4_linear(w)
    scaled = w.reshape(rows, kb, 32) / torch.exp2(scales_ref.float() - 127).unsqueeze(-1)
    scaled = scaled.reshape(rows, 32 * kb)
    mids = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    tie = (scaled.abs().unsqueeze(-1) == mids).any(-1)
    ours = quant.float_to_e2m1(scaled)
    lo_eq = (ours & 0xF) == (packed_ref & 0xF)
    hi_eq = (ours >> 4) == (packed_ref >> 4)
    assert lo_eq[~tie[:, 0::2]].all() and hi_eq[~tie[:, 1::2]].all()


def test_float_to_e2m1_rounds_ties_to_even_and_saturates():
    x = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 7.0, 100.0, -0.75, -5.0, 0.1, -0.1, 0.0, 5.5, 2.6])
    expect = torch.tensor([0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6.0, 6.0, -1.0, -4.0, 0.0, -0.0, 0.0, 6.0, 3.0])
    got = quant.e2m1_to_float(quant.float_to_e2m1(x))
    assert torch.equal(got, expect)
    # low nibble = even element
    assert quant.float_to_e2m1(torch.tensor([6.0, 0.5])).item() == 0x17


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), rows=st.integers(1, 9), kb=st.integers(1, 8), gs_exp=st.integers(-6, 10))
def test_nvfp4_dequant_bit_exact_vs_flashinfer_cpu(seed, rows, kb, gs_exp):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(rows, 16 * kb, generator=g) * 3).to(torch.bfloat16)
    gs = torch.tensor(2.0**gs_exp * 1.37, dtype=torch.float32)
    packed, sf = quant.nvfp4_quantize(x, gs)
    assert packed.dtype == torch.uint8 and packed.shape == (rows, 8 * kb)
    assert sf.dtype == torch.float8_e4m3fn and sf.shape == (rows, kb)
    ours = quant.nvfp4_dequantize(packed, sf, gs)
    ref = fp4q._e2m1_and_ufp8sf_scale_to_float_cpu(packed, sf.view(torch.uint8), 1.0 / gs, 16, 1, False)
    assert torch.equal(ours, ref)


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), rows=st.integers(1, 9), kb=st.integers(1, 8))
def test_nvfp4_quantize_recipe_and_error_bound(seed, rows, kb):
    """SF = e4m3(gs * amax/6); each value is the nearest e2m1 grid point of x*gs/sf (within half a grid step)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, 16 * kb, generator=g) * torch.rand(rows, 1, generator=g) * 10
    amax = x.abs().amax()
    gs = torch.tensor(448.0 * 6.0, dtype=torch.float32) / amax
    packed, sf = quant.nvfp4_quantize(x, gs)
    blocks = x.reshape(rows, kb, 16)
    sf_expect = (gs * blocks.abs().amax(-1) / 6.0).to(torch.float8_e4m3fn)
    assert torch.equal(sf.view(torch.uint8), sf_expect.view(torch.uint8))
    scaled = (blocks * gs / sf.float().unsqueeze(-1)).reshape(rows, -1).clamp(-6, 6)
    vals = quant.e2m1_to_float(packed)
    # distance to the chosen grid point is the minimum distance over the grid (up to fp32 noise)
    best = (scaled.abs().unsqueeze(-1) - GRID).abs().min(-1).values
    assert ((vals.abs() - scaled.abs()).abs() <= best + 1e-5).all()
    assert ((vals == 0) | (torch.sign(vals) == torch.sign(scaled))).all()


def test_nvfp4_zero_block_and_device_neutral():
    x = torch.zeros(2, 32)
    x[1, 16:] = torch.linspace(-3, 3, 16)
    packed, sf = quant.nvfp4_quantize(x, 1.0)
    assert sf.float()[0].eq(0).all() and sf.float()[1, 0] == 0
    assert quant.nvfp4_dequantize(packed, sf, 1.0)[0].eq(0).all()
    assert packed.device == x.device


def test_fp8_per_tensor_matches_flashinfer_activation_prep():
    x = (torch.randn(7, 256, generator=torch.Generator().manual_seed(0)) * 5).to(torch.bfloat16)
    x[0, 0] = 1000.0  # saturates to 448 on both sides
    scale = 0.1  # dequant scale; flashinfer's argument is the multiplier 1/scale
    ours = quant.fp8_quantize(x, scale)
    ref, _ = prep.prepare_trtllm_fp8_per_tensor_activations(x, hidden_states_scale_global=1.0 / scale)
    # x/scale and x*(1/scale) may differ by one fp32 ulp before the e4m3 rounding: allow rare 1-code differences
    diff = (ours.view(torch.uint8).int() - ref.view(torch.uint8).int()).abs()
    assert diff.max() <= 1 and (diff > 0).float().mean() < 0.01
    back = quant.fp8_dequantize(ours, scale)
    assert back[0, 0] == torch.tensor(448 * scale, dtype=torch.float32)
    ok = (back - x.float()).abs() <= x.float().abs() * 2**-4 + scale * 2**-10
    assert ok.flatten()[1:].all()


def test_fp8_block_quantize_bit_exact_vs_flashinfer_deepseek_weights():
    g = torch.Generator().manual_seed(1)
    w = (torch.randn(3, 256, 384, generator=g) * torch.rand(3, 256, 1, generator=g) * 4).to(torch.bfloat16)
    q, s = quant.fp8_block_quantize(w)
    q_ref, s_ref = prep._deepseek_fp8_quantize_weights(w)
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))
    assert torch.equal(s, s_ref)
    assert s.shape == (3, 2, 3)
    # e4m3: 3 mantissa bits (relative error <= 2^-4), subnormal step 2^-9 of the block scale
    back = quant.fp8_block_dequantize(q, s)
    s_full = s.repeat_interleave(128, -2).repeat_interleave(128, -1)
    assert ((back - w.float()).abs() <= w.float().abs() * 2**-4 + s_full * 2**-10).all()


def test_fp8_group_quantize_bit_exact_vs_flashinfer_deepseek_activations():
    x = (torch.randn(11, 512, generator=torch.Generator().manual_seed(2)) * 3).to(torch.bfloat16)
    q, s = quant.fp8_group_quantize(x)
    q_ref, s_ref = prep._deepseek_fp8_quantize_activations(x)
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))
    assert torch.equal(s.t().contiguous(), s_ref)  # the kernel takes [H/128, T]
    back = quant.fp8_group_dequantize(q, s)
    assert ((back - x.float()).abs() <= x.float().abs() * 2**-4 + s.repeat_interleave(128, -1) * 2**-10).all()


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), e=st.integers(-20, 20))
def test_mxfp8_scale_is_smallest_power_of_two_that_fits(seed, e):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(4, 64, generator=g) * 2.0**e
    x[0, :32] = 448.0 * 2.0**e  # exact power-of-two boundary: must not round up
    q, sf = quant.mxfp8_quantize(x)
    scale = quant.ue8m0_to_float(sf)
    amax = x.abs().reshape(4, 2, 32).amax(-1)
    assert (amax <= 448 * scale).all() and (amax > 224 * scale).all()
    assert scale[0, 0] == 2.0**e
    back = quant.mxfp8_dequantize(q, sf)
    s_full = scale.repeat_interleave(32, -1)
    assert ((back - x).abs() <= x.abs() * 2**-4 + s_full * 2**-10).all()
