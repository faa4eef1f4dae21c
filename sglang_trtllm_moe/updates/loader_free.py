"""The end of a loader-free session: the values a load would refuse, found before anything is laid out.

A writer that puts raw bytes straight into the served parameters (P2P / RDMA, between `begin_weight_update` and
`end_weight_update`; SGLang then ends the session with `run_post_load=True`) passes no loader hook, so none of the
per-write checks ran. At the end, before any layer is laid out, `check` reads the values every load is held to
(each format's value rules, `WeightFormat.load_rule(...).value_rule`: block scales finite and >= 0 — 1-byte encodings
by their bytes —, per-tensor and input scales finite and > 0) in every parameter of every layer the plugin manages
or watches — only the experts the writer said it wrote where it said so (updates/session_writes.py) — one reduction
per parameter of each layer and one read-back per device for the whole session (value_checks.find_bad). Weights
are data (every bit pattern is a number) and are not checked, as in a load.

The writer already overwrote the previous bytes: there is nothing to put back. A refused expert is *fenced*
(`fence`): every byte of it written as a zero expert — weights (and biases) 0, block scales 0, its per-tensor and
input scales set to values that keep the layer's shared scalars what the other experts make them — so it
contributes exactly 0 to every token routed to it, whatever the kernel (a CUDA graph replays the same bytes). The
layer is laid out as usual, every other expert serving what the writer wrote, and the session answers
`(False, message)` naming the layer, the parameter, the expert and the value. Never NaN, never silently.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import layer_state
from ..formats.base import Layer, WeightFormat
from ..formats.load_rules import INPUT_SCALE
from . import value_checks

#: how many refused values a message spells out (the rest are counted)
SHOWN = 4


@dataclass(frozen=True)
class Bad:
    """One refused expert of one parameter."""

    #: the layer's name (its prefix)
    layer: str
    param: str
    #: the expert's global slot (updates/session_writes.py), or None: the parameter is not per expert
    slot: int | None
    #: the first refused value of the expert, and its index
    what: str
    #: what the rule asks for
    expected: str

    def sentence(self) -> str:
        who = f"expert {self.slot}" if self.slot is not None else "the layer (not per expert)"
        return f"{self.layer}: {self.param} of {who} holds {self.what}; expected {self.expected}"


def layers_of(model) -> list[tuple[Layer, WeightFormat, bool]]:
    """(layer, format, managed) for every layer of `model` the plugin manages (True) or watches (False)."""
    out: list[tuple[Layer, WeightFormat, bool]] = []
    for module in model.modules():
        st = layer_state.state_of(module)
        if st is not None:
            out.append((module, st.fmt, True))
            continue
        fmt = layer_state.observed(module)
        if fmt is not None:
            out.append((module, fmt, False))
    return out


def _offset(layer, num_experts: int) -> int:
    return int(getattr(layer, "moe_ep_rank", 0) or 0) * num_experts


def _ruled(layer, fmt) -> list[tuple[str, torch.Tensor, str]]:
    """(parameter name, its tensor [experts, ...] or not per expert, value rule) of `layer`'s parameters that hold
    checked values."""
    out = []
    for name in (*(p.name for p in fmt.params), *fmt.scalar_params):
        if name in fmt.recomputed_params:
            continue
        rule = fmt.load_rule(name)
        t = getattr(layer, name, None)
        if rule is None or not isinstance(t, torch.Tensor) or not t.numel():
            continue
        code = rule.value_rule(t.dtype)
        if code is not None:
            out.append((name, t.detach(), code))
    return out


def check(model, experts_of=None) -> list[Bad]:
    """The refused values of `model`'s managed and watched layers, per (layer, parameter, expert). `experts_of(layer)`:
    the local experts a hinted session wrote into a managed layer (None: all of them). At most one read-back per
    device (none on a CPU)."""
    items: list[tuple[torch.Tensor, str]] = []
    where: list[tuple] = []
    for layer, fmt, managed in layers_of(model):
        e = fmt.tensor(layer, fmt.params[0]).shape[0]
        ids = experts_of(layer) if (managed and experts_of is not None) else None
        if ids is not None and not ids:
            continue
        local = None if ids is None else sorted(ids)
        index = None if local is None else torch.tensor(local, dtype=torch.long)
        for name, t, code in _ruled(layer, fmt):
            per_expert = t.dim() > 0 and t.shape[0] == e
            if index is not None and per_expert:
                items.append((t.index_select(0, index.to(t.device)), code))
                where.append((layer, e, name, code, per_expert, local))
            else:
                items.append((t, code))
                where.append((layer, e, name, code, per_expert, None))
    bad: list[Bad] = []
    for i in value_checks.find_bad(items):
        layer, e, name, code, per_expert, local = where[i]
        bad += _located(layer, e, name, items[i][0], code, per_expert, local)
    return bad


def _located(layer, e: int, name: str, t: torch.Tensor, code: str, per_expert: bool, local) -> list[Bad]:
    """The experts of a refused tensor that hold a refused value (a refusal only: it synchronises)."""
    expected = value_checks.EXPECTED[code]
    lname = layer_state.layer_name(layer)
    if not per_expert:
        return [Bad(lname, name, None, value_checks.describe_bad(t, code), expected)]
    mask = value_checks.bad_mask(t, code).reshape(t.shape[0], -1).any(dim=1)
    out = []
    offset = _offset(layer, e)
    for row in mask.nonzero().flatten().tolist():
        expert = local[row] if local is not None else row
        what = value_checks.describe_bad(t[row], code)
        out.append(Bad(lname, name, offset + expert, what.replace(" at [", f" at [{expert}, ", 1), expected))
    return out


def message(bad: list[Bad]) -> str:
    """The refusal of a session: the first refused values, then what is served now."""
    shown = "; ".join(b.sentence() for b in bad[:SHOWN])
    more = f" (and {len(bad) - SHOWN} more refused value(s))" if len(bad) > SHOWN else ""
    fenced: dict[str, set] = {}
    for b in bad:
        fenced.setdefault(b.layer, set()).add("all" if b.slot is None else b.slot)
    which = "; ".join(
        f"{name}: experts {sorted(s, key=str)}" if "all" not in s else f"{name}: every expert"
        for name, s in fenced.items()
    )
    return (
        f"sglang-trtllm-moe refused the loader-free weight-update session: {shown}{more}. The writer already "
        f"overwrote the previous weights, so the refused experts are served as zero experts (their output is 0) and "
        f"every other expert as written ({which}); write those experts again in a new session"
    )


def fence(model, bad: list[Bad]) -> int:
    """Every refused expert of `model`'s layers (by layer name and global slot; a parameter that is not per expert:
    the whole layer) written as a zero expert, in checkpoint layout, before the end of the session lays it out.
    Returns the experts fenced on this rank."""
    wanted: dict[str, set] = {}
    for b in bad:
        wanted.setdefault(b.layer, set()).add(b.slot)
    done = 0
    for layer, fmt, _ in layers_of(model):
        slots = wanted.get(layer_state.layer_name(layer))
        if not slots:
            continue
        e = fmt.tensor(layer, fmt.params[0]).shape[0]
        offset = _offset(layer, e)
        local = list(range(e)) if None in slots else sorted(s - offset for s in slots if offset <= s < offset + e)
        if local:
            with layer_state.locked(layer):
                _zero_experts(layer, fmt, e, local)
            done += len(local)
    return done


def _zero_experts(layer, fmt, e: int, local: list[int]) -> None:
    index = torch.tensor(local, dtype=torch.long)
    keep = torch.ones(e, dtype=torch.bool)
    keep[index] = False
    for p in fmt.params:
        t = fmt.tensor(layer, p)
        # every byte 0: 0.0 in e2m1, e4m3, bf16 and float32; e8m0's smallest scale (its weights are 0 anyway); a
        # layout that flips bits (INT4: checkpoint nibble 8 is the value 0) gets the bytes it lays out as 0
        xor = getattr(p, "byte_xor", 0)
        if xor:
            t.view(torch.uint8).index_fill_(0, index.to(t.device), xor)
        else:
            (t.view(torch.uint8) if t.element_size() == 1 else t).index_fill_(0, index.to(t.device), 0)
    for name in fmt.scalar_params:
        t = getattr(layer, name, None)
        if not isinstance(t, torch.Tensor) or not t.numel():
            continue
        t = t.data
        rule = fmt.load_rule(name)
        if t.dim() == 0 or t.shape[0] != e:  # one value for the layer
            if not bool(torch.isfinite(t.float()).all() & (t.float() > 0).all()):
                t.fill_(1.0)
            continue
        # the others' largest valid input scale keeps max-of-experts scalars (1 / a1) what the others make them
        fill = 1.0
        if rule is not None and rule.kind == INPUT_SCALE and bool(keep.any()):
            rest = t[keep.to(t.device)].float()
            ok = rest[torch.isfinite(rest) & (rest > 0)]
            fill = float(ok.max()) if ok.numel() else 1.0
        t[index.to(t.device)] = fill


__all__ = ["SHOWN", "Bad", "check", "fence", "layers_of", "message"]
