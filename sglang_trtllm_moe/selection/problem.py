"""The question selection answers — one MoE layer as the kernel sees it, and the device it would run on — and the
shape of its answers (one backend's eligibility, one resolution)."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from ..formats import Checkpoint, WeightFormat, for_checkpoint


@dataclass(frozen=True)
class MoeProblem:
    """One MoE layer as the kernel sees it. Sizes are the checkpoint's (before TP); per-rank sizes are derived."""

    hidden_size: int
    intermediate_size: int
    num_experts: int
    top_k: int = 1
    #: SGLang's quantization name (modelopt_fp4, modelopt_fp8, fp8, compressed-tensors, ...); None = BF16
    quantization: str | None = None
    #: fp8: the checkpoint's weight_block_size, e.g. (128, 128); None = per-tensor
    weight_block_size: tuple[int, ...] | None = None
    #: compressed-tensors: the scheme ("nvfp4", "w8a8_fp8", "int4", ...)
    quant_scheme: str | None = None
    #: fp8: "static" | "dynamic" activation scales, as the checkpoint's config says (None: not said)
    activation_scheme: str | None = None
    #: fp8: the routed experts are MXFP4 (SGLang's ModelConfig.is_fp4_experts)
    fp4_experts: bool = False
    #: the quantization is SGLang's online one (--quantization on a checkpoint without a quantization_config)
    online_quantization: bool = False
    activation: str = "silu"
    gated: bool = True
    tp_size: int = 1
    ep_size: int = 1
    a2a_backend: str = "none"
    enable_eplb: bool = False
    num_redundant_experts: int = 0
    init_expert_location: str = "trivial"
    speculative_draft: bool = False
    architecture: str = ""
    #: why SGLang builds this model without FusedMoE layers (no MoE runner backend applies); None = it builds them
    no_fused_moe: str | None = None

    @property
    def moe_tp_size(self) -> int:
        """Experts are split EP-ways inside the TP group; what is left of TP splits each expert's intermediate."""
        return max(1, self.tp_size // max(1, self.ep_size))

    @property
    def intermediate_per_rank(self) -> int:
        return self.intermediate_size // self.moe_tp_size

    @property
    def expert_remap(self) -> bool:
        return self.enable_eplb or self.num_redundant_experts > 0 or self.init_expert_location != "trivial"

    @property
    def checkpoint(self) -> Checkpoint:
        return Checkpoint(
            self.quantization,
            self.weight_block_size,
            self.quant_scheme,
            self.activation_scheme,
            self.fp4_experts,
            self.online_quantization,
        )

    def weight_format(self) -> tuple[WeightFormat | None, str]:
        """(format, its title) — format None (and why) when the plugin does not prepare this checkpoint."""
        return for_checkpoint(self.checkpoint)


@dataclass(frozen=True)
class DeviceInfo:
    #: compute capability as an SM number (100, 103, 120, 90, ...); None = no GPU known
    sm: int | None
    flashinfer_version: str | None = None
    #: where `sm` came from ("sglang-platform", "torch.cuda", "cli", ...)
    source: str = ""

    @property
    def sm100_family(self) -> bool:
        return self.sm is not None and self.sm // 10 == 10


@dataclass(frozen=True)
class Eligibility:
    eligible: bool
    code: str
    reason: str
    backend: str = ""


@dataclass
class Resolution:
    #: the backend SGLang should use ("auto" = SGLang decides per layer, as upstream)
    winner: str
    candidates: list[Eligibility]
    fingerprint: dict
    code: str = ""
    reason: str = ""
    requested: str = "auto"
    #: what SGLang had decided before the plugin looked (None when unknown, e.g. `explain` without SGLang)
    upstream: str | None = None

    @property
    def changed(self) -> bool:
        return self.upstream is not None and self.winner != self.upstream

    def to_dict(self) -> dict:
        return {
            "winner": self.winner,
            "code": self.code,
            "reason": self.reason,
            "requested": self.requested,
            "upstream": self.upstream,
            "changed": self.changed,
            "candidates": [asdict(c) for c in self.candidates],
            "fingerprint": self.fingerprint,
        }
