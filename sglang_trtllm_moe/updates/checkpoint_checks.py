"""A disk update's checkpoint directory checked whole before SGLang touches the model (bucket_validation.py's checks of
its headers' meta tensors, and every scale's values read from the files): every file readable and as long as its
header says, every tensor that targets a layer of the plugin's checked from its header, gated experts whole where
SGLang converts their halves together, and the values of every scale — each rank its own experts' (`local_only`) —
read one chunk at a time, kept for the update to write (`KeptValues`: each scale read from the files once)."""

from __future__ import annotations

import torch

from ..layer_state import layer_name
from . import bucket_validation, checkpoint_headers, value_checks
from .bucket_validation import BucketRefused, refusal_text, value_refusal
from .checked_writes import Checked
from .layer_params import format_of
from .name_index import expert_targets, managed_modules


def check_checkpoint(
    model, files, keep=None, what: str = "checkpoint", record: Checked | None = None, local_only: bool = False
) -> checkpoint_headers.Headers:
    """A disk update's checkpoint directory, whole, before SGLang touches the model: every file readable and as long
    as its header says; every tensor that targets a managed layer checked from its header (name, shard, expert,
    dtype, shape) as `check_bucket` checks a tensor; then the values of every one of them that has a value rule
    (every scale, of any size, 1-byte scales on their bytes), read one tensor at a time. Raises BucketRefused;
    returns the headers. record: a `checked_writes.Checked` of the disk update: once the whole checkpoint passed, the
    (parameter, shard, expert) of every tensor whose values were read and checked here is recorded there, so the
    loader hooks check only the structure of SGLang's writes of them while the update runs (the caller makes sure
    the files did not change meanwhile: rollback.fingerprint)."""
    headers, found = checkpoint_findings(model, files, keep, local_only)
    if found.problems:
        raise BucketRefused(refusal_text(found.problems, what, len(headers.tensors)))
    if record is not None:
        record.add_from_files(headers.tensors, found.checked)
    return headers


def checkpoint_findings(model, files, keep=None, local_only: bool = False, headers=None, values=None):
    """(headers, Findings) of a checkpoint directory against `model`'s layers: the headers' problems (index -1),
    each tensor's, and the values of every scale read from the files. keep: SGLang's weight_name_filter. values: a
    dict (with a byte budget: `values.budget`) where the values read are kept by name, up to the budget, for the
    update to write them instead of reading them again (`KeptValues`)."""
    if headers is None:
        headers = checkpoint_headers.read_headers(files, keep)
    found = bucket_validation.check_items(model, headers.tensors, headers=True, local_only=local_only)
    found.problems[:0] = [(-1, p) for p in headers.problems]
    found.problems += [(-1, p) for p in _unpaired_halves(model, headers.tensors)]
    if not found.problems and found.jobs:
        try:
            found.problems += _check_read_values(headers, found.jobs, values)
        except OSError as e:
            found.problems.append((-1, f"{type(e).__name__}: {e}"))
    return headers, found


def _unpaired_halves(model, named_tensors) -> list[str]:
    """Gated experts of a format that converts w1 and w3 source writes together (`WeightFormat.pairs_sources`:
    nvfp4_online) with one half in the checkpoint: SGLang's loader would hold that half, write nothing of the
    expert, and still hold it in the next update (which then fails: "got two w1 tensors"). A tensor bucket may hold
    one half (its partner can come in a later call of the same session, where SGLang pairs them); a checkpoint is
    the whole request."""
    if not any((f := format_of(m)) is not None and f.pairs_sources for m in managed_modules(model).values()):
        return []  # no layer here pairs its sources: nothing to look at (one pass over the layers)
    halves: dict = {}
    items = [it for it in named_tensors if isinstance(it, (list, tuple)) and len(it) == 2]
    for (name, tensor), target in zip(items, expert_targets(model, items), strict=True):
        if target is None or target[2] not in ("w1", "w3") or not isinstance(tensor, torch.Tensor):
            continue
        layer, pname, shard, expert = target
        fmt = format_of(layer)
        if fmt is None or not fmt.pairs_sources or not fmt.is_gated(layer):
            continue
        if fmt.converted_by_sglang(layer, pname, tensor, expert, "global"):
            halves.setdefault((id(layer), expert), (layer, expert, name, {}))[3][shard] = name
    return [
        f"{layer_name(layer)}: expert {expert}: "
        f"{'w1 (gate) without w3 (up)' if 'w1' in got else 'w3 (up) without w1 (gate)'} ({first}); expected both "
        "halves of a gated expert in the checkpoint (SGLang quantizes them together, with one scale, and holds a "
        "half alone unwritten)"
        for layer, expert, first, got in halves.values()
        if len(got) == 1
    ]


class KeptValues(dict):
    """Checkpoint name -> the values a disk update's pre-check read from the files, kept (up to `budget` bytes) so
    the update writes them rather than reading the same bytes again."""

    def __init__(self, budget: int):
        super().__init__()
        self.budget = budget


def _check_read_values(headers, jobs: list, kept: KeptValues | None = None) -> list[tuple[int, str]]:
    """The values of the jobs' tensors, read from the checkpoint's files: checked at once per chunk read (at most
    checkpoint_headers.CHUNK_BYTES held, but for what `kept` keeps); the refusals of those that break their rule."""
    names = headers.tensors
    wanted = {names[j[2]][0]: j for j in jobs}
    problems: list[tuple[int, str]] = []
    held: list = []
    size = 0

    def check():
        bad = value_checks.find_bad([(t, wanted[n][1]) for n, t in held])
        problems.extend((wanted[held[i][0]][2], value_refusal(wanted[held[i][0]], held[i][1])) for i in bad)
        held.clear()

    for name, tensor in checkpoint_headers.read_tensors(headers, list(wanted)):
        held.append((name, tensor))
        nbytes = tensor.numel() * tensor.element_size()
        size += nbytes
        if kept is not None and kept.budget >= nbytes:
            kept[name] = tensor
            kept.budget -= nbytes
        if size >= checkpoint_headers.CHUNK_BYTES:
            check()
            size = 0
    if held:
        check()
    return problems
