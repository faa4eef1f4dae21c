"""Where SGLang's own preparation and reload are right, the plugin defers to them: the verdict type, its lookup and
the release boundaries the verdicts are drawn at.

For every weight format and SGLang release range, one verdict: does upstream's own `process_weights_after_loading`
plus reload machinery survive the RL updates that release's public API allows — a one-expert disk update, a whole
disk update, a tensor update (in a begin/end session where the release has them), another one-expert tensor update
— each byte-identical to a fresh load of the intended checkpoint, with storage, the Parameter objects and their
weight_loader kept? Measured by `tests/support/upstream_rl.py` with the plugin switched off (the matrix re-measures
it on every release in `tests/test_defer.py`, so a verdict that stops being true fails CI).

Each format declares its own verdicts (`WeightFormat.upstream_verdicts`, in its module of formats/: a new format is
one unit of change); compat/ sits below formats/ and imports none of it, so the lookup reads the format it is handed
by duck typing. A verdict's range is drawn at named boundaries (this module's, or a flag of compat/features.py), never
at a literal release outside compat/ (tests/test_house_rules.py).

Where upstream is right, the plugin leaves preparation to SGLang and only adds what is missing there: validation
before writes (the loader hook), the emulator for CPU runs, doctor/explain visibility. Where it is wrong, the
plugin prepares the layer itself (formats/, layer_state), keeping the release's observable shapes where it can
(docs/COMPAT.md lists where it deliberately does not, and why).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from packaging.specifiers import SpecifierSet
from packaging.version import Version

from .features import Feature
from .releases import OLDEST_SUPPORTED


@dataclass(frozen=True)
class Verdict:
    #: the releases this verdict holds on (built from named boundaries: `EVERY_RELEASE`, `CPU_ORACLE`, a feature flag)
    releases: str
    #: True: SGLang's own prep and reload are right there, the plugin defers; False: the plugin prepares
    upstream_correct: bool
    #: what was measured (tests/support/upstream_rl.py) or, where SGLang's own path cannot run on a CPU box, read
    evidence: str

    def holds(self, release: Version | str | None = None) -> bool:
        return Feature(self.releases, self.evidence).present(release)


class Judged(Protocol):
    """What the lookup asks of a format it is handed (`WeightFormat`): its registry name and its own verdicts."""

    @property
    def name(self) -> str: ...

    @property
    def upstream_verdicts(self) -> Sequence[Verdict]: ...


# ---- the boundaries verdicts are drawn at ------------------------------------------------------------------------

#: every release the plugin runs on
EVERY_RELEASE = Feature(f">={OLDEST_SUPPORTED}", "every release the plugin runs on (compat.releases.OLDEST_SUPPORTED)")
#: where SGLang's own trtllm preparation runs on a CPU box, so a verdict is measured; before it, read from the code
CPU_ORACLE = Feature(
    ">=0.5.16",
    "SGLang's trtllm prep imports flashinfer, which imports on CPU from this release's pin on (tests/test_defer.py "
    "measures there; before, a verdict is read from the code)",
)
#: the evidence of a verdict before `CPU_ORACLE`
NO_CPU_ORACLE = (
    "SGLang's trtllm prep imports flashinfer, which cannot be imported on CPU at this release's pin; "
    "the code is the one measured on 0.5.16"
)


def between(since: Feature, until: Feature) -> str:
    """The releases from `since` on, before `until` starts (">=A,<B"): a verdict's range between two boundaries."""
    return f"{since.releases},{until.before}"


def read_before_cpu_oracle(upstream_correct: bool = False, note: str = "") -> Verdict:
    """The verdict before `CPU_ORACLE`: read from the code, the one measured from there on."""
    return Verdict(CPU_ORACLE.before, upstream_correct, "read: " + NO_CPU_ORACLE + note)


# ---- the lookup ---------------------------------------------------------------------------------------------------


def verdict(fmt: Judged, release: Version | str | None = None) -> Verdict | None:
    """The verdict `fmt` (a `WeightFormat`) declares for the running (or given) release, if it has one."""
    for v in fmt.upstream_verdicts:
        if v.holds(release):
            return v
    return None


def upstream_prepares(fmt: Judged, release: Version | str | None = None) -> bool:
    """True where SGLang's own preparation of `fmt` is right on the running (or given) release."""
    v = verdict(fmt, release)
    return bool(v and v.upstream_correct)


def overlap(fmt: Judged) -> str | None:
    """The first release on which two of `fmt`'s verdicts hold, if any (the registry refuses such a format: one
    verdict per release)."""
    vs = tuple(fmt.upstream_verdicts)
    for i, a in enumerate(vs):
        for b in vs[i + 1 :]:
            if SpecifierSet(a.releases) & SpecifierSet(b.releases):
                both = [r for r in (f"0.5.{n}" for n in range(0, 60)) if a.holds(r) and b.holds(r)]
                if both:
                    return both[0]
    return None


__all__ = [
    "CPU_ORACLE",
    "EVERY_RELEASE",
    "NO_CPU_ORACLE",
    "Judged",
    "Verdict",
    "between",
    "overlap",
    "read_before_cpu_oracle",
    "upstream_prepares",
    "verdict",
]
