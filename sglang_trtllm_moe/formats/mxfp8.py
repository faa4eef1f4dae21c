"""MXFP8 (SGLang `quant_method: mxfp8` -> Fp8MoEMethod with use_mxfp8): e4m3 weights, one UE8M0 scale byte per 32
values along K (`*_weight_scale_inv`, uint8), activations quantized to MXFP8 at run time.

Kernel (flashinfer `trtllm_fp8_block_scale_moe` / `_routed_moe` with `fp8_quantization_type=MxFp8`): shuffled
weights (`use_shuffled_weight=True`, MajorK), so w13 rows [up; gate] -> gated interleave -> shuffle_matrix_a blocks,
w2 rows shuffled; the scale rows take the same row map (flashinfer's `get_shuffle_matrix_sf_a_row_indices` returns
the weight indices) and then the 128x4 swizzle. FusedMoE's loader swaps shard ids w1<->w3 for Fp8MoEMethod on the
trtllm backends (every release), so w13 and its scale rows load as [up; gate] per 128-padded half, pad rows and pad
scale bytes zeroed: the default row maps apply unchanged. SGLang's own prep (`align_mxfp8_moe_weights_for_flashinfer_
trtllm`) computes exactly these bytes, but over every expert at every flush: after a one-expert RL update the other
experts are shuffled twice (measured: 0.86-0.98 of their w13 bytes wrong). Here each expert is prepared once.

Storage: SGLang's own Parameters, unchanged (nothing narrower or wider). No weight scalars: the SwiGLU alpha/beta/
clamp tensors come from the model config (SGLang's `_prepare_flashinfer_trtllm_activation_params`, 0.5.18+).
The kernel takes the weight scales as uint8 (the MxFp8 launcher checks it), activation scales uint8 [T, H/32] linear.
"""

from __future__ import annotations

import torch

from .. import quant
from ..compat import defer, features
from .base import (
    TRTLLM,
    TRTLLM_ROUTED,
    Checkpoint,
    KernelCall,
    Layer,
    ParamLayout,
    Support,
    WeightFormat,
)
from .encodings import (
    MX_BLOCK,
    Calibration,
    Encoding,
    Tensors,
    block_scaled_intermediate,
    mxfp8_grid,
    swiglu_limits,
)
from .load_rules import UE8M0_BYTES


def _mxfp8(w: torch.Tensor, calib: Calibration) -> Tensors:
    """One projection: e4m3 `weight` and uint8 UE8M0 `weight_scale_inv` per 32 columns."""
    q, s = quant.mxfp8_quantize(w)
    return {"weight": q, "weight_scale_inv": s}


#: MXFP8: e4m3, a UE8M0 byte per 32 (`quant_method: mxfp8`)
MXFP8_WEIGHTS = Encoding(
    "mxfp8",
    "fp8_block_scale",
    _mxfp8,
    lambda t: quant.mxfp8_dequantize(t["weight"], t["weight_scale_inv"]),
    grid=mxfp8_grid,
)


class Mxfp8(WeightFormat):
    name = "mxfp8"
    title = "MXFP8 (mxfp8)"
    encoding = MXFP8_WEIGHTS
    hook_module = "sglang_trtllm_moe.builtins.mx_hooks"
    upstream_verdicts = (
        defer.Verdict(
            defer.CPU_ORACLE.releases,
            False,
            "measured: a one-expert update re-shuffles every expert that was not reloaded (SGLang's "
            "align_mxfp8_moe_weights_for_flashinfer_trtllm lays the whole layer out again at each prep; storage and "
            "loaders are kept)",
        ),
        defer.read_before_cpu_oracle(),
    )
    quantizations = {TRTLLM: frozenset({"mxfp8"}), TRTLLM_ROUTED: frozenset({"mxfp8"})}
    #: SGLang's FP8 leaf (`_SUPPORTED_FP8_ACTIVATIONS`) and flashinfer's MxFp8 launcher: SwiGLU (with optional
    #: alpha/beta/clamp) gated, relu2 non-gated (0.5.19+, see `activations`)
    gated_activations = frozenset({"silu"})
    non_gated_activations = frozenset({"relu2"})
    #: FusedMoE rounds the per-rank intermediate to 128 on the trtllm backends; the 128x4 scale swizzle in place
    #: needs w2's I/32 scale columns % 4 == 0, i.e. I % 128
    intermediate_align = (128, 128)
    accepts_prequantized = True
    params = (
        ParamLayout("w13_weight", "w13"),
        ParamLayout("w13_weight_scale_inv", "w13", sf_swizzle=True, byte_code=UE8M0_BYTES),
        ParamLayout("w2_weight", "w2"),
        ParamLayout("w2_weight_scale_inv", "w2", sf_swizzle=True, byte_code=UE8M0_BYTES),
    )
    # validation (LoadRule, derived): e4m3 weights and uint8 UE8M0 scale bytes only — float8_e8m0fnu scales would be
    # value-converted into the uint8 storage (2^k as integers), so they are refused, naming uint8; a 0xFF scale byte
    # (UE8M0's NaN) is refused

    def describes(self, checkpoint: Checkpoint) -> bool:
        return checkpoint.quantization == "mxfp8" and not checkpoint.online

    def refusal(self, checkpoint: Checkpoint) -> str | None:
        if checkpoint.quantization == "mxfp8" and checkpoint.online:
            return (
                "online MXFP8 (--quantization mxfp8 on a BF16 checkpoint): SGLang quantizes at load time and "
                "rebinds the Parameters to fp8, so the plugin leaves the layer to SGLang's own preparation"
            )
        return None

    def activations(self, gated: bool) -> frozenset[str]:
        """Non-gated relu2 only where SGLang allocates the kernel's I-row w13 (0.5.19+): before, SGLang slices a
        2I-row allocation at its prep (new storage) and the plugin leaves the layer to SGLang."""
        if not gated and not features.MXFP8_NON_GATED_W13_ROWS.present():
            return frozenset()
        return super().activations(gated)

    def supports_intermediate(self, per_rank: int, gated: bool) -> Support:
        return block_scaled_intermediate(per_rank)  # the fp8 block-scale kernel family's rule

    def check_layout(self, layer: Layer) -> str | None:
        problem = super().check_layout(layer)
        if problem:
            return problem
        if getattr(layer, "w13_weight_bias", None) is not None:
            return "the layer has GEMM biases, which SGLang's MXFP8 trtllm kernel call does not pass"
        e, m, h = layer.w13_weight.shape
        i = layer.w2_weight.shape[2]
        gated = self.is_gated(layer)
        if m != (2 * i if gated else i):
            return (
                f"w13 has {m} rows for intermediate {i} ({'gated' if gated else 'non-gated'}): SGLang allocates "
                "2 x intermediate rows for non-gated MXFP8 before 0.5.19 and slices them at prep"
            )
        if h % 128 or i % 128:
            return f"hidden {h} / intermediate {i}: the MXFP8 kernel and its 128x4 scales need multiples of 128"
        for n, rows, cols in (("w13_weight_scale_inv", m, h), ("w2_weight_scale_inv", h, i)):
            t = getattr(layer, n)
            if t.dtype != torch.uint8 or tuple(t.shape) != (e, rows, cols // MX_BLOCK):
                return (
                    f"{n} is {tuple(t.shape)} {t.dtype}, expected uint8 UE8M0 bytes [{e}, {rows}, {cols // MX_BLOCK}]"
                )
        return None

    def kernel_args(self, call: KernelCall, routing: dict, routed: bool) -> dict:
        """Activations MXFP8 (uint8 scales [T, H/32], linear, not transposed), weights shuffled MajorK, MxFp8."""
        layer, qi = call.layer, call.quant_info
        if routing.get("routed_scaling_factor") is None:
            routing["routed_scaling_factor"] = 1.0
        if call.hidden_scale is not None:  # pre-quantized by the dispatcher (a2a)
            hs, sf = call.hidden, call.hidden_scale
        elif call.on_kernel:
            if features.MXFP8_QUANTIZE_IN_FP8_UTILS.present():
                from sglang.srt.layers.quantization.fp8_utils import flashinfer_mxfp8_quantize as mxq
            else:
                from flashinfer import mxfp8_quantize as mxq
            hs, sf = mxq(call.hidden, False)
        else:
            from ..quant import mxfp8_quantize

            hs, sf = mxfp8_quantize(call.hidden)
        return dict(
            hidden_states=hs,
            hidden_states_scale=sf.view(torch.uint8).reshape(hs.shape[0], -1).contiguous(),
            gemm1_weights=layer.w13_weight.data,
            gemm1_weights_scale=layer.w13_weight_scale_inv.data.view(torch.uint8),
            gemm2_weights=layer.w2_weight.data,
            gemm2_weights_scale=layer.w2_weight_scale_inv.data.view(torch.uint8),
            **swiglu_limits(qi),
            num_experts=qi.global_num_experts,
            intermediate_size=int(layer.w2_weight.shape[2]),
            local_expert_offset=qi.local_expert_offset,
            local_num_experts=qi.local_num_experts,
            use_shuffled_weight=True,
            weight_layout=0,
            fp8_quantization_type=2,  # MajorK, MxFp8
            **routing,
        )


MXFP8 = Mxfp8()
