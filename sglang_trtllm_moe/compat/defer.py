"""Where SGLang's own preparation and reload are right, the plugin defers to them: the table, with its evidence.

For every weight format and SGLang release range, one verdict: does upstream's own `process_weights_after_loading`
plus reload machinery survive the RL updates that release's public API allows — a one-expert disk update, a whole
disk update, a tensor update (in a begin/end session where the release has them), another one-expert tensor update
— each byte-identical to a fresh load of the intended checkpoint, with storage, the Parameter objects and their
weight_loader kept? Measured by `tests/support/upstream_rl.py` with the plugin switched off (the matrix re-measures
it on every release in `tests/test_defer.py`, so a row that stops being true fails CI).

Where upstream is right, the plugin leaves preparation to SGLang and only adds what is missing there: validation
before writes (the loader hook), the emulator for CPU runs, doctor/explain visibility. Where it is wrong, the
plugin prepares the layer itself (formats/, layer_state), keeping the release's observable shapes where it can
(docs/COMPAT.md lists where it deliberately does not, and why).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from packaging.specifiers import SpecifierSet
from packaging.version import Version

from .features import Feature


class Named(Protocol):
    """What the table asks of a format it is handed: its registry name (`WeightFormat.name`)."""

    @property
    def name(self) -> str: ...


@dataclass(frozen=True)
class FormatName:
    """A weight format as the table names it: its registry name (formats/ `FORMATS`). compat/ sits below formats/
    and imports none of it; the caller hands the format in (`verdict(fmt)`), and the registry's test holds every
    registered format to a verdict here (tests/test_registry_completeness.py `test_6`)."""

    name: str


BF16 = FormatName("bf16")
CT_NVFP4 = FormatName("ct_nvfp4")
FP8_BLOCK = FormatName("fp8_block")
FP8_TENSOR = FormatName("fp8_tensor")
FP8_TENSOR_MODELOPT = FormatName("fp8_tensor_modelopt")
MXFP4_EXPERTS = FormatName("mxfp4_experts")
MXFP4_GPTOSS = FormatName("mxfp4_gptoss")
MXFP8 = FormatName("mxfp8")
NVFP4 = FormatName("nvfp4")
NVFP4_ONLINE = FormatName("nvfp4_online")
NVFP4_ONLINE_TENSOR = FormatName("nvfp4_online_tensor")


@dataclass(frozen=True)
class Verdict:
    #: the registry entry (formats/) the verdict is about, by name
    fmt: FormatName
    #: the releases this verdict holds on
    releases: str
    #: True: SGLang's own prep and reload are right there, the plugin defers; False: the plugin prepares
    upstream_correct: bool
    #: what was measured (tests/support/upstream_rl.py) or, where SGLang's own path cannot run on a CPU box, read
    evidence: str

    def holds(self, release: Version | str | None = None) -> bool:
        return Feature(self.releases, self.evidence).present(release)


_NO_CPU_ORACLE = (
    "SGLang's trtllm prep imports flashinfer, which cannot be imported on CPU at this release's pin; "
    "the code is the one measured on 0.5.16"
)

TABLE: tuple[Verdict, ...] = (
    Verdict(
        BF16,
        ">=0.5.23",
        True,
        "measured: every flow exact, storage, Parameters and weight_loaders kept (SGLang packs only canonical "
        "weights and restores whole layers before loads and at begin_weight_update, in place)",
    ),
    Verdict(
        BF16,
        ">=0.5.16,<0.5.23",
        False,
        "measured: a one-expert disk update fails (RuntimeError: the loader writes 3-D shards into the 4-D "
        "block-layout Parameter; the routed backend's shape-only restore leaves the bytes blocked and the "
        "next prep re-packs every expert)",
    ),
    Verdict(BF16, "<0.5.16", False, "read: " + _NO_CPU_ORACLE),
    Verdict(
        NVFP4,
        ">=0.5.11",
        False,
        "measured: a one-expert update re-shuffles the experts that were not reloaded (w13/w2 weights and "
        "block scales differ from a fresh load); a tensor update is never prepared (kernel scalars stale)",
    ),
    Verdict(
        NVFP4_ONLINE,
        ">=0.5.16",
        False,
        "measured: ModelOpt NVFP4's prep (the online method inherits it): a one-expert update re-shuffles the "
        "experts that were not reloaded; the unused static input scales are unfilled memory on 0.5.23 (every "
        "flow differs there)",
    ),
    Verdict(NVFP4_ONLINE, ">=0.5.14,<0.5.16", False, "read: " + _NO_CPU_ORACLE),
    Verdict(NVFP4_ONLINE, "<0.5.14", False, "read: upstream lacks it (no --quantization nvfp4_online before 0.5.14)"),
    Verdict(
        NVFP4_ONLINE_TENSOR,
        ">=0.5.18",
        False,
        "read: nvfp4_online's method and ModelOpt NVFP4's prep (measured for nvfp4_online above: a one-expert "
        "update re-shuffles the experts that were not reloaded); only the activation scales differ",
    ),
    Verdict(
        NVFP4_ONLINE_TENSOR,
        "<0.5.18",
        False,
        "read: upstream lacks it (modelopt_fp4 needs serialized NVFP4 metadata before 0.5.18)",
    ),
    Verdict(
        CT_NVFP4,
        ">=0.5.16",
        False,
        "measured: SGLang renames the *_packed Parameters at prep, so the next load by checkpoint name raises KeyError",
    ),
    Verdict(CT_NVFP4, "<0.5.16", False, "read: " + _NO_CPU_ORACLE),
    Verdict(
        FP8_TENSOR_MODELOPT,
        ">=0.5.16",
        False,
        "measured: SGLang requantizes w1/w3 to one scale and replaces the Parameters, so the next update "
        "raises AttributeError (no weight_loader)",
    ),
    Verdict(FP8_TENSOR_MODELOPT, "<0.5.16", False, "read: " + _NO_CPU_ORACLE),
    Verdict(
        FP8_TENSOR,
        ">=0.5.16",
        False,
        "measured: SGLang requantizes w1/w3 to one scale and replaces the Parameters, so the next update "
        "raises AttributeError (no weight_loader)",
    ),
    Verdict(FP8_TENSOR, "<0.5.16", False, "read: " + _NO_CPU_ORACLE),
    Verdict(
        MXFP8,
        ">=0.5.16",
        False,
        "measured: a one-expert update re-shuffles every expert that was not reloaded (SGLang's "
        "align_mxfp8_moe_weights_for_flashinfer_trtllm lays the whole layer out again at each prep; storage and "
        "loaders are kept)",
    ),
    Verdict(MXFP8, "<0.5.16", False, "read: " + _NO_CPU_ORACLE),
    Verdict(
        MXFP4_EXPERTS,
        ">=0.5.16",
        False,
        "measured: SGLang's prep replaces the Parameters (e8m0 scales, uint8 weights) without weight_loader, so "
        "the next load raises AttributeError",
    ),
    Verdict(MXFP4_EXPERTS, "<0.5.16", False, "read: " + _NO_CPU_ORACLE + " (no FP4-expert path before 0.5.12)"),
    Verdict(
        MXFP4_GPTOSS,
        ">=0.5.16",
        False,
        "measured: SGLang's prep replaces the Parameters (scales viewed e4m3, biases fp32) without "
        "weight_loader, so the next fused load raises TypeError (default_weight_loader)",
    ),
    Verdict(MXFP4_GPTOSS, "<0.5.16", False, "read: " + _NO_CPU_ORACLE),
    Verdict(
        FP8_BLOCK,
        ">=0.5.11",
        True,
        "measured: every flow exact, storage, Parameters and weight_loaders kept (the kernel layout is the "
        "loaded layout: FusedMoE loads w13 as [up; gate] on trtllm and nothing is permuted)",
    ),
)


def verdict(fmt: Named, release: Version | str | None = None) -> Verdict | None:
    """The verdict on registry entry `fmt` (a `WeightFormat`, matched by its name) for the running (or given)
    release, if the table has one."""
    for v in TABLE:
        if v.fmt.name == fmt.name and v.holds(release):
            return v
    return None


def upstream_prepares(fmt: Named, release: Version | str | None = None) -> bool:
    """True where SGLang's own preparation of `fmt` is right on the running (or given) release."""
    v = verdict(fmt, release)
    return bool(v and v.upstream_correct)


__all__ = ["TABLE", "FormatName", "Named", "Verdict", "upstream_prepares", "verdict"]


def _check_table() -> None:
    """No release has two verdicts for one format (checked at import: the table is data, not code paths)."""
    for i, a in enumerate(TABLE):
        for b in TABLE[i + 1 :]:
            if a.fmt.name == b.fmt.name and SpecifierSet(a.releases) & SpecifierSet(b.releases):
                probe = [f"0.5.{n}" for n in range(0, 60)]
                both = [r for r in probe if a.holds(r) and b.holds(r)]
                if both:
                    raise AssertionError(f"defer table: {a.fmt.name} has two verdicts on {both[0]}")


_check_table()
