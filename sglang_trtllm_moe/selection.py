"""Which TRT-LLM-Gen MoE backend can serve a MoE problem, and why not — one pure function per question.

Modelled on TensorRT-LLM's `can_implement(problem, deployment) -> MoEEligibility` / `MoEResolutionReport`:
"degradation is allowed, silence is not". `can_implement` answers for one backend with a reason code and a
sentence; `resolve` walks the candidates in preference order and keeps SGLang's own answer when none fits.
Nothing here imports SGLang or torch, so `explain` and the resolution hook share the same rules, and the rules
can be tested without a GPU. The SGLang-facing glue lives in `builtins/selection_hooks.py`.

Facts behind the rules (SGLang 0.5.23, flashinfer 0.7.2; see shared/reference):
* the kernels are built for SM 10.x only on the trtllm-gen path SGLang uses (SM12x has other kernels, SM90 none);
* formats the plugin prepares: NVFP4 (modelopt_fp4, compressed-tensors nvfp4), FP8 per-tensor (modelopt_fp8),
  FP8 128x128 block (fp8 + weight_block_size [128, 128]) and BF16;
* the routed variant takes precomputed top-k, so it is the one that works when experts are remapped (EPLB,
  redundant experts) or when an A2A dispatch has already routed the tokens; it accepts fewer quantizations
  (SGLang's own assert in `handle_moe_kernel_config`);
* only the `none` and `flashinfer` A2A backends have a fused func for these runners (sglang#24502: deepep has none).
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import json
import logging
import os
import re
from dataclasses import asdict, dataclass
from typing import Any, Mapping

from . import PROJECT_NAME, __version__

logger = logging.getLogger(PROJECT_NAME)

ENV_AUTO = "SGLANG_TRTLLM_MOE_AUTO"

TRTLLM = "flashinfer_trtllm"
TRTLLM_ROUTED = "flashinfer_trtllm_routed"
BACKENDS = (TRTLLM, TRTLLM_ROUTED)


class Code:
    """Reason codes (stable strings: logs, `explain --json` and tests match on them)."""

    OK = "OK"
    UNKNOWN_BACKEND = "UNKNOWN_BACKEND"
    SM_UNSUPPORTED = "SM_UNSUPPORTED"
    FLASHINFER_MISSING = "FLASHINFER_MISSING"
    FLASHINFER_TOO_OLD = "FLASHINFER_TOO_OLD"
    SPEC_DRAFT_KEEPS_UPSTREAM = "SPEC_DRAFT_KEEPS_UPSTREAM"
    QUANT_UNSUPPORTED = "QUANT_UNSUPPORTED"
    QUANT_UNSUPPORTED_BY_BACKEND = "QUANT_UNSUPPORTED_BY_BACKEND"
    ACTIVATION_UNSUPPORTED = "ACTIVATION_UNSUPPORTED"
    HIDDEN_ALIGNMENT = "HIDDEN_ALIGNMENT"
    INTERMEDIATE_SPLIT = "INTERMEDIATE_SPLIT"
    BLOCK_ALIGNMENT = "BLOCK_ALIGNMENT"
    EXPERT_SPLIT = "EXPERT_SPLIT"
    A2A_UNSUPPORTED = "A2A_UNSUPPORTED"
    A2A_NEEDS_ROUTED = "A2A_NEEDS_ROUTED"
    EXPERT_REMAP_NEEDS_ROUTED = "EXPERT_REMAP_NEEDS_ROUTED"
    # resolution-level outcomes
    AUTO_SELECTED = "AUTO_SELECTED"
    UPSTREAM_AGREES = "UPSTREAM_AGREES"
    EXPLICIT = "EXPLICIT"
    AUTO_DISABLED = "AUTO_DISABLED"
    NOT_SM100 = "NOT_SM100"
    UPSTREAM_MODEL_RULE = "UPSTREAM_MODEL_RULE"
    NO_ELIGIBLE_BACKEND = "NO_ELIGIBLE_BACKEND"


# --- what the kernels accept, per prepared weight format -------------------------------------------------------

#: (gated activations, non-gated activations) per format: SGLang 0.5.23's runner sets (`_SUPPORTED_FP4/FP8/BF16_
#: ACTIVATIONS`) intersected with the names `get_activation_type` maps for that gating. "situ" is left out on
#: purpose: it needs clamp parameters the plugin does not prepare.
ACTIVATIONS = {
    "nvfp4": ({"silu", "gelu"}, {"silu", "gelu", "relu2"}),
    "fp8_tensor": ({"silu"}, {"silu", "relu2"}),
    "fp8_block": ({"silu"}, {"silu", "relu2"}),
    "bf16": ({"silu"}, {"silu", "relu2"}),
}

#: Intermediate-per-rank padding (gated, non-gated) as the layer is actually allocated. NVFP4 gated: 64, because
#: the scale-row permutation asserts 2*Ip % 128 == 0 (flashinfer#3206, vllm#46880); SGLang's NVFP4 create_weights
#: pads to exactly that. Every other format: SGLang 0.5.23's FusedMoE rounds the per-rank intermediate up to 128 on
#: the trtllm path (fused_moe_triton/layer.py, per half for gated w13) although the kernels alone would accept 16
#: (FP8 per-tensor gated) or 64 (BF16 gated: w2's 128-byte block layout) — measured by the multi-rank tests. FP8
#: block cannot be padded past its scale blocks, so it must already be a multiple of 128 (checked separately).
INTERMEDIATE_ALIGN = {"nvfp4": (64, 128), "fp8_tensor": (128, 128), "fp8_block": (128, 128), "bf16": (128, 128)}

#: Hidden size must be a multiple of this (not padded by the plugin): w2's rows are the hidden dim and go through
#: the same 128-row scale/shuffle tiling. Conservative for BF16/FP8 per-tensor (they need 32/64); a rejection
#: only means SGLang keeps its own path.
HIDDEN_ALIGN = 128

#: Quantizations each runner accepts in SGLang 0.5.23 (`handle_moe_kernel_config` asserts), restricted to what
#: the plugin prepares. modelopt_fp8 and compressed-tensors have no routed path there.
BACKEND_QUANTS = {
    TRTLLM: {"modelopt_fp4", "compressed-tensors", "modelopt_fp8", "fp8", None},
    TRTLLM_ROUTED: {"modelopt_fp4", "fp8", None},
}

#: A2A backends with a registered fused func for these runners (FusedOpPool keys in 0.5.23).
A2A_OK = {"none", "flashinfer"}

#: Non-gated activations need flashinfer's `activation_type` argument (first pinned by SGLang 0.5.11).
MIN_FLASHINFER_NON_GATED = (0, 6, 8)

#: Architectures whose MoE experts are non-gated (a single up projection), and the config key of their activation.
NON_GATED_ARCHS = {
    "NemotronHForCausalLM": "mlp_hidden_act",
    "NemotronHPuzzleForCausalLM": "mlp_hidden_act",
    "NemotronH_Omni_Reasoning_V3": "mlp_hidden_act",
}

SPEC_DRAFT_WHY = (
    "speculative draft (NextN/MTP) MoE layers keep upstream's choice: they are usually unquantized BF16 with "
    "their own shapes, and the trtllm BF16 batched GEMM on draft layers has an open illegal-memory-access bug "
    "(sglang#30209; the default that would fix it, #30210, is not merged) — the plugin does not widen that exposure"
)


# --- the problem, the device, the answers -------------------------------------------------------------------


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
    weight_block_size: tuple[int, int] | None = None
    #: compressed-tensors: the scheme ("nvfp4", "w8a8_fp8", "int4", ...)
    quant_scheme: str | None = None
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

    def weight_format(self) -> tuple[str | None, str]:
        """(format, why) — format None when the plugin does not prepare this quantization."""
        q = self.quantization
        if q is None:
            return "bf16", "BF16 (unquantized)"
        if q == "modelopt_fp4":
            return "nvfp4", "NVFP4 (modelopt_fp4)"
        if q == "compressed-tensors":
            if self.quant_scheme == "nvfp4":
                return "nvfp4", "NVFP4 (compressed-tensors nvfp4)"
            return None, f"compressed-tensors scheme {self.quant_scheme or 'unknown'!r} is not NVFP4"
        if q == "modelopt_fp8":
            return "fp8_tensor", "FP8 per-tensor (modelopt_fp8)"
        if q == "fp8":
            if self.weight_block_size is not None and tuple(self.weight_block_size) == (128, 128):
                return "fp8_block", "FP8 128x128 block (fp8)"
            if self.weight_block_size is None:
                return None, "fp8 without weight_block_size (per-tensor/dynamic) is served only as modelopt_fp8"
            return None, f"fp8 with weight_block_size {list(self.weight_block_size)} (only [128, 128] is served)"
        return None, f"quantization {q!r} is not a format the plugin prepares"


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


# --- rules ------------------------------------------------------------------------------------------------------


def _version_tuple(v: str) -> tuple[int, ...]:
    """Release numbers only ("0.7.2.post1" -> (0, 7, 2), "0.6.8rc1" -> (0, 6, 8)); no packaging import needed."""
    m = re.match(r"\d+(?:\.\d+)*", v.strip())
    return tuple(int(x) for x in m.group(0).split(".")) if m else ()


def _round_up(x: int, m: int) -> int:
    return (x + m - 1) // m * m


def can_implement(backend: str, problem: MoeProblem, device: DeviceInfo) -> Eligibility:
    """Can `backend` serve `problem` on `device`, with the plugin's weight preparation? First failing rule wins."""

    def no(code: str, reason: str) -> Eligibility:
        return Eligibility(False, code, reason, backend)

    p = problem
    if backend not in BACKENDS:
        return no(Code.UNKNOWN_BACKEND, f"{backend!r} is not a TRT-LLM-Gen MoE backend ({', '.join(BACKENDS)})")
    if not device.sm100_family:
        where = f"SM{device.sm}" if device.sm is not None else "no CUDA GPU"
        extra = " (SM12x has its own kernels, served by flashinfer_cutlass)" if device.sm and device.sm // 10 == 12 else ""
        return no(Code.SM_UNSUPPORTED, f"TRT-LLM-Gen MoE kernels need an SM 10.x GPU; this is {where}{extra}")
    if device.flashinfer_version is None:
        return no(Code.FLASHINFER_MISSING, "flashinfer-python is not installed: the fused MoE kernels come from it")
    if not p.gated and _version_tuple(device.flashinfer_version) < MIN_FLASHINFER_NON_GATED:
        need = ".".join(map(str, MIN_FLASHINFER_NON_GATED))
        return no(Code.FLASHINFER_TOO_OLD, f"non-gated {p.activation} needs flashinfer >= {need} "
                                           f"(activation_type); installed {device.flashinfer_version}")
    if p.speculative_draft:
        return no(Code.SPEC_DRAFT_KEEPS_UPSTREAM, SPEC_DRAFT_WHY)

    fmt, fmt_why = p.weight_format()
    if fmt is None:
        return no(Code.QUANT_UNSUPPORTED, fmt_why)
    if p.quantization not in BACKEND_QUANTS[backend]:
        return no(Code.QUANT_UNSUPPORTED_BY_BACKEND, f"{backend} has no {fmt_why} path in SGLang")
    gated_acts, plain_acts = ACTIVATIONS[fmt]
    allowed = gated_acts if p.gated else plain_acts
    if p.activation not in allowed:
        kind = "gated" if p.gated else "non-gated"
        return no(Code.ACTIVATION_UNSUPPORTED,
                  f"{kind} {p.activation!r} is not supported for {fmt_why} (supported: {sorted(allowed)})")

    if p.hidden_size % HIDDEN_ALIGN:
        return no(Code.HIDDEN_ALIGNMENT, f"hidden size {p.hidden_size} is not a multiple of {HIDDEN_ALIGN}")
    if p.intermediate_size % p.moe_tp_size:
        return no(Code.INTERMEDIATE_SPLIT,
                  f"intermediate {p.intermediate_size} does not split over MoE-TP {p.moe_tp_size} "
                  f"(tp {p.tp_size} / ep {p.ep_size})")
    ip = p.intermediate_per_rank
    if fmt == "fp8_block" and ip % 128:
        return no(Code.BLOCK_ALIGNMENT,
                  f"intermediate per rank {ip} is not a multiple of the 128x128 FP8 scale block")
    if p.num_experts % max(1, p.ep_size):
        return no(Code.EXPERT_SPLIT, f"{p.num_experts} experts do not split over EP {p.ep_size}")

    if p.a2a_backend not in A2A_OK:
        return no(Code.A2A_UNSUPPORTED,
                  f"A2A backend {p.a2a_backend!r} has no fused func for {backend} "
                  f"(sglang#24502: 'FLASHINFER_TRTLLM requires a fused func for a2a backend deepep'); "
                  f"use --moe-a2a-backend flashinfer with {TRTLLM_ROUTED}")
    if backend == TRTLLM and p.a2a_backend == "flashinfer":
        return no(Code.A2A_NEEDS_ROUTED,
                  "the FlashInfer A2A dispatch delivers top-k ids and weights, so experts run through the routed "
                  f"kernel ({TRTLLM_ROUTED}); SGLang itself switches to it once a dispatch type is set")
    if backend == TRTLLM and p.expert_remap:
        return no(Code.EXPERT_REMAP_NEEDS_ROUTED,
                  f"{TRTLLM} routes inside the kernel and cannot apply the EPLB / redundant-expert remap "
                  f"(as SGLang 0.5.23 does for Nemotron-H, use {TRTLLM_ROUTED})")

    gated_align, plain_align = INTERMEDIATE_ALIGN[fmt]
    align = gated_align if p.gated else plain_align
    ipad = _round_up(ip, align)
    pad = f", padded to {ipad} (multiple of {align})" if ipad != ip else ""
    act = f"{'gated' if p.gated else 'non-gated'} {p.activation}"
    return Eligibility(True, Code.OK, f"{fmt_why}, {act}, H {p.hidden_size}, I/rank {ip}{pad}, "
                                      f"{p.num_experts} experts / EP {p.ep_size}, a2a {p.a2a_backend}", backend)


def candidate_order(problem: MoeProblem) -> tuple[str, ...]:
    """Preference: the in-kernel-routing runner, unless tokens arrive already routed or experts are remapped."""
    if problem.expert_remap or problem.a2a_backend == "flashinfer":
        return (TRTLLM_ROUTED, TRTLLM)
    return (TRTLLM, TRTLLM_ROUTED)


def auto_enabled() -> bool:
    return os.environ.get(ENV_AUTO, "1").strip().lower() not in ("0", "false", "no", "off")


def resolve(problem: MoeProblem, device: DeviceInfo, requested: str = "auto", upstream: str | None = None) -> Resolution:
    """The report for one MoE problem: every candidate's eligibility and the backend to use.

    `requested` is what the user asked for (`--moe-runner-backend`); `upstream` is what SGLang decided on its own
    before the plugin looked ("auto" when no rule of its own fired). Policy: an explicit choice is never
    overridden; SGLang's own model rules that picked something other than a TRT-LLM runner are kept; otherwise,
    on SM 10.x, the first eligible candidate wins, and SGLang's answer is kept when there is none.
    """
    cands = [can_implement(b, problem, device) for b in candidate_order(problem)]
    eligible = [c for c in cands if c.eligible]
    base = upstream if upstream is not None else requested

    def done(winner: str, code: str, reason: str) -> Resolution:
        return Resolution(winner, cands, env_fingerprint(device), code, reason, requested, upstream)

    if requested != "auto":
        return done(requested, Code.EXPLICIT, f"--moe-runner-backend {requested} was asked for explicitly: never overridden")
    if not auto_enabled():
        return done(base, Code.AUTO_DISABLED, f"{ENV_AUTO}=0: auto-selection is off, SGLang's choice ({base}) stands")
    if problem.speculative_draft:
        return done(base, Code.SPEC_DRAFT_KEEPS_UPSTREAM, SPEC_DRAFT_WHY)
    if not device.sm100_family:
        where = f"SM{device.sm}" if device.sm is not None else "no CUDA GPU"
        return done(base, Code.NOT_SM100, f"{where} is not SM 10.x: SGLang's choice ({base}) stands")
    if upstream is not None and upstream not in ("auto", *BACKENDS):
        return done(upstream, Code.UPSTREAM_MODEL_RULE,
                    f"SGLang's own rule for this model chose {upstream}: kept")
    if not eligible:
        first = cands[0]
        return done(base, Code.NO_ELIGIBLE_BACKEND,
                    f"no TRT-LLM-Gen backend can serve this layer ({first.code}: {first.reason}); "
                    f"SGLang's choice ({base}) stands")
    if upstream in BACKENDS and any(c.backend == upstream for c in eligible):
        return done(upstream, Code.UPSTREAM_AGREES, f"SGLang already chose {upstream}, which is eligible")
    winner = eligible[0]
    why = f"{winner.backend} is eligible on SM{device.sm}: {winner.reason}"
    if upstream in BACKENDS:
        rejected = next(c for c in cands if c.backend == upstream)
        why = f"SGLang chose {upstream}, which cannot work ({rejected.code}); {why}"
    return done(winner.backend, Code.AUTO_SELECTED, why)


# --- environment and reporting ------------------------------------------------------------------------------------


def flashinfer_version() -> str | None:
    """Installed flashinfer-python, without importing it (its import is slow and may probe CUDA)."""
    if importlib.util.find_spec("flashinfer") is None:
        return None
    for dist in ("flashinfer-python", "flashinfer"):
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return "unknown"


def _dist_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def env_fingerprint(device: DeviceInfo) -> dict:
    """What decides the answer besides the model: compare across ranks to find why two nodes diverged."""
    env = {k: os.environ[k] for k in sorted(os.environ) if k.startswith("SGLANG_TRTLLM_MOE_")}
    fp = {
        "plugin": __version__,
        "sglang": _dist_version("sglang"),
        "flashinfer": device.flashinfer_version,
        "sm": device.sm,
        "sm_source": device.source,
        "env": env,
    }
    fp["id"] = hashlib.sha1(json.dumps(fp, sort_keys=True).encode()).hexdigest()[:12]
    return fp


def log_decision(res: Resolution, problem: MoeProblem, what: str = "MoE") -> None:
    """Exactly one line per decision (INFO when the plugin changed SGLang's answer or kept it for a reason)."""
    rejected = "; ".join(f"{c.backend}: {c.code}" for c in res.candidates if not c.eligible) or "none"
    logger.info(
        "sglang-trtllm-moe: %s %s (%s, H %d, I %d, %d experts, tp %d, ep %d, a2a %s): moe_runner_backend=%s "
        "[%s] %s | rejected: %s | fingerprint %s",
        problem.architecture or "model", what, problem.quantization or "bf16", problem.hidden_size,
        problem.intermediate_size, problem.num_experts, problem.tp_size, problem.ep_size, problem.a2a_backend,
        res.winner, res.code, res.reason, rejected, res.fingerprint.get("id"),
    )


def format_report(res: Resolution) -> str:
    lines = [f"winner: {res.winner}  [{res.code}]", f"  {res.reason}"]
    if res.upstream is not None:
        lines.append(f"  SGLang alone: {res.upstream}")
    lines.append("candidates:")
    for c in res.candidates:
        mark = "eligible" if c.eligible else "rejected"
        lines.append(f"  {c.backend:<26} {mark:<8} {c.code}: {c.reason}")
    fp = res.fingerprint
    lines.append(f"environment: {fp['id']}  plugin {fp['plugin']}, sglang {fp['sglang']}, flashinfer {fp['flashinfer']}, "
                 f"SM {fp['sm']} ({fp['sm_source']}), env {fp['env'] or '{}'}")
    return "\n".join(lines)


# --- reading a HuggingFace config -------------------------------------------------------------------------------


def _get(cfg: Any, key: str, default: Any = None) -> Any:
    if isinstance(cfg, Mapping):
        return cfg.get(key, default)
    return getattr(cfg, key, default)


_ACT_ALIASES = {"swish": "silu", "gelu_pytorch_tanh": "gelu", "gelu_new": "gelu", "gelu_tanh": "gelu"}


def detect_quantization(quant_cfg: Mapping | None) -> tuple[str | None, tuple[int, int] | None, str | None]:
    """(SGLang quantization name, fp8 weight_block_size, compressed-tensors scheme) from `quantization_config`.

    Mirrors how SGLang's ModelConfig names the checkpoint's method (tests compare against it)."""
    if not quant_cfg:
        return None, None, None
    method = str(_get(quant_cfg, "quant_method", "") or "").lower()
    if method == "modelopt":
        algo = str(_get(quant_cfg, "quant_algo", "") or "").upper()
        if not algo and isinstance(_get(quant_cfg, "quantization"), Mapping):
            algo = str(_get(quant_cfg, "quantization").get("quant_algo", "")).upper()
        if algo == "NVFP4":
            return "modelopt_fp4", None, None
        if algo == "FP8":
            return "modelopt_fp8", None, None
        if algo == "MIXED_PRECISION":
            return "modelopt_mixed", None, None
        return "modelopt", None, None
    if method == "fp8":
        wbs = _get(quant_cfg, "weight_block_size")
        return "fp8", (tuple(int(x) for x in wbs) if wbs else None), None
    if method == "compressed-tensors":
        scheme = None
        for group in (_get(quant_cfg, "config_groups") or {}).values():
            w = (group or {}).get("weights") or {}
            bits, typ, gs = w.get("num_bits"), w.get("type"), w.get("group_size")
            if bits == 4 and typ == "float" and gs == 16:
                scheme = "nvfp4"
            elif bits == 8 and typ == "float":
                scheme = "w8a8_fp8"
            elif typ == "int":
                scheme = f"int{bits}"
            break
        return "compressed-tensors", None, scheme
    return method or None, None, None


def problem_from_hf_config(cfg: Any, *, quantization: str | None = None, **parallel: Any) -> MoeProblem | None:
    """A MoeProblem from a HuggingFace config (dict or PretrainedConfig); None for a model without routed experts.

    `quantization` overrides the checkpoint's (as `--quantization` does); `parallel` takes the MoeProblem
    fields tp_size, ep_size, a2a_backend, enable_eplb, num_redundant_experts, init_expert_location,
    speculative_draft."""
    text = _get(cfg, "text_config") or cfg
    archs = _get(cfg, "architectures") or _get(text, "architectures") or [""]
    arch = archs[0]
    experts = next((_get(text, k) for k in ("n_routed_experts", "num_experts", "num_local_experts", "moe_num_experts")
                    if _get(text, k)), None)
    inter = _get(text, "moe_intermediate_size") or _get(text, "intermediate_size")
    hidden = _get(text, "hidden_size")
    if not experts or not inter or not hidden:
        return None
    if arch in NON_GATED_ARCHS:
        gated, act = False, _get(text, NON_GATED_ARCHS[arch]) or "relu2"
    else:
        act = _get(text, "hidden_act") or _get(text, "hidden_activation") or "silu"
        gated = act != "relu2"
    act = _ACT_ALIASES.get(str(act), str(act))
    detected, block, scheme = detect_quantization(_get(cfg, "quantization_config") or _get(text, "quantization_config"))
    quant = quantization if quantization is not None else detected
    if quant == "modelopt" and detected and detected.startswith("modelopt_"):
        quant = detected
    return MoeProblem(
        hidden_size=int(hidden), intermediate_size=int(inter), num_experts=int(experts),
        top_k=int(_get(text, "num_experts_per_tok") or _get(text, "moe_topk") or 1),
        quantization=quant, weight_block_size=block if quant == "fp8" else None,
        quant_scheme=scheme if quant == "compressed-tensors" else None,
        activation=act, gated=gated, architecture=arch, **parallel,
    )


__all__ = [
    "BACKENDS", "Code", "DeviceInfo", "Eligibility", "MoeProblem", "Resolution", "auto_enabled", "can_implement",
    "candidate_order", "detect_quantization", "env_fingerprint", "flashinfer_version", "format_report",
    "log_decision", "problem_from_hf_config", "resolve",
]
