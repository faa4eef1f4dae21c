"""The TRT-LLM-Gen MoE emulator against MoE references written here, from the *unprepared* checkpoint tensors.

Each test builds random experts, quantizes them, prepares them for the kernel (our `layouts` forward maps, checked
against flashinfer's own CPU functions where they run: shuffle_matrix_a, reorder_rows_for_gated_act_gemm,
convert_to_block_layout, prepare_trtllm_fp8_per_tensor_weights, prepare_trtllm_bf16_weights), runs the emulator on
the prepared bytes, and compares with a per-token loop that dequantizes each expert from the checkpoint layout.

Two references per quantized format, with tolerances justified where they are used:
* "tight": the same intermediate re-quantization as the kernel, applied in *true* units (x, W dequantized with their
  global scales) instead of the kernel's raw-accumulator units + output scalars. Equal up to fp32 rounding, except
  that a rounding difference can move one FP4/FP8 code of the intermediate by one step. A wrong row map, swapped
  halves, a misplaced scalar or a missing expert breaks it by O(1).
* "loose": a plain bf16 MoE with the unquantized weights and no re-quantization: bounds the total quantization error.

Shapes: E=8, top_k=2, H=256, T=16 (small, the whole file runs in a few seconds on 2 cores).
"""

import inspect
import sys

import flashinfer
import flashinfer.fused_moe.api as fi_api
import flashinfer.fused_moe.core as fi_core
import flashinfer.fused_moe.prepare as fi_prep
import flashinfer.quantization.fp4_quantization as fi_fp4
import pytest
import torch

from sglang_trtllm_moe import emulator, kernel_api, layouts, quant
from sglang_trtllm_moe.emulator import entry_points
from sglang_trtllm_moe.emulator.routing import pack_topk, route

E, H, TOPK, T = 8, 256, 2, 16
SWIGLU, RELU2 = int(emulator.ActivationType.Swiglu), int(emulator.ActivationType.Relu2)
RENORM = 1


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _rel_err(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def _act_true(a, gated):
    """Kernel activation in true units: silu(second half) * first half, or relu(x)^2."""
    if gated:
        ip = a.shape[-1] // 2
        return torch.nn.functional.silu(a[..., ip:]) * a[..., :ip]
    return torch.relu(a).square()


def _ref_moe(x, ids, wts, w13_of, w2_of, gated, requant=None, offset=0, n_local=E, weights_on_input=False):
    """Per-token, per-slot loop: out[t] = sum_k w * bf16(W2_e @ q(act(W13_e @ x_t)))."""
    out = torch.zeros(x.shape[0], w2_of(offset).shape[0])
    for t in range(x.shape[0]):
        acc = torch.zeros(out.shape[1])
        for k in range(ids.shape[1]):
            e = int(ids[t, k])
            if not (offset <= e < offset + n_local):
                continue
            w = wts[t, k].float()
            a = w13_of(e) @ x[t]
            if weights_on_input:
                a = a * w
            h = _act_true(a, gated)
            if requant is not None:
                h = requant(h)
            y = (w2_of(e) @ h).to(torch.bfloat16).float()
            acc += y if weights_on_input else w * y
        out[t] = acc
    return out.to(torch.bfloat16)


def _pad_halves(w13, i, ip):
    """[E, 2I, ...] -> [E, 2Ip, ...], each half zero padded on its own (written here, independent of layouts)."""
    out = w13.new_zeros(w13.shape[0], 2 * ip, *w13.shape[2:])
    out[:, :i] = w13[:, :i]
    out[:, ip : ip + i] = w13[:, i:]
    return out


def _fi_shuffle_w13(u8_expert, gated):
    """flashinfer's own CPU row prep of one expert's GEMM1 bytes (reorder, then shuffle_matrix_a)."""
    if gated:
        u8_expert = fi_core.reorder_rows_for_gated_act_gemm(u8_expert)
    return fi_fp4.shuffle_matrix_a(u8_expert, 128)


# ----------------------------------------------------------------------------------------------------------------
# NVFP4
# ----------------------------------------------------------------------------------------------------------------


def _nvfp4_case(inter, gated, seed=0):
    """Random NVFP4 MoE as SGLang's ModelOpt path holds it, plus the kernel arguments prepared from it."""
    g = _gen(seed)
    ip = layouts.padded_intermediate(inter, gated)
    rows = 2 * inter if gated else inter
    w13 = (torch.randn(E, rows, H, generator=g) * 0.05).to(torch.bfloat16)  # [up; gate]
    w2 = (torch.randn(E, H, inter, generator=g) * 0.05).to(torch.bfloat16)
    x = torch.randn(T, H, generator=g).to(torch.bfloat16)
    logits = torch.randn(T, E, generator=g)
    if gated:
        w13p = _pad_halves(w13, inter, ip)
    else:
        w13p = torch.zeros(E, ip, H, dtype=torch.bfloat16)
        w13p[:, :inter] = w13
    w2p = torch.zeros(E, H, ip, dtype=torch.bfloat16)
    w2p[:, :, :inter] = w2
    # per-expert global scales; gated halves get their own (w13_weight_scale_2 = [gate, up]) to exercise the
    # separate gate / up output scalars
    M = w13p.shape[1]
    half = M // 2 if gated else M
    gs_up = 448 * 6 / w13p[:, :half].float().abs().amax(dim=(1, 2))
    gs_gate = 448 * 6 / w13p[:, half:].float().abs().amax(dim=(1, 2)) if gated else gs_up
    gs_w2 = 448 * 6 / w2p.float().abs().amax(dim=(1, 2))
    q13, s13, q2, s2 = [], [], [], []
    for e in range(E):
        if gated:
            qu, su = quant.nvfp4_quantize(w13p[e, :half], gs_up[e])
            qg, sg = quant.nvfp4_quantize(w13p[e, half:], gs_gate[e])
            q13.append(torch.cat([qu, qg]))
            s13.append(torch.cat([su, sg]))
        else:
            q, s = quant.nvfp4_quantize(w13p[e], gs_up[e])
            q13.append(q)
            s13.append(s)
        q, s = quant.nvfp4_quantize(w2p[e], gs_w2[e])
        q2.append(q)
        s2.append(s)
    q13, s13, q2, s2 = map(torch.stack, (q13, s13, q2, s2))
    a1 = x.float().abs().amax() / (448 * 6)  # input dequant scale (w13_input_scale)
    xq, xs = quant.nvfp4_quantize(x, 1 / a1)

    def w13_true(e):
        d = fi_fp4._e2m1_and_ufp8sf_scale_to_float_cpu(q13[e], s13[e].view(torch.uint8), None, 16, 1, False)
        if gated:
            return torch.cat([d[:half] / gs_up[e], d[half:] / gs_gate[e]])
        return d / gs_up[e]

    def w2_true(e):
        return fi_fp4._e2m1_and_ufp8sf_scale_to_float_cpu(q2[e], s2[e].view(torch.uint8), None, 16, 1, False) / gs_w2[e]

    x_true = fi_fp4._e2m1_and_ufp8sf_scale_to_float_cpu(xq, xs.view(torch.uint8), None, 16, 1, False) * a1
    ids, wts = route(RENORM, logits, TOPK)
    # a2: intermediate input scale, calibrated on the activations like ModelOpt does
    h_all = torch.stack([_act_true(w13_true(int(e)) @ x_true[t], gated) for t in range(T) for e in ids[t]])
    a2 = h_all.abs().amax() / (448 * 6)
    # prepare: rows with the layouts maps (checked against flashinfer's row prep), scales rows + 128x4 swizzle
    map13, map2 = layouts.w13_row_map(M, gated), layouts.w2_row_map(H)
    w13_prep = layouts.permute_rows_(q13.clone(), map13)
    w2_prep = layouts.permute_rows_(q2.clone(), map2)
    for e in (0, E - 1):
        assert torch.equal(w13_prep[e], _fi_shuffle_w13(q13[e], gated))
        assert torch.equal(w2_prep[e], fi_fp4.shuffle_matrix_a(q2[e], 128))
    s13_prep = layouts.swizzle_sf_128x4(s13.view(torch.uint8)[:, map13]).view(torch.float8_e4m3fn)
    s2_prep = layouts.swizzle_sf_128x4(s2.view(torch.uint8)[:, map2]).view(torch.float8_e4m3fn)
    # SGLang's scalars (modelopt_quant.py / flashinfer_trtllm.py)
    g1_alphas = a1 / gs_gate
    g1_alphas_up = a1 / gs_up
    out1 = g1_alphas_up / a2 if gated else torch.full((E,), 1 / a2.item())
    kernel_args = dict(
        routing_logits=logits,
        routing_bias=None,
        hidden_states=xq,
        hidden_states_scale=xs,
        gemm1_weights=w13_prep,
        gemm1_weights_scale=s13_prep,
        gemm1_bias=None,
        gemm1_alpha=None,
        gemm1_beta=None,
        gemm1_clamp_limit=None,
        gemm2_weights=w2_prep,
        gemm2_weights_scale=s2_prep,
        gemm2_bias=None,
        output1_scale_scalar=out1.float(),
        output1_scale_gate_scalar=g1_alphas.float(),
        output2_scale_scalar=(a2 / gs_w2).float(),
        num_experts=E,
        top_k=TOPK,
        n_group=None,
        topk_group=None,
        intermediate_size=ip,
        local_expert_offset=0,
        local_num_experts=E,
        routed_scaling_factor=None,
        routing_method_type=RENORM,
        activation_type=SWIGLU if gated else RELU2,
    )

    def requant(h):
        hq, hs = quant.nvfp4_quantize(h, 1 / a2)
        return quant.nvfp4_dequantize(hq, hs, 1 / a2)

    tight = _ref_moe(x_true, ids, wts, w13_true, w2_true, gated, requant)
    loose = _ref_moe(x.float(), ids, wts, lambda e: w13p[e].float(), lambda e: w2p[e].float(), gated)
    return (
        kernel_args,
        tight,
        loose,
        dict(ids=ids, wts=wts, x_true=x_true, w13_true=w13_true, w2_true=w2_true, requant=requant, s13=s13, M=M),
    )


# Tolerances (relative Frobenius error of the [T, H] output):
# tight 1e-2: fp32 rounding order differs (raw units * scalars vs true units), which can move an intermediate e2m1
#   code by one step (up to 1/3 of the value) now and then. Observed 0 to 1e-4 over 12 cases; a wrong layout or
#   scalar gives > 0.3 (test_nvfp4_detects_layout_errors).
# loose 0.35: NVFP4 quantization of a Gaussian costs ~9.5% relative RMS per stage (measured), four stages (x, W13,
#   the intermediate, W2) give ~19%; observed 0.19-0.24.
NVFP4_TIGHT, NVFP4_LOOSE = 1e-2, 0.35


@pytest.mark.parametrize("inter,gated", [(96, True), (88, True), (200, False)])
def test_nvfp4_matches_references(inter, gated):
    """Gated SwiGLU with I=96 (no intermediate padding; 2I=192 scale rows padded to 256 by the swizzle), I=88
    (halves padded to 96), and Relu2 with I=200 (padded to 256, padded rows zero)."""
    args, tight, loose, _ = _nvfp4_case(inter, gated)
    out = emulator.trtllm_fp4_block_scale_moe(**args)
    assert isinstance(out, list) and len(out) == 1
    out = out[0]
    assert out.dtype == torch.bfloat16 and out.shape == (T, H)
    assert _rel_err(out, tight) < NVFP4_TIGHT
    assert _rel_err(out, loose) < NVFP4_LOOSE


def test_nvfp4_detects_layout_errors():
    """The comparison can fail: unprepared weights, or swapped gate/up scalars, are far off."""
    args, tight, _, extra = _nvfp4_case(96, True, seed=1)
    bad = dict(
        args,
        gemm1_weights=layouts.unpermute_rows_(args["gemm1_weights"].clone(), layouts.w13_row_map(extra["M"], True)),
    )
    assert _rel_err(emulator.trtllm_fp4_block_scale_moe(**bad)[0], tight) > 0.3
    bad = dict(
        args,
        output1_scale_gate_scalar=args["output1_scale_scalar"],
        output1_scale_scalar=args["output1_scale_gate_scalar"],
    )
    assert _rel_err(emulator.trtllm_fp4_block_scale_moe(**bad)[0], tight) > 0.3


def test_nvfp4_linear_scale_layout_without_padding_is_accepted():
    """[E, M, K/16] e4m3 scales (SGLang's reshape when no padding occurred) read the same as padded [E, Rp, Cp]."""
    args, _, _, _ = _nvfp4_case(128, True, seed=2)  # 2I = 256 rows, H/16 = 16 cols: no swizzle padding
    assert args["gemm1_weights_scale"].shape == (E, 256, 16)
    flat = dict(args, gemm1_weights_scale=args["gemm1_weights_scale"].reshape(-1))
    a = emulator.trtllm_fp4_block_scale_moe(**args)[0]
    b = emulator.trtllm_fp4_block_scale_moe(**flat)[0]
    assert torch.equal(a, b)


def test_nvfp4_expert_parallel_ranks_sum_to_whole():
    args, tight, _, extra = _nvfp4_case(96, True, seed=3)
    full = emulator.trtllm_fp4_block_scale_moe(**args)[0]
    parts = []
    for off in (0, E // 2):
        sl = slice(off, off + E // 2)
        local = dict(
            args,
            local_expert_offset=off,
            local_num_experts=E // 2,
            gemm1_weights=args["gemm1_weights"][sl],
            gemm1_weights_scale=args["gemm1_weights_scale"][sl],
            gemm2_weights=args["gemm2_weights"][sl],
            gemm2_weights_scale=args["gemm2_weights_scale"][sl],
            output1_scale_scalar=args["output1_scale_scalar"][sl],
            output1_scale_gate_scalar=args["output1_scale_gate_scalar"][sl],
            output2_scale_scalar=args["output2_scale_scalar"][sl],
        )
        part = emulator.trtllm_fp4_block_scale_moe(**local)[0]
        ref = _ref_moe(
            extra["x_true"],
            extra["ids"],
            extra["wts"],
            extra["w13_true"],
            extra["w2_true"],
            True,
            extra["requant"],
            offset=off,
            n_local=E // 2,
        )
        assert _rel_err(part, ref) < NVFP4_TIGHT
        assert _rel_err(part, full) > 0.1  # each rank alone is not the whole
        parts.append(part.float())
    # each of the three outputs is rounded to bf16 on its own (relative error <= 2^-8 each): the sum of the parts
    # differs from the whole by those roundings only
    diff = (parts[0] + parts[1] - full.float()).abs()
    assert (diff <= (parts[0].abs() + parts[1].abs() + full.float().abs()) * 2**-8).all()


def test_nvfp4_routed_matches_logits_path_bit_for_bit():
    args, _, _, _ = _nvfp4_case(96, True, seed=4)
    full = emulator.trtllm_fp4_block_scale_moe(**args)[0]
    ids, wts = route(RENORM, args["routing_logits"], TOPK)
    routed_args = {k: v for k, v in args.items() if k != "routing_logits"}
    for topk_ids in (pack_topk(ids, wts), (ids, wts)):
        out = emulator.trtllm_fp4_block_scale_routed_moe(topk_ids=topk_ids, **routed_args)[0]
        assert torch.equal(out, full)
    # `output` is written in place and returned; `routing_replay_out` records the chosen ids
    buf = torch.empty(T, H, dtype=torch.bfloat16)
    replay = torch.full((T + 3, TOPK), -1, dtype=torch.int16)
    res = emulator.trtllm_fp4_block_scale_moe(**dict(args, output=buf, routing_replay_out=replay))[0]
    assert res.data_ptr() == buf.data_ptr() and torch.equal(buf, full)
    assert torch.equal(replay[:T].int(), ids) and (replay[T:] == -1).all()


def test_unsupported_options_raise_not_implemented():
    args, _, _, _ = _nvfp4_case(96, True, seed=5)
    with pytest.raises(NotImplementedError, match="do_finalize"):
        emulator.trtllm_fp4_block_scale_moe(**dict(args, do_finalize=False))
    with pytest.raises(NotImplementedError, match="SwigluStep"):
        emulator.trtllm_fp4_block_scale_moe(**dict(args, activation_type=int(emulator.ActivationType.SwigluStep)))
    mx_scale = torch.zeros(E, 2 * 96, H // 32, dtype=torch.uint8).view(torch.float8_e4m3fn)
    with pytest.raises(NotImplementedError, match="MXFP4"):
        emulator.trtllm_fp4_block_scale_moe(**dict(args, gemm1_weights_scale=layouts.swizzle_sf_128x4(mx_scale)))


def test_options_of_newer_flashinfer_change_nothing_or_raise():
    """flashinfer 0.7.4's additions (kernel_api.FLASHINFER_ADDED): a workspace buffer is scratch and changes nothing;
    `nvfp4_4over6` left unset or None changes nothing (it only acts on the per-token NVFP4 requantization, which the
    emulator refuses anyway); a 4over6 recipe and precomputed routing metadata are refused by name."""
    args, _, _, _ = _nvfp4_case(96, True, seed=6)
    plain = emulator.trtllm_fp4_block_scale_moe(**args)[0]
    scratch = torch.zeros(1 << 16, dtype=torch.uint8)
    for extra in ({"workspace_buffer": scratch}, {"nvfp4_4over6": None}, {"nvfp4_4over6": kernel_api.UNSET}):
        assert torch.equal(emulator.trtllm_fp4_block_scale_moe(**dict(args, **extra))[0], plain), extra
    assert torch.equal(scratch, torch.zeros_like(scratch))
    with pytest.raises(NotImplementedError, match="nvfp4_4over6"):
        emulator.trtllm_fp4_block_scale_moe(**dict(args, nvfp4_4over6=object()))
    ids, w = route(RENORM, args["routing_logits"], TOPK)
    routed = {k: v for k, v in args.items() if k != "routing_logits"}
    with pytest.raises(NotImplementedError, match="routing_metadata"):
        emulator.trtllm_fp4_block_scale_routed_moe(topk_ids=pack_topk(ids, w), **routed, routing_metadata=object())


# ----------------------------------------------------------------------------------------------------------------
# FP8 per-tensor, prepared by flashinfer's own CPU prep (weights, row layout and the three scalars)
# ----------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("gated,on_input", [(True, False), (False, False), (True, True)])
def test_fp8_per_tensor_with_flashinfer_prepared_weights(gated, on_input):
    g = _gen(10)
    inter = 128
    w1 = (torch.randn(E, 2 * inter if gated else inter, H, generator=g) * 0.05).to(torch.bfloat16)
    w2 = (torch.randn(E, H, inter, generator=g) * 0.05).to(torch.bfloat16)
    x = torch.randn(T, H, generator=g).to(torch.bfloat16)
    logits = torch.randn(T, E, generator=g)
    method, k = (3, 1) if on_input else (RENORM, TOPK)  # Llama4 routing puts the weight on the input
    ids, wts = route(method, logits, k)
    q_in = 448 / x.float().abs().amax()
    q1, s1 = fi_prep._quantize_fp8_per_expert(w1)  # flashinfer's own per-expert quantizer (multipliers)
    q2, s2 = fi_prep._quantize_fp8_per_expert(w2)
    x_true = fi_prep.prepare_trtllm_fp8_per_tensor_activations(x, hidden_states_scale_global=q_in)[0].float() / q_in

    def w13_true(e):
        return q1[e].float() / s1[e]

    def w2_true(e):
        return q2[e].float() / s2[e]

    h_all = torch.stack(
        [
            _act_true(w13_true(int(e)) @ x_true[t] * (wts[t, j].float() if on_input else 1), gated)
            for t in range(T)
            for j, e in enumerate(ids[t])
        ]
    )
    q_int = 448 / h_all.abs().amax()
    prepared = fi_prep.prepare_trtllm_fp8_per_tensor_weights(
        w1,
        w2,
        hidden_states_scale_global=q_in,
        intermediate_scale_global=q_int,
        num_local_experts=E,
        hidden_size=H,
        intermediate_size=inter,
        activation=fi_api.SwiGLU() if gated else fi_api.ReLU2(),
    )
    # our row maps give the same prepared bytes
    mine = layouts.permute_rows_(q1.clone(), layouts.w13_row_map(q1.shape[1], gated))
    assert torch.equal(mine.view(torch.uint8), prepared["gemm1_weights"].view(torch.uint8))
    xq, _ = fi_prep.prepare_trtllm_fp8_per_tensor_activations(x, hidden_states_scale_global=q_in)
    out = emulator.trtllm_fp8_per_tensor_scale_moe(
        logits,
        None,
        xq,
        prepared["gemm1_weights"],
        prepared["output1_scales_scalar"].reshape(E),
        prepared["output1_scales_gate_scalar"].reshape(E),
        prepared["gemm2_weights"],
        prepared["output2_scales_scalar"].reshape(E),
        E,
        k,
        None,
        None,
        inter,
        0,
        E,
        None,
        on_input,
        routing_method_type=method,
        activation_type=SWIGLU if gated else RELU2,
    )
    assert torch.is_tensor(out) and out.shape == (T, H) and out.dtype == torch.bfloat16

    def requant(h):
        return (h * q_int).clamp(-448, 448).to(torch.float8_e4m3fn).float() / q_int

    tight = _ref_moe(x_true, ids, wts, w13_true, w2_true, gated, requant, weights_on_input=on_input)
    loose = _ref_moe(
        x.float(), ids, wts, lambda e: w1[e].float(), lambda e: w2[e].float(), gated, weights_on_input=on_input
    )
    # tight 1e-2: same e4m3 re-quantization, a code may move one step (2^-3 relative) from fp32 order; observed
    #   0 to 9e-5. loose 0.15: e4m3 costs ~2.7% relative RMS per stage (measured on a Gaussian), four stages (x, W1,
    #   intermediate, W2); observed 0.056-0.068.
    assert _rel_err(out, tight) < 1e-2
    assert _rel_err(out, loose) < 0.15


# ----------------------------------------------------------------------------------------------------------------
# DeepSeek FP8 block scale
# ----------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("layout", [0, 2])
def test_fp8_block_deepseek(layout):
    g = _gen(20)
    inter = 128
    w1 = (torch.randn(E, 2 * inter, H, generator=g) * 0.05).to(torch.bfloat16)
    w2 = (torch.randn(E, H, inter, generator=g) * 0.05).to(torch.bfloat16)
    x = torch.randn(T, H, generator=g).to(torch.bfloat16)
    logits = torch.randn(T, E, generator=g)
    bias = torch.randn(E, generator=g) * 0.1
    ids, wts = route(2, logits, TOPK, bias=bias, n_group=4, topk_group=2, routed_scaling_factor=2.5)
    q1, s1 = quant.fp8_block_quantize(w1)
    q2, s2 = quant.fp8_block_quantize(w2)
    xq, xs = quant.fp8_group_quantize(x)
    if layout == 2:  # BlockMajorK [E, K/128, M, 128] bytes: flashinfer's convert_to_block_layout per expert
        g1 = torch.stack([fi_core.convert_to_block_layout(q1[e].view(torch.uint8), 128) for e in range(E)])
        g2 = torch.stack([fi_core.convert_to_block_layout(q2[e].view(torch.uint8), 128) for e in range(E)])
        assert torch.equal(g1, layouts.to_block_major_k(q1.view(torch.uint8)))
        g1, g2 = g1.view(torch.float8_e4m3fn), g2.view(torch.float8_e4m3fn)
    else:
        g1, g2 = q1, q2
    out = emulator.trtllm_fp8_block_scale_moe(
        logits,
        bias,
        xq,
        xs.t().contiguous(),
        g1,
        s1,
        g2,
        s2,
        E,
        TOPK,
        4,
        2,
        inter,
        0,
        E,
        2.5,
        routing_method_type=2,
        weight_layout=layout,
    )
    assert torch.is_tensor(out) and out.shape == (T, H)
    x_true = quant.fp8_group_dequantize(xq, xs)

    def w13_true(e):
        return quant.fp8_block_dequantize(q1[e], s1[e])

    def w2_true(e):
        return quant.fp8_block_dequantize(q2[e], s2[e])

    def block_requant(v):
        s = (v.view(-1, 128).abs().amax(-1, keepdim=True) / 448).clamp(min=torch.finfo(torch.float32).tiny)
        return ((v.view(-1, 128) / s).to(torch.float8_e4m3fn).float() * s).view(-1)

    out_ref = torch.zeros(T, H)
    for t in range(T):
        for k in range(TOPK):
            e = int(ids[t, k])
            a = block_requant(w13_true(e) @ x_true[t])  # GEMM1 writes e4m3 + per-128-column scales
            h = block_requant(_act_true(a, True))
            out_ref[t] += wts[t, k].float() * (w2_true(e) @ h).to(torch.bfloat16).float()
    loose = _ref_moe(x.float(), ids, wts, lambda e: w1[e].float(), lambda e: w2[e].float(), True)
    # tight 1e-2: same two block re-quantizations, applied to values computed in a different fp32 order (observed
    #   1.7e-3). loose 0.15: e4m3 at five stages (x, W1, GEMM1 output, activation, W2), ~2.7% RMS each; observed 0.077.
    assert _rel_err(out, out_ref.to(torch.bfloat16)) < 1e-2
    assert _rel_err(out, loose) < 0.15


# ----------------------------------------------------------------------------------------------------------------
# BF16, prepared by flashinfer's own prepare_trtllm_bf16_weights
# ----------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("gated", [True, False])
def test_bf16_with_flashinfer_prepared_weights(gated):
    g = _gen(30)
    inter = 128
    w1 = (torch.randn(E, 2 * inter if gated else inter, H, generator=g) * 0.05).to(torch.bfloat16)
    w2 = (torch.randn(E, H, inter, generator=g) * 0.05).to(torch.bfloat16)
    x = torch.randn(T, H, generator=g).to(torch.bfloat16)
    logits = torch.randn(T, E, generator=g)
    prepared = fi_prep.prepare_trtllm_bf16_weights(
        w1,
        w2,
        num_local_experts=E,
        hidden_size=H,
        intermediate_size=inter,
        activation=fi_api.SwiGLU() if gated else fi_api.ReLU2(),
    )
    assert prepared["gemm1_weights"].shape == (E, H // 64, w1.shape[1], 64)
    # our in-place prep produces the same bytes, and the emulator accepts that [E, M, K] storage as well
    mine = layouts.permute_rows_to_block_major_k_(w1.clone(), layouts.w13_row_map(w1.shape[1], gated))
    assert torch.equal(layouts.block_major_k_view(mine), prepared["gemm1_weights"])
    act = SWIGLU if gated else RELU2
    out = emulator.trtllm_bf16_moe(
        logits,
        None,
        x,
        prepared["gemm1_weights"],
        prepared["gemm2_weights"],
        E,
        TOPK,
        None,
        None,
        inter,
        0,
        E,
        routing_method_type=RENORM,
        activation_type=act,
    )
    ids, wts = route(RENORM, logits, TOPK)
    ref = _ref_moe(
        x.float(),
        ids,
        wts,
        lambda e: w1[e].float(),
        lambda e: w2[e].float(),
        gated,
        requant=lambda h: h.to(torch.bfloat16).float(),
    )
    # same math up to fp32 accumulation order (which can flip a bf16 rounding): observed 0 to 3e-6
    assert _rel_err(out, ref) < 1e-3
    ids2 = pack_topk(ids, wts)
    out2 = emulator.trtllm_bf16_routed_moe(
        ids2,
        x,
        prepared["gemm1_weights"],
        prepared["gemm2_weights"],
        E,
        TOPK,
        None,
        None,
        inter,
        0,
        E,
        activation_type=act,
    )
    assert torch.equal(out, out2)
    out3 = emulator.trtllm_bf16_routed_moe(ids2, x, mine, w2, E, TOPK, None, None, inter, 0, E, activation_type=act)
    assert _rel_err(out3, ref) > 0.3  # unprepared w2 is read as garbage


# ----------------------------------------------------------------------------------------------------------------
# MxInt4 (INT4 weights x BF16), prepared as flashinfer's own test prepares them, against its reference
# ----------------------------------------------------------------------------------------------------------------


def _fi_mxint4_quantize(w):
    """flashinfer's test quantizer (tests/moe/trtllm_gen_fused_moe_utils.py `mxint4_quantize`, read at fb28d72; not
    in the wheels): per 32 values amax = max(max * 8/7, -min), scale = amax / 8, two's-complement nibbles (low =
    even element); bf16 scales. Written here from it."""
    b = w.reshape(-1, 32).float()
    x_max, x_min = b.max(dim=-1, keepdim=True)[0] * 8.0 / 7.0, b.min(dim=-1, keepdim=True)[0]
    scales = torch.where(x_max > -x_min, x_max, -x_min) / 8.0
    q = (b * scales.reciprocal()).round().clamp(-8, 7).to(torch.int8).reshape(-1, 16, 2)
    packed = ((q[..., 0] & 0x0F) | ((q[..., 1] & 0x0F) << 4)).to(torch.uint8)
    return packed.reshape(*w.shape[:-1], w.shape[-1] // 2), scales.to(torch.bfloat16).reshape(*w.shape[:-1], -1)


def _fi_mxint4_dequantize(packed, scales):
    """flashinfer's reference (`run_moe_reference_mxint4`): signed nibbles x bf16 scale, in float32."""
    n = torch.stack([packed & 0x0F, (packed >> 4) & 0x0F], dim=-1).flatten(-2).to(torch.int8)
    n = torch.where(n < 8, n, n - 16).float()
    return n * scales.float().repeat_interleave(32, dim=-1)


def test_mxint4_with_flashinfer_prepared_weights_matches_flashinfers_reference():
    """Weights quantized and prepared as flashinfer's MxInt4BlockScaleMoe test does (its CPU permute-index caches and
    convert_to_block_layout; block_scale_interleave, CUDA-only, by the 128x4 swizzle, the same element map in its
    host loop), the emulator against flashinfer's reference math (run_moe_dequant: float32 GEMMs, silu(second half)
    * first half, the intermediate in bf16, float32 finalize). The plugin's in-place prep of compressed-tensors
    words (w/s + 8) gives the same bytes."""
    g = _gen(40)
    inter, E4 = 256, 4
    w1 = torch.randn(E4, 2 * inter, H, generator=g) * 0.05  # [up; gate], as the kernel reads GEMM1
    w2 = torch.randn(E4, H, inter, generator=g) * 0.05
    x = torch.randn(T, H, generator=g).to(torch.bfloat16)
    logits = torch.randn(T, E4, generator=g)
    q1, s1 = _fi_mxint4_quantize(w1)
    q2, s2 = _fi_mxint4_quantize(w2)
    cache: dict = {}
    g1w, g1s, g2w, g2s = [], [], [], []
    for e in range(E4):
        p1 = fi_core._maybe_get_cached_w3_w1_permute_indices(cache, q1[e], 128)
        p1s = fi_core._maybe_get_cached_w3_w1_permute_indices(cache, s1[e], 128, num_elts_per_sf=32)
        p2 = fi_core.get_w2_permute_indices_with_cache(cache, q2[e], 128)
        p2s = fi_core.get_w2_permute_indices_with_cache(cache, s2[e], 128, num_elts_per_sf=16)
        g1w.append(fi_core.convert_to_block_layout(q1[e][p1].contiguous(), 128))
        g2w.append(fi_core.convert_to_block_layout(q2[e][p2].contiguous(), 128))
        g1s.append(layouts.swizzle_sf_128x4(s1[e][p1s].contiguous()).reshape(-1))
        g2s.append(layouts.swizzle_sf_128x4(s2[e][p2s].contiguous()).reshape(-1))
    g1w, g2w, g1s, g2s = map(torch.stack, (g1w, g2w, g1s, g2s))
    out = emulator.trtllm_mxint4_block_scale_moe(
        logits, None, x, g1w, g1s, None, None, None, g2w, g2s, E4, TOPK, None, None, inter, 0, E4, None, RENORM
    )[0]
    ids, wts = route(RENORM, logits, TOPK)
    d1, d2 = _fi_mxint4_dequantize(q1, s1), _fi_mxint4_dequantize(q2, s2)
    ref = torch.zeros(T, H)
    for t in range(T):
        for k in range(TOPK):
            e = int(ids[t, k])
            a = d1[e] @ x[t].float()
            h = (torch.nn.functional.silu(a[inter:]) * a[:inter]).to(torch.bfloat16).float()
            ref[t] += wts[t, k].float() * (d2[e] @ h)
    # the same values; the emulator also rounds GEMM2's output to bf16 before the sum, as the kernel writes it
    # (the reference sums in float32): observed 2.4e-3
    assert _rel_err(out, ref) < 1e-2
    routed = emulator.trtllm_mxint4_block_scale_routed_moe(
        pack_topk(ids, wts), x, g1w, g1s, None, None, None, g2w, g2s, E4, TOPK, None, None, inter, 0, E4, None
    )[0]
    assert torch.equal(out, routed)
    # the plugin's prep of compressed-tensors' words (nibbles w/s + 8: the same bytes XOR 0x88) and bf16 scales
    ct1 = (q1 ^ 0x88).view(torch.int32).clone()
    mine = layouts.permute_rows_to_block_major_k_(ct1, layouts.w13_row_map(2 * inter, True), xor=0x88)
    assert torch.equal(layouts.block_major_k_view(mine.view(torch.uint8)), g1w)
    ms1 = layouts.permute_rows_and_swizzle_sf_(s1.clone(), layouts.w13_row_map(2 * inter, True))
    assert torch.equal(ms1.reshape(E4, -1), g1s)
    bad = emulator.trtllm_mxint4_block_scale_moe(
        logits,
        None,
        x,
        q1.contiguous(),
        g1s,
        None,
        None,
        None,
        g2w,
        g2s,
        E4,
        TOPK,
        None,
        None,
        inter,
        0,
        E4,
        None,
        RENORM,
    )[0]
    assert _rel_err(bad, ref) > 0.3  # an unprepared GEMM1 is garbage


# ----------------------------------------------------------------------------------------------------------------
# Contract with flashinfer's Python API
# ----------------------------------------------------------------------------------------------------------------


def _same_default(ours, theirs) -> bool:
    """The same repr (an int for an enum member, or 1 for True, differs), and equal or both identity sentinels
    (0.7.4's `nvfp4_4over6=_UNSET` has no `__eq__`)."""
    if repr(ours) != repr(theirs):
        return False
    sentinel = type(theirs).__eq__ is object.__eq__ and type(ours).__eq__ is object.__eq__
    return ours == theirs or (sentinel and theirs is not None)


@pytest.mark.parametrize("name", emulator.KERNEL_FUNCTIONS)
def test_signatures_match_flashinfer(name):
    """The emulator follows the newest tested flashinfer; against an older one installed here, what it predates
    (kernel_api.FLASHINFER_ADDED) is left out and the rest must match exactly: names, order, kinds, defaults."""
    later = kernel_api.flashinfer_predates(flashinfer.__version__, name)
    ours = {n: p for n, p in inspect.signature(getattr(emulator, name)).parameters.items() if n not in later}
    theirs = inspect.signature(inspect.unwrap(getattr(fi_core, name))).parameters
    assert list(ours) == list(theirs), f"flashinfer {flashinfer.__version__}"
    for p in theirs:
        assert ours[p].kind == theirs[p].kind, p
        assert _same_default(ours[p].default, theirs[p].default), (p, ours[p].default, theirs[p].default)


def test_entry_points_are_the_signature_table():
    """Each emulator entry point is made from kernel_api.SIGNATURES (what the test above compares with flashinfer):
    the same signature, named as flashinfer's, in its family module."""
    assert tuple(kernel_api.SIGNATURE_SPECS) == kernel_api.KERNEL_FUNCTIONS
    for name in kernel_api.KERNEL_FUNCTIONS:
        fn = getattr(emulator, name)
        assert inspect.signature(fn) == kernel_api.SIGNATURES[name], name
        assert fn.__name__ == fn.__qualname__ == name and f"`{name}`" in fn.__doc__
        assert fn.__module__.startswith("sglang_trtllm_moe.emulator."), fn.__module__
        assert getattr(sys.modules[fn.__module__], name) is fn, name


def test_entry_points_bind_arguments_as_python_functions():
    """Positional and keyword calls compute the same; a wrong call fails as a Python function's call does."""
    args, _, _, _ = _nvfp4_case(96, True, seed=7)
    ids, w = route(RENORM, args["routing_logits"], TOPK)
    routed = {k: v for k, v in args.items() if k != "routing_logits"} | {"topk_ids": pack_topk(ids, w)}
    fn = emulator.trtllm_fp4_block_scale_routed_moe
    positional = [routed.get(n, p.default) for n, p in inspect.signature(fn).parameters.items()]
    assert torch.equal(fn(*positional)[0], fn(**routed)[0])
    with pytest.raises(TypeError, match="unexpected keyword argument 'bogus'"):
        fn(**routed, bogus=1)
    with pytest.raises(TypeError, match="missing 1 required positional argument: 'topk_ids'"):
        fn(**{k: v for k, v in routed.items() if k != "topk_ids"})
    with pytest.raises(TypeError, match="multiple values for argument 'topk_ids'"):
        fn(routed["topk_ids"], **routed)
    block = emulator.trtllm_fp8_block_scale_moe  # its biases and workspace are keyword-only, as flashinfer's
    n_positional = sum(p.kind is p.POSITIONAL_OR_KEYWORD for p in inspect.signature(block).parameters.values())
    with pytest.raises(TypeError, match=f"takes from 16 to {n_positional} positional arguments"):
        block(*[None] * (n_positional + 1))


def test_an_entry_point_parameter_nothing_handles_fails_at_import():
    """Every parameter of the table is consumed, refused unless off, or known to change nothing, when the entry
    point is made: a parameter flashinfer adds is never silently ignored; an impl may not read one it lacks."""

    def reads_hidden_states(ids, weights, hidden_states):
        return hidden_states

    with pytest.raises(TypeError, match="does not handle .*gemm1_weights"):
        entry_points.entry_points("bf16", reads_hidden_states, "stub")

    def reads_a_missing_one(ids, weights, hidden_states, no_such_argument):
        return hidden_states

    with pytest.raises(TypeError, match="no_such_argument"):
        entry_points.entry_points("bf16", reads_a_missing_one, "stub")


def test_enums_match_flashinfer():
    import flashinfer.tllm_enums as enums

    for mine, fi in (
        (emulator.ActivationType, enums.ActivationType),
        (emulator.WeightLayout, enums.WeightLayout),
        (emulator.Fp8QuantizationType, enums.Fp8QuantizationType),
        (kernel_api.RoutingMethodType, enums.RoutingMethodType),
    ):
        later = kernel_api.flashinfer_predates(flashinfer.__version__, mine.__name__)
        assert {m.name: int(m) for m in mine if m.name not in later} == {m.name: int(m) for m in fi}, (
            f"flashinfer {flashinfer.__version__}: {mine.__name__}"
        )


# ----------------------------------------------------------------------------------------------------------------
# The real kernel (Blackwell only)
# ----------------------------------------------------------------------------------------------------------------


@pytest.mark.requires_sm100
@pytest.mark.parametrize("inter,gated", [(128, True), (256, False)])
def test_emulator_matches_flashinfer_kernel_nvfp4(inter, gated):
    """Same prepared bytes into the real kernel and the emulator. Expected agreement: relative error < 3e-2
    (the epilogue's rcp.approx and accumulation order can move a few FP4 codes of the intermediate by one step;
    everything else is exact fp32 math on identical inputs)."""
    import flashinfer.fused_moe as fm
    from flashinfer.tllm_enums import SfLayout

    args, _, _, _ = _nvfp4_case(inter, gated, seed=40)
    cuda = {k: (v.cuda() if torch.is_tensor(v) else v) for k, v in args.items()}
    got = fm.trtllm_fp4_block_scale_moe(**cuda, hidden_states_scale_layout=SfLayout.layout_linear)[0]
    emu = emulator.trtllm_fp4_block_scale_moe(**cuda)[0]
    assert emu.device == got.device
    assert _rel_err(got, emu) < 3e-2


@pytest.mark.requires_sm100
def test_emulator_matches_flashinfer_kernel_bf16():
    """BF16 has no quantization: expected relative error < 1e-2 (accumulation order + bf16 intermediate)."""
    import flashinfer.fused_moe as fm

    g = _gen(41)
    inter = 256
    w1 = (torch.randn(E, 2 * inter, H, generator=g) * 0.05).to(torch.bfloat16)
    w2 = (torch.randn(E, H, inter, generator=g) * 0.05).to(torch.bfloat16)
    x = torch.randn(T, H, generator=g).to(torch.bfloat16).cuda()
    logits = torch.randn(T, E, generator=g).cuda()
    p = fi_prep.prepare_trtllm_bf16_weights(
        w1.cuda(), w2.cuda(), num_local_experts=E, hidden_size=H, intermediate_size=inter
    )
    args = (logits, None, x, p["gemm1_weights"], p["gemm2_weights"], E, TOPK, None, None, inter, 0, E)
    got = fm.trtllm_bf16_moe(*args, routing_method_type=RENORM)
    emu = emulator.trtllm_bf16_moe(*args, routing_method_type=RENORM)
    assert _rel_err(got, emu) < 1e-2
