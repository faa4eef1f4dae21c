"""Write plans: what a write into one parameter of one layer must look like, computed once per (layer, parameter)
(`plan_of`), so a write that passes every check costs a few dict lookups and comparisons (validation.py runs the
full checks for anything a plan does not accept).

The structural rules of a write are declared once, here (`names_another_parameter`, `shards_of`, `expert_count`,
`accepted_devices`, `ShapeRule`; the dtype and value rules are the format's `LoadRule.accepts_dtype` /
`value_rule`): a plan compiles them into its fields and the hot path only executes those; the full checks
(validation.py) ask the same rules and build a refusal's message from them only when one fails."""

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


# ---- the rules of a write, each declared once ----------------------------------------------------------------------


def named_parameter(weight_name: str) -> str:
    """The parameter a write's `weight_name` names: its last dotted part (SGLang's loader routes a write by it:
    "input_scale", "weight_scale_2", "scale", ...)."""
    return weight_name[weight_name.rfind(".") + 1 :]


def rule_names(fmt) -> frozenset[str]:
    """Every parameter name `fmt` has a load rule for (`WeightFormat.load_rule`: its laid-out and scalar params)."""
    return frozenset((*(p.name for p in fmt.params), *fmt.scalar_params))


def names_another_parameter(fmt, weight_name: str, name: str) -> str | None:
    """The other parameter with a load rule that `weight_name` names instead of `name` — SGLang's loader would write
    it by that parameter's rule — or None (a plan compiles it: `rule_names` and the name's dotted tail)."""
    tail = named_parameter(weight_name)
    return tail if tail != name and fmt.load_rule(tail) is not None else None


def shards_of(rule: LoadRule, gated: bool) -> tuple[str, ...]:
    """The shard ids a parameter of `rule` takes: w2 for the w2 group; w1 / w3 for the w13 group (w1 alone where the
    layer is not gated) — per-tensor scales and input scales included."""
    return ("w2",) if rule.group == "w2" else (("w1", "w3") if gated else ("w1",))


def expert_count(layer, param, view, scope: str) -> int:
    """How many expert ids a write into `param` may name (0: no bound known): the checkpoint's experts in
    `FusedMoE.weight_loader` (scope "global"), the experts the parameter keeps in `_weight_loader_impl` ("local":
    the local ones, or every expert for parameters SGLang keeps per global expert)."""
    return global_expert_count(layer, param) if scope == "global" else int(view.shape[0])


def accepted_devices(param) -> frozenset:
    """The devices a loaded tensor may be on: the parameter's, or the CPU (a header's meta tensor stands for a
    checkpoint tensor not read yet: accepted where the caller checks headers)."""
    return frozenset((param.device, _CPU))


class ShapeRule:
    """The shapes a one-expert, one-shard write into a parameter may have: a per-expert scale is 0-dim or [1]; a
    weight or block scale is 2-D, the dimension TP does not split equals the parameter's and the split one is one of
    the layer's `extents` (the checkpoint's logical intermediate, or the layer's padded size). `shapes`: the accepted
    shapes as a set where they are few (what a plan compares against), else None."""

    __slots__ = ("rule", "view_shape", "scalar", "extents", "fixed_dim", "split_dim", "fixed", "expected", "shapes")

    def __init__(self, layer, fmt, rule: LoadRule, view, gated: bool):
        self.rule, self.view_shape, self.scalar = rule, tuple(view.shape), rule.scalar
        if self.scalar:
            self.shapes: frozenset | None = frozenset({(), (1,)})
            return
        self.extents, want, _ = intermediate_extents(layer, fmt, rule, view, gated)
        if rule.group == "w13":
            self.fixed_dim, self.split_dim, self.fixed = 1, 0, int(view.shape[2])
            self.expected = f"[{want}, {self.fixed}]"
        else:
            self.fixed_dim, self.split_dim, self.fixed = 0, 1, int(view.shape[1])
            self.expected = f"[{self.fixed}, {want}]"
        self.shapes = None
        if isinstance(self.extents, tuple):
            if self.fixed_dim == 1:
                self.shapes = frozenset((x, self.fixed) for x in self.extents)
            else:
                self.shapes = frozenset((self.fixed, x) for x in self.extents)

    def problem(self, shape: tuple) -> tuple[str, str] | None:
        """(what is wrong with `shape`, what is expected) — None where the rule accepts it."""
        rule = self.rule
        if self.scalar:
            if shape in ((), (1,)):
                return None
            return (
                f"shape {shape}: {rule.name} holds one {rule.kind.replace('_', ' ')} per expert and shard",
                "a 0-dim or [1] tensor",
            )
        fixed_dim, split_dim, fixed, extents = self.fixed_dim, self.split_dim, self.fixed, self.extents
        if len(shape) == 2 and shape[fixed_dim] == fixed and shape[split_dim] in extents:
            return None
        short = len(shape) == 2 and shape[fixed_dim] == fixed and 0 < shape[split_dim] < max(extents)
        note = " (SGLang would zero-fill the rest)" if short else ""
        return f"shape {shape} does not fit {rule.name} {self.view_shape}{note}", self.expected


# ---- the plan of one parameter ---------------------------------------------------------------------------------


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
        self.devices = accepted_devices(param)
        self.converts = type(fmt).converted_by_sglang is not WeightFormat.converted_by_sglang
        self.hit = (name, self.dot_name, 0)
        #: every parameter name the format has a rule for (a weight_name ending in another one is checked in full:
        #: `names_another_parameter`)
        self.managed = rule_names(fmt)
        if rule is None:
            return
        gated = fmt.is_gated(layer)
        self.shards = shards_of(rule, gated)
        view = param_view(layer, fmt, name, param)
        self.global_n = expert_count(layer, param, view, "global")
        self.local_n = expert_count(layer, param, view, "local")
        #: what a request's record says of a write this plan accepted (checked_writes.Checked)
        self.hit = (name, self.dot_name, self.local_n)
        self.shapes = ShapeRule(layer, fmt, rule, view, gated).shapes

    def accepts(self, layer, param, loaded, weight_name, shard_id, expert_id, scope, headers, values):
        if not self.name_ok(weight_name, shard_id, expert_id, scope) or not isinstance(loaded, torch.Tensor):
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
        code = self.tensor_code(loaded, headers)
        if code is None:
            return None
        if values is False or not code or not loaded.numel():
            return self.name, expert_id
        if isinstance(values, list):
            values.append(ValueJob(loaded, code, self.rule, (layer, self.name, shard_id, expert_id)))  # type: ignore[arg-type]
        elif loaded.device.type != "meta" and not (scope == "global" and values_from_files(param, shard_id, expert_id)):
            if value_checks.bad_one(loaded, code):
                return None  # the full checks refuse it, naming the value
        return self.name, expert_id

    def name_ok(self, weight_name, shard_id, expert_id, scope: str) -> bool:
        """A write's own checks, before its tensor's: `weight_name` names this parameter (SGLang's mapped name ends
        in the parameter's; a checkpoint name, "...experts.3.gate_proj.weight_scale", ends in a suffix that names no
        other parameter), its shard id is one this parameter takes, its expert id an int in range for `scope`."""
        if type(weight_name) is not str:
            return False
        if not weight_name.endswith(self.dot_name) and named_parameter(weight_name) in self.managed:
            return False
        if type(shard_id) is not str or shard_id not in self.shards or type(expert_id) is not int:
            return False
        n = self.global_n if scope == "global" else self.local_n
        return not n or 0 <= expert_id < n

    def tensor_code(self, loaded: torch.Tensor, headers: bool = False) -> str | None:
        """A plain (not converted) write of tensor `loaded`: None when its device, dtype or shape is not accepted;
        else the value rule its values must pass ("": none). headers: a meta tensor stands for a checkpoint tensor
        whose values are read later."""
        if not loaded.is_cpu:  # (the CPU is always accepted: what disk loads deliver)
            dev = loaded.device
            if dev not in self.devices and not (headers and dev.type == "meta"):
                return None
        dt = loaded.dtype
        ok = self.dtypes.get(dt)
        if ok is None:
            ok = self.dtypes[dt] = self.rule.accepts_dtype(dt, self.dtype)  # type: ignore[union-attr]
        if not ok or self.shapes is None or loaded.shape not in self.shapes:
            return None
        code = self.codes.get(dt)
        if code is None:
            code = self.codes[dt] = self.rule.value_rule(self.dtype, dt) or ""  # type: ignore[union-attr]
        return code


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
