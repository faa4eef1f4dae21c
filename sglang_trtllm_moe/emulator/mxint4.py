"""INT4 weights x BF16 activations: flashinfer `trtllm_mxint4_block_scale_moe` / `_routed_moe`.

What the launcher fixes (flashinfer's `MxInt4BlockScaleLauncher`): BF16 activations, MxInt4 weights in the
shuffled block-major-K layout (`use_shuffled_weight`, `BlockMajorK`), SwiGLU (it takes no activation type), bf16
block scales per 32 values in the 128x4 layout, no output scalars. It reads the weights and scales through their
data pointers only (its checks are dtypes and the scales' element count), so the bytes are what counts: GEMM1 as
[E, K/256, 2I, 128] bytes (`convert_to_block_layout`, block K 128 bytes) of rows [up; gate] gated-interleaved and
shuffled, two's-complement nibbles (low = even element); GEMM2 likewise with rows shuffled.

The math follows flashinfer's own test reference for this kernel (tests/moe/trtllm_gen_fused_moe_utils.py
`run_moe_reference_mxint4` + `run_moe_dequant`, read at fb28d72; it is not in the wheels): weights dequantized in
float32 (nibble x bf16 scale), GEMM1 in float32, `silu(gate) * up` (first half = up, the linear one), the
intermediate rounded to bf16, GEMM2 in float32, bf16 output, routing weights applied at finalize. The SwiGLU alpha /
beta / clamp controls act as for the other families (common.activate).
"""

from __future__ import annotations

import torch

from .. import layouts, quant
from ..kernel_api import ActivationType
from .common import activate, check_local, gemm, round_bf16, row_inverses, run_experts, scalar_or_none, unshuffle_rows
from .entry_points import entry_points

SWIGLU = int(ActivationType.Swiglu)
BLOCK = quant.INT4_GROUP


def _weights(w: torch.Tensor, e: int, rows: int, cols: int, inv: torch.Tensor) -> torch.Tensor:
    """Expert e's block-major uint8 bytes ([E, K/256, M, 128] or any shape of that size per expert) -> the logical
    [rows, cols/2] bytes (rows unshuffled)."""
    kb = cols // 2
    we = w[e].reshape(-1)
    if we.numel() != rows * kb:
        raise ValueError(f"INT4 weight of shape {tuple(w.shape)} does not hold [{rows}, {cols}] values per expert")
    lin = layouts.from_block_major_k(we.view(1, kb // layouts.BLOCK_K_BYTES, rows, layouts.BLOCK_K_BYTES))[0]
    return unshuffle_rows(lin, inv)


def _scales(sf: torch.Tensor, e: int, n: int, rows: int, cols: int, inv: torch.Tensor) -> torch.Tensor:
    """Expert e's bf16 scales in the 128x4 layout (any shape holding n experts) -> linear [rows, cols], rows
    unshuffled."""
    rp, cp = -(-rows // 128) * 128, -(-cols // 4) * 4
    flat = sf.reshape(-1)
    if flat.numel() != n * rp * cp:  # the launcher's check: weight_scale_vec_size == 32
        raise ValueError(
            f"weights scale of shape {tuple(sf.shape)} does not hold {n} experts of {rows}x{cols} bf16 scales "
            "(one per 32 values)"
        )
    lin = layouts.unswizzle_sf_128x4(flat[e * rp * cp : (e + 1) * rp * cp].view(rp, cp), rows, cols)
    return lin.index_select(0, inv)


def _mxint4_impl(
    ids,
    weights,
    hidden_states,
    gemm1_weights,
    gemm1_weights_scale,
    gemm1_alpha,
    gemm1_beta,
    gemm1_clamp_limit,
    gemm2_weights,
    gemm2_weights_scale,
    intermediate_size,
    local_expert_offset,
    local_num_experts,
    output,
    routing_replay_out,
):
    if hidden_states.dtype != torch.bfloat16:
        raise ValueError(f"hidden_states must be bf16, got {hidden_states.dtype} (flashinfer's check)")
    for name, t in (("gemm1_weights", gemm1_weights), ("gemm2_weights", gemm2_weights)):
        if t.dtype != torch.uint8:
            raise ValueError(f"{name} must be uint8 (int4 packed in uint8), got {t.dtype}")
    for name, t in (("gemm1_weights_scale", gemm1_weights_scale), ("gemm2_weights_scale", gemm2_weights_scale)):
        if t.dtype != torch.bfloat16:
            raise ValueError(f"{name} must be bf16, got {t.dtype}")
    H = hidden_states.shape[1]
    inter, m = int(intermediate_size), 2 * int(intermediate_size)
    n = int(local_num_experts)
    check_local("gemm1_weights", gemm1_weights, n)
    check_local("gemm2_weights", gemm2_weights, n)
    inv1, inv2 = row_inverses(m, True, H, hidden_states.device)

    def expert(e, rows, _w):
        w1 = quant.int4_dequantize(
            _weights(gemm1_weights, e, m, H, inv1), _scales(gemm1_weights_scale, e, n, m, H // BLOCK, inv1), 0
        )
        w2 = quant.int4_dequantize(
            _weights(gemm2_weights, e, H, inter, inv2),
            _scales(gemm2_weights_scale, e, n, H, inter // BLOCK, inv2),
            0,
        )
        h = activate(
            gemm(rows, w1),
            SWIGLU,
            alpha=scalar_or_none(gemm1_alpha, e),
            beta=scalar_or_none(gemm1_beta, e),
            limit=scalar_or_none(gemm1_clamp_limit, e),
        )
        return round_bf16(gemm(round_bf16(h), w2))  # the intermediate and GEMM2's output are bf16

    out = run_experts(
        hidden_states.float(), ids, weights, local_expert_offset, n, expert, H, output, routing_replay_out
    )
    return [out]


def _mxint4_unsupported(valid_hidden_size, valid_intermediate_size) -> None:
    """What the INT4 entry points take and the emulator does not model (the plugin never passes them)."""
    from .common import unsupported

    unsupported(
        valid_hidden_size=(valid_hidden_size, valid_hidden_size is None),
        valid_intermediate_size=(valid_intermediate_size, valid_intermediate_size is None),
    )


trtllm_mxint4_block_scale_moe, trtllm_mxint4_block_scale_routed_moe = entry_points(
    "mxint4_block_scale",
    _mxint4_impl,
    "INT4 (bf16 scales per 32) x BF16, SwiGLU; returns [output]",
    _mxint4_unsupported,
)
