"""The environment that decides an answer, and how a decision is told: one log line, a report, a fingerprint."""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import json
import logging
import os

from .. import PROJECT_NAME, __version__
from .problem import DeviceInfo, MoeProblem, Resolution

logger = logging.getLogger(PROJECT_NAME)


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
    """What decides the answer besides the model: compare across ranks to find why two nodes diverged. The id hashes
    the plugin, SGLang and flashinfer versions, the SM and the SGLANG_TRTLLM_MOE_* environment — not where the SM was
    read (`sm_source`: SGLang's platform in a server, `--sm` or torch in `explain`), so `explain --sm N` in the
    server's environment gives the server's id."""
    env = {k: os.environ[k] for k in sorted(os.environ) if k.startswith("SGLANG_TRTLLM_MOE_")}
    fp = {
        "plugin": __version__,
        "sglang": _dist_version("sglang"),
        "flashinfer": device.flashinfer_version,
        "sm": device.sm,
        "env": env,
    }
    fp["id"] = hashlib.sha1(json.dumps(fp, sort_keys=True).encode()).hexdigest()[:12]
    fp["sm_source"] = device.source
    return fp


def log_decision(res: Resolution, problem: MoeProblem, what: str = "MoE") -> None:
    """Exactly one line per decision (INFO when the plugin changed SGLang's answer or kept it for a reason)."""
    rejected = "; ".join(f"{c.backend}: {c.code}" for c in res.candidates if not c.eligible) or "none"
    logger.info(
        "sglang-trtllm-moe: %s %s (%s, H %d, I %d, %d experts, tp %d, ep %d, a2a %s): moe_runner_backend=%s "
        "[%s] %s | rejected: %s | fingerprint %s",
        problem.architecture or "model",
        what,
        problem.quantization or "bf16",
        problem.hidden_size,
        problem.intermediate_size,
        problem.num_experts,
        problem.tp_size,
        problem.ep_size,
        problem.a2a_backend,
        res.winner,
        res.code,
        res.reason,
        rejected,
        res.fingerprint.get("id"),
    )


def format_report(res: Resolution) -> str:
    if res.code == "NO_FUSED_MOE":  # rules.Code.NO_FUSED_MOE (rules imports this module): no winner to name
        lines = [f"no FusedMoE layer  [{res.code}]", f"  {res.reason}"]
    else:
        lines = [f"winner: {res.winner}  [{res.code}]", f"  {res.reason}"]
    if res.upstream is not None:
        lines.append(f"  SGLang alone: {res.upstream}")
    lines.append("candidates:")
    for c in res.candidates:
        mark = "eligible" if c.eligible else "rejected"
        lines.append(f"  {c.backend:<26} {mark:<8} {c.code}: {c.reason}")
    fp = res.fingerprint
    lines.append(
        f"environment: {fp['id']}  plugin {fp['plugin']}, sglang {fp['sglang']}, flashinfer {fp['flashinfer']}, "
        f"SM {fp['sm']} ({fp['sm_source']}), env {fp['env'] or '{}'}"
    )
    return "\n".join(lines)
