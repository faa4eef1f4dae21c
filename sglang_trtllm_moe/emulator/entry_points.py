"""The emulator's entry points, made from `kernel_api.SIGNATURES`: a family module gives its impl (and the options
of its own it refuses); the flashinfer signature, the routing and the refusals every family shares are made here.

Why generated: the eight signatures of about 30 parameters each (they differ in order, defaults and extras) were
written out once per entry point, next to the table the tests compare with flashinfer. Why `exec` of a plain `def`
(as `dataclasses` makes `__init__`): the callable is then a real Python function of that signature, so binding
costs what any call costs (no `Signature.bind` per call: the emulator runs inside CUDA graphs), positional and
keyword calls and their errors (missing, unknown, duplicate arguments) are Python's own, and `inspect.signature`
reads it from the code.

Each parameter of an entry point must be accounted for when it is made (else import fails, naming it): consumed by
the impl, the option check or the routing, refused unless off (`REFUSED_UNLESS_OFF`), or one that changes no result
(`NO_EFFECT`). A parameter flashinfer adds to the table is thus never silently ignored.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

from ..kernel_api import SIGNATURES, kernel_function
from . import common
from .common import unsupported
from .routing import split_routed_input

#: options that change what the kernel computes and that no family models: refused unless off, where the family's
#: impl does not take them (the FP4 impl takes the GEMM biases; FP8 block has them too and does not)
REFUSED_UNLESS_OFF: dict[str, Callable[[Any], bool]] = {
    "do_finalize": bool,  # the unfinalized (per-slot) output is not emulated
    "num_fused_shared_experts": lambda v: not v,
    "gemm1_bias": lambda v: v is None,
    "gemm2_bias": lambda v: v is None,
    "gemm1_lora_delta": lambda v: v is None,
    "routing_metadata": lambda v: v is None,
}
#: what changes no result: launch and autotuning hints, the expert count (the weights say it), scratch memory
NO_EFFECT = frozenset({"num_experts", "enable_pdl", "tune_max_num_tokens", "workspace_buffer"})
#: the routing the kernel runs from `routing_logits` (common.routing's parameters); a `_routed` entry point takes
#: its top-k precomputed (`topk_ids`) and the routing arguments it still has change nothing
ROUTING = tuple(inspect.signature(common.routing).parameters)


@functools.cache
def _params(fn: Callable[..., Any], skip: int = 0) -> tuple[str, ...]:
    return tuple(inspect.signature(fn).parameters)[skip:]


def entry_points(
    family: str,
    impl: Callable[..., Any],
    doc: str,
    check: Callable[..., None] | None = None,
) -> tuple[Callable[..., Any], Callable[..., Any]]:
    """The family's two entry points (logits-routed, then `_routed`), each with its flashinfer signature.
    `impl(ids, weights, **args)` computes from the top-k and the arguments it names (an argument the entry point
    does not take is None: `routing_replay_out` of the routed FP4 / FP8 block ones); `check(**args)`, if given,
    raises NotImplementedError for what the family takes but does not model."""
    module = impl.__module__
    return (
        _make(kernel_function(family, False), False, impl, check, doc, module),
        _make(kernel_function(family, True), True, impl, check, doc, module),
    )


def _make(name: str, routed: bool, impl, check, doc: str, module: str) -> Callable[..., Any]:
    sig = SIGNATURES[name]
    taken = set(sig.parameters)
    impl_args = _params(impl, 2)
    check_args = _params(check) if check is not None else ()
    unknown = (set(impl_args) - taken - {"routing_replay_out"}) | (set(check_args) - taken)
    if unknown:
        raise TypeError(f"{name}: {module} reads {sorted(unknown)}, which the flashinfer entry point does not take")
    refused = tuple((n, ok) for n, ok in REFUSED_UNLESS_OFF.items() if n in taken and n not in impl_args)
    handled = {*impl_args, *check_args, *(n for n, _ in refused), *NO_EFFECT, *ROUTING, "topk_ids"}
    if taken - handled:
        raise TypeError(
            f"{name}: the emulator does not handle {sorted(taken - handled)}: model them in {module}'s impl or check, "
            "or list them in entry_points.REFUSED_UNLESS_OFF / NO_EFFECT"
        )

    def run(args: dict[str, Any]) -> Any:
        for n, ok in refused:
            if not ok(args[n]):
                unsupported(**{n: ("<tensor>" if hasattr(args[n], "shape") else args[n], False)})
        if check is not None:
            check(**{n: args[n] for n in check_args})
        if routed:
            ids, weights = split_routed_input(args["topk_ids"])
        else:
            ids, weights = common.routing(**{n: args[n] for n in ROUTING})
        return impl(ids, weights, **{n: args.get(n) for n in impl_args})

    return _define(name, sig, run, f"Emulates flashinfer `{name}` ({doc}).", module)


def _define(name: str, sig: inspect.Signature, run: Callable[[dict[str, Any]], Any], doc: str, module: str):
    """`def name(<sig>): return run(locals())`, its defaults the table's objects (not their reprs)."""
    namespace: dict[str, Any] = {"_run": run}
    parts, keyword_only = [], False
    for i, p in enumerate(sig.parameters.values()):
        assert p.name.isidentifier() and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY), p
        if p.kind is p.KEYWORD_ONLY and not keyword_only:
            parts.append("*")
            keyword_only = True
        if p.default is p.empty:
            parts.append(p.name)
        else:
            namespace[f"_default{i}"] = p.default
            parts.append(f"{p.name}=_default{i}")
    exec(f"def {name}({', '.join(parts)}):\n    return _run(locals())\n", namespace)  # noqa: S102
    fn = namespace[name]
    fn.__doc__, fn.__module__, fn.__qualname__ = doc, module, name
    return fn
