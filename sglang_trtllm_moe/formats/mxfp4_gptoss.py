"""gpt-oss MXFP4 (SGLang `quant_method: mxfp4` -> Mxfp4MoEMethod, `_fi_kernel == "trtllm_sm100"` on
--moe-runner-backend flashinfer_mxfp4): packed e2m1 weights (uint8), UE8M0 scale bytes (uint8) per 32, fp32 GEMM
biases, SwiGLU with alpha 1.702, beta 1 and clamp 7 (gpt-oss's `(clamp(up, -7, 7) + 1) * g * sigmoid(1.702 g)`,
g = min(gate, 7)), activations MXFP8 (default) or BF16; hidden padded to 128 (256 before 0.5.17).

Checkpoint layout: all experts in one tensor per parameter (`gate_up_proj_blocks` ...), w13 rows *interleaved*
(row 2j = gate_j, 2j+1 = up_j). SGLang's loader fast path copies each into the top-left of the padded Parameter
(`expert_id=None`), so a "partial" RL update is a whole-layer write: validated and un-prepared in the
FusedMoE.weight_loader hook before SGLang's copy, re-prepared at the flush.

Kernel layout (flashinfer `trtllm_fp4_block_scale_moe`): SGLang's prep swaps every row pair (u0, g0, u1, g1, ...:
the gated interleave of [up; gate]) then shuffles rows (tile 128); weights, scales and biases of w13 alike; w2 rows,
scale rows and bias: shuffle only; scales 128x4 swizzled. Verified: m13 = pairswap[shuffle], pairswap(r) = r ^ 1.

Storage: SGLang's Parameters, except the biases, which SGLang widens bf16 -> fp32 into new Parameters at prep (and
rebinds the scale Parameters to float8_e4m3fn views, so its next reload value-converts the uint8 checkpoint bytes:
every scale byte wrong). Here the biases are allocated fp32 at create time (the final width, once: SGLang's
`param.data[:, :n].copy_(bf16)` widens exactly) and weights and scales stay uint8 Parameters; the kernel gets
`.view(float8_e4m3fn)` of the scales. Scalars gemm1_alpha / gemm1_beta / gemm1_clamp_limit are Parameters of
[local experts] (SGLang <= 0.5.16 sizes them by the global expert count: the plugin uses the local count everywhere).
"""

from __future__ import annotations

from typing import Any

import torch

from .. import layouts
from ..compat import defer
from ..layouts.maps import cached, norm_device
from .base import Checkpoint, KernelCall, Layer, ParamLayout, WeightFormat
from .encodings import FLASHINFER_MXFP4, MX_BLOCK, MXFP4, grid_dequantize, mxfp4_activations
from .load_rules import UE8M0_BYTES

#: SGLang's Mxfp4MoEMethod (no type information)
QuantMethod = Any
#: gpt-oss's SwiGLU alpha and clamp limit (its beta is 1)
ALPHA, LIMIT = 1.702, 7.0


class Mxfp4GptOss(WeightFormat):
    name = "mxfp4_gptoss"
    title = "MXFP4 (mxfp4, gpt-oss)"
    encoding = MXFP4
    hook_module = "sglang_trtllm_moe.builtins.mx_hooks"
    upstream_verdicts = (
        defer.Verdict(
            defer.CPU_ORACLE.releases,
            False,
            "measured: SGLang's prep replaces the Parameters (scales viewed e4m3, biases fp32) without "
            "weight_loader, so the next fused load raises TypeError (default_weight_loader)",
        ),
        defer.read_before_cpu_oracle(),
    )
    own_backend = FLASHINFER_MXFP4
    quantizations = {FLASHINFER_MXFP4: frozenset({"mxfp4"})}
    gated_activations = frozenset({"silu"})
    non_gated_activations = frozenset()
    activation_note = "gpt-oss's clamped SwiGLU (alpha/beta/limit); Kimi-K3's SiTU stays SGLang's"
    intermediate_align = (128, 128)
    fused = True
    params = (
        ParamLayout("w13_weight", "w13"),
        ParamLayout("w13_weight_scale", "w13", sf_swizzle=True, byte_code=UE8M0_BYTES),
        ParamLayout("w13_weight_bias", "w13"),
        ParamLayout("w2_weight", "w2"),
        ParamLayout("w2_weight_scale", "w2", sf_swizzle=True, byte_code=UE8M0_BYTES),
        ParamLayout("w2_weight_bias", "w2"),
    )
    # validation (LoadRule, derived; fused writes: validation.validate_fused): uint8 blocks and UE8M0 scale bytes only
    # (0xFF, UE8M0's NaN, refused)
    # (float8_e8m0fnu scales would be value-converted into the uint8 storage), any float bias (fp32 storage)
    #: SGLang's GptOssForCausalLM.load_weights: checkpoint names below `...mlp.experts.` -> the parameter it writes
    fused_checkpoint_names = {
        "gate_up_proj_blocks": "w13_weight",
        "gate_up_proj_scales": "w13_weight_scale",
        "gate_up_proj_bias": "w13_weight_bias",
        "down_proj_blocks": "w2_weight",
        "down_proj_scales": "w2_weight_scale",
        "down_proj_bias": "w2_weight_bias",
    }

    def describes(self, checkpoint: Checkpoint) -> bool:
        return checkpoint.quantization == "mxfp4"

    # ---- storage --------------------------------------------------------------------------------------------------
    @staticmethod
    def on_trtllm_gen(method: QuantMethod) -> bool:
        """SGLang's Mxfp4MoEMethod picked FlashInfer's SM100 TRT-LLM-Gen kernel for the layer."""
        from ..compat import features

        if features.GPTOSS_FI_KERNEL_ATTR.present():
            return getattr(method, "_fi_kernel", None) == "trtllm_sm100"
        return bool(getattr(method, "use_flashinfer", False))  # 0.5.11: flashinfer_mxfp4 on SM100 is trtllm-gen

    @staticmethod
    def allocation_problem(method: QuantMethod, layer: Layer) -> str | None:
        cfg = layer.moe_runner_config
        for flag in ("use_marlin", "use_deep_gemm", "use_mega_moe"):
            if getattr(method, flag, False):
                return f"{flag}: another kernel consumes the weights"
        if cfg.activation != "silu" or not cfg.is_gated:
            return f"activation {cfg.activation!r} (Kimi-K3 SiTU has another row map and activation)"
        if not getattr(cfg, "gate_up_interleaved", True):
            return "gate_up_interleaved=False (Kimi-K3): a [gate; up] checkpoint needs another row map"
        if getattr(layer, "w13_weight_bias", None) is None or getattr(layer, "w2_weight_bias", None) is None:
            return "the layer has no GEMM biases (SGLang's trtllm gpt-oss call always passes them)"
        return None

    @staticmethod
    def allocate_(layer: Layer) -> None:
        """Biases at the kernel's fp32 width from the start (same shape and attributes, zeros as SGLang's)."""
        for name in ("w13_weight_bias", "w2_weight_bias"):
            old = getattr(layer, name)
            if old.dtype == torch.float32:
                continue
            new = torch.nn.Parameter(
                torch.zeros(old.shape, dtype=torch.float32, device=old.device), requires_grad=False
            )
            for k, v in vars(old).items():
                setattr(new, k, v)
            layer.register_parameter(name, new)

    # ---- layout ---------------------------------------------------------------------------------------------------
    def row_map(self, layer: Layer, p: ParamLayout, t: torch.Tensor) -> torch.Tensor:
        m = t.shape[1]
        if p.group == "w2":
            return layouts.w2_row_map(m, device=t.device)
        dev = norm_device(t.device)

        def build() -> torch.Tensor:  # checkpoint rows g0, u0, g1, u1, ... -> u0, g0, u1, g1, ... -> shuffle
            return (torch.arange(m, device=dev) ^ 1)[layouts.shuffle_map(m, device=dev)]

        return cached(("mxfp4_gptoss_w13", m, dev), build)

    def check_layout(self, layer: Layer) -> str | None:
        cfg = layer.moe_runner_config
        ok, problem = self.supports_activation(cfg.activation, bool(cfg.is_gated))
        if not ok:
            return problem
        e, m, k2 = layer.w13_weight.shape
        hp, i2 = layer.w2_weight.shape[1], layer.w2_weight.shape[2]
        want = {
            "w13_weight": ((e, m, k2), torch.uint8),
            "w13_weight_scale": ((e, m, k2 * 2 // MX_BLOCK), torch.uint8),
            "w13_weight_bias": ((e, m), torch.float32),
            "w2_weight": ((e, hp, i2), torch.uint8),
            "w2_weight_scale": ((e, hp, i2 * 2 // MX_BLOCK), torch.uint8),
            "w2_weight_bias": ((e, hp), torch.float32),
        }
        for n, (shape, dtype) in want.items():
            t = getattr(layer, n, None)
            if t is None or tuple(t.shape) != shape or t.dtype != dtype:
                got = None if t is None else (tuple(t.shape), t.dtype)
                return f"{n} is {got}, expected {shape} {dtype}"
        if m != 4 * i2 or m % 256 or hp % 128 or k2 * 2 != hp:
            return f"w13 {tuple(layer.w13_weight.shape)} / w2 {tuple(layer.w2_weight.shape)}: expected padded sizes"
        return None

    # ---- checker ----------------------------------------------------------------------------------------------------
    def scale_of(self, name: str) -> str | None:
        if name.endswith("_bias"):
            return None  # dense fp32, compared on its own
        return super().scale_of(name)

    def dequantize_param(
        self, name: str, weight: torch.Tensor, scale: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The biases are dense (compared on their own); the weights MXFP4 (the encoding's grid)."""
        if name.endswith("_bias"):
            return grid_dequantize(weight.unsqueeze(-1), None)
        return super().dequantize_param(name, weight, scale)

    # ---- scalars ----------------------------------------------------------------------------------------------------
    def compute_scalars(self, layer: Layer) -> dict[str, torch.Tensor]:
        """SGLang's expressions (mxfp4.py process_weights_after_loading, 0.5.17+), sized by the local experts."""
        cfg = layer.moe_runner_config
        e = layer.w13_weight.shape[0]
        dev = layer.w13_weight.device
        alpha = getattr(cfg, "gemm1_alpha", None) or ALPHA
        limit = getattr(cfg, "gemm1_clamp_limit", None) or LIMIT
        return {
            n: torch.full((e,), float(v), dtype=torch.float32, device=dev)
            for n, v in (("gemm1_alpha", alpha), ("gemm1_beta", 1.0), ("gemm1_clamp_limit", limit))
        }

    # ---- the kernel -------------------------------------------------------------------------------------------------
    def routes_in_kernel(self, call: KernelCall) -> bool:
        return True  # SGLang's gpt-oss call always routes the bypassed logits in the kernel (gpt-oss declares none)

    def routing_method(self, call: KernelCall) -> int | None:
        return 1  # RoutingMethodType.Renormalize, as SGLang's gpt-oss call passes it

    def kernel_args(self, call: KernelCall, routing: dict, routed: bool) -> dict:
        """SGLang's `_fused_experts_flashinfer_mxfp4_sm100_trtllm_gen` (0.5.20+) / Mxfp4MoEMethod.apply (before):
        Renormalize routing on bf16 logits, biases and SwiGLU scalars, no output scalars, routed_scaling None, and
        an output as wide as the unpadded hidden size."""
        layer, qi = call.layer, call.quant_info
        if routed:
            raise NotImplementedError("gpt-oss MXFP4 runs with in-kernel routing (bypassed top-k) only")
        routing.update(
            routing_method_type=1, routed_scaling_factor=None, routing_bias=None, n_group=None, topk_group=None
        )
        routing["routing_logits"] = routing["routing_logits"].to(torch.bfloat16)
        hp = layer.w2_weight.shape[1]
        hs, sf = mxfp4_activations(call, qi.precision, hp)
        out = torch.empty(call.hidden.shape[0], call.hidden.shape[-1], dtype=torch.bfloat16, device=call.hidden.device)
        return dict(
            hidden_states=hs,
            hidden_states_scale=sf,
            gemm1_weights=layer.w13_weight.data,
            gemm1_weights_scale=layer.w13_weight_scale.data.view(torch.float8_e4m3fn),
            gemm1_bias=layer.w13_weight_bias.data,
            gemm1_alpha=layer.gemm1_alpha.data,
            gemm1_beta=layer.gemm1_beta.data,
            gemm1_clamp_limit=layer.gemm1_clamp_limit.data,
            gemm2_weights=layer.w2_weight.data,
            gemm2_weights_scale=layer.w2_weight_scale.data.view(torch.float8_e4m3fn),
            gemm2_bias=layer.w2_weight_bias.data,
            output1_scale_scalar=None,
            output1_scale_gate_scalar=None,
            output2_scale_scalar=None,
            num_experts=qi.global_num_experts,
            intermediate_size=int(layer.w2_weight.shape[2]) * 2,
            local_expert_offset=qi.local_expert_offset,
            local_num_experts=qi.local_num_experts,
            output=out,
            **routing,
        )


MXFP4_GPTOSS = Mxfp4GptOss()
