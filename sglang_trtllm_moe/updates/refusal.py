"""How a write is refused: `Refusal` (the message, built only when refusing) and the value checks of one write
(`ValueJob`: a tensor's values, checked with the other tensors of its request, or at once)."""

from __future__ import annotations

from typing import NoReturn

import torch

from ..errors import WeightUpdateRefused
from ..formats.load_rules import LoadRule
from ..layer_state import layer_name
from . import value_checks

#: how every refusal ends (a whole request's refusal says it once, for all its tensors)
NOTHING_WRITTEN = "; nothing was written"


def short(x) -> str:
    if isinstance(x, torch.Tensor):
        r = (
            f"tensor({x.tolist()!r}, dtype={x.dtype})"
            if x.numel() <= 4 and x.device.type != "meta"
            else f"tensor(shape={tuple(x.shape)}, dtype={x.dtype}, device={x.device})"
        )
    else:
        r = repr(x)
    return r if len(r) <= 80 else r[:77] + "..."


class Refusal:
    """Raises a refusal of one write: "<layer>: refused weight update of <param> (<what>): <problem>; expected
    <expected>; nothing was written". Keeps its arguments; the message is built only when it refuses."""

    __slots__ = ("layer", "name", "shard_id", "expert_id", "what")

    def __init__(self, layer, name, shard_id, expert_id, what: str | None = None):
        self.layer, self.name, self.shard_id, self.expert_id, self.what = layer, name, shard_id, expert_id, what

    @property
    def where(self) -> str:
        what = self.what or f"shard {short(self.shard_id)}, expert {short(self.expert_id)}"
        return f"{layer_name(self.layer)}: refused weight update of {self.name} ({what})"

    def __call__(self, problem: str, expected: str) -> NoReturn:
        raise WeightUpdateRefused(f"{self.where}: {problem}; expected {expected}{NOTHING_WRITTEN}")


class ValueJob:
    """The values of one tensor of a request, to be checked with the others (`values=` list of check_write).

    tensor: the tensor (a meta tensor for a checkpoint's header: its values are read later); code: the value rule
    (formats/base.py VALUE_RULES); rule; refuse: its Refusal, or the (layer, parameter name, shard id, expert id) to
    build it from if it refuses; name: the checkpoint name it came by (set by the request's check)."""

    __slots__ = ("tensor", "code", "rule", "_refuse", "name")

    def __init__(self, tensor: torch.Tensor, code: str, rule: LoadRule, refuse, name: str = ""):
        self.tensor, self.code, self.rule, self._refuse, self.name = tensor, code, rule, refuse, name

    @property
    def refuse(self) -> Refusal:
        r = self._refuse
        if not isinstance(r, Refusal):
            r = self._refuse = Refusal(*r)
        return r

    def refusal(self, tensor: torch.Tensor | None = None) -> str:
        """The refusal message for this tensor's (or its values', read later) bad value."""
        try:
            refuse_values(self.rule, self.tensor if tensor is None else tensor, self.code, self.refuse)
        except WeightUpdateRefused as e:
            return str(e)
        raise AssertionError("refuse_values returned")


def value_rule_of(rule: LoadRule, param, loaded) -> str | None:
    """The value rule `loaded` must satisfy to be written into `param` (None: not value-checked, or a header's meta
    tensor, which has no values)."""
    if not isinstance(loaded, torch.Tensor) or loaded.device.type == "meta" or not loaded.numel():
        return None
    return rule.value_rule(param.dtype, loaded.dtype)


def check_values(rule: LoadRule, param, loaded, refuse: Refusal) -> None:
    """One tensor's values (a whole request checks all of its tensors at once: bucket_validation.py)."""
    code = value_rule_of(rule, param, loaded)
    if code is not None and value_checks.bad_one(loaded, code):
        refuse_values(rule, loaded, code, refuse)


def refuse_values(rule: LoadRule, loaded, code: str, refuse: Refusal) -> NoReturn:
    refuse(
        f"{rule.name} {value_checks.describe_bad(loaded, code)} is not a valid {rule.kind.replace('_', ' ')}",
        value_checks.EXPECTED[code],
    )
