"""The README's user-facing support table, generated from the same compat-matrix results as docs/COMPAT.md.

Rows are what a user asks ("does FP8 RL updating work on my release?"), columns are release ranges (consecutive
releases whose answers are all the same), a cell is "yes", "no (SGLang lacks it)", "no (not yet)", "no (known
bug)", "broken" or "-" (not checked), with a note number where it is not a plain yes. The README keeps cells short
(`render`): a row is named by its label (the question up to its first " (" or ":"), the rows that are "yes" on every
release are one sentence, a note is cut at NOTE_CHARS. The detail goes to docs/COMPAT.md (`render_full`): every
row with its whole question and every note whole, next to the per-test matrix.

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
    ("serve INT4 W4A16 experts as Kimi-K2 ships them (compressed-tensors, group 32)", ("int4",)),
    ("non-gated relu2 experts (Nemotron-H)", ("relu2",)),
    ("RL update from disk", ("rl_disk",)),
    ("RL update from tensors (buckets, sessions)", ("rl_tensor",)),
    ("RL update of some experts only", ("rl_partial",)),
    ("RL update from concurrent loader threads", ("threads",)),
    ("a bad or failed weight update changes nothing (refused, or put back bit for bit)", ("nothing_lost",)),
    ("a MoE forward with 0 tokens (idle ranks, warm-up)", ("empty_forward",)),
    ("routed experts on flashinfer_trtllm (R3, --enable-return-routed-experts: the fused runner)", ("routed_experts",)),
    ("weight checker (snapshot / compare)", ("checker",)),
    ("weight checker checksum: hashes like SGLang alone holding the same weights unquantized", ("checksum",)),
    ("auto-select flashinfer_trtllm on SM100", ("auto",)),
    ("RL update over NCCL (update_weights_from_distributed)", ("rl_distributed",)),
    ("RL update by checkpoint-engine (update_weights_from_ipc buckets, then its post hook)", ("rl_ipc",)),
    (
        "RL update by a custom weight loader (verl's sparse delta sync: NaN-masked writes, verify sweep, failures "
        "answered and put back)",
        ("rl_custom_loader",),
    ),
    (
        "speculative-draft MoE layers (NextN / MTP): prepared like the target's, RL updates per runner selector",
        ("draft_moe",),
    ),
    ("a whole model on sglang.Engine (serve + RL updates end to end)", ("engine",)),
    (
        "RL update by P2P / RDMA writes in a session (loader-free: checked, laid out, refused values fenced)",
        ("loader_free",),
    ),
    (
        "boot a new instance from a running one (--load-format remote_instance, nccl / transfer_engine)",
        ("remote_instance",),
    ),
)

#: the longest note the README shows (the whole note is in docs/COMPAT.md)
NOTE_CHARS = 120

LEGEND = (
    "**yes**: proven on every release of the column (CPU, real SGLang objects, emulated kernels); **no (SGLang lacks "
    "it)**: that release does not have the feature; **-**: not checked there."
)

FULL_LEGEND = (
    "**yes**: works with the plugin on every release of the column (proven on CPU by the compat matrix with "
    "real SGLang objects and the kernel emulator). **no (SGLang lacks it)**: that SGLang release does not "
    "have the feature. **no (not yet)**: the plugin does not provide it on those releases yet. **no (known "
    "bug)** / **broken**: an expected failure / a failed test in the last matrix run. **-**: not checked on "
    "that release by the last matrix run."
)


def label(question: str) -> str:
    """A row's short name in the README: its question up to the first " (" or ":"."""
    return re.split(r" \(|:", question, maxsplit=1)[0].strip()


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
            return "no (known bug)", _note(c["detail"], "")
    statuses = {c["status"] for c in got}
    if statuses <= {"pass", "pass (partly n/a)"}:
        return "yes", ""
    if statuses <= {"no test", "not run"}:
        return "-", ""
    detail = "; ".join(c["detail"] for c in got if c["status"] not in ("pass", "pass (partly n/a)"))
    if "not provided by the plugin" in detail:
        return "no (not yet)", _note(detail, "not provided by the plugin")
    if "absent upstream" in detail:
        return "no (SGLang lacks it)", _note(detail, "absent upstream")
    return "-", _note(detail, "")


def _note(detail: str, after: str) -> str:
    """The user's note for a matrix reason: of the reasons given after `after`, the one whose requirement holds from
    the earliest release (a capability absent on a release is absent for its most basic requirement; the later ones
    only narrow what its tests can check)."""
    parts = detail.split(after + ":")[1:] if after and after + ":" in detail else [detail]
    reasons = []
    for p in parts:
        text, _, needs = p.partition(" (needs ")
        m = re.match(r">=\s*([0-9][0-9.]*[0-9])", needs)
        reasons.append((Version(m.group(1)) if m else Version("9999"), text.split(";")[0].strip()))
    return min(reasons, key=lambda r: r[0])[1]


def _short(note: str) -> str:
    return note if len(note) <= NOTE_CHARS else note[: NOTE_CHARS - 3].rstrip() + "..."


def _columns(data: dict) -> tuple[list[list[str]], dict[str, list[tuple[str, str]]]]:
    """(groups of consecutive releases answering every row alike, {release: [(answer, note) per row]})."""
    # one column per SGLang release range; a lane (a release with another flashinfer) is a maintainer's row
    releases = [r for r in data["releases"] if "capabilities" in r and not r.get("lane")]
    answers = {r["release"]: [_answer(r["capabilities"], keys) for _, keys in ROWS] for r in releases}
    groups: list[list[str]] = []
    for r in releases:
        rel = r["release"]
        if groups and [a for a, _ in answers[groups[-1][-1]]] == [a for a, _ in answers[rel]]:
            groups[-1].append(rel)
        else:
            groups.append([rel])
    return groups, answers


def _table(data: dict, full: bool) -> str:
    groups, answers = _columns(data)
    if not groups:
        return ""
    heads = [g[0] if len(g) == 1 else f"{g[0]} - {g[-1]}" for g in groups]
    lines = ["| SGLang release: | " + " | ".join(heads) + " |", "|---|" + "---|" * len(heads)]
    notes: list[str] = []
    everywhere: list[str] = []
    for i, (question, _) in enumerate(ROWS):
        row = [answers[g[-1]][i] for g in groups]
        if not full and all(a == "yes" for a, _ in row):
            everywhere.append(label(question))
            continue
        cells = []
        for answer, note in row:
            if note:
                note = note if full else _short(note)
                if note not in notes:
                    notes.append(note)
                answer += f" [{notes.index(note) + 1}]"
            cells.append(answer)
        lines.append(f"| {question if full else label(question)} | " + " | ".join(cells) + " |")
    out = "\n".join(lines) + "\n"
    if everywhere:
        out += f"\n**yes on every release {groups[0][0]} - {groups[-1][-1]}**: " + "; ".join(everywhere) + ".\n"
    if notes:
        out += "\n" + "\n".join(f"{i + 1}. {n}" for i, n in enumerate(notes)) + "\n"
    return out + "\n" + (FULL_LEGEND if full else LEGEND) + "\n"


def render(data: dict) -> str:
    """The README's table: short labels, the rows that are yes everywhere in one sentence, notes cut short."""
    return _table(data, full=False)


def render_full(data: dict) -> str:
    """docs/COMPAT.md's copy: every row with its whole question, every note whole."""
    return _table(data, full=True)


__all__ = ["FULL_LEGEND", "LEGEND", "NOTE_CHARS", "ROWS", "label", "render", "render_full"]
