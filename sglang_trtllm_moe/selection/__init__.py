"""Auto-selection of the TRT-LLM-Gen MoE backend: the problem, the rules, the HF-config reader and the report.

Nothing here imports SGLang, so `explain` (offline) and the resolution hook (builtins/selection_hooks.py) share the
same rules, and the rules can be tested without a GPU. What each weight format serves is the format's declaration
(formats/): this package only adds the deployment (device, parallelism, A2A, EPLB) and the policy.
"""

from ..formats import BACKENDS, TRTLLM, TRTLLM_ROUTED
from .hf_config import NON_GATED_ARCHS, detect_quantization, problem_from_hf_config
from .problem import DeviceInfo, Eligibility, MoeProblem, Resolution
from .report import env_fingerprint, flashinfer_version, format_report, log_decision
from .rules import (
    A2A_OK,
    A2A_REJECTIONS,
    ENV_AUTO,
    MIN_FLASHINFER_NON_GATED,
    SPEC_DRAFT_WHY,
    Code,
    a2a_instead,
    auto_enabled,
    can_implement,
    candidate_order,
    resolve,
    weight_cache_why,
)

__all__ = [
    "A2A_OK",
    "A2A_REJECTIONS",
    "BACKENDS",
    "Code",
    "DeviceInfo",
    "ENV_AUTO",
    "Eligibility",
    "MIN_FLASHINFER_NON_GATED",
    "MoeProblem",
    "NON_GATED_ARCHS",
    "Resolution",
    "SPEC_DRAFT_WHY",
    "a2a_instead",
    "TRTLLM",
    "TRTLLM_ROUTED",
    "auto_enabled",
    "can_implement",
    "candidate_order",
    "detect_quantization",
    "env_fingerprint",
    "flashinfer_version",
    "format_report",
    "log_decision",
    "problem_from_hf_config",
    "resolve",
    "weight_cache_why",
]
