"""The serving role: which checkpoints a format holds, on which runner backends, and what its kernel computes.

Selection (offline, from a checkpoint's config: selection/rules.py) and `explain` read only this role; the load-time
layout check (`layout.Layout.check_layout`) asks `supports_activation` of it too.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, ClassVar

from ... import layouts
from ..records import SUPPORTED, Checkpoint, Support


class Serving:
    """Its MUST members are `Spec`'s (formats/base.py): `name`, `title`, `quantizations`, `hook_module`,
    `describes(checkpoint)`; MAY there: `gated_activations`, `non_gated_activations`, `intermediate_align`.

    MAY define here: `hidden_align` (default 128), `activation_note`, `online_sources`, `own_backend`, `refusal`,
    `config_scheme` (a compressed-tensors scheme the generic detection does not name), and
    any `supports_*` predicate whose rule differs. Each predicate answers `(ok, reason)` (`Support`); selection asks
    them all, each under its reason code."""

    # declared by formats/base.py Spec
    name: str
    title: str
    quantizations: Mapping[str, frozenset]
    gated_activations: ClassVar[frozenset[str]]
    non_gated_activations: ClassVar[frozenset[str]]
    intermediate_align: ClassVar[tuple[int, int]]
    hook_module: ClassVar[str]
    if TYPE_CHECKING:

        def describes(self, checkpoint: Checkpoint) -> bool: ...

    #: w2's rows are the hidden dim and go through the same 128-row scale/shuffle tiling
    hidden_align: ClassVar[int] = 128
    #: why the activation sets are what they are, added to a refusal (e.g. a kernel that only implements SwiGLU)
    activation_note: ClassVar[str] = ""
    #: the checkpoint quantizations (as SGLang names them) that a server started with one of this format's
    #: quantizations quantizes online although the checkpoint has a quantization_config of its own
    #: (`Checkpoint.online`; selection/hf_config.py ONLINE_FROM)
    online_sources: ClassVar[frozenset[str]] = frozenset()
    #: the runner backend SGLang serves this format on when it is not flashinfer_trtllm(_routed) (e.g.
    #: "flashinfer_mxfp4"); selection reports it, never auto-switches to it
    own_backend: ClassVar[str | None] = None

    def config_scheme(self, weights: Mapping[str, Any], input_activations: Any) -> str | None:
        """The `Checkpoint.quant_scheme` this format's checkpoints declare in a compressed-tensors config group
        (its `weights` and `input_activations` entries: selection/hf_config.py asks every format first), or None:
        the group is not this format's to name."""
        return None

    def refusal(self, checkpoint: Checkpoint) -> str | None:
        """Why a checkpoint of this format's quantization that the format does not describe is not prepared (a
        variant of it the kernels or SGLang's path do not serve), or None when the checkpoint is not this format's
        to refuse. `formats.for_checkpoint` asks it when no format describes the checkpoint."""
        return None

    def serves(self, backend: str, checkpoint: Checkpoint) -> bool:
        return checkpoint.quantization in self.quantizations.get(backend, ())

    def activations(self, gated: bool) -> frozenset[str]:
        return self.gated_activations if gated else self.non_gated_activations

    # ---- eligibility: named predicates, each -> (ok, reason) ---------------------------------------------------
    # One set per format, read by selection (selection/rules.py, offline: the checkpoint's sizes, per rank) and by
    # the load-time `check_layout` (SGLang's allocation of the layer: `supports_activation` on its runner config, then
    # its storage, whose sizes SGLang may already have padded).
    def supports_backend(self, backend: str, checkpoint: Checkpoint) -> Support:
        """SGLang has a path for this format's checkpoints on runner `backend` that the plugin prepares."""
        if self.serves(backend, checkpoint):
            return SUPPORTED
        where = (
            f"; SGLang serves it on {self.own_backend} (TRT-LLM-Gen kernels too), where the plugin prepares it in place"
            if self.own_backend
            else ""
        )
        return False, f"{backend} has no {self.title} path in SGLang{where}"

    def supports_activation(self, activation: str, gated: bool) -> Support:
        """The kernel computes (activation, gating) for this format on every flashinfer the releases pin."""
        allowed = self.activations(gated)
        if activation in allowed:
            return SUPPORTED
        kind = "gated" if gated else "non-gated"
        note = f"; {self.activation_note}" if self.activation_note else ""
        return False, (
            f"{kind} {activation!r} is not computed by the TRT-LLM-Gen {self.title or self.name} kernel "
            f"(supported {kind}: {sorted(allowed) or 'none'}{note})"
        )

    def supports_hidden(self, hidden: int, gated: bool) -> Support:
        """The checkpoint's hidden size fits the kernel's tiling (`hidden_align`) for this gating."""
        if hidden % self.hidden_align:
            return False, f"hidden size {hidden} is not a multiple of {self.hidden_align}"
        return SUPPORTED

    def supports_intermediate(self, per_rank: int, gated: bool) -> Support:
        """The checkpoint's per-rank intermediate can be served: by default SGLang's allocation pads it to
        `intermediate_align` (`padded_intermediate`); a format whose scale blocks cannot be padded overrides this."""
        return SUPPORTED

    def activation_problem(self, activation: str, gated: bool) -> str | None:
        """None when the kernel computes (activation, gating) for this format, else the sentence saying why not
        (`supports_activation`'s reason)."""
        return self.supports_activation(activation, gated)[1]

    def padded_intermediate(self, per_rank: int, gated: bool) -> int:
        """The per-rank intermediate as SGLang allocates this format's layer (per half for gated w13): rounded up to
        the format's `intermediate_align` — a multiple of the kernel's own tiling (`layouts.padded_intermediate`)."""
        return layouts.padded_intermediate(per_rank, gated, align=self.intermediate_align[0 if gated else 1])
