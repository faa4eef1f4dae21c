"""The README's user-facing support table, generated from the same compat-matrix results as docs/COMPAT.md.

Rows are what a user asks ("does FP8 RL updating work on my release?"), columns are release ranges (consecutive
releases whose answers are all the same), a cell is "yes", "no — upstream lacks it", "no — not yet", "no — known
bug", "broken" or "-" (not checked), with one short note where it is not a plain yes. The per-test matrix with its
reasons stays in docs/COMPAT.md.

`python -m tests.support.matrix render` re-renders it (and docs/COMPAT.md) from docs/compat.json without running
anything; `ci/matrix` renders it after every run.
"""

from __future__ import annotations

import re

from packaging.version import Version

#: (question, capability keys of tests/support/matrix.py CAPABILITIES that answer it; all must hold)
ROWS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("serve NVFP4 MoE (ModelOpt, compressed-tensors)", ("nvfp4",)),
    ("serve online NVFP4 (--quantization nvfp4_online on a BF16 checkpoint), RL updates in BF16", ("nvfp4_online",)),
    ("serve FP8 MoE (per-tensor, DeepSeek 128x128 block)", ("fp8",)),
    ("serve BF16 MoE", ("bf16",)),
    ("serve MXFP8 MoE (quant_method mxfp8)", ("mxfp8",)),
    ("serve MXFP4 experts on an FP8 config (DeepSeek-V4, MiMo-V2; flashinfer_mxfp4)", ("mxfp4_experts",)),
    ("serve gpt-oss MXFP4 (flashinfer_mxfp4)", ("mxfp4_gptoss",)),
    ("non-gated relu2 experts (Nemotron-H)", ("relu2",)),
    ("RL update from disk", ("rl_disk",)),
    ("RL update from tensors (buckets, sessions)", ("rl_tensor",)),
    ("RL update of some experts only", ("rl_partial",)),
    ("RL update from concurrent loader threads", ("threads",)),
    ("a bad or failed weight update changes nothing (refused, or put back bit for bit)", ("nothing_lost",)),
    ("a MoE forward with 0 tokens (idle ranks, warm-up)", ("empty_forward",)),
    ("routed experts (R3, --enable-return-routed-experts) on the fused flashinfer_trtllm runner", ("routed_experts",)),
    ("weight checker (snapshot / compare)", ("checker",)),
    ("weight checker checksum: hashes like SGLang alone holding the same weights unquantized", ("checksum",)),
    ("auto-select flashinfer_trtllm on SM100", ("auto",)),
    ("RL update over NCCL (update_weights_from_distributed)", ("rl_distributed",)),
    ("RL update by checkpoint-engine (update_weights_from_ipc buckets, then its post hook)", ("rl_ipc",)),
    (
        "speculative-draft (NextN / MTP) MoE layers: prepared like the target's, RL updates per runner selector",
        ("draft_moe",),
    ),
    ("a whole model on sglang.Engine: serve + RL updates end to end", ("engine",)),
    (
        "RL update by P2P / RDMA writes in a session (loader-free: checked, laid out, refused values fenced)",
        ("loader_free",),
    ),
    (
        "boot a new instance from a running one (--load-format remote_instance, nccl / transfer_engine)",
        ("remote_instance",),
    ),
)

LEGEND = (
    "**yes**: works with the plugin on every release of the column (proven on CPU by the compat matrix with "
    "real SGLang objects and the kernel emulator). **no — upstream lacks it**: that SGLang release does not "
    "have the feature. **no — not yet**: the plugin does not provide it on those releases yet. **no — known "
    "bug** / **broken**: an expected failure / a failed test in the last matrix run. **-**: not checked on "
    "that release by the last matrix run (the per-test details: [docs/COMPAT.md](docs/COMPAT.md))."
)


def _answer(cells: dict, keys: tuple[str, ...]) -> tuple[str, str]:
    """(answer, note) for one release from its capability cells."""
    got = [cells[k] for k in keys if k in cells]
    if not got:
        return "-", ""
    for c in got:
        if c["status"] == "FAIL":
            return "broken", _note(c["detail"], "")
    for c in got:
        if c["status"] == "bug":
            return "no — known bug", _note(c["detail"], "")
    statuses = {c["status"] for c in got}
    if statuses <= {"pass", "pass (partly n/a)"}:
        return "yes", ""
    if statuses <= {"no test", "not run"}:
        return "-", ""
    detail = "; ".join(c["detail"] for c in got if c["status"] not in ("pass", "pass (partly n/a)"))
    if "not provided by the plugin" in detail:
        return "no — not yet", _note(detail, "not provided by the plugin")
    if "absent upstream" in detail:
        return "no — upstream lacks it", _note(detail, "absent upstream")
    return "-", _note(detail, "")


def _note(detail: str, after: str) -> str:
    """The user's note for a matrix reason, shortened: of the reasons given after `after`, the one whose requirement
    holds from the earliest release (a capability absent on a release is absent for its most basic requirement; the
    later ones only narrow what its tests can check)."""
    parts = detail.split(after + ":")[1:] if after and after + ":" in detail else [detail]
    reasons = []
    for p in parts:
        text, _, needs = p.partition(" (needs ")
        m = re.match(r">=\s*([0-9][0-9.]*[0-9])", needs)
        reasons.append((Version(m.group(1)) if m else Version("9999"), text.split(";")[0].strip()))
    text = min(reasons, key=lambda r: r[0])[1]
    return text[:160] + ("..." if len(text) > 160 else "")


def render(data: dict) -> str:
    # one column per SGLang release range; a lane (a release with another flashinfer) is a maintainer's row
    releases = [r for r in data["releases"] if "capabilities" in r and not r.get("lane")]
    if not releases:
        return ""
    answers = {r["release"]: [_answer(r["capabilities"], keys) for _, keys in ROWS] for r in releases}
    # columns: runs of consecutive releases with the same answers in every row
    groups: list[list[str]] = []
    for r in releases:
        rel = r["release"]
        if groups and [a for a, _ in answers[groups[-1][-1]]] == [a for a, _ in answers[rel]]:
            groups[-1].append(rel)
        else:
            groups.append([rel])
    heads = [g[0] if len(g) == 1 else f"{g[0]} - {g[-1]}" for g in groups]
    lines = ["| SGLang release: | " + " | ".join(heads) + " |", "|---|" + "---|" * len(heads)]
    notes: list[str] = []
    for i, (question, _) in enumerate(ROWS):
        cells = []
        for g in groups:
            answer, note = answers[g[-1]][i]
            if note:
                if note not in notes:
                    notes.append(note)
                answer += f" [{notes.index(note) + 1}]"
            cells.append(answer)
        lines.append(f"| {question} | " + " | ".join(cells) + " |")
    out = "\n".join(lines) + "\n"
    if notes:
        out += "\n" + "\n".join(f"{i + 1}. {n}" for i, n in enumerate(notes)) + "\n"
    return out + "\n" + LEGEND + "\n"


__all__ = ["LEGEND", "ROWS", "render"]
