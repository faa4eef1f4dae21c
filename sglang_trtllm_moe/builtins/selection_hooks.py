"""Auto-select flashinfer_trtllm(_routed) where SGLang resolves `--moe-runner-backend`.

Target (0.5.23): a BEFORE hook on `sglang.srt.arg_groups.moe_hook.handle_moe_kernel_config`, the pipeline step
that resolves the MoE runner from quantization. Why there and not elsewhere:
* every model-specific rule has already run (`handle_model_specific_adjustments` and its override registry come
  earlier in `pipeline.run_resolution_pipeline`), so we see what SGLang decided on its own and only fill the gap;
* the step itself then runs SGLang's quantization rules, its per-runner asserts and the shared-expert-fusion
  disable on *our* choice — the plugin's pick is validated by SGLang's own code, not trusted;
* the pipeline imports the step at call time and calls it through `run_hook`, which keys on `__name__`
  (HookRegistry's wrapper keeps it), so the hook lands whether or not `moe_hook` was imported before
  `load_plugins()`; `register_model_override` would not see explicit-vs-derived "auto" or the a2a/EPLB fields
  the same way, and per-arch providers would have to be registered for every architecture.
The choice is written with `declare_resolution` (SGLang's own provenance stash), never by mutating the record.
That is 0.5.19+. On 0.5.11-0.5.18 the same step is the method `ServerArgs._handle_moe_kernel_config` inside
`__post_init__` (same position: after the model rules, before SGLang's own quantization rules and asserts); on
0.5.15-0.5.18 the choice goes into the declaration stash the way SGLang's post-process passes write, on 0.5.11-0.5.14
into the field the way that release's own rules write (their model rules overwrite the field first, so what the
user asked for is recorded BEFORE `_handle_model_specific_adjustments`). The per-release difference (step,
write-back, platform fake) is `compat.platform` (ADAPTERS and its flags); `decide` is one function for all.
"""

from __future__ import annotations

import logging
from typing import Any

from .. import PROJECT_NAME, hookimpl
from ..selection import (
    Code,
    DeviceInfo,
    Resolution,
    flashinfer_version,
    log_decision,
    problem_from_hf_config,
    resolve,
)
from ..targets import HookTarget

logger = logging.getLogger(PROJECT_NAME)

SOURCE = "sglang_trtllm_moe.auto_select"

#: Every decision made in this process (target and draft), newest last: for `explain` and tests.
DECISIONS: list[dict] = []


def _problem(server_args: Any, draft: bool = False):
    from ..compat.platform import model_config_of, resolved_view, weight_cache_mode

    view = resolved_view(server_args)
    model_config = model_config_of(server_args)
    quant = view.quantization or getattr(model_config, "quantization", None)
    a2a = view.speculative_moe_a2a_backend if draft and view.speculative_moe_a2a_backend else view.moe_a2a_backend
    # A2A backends make EP span the TP group (SGLang declares that one step later, in handle_a2a_moe).
    ep = view.tp_size if a2a not in (None, "none") else view.ep_size
    return problem_from_hf_config(
        model_config.hf_config,
        quantization=quant,
        tp_size=view.tp_size,
        ep_size=ep,
        a2a_backend=a2a or "none",
        enable_eplb=bool(view.enable_eplb),
        num_redundant_experts=int(view.ep_num_redundant_experts or 0),
        init_expert_location=str(view.init_expert_location or "trivial"),
        speculative_draft=draft,
        return_routed_experts=bool(getattr(view, "enable_return_routed_experts", False)),
        weight_cache_mode=weight_cache_mode(view),
    ), view


def device_from_sglang() -> DeviceInfo:
    """The device as SGLang's platform facts describe it (`compat.platform.sm_from_sglang`: honours
    `override_platform` / the rebound probes), with the installed flashinfer."""
    from ..compat.platform import sm_from_sglang

    sm, source = sm_from_sglang()
    return DeviceInfo(sm=sm, flashinfer_version=flashinfer_version(), source=source)


def decide(server_args: Any) -> Resolution | None:
    """Look at the half-resolved ServerArgs, declare the plugin's choice, return the report (None: not MoE)."""
    from ..compat.platform import declare_choice, requested_field

    problem, view = _problem(server_args)
    if problem is None:
        return None
    requested = requested_field(server_args, "moe_runner_backend") or "auto"
    upstream = view.moe_runner_backend
    device = device_from_sglang()
    res = resolve(problem, device, requested=requested, upstream=upstream)
    log_decision(res, problem)
    DECISIONS.append({"what": "target", "problem": problem, **res.to_dict()})

    if res.code != Code.AUTO_SELECTED or res.winner == upstream:
        return res  # explicit, switched off, not SM 10.x, SGLang's own rule, or nothing eligible: SGLang's answer
    declare_choice(server_args, SOURCE, moe_runner_backend=res.winner)
    # The draft inherits the target's runner by default (_speculative_moe_runner_default); pin it to what it
    # would have inherited without us, so only the target moves.
    if view.speculative_algorithm is not None and view.speculative_moe_runner_backend is None:
        draft, _ = _problem(server_args, draft=True)
        dres = resolve(draft, device, requested="auto", upstream=upstream)
        log_decision(dres, draft, what="speculative draft MoE")
        DECISIONS.append({"what": "draft", "problem": draft, **dres.to_dict()})
        declare_choice(server_args, SOURCE, speculative_moe_runner_backend=dres.winner)
    return res


def before_handle_moe_kernel_config(server_args, *args, **kwargs):
    """BEFORE hook: decide, then let SGLang's step run (and validate) as usual. Never breaks resolution."""
    try:
        decide(server_args)
    except Exception as e:  # noqa: BLE001 - a bug here must leave SGLang's own resolution untouched
        logger.warning(
            "sglang-trtllm-moe: auto-selection skipped, SGLang's choice stands: %s: %s",
            type(e).__name__,
            e,
            exc_info=True,
        )
    try:
        say_stale_draft(server_args)
    except Exception as e:  # noqa: BLE001 - a note, never a reason to break resolution
        logger.debug("sglang-trtllm-moe: stale-draft note skipped: %s: %s", type(e).__name__, e)
    return None


def say_stale_draft(server_args) -> str | None:
    """At start-up, with a speculative draft on a release whose distributed update leaves it stale: the warning
    the update itself logs later (updates/stale_draft.py), before the first RL step."""
    from ..compat.platform import resolved_view
    from ..updates import stale_draft

    view = resolved_view(server_args)
    if view.speculative_algorithm is None or not stale_draft.has_draft_model(view.speculative_algorithm):
        return None
    text = stale_draft.note(stale_draft.draft_name(view))
    if text is not None:
        logger.warning("sglang-trtllm-moe: %s", text)
    return text


def before_model_rules(server_args, *args, **kwargs):
    """BEFORE hook (<= 0.5.14): what the user asked for, before SGLang's model rules assign the fields."""
    from ..compat.platform import record_requested

    try:
        record_requested(server_args)
    except Exception as e:  # noqa: BLE001 - never breaks resolution; the field is read instead
        logger.warning(
            "sglang-trtllm-moe: could not record the requested MoE runner backend: %s: %s", type(e).__name__, e
        )
    return None


@hookimpl
def register_sglang_hooks(register, release):
    from ..compat import features
    from ..compat.platform import ADAPTERS, RECORD_TARGET

    register(
        HookTarget(
            target=RECORD_TARGET,
            hook=before_model_rules,
            hook_type="before",
            releases=features.SERVER_ARGS_FIELD_WRITES.releases,
            capability="auto-select",
            why="record --moe-runner-backend before SGLang's model rules overwrite it (explicit vs auto)",
        )
    )

    for a in ADAPTERS:  # one resolution step per release range; the decision is the same everywhere
        register(
            HookTarget(
                target=a.hook_target,
                hook=before_handle_moe_kernel_config,
                hook_type="before",
                releases=a.releases,
                capability="auto-select",
                why="on SM 10.x with --moe-runner-backend auto, pick flashinfer_trtllm(_routed) wherever eligible",
            )
        )


__all__ = ["DECISIONS", "SOURCE", "before_handle_moe_kernel_config", "decide", "device_from_sglang"]
