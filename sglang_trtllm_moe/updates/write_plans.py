"""Write plans: what a write into one parameter of one layer must look like, computed once per (layer, parameter)
(`plan_of`), so a write that passes every check costs a few dict lookups and comparisons (validation.py runs the
full checks for anything a plan does not accept)."""

from __future__ import annotations

import weakref

import torch

from ..formats.base import WeightFormat
from ..formats.load_rules import LoadRule
from ..layer_state import PLANS_ATTR
from . import value_checks
from .checked_writes import values_from_files
from .layer_params import format_of, global_expert_count, intermediate_extents, param_name, param_view
from .refusal import ValueJob

_CPU = torch.device("cpu")


class WritePlan:
    """What `check_write` needs to accept a write into one parameter of one layer, computed once (`plan_of`): the
    parameter's managed name, its rule, the shard ids it takes, the expert ranges, the devices, the accepted dtypes
    (cached per loaded dtype), the accepted shapes (where the layer's sizes make them a small set) and the value rule
    per loaded dtype. `accepts` answers (name, expert id) for a write every check would accept, None for anything
    else (the full checks then decide, and refuse with their message)."""

    __slots__ = (
        "param",
        "fmt",
        "name",
        "dot_name",
        "rule",
        "shape",
        "dtype",
        "ptr",
        "shards",
        "global_n",
        "local_n",
        "devices",
        "dtypes",
        "shapes",
        "codes",
        "converts",
        "managed",
        "hit",
    )

    def __init__(self, layer, fmt, param, name: str, rule: LoadRule | None):
        #: the parameter, weakly (a plan never keeps a replaced parameter's storage alive)
        self.param = weakref.ref(param)
        self.fmt, self.name, self.dot_name, self.rule = fmt, name, "." + name, rule
        self.shape, self.dtype, self.ptr = param.shape, param.dtype, param.data_ptr()
        self.dtypes: dict = {}
        self.codes: dict = {}
        self.shapes: frozenset | None = None
        self.shards: tuple = ()
        self.global_n = self.local_n = 0
        self.devices = frozenset((param.device, _CPU))
        self.converts = type(fmt).converted_by_sglang is not WeightFormat.converted_by_sglang
        self.hit = (name, self.dot_name, 0)
        #: every parameter name the format has a rule for (a weight_name ending in another one is checked in full)
        self.managed = frozenset((*(p.name for p in fmt.params), *fmt.scalar_params))
        if rule is None:
            return
        gated = fmt.is_gated(layer)
        self.shards = ("w2",) if rule.group == "w2" else (("w1", "w3") if gated else ("w1",))
        view = param_view(layer, fmt, name, param)
        self.global_n = global_expert_count(layer, param)
        self.local_n = int(view.shape[0])
        #: what a request's record says of a write this plan accepted (checked_writes.Checked)
        self.hit = (name, self.dot_name, self.local_n)
        if rule.scalar:
            self.shapes = frozenset({(), (1,)})
        else:
            extents, _, _ = intermediate_extents(layer, fmt, rule, view, gated)
            if isinstance(extents, tuple):
                if rule.group == "w13":
                    self.shapes = frozenset((x, int(view.shape[2])) for x in extents)
                else:
                    self.shapes = frozenset((int(view.shape[1]), x) for x in extents)

    def accepts(self, layer, param, loaded, weight_name, shard_id, expert_id, scope, headers, values):
        if type(weight_name) is not str:
            return None
        # SGLang's mapped name ends in the parameter's; a checkpoint name ("...experts.3.gate_proj.weight_scale")
        # ends in a suffix that names no other parameter
        if not weight_name.endswith(self.dot_name) and weight_name[weight_name.rfind(".") + 1 :] in self.managed:
            return None
        if type(shard_id) is not str or shard_id not in self.shards or type(expert_id) is not int:
            return None
        n = self.global_n if scope == "global" else self.local_n
        if n and not 0 <= expert_id < n:
            return None
        if not isinstance(loaded, torch.Tensor):
            return None
        if self.converts and self.fmt.converted_by_sglang(layer, self.name, loaded, expert_id, scope):
            shape = self.fmt.converted_shape(layer, self.name, loaded)
            if shape is not None and (self.shapes is None or tuple(shape) not in self.shapes):
                return None  # the full checks refuse it, naming the shape
            if loaded.device.type != "meta":
                if self.fmt.source_problem(layer, self.name, loaded):
                    return None  # the full checks refuse it, naming the values
            elif isinstance(values, list) and self.fmt.source_values is not None:  # a header: read from the file
                job = ValueJob(loaded, self.fmt.source_values, self.rule, (layer, self.name, shard_id, expert_id))  # type: ignore[arg-type]
                values.append(job)
            return self.name, expert_id
        dev = loaded.device
        if dev not in self.devices and not (headers and dev.type == "meta"):
            return None
        dt = loaded.dtype
        ok = self.dtypes.get(dt)
        if ok is None:
            ok = self.dtypes[dt] = self.rule.accepts_dtype(dt, self.dtype)  # type: ignore[union-attr]
        if not ok or self.shapes is None or loaded.shape not in self.shapes:
            return None
        if values is False:
            return self.name, expert_id
        code = self.codes.get(dt, 0)
        if code == 0:
            code = self.codes[dt] = self.rule.value_rule(self.dtype, dt)  # type: ignore[union-attr]
        if code is None or not loaded.numel():
            return self.name, expert_id
        if isinstance(values, list):
            values.append(ValueJob(loaded, code, self.rule, (layer, self.name, shard_id, expert_id)))  # type: ignore[arg-type]
        elif dev.type != "meta" and not (scope == "global" and values_from_files(param, shard_id, expert_id)):
            if value_checks.bad_one(loaded, code):
                return None  # the full checks refuse it, naming the value
        return self.name, expert_id


def plan_of(layer, param) -> WritePlan | None:
    """The write plan of `param` in `layer` (cached on the layer, rebuilt when the parameter's storage, shape or
    dtype changed, or another parameter took its name); None when the layer is not the plugin's (managed or
    watched), or `param` is not one of its parameters or is one the plugin computes (the full checks refuse those)."""
    d = getattr(layer, "__dict__", None)
    plans = d.get(PLANS_ATTR) if d is not None else None
    if plans is not None:
        plan = plans.get(id(param))
        if (
            plan is not None
            and plan.param() is param
            and d["_parameters"].get(plan.name) is param  # type: ignore[index]
            and param.data_ptr() == plan.ptr
            and param.dtype is plan.dtype
            and param.shape == plan.shape
        ):
            return plan
    elif d is None or not isinstance(d.get("_parameters"), dict) or format_of(layer) is None:
        return None  # not an nn.Module (the full checks), or not the plugin's layer
    return _new_plan(layer, param)


def _new_plan(layer, param) -> WritePlan | None:
    fmt = format_of(layer)
    if fmt is None or not isinstance(param, torch.Tensor):
        return None
    name = param_name(layer, param, fmt)
    if name is None:
        return None
    rule = fmt.load_rule(name)
    if rule is None and not hasattr(param, "weight_loader"):
        return None  # a kernel scalar the plugin computes: refused by the full checks
    plan = WritePlan(layer, fmt, param, name, rule)
    plans = layer.__dict__.setdefault(PLANS_ATTR, {})
    for key, old in list(plans.items()):  # plans of parameters the layer no longer holds (no storage kept alive)
        p = old.param()
        if p is None or layer._parameters.get(old.name) is not p:
            plans.pop(key, None)
    plans[id(param)] = plan
    return plan
