"""Pure-torch quantizers and dequantizers for the formats the TRT-LLM-Gen MoE kernels consume.

Why this exists: flashinfer's quantizers (`fp4_quantize`, `mxfp8_quantize`, ...) need a CUDA device and a JIT build,
so nothing on a CPU test machine (or on a non-Blackwell GPU) can produce NVFP4/MXFP8 bytes with them. The tests, the
emulator, the weight checker and the demo all need the same bytes the real quantizers would write, so this module
reproduces the kernels' conventions in plain torch, on whatever device the input lives on.

Conventions (all checked against flashinfer's own sources, see the per-function notes):
* e2m1 packing: two FP4 codes per byte, **low nibble = even element** (flashinfer `_E2M1_VALUES` /
  `_e2m1_and_ufp8sf_scale_to_float_cpu`). Code = sign bit 3 | magnitude index into [0, .5, 1, 1.5, 2, 3, 4, 6].
* "global_scale" of NVFP4 is the *quantization* multiplier (flashinfer `fp4_quantize(x, global_scale)`,
  typically 448*6/amax, or 1/a1 in SGLang); dequantization multiplies by its reciprocal.
* FP8 per-tensor `scale` is the *dequantization* scale (SGLang convention: x ~= q * scale).
* Block-FP8 (DeepSeek) scales are dequantization scales (`scale_inv` in checkpoints): x ~= q * s.
"""

from __future__ import annotations

import torch

E2M1_MAX = 6.0
FP8_E4M3_MAX = 448.0
NVFP4_BLOCK = 16
MXFP8_BLOCK = 32
FP8_BLOCK = 128

# Magnitudes of the 8 non-negative e2m1 codes, and the midpoints between neighbours.
_E2M1_GRID = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
_E2M1_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)

ScaleLike = float | torch.Tensor

# Constants are made on the device by fill kernels (`torch.full`), never with `torch.tensor(python data, device=...)`:
# that is a host->device copy, which CUDA-graph capture refuses, and the emulator's forward quantizes through this
# module under capture. A fill rounds the Python float to float32 exactly as `torch.tensor(..., float32)` does.
# Nothing made here is cached: a tensor first made inside capture holds its values only in the graph's replays.


def _f32(value: float, device: torch.device) -> torch.Tensor:
    return torch.full((), value, dtype=torch.float32, device=device)


def _f32_table(values: tuple[float, ...], device: torch.device) -> torch.Tensor:
    return torch.stack([_f32(v, device) for v in values])


def _as_f32_scalar(s: ScaleLike, device: torch.device) -> torch.Tensor:
    """A scalar scale as a 0-d float32 tensor on `device` (kept on device: no host sync)."""
    t = s.to(device=device, dtype=torch.float32) if isinstance(s, torch.Tensor) else _f32(s, device)
    if t.numel() != 1:
        raise ValueError(f"expected one scale value, got shape {tuple(t.shape)}")
    return t.reshape(())


def _fp8_max(device: torch.device) -> torch.Tensor:
    """448 as a tensor: torch's CUDA `tensor / python_scalar` multiplies by the reciprocal (1 ulp off true division,
    which is what CPU torch and the kernels' `aMax / E4m3MaxVal` compute); tensor / tensor divides on both."""
    return _f32(FP8_E4M3_MAX, device)


def _lut(device: torch.device) -> torch.Tensor:
    grid = _f32_table(_E2M1_GRID, device)
    return torch.cat([grid, -grid])


# ----------------------------------------------------------------------------------------------------------------
# e2m1 (FP4)
# ----------------------------------------------------------------------------------------------------------------


def e2m1_to_float(packed: torch.Tensor) -> torch.Tensor:
    """Unpack uint8 `[..., K/2]` (two e2m1 codes per byte, low nibble first) to float32 `[..., K]`."""
    if packed.dtype != torch.uint8:
        packed = packed.view(torch.uint8)
    lo = packed & 0x0F
    hi = packed >> 4
    codes = torch.stack([lo, hi], dim=-1).flatten(-2)
    return _lut(packed.device)[codes.long()]


def float_to_e2m1(x: torch.Tensor) -> torch.Tensor:
    """Round float `[..., K]` (K even) to e2m1 and pack to uint8 `[..., K/2]`, low nibble = even element.

    Rounding is round-to-nearest-even with saturation to +-6, which is what the hardware `cvt.rn.satfinite.e2m1x2.f32`
    used by TRT-LLM's quantizer does. Note: flashinfer's pure-torch MXFP4 helper (`prepare._quantize_mxfp4_linear`)
    and SGLang's KV-FP4 helper round exact midpoints *down* (bucketize); they agree with this function everywhere else.
    The sign bit is set for x < 0 (so -0.0 encodes as +0), like both of those helpers.
    """
    if x.shape[-1] % 2:
        raise ValueError(f"e2m1 packing needs an even last dim, got {tuple(x.shape)}")
    xf = x.float()
    a = xf.abs()
    bounds = _f32_table(_E2M1_MIDPOINTS, x.device)
    idx = torch.bucketize(a, bounds, right=False)  # a == bound -> lower index
    # Ties (a exactly on a midpoint) go to the even index (mantissa bit 0): lower index is odd -> step up.
    on_bound = (idx < len(_E2M1_MIDPOINTS)) & (a == bounds[idx.clamp(max=len(_E2M1_MIDPOINTS) - 1)])
    idx = torch.where(on_bound & (idx % 2 == 1), idx + 1, idx)
    idx = torch.where(torch.isnan(a), torch.zeros_like(idx), idx)  # NaN -> 0 (never produced by our callers)
    codes = (idx | ((xf < 0).long() << 3)).to(torch.uint8)
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


# ----------------------------------------------------------------------------------------------------------------
# NVFP4: e2m1 values, e4m3 scale per 16 elements, fp32 global scale
# ----------------------------------------------------------------------------------------------------------------


def nvfp4_quantize(
    x: torch.Tensor, global_scale: ScaleLike, block: int = NVFP4_BLOCK
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize `[..., K]` to NVFP4: (packed uint8 `[..., K/2]`, linear SF float8_e4m3fn `[..., K/16]`).

    Follows TRT-LLM's `cvt_warp_fp16_to_fp4` (quantization_utils.cuh, default fast-math branch):
        sf_f   = global_scale * (amax * rcp(6))
        sf     = e4m3(sf_f)                          (round-to-nearest, saturating)
        oscale = rcp(float(sf) * rcp(global_scale))  (0 when amax == 0)
        q      = e2m1_rn(x * oscale)
    Remaining difference: the kernel uses `rcp.approx.ftz.f32` (max 1 ulp error, flushes denormals), we use exact
    fp32 reciprocals; the kernel's amax comes from bf16/fp16 inputs, ours from whatever dtype is given. The result
    can therefore differ in rare e2m1 codes that sit within 1 ulp of a rounding midpoint, never in the SF unless
    sf_f itself sits on an e4m3 midpoint within 1 ulp.
    """
    K = x.shape[-1]
    if K % block:
        raise ValueError(f"last dim {K} is not a multiple of the NVFP4 block {block}")
    gs = _as_f32_scalar(global_scale, x.device)
    xb = x.float().reshape(*x.shape[:-1], K // block, block)
    amax = xb.abs().amax(dim=-1, keepdim=True)
    rcp6 = _f32(1.0 / 6.0, x.device)  # fp32(1/6), what rcp.approx(6) gives
    sf_f = gs * (amax * rcp6)
    sf = sf_f.clamp(max=FP8_E4M3_MAX).to(torch.float8_e4m3fn)
    denom = sf.float() * (1.0 / gs)
    oscale = torch.where(amax != 0, 1.0 / denom, torch.zeros_like(denom))
    scaled = xb * oscale
    scaled = torch.nan_to_num(scaled, nan=0.0)  # amax != 0 but sf underflowed to 0: values are 0 * inf
    packed = float_to_e2m1(scaled.reshape(x.shape))
    return packed, sf.reshape(*x.shape[:-1], K // block)


def nvfp4_quantize_4over6(
    x: torch.Tensor, global_scale: ScaleLike, err_mode: str = "MSE", block: int = NVFP4_BLOCK
) -> tuple[torch.Tensor, torch.Tensor]:
    """NVFP4 "4over6" of `[..., K]`: per block of 16, the candidate of block scale amax/6 and the one of 1.5x that
    (the block's amax lands on e2m1 4 instead of 6), whichever errs less. flashinfer's cute-dsl recipe as SGLang
    0.5.23's online weight quantizer calls it (`NVFP44Over6Config(448, err_mode, err_use_fast_math=True)` under
    FLASHINFER_DISABLE_FP4_QUANT_FAST_MATH=1; `_nvfp4_4over6_quant_from_values`, quantization_cute_dsl_utils.py):
        sf6 = rn(rn(amax / 6) * gs), sf4 = rn(sf6 * 1.5), scale_c = e4m3(sf_c)   (satfinite)
        q_c = e2m1_rn(x * min(1 / (scale_c * (1 / gs)), FLT_MAX))
        err_c = sum_i (q_c[i] * scale_c - x[i] * gs)^2 (MSE; |.| for MAE), in element order, fp32
    and the 4-candidate is taken when err4 < err6 (strictly). The fp16 products of the candidates' decode are exact
    (e2m1 x e4m3 has at most 6 significant bits). Returns (packed uint8 `[..., K/2]`, linear e4m3 `[..., K/16]`)."""
    K = x.shape[-1]
    if K % block:
        raise ValueError(f"last dim {K} is not a multiple of the NVFP4 block {block}")
    if err_mode not in ("MSE", "MAE"):
        raise ValueError(f"4over6 error mode {err_mode!r}: MSE or MAE")
    gs = _as_f32_scalar(global_scale, x.device)
    xb = x.float().reshape(*x.shape[:-1], K // block, block)
    amax = xb.abs().amax(dim=-1, keepdim=True)
    sf6_f = (amax / _f32(6.0, x.device)) * gs
    sf4_f = sf6_f * _f32(1.5, x.device)
    decode = _f32(1.0, x.device) / gs
    original = xb * gs

    def candidate(sf_f: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        sf = sf_f.clamp(max=FP8_E4M3_MAX).to(torch.float8_e4m3fn)
        oscale = torch.clamp(_f32(1.0, x.device) / (sf.float() * decode), max=torch.finfo(torch.float32).max)
        codes = float_to_e2m1((xb * oscale).reshape(x.shape)).reshape(*xb.shape[:-1], block // 2)
        diff = e2m1_to_float(codes) * sf.float() - original
        terms = diff * diff if err_mode == "MSE" else diff.abs()
        err = terms[..., 0]
        for i in range(1, block):  # fp32 adds in element order, as the kernel accumulates
            err = err + terms[..., i]
        return codes, sf.float(), err

    codes6, sf6, err6 = candidate(sf6_f)
    codes4, sf4, err4 = candidate(sf4_f)
    take4 = (err4 < err6).unsqueeze(-1)  # the 4 candidate replaces the 6 one only when strictly better
    zero = amax == 0
    best_codes = torch.where(zero, torch.zeros_like(codes6), torch.where(take4, codes4, codes6))
    best_sf = torch.where(zero, torch.zeros_like(sf6), torch.where(take4, sf4, sf6))
    return best_codes.reshape(*x.shape[:-1], K // 2), best_sf.to(torch.float8_e4m3fn).reshape(*x.shape[:-1], K // block)


def nvfp4_quantize_per_token(
    x: torch.Tensor, global_scale_inv: ScaleLike = 1.0 / (FP8_E4M3_MAX * E2M1_MAX), block: int = NVFP4_BLOCK
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-token NVFP4 of `[T, K]` (flashinfer `nvfp4_quantize(..., per_token_activation=True)`, cute-dsl, default
    fast math): per row, per_token_scale = amax * global_scale_inv and the row quantized with global scale
    1 / per_token_scale (`_row_scales`, nvfp4_quantize.py); a zero row gives scale 0 and zero codes. Returns
    (packed uint8 `[T, K/2]`, linear e4m3 `[T, K/16]`, per_token_scale float32 `[T]`): x ~= dequant * scale[t]."""
    inv = _as_f32_scalar(global_scale_inv, x.device)
    amax = x.float().abs().amax(dim=-1)
    pts = amax * inv
    enc = torch.where(pts != 0, _f32(1.0, x.device) / pts, torch.zeros_like(pts))
    K = x.shape[-1]
    xb = x.float().reshape(x.shape[0], K // block, block)
    bmax = xb.abs().amax(dim=-1, keepdim=True)
    gs = enc.reshape(-1, 1, 1)
    sf = (gs * (bmax * _f32(1.0 / 6.0, x.device))).clamp(max=FP8_E4M3_MAX).to(torch.float8_e4m3fn)
    denom = sf.float() * torch.where(gs != 0, 1.0 / gs, torch.zeros_like(gs))
    oscale = torch.where((bmax != 0) & (denom != 0), 1.0 / denom, torch.zeros_like(denom))
    packed = float_to_e2m1(torch.nan_to_num(xb * oscale, nan=0.0).reshape(x.shape))
    return packed, sf.reshape(x.shape[0], K // block), pts


def nvfp4_dequantize(
    packed: torch.Tensor, sf: torch.Tensor, global_scale: ScaleLike = 1.0, block: int = NVFP4_BLOCK
) -> torch.Tensor:
    """NVFP4 `[..., K/2]` + linear e4m3 SF `[..., K/16]` -> float32 `[..., K]`, i.e. e2m1 * sf * (1/global_scale).

    The product order (value * sf) * (1/gs) is flashinfer's `_e2m1_and_ufp8sf_scale_to_float_cpu`, so the result is
    bit-identical to it when it is given `global_scale_tensor = 1/gs` (its argument is the dequantization scale).
    """
    vals = e2m1_to_float(packed)
    sf_f = sf.view(torch.float8_e4m3fn).float() if sf.dtype == torch.uint8 else sf.float()
    if sf_f.shape[-1] * block != vals.shape[-1]:
        raise ValueError(f"scale shape {tuple(sf.shape)} does not match {vals.shape[-1]} values per row")
    out = vals * sf_f.repeat_interleave(block, dim=-1)
    inv = 1.0 / _as_f32_scalar(global_scale, packed.device)
    return out * inv


# ----------------------------------------------------------------------------------------------------------------
# FP8 e4m3
# ----------------------------------------------------------------------------------------------------------------


def fp8_quantize(x: torch.Tensor, scale: ScaleLike) -> torch.Tensor:
    """Per-tensor FP8: e4m3(clamp(x / scale, +-448)); `scale` is the dequantization scale (x ~= q * scale)."""
    s = _as_f32_scalar(scale, x.device)
    return (x.float() / s).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)


def fp8_dequantize(q: torch.Tensor, scale: ScaleLike = 1.0) -> torch.Tensor:
    """Per-tensor FP8 back to float32: q * scale."""
    return q.float() * _as_f32_scalar(scale, q.device)


def fp8_block_quantize(w: torch.Tensor, block: int = FP8_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek 128x128 block FP8 of `[..., N, K]`: (e4m3 `[..., N, K]`, scale_inv float32 `[..., N/128, K/128]`).

    Scale = max(amax/448, 1e-12), q = e4m3(clamp(w / scale)), exactly flashinfer
    `prepare._deepseek_fp8_quantize_weights`
    (the TRT-LLM DeepSeek recipe uses plain fp32 scales, not DeepGEMM's power-of-two ue8m0 ones).
    """
    *lead, N, K = w.shape
    if N % block or K % block:
        raise ValueError(f"block FP8 needs N and K multiples of {block}, got {(N, K)}")
    b = w.float().reshape(*lead, N // block, block, K // block, block).transpose(-3, -2)
    scale = (b.abs().amax(dim=(-1, -2), keepdim=True) / _fp8_max(w.device)).clamp(min=1e-12)
    q = (b / scale).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).transpose(-3, -2).reshape(w.shape)
    return q.to(torch.float8_e4m3fn), scale[..., 0, 0].contiguous()


def fp8_block_dequantize(q: torch.Tensor, scale_inv: torch.Tensor, block: int = FP8_BLOCK) -> torch.Tensor:
    """Inverse of `fp8_block_quantize`: float32 `[..., N, K]`."""
    s = scale_inv.float().repeat_interleave(block, dim=-2).repeat_interleave(block, dim=-1)
    return q.float() * s


def fp8_group_quantize(
    x: torch.Tensor, group: int = FP8_BLOCK, min_scale: float = 1e-12
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token 1x`group` FP8 of `[..., K]`: (e4m3 `[..., K]`, scale float32 `[..., K/group]`), scale = amax/448.

    Same math as flashinfer `prepare._deepseek_fp8_quantize_activations` (which returns the scales transposed
    `[K/128, T]` for the kernel; transpose ours with `.t()` for a 2-D input). `min_scale` is 1e-12 there; the
    kernel's own activation re-quantization uses FLT_MIN (see `emulator`).
    """
    K = x.shape[-1]
    if K % group:
        raise ValueError(f"last dim {K} is not a multiple of the group {group}")
    b = x.float().reshape(*x.shape[:-1], K // group, group)
    scale = (b.abs().amax(dim=-1, keepdim=True) / _fp8_max(x.device)).clamp(min=min_scale)
    q = (b / scale).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).reshape(x.shape).to(torch.float8_e4m3fn)
    return q, scale.squeeze(-1)


def fp8_group_dequantize(q: torch.Tensor, scale: torch.Tensor, group: int = FP8_BLOCK) -> torch.Tensor:
    """Inverse of `fp8_group_quantize`: float32 `[..., K]`."""
    return q.float() * scale.float().repeat_interleave(group, dim=-1)


# ----------------------------------------------------------------------------------------------------------------
# MXFP8: e4m3 values, ue8m0 (power of two) scale per 32 elements
# ----------------------------------------------------------------------------------------------------------------


def mxfp8_quantize(x: torch.Tensor, block: int = MXFP8_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """MXFP8 of `[..., K]`: (e4m3 `[..., K]`, ue8m0 scale bytes uint8 `[..., K/32]`, linear layout).

    The exponent is rounded *up* (cudaRoundPosInf, like TRT-LLM's UE8M0 path) so amax/scale <= 448; an all-zero
    block gets byte 0 (2^-127) and encodes zeros.
    """
    K = x.shape[-1]
    if K % block:
        raise ValueError(f"last dim {K} is not a multiple of the MX block {block}")
    b = x.float().reshape(*x.shape[:-1], K // block, block)
    amax = b.abs().amax(dim=-1, keepdim=True)
    v = amax * _f32(1.0 / FP8_E4M3_MAX, x.device)  # kernel: amax * rcp(448)
    # ceil(log2(v)) exactly (torch.log2 can round 2^n*(1+eps) down to n): v = m * 2^ex with m in [0.5, 1).
    m, ex = torch.frexp(v)
    e = torch.where(m == 0.5, ex - 1, ex).float()
    e = torch.where(v > 0, e, torch.full_like(e, -127.0)).clamp(-127, 127)
    q = (b * torch.exp2(-e)).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).reshape(x.shape).to(torch.float8_e4m3fn)
    return q, (e.squeeze(-1) + 127).to(torch.uint8)


def ue8m0_to_float(sf: torch.Tensor) -> torch.Tensor:
    """ue8m0 bytes -> float32 powers of two (2^(byte-127))."""
    return torch.exp2(sf.view(torch.uint8).float() - 127.0)


def mxfp8_dequantize(q: torch.Tensor, sf: torch.Tensor, block: int = MXFP8_BLOCK) -> torch.Tensor:
    """Inverse of `mxfp8_quantize`: float32 `[..., K]`."""
    return q.float() * ue8m0_to_float(sf).repeat_interleave(block, dim=-1)


# ----------------------------------------------------------------------------------------------------------------
# MXFP4: e2m1 values, ue8m0 (power of two) scale per 32 elements (gpt-oss, DeepSeek-V4 routed experts)
# ----------------------------------------------------------------------------------------------------------------


def mxfp4_quantize(x: torch.Tensor, block: int = MXFP8_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """MXFP4 of `[..., K]`: (packed e2m1 uint8 `[..., K/2]`, low nibble = even element; ue8m0 bytes uint8
    `[..., K/32]`). Scale 2^ceil(log2(amax/6)) (no value saturates, like flashinfer's `fp4_quantize(...,
    sf_use_ue8m0=True)` with RoundPosInf), e2m1 round-to-nearest-even; an all-zero block gets byte 0."""
    K = x.shape[-1]
    if K % block:
        raise ValueError(f"last dim {K} is not a multiple of the MX block {block}")
    b = x.float().reshape(*x.shape[:-1], K // block, block)
    amax = b.abs().amax(dim=-1, keepdim=True)
    v = amax / _f32(E2M1_MAX, x.device)
    m, ex = torch.frexp(v)
    e = torch.where(m == 0.5, ex - 1, ex).float()
    e = torch.where(v > 0, e, torch.full_like(e, -127.0)).clamp(-127, 127)
    packed = float_to_e2m1((b * torch.exp2(-e)).reshape(x.shape))
    return packed, (e.squeeze(-1) + 127).to(torch.uint8)


def mxfp4_dequantize(packed: torch.Tensor, sf: torch.Tensor, block: int = MXFP8_BLOCK) -> torch.Tensor:
    """MXFP4 `[..., K/2]` + linear ue8m0 bytes `[..., K/32]` (uint8 / float8_e8m0fnu / any 1-byte view) ->
    float32 `[..., K]`: e2m1 * 2^(byte - 127)."""
    vals = e2m1_to_float(packed)
    s = ue8m0_to_float(sf)
    if s.shape[-1] * block != vals.shape[-1]:
        raise ValueError(f"scale shape {tuple(sf.shape)} does not match {vals.shape[-1]} values per row")
    return vals * s.repeat_interleave(block, dim=-1)


# ----------------------------------------------------------------------------------------------------------------
# INT4 W4A16, symmetric, a bf16 scale per 32 values (compressed-tensors pack-quantized: Kimi-K2's routed experts)
# ----------------------------------------------------------------------------------------------------------------

INT4_GROUP = 32


def int4_quantize(w: torch.Tensor, group: int = INT4_GROUP) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric INT4 of `[..., K]` as compressed-tensors' W4A16 writes it: (int32 `[..., K/8]` words of 8 nibbles
    w/s + 8, element j of a word at bits 4j — `pack_to_int32`'s layout, checked against it; bf16 scales
    `[..., K/group]`, s = amax / 7.5 as its symmetric min-max observer computes it, never 0)."""
    K = w.shape[-1]
    if K % group or K % 8:
        raise ValueError(f"last dim {K} is not a multiple of the INT4 group {group}")
    b = w.float().reshape(*w.shape[:-1], K // group, group)
    scale = (b.abs().amax(dim=-1, keepdim=True) / 7.5).clamp(min=float(torch.finfo(torch.bfloat16).tiny))
    scale = scale.to(torch.bfloat16)
    q = torch.round(b / scale.float()).clamp(-8, 7).reshape(w.shape).to(torch.int8)
    return int4_pack(q), scale.squeeze(-1)


def int4_pack(q: torch.Tensor) -> torch.Tensor:
    """Signed int8 values in [-8, 7] `[..., K]` -> compressed-tensors' int32 words `[..., K/8]` (nibble = q + 8; the
    bytes of a word, little-endian, hold elements (2i, 2i+1) in (low, high) nibbles)."""
    u = (q.to(torch.int16) + 8).to(torch.uint8).reshape(*q.shape[:-1], q.shape[-1] // 2, 2)
    return (u[..., 0] | (u[..., 1] << 4)).contiguous().view(torch.int32)


def int4_unpack(packed: torch.Tensor, offset: int = 8) -> torch.Tensor:
    """int32 words `[..., K/8]` (or their bytes, uint8 `[..., K/2]`) -> signed int8 `[..., K]`: nibble - `offset`
    (8: compressed-tensors' w/s + 8; 0: the kernel's two's-complement nibbles, flashinfer's reference)."""
    u8 = packed.contiguous().view(torch.uint8)
    n = torch.stack([u8 & 0x0F, u8 >> 4], dim=-1).flatten(-2).to(torch.int8)
    if offset:
        return n - offset
    return torch.where(n >= 8, n - 16, n)


def int4_dequantize(packed: torch.Tensor, scale: torch.Tensor, offset: int = 8, group: int = INT4_GROUP):
    """INT4 `packed` (see `int4_unpack`) x bf16 scales `[..., K/group]` -> float32 `[..., K]` (the product of a
    4-bit integer and a bf16 is exact in float32, as flashinfer's reference computes it)."""
    q = int4_unpack(packed, offset).float()
    s = scale.float()
    if s.shape[-1] * group != q.shape[-1]:
        raise ValueError(f"scale shape {tuple(scale.shape)} does not match {q.shape[-1]} values per row")
    return q * s.repeat_interleave(group, dim=-1)


__all__ = [
    "E2M1_MAX",
    "FP8_E4M3_MAX",
    "e2m1_to_float",
    "float_to_e2m1",
    "nvfp4_quantize",
    "nvfp4_dequantize",
    "fp8_quantize",
    "fp8_dequantize",
    "fp8_block_quantize",
    "fp8_block_dequantize",
    "fp8_group_quantize",
    "fp8_group_dequantize",
    "mxfp8_quantize",
    "mxfp8_dequantize",
    "ue8m0_to_float",
    "mxfp4_quantize",
    "mxfp4_dequantize",
    "INT4_GROUP",
    "int4_quantize",
    "int4_pack",
    "int4_unpack",
    "int4_dequantize",
]
