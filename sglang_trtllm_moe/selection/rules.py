"""Which TRT-LLM-Gen MoE backend can serve a MoE problem, and why not — one pure function per question.

Modelled on TensorRT-LLM's `can_implement(problem, deployment) -> MoEEligibility` / `MoEResolutionReport`:
"degradation is allowed, silence is not". `can_implement` answers for one backend with a reason code and a
sentence; `resolve` walks the candidates in preference order and keeps SGLang's own answer when none fits. What a
format serves (quantizations per backend, activations, alignment) is the format's own declaration (formats/); what
is here is about the deployment:
* the kernels are built for SM 10.x only on the trtllm-gen path SGLang uses (SM12x has other kernels, SM90 none);
* the routed variant takes precomputed top-k, so it is the one that works when experts are remapped (EPLB,
  redundant experts) or when an A2A dispatch has already routed the tokens;
* only the `none` and `flashinfer` A2A backends have a fused func for these runners (sglang#24502: deepep has none);
* with `--enable-return-routed-experts`, the in-kernel router must report the experts it picked: flashinfer's kernels
  do from a version per routing method (kernel_api.ROUTING_REPLAY_SINCE); elsewhere the routed variant is the one
  that works (SGLang's own top-k routes and captures).
"""

from __future__ import annotations

import re

from .. import env
from ..formats import BACKENDS, TRTLLM, TRTLLM_ROUTED
from ..kernel_api import RoutingMethodType, replays_routing
from .problem import DeviceInfo, Eligibility, MoeProblem, Resolution

ENV_AUTO = "SGLANG_TRTLLM_MOE_AUTO"


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
    ROUTING_REPLAY_UNSUPPORTED = "ROUTING_REPLAY_UNSUPPORTED"
    # resolution-level outcomes
    AUTO_SELECTED = "AUTO_SELECTED"
    UPSTREAM_AGREES = "UPSTREAM_AGREES"
    EXPLICIT = "EXPLICIT"
    AUTO_DISABLED = "AUTO_DISABLED"
    NOT_SM100 = "NOT_SM100"
    UPSTREAM_MODEL_RULE = "UPSTREAM_MODEL_RULE"
    NO_ELIGIBLE_BACKEND = "NO_ELIGIBLE_BACKEND"
    NO_FUSED_MOE = "NO_FUSED_MOE"
    WEIGHT_CACHE_KEEPS_UPSTREAM = "WEIGHT_CACHE_KEEPS_UPSTREAM"


#: A2A backends with a registered fused func for these runners (FusedOpPool keys in 0.5.23:
#: `moe_runner/flashinfer_trtllm.py` registers ("none" | "flashinfer", "flashinfer_trtllm(_routed)") only).
A2A_OK = {"none", "flashinfer"}

#: Why each other A2A backend SGLang offers (`--moe-a2a-backend` choices of 0.5.11 - 0.5.23, and the enum's
#: `customized`) cannot feed the TRT-LLM-Gen runners: SGLang looks the pair (a2a, runner) up in its FusedOpPool when
#: it builds a MoE layer and raises NotImplementedError where none is registered (0.5.23 `moe_runner/runner.py`
#: 168-181). Read from 0.5.23's `arg_groups/moe_hook.py` `handle_a2a_moe` and `layers/moe/token_dispatcher/`.
#: tests/test_selection.py fails for a choice of the installed release that is missing here.
A2A_REJECTIONS: dict[str, str] = {
    "deepep": "DeepEP dispatches in its own normal / low-latency formats and SGLang has no fused func that hands "
    "them to the TRT-LLM runners (sglang#24502: 'FLASHINFER_TRTLLM requires a fused func for a2a backend deepep'); "
    "with DeepEP SGLang runs deep_gemm (or flashinfer_cutedsl for NVFP4, low-latency mode)",
    "deepep_v2": "SGLang runs DeepEP v2 with --moe-runner-backend deep_gemm only (it refuses every other runner: "
    "moe_runner/runner.py, arg_groups/moe_hook.py)",
    "mooncake": "Mooncake EP dispatches in DeepEP's low-latency format (deepep_ll), which no TRT-LLM fused func takes",
    "nixl": "NIXL EP dispatches in DeepEP's low-latency format (deepep_ll), which no TRT-LLM fused func takes",
    "mori": "MoRI EP is the AMD ROCm dispatcher (DeepEP normal format into aiter experts), not an SM100 path",
    "pplx": "pplx-kernels' dispatch runs SGLang's masked DeepGEMM path only (SGLang resolves auto to deep_gemm and "
    "refuses other runners)",
    "ascend_fuseep": "Ascend NPU only (FuseEP bypasses the MoE runners)",
    "ascend_tp": "Ascend NPU only",
    "megamoe": "MegaMoE fuses dispatch, experts and combine in DeepGEMM's kernel over symmetric memory: no MoE runner "
    "runs the experts",
    "flashinfer_megamoe": "FlashInfer MegaMoE replaces the MoE runner (SGLang requires --moe-runner-backend "
    "flashinfer_megamoe with it)",
    "customized": "a dispatcher registered in code: SGLang registers no TRT-LLM fused func for it",
}

#: Non-gated activations need flashinfer's `activation_type` argument (first pinned by SGLang 0.5.11).
MIN_FLASHINFER_NON_GATED = (0, 6, 8)

SPEC_DRAFT_WHY = (
    "speculative draft (NextN/MTP) MoE layers keep upstream's choice: they are usually unquantized BF16 with "
    "their own shapes, and the trtllm BF16 batched GEMM on draft layers has an open illegal-memory-access bug "
    "(sglang#30209; the default that would fix it, #30210, is not merged) — the plugin does not widen that exposure"
)


def weight_cache_why(mode: str) -> str:
    """Why the plugin cannot serve a process that maps its weights from SGLang's weight cache (0.5.17+)."""
    return (
        f"--weight-cache-mode {mode}: SGLang maps this process's weights from its weight-cache daemon and skips "
        "process_weights_after_loading (weight_cache/ipc_loader.py), and the daemon prepares them with SGLang's own "
        "code without loading plugins (weight_cache/daemon.py): the plugin can neither prepare nor watch these "
        "layers, and the daemon resolves the MoE runner without the plugin, so the plugin must not move it; SGLang "
        "also refuses online weight updates in this mode (use --weight-cache-mode off for RL)"
    )


def _version_tuple(v: str) -> tuple[int, ...]:
    """Release numbers only ("0.7.2.post1" -> (0, 7, 2), "0.6.8rc1" -> (0, 6, 8)); no packaging import needed."""
    m = re.match(r"\d+(?:\.\d+)*", v.strip())
    return tuple(int(x) for x in m.group(0).split(".")) if m else ()


def _flashinfer_a2a_has_trtllm() -> bool:
    """The installed SGLang runs FlashInfer A2A on the TRT-LLM routed runner (any release, when none is installed:
    the rules then describe the newest)."""
    from ..compat import features
    from ..compat.releases import installed_version

    return installed_version() is None or features.FLASHINFER_A2A_TRTLLM_ROUTED.present()


def a2a_instead() -> str:
    """What serves expert parallelism on the TRT-LLM-Gen kernels on the installed release."""
    if _flashinfer_a2a_has_trtllm():
        return (
            f"for expert parallelism on the TRT-LLM-Gen kernels use --moe-a2a-backend none ({TRTLLM}) or "
            f"--moe-a2a-backend flashinfer ({TRTLLM_ROUTED})"
        )
    return (
        f"for expert parallelism on the TRT-LLM-Gen kernels use --moe-a2a-backend none ({TRTLLM}); FlashInfer A2A "
        f"reaches {TRTLLM_ROUTED} from SGLang 0.5.15"
    )


def can_implement(backend: str, problem: MoeProblem, device: DeviceInfo) -> Eligibility:
    """Can `backend` serve `problem` on `device`, with the plugin's weight preparation? First failing rule wins."""

    def no(code: str, reason: str) -> Eligibility:
        return Eligibility(False, code, reason, backend)

    p = problem
    if backend not in BACKENDS:
        return no(Code.UNKNOWN_BACKEND, f"{backend!r} is not a TRT-LLM-Gen MoE backend ({', '.join(BACKENDS)})")
    if not device.sm100_family:
        where = f"SM{device.sm}" if device.sm is not None else "no CUDA GPU"
        extra = (
            " (SM12x has its own kernels, served by flashinfer_cutlass)" if device.sm and device.sm // 10 == 12 else ""
        )
        return no(Code.SM_UNSUPPORTED, f"TRT-LLM-Gen MoE kernels need an SM 10.x GPU; this is {where}{extra}")
    if device.flashinfer_version is None:
        return no(Code.FLASHINFER_MISSING, "flashinfer-python is not installed: the fused MoE kernels come from it")
    if not p.gated and _version_tuple(device.flashinfer_version) < MIN_FLASHINFER_NON_GATED:
        need = ".".join(map(str, MIN_FLASHINFER_NON_GATED))
        return no(
            Code.FLASHINFER_TOO_OLD,
            f"non-gated {p.activation} needs flashinfer >= {need} "
            f"(activation_type); installed {device.flashinfer_version}",
        )
    if p.speculative_draft:
        return no(Code.SPEC_DRAFT_KEEPS_UPSTREAM, SPEC_DRAFT_WHY)

    # what the weight format serves: its own named predicates (formats/), each answer under its reason code
    fmt, fmt_why = p.weight_format()
    if fmt is None:
        return no(Code.QUANT_UNSUPPORTED, fmt_why)
    for code, (ok, why) in (
        (Code.QUANT_UNSUPPORTED_BY_BACKEND, fmt.supports_backend(backend, p.checkpoint)),
        (Code.ACTIVATION_UNSUPPORTED, fmt.supports_activation(p.activation, p.gated)),
        (Code.HIDDEN_ALIGNMENT, fmt.supports_hidden(p.hidden_size, p.gated)),
    ):
        if not ok:
            return no(code, why or code)
    if p.intermediate_size % p.moe_tp_size:
        return no(
            Code.INTERMEDIATE_SPLIT,
            f"intermediate {p.intermediate_size} does not split over MoE-TP {p.moe_tp_size} "
            f"(tp {p.tp_size} / ep {p.ep_size})",
        )
    ip = p.intermediate_per_rank
    ok, why = fmt.supports_intermediate(ip, p.gated)
    if not ok:
        return no(Code.BLOCK_ALIGNMENT, why or Code.BLOCK_ALIGNMENT)
    if p.num_experts % max(1, p.ep_size):
        return no(Code.EXPERT_SPLIT, f"{p.num_experts} experts do not split over EP {p.ep_size}")

    if p.a2a_backend == "flashinfer" and not _flashinfer_a2a_has_trtllm():
        return no(
            Code.A2A_UNSUPPORTED,
            "this SGLang release runs --moe-a2a-backend flashinfer on flashinfer_cutlass only (its "
            "_handle_a2a_moe asserts it; the TRT-LLM routed runner behind FlashInfer A2A arrives in 0.5.15); "
            + a2a_instead(),
        )
    if p.a2a_backend not in A2A_OK:
        why = A2A_REJECTIONS.get(
            p.a2a_backend,
            "SGLang registers no fused func for it with these runners (a backend this plugin release does not know)",
        )
        return no(
            Code.A2A_UNSUPPORTED,
            f"--moe-a2a-backend {p.a2a_backend} has no fused func for {backend}: {why}; {a2a_instead()}",
        )
    if backend == TRTLLM and p.a2a_backend == "flashinfer":
        return no(
            Code.A2A_NEEDS_ROUTED,
            "the FlashInfer A2A dispatch delivers top-k ids and weights, so experts run through the routed "
            f"kernel ({TRTLLM_ROUTED}); SGLang itself switches to it once a dispatch type is set",
        )
    if backend == TRTLLM and p.expert_remap:
        return no(
            Code.EXPERT_REMAP_NEEDS_ROUTED,
            f"{TRTLLM} routes inside the kernel and cannot apply the EPLB / redundant-expert remap "
            f"(as SGLang 0.5.23 does for Nemotron-H, use {TRTLLM_ROUTED})",
        )

    if backend == TRTLLM and p.return_routed_experts and not _replays(p, device):
        method = RoutingMethodType(p.routing_method).name if p.routing_method is not None else None
        return no(
            Code.ROUTING_REPLAY_UNSUPPORTED,
            f"--enable-return-routed-experts needs the experts {TRTLLM}'s in-kernel router picked, and flashinfer "
            f"{device.flashinfer_version}'s kernels do not report them (routing_replay_out) for "
            + (
                f"{method} routing"
                if method
                else f"this model's routing ({p.architecture or 'unknown'} is not "
                "in the plugin's routing table, and this flashinfer reports some methods only)"
            )
            + f"; {TRTLLM_ROUTED} routes with SGLang's own top-k, which captures them",
        )

    ipad = fmt.padded_intermediate(ip, p.gated)
    align = fmt.intermediate_align[0 if p.gated else 1]
    pad = f", padded to {ipad} (multiple of {align})" if ipad != ip else ""
    act = f"{'gated' if p.gated else 'non-gated'} {p.activation}"
    return Eligibility(
        True,
        Code.OK,
        f"{fmt_why}, {act}, H {p.hidden_size}, I/rank {ip}{pad}, "
        f"{p.num_experts} experts / EP {p.ep_size}, a2a {p.a2a_backend}",
        backend,
    )


def _replays(p: MoeProblem, device: DeviceInfo) -> bool:
    """Does the fused runner report the experts it routed for this problem on this device (the emulator always)?"""
    return env.emulating() or replays_routing(device.flashinfer_version, p.routing_method)


def candidate_order(problem: MoeProblem) -> tuple[str, ...]:
    """Preference: the in-kernel-routing runner, unless tokens arrive already routed or experts are remapped."""
    if problem.expert_remap or problem.a2a_backend == "flashinfer":
        return (TRTLLM_ROUTED, TRTLLM)
    return (TRTLLM, TRTLLM_ROUTED)


def auto_enabled() -> bool:
    return env.flag(ENV_AUTO, default=True)


def resolve(
    problem: MoeProblem, device: DeviceInfo, requested: str = "auto", upstream: str | None = None
) -> Resolution:
    """The report for one MoE problem: every candidate's eligibility and the backend to use.

    `requested` is what the user asked for (`--moe-runner-backend`); `upstream` is what SGLang decided on its own
    before the plugin looked ("auto" when no rule of its own fired). Policy: a model SGLang builds without FusedMoE
    layers gets no winner (NO_FUSED_MOE: nothing would run it); an explicit choice is never overridden; with the weight
    cache on, SGLang's choice stands (WEIGHT_CACHE_KEEPS_UPSTREAM); SGLang's own
    model rules that picked something other than a TRT-LLM runner are kept; otherwise, on SM 10.x, the first eligible
    candidate wins, and SGLang's answer is kept when there is none.
    """
    from .report import env_fingerprint

    base = upstream if upstream is not None else requested
    if problem.no_fused_moe:
        # no layer would run a MoE runner: no candidate to weigh, no winner to name; SGLang's value stands unused
        return Resolution(
            base,
            [],
            env_fingerprint(device),
            Code.NO_FUSED_MOE,
            f"{problem.no_fused_moe}: no MoE runner backend applies (--moe-runner-backend {base} "
            f"has no effect); the plugin prepares nothing",
            requested,
            upstream,
        )
    cands = [can_implement(b, problem, device) for b in candidate_order(problem)]
    eligible = [c for c in cands if c.eligible]

    def done(winner: str, code: str, reason: str) -> Resolution:
        return Resolution(winner, cands, env_fingerprint(device), code, reason, requested, upstream)

    if requested != "auto":
        return done(
            requested, Code.EXPLICIT, f"--moe-runner-backend {requested} was asked for explicitly: never overridden"
        )
    if not auto_enabled():
        return done(base, Code.AUTO_DISABLED, f"{ENV_AUTO}=0: auto-selection is off, SGLang's choice ({base}) stands")
    if problem.weight_cache_mode not in ("", "off"):
        why = weight_cache_why(problem.weight_cache_mode)
        return done(base, Code.WEIGHT_CACHE_KEEPS_UPSTREAM, f"{why}; SGLang's choice ({base}) stands")
    if problem.speculative_draft:
        return done(base, Code.SPEC_DRAFT_KEEPS_UPSTREAM, SPEC_DRAFT_WHY)
    if not device.sm100_family:
        if device.sm is None:
            why = "no CUDA GPU on this machine (the TRT-LLM-Gen kernels need SM 10.x)"
        else:
            why = f"SM{device.sm} is not SM 10.x"
        return done(base, Code.NOT_SM100, f"{why}: SGLang's choice ({base}) stands")
    if upstream is not None and upstream not in ("auto", *BACKENDS):
        fmt, _ = problem.weight_format()
        also = (
            f"; {upstream} runs the TRT-LLM-Gen kernels on {fmt.title} weights the plugin prepares in place"
            if fmt is not None and fmt.own_backend == upstream
            else ""
        )
        return done(
            upstream, Code.UPSTREAM_MODEL_RULE, f"SGLang's own rule for this model chose {upstream}: kept{also}"
        )
    if not eligible:
        first = cands[0]
        return done(
            base,
            Code.NO_ELIGIBLE_BACKEND,
            f"no TRT-LLM-Gen backend can serve this layer ({first.code}: {first.reason}); "
            f"SGLang's choice ({base}) stands",
        )
    if upstream in BACKENDS and any(c.backend == upstream for c in eligible):
        return done(upstream, Code.UPSTREAM_AGREES, f"SGLang already chose {upstream}, which is eligible")
    winner = eligible[0]
    why = f"{winner.backend} is eligible on SM{device.sm}: {winner.reason}"
    if upstream in BACKENDS:
        rejected = next(c for c in cands if c.backend == upstream)
        why = f"SGLang chose {upstream}, which cannot work ({rejected.code}); {why}"
    return done(winner.backend, Code.AUTO_SELECTED, why)
