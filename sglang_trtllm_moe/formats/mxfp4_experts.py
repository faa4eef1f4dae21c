"""MXFP4 routed experts on an FP8 config (DeepSeek-V4, MiMo-V2, Bailing-V3: `Fp8Config.is_fp4_experts` on
--moe-runner-backend flashinfer_mxfp4 -> SGLang's Mxfp4FlashinferTrtllmMoEMethod on SM100): packed e2m1 weights
(int8 storage), one UE8M0 scale per 32 values along K, activations MXFP8 (default) or BF16.

Kernel (flashinfer `trtllm_fp4_block_scale_moe` / `_routed_moe`, MXFP4 picked by the scale count): w13 rows
[up; gate] -> gated interleave -> shuffle_matrix_a, w2 rows shuffled; scale rows take the same map, then the 128x4
swizzle. FusedMoE's plain loader stores w13 as the checkpoint's [gate; up] (no w1/w3 swap on this method), so the
half swap is folded into the w13 row map (as for compressed-tensors NVFP4). The FP4 launcher takes the weights as
uint8 and the scale bytes with float8_e4m3fn metadata ("FP4 launcher requires float8 tensor metadata for both E4M3
and UE8M0 scale bytes", flashinfer prepare.py); the runner hands it those views of the same storage.

Storage, allocated once at the final width and kept (builtins/mx_hooks.py, after SGLang's create_weights): SGLang
allocates float32 scales and, at prep, converts them with `.to(float8_e8m0fnu)` into new Parameters (and from
0.5.21 pads I to 128 per half into new storage), dropping `weight_loader` (the next RL update raises
AttributeError). Here the scale Parameters are float8_e8m0fnu from the start (byte 127 = 1.0, SGLang's pad value),
and the weights are allocated padded per half when I % 128 != 0. SGLang's loader then writes a float32 (or e8m0)
checkpoint scale with `copy_`, which is the same value conversion as SGLang's `.to(float8_e8m0fnu)` (measured equal
on CPU and H200), so the bytes are SGLang's, at 1/4 of SGLang's pre-prep scale memory. Deliberate difference from
the release's pre-prep dtype (float32): docs/COMPAT.md. Pad scale rows/columns are re-set to 127 at every prepare
(the loader zero-fills them from 0.5.23), exactly SGLang 0.5.21+'s `_pad_intermediate_size` fill.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .. import layer_attrs, layouts
from ..compat import defer
from ..layouts.maps import cached, norm_device
from .base import Checkpoint, KernelCall, Layer, ParamLayout, WeightFormat
from .encodings import FLASHINFER_MXFP4, MX_BLOCK, MXFP4, mxfp4_activations
from .load_rules import NONNEGATIVE

UE8M0_ONE = 127
SCALE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class Mxfp4Experts(WeightFormat):
    name = "mxfp4_experts"
    title = "MXFP4 experts (fp8 config, is_fp4_experts)"
    encoding = MXFP4
    hook_module = "sglang_trtllm_moe.builtins.mx_hooks"
    upstream_verdicts = (
        defer.Verdict(
            defer.CPU_ORACLE.releases,
            False,
            "measured: SGLang's prep replaces the Parameters (e8m0 scales, uint8 weights) without weight_loader, so "
            "the next load raises AttributeError",
        ),
        defer.read_before_cpu_oracle(note=" (no FP4-expert path before 0.5.12)"),
    )
    own_backend = FLASHINFER_MXFP4
    quantizations = {FLASHINFER_MXFP4: frozenset({"fp8"})}
    #: SGLang's call passes no alpha/beta (clamp = swiglu_limit) and only Swiglu
    gated_activations = frozenset({"silu"})
    non_gated_activations = frozenset()
    activation_note = "SGLang's FP4-expert trtllm call passes SwiGLU (clamped by swiglu_limit) only"
    intermediate_align = (128, 128)
    #: validation: packed e2m1 bytes as int8 or uint8 (copy_ keeps the bits); scales as float8_e8m0fnu (exact) or
    #: the float values 2^k (SGLang's own value conversion, as its prep's `.to(e8m0)`), finite and >= 0 — never
    #: uint8 / int8 bytes, which SGLang would store as the integers' values
    params = (
        ParamLayout("w13_weight", "w13", load_dtypes=(torch.uint8,)),
        ParamLayout("w13_weight_scale_inv", "w13", sf_swizzle=True, load_dtypes=SCALE_DTYPES, values=NONNEGATIVE),
        ParamLayout("w2_weight", "w2", load_dtypes=(torch.uint8,)),
        ParamLayout("w2_weight_scale_inv", "w2", sf_swizzle=True, load_dtypes=SCALE_DTYPES, values=NONNEGATIVE),
    )
    #: what SGLang's fused FP8 shared expert (`_maybe_load_fp8_shared_expert_as_fp4`, 0.5.15+, ids past the routed
    #: experts) receives: block-FP8 weight and scale, requantized to MXFP4 by SGLang before it writes
    SHARED_EXPERT_DTYPES = {
        "w13_weight": (torch.float8_e4m3fn,),
        "w2_weight": (torch.float8_e4m3fn,),
        "w13_weight_scale_inv": (torch.float8_e8m0fnu, torch.float32),
        "w2_weight_scale_inv": (torch.float8_e8m0fnu, torch.float32),
    }

    def converted_by_sglang(self, layer: Layer, param_name: str, loaded: torch.Tensor, expert: int, scope: str) -> bool:
        if not getattr(layer, "_has_fused_shared", False):
            return False
        first_shared = getattr(layer, "_num_global_routed" if scope == "global" else "_num_local_routed", None)
        return (
            first_shared is not None
            and expert >= int(first_shared)
            and loaded.dtype in self.SHARED_EXPERT_DTYPES.get(param_name, ())
        )

    def describes(self, checkpoint: Checkpoint) -> bool:
        return checkpoint.quantization == "fp8" and checkpoint.fp4_experts

    # ---- storage --------------------------------------------------------------------------------------------------
    @staticmethod
    def allocation_problem(layer: Layer, intermediate: int, hidden: int) -> str | None:
        from ..compat import features

        if not layer.moe_runner_config.is_gated or layer.moe_runner_config.activation != "silu":
            return f"activation {layer.moe_runner_config.activation!r}: SGLang's FP4-expert kernel call is SwiGLU only"
        if hidden % 128:
            return f"hidden {hidden} is not a multiple of 128 (the MXFP4 kernel and its 128x4 scales need it)"
        if intermediate % 128 and not features.FP4_EXPERTS_PADDED_LOAD.present():
            return (
                f"intermediate {intermediate} per rank is not a multiple of 128 and this release's loader cannot "
                "write into an expert buffer padded to 128 (0.5.17+ can; SGLang itself pads only from 0.5.21)"
            )
        return None

    def allocate_(self, layer: Layer, intermediate: int, hidden: int) -> None:
        """Replace SGLang's just-created Parameters (same names and attributes, nothing loaded yet) by the kernel's
        final width: scales float8_e8m0fnu filled with 1.0, weights padded per half to 128."""
        ip = layouts.maps.round_up(intermediate, 128)
        e = layer.w13_weight.shape[0]
        want = {
            "w13_weight": ((e, 2 * ip, hidden // 2), torch.int8, 0),
            "w2_weight": ((e, hidden, ip // 2), torch.int8, 0),
            "w13_weight_scale_inv": ((e, 2 * ip, hidden // MX_BLOCK), torch.float8_e8m0fnu, UE8M0_ONE),
            "w2_weight_scale_inv": ((e, hidden, ip // MX_BLOCK), torch.float8_e8m0fnu, UE8M0_ONE),
        }
        for name, (shape, dtype, fill) in want.items():
            old = getattr(layer, name)
            if tuple(old.shape) == shape and old.dtype == dtype:
                continue
            data = torch.full(shape, fill, dtype=torch.uint8, device=old.device).view(dtype)
            new = torch.nn.Parameter(data, requires_grad=False)
            for k, v in vars(old).items():  # weight_loader, quant_method="block", format_ue8m0, ...
                setattr(new, k, v)
            layer.register_parameter(name, new)

    # ---- layout ---------------------------------------------------------------------------------------------------
    def row_map(self, layer: Layer, p: ParamLayout, t: torch.Tensor) -> torch.Tensor:
        m = t.shape[1]
        if p.group == "w2":
            return layouts.w2_row_map(m, device=t.device)
        dev = norm_device(t.device)

        def build() -> torch.Tensor:  # checkpoint [gate; up] per padded half -> [up; gate] -> the kernel's w13 map
            swap = (torch.arange(m, device=dev) + m // 2) % m
            return swap[layouts.w13_row_map(m, True, device=dev)]

        return cached(("mxfp4_experts_w13", m, dev), build)

    def pad_(self, layer: Layer, group: str, experts: Sequence[int]) -> None:
        """Re-set the pad scale bytes (intermediate rows / columns past I) of `experts` to the UE8M0 one, as SGLang
        pads (the loader zero-fills them from 0.5.23, leaves them before): idempotent, in checkpoint layout."""
        i = getattr(layer, layer_attrs.UNPADDED_INTERMEDIATE, None)
        ip = layer.w2_weight.shape[2] * 2
        if i is None or i == ip or not experts:
            return
        ids = torch.as_tensor(list(experts), dtype=torch.long)
        if group == "w13":
            s13 = layer.w13_weight_scale_inv.data.view(torch.uint8)
            ids = ids.to(s13.device)
            s13[ids, i:ip] = UE8M0_ONE
            s13[ids, ip + i :] = UE8M0_ONE
        else:
            s2 = layer.w2_weight_scale_inv.data.view(torch.uint8)
            s2[ids.to(s2.device), :, i // MX_BLOCK :] = UE8M0_ONE

    def prepare_(self, layer: Layer, group: str, experts: Sequence[int]) -> None:
        self.pad_(layer, group, experts)
        super().prepare_(layer, group, experts)

    def check_layout(self, layer: Layer) -> str | None:
        problem = super().check_layout(layer)
        if problem:
            return problem
        e, m, h2 = layer.w13_weight.shape
        h = h2 * 2
        for n, dtype in (
            ("w13_weight_scale_inv", torch.float8_e8m0fnu),
            ("w2_weight_scale_inv", torch.float8_e8m0fnu),
            ("w13_weight", torch.int8),
            ("w2_weight", torch.int8),
        ):
            if getattr(layer, n).dtype != dtype:
                return f"{n} is {getattr(layer, n).dtype}, not the {dtype} the plugin allocated"
        if m % 256 or h % 128:
            return f"w13 {tuple(layer.w13_weight.shape)}: the MXFP4 kernel needs 2 x I % 256 == 0 and H % 128 == 0"
        return None

    # ---- the kernel -------------------------------------------------------------------------------------------------
    def routes_in_kernel(self, call: KernelCall) -> bool:
        # SGLang's apply routes bypassed logits in the kernel only with the method its configure_bypassed_topk chose
        return call.quant_info.routing_method_type is not None

    def routing_method(self, call: KernelCall) -> int | None:
        return call.quant_info.routing_method_type

    def kernel_args(self, call: KernelCall, routing: dict, routed: bool) -> dict:
        """SGLang's Mxfp4FlashinferTrtllmMoEMethod.apply, on the plugin's storage: weights as uint8, scale bytes
        with float8_e4m3fn metadata, activations MXFP8 (scale e4m3-viewed [T, H/32], linear) or BF16."""
        layer, qi = call.layer, call.quant_info
        if routed:  # SGLang: TopK on materialized ids, the routed scaling already folded into the weights
            routing.update(routing_method_type=5, n_group=1, topk_group=1, routed_scaling_factor=1.0)
        else:
            routing.update(qi.bypassed_routing)
        hs, sf = mxfp4_activations(call, qi.precision, layer.w13_weight.shape[2] * 2)
        return dict(
            hidden_states=hs,
            hidden_states_scale=sf,
            gemm1_weights=layer.w13_weight.data.view(torch.uint8),
            gemm1_weights_scale=layer.w13_weight_scale_inv.data.view(torch.float8_e4m3fn),
            gemm1_bias=None,
            gemm1_alpha=None,
            gemm1_beta=None,
            gemm1_clamp_limit=qi.gemm1_clamp_limit,
            gemm2_weights=layer.w2_weight.data.view(torch.uint8),
            gemm2_weights_scale=layer.w2_weight_scale_inv.data.view(torch.float8_e4m3fn),
            gemm2_bias=None,
            output1_scale_scalar=layer.output1_scale_scalar,
            output1_scale_gate_scalar=layer.output1_scale_gate_scalar,
            output2_scale_scalar=layer.output2_scale_scalar,
            num_experts=qi.global_num_experts,
            intermediate_size=int(layer.w2_weight.shape[2]) * 2,
            local_expert_offset=qi.local_expert_offset,
            local_num_experts=qi.local_num_experts,
            **routing,
        )


MXFP4_EXPERTS = Mxfp4Experts()
