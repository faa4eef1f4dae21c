"""Whole requests at the update entry points: every tensor of a bucket (tensor / distributed / IPC updates), of a
whole-parameter write (load_format="direct") or of a checkpoint directory (a disk update, from its safetensors
headers) that targets a managed layer is checked before any of it is loaded.

SGLang loads a list in order: a bad 5th tensor would leave the first four written, and a disk update restores
every layer before it reads the first tensor. One bad tensor refuses the whole request (`BucketRefused`); the entry
point hooks (builtins/weight_updates.py) return it as (False, message). Each tensor is checked by the same rules as
one loader write (validation.py); the values of a whole request are checked at once (value_checks.py: at most one
device synchronisation per device), and a checkpoint directory's from its files, one tensor at a time."""

from __future__ import annotations

import threading
import weakref

import torch

from .. import layer_attrs, layer_state
from ..errors import WeightUpdateRefused
from ..layer_state import layer_name, state_of
from . import checkpoint_headers, value_checks
from .checked_writes import Checked
from .layer_params import PROJECTIONS, format_of, managed_names, param_name, param_view
from .refusal import NOTHING_WRITTEN, Refusal, ValueJob
from .validation import check_planned, check_tensor, validate_fused
from .write_plans import plan_of


class BucketRefused(WeightUpdateRefused):
    """A whole update bucket refused before any of it was loaded."""


class _ModelCache:
    """What a model's requests look up again and again: its managed layers (one walk of `named_modules`), and what
    each checkpoint name below them resolves to. Valid while no layer is attached or observed anywhere
    (layer_state.generation)."""

    #: names resolved per model at most (a bound on the cache; names past it are resolved every time)
    MAX_NAMES = 1 << 20

    def __init__(self, generation: int, layers: dict):
        self.generation = generation
        self.layers = layers
        #: checkpoint name -> [layer, param name, shard id, expert id, its write plan] | None (not an expert tensor of
        #: a layer here)
        self.targets: dict = {}


_CACHES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_CACHES_LOCK = threading.Lock()


def _cache_of(model) -> _ModelCache:
    gen = layer_state.generation()
    try:
        c = _CACHES.get(model)
    except TypeError:  # not weak-referenceable / hashable: nothing cached
        return _ModelCache(gen, _managed_modules(model))
    if c is None or c.generation != gen:
        c = _ModelCache(gen, _managed_modules(model))
        with _CACHES_LOCK:
            _CACHES[model] = c
    return c


def managed_modules(model) -> dict[str, object]:
    """{name prefix: layer} of every FusedMoE under `model` the plugin manages or watches: its module path, the
    checkpoint prefix SGLang's model code built it with, and the path from "layers." on where only one layer has
    it (checkpoints name the model root their own way: Nemotron-H's "backbone." is SGLang's "model."). Walked once
    per model (again after a layer anywhere is attached or observed)."""
    return _cache_of(model).layers


def _managed_modules(model) -> dict[str, object]:
    out: dict[str, object] = {}
    tails: dict[str, list] = {}
    for path, m in model.named_modules():
        if format_of(m) is not None:
            out[path] = m
            prefix = getattr(m, layer_attrs.PREFIX, None)
            if prefix:
                out.setdefault(prefix, m)
            tail = _from_layers(path)
            if tail:
                tails.setdefault(tail, []).append(m)
    for tail, ms in tails.items():
        if len(ms) == 1:
            out.setdefault(tail, ms[0])
    for alias, m in _nextn_aliases(model, out).items():
        out.setdefault(alias, m)
    return out


#: where SGLang's NextN / MTP draft classes (`*NextN`: DeepSeek-V3/V4, GLM-5, Hunyuan, LongCat) build their one
#: decoder layer; their loaders read it from the checkpoint's "model.layers.{N}." (N = num_hidden_layers, 0 for a
#: one-layer config: deepseek_common/deepseek_weight_loader.py `_initialize_nextn_conf`)
NEXTN_DECODER = "model.decoder."


def _nextn_aliases(model, found: dict) -> dict:
    """The checkpoint names of a speculative draft's MoE layers: without them a request's draft experts resolve to
    no layer here, and are checked only write by write in the loader hook (a bad one after good ones: a partial
    write)."""
    cfg = getattr(model, "config", None)
    if cfg is None or not type(model).__name__.endswith("NextN") or not getattr(cfg, "num_nextn_predict_layers", 0):
        return {}
    n = 0 if cfg.num_hidden_layers == 1 else cfg.num_hidden_layers
    head = f"model.layers.{n}."
    return {head + path[len(NEXTN_DECODER) :]: m for path, m in found.items() if path.startswith(NEXTN_DECODER)}


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
    record: Checked | None = None,
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
    checked here (check_checkpoint reads them).
    record: a `checked_writes.Checked` of the request: once the whole bucket passed, every expert write it validated is
    recorded there, so the loader hooks do not check it again."""
    entries: list | None = [] if record is not None and not headers else None
    problems, writes, jobs = _check_items(model, named_tensors, direct, skip, headers, entries)
    if not headers:
        problems += [jobs[i].refusal() for i in value_checks.find_bad([(j.tensor, j.code) for j in jobs])]
    _raise(problems, what, len(named_tensors))
    if entries:
        record.add_tensors(entries)  # type: ignore[union-attr]
    return writes


def check_checkpoint(
    model, files, keep=None, what: str = "checkpoint", record: Checked | None = None
) -> checkpoint_headers.Headers:
    """A disk update's checkpoint directory, whole, before SGLang touches the model: every file readable and as long
    as its header says; every tensor that targets a managed layer checked from its header (name, shard, expert,
    dtype, shape) as `check_bucket` checks a tensor; then the values of every one of them that has a value rule
    (every scale, of any size, 1-byte scales on their bytes), read one tensor at a time. Raises BucketRefused;
    returns the headers. record: a `checked_writes.Checked` of the disk update: once the whole checkpoint passed, the
    (parameter, shard, expert) of every tensor whose values were read and checked here is recorded there, so the
    loader hooks check only the structure of SGLang's writes of them while the update runs (the caller makes sure
    the files did not change meanwhile: rollback.fingerprint)."""
    headers = checkpoint_headers.read_headers(files, keep)
    entries: list | None = [] if record is not None else None
    problems, _, jobs = _check_items(model, headers.tensors, False, frozenset(), True, entries)
    problems = headers.problems + problems + _unpaired_halves(model, headers.tensors)
    if not problems and jobs:
        wanted = {j.name: j for j in jobs}
        try:
            problems += _check_read_values(headers, wanted)
        except OSError as e:
            problems.append(f"{type(e).__name__}: {e}")
    _raise(problems, what, len(headers.tensors))
    if entries:  # every value of theirs with a value rule was read and checked above
        record.add_from_files(entries)  # type: ignore[union-attr]
    return headers


def _unpaired_halves(model, named_tensors) -> list[str]:
    """Gated experts of a format that converts w1 and w3 source writes together (`WeightFormat.pairs_sources`:
    nvfp4_online) with one half in the checkpoint: SGLang's loader would hold that half, write nothing of the
    expert, and still hold it in the next update (which then fails: "got two w1 tensors"). A tensor bucket may hold
    one half (its partner can come in a later call of the same session, where SGLang pairs them); a checkpoint is
    the whole request."""
    if not any((f := format_of(m)) is not None and f.pairs_sources for m in _cache_of(model).layers.values()):
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


def _check_read_values(headers, wanted: dict) -> list[str]:
    """The values of the jobs' tensors, read from the checkpoint's files: checked at once per chunk read (at most
    checkpoint_headers.CHUNK_BYTES held); the refusals of those that break their rule."""
    problems: list[str] = []
    held: list = []
    size = 0

    def check():
        bad = value_checks.find_bad([(t, wanted[n].code) for n, t in held])
        problems.extend(wanted[held[i][0]].refusal(held[i][1]) for i in bad)
        held.clear()

    for name, tensor in checkpoint_headers.read_tensors(headers, list(wanted)):
        held.append((name, tensor))
        size += tensor.numel() * tensor.element_size()
        if size >= checkpoint_headers.CHUNK_BYTES:
            check()
            size = 0
    if held:
        check()
    return problems


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


def _check_items(
    model, named_tensors, direct: bool, skip, headers: bool, entries: list | None = None
) -> tuple[list[str], list, list[ValueJob]]:
    """(problems, direct writes, value jobs) of a request's tensors: everything but the values. entries: where to
    append (tensor, param, shard id, expert id, (parameter name, "." + name, local expert count), checkpoint name,
    layer) of every expert write checked."""
    cache = _cache_of(model)
    layers = cache.layers
    problems: list[str] = []
    writes: list = []
    jobs: list[ValueJob] = []
    if not layers:
        return problems, writes, jobs
    current: set = set()  # ids of the write plans found current during this call (nothing changes them meanwhile)
    for item in named_tensors:
        if type(item) is not tuple or len(item) != 2:
            if not isinstance(item, (list, tuple)) or len(item) != 2:
                continue
        name, tensor = item
        if type(name) is not str:
            if not isinstance(name, str):
                continue
        if skip and id(tensor) in skip:
            continue
        if direct:  # parameter names only: "<layer>.<param>"
            if _layer_at(layers, name.rpartition(".")[0]) is not None:
                _check_other(layers, name, tensor, direct, jobs, problems, writes)
            continue
        target = _cached_target(cache, name)
        if target is None:
            continue  # not an expert tensor of a managed layer: SGLang's behaviour
        if target is _OTHER:
            _check_other(layers, name, tensor, direct, jobs, problems, writes)
            continue
        layer, pname, shard, expert, plan = target
        param = layer._parameters.get(pname)
        if plan is None or plan.param() is not param or id(plan) not in current:
            # the plan resolved with the name, checked current once per request (write_plans.plan_of)
            plan = target[4] = plan_of(layer, param) if param is not None else None
            if plan is not None:
                current.add(id(plan))
        if plan is None or plan.rule is None:
            fmt = format_of(layer)
            if param is None or fmt is None:
                problems.append(
                    f"{layer_name(layer)}: {name}: no parameter {pname} of this layer takes it "
                    f"(its checkpoint parameters: {managed_names(layer, fmt)})"
                )
                continue
            if fmt.load_rule(param_name(layer, param, fmt)) is None:
                continue  # a parameter the format does not load (compressed-tensors' weight_shape): SGLang's loader's
        if not isinstance(tensor, torch.Tensor):
            continue  # unwrapped later by SGLang; the per-shard check applies
        n_jobs = len(jobs)
        try:
            checked = check_planned(plan, layer, param, tensor, name, shard, expert, "global", headers, jobs)
        except WeightUpdateRefused as e:
            problems.append(str(e))
            continue
        if len(jobs) > n_jobs:  # (one job per tensor at most)
            jobs[-1].name = name
        if entries is not None and checked is not None:
            hit = plan.hit if plan is not None and plan.name == checked[0] else (checked[0], "." + checked[0], 0)
            entries.append((tensor, param, shard, checked[1], hit, name, layer))
    return problems, writes, jobs


def expert_targets(model, named_tensors) -> list:
    """What each item of a request targets, in order: (layer, parameter name, shard id, checkpoint expert id) for an
    expert tensor of a layer the plugin manages or watches (a `model.load_weights` name,
    "<layer>.<expert>.<projection>.<suffix>"), else None. The names are resolved as `check_bucket` resolves them
    (cached per model: after a request's check these are dict look-ups)."""
    cache = _cache_of(model)
    layers = cache.layers
    out: list = []
    if not layers:
        return [None] * len(named_tensors)
    for item in named_tensors:
        name = item[0] if isinstance(item, (list, tuple)) and len(item) == 2 else None
        if type(name) is not str:
            out.append(None)
            continue
        target = _cached_target(cache, name)
        out.append(None if target is None or target is _OTHER else (target[0], target[1], target[2], target[3]))
    return out


#: `_ModelCache.targets` markers: not resolved yet; a "<layer>.<param>" name (checked by `_check_other`)
_UNSEEN = object()
_OTHER = object()


def _cached_target(cache, name: str):
    """`_target` of `name`, remembered per model (up to `MAX_NAMES` names): a request's names resolve once."""
    target = cache.targets.get(name, _UNSEEN)
    if target is _UNSEEN:
        target = _target(cache.layers, name)
        if len(cache.targets) < cache.MAX_NAMES:
            cache.targets[name] = target
    return target


def _target(layers: dict, name: str):
    """What a checkpoint name (model.load_weights' form) targets: [layer, param name, shard id, expert id, None] for
    "<layer>.<expert>.<projection>.<suffix>" below a managed layer; `_OTHER` for "<layer>.<param>"; None for every
    other name."""
    path, _, pname = name.rpartition(".")
    if _layer_at(layers, path) is not None:
        return _OTHER
    head = name.rsplit(".", 3)
    layer = _layer_at(layers, head[0]) if len(head) == 4 else None
    if layer is None:
        return None
    hit = _resolve(layer, name[len(head[0]) + 1 :])
    if hit is None:
        return None
    return [layer, *hit, None]  # the last: the parameter's write plan, once looked up


def _check_other(layers: dict, name: str, tensor, direct: bool, jobs: list, problems: list, writes: list) -> None:
    """A "<layer>.<param>" name: a fused checkpoint tensor of all experts (gpt-oss), a whole-parameter write
    (load_format="direct"), or a parameter name where model.load_weights takes checkpoint names (refused)."""
    path, _, pname = name.rpartition(".")
    layer = _layer_at(layers, path)
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
        return
    if param is None:
        if direct:
            problems.append(
                f"{layer_name(layer)}: {name}: the layer has no parameter {pname} "
                f"(its checkpoint parameters: {managed_names(layer, fmt)})"
            )
        return
    own = param_name(layer, param, fmt)
    if fmt.load_rule(own) is None:
        return  # a parameter the format does not load (kernel scalars): SGLang's behaviour
    if not direct:
        problems.append(
            f"{layer_name(layer)}: {name} is a parameter name; model.load_weights takes "
            f"checkpoint names (<layer>.<expert>.<projection>.<suffix>) — whole parameters go "
            f"through load_format='direct'"
        )
        return
    try:
        _check_full(layer, fmt, own, param, tensor, name, jobs)
        writes.append((layer, own))
    except WeightUpdateRefused as e:
        problems.append(str(e))
