"""BF16 (unquantized) experts for flashinfer `trtllm_bf16_moe`: row permutation, then BlockMajorK, in place.

Kernel layout (flashinfer prepare.py `prepare_trtllm_bf16_weights`, SGLang unquant.py): w13 rows [up; gate] ->
gated interleave -> shuffle_matrix_a (non-gated: shuffle only), w2: shuffle; then each expert [M, K] becomes
block-major [K/64, M, 64] (128-byte blocks of K). SGLang does this per expert and then *reshapes the Parameter to
4-D*, so every later weight load first needs `maybe_restore_flashinfer_trtllm_bf16_weight_shape_for_load` to
un-block the whole layer (sglang#26194, #28015, #33743). Here the Parameter keeps its loaded shape [E, M, K] and
storage; only its bytes are block-major. The runner hands the kernel `layouts.block_major_k_view` (4-D, same
storage), SGLang's loader always sees [E, M, K], and the per-expert state in `weights` un-blocks only the expert
being written. No scalars: the kernel takes no scales.

SGLang's FusedMoE already allocates the intermediate padded to 128 on this backend (per half for gated w13, the
loader zero-fills the pad), so there is nothing to re-allocate.
"""

from __future__ import annotations

import torch

from .. import layouts
from ..compat import defer, features
from .base import (
    TRTLLM,
    TRTLLM_ROUTED,
    Checkpoint,
    KernelCall,
    Layer,
    ParamLayout,
    WeightFormat,
)
from .encodings import Calibration, Encoding, Tensors


def _bf16(w: torch.Tensor, calib: Calibration) -> Tensors:
    return {"weight": w.to(torch.bfloat16)}


#: BF16, unquantized (no quant config)
BF16_WEIGHTS = Encoding("bf16", "bf16", _bf16, lambda t: t["weight"].float())

BLOCK_K_BYTES = 128


class Bf16(WeightFormat):
    name = "bf16"
    title = "BF16 (unquantized)"
    encoding = BF16_WEIGHTS
    hook_module = "sglang_trtllm_moe.builtins.bf16_hooks"
    upstream_verdicts = (
        defer.Verdict(
            features.BF16_LOAD_RESTORES_LAYOUT.releases,
            True,
            "measured: every flow exact, storage, Parameters and weight_loaders kept (SGLang packs only canonical "
            "weights and restores whole layers before loads and at begin_weight_update, in place)",
        ),
        defer.Verdict(
            defer.between(defer.CPU_ORACLE, features.BF16_LOAD_RESTORES_LAYOUT),
            False,
            "measured: a one-expert disk update fails (RuntimeError: the loader writes 3-D shards into the 4-D "
            "block-layout Parameter; the routed backend's shape-only restore leaves the bytes blocked and the "
            "next prep re-packs every expert)",
        ),
        defer.read_before_cpu_oracle(),
    )
    quantizations = {TRTLLM: frozenset({None}), TRTLLM_ROUTED: frozenset({None})}
    #: SGLang's own trtllm BF16 prep produces this layout (its BF16 leaf's layers, emulated as BF16)
    sglang_leaf = "bf16"
    #: SGLang's BF16 trtllm path (`_SUPPORTED_BF16_ACTIVATIONS`, get_activation_type): gated SwiGLU, non-gated silu
    #: and relu2
    gated_activations = frozenset({"silu"})
    non_gated_activations = frozenset({"silu", "relu2"})
    #: SGLang's FusedMoE rounds to 128 on the trtllm path; the kernel alone would take 64 gated (w2's 128-byte blocks)
    intermediate_align = (128, 128)

    def describes(self, checkpoint: Checkpoint) -> bool:
        return checkpoint.quantization is None

    # SGLang shows a prepared BF16 layer's Parameters 4-D ([E, K/64, M, 64], the kernel's BlockMajorK view) and a
    # loadable one 3-D ([E, M, K]); the plugin keeps that contract (compat/defer.py: where it prepares BF16 itself):
    # the same storage seen through either view, 4-D exactly when every expert of the group is prepared.
    def tensor(self, layer: Layer, p: ParamLayout) -> torch.Tensor:
        t = getattr(layer, p.name).data
        if t.dim() == 4:
            e, nb, m, bk = t.shape
            return t.view(e, m, nb * bk)
        return t

    def prepared_at_attach(self, layer: Layer, group: str) -> bool:
        return all(getattr(layer, p.name).data.dim() == 4 for p in self.params if p.group == group)

    def on_layout(self, layer: Layer, group: str, all_prepared: bool) -> None:
        for p in self.params:
            if p.group != group:
                continue
            param = getattr(layer, p.name)
            flat = self.tensor(layer, p)
            param.data = layouts.block_major_k_view(flat, BLOCK_K_BYTES) if all_prepared else flat

    params = (
        ParamLayout("w13_weight", "w13", block_major_k=True),
        ParamLayout("w2_weight", "w2", block_major_k=True),
    )

    def check_layout(self, layer: Layer) -> str | None:
        cfg = layer.moe_runner_config
        if cfg.gemm1_alpha is not None or cfg.gemm1_clamp_limit is not None:
            return (
                "SwiGLU-OAI parameters (gemm1_alpha / gemm1_clamp_limit) are not passed to the BF16 kernel by "
                "SGLang's flashinfer_trtllm path, so the layer would compute a different activation"
            )
        if getattr(cfg, "num_fused_shared_experts", 0):
            return "fused shared experts are not supported by the flashinfer_trtllm BF16 MoE"
        problem = super().check_layout(layer)
        if problem:
            return problem
        for p in self.params:
            t = getattr(layer, p.name)
            if t.dtype.itemsize != 2:
                return f"{p.name} is {t.dtype}; the BF16 kernel takes 16-bit weights"
            if (t.shape[2] * t.element_size()) % BLOCK_K_BYTES:
                return (
                    f"{p.name} rows are {t.shape[2]} elements; BlockMajorK needs a multiple of "
                    f"{BLOCK_K_BYTES // t.element_size()} "
                    f"(pad the {'hidden' if p.group == 'w13' else 'intermediate'} size)"
                )
        return None

    def routing_method(self, call: KernelCall) -> int | None:
        """SGLang's BF16 QuantInfo carries no routing method; its leaf reads the runner config's."""
        return call.runner_config.routing_method_type

    def kernel_args(self, call: KernelCall, routing: dict, routed: bool) -> dict:
        """The weights stay [E, M, K] Parameters whose bytes are block-major; the kernel is given the 4-D BlockMajorK
        view of the same storage. routed_scaling_factor reaches the kernel on the logits path (vllm#43769 lost it for
        BF16); on the routed path SGLang's TopK has already folded it into the weights."""
        qi, cfg = call.quant_info, call.runner_config
        return dict(
            hidden_states=call.hidden,
            gemm1_weights=_kernel_view(qi.gemm1_weights.data),
            gemm2_weights=_kernel_view(qi.gemm2_weights.data),
            num_experts=qi.global_num_experts,
            intermediate_size=cfg.intermediate_size_per_partition,
            local_expert_offset=qi.local_expert_offset,
            local_num_experts=cfg.num_local_experts,
            use_shuffled_weight=True,
            weight_layout=2,  # WeightLayout.BlockMajorK
            **routing,
        )


def _kernel_view(t: torch.Tensor) -> torch.Tensor:
    """The kernel's 4-D BlockMajorK view (a prepared layer already shows it; SGLang's own prep leaves it too)."""
    return t if t.dim() == 4 else layouts.block_major_k_view(t, BLOCK_K_BYTES)


BF16 = Bf16()
