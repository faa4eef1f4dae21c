"""What a user is told about a speculative draft that an update entry point leaves on its old weights (issue #39).

One text, three places that say it: the warning at update time (builtins/draft_updates.py), the start-up log of a
server with a draft (builtins/selection_hooks.py) and `explain --speculative-algorithm` (explain.py). Where SGLang
loads every update into the draft too (0.5.21+), there is nothing to say.
"""

from __future__ import annotations

from ..compat import features
from ..compat.releases import installed_version

#: what to do, whichever draft it is
WHAT_TO_DO = (
    "to keep the draft in step, also load its weights through an entry point that reaches it: "
    "update_weights_from_tensor (this release loads the draft, then the target, with the same tensors) or "
    "update_weights_from_disk (the target, then the draft); or run SGLang 0.5.21+, whose "
    "update_weights_from_distributed loads every runner the request's `selector` names (default: all)"
)


#: speculative algorithms without a draft model (n-gram lookup: nothing to update, nothing to go stale)
NO_DRAFT_MODEL = ("NGRAM", "NONE")


def has_draft_model(algorithm) -> bool:
    """Whether `algorithm` (as --speculative-algorithm spells it; None: unknown) runs a draft model."""
    return algorithm is None or str(getattr(algorithm, "name", algorithm)).upper() not in NO_DRAFT_MODEL


def algorithm_of(draft_worker):
    """The --speculative-algorithm of the spec worker's ServerArgs (or of ServerArgs themselves); None: unknown."""
    return getattr(getattr(draft_worker, "server_args", draft_worker), "speculative_algorithm", None)


def note(draft: str = "the speculative draft model", release=None) -> str | None:
    """Why `draft` goes stale on `release` (default: the installed SGLang) and what to do; None where no entry point
    leaves it stale (features.DISTRIBUTED_UPDATE_SKIPS_DRAFT)."""
    if not features.DISTRIBUTED_UPDATE_SKIPS_DRAFT.present(release):
        return None
    where = f"SGLang {release or installed_version()}"
    return (
        f"{where} loads update_weights_from_distributed into the target model only: {draft} keeps serving its old "
        f"weights after such an update (disk, IPC and tensor updates do reach it); {WHAT_TO_DO}"
    )


def draft_name(draft_worker) -> str:
    """The draft as a user named it: its --speculative-draft-model-path and algorithm (the spec worker's
    ServerArgs, or ServerArgs themselves), or the worker's class where it carries none."""
    args = getattr(draft_worker, "server_args", draft_worker)
    path = getattr(args, "speculative_draft_model_path", None)
    algo = getattr(args, "speculative_algorithm", None)
    if path is None and algo is None:
        return f"the speculative draft ({type(draft_worker).__name__})"
    return f"the speculative draft model {path or '(the target checkpoint)'} ({algo or 'speculative decoding'})"
