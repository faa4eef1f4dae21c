"""Whole requests at the update entry points: every tensor of a bucket (tensor / distributed / IPC updates), of a
whole-parameter write (load_format="direct") or of a checkpoint directory (a disk update, from its safetensors
headers) that targets a managed layer is checked before any of it is loaded.

SGLang loads a list in order: a bad 5th tensor would leave the first four written, and a disk update restores
every layer before it reads the first tensor. One bad tensor refuses the whole request (`BucketRefused`); the entry
point hooks (builtins/weight_updates.py, through updates/request.py) return it as (False, message). Each tensor is
checked by the same rules as one loader write (its parameter's write plan, write_plans.py: the name's own checks once
per name and plan, the tensor's device, dtype and shape per tensor; the full checks of validation.py only to explain a
refusal); the values of a whole request are checked at once (value_checks.py: at most one device synchronisation per
device), and a checkpoint directory's from its files, one tensor at a time.

Rank-local (`local_only`, where a request's ranks answer it together: updates/verdicts.py): a tensor of an expert
this rank does not hold (name_index.Target.slots == ()) costs a look-up and is not checked here — the rank that holds
it checks it, and every rank refuses what any rank refused."""

from __future__ import annotations

import torch

from ..errors import WeightUpdateRefused
from ..layer_state import layer_name, state_of
from . import value_checks
from .checked_writes import Checked
from .layer_params import format_of, managed_names, param_name, param_view
from .name_index import OTHER, Target, expert_targets, index_of, layer_at, managed_modules
from .refusal import NOTHING_WRITTEN, Refusal, ValueJob
from .slot_writes import storage_of
from .validation import check_planned, check_tensor, validate_fused
from .write_plans import plan_of

__all__ = [
    "BucketRefused",
    "Findings",
    "check_bucket",
    "check_items",
    "check_values",
    "expert_targets",
    "managed_modules",
    "refusal_text",
    "value_refusal",
]


class BucketRefused(WeightUpdateRefused):
    """A whole update bucket refused before any of it was loaded."""


class Findings:
    """What one model's check of a request found, before its values are checked: `problems` ((index of the item,
    message)), `writes` (a direct write's (layer, parameter name) pairs), `jobs` (value checks: (tensor, rule, index,
    ValueJob, Target or run)), `resolved` (indices of the items whose names resolve to a layer here: checked, or
    another rank's), `checked` ((index, Target) of the expert tensors checked and accepted), `elsewhere` (indices of
    the expert tensors another rank holds), `whole` (every item was a (name, tensor) pair: nothing left to check once
    SGLang unwraps it)."""

    __slots__ = ("problems", "writes", "jobs", "resolved", "checked", "elsewhere", "whole")

    def __init__(self):
        self.problems: list[tuple[int, str]] = []
        self.writes: list = []
        self.jobs: list[tuple] = []
        self.resolved: list[int] = []
        self.checked: list[tuple[int, Target]] = []
        self.elsewhere: list[int] = []
        self.whole = True


def _epoch() -> int:
    _EPOCH[0] += 1
    return _EPOCH[0]


_EPOCH = [0]
_MISS = object()


def check_items(
    model,
    named_tensors,
    direct: bool = False,
    skip=frozenset(),
    headers: bool = False,
    local_only: bool = False,
    index=None,
) -> Findings:
    """Every item of a request that targets a layer of `model` the plugin manages or watches, checked but for its
    values (`check_values` next). direct / skip / headers: as `check_bucket`. local_only: a tensor of another rank's
    expert is not checked (its rank checks it). index: the model's name index, current (name_index.index_of). Never
    raises for an item: what an item's check raises is that item's refusal."""
    out = Findings()
    idx = index if index is not None else index_of(model)
    if not idx.layers:
        out.whole = all(type(it) is tuple and len(it) == 2 and isinstance(it[1], torch.Tensor) for it in named_tensors)
        return out
    get, known = idx.get, idx.targets.get
    epoch = _epoch()
    problems, jobs, resolved, elsewhere = out.problems, out.jobs, out.resolved, out.elsewhere
    runs: dict = {}  # ParamShard -> its open _Run (None: its views are not of one buffer)
    tensor_class = torch.Tensor
    for i, item in enumerate(named_tensors):
        if type(item) is not tuple or len(item) != 2:
            if not isinstance(item, (list, tuple)) or len(item) != 2:
                out.whole = False
                continue
        name, tensor = item
        if tensor.__class__ is not tensor_class and not isinstance(tensor, tensor_class):
            out.whole = False
        if type(name) is not str:
            if not isinstance(name, str):
                continue
        if skip and id(tensor) in skip:
            continue
        if direct:  # parameter names only: "<layer>.<param>"
            if layer_at(idx.layers, name.rpartition(".")[0]) is not None:
                resolved.append(i)
                _check_other(idx.layers, i, name, tensor, direct, out)
            continue
        target = known(name, _MISS)
        if target is _MISS:
            target = get(name)
        if target is None:
            continue  # not an expert tensor of a managed layer: SGLang's behaviour
        resolved.append(i)
        if target is OTHER:
            _check_other(idx.layers, i, name, tensor, direct, out)
            continue
        slots = target.slots
        if slots is not None and not slots:
            elsewhere.append(i)
            if local_only:
                continue  # another rank's expert: that rank checks it (and SGLang's loader drops it here)
        try:
            _check_expert(i, name, tensor, target, epoch, headers, runs, out)
        except Exception as e:  # noqa: BLE001 - a check that raised refuses its tensor (never the whole loop)
            problems.append((i, f"{name}: the check raised {type(e).__name__}: {e}"))
    for run in runs.values():
        if run is not None:
            run.job(jobs)
    return out


def _check_expert(i: int, name: str, tensor, target: Target, epoch: int, headers: bool, runs: dict, out: Findings):
    """One expert tensor of a request (check_items' loop)."""
    ps = target.ps
    if ps.epoch != epoch:  # the parameter and its plan, looked up once per request
        ps.epoch, ps.param = epoch, ps.layer._parameters.get(ps.pname)
        ps.plan = plan_of(ps.layer, ps.param) if ps.param is not None else None
    plan = ps.plan
    if plan is None or plan.rule is None:
        layer, fmt = ps.layer, format_of(ps.layer)
        if ps.param is None or fmt is None:
            out.problems.append(
                (
                    i,
                    f"{layer_name(layer)}: {name}: no parameter {ps.pname} of this layer takes it "
                    f"(its checkpoint parameters: {managed_names(layer, fmt)})",
                )
            )
            return
        if fmt.load_rule(param_name(layer, ps.param, fmt)) is None:
            return  # a parameter the format does not load (compressed-tensors' weight_shape): SGLang's loader's
    if not isinstance(tensor, torch.Tensor):
        return  # unwrapped later by SGLang; the per-shard check applies
    if plan is not None and target.ok is not plan and plan.name_ok(name, ps.shard, target.expert, "global"):
        target.ok = plan  # the name's own checks (weight name, shard, expert range), once per name and plan
    if plan is not None and target.ok is plan and not plan.converts:
        view = tensor._base is not None
        if view:  # a view of a buffer: the next of a run of this shard's (the first's geometry)?
            run = runs.get(ps, _MISS)
            if run is None:
                view = False  # this shard's views are not of one buffer in this request: no runs
            elif run is not _MISS:
                took = run.takes(tensor)
                if took:
                    run.members.append((i, target, tensor))
                    out.checked.append((i, target))
                    return
                if took is None:
                    run.job(out.jobs)
                    runs[ps], view = None, False
        code = plan.tensor_code(tensor, headers)  # the tensor's own: device, dtype, shape; its value rule
        if code is not None:
            if view:
                old = runs.get(ps)
                if old is not None:
                    old.job(out.jobs)
                runs[ps] = _Run(tensor, code, i, target)
            elif code and tensor.numel():
                out.jobs.append((tensor, code, i, target))
            out.checked.append((i, target))
            return
    # everything else (a write SGLang converts, a refusal): the plan's whole path, which explains a refusal
    found: list = []
    try:
        hit = check_planned(plan, ps.layer, ps.param, tensor, name, ps.shard, target.expert, "global", headers, found)
    except WeightUpdateRefused as e:
        out.problems.append((i, str(e)))
        return
    for job in found:
        job.name = name
        out.jobs.append((job.tensor, job.code, i, job))
    if hit is not None:
        out.checked.append((i, target))


class _Run:
    """Tensors of one ParamShard, accepted in a request's order, that are views of one storage at a constant positive
    byte stride with the first one's shape, strides and dtype (one buffer: a flattened bucket, an IPC buffer, a
    distributed broadcast): each one costs a few comparisons, and their values are checked as one strided view."""

    __slots__ = ("shape", "dtype", "stride", "code", "last", "step", "where", "members")

    def __init__(self, tensor: torch.Tensor, code: str, i: int, target: Target):
        self.code = code
        self.shape, self.dtype, self.stride = tensor.shape, tensor.dtype, tensor.stride()
        self.last, self.step = tensor.data_ptr(), 0
        self.where: int | None = None
        #: (index, Target, tensor) of every tensor of the run, the first first
        self.members = [(i, target, tensor)]

    def takes(self, tensor: torch.Tensor) -> bool | None:
        """Is `tensor` (a view) the next of the run? (It then is.) None: it is of another storage than the run's
        first (the request's tensors of this shard are then taken one by one)."""
        if tensor.dtype is not self.dtype or tensor.shape != self.shape or tensor.stride() != self.stride:
            return False
        p = tensor.data_ptr()
        d = p - self.last
        if d <= 0 or (self.step and d != self.step) or d % tensor.element_size():
            return False
        if self.where is None:  # a second tensor: the first one's storage (asked only now)
            self.where = storage_of(self.members[0][2])
        if storage_of(tensor) != self.where:
            return None
        self.step, self.last = d, p
        return True

    def job(self, jobs: list) -> None:
        """The run's value check: one job of its strided view (or of its one tensor)."""
        if not self.code:
            return
        i, target, t = self.members[0]
        if not t.numel():
            return
        if len(self.members) == 1:
            jobs.append((t, self.code, i, target))
            return
        view = t.as_strided(
            (len(self.members), *self.shape), (self.step // t.element_size(), *self.stride), t.storage_offset()
        )
        jobs.append((view, self.code, i, self))

    def refusals(self) -> list[tuple[int, str]]:
        """(index, refusal) of each tensor of the run whose values break its rule (one read-back each: refusals
        only)."""
        out = []
        for i, target, t in self.members:
            if value_checks.bad_one(t, self.code):
                out.append((i, value_refusal((t, self.code, i, target))))
        return out


def check_values(findings: Findings) -> None:
    """The values of every job of `findings` at once (value_checks.find_bad: at most one device synchronisation per
    device); a refusal per bad one, added to its problems."""
    jobs = findings.jobs
    if not jobs:
        return
    bad = value_checks.find_bad([(j[0], j[1]) for j in jobs])
    for b in bad:
        job = jobs[b]
        if isinstance(job[3], _Run):
            findings.problems.extend(job[3].refusals())
        else:
            findings.problems.append((job[2], value_refusal(job)))
    findings.problems.sort(key=lambda p: p[0])


def value_refusal(job, tensor: torch.Tensor | None = None) -> str:
    """The refusal of a value job (its values, or `tensor`: its values read from the files)."""
    maker = job[3]
    if isinstance(maker, ValueJob):
        return maker.refusal(tensor)
    ps = maker.ps
    vj = ValueJob(job[0], job[1], ps.plan.rule, (ps.layer, ps.plan.name, ps.shard, maker.expert))
    return vj.refusal(tensor)


def check_bucket(
    model,
    named_tensors,
    direct: bool = False,
    skip=frozenset(),
    headers: bool = False,
    what: str = "weight-update bucket",
    record: Checked | None = None,
    local_only: bool = False,
) -> list:
    """Validate every tensor of an update bucket that targets a managed layer of `model` before any of the bucket
    is loaded: one bad tensor refuses the whole bucket (SGLang would load the ones before it, then fail or corrupt).
    Names below a managed layer that no parameter of it takes are refused too; other names are left to SGLang. The
    values of all tensors are checked at once, after their names, dtypes and shapes (at most one device
    synchronisation per device of the bucket: value_checks.find_bad). This rank's verdict alone: a request whose
    ranks answer together checks through updates/request.py.

    direct=False: checkpoint names as `model.load_weights` takes them (`<layer>.<expert>.<projection>.<suffix>`).
    direct=True: parameter names (`<layer>.<param>`, load_format="direct"); returns the (layer, param name) pairs the
    bucket writes, which the caller returns to checkpoint layout before SGLang writes them whole.
    skip: ids of tensors already checked (the same objects, handed on by SGLang).
    headers: the tensors are a checkpoint's meta tensors (checkpoint_headers.read_headers): their values are not
    checked here (check_checkpoint reads them).
    record: a `checked_writes.Checked` of the request: once the whole bucket passed, every expert write it validated is
    recorded there, so the loader hooks do not check it again."""
    found = check_items(model, named_tensors, direct, skip, headers, local_only)
    if not headers:
        check_values(found)
    if found.problems:
        raise BucketRefused(refusal_text(found.problems, what, len(named_tensors)))
    if record is not None and not headers:
        record.add_checked(named_tensors, found.checked)
    return found.writes


def refusal_text(problems: list[tuple[int, str]], what: str, n: int, refused: int | None = None) -> str:
    """The message of a whole request of `n` tensors refused for `problems` ((index, message), the first tensor
    first; `refused` of them in all, where more were refused than named)."""
    texts = [p.removesuffix(NOTHING_WRITTEN) for _, p in problems]  # said once for the whole request below
    count = max(len(texts), refused or 0)
    more = f" (and {count - 3} more)" if count > 3 else ""
    return (
        f"refused the whole {what} ({n} tensors, {count} refused): "
        + " | ".join(texts[:3])
        + more
        + "; nothing of it was written"
    )


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


def _check_other(layers: dict, i: int, name: str, tensor, direct: bool, out: Findings) -> None:
    """A "<layer>.<param>" name: a fused checkpoint tensor of all experts (gpt-oss), a whole-parameter write
    (load_format="direct"), or a parameter name where model.load_weights takes checkpoint names (refused)."""
    path, _, pname = name.rpartition(".")
    layer = layer_at(layers, path)
    fmt = format_of(layer)
    param = layer._parameters.get(pname)
    fused_param = fmt.fused_checkpoint_names.get(pname) if param is None and not direct else None
    found: list = []
    try:
        if fused_param is not None:  # a checkpoint tensor of all experts (gpt-oss): dtype and values here;
            # its shape once the model's loader has narrowed it to this rank (validate_fused at the write)
            validate_fused(layer, fused_param, layer._parameters[fused_param], tensor, shape=False, values=found)
            return
        if param is None:
            if direct:
                out.problems.append(
                    (
                        i,
                        f"{layer_name(layer)}: {name}: the layer has no parameter {pname} "
                        f"(its checkpoint parameters: {managed_names(layer, fmt)})",
                    )
                )
            return
        own = param_name(layer, param, fmt)
        if fmt.load_rule(own) is None:
            return  # a parameter the format does not load (kernel scalars): SGLang's behaviour
        if not direct:
            out.problems.append(
                (
                    i,
                    f"{layer_name(layer)}: {name} is a parameter name; model.load_weights takes "
                    f"checkpoint names (<layer>.<expert>.<projection>.<suffix>) — whole parameters go "
                    f"through load_format='direct'",
                )
            )
            return
        _check_full(layer, fmt, own, param, tensor, name, found)
        out.writes.append((layer, own))
    except WeightUpdateRefused as e:
        out.problems.append((i, str(e)))
    finally:
        for job in found:
            job.name = name
            out.jobs.append((job.tensor, job.code, i, job))
