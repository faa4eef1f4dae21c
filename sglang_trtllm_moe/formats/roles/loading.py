"""The loading role: what an RL weight update may write into a format's parameters, and what SGLang's own loader
converts on the way in.

validation.py, bucket_validation.py and write_plans.py read only this role (and the parameter list of the layout
role); a format overrides what its loader does differently.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import ClassVar

import torch

from ..load_rules import BLOCK_SCALE, INPUT_SCALE, POSITIVE, TENSOR_SCALE, WEIGHT, LoadRule
from ..records import Layer, ParamLayout


class Loading:
    """Nothing required: every rule derives from the layout role's `params` / `scalar_params` (see `LoadRule`).

    MAY define: `ParamLayout.kind / load_dtypes / values` (on the layout role's parameters), `scalar_rules`,
    `converted_by_sglang` (+ `converted_shape`, `source_problem`, `pairs_sources`, `source_values`) for writes
    SGLang's loader converts itself, `fused` with `fused_checkpoint_names` (all experts written at once: gpt-oss),
    `batched_where_sglang_prepares`."""

    #: LoadRule overrides for `scalar_params` (default: group from the "w13_"/"w2_" prefix, INPUT_SCALE when
    #: "input" is in the name else TENSOR_SCALE, values POSITIVE)
    scalar_rules: ClassVar[Mapping[str, LoadRule]] = {}
    # read from the layout role
    params: ClassVar[tuple[ParamLayout, ...]]
    scalar_params: ClassVar[tuple[str, ...]]
    #: the loader writes all experts of a parameter at once (gpt-oss: `expert_id=None`); a "partial" update is a
    #: whole-group write, validated and un-prepared in the FusedMoE.weight_loader hook
    fused: ClassVar[bool] = False
    #: `fused` formats: the checkpoint's names of all-expert tensors below the MoE layer -> the parameter SGLang's
    #: model loader writes them into (so a whole request's check finds them)
    fused_checkpoint_names: ClassVar[Mapping[str, str]] = {}
    #: where SGLang prepares this format itself (compat/defer.py), a layer keeps the loaded layout and SGLang's loader
    #: does nothing but write the bytes: a validated bucket's expert tensors may then be written batched
    #: (batched_writes.py) into such a layer too. False: SGLang's per-tensor loader writes them (its own restore
    #: before a load, e.g. BF16's whole-layer un-block on 0.5.23, stays SGLang's)
    batched_where_sglang_prepares: ClassVar[bool] = False
    #: True when SGLang converts a gated expert's w1 and w3 source writes together (one scale per pair) and holds a
    #: half until its partner arrives: a disk update's checkpoint must hold both halves of every such expert it holds
    pairs_sources: bool = False
    #: the value rule (load_rules.VALUE_RULES) of a write `converted_by_sglang` whose values are read later (a disk
    #: update's checkpoint, from its files before SGLang loads anything), or None: not value-checked there
    source_values: str | None = None

    def load_rule(self, param_name: str) -> LoadRule | None:
        """The rule for writes into `param_name`, or None when the format does not manage it (cached)."""
        rules = self.__dict__.get("_load_rules")
        if rules is None:
            rules = {}
            for p in self.params:
                kind = p.kind or (BLOCK_SCALE if (p.sf_swizzle or "scale" in p.name) else WEIGHT)
                rules[p.name] = LoadRule(p.name, p.group, kind, tuple(p.load_dtypes), p.values, p.byte_code)
            for n in self.scalar_params:
                rules[n] = self.scalar_rules.get(n) or LoadRule(
                    n,
                    "w2" if n.startswith("w2") else "w13",
                    INPUT_SCALE if "input" in n else TENSOR_SCALE,
                    values=POSITIVE,
                )
            self.__dict__["_load_rules"] = rules
        return rules.get(param_name)

    def converted_by_sglang(self, layer: Layer, param_name: str, loaded: torch.Tensor, expert: int, scope: str) -> bool:
        """True when SGLang's loader converts this write itself before storing it (its own dtypes and shapes, e.g. a
        fused FP8 shared expert requantized into FP4-expert storage): validation checks only the shard and expert id.
        `scope`: "global" (a checkpoint expert id) or "local"."""
        return False

    def converted_shape(self, layer: Layer, param_name: str, loaded: torch.Tensor) -> tuple | None:
        """For a write `converted_by_sglang`: the shape SGLang's conversion stores (checked like a direct write of
        the parameter's dtype), or None (only the ids are checked)."""
        return None

    def source_problem(self, layer: Layer, param_name: str, loaded: torch.Tensor) -> str | None:
        """For a write `converted_by_sglang` on a real device: why its values cannot be converted, or None."""
        return None
