"""The question selection answers — one MoE layer as the kernel sees it, and the device it would run on — and the
shape of its answers (one backend's eligibility, one resolution)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields, replace
from typing import Any

from ..formats import Checkpoint, WeightFormat, for_checkpoint

#: MoeProblem's keywords for the fields of its `checkpoint` (callers may pass them flat, as before it held one)
CHECKPOINT_KEYWORDS = {
    "quantization": "quantization",
    "weight_block_size": "weight_block_size",
    "quant_scheme": "quant_scheme",
    "activation_scheme": "activation_scheme",
    "fp4_experts": "fp4_experts",
    "online_quantization": "online",
}


@dataclass(frozen=True, init=False)
class MoeProblem:
    """One MoE layer as the kernel sees it. Sizes are the checkpoint's (before TP); per-rank sizes are derived.

    What the checkpoint's config says about its weights is one `formats.Checkpoint` (the format registry reads
    it). The constructor also takes its fields flat — `MoeProblem(..., quantization="fp8", weight_block_size=(128,
    128))` — and `dataclasses.replace(problem, quantization=...)` changes one of them; they read back as properties
    (`problem.quantization`)."""

    hidden_size: int
    intermediate_size: int
    num_experts: int
    top_k: int = 1
    #: what the checkpoint's config says about its MoE weights (None given = unquantized BF16)
    checkpoint: Checkpoint = Checkpoint()
    activation: str = "silu"
    gated: bool = True
    tp_size: int = 1
    ep_size: int = 1
    a2a_backend: str = "none"
    enable_eplb: bool = False
    num_redundant_experts: int = 0
    init_expert_location: str = "trivial"
    speculative_draft: bool = False
    #: --enable-return-routed-experts (R3): the in-kernel router must report the experts it routed each token to
    return_routed_experts: bool = False
    #: the routing method SGLang's model class declares (kernel_api.RoutingMethodType); None = not known here
    routing_method: int | None = None
    architecture: str = ""
    #: why SGLang builds this model without FusedMoE layers (no MoE runner backend applies); None = it builds them
    no_fused_moe: str | None = None
    #: --weight-cache-mode (SGLang 0.5.17+): "off", or "daemon" / "client" (weights mapped from SGLang's weight-cache
    #: daemon, process_weights_after_loading skipped: the plugin prepares nothing)
    weight_cache_mode: str = "off"

    def __init__(self, hidden_size: int, intermediate_size: int, num_experts: int, top_k: int = 1, **kw: Any):
        flat = {CHECKPOINT_KEYWORDS[k]: kw.pop(k) for k in list(kw) if k in CHECKPOINT_KEYWORDS}
        checkpoint = kw.pop("checkpoint", None) or Checkpoint()
        if flat:
            checkpoint = replace(checkpoint, **flat)
        values: dict[str, Any] = dict(
            hidden_size=hidden_size, intermediate_size=intermediate_size, num_experts=num_experts
        )
        values.update(top_k=top_k, checkpoint=checkpoint)
        for f in fields(self):
            if f.name in values:
                continue
            if f.name in kw:
                values[f.name] = kw.pop(f.name)
            else:
                values[f.name] = f.default
        if kw:
            raise TypeError(f"MoeProblem got unexpected keyword arguments {sorted(kw)}")
        for name, value in values.items():
            object.__setattr__(self, name, value)

    # the checkpoint's fields, as MoeProblem names them
    @property
    def quantization(self) -> str | None:
        """SGLang's quantization name (modelopt_fp4, modelopt_fp8, fp8, compressed-tensors, ...); None = BF16."""
        return self.checkpoint.quantization

    @property
    def weight_block_size(self) -> tuple[int, ...] | None:
        return self.checkpoint.weight_block_size

    @property
    def quant_scheme(self) -> str | None:
        return self.checkpoint.quant_scheme

    @property
    def activation_scheme(self) -> str | None:
        return self.checkpoint.activation_scheme

    @property
    def fp4_experts(self) -> bool:
        return self.checkpoint.fp4_experts

    @property
    def online_quantization(self) -> bool:
        return self.checkpoint.online

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

    def weight_format(self) -> tuple[WeightFormat | None, str]:
        """(format, its title) — format None (and why) when the plugin does not prepare this checkpoint."""
        return for_checkpoint(self.checkpoint)

    def to_dict(self) -> dict:
        """The problem as `explain --json` shows it: every field, the checkpoint's flat under MoeProblem's names."""
        out: dict = {}
        for f in fields(self):
            if f.name == "checkpoint":
                out.update({k: getattr(self.checkpoint, v) for k, v in CHECKPOINT_KEYWORDS.items()})
            else:
                out[f.name] = getattr(self, f.name)
        return out


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
