"""Which experts a loader-free session writes: the writer's hint (README "RL", docs/RELIABILITY.md).

A writer that puts raw bytes straight into the served parameters (P2P / RDMA) between `begin_weight_update` and
`end_weight_update` bypasses every loader hook: the plugin cannot see which experts it writes. Without a hint, the
plugin returns every managed layer to checkpoint layout at `begin` and checks and lays every expert out again at
`end` (a whole model's re-layout). With a hint — the experts the session writes, said before it begins — `begin`
returns only those to checkpoint layout and `end` checks and lays out only those: the cost follows the experts
written. Why before `begin`: a writer may write part of an expert (one half of w13, the weight but not its scale);
every byte it does not write must then already be in checkpoint layout, so the un-preparing has to happen first.

The hint names experts by their **slot**: the index along the expert dimension of the layer's parameters across its
EP group (`moe_ep_rank * num_local_experts` + the local index: the kernel's `local_expert_offset`; with TP alone, the
checkpoint's expert id) — what a writer addressing parameter memory writes to. Per layer (its prefix,
`model.layers.3.mlp.experts`) or for every layer ("*"); a layer the hint does not name is not written (kept laid
out, not checked). It reaches the scheduler processes by a field SGLang already carries to them: the `rid` of
`BeginWeightUpdateReqInput` (`rid(experts)`; `POST /begin_weight_update {"rid": ...}`, or `begin(engine, ...)`), or
in-process by `expect(experts)` (a writer running inside the scheduler process). Consumed by the next `begin`.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from .. import layer_state

#: the prefix that marks a `rid` as this plugin's hint (any other rid is SGLang's business, left alone)
RID_PREFIX = "sglang-trtllm-moe:writes="
#: the key that names every layer
EVERY_LAYER = "*"


@dataclass(frozen=True)
class SessionWrites:
    """The experts one session writes: layer prefix (or EVERY_LAYER) -> global slots, sorted."""

    experts: Mapping[str, tuple[int, ...]]

    def slots_of(self, name: str) -> tuple[int, ...] | None:
        """The global slots the session writes into layer `name` (empty: none of it); None: the hint names
        neither the layer nor every layer — nothing of it is written."""
        own = self.experts.get(name)
        every = self.experts.get(EVERY_LAYER)
        if own is None and every is None:
            return None
        return tuple(sorted(set(own or ()) | set(every or ())))

    def local_ids(self, layer, name: str) -> list[int]:
        """The local experts of `layer` (named `name`) the session writes, on this rank."""
        slots = self.slots_of(name)
        if not slots:
            return []
        n = int(getattr(layer, "num_local_experts", 0) or 0)
        if not n:  # a layer object without SGLang's count: its parameters' expert dimension (the plugin's state)
            st = layer_state.state_of(layer)
            n = st.num_experts if st is not None else 0
        offset = int(getattr(layer, "moe_ep_rank", 0) or 0) * n
        return [s - offset for s in slots if offset <= s < offset + n]

    @property
    def total(self) -> int:
        return sum(len(v) for v in self.experts.values())


def parse(experts) -> SessionWrites:
    """`experts`: {layer prefix or "*": [global slots]}, as a mapping or its JSON text. Raises ValueError naming
    what is wrong (never half-applied)."""
    if isinstance(experts, (str, bytes)):
        try:
            experts = json.loads(experts)
        except ValueError as e:
            raise ValueError(f"sglang-trtllm-moe: the session-writes hint is not JSON ({e})") from None
    if not isinstance(experts, Mapping):
        raise ValueError(
            f"sglang-trtllm-moe: the session-writes hint must map a layer prefix (or {EVERY_LAYER!r}) to expert "
            f"slots, got {type(experts).__name__}"
        )
    out: dict[str, tuple[int, ...]] = {}
    for name, slots in experts.items():
        if not isinstance(name, str) or not name:
            raise ValueError(f"sglang-trtllm-moe: session-writes hint: layer name {name!r} is not a non-empty string")
        if isinstance(slots, (str, bytes)) or not isinstance(slots, Iterable):
            raise ValueError(f"sglang-trtllm-moe: session-writes hint for {name}: {slots!r} is not a list of slots")
        ids = []
        for s in slots:
            if isinstance(s, bool) or not isinstance(s, int) or s < 0:
                raise ValueError(
                    f"sglang-trtllm-moe: session-writes hint for {name}: slot {s!r} is not a non-negative int"
                )
            ids.append(int(s))
        out[name] = tuple(sorted(set(ids)))
    return SessionWrites(out)


def rid(experts) -> str:
    """The `rid` of a `BeginWeightUpdateReqInput` that carries the hint to every scheduler process (HTTP:
    `POST /begin_weight_update` with `{"rid": rid(experts)}`)."""
    return RID_PREFIX + json.dumps({k: list(v) for k, v in parse(experts).experts.items()}, separators=(",", ":"))


def from_rid(value) -> SessionWrites | None:
    """The hint a begin request's `rid` carries, or None (no rid, or not ours)."""
    if not isinstance(value, str) or not value.startswith(RID_PREFIX):
        return None
    return parse(value[len(RID_PREFIX) :])


_LOCK = threading.Lock()
_PENDING: list[SessionWrites] = []


def expect(experts) -> None:
    """In this process: the next session's `begin` un-prepares only `experts` ({layer prefix or "*": [slots]}),
    and its `end` checks and lays out only those. None: forget a pending hint (the whole model again)."""
    hint = None if experts is None else parse(experts)
    with _LOCK:
        _PENDING[:] = [] if hint is None else [hint]


def take() -> SessionWrites | None:
    """The pending hint, consumed (a session's begin)."""
    with _LOCK:
        return _PENDING.pop() if _PENDING else None


#: the hint of the session open in this process (None: no hint, the whole model), from its begin to its end
_OPEN: list[SessionWrites | None] = [None]


def opened(hint: SessionWrites | None) -> None:
    """A session began with `hint` (its end reads it back: `current`)."""
    _OPEN[0] = hint


def current() -> SessionWrites | None:
    return _OPEN[0]


def begin(engine, experts, selector: str = "all"):
    """`sglang.Engine.begin_weight_update(selector)` carrying the hint (the request Engine builds, with its rid):
    returns what it returns, (success, message)."""
    from sglang.srt.managers.io_struct import BeginWeightUpdateReqInput

    obj = BeginWeightUpdateReqInput(selector=selector, rid=rid(experts))
    return engine.loop.run_until_complete(engine.tokenizer_manager.begin_weight_update(obj, None))


__all__ = [
    "EVERY_LAYER",
    "RID_PREFIX",
    "SessionWrites",
    "begin",
    "current",
    "expect",
    "from_rid",
    "opened",
    "parse",
    "rid",
    "take",
]
