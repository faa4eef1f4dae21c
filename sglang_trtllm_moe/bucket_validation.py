"""Whole requests at the update entry points: every tensor of a bucket (tensor / distributed / IPC updates), of a
whole-parameter write (load_format="direct") or of a checkpoint directory (a disk update, from its safetensors
headers) that targets a managed layer is checked before any of it is loaded.

SGLang loads a list in order: a bad 5th tensor would leave the first four written, and a disk update restores
every layer before it reads the first tensor. One bad tensor refuses the whole request (`BucketRefused`); the entry
point hooks (builtins/weight_updates.py) return it as (False, message). Each tensor is checked by the same rules as
one loader write (validation.py); the values of a whole request are checked at once (value_checks.py: at most one
device synchronisation per device), and a checkpoint directory's from its files, one tensor at a time."""

from __future__ import annotations

import torch

from . import checkpoint_headers, value_checks
from .errors import WeightUpdateRefused
from .layer_state import layer_name, state_of
from .validation import (
    NOTHING_WRITTEN,
    PROJECTIONS,
    Refusal,
    ValueJob,
    check_tensor,
    check_write,
    format_of,
    managed_names,
    param_name,
    param_view,
    validate_fused,
)


class BucketRefused(WeightUpdateRefused):
    """A whole update bucket refused before any of it was loaded."""


def managed_modules(model) -> dict[str, object]:
    """{name prefix: layer} of every FusedMoE under `model` the plugin manages or watches: its module path, the
    checkpoint prefix SGLang's model code built it with, and the path from "layers." on where only one layer has
    it (checkpoints name the model root their own way: Nemotron-H's "backbone." is SGLang's "model.")."""
    out: dict[str, object] = {}
    tails: dict[str, list] = {}
    for path, m in model.named_modules():
        if format_of(m) is not None:
            out[path] = m
            prefix = getattr(m, "_trtllm_moe_prefix", None)
            if prefix:
                out.setdefault(prefix, m)
            tail = _from_layers(path)
            if tail:
                tails.setdefault(tail, []).append(m)
    for tail, ms in tails.items():
        if len(ms) == 1:
            out.setdefault(tail, ms[0])
    return out


def _from_layers(path: str) -> str | None:
    at = path.find("layers.")
    return path[at:] if at > 0 and path[at - 1] == "." else None


def _layer_at(layers: dict, path: str):
    layer = layers.get(path)
    if layer is None:
        tail = _from_layers(path)
        layer = layers.get(tail) if tail else None
    return layer


def _resolve(layer, rest: str):
    """A checkpoint name below a managed layer, "<expert>.<projection>.<suffix>" -> (param name, shard id, expert
    id); None when it is not of that form."""
    parts = rest.split(".")
    if len(parts) != 3 or not parts[0].isdigit() or parts[1] not in PROJECTIONS:
        return None
    shard = PROJECTIONS[parts[1]]
    if shard == "w3" and not format_of(layer).is_gated(layer):
        shard = "w1"  # non-gated checkpoints name their one GEMM1 projection up_proj; SGLang loads it as w1
    return f"{'w2' if shard == 'w2' else 'w13'}_{parts[2]}", shard, int(parts[0])


def _check_full(layer, fmt, pname, param, tensor, name, jobs: list) -> None:
    """A whole-parameter write (load_format="direct"): SGLang's default_weight_loader copies it over all experts.
    Its shape: the parameter's [experts, rows, cols] view where the plugin manages the layer (it returns the group
    to checkpoint layout, and that shape, before SGLang writes), else the parameter's shape as SGLang shows it."""
    refuse = Refusal(layer, pname, None, None, what=f"whole-parameter write {name!r}")
    view = param_view(layer, fmt, pname, param)
    whole = view.shape if state_of(layer) is not None else param.shape
    check_tensor(
        layer, fmt, fmt.load_rule(pname), param, view, tensor, fmt.is_gated(layer), refuse, whole=whole, values=jobs
    )


def check_bucket(
    model,
    named_tensors,
    direct: bool = False,
    skip=frozenset(),
    headers: bool = False,
    what: str = "weight-update bucket",
) -> list:
    """Validate every tensor of an update bucket that targets a managed layer before any of the bucket is loaded:
    one bad tensor refuses the whole bucket (SGLang would load the ones before it, then fail or corrupt). Names
    below a managed layer that no parameter of it takes are refused too; other names are left to SGLang. The values
    of all tensors are checked at once, after their names, dtypes and shapes (at most one device synchronisation
    per device of the bucket: value_checks.find_bad).

    direct=False: checkpoint names as `model.load_weights` takes them (`<layer>.<expert>.<projection>.<suffix>`).
    direct=True: parameter names (`<layer>.<param>`, load_format="direct"); returns the (layer, param name) pairs the
    bucket writes, which the caller returns to checkpoint layout before SGLang writes them whole.
    skip: ids of tensors already checked (the same objects, handed on by SGLang).
    headers: the tensors are a checkpoint's meta tensors (checkpoint_headers.read_headers): their values are not
    checked here (check_checkpoint reads them)."""
    problems, writes, jobs = _check_items(model, named_tensors, direct, skip, headers)
    if not headers:
        problems += [jobs[i].refusal() for i in value_checks.find_bad([(j.tensor, j.code) for j in jobs])]
    _raise(problems, what, len(named_tensors))
    return writes


def check_checkpoint(model, files, keep=None, what: str = "checkpoint") -> checkpoint_headers.Headers:
    """A disk update's checkpoint directory, whole, before SGLang touches the model: every file readable and as long
    as its header says; every tensor that targets a managed layer checked from its header (name, shard, expert,
    dtype, shape) as `check_bucket` checks a tensor; then the values of every one of them that has a value rule
    (every scale, of any size, 1-byte scales on their bytes), read one tensor at a time. Raises BucketRefused;
    returns the headers."""
    headers = checkpoint_headers.read_headers(files, keep)
    problems, _, jobs = _check_items(model, headers.tensors, False, frozenset(), True)
    problems = headers.problems + problems
    if not problems and jobs:
        wanted = {j.name: j for j in jobs}
        for name, tensor in checkpoint_headers.read_tensors(headers, list(wanted)):
            job = wanted[name]
            if value_checks.find_bad([(tensor, job.code)]):
                problems.append(job.refusal(tensor))
    _raise(problems, what, len(headers.tensors))
    return headers


def _raise(problems: list[str], what: str, n: int) -> None:
    if problems:
        problems = [p.removesuffix(NOTHING_WRITTEN) for p in problems]  # said once for the whole request below
        more = f" (and {len(problems) - 3} more)" if len(problems) > 3 else ""
        raise BucketRefused(
            f"refused the whole {what} ({n} tensors, {len(problems)} refused): "
            + " | ".join(problems[:3])
            + more
            + "; nothing of it was written"
        )


def _check_items(model, named_tensors, direct: bool, skip, headers: bool) -> tuple[list[str], list, list[ValueJob]]:
    """(problems, direct writes, value jobs) of a request's tensors: everything but the values."""
    layers = managed_modules(model)
    problems: list[str] = []
    writes: list = []
    jobs: list[ValueJob] = []
    if not layers:
        return problems, writes, jobs
    for item in named_tensors:
        if not isinstance(item, (list, tuple)) or len(item) != 2 or not isinstance(item[0], str):
            continue
        name, tensor = item
        if skip and id(tensor) in skip:
            continue
        path, _, pname = name.rpartition(".")
        layer = _layer_at(layers, path)
        if layer is not None:  # "<layer>.<param>"
            fmt = format_of(layer)
            param = layer._parameters.get(pname)
            fused_param = fmt.fused_checkpoint_names.get(pname) if param is None and not direct else None
            if fused_param is not None:  # a checkpoint tensor of all experts (gpt-oss): dtype and values here;
                # its shape once the model's loader has narrowed it to this rank (validate_fused at the write)
                n_jobs = len(jobs)
                try:
                    validate_fused(layer, fused_param, layer._parameters[fused_param], tensor, shape=False, values=jobs)
                except WeightUpdateRefused as e:
                    problems.append(str(e))
                for job in jobs[n_jobs:]:
                    job.name = name
                continue
            if param is None:
                if direct:
                    problems.append(
                        f"{layer_name(layer)}: {name}: the layer has no parameter {pname} "
                        f"(its checkpoint parameters: {managed_names(layer, fmt)})"
                    )
                continue
            own = param_name(layer, param, fmt)
            if fmt.load_rule(own) is None:
                continue  # a parameter the format does not load (kernel scalars): SGLang's behaviour
            if not direct:
                problems.append(
                    f"{layer_name(layer)}: {name} is a parameter name; model.load_weights takes "
                    f"checkpoint names (<layer>.<expert>.<projection>.<suffix>) — whole parameters go "
                    f"through load_format='direct'"
                )
                continue
            try:
                _check_full(layer, fmt, own, param, tensor, name, jobs)
                writes.append((layer, own))
            except WeightUpdateRefused as e:
                problems.append(str(e))
            continue
        if direct:
            continue
        head = name.rsplit(".", 3)
        layer = _layer_at(layers, head[0]) if len(head) == 4 else None
        if layer is None:
            continue
        hit = _resolve(layer, name[len(head[0]) + 1 :])
        if hit is None:
            continue
        pname, shard, expert = hit
        fmt = format_of(layer)
        param = layer._parameters.get(pname)
        if param is None or fmt.load_rule(param_name(layer, param, fmt)) is None:
            problems.append(
                f"{layer_name(layer)}: {name}: no parameter {pname} of this layer takes it "
                f"(its checkpoint parameters: {managed_names(layer, fmt)})"
            )
            continue
        if not isinstance(tensor, torch.Tensor):
            continue  # unwrapped later by SGLang; the per-shard check applies
        n_jobs = len(jobs)
        try:
            check_write(layer, param, tensor, name, shard, expert, scope="global", headers=headers, values=jobs)
        except WeightUpdateRefused as e:
            problems.append(str(e))
        for job in jobs[n_jobs:]:
            job.name = name
    return problems, writes, jobs
