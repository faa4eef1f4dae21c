"""Per-expert layout state of every MoE layer the plugin prepares, and the flush that keeps it exact.

Why: RL frameworks write new weights into a live SGLang model (from disk, from tensors, one expert at a time).
Upstream either writes checkpoint-layout bytes into kernel-layout storage (silent garbage) or re-prepares the
whole layer, re-shuffling experts that were never reloaded (measured on SGLang 0.5.23: about 86 % of the w13 bytes
of the other experts wrong after a one-expert NVFP4 update; `sglang-trtllm-moe bench` re-measures it). Here each
(group, expert) is either "prepared" or "checkpoint":

* before SGLang's loader writes into a prepared expert, that expert's group is returned to checkpoint layout in
  place (exact inverse layouts) and marked dirty;
* a flush (end of every weight-update entry point, and `process_weights_after_loading`) prepares exactly the
  dirty experts, chunk by chunk, marking each chunk prepared only once it is done, then recomputes the scalars.
  Nothing is prepared twice and nothing is left unprepared; a failure leaves the unfinished experts dirty (retried
  at the next flush) and raises an error naming the layer.
Storage never moves: every step is in place on the parameters SGLang allocated.

Concurrency: SGLang's loaders call `weight_loader` from thread pools (DeepSeek's loader submits one task per CPU
tensor, so shards of the same expert are written concurrently), and RL frameworks may load from several threads.
Un-preparing an expert is a read-modify-write of its whole group (the gated row interleave mixes w1 and w3), so
the check of the layout state, the in-place inverse and the write of a shard are one step per layer: every
writer and every flush of a layer holds that layer's lock (`LayerState.lock`, re-entrant); different layers load
in parallel.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from . import layer_attrs, layouts
from .errors import WeightPrepError
from .formats.base import Layer, WeightFormat, set_scalar_

logger = logging.getLogger("sglang_trtllm_moe")

STATE_ATTR = layer_attrs.STATE
_LAYERS: weakref.WeakSet[torch.nn.Module] = weakref.WeakSet()
#: guards `_LAYERS` and the creation of a layer's state (two threads must never attach two states to one layer)
_REGISTRY_LOCK = threading.Lock()
#: what validation caches per layer (updates/write_plans.py `plan_of`: one write plan per parameter); dropped when the
#: layer's state or watched format is set
PLANS_ATTR = layer_attrs.PLANS
#: bumped whenever a layer starts being managed or watched: caches of which layers a model holds compare it
_GENERATION = [0]


def generation() -> int:
    """Changes whenever a layer is attached or observed (bucket_validation caches a model's managed layers)."""
    return _GENERATION[0]


def _own(layer: Layer, attr: str) -> Any:
    """`layer`'s own attribute `attr`, or None: a dict lookup (a missing attribute of an nn.Module would otherwise
    go through Module.__getattr__ and an AttributeError, ~5 us, on every write into a layer SGLang prepares)."""
    d = getattr(layer, "__dict__", None)
    return d.get(attr) if d is not None else getattr(layer, attr, None)


def _set_own(layer: Layer, attr: str, value: Any) -> None:
    if isinstance(layer, torch.nn.Module):
        object.__setattr__(layer, attr, value)
    else:
        setattr(layer, attr, value)


def layer_name(layer: Layer) -> str:
    prefix = getattr(layer, layer_attrs.PREFIX, None) or getattr(layer, "prefix", None)
    if prefix:
        return str(prefix)
    lid = getattr(layer, "layer_id", None)
    return f"{type(layer).__name__}(layer_id={lid})" if lid is not None else type(layer).__name__


@dataclass
class LayerState:
    fmt: WeightFormat
    num_experts: int
    #: group -> bool[E] (CPU): True = kernel layout. Host bookkeeping, read by the runner at every forward (CUDA-graph
    #: capture included), so it never lives on a device, whatever torch's default device is when a layer is attached
    prepared: dict[str, torch.Tensor] = field(default_factory=dict)
    scalars_dirty: bool = True
    flushes: int = 0
    experts_prepared_total: int = 0
    #: held by every writer and every flush of the layer: state check, in-place inverse and write are one step
    lock: threading.RLock = field(default_factory=threading.RLock, repr=False, compare=False)
    #: parameter name -> group, of the laid-out parameters (fmt.group_of without the loop)
    groups: dict[str, str] = field(default_factory=dict, repr=False, compare=False)
    #: the format shows prepared parameters in another shape (it overrides `WeightFormat.on_layout`: BF16)
    views: bool = field(default=False, repr=False, compare=False)
    #: group -> (mask, its _version, the mask as a list): `prepared` read without a tensor op per write
    _mirror: dict = field(default_factory=dict, repr=False, compare=False)
    #: the layer's parameter names when the plugin took it over (SGLang's, as its create_weights registered them):
    #: what a remote instance built from the same config holds (builtins/remote_instance.py)
    loaded_params: tuple[str, ...] = field(default=(), repr=False, compare=False)
    #: the kernel scalars the last flush wrote (`WeightFormat.compute_scalars`' names, Parameters of the layer)
    kernel_scalars: tuple[str, ...] = field(default=(), repr=False, compare=False)

    def __post_init__(self) -> None:
        self.groups = {p.name: p.group for p in self.fmt.params}
        self.views = type(self.fmt).on_layout is not WeightFormat.on_layout

    def _bits(self, group: str) -> list[bool]:
        """`prepared[group]` as a Python list, refreshed whenever the mask changed (its version counter: every
        in-place write of it, here, in rollback or anywhere, bumps it); no tensor op while it did not."""
        mask = self.prepared[group]
        ver = mask._version
        m = self._mirror.get(group)
        if m is None or m[0] is not mask or m[1] != ver:
            m = (mask, ver, mask.tolist())
            self._mirror[group] = m
        return m[2]

    def is_prepared(self, group: str, expert: int) -> bool:
        return self._bits(group)[expert]

    def known_unprepared(self, group: str, expert: int) -> bool:
        """True when the Python copy of `prepared[group]` is current and says local expert `expert` (in range) is in
        checkpoint layout: no tensor op, for the loader hook on every write. False when it is prepared, out of
        range, or the copy is not current (then `before_write_locked` reads the mask and decides)."""
        m = self._mirror.get(group)
        return (
            m is not None
            and m[0] is self.prepared[group]
            and m[1] == m[0]._version
            and expert < self.num_experts
            and not m[2][expert]
        )

    def all_prepared(self, group: str) -> bool:
        return all(self._bits(group))

    def dirty_experts(self) -> dict[str, list[int]]:
        return {g: (~m).nonzero().flatten().tolist() for g, m in self.prepared.items() if not bool(m.all())}

    @property
    def clean(self) -> bool:
        """Asked by the runner at every forward: Python lists only, once the masks were read after their last change."""
        return not self.scalars_dirty and all(self.all_prepared(g) for g in self.prepared)


def state_of(layer: Layer) -> LayerState | None:
    return _own(layer, STATE_ATTR)


def attach(layer: Layer, fmt: WeightFormat, kernel_layout: bool = False) -> LayerState:
    """Start managing a freshly loaded layer: everything is in checkpoint layout, everything is dirty.
    `kernel_layout`: its bytes already hold `fmt`'s kernel layout (copied from an instance that laid them out:
    `adopt`)."""
    with _REGISTRY_LOCK:
        st = state_of(layer)
        if st is not None:
            return st
        e = fmt.tensor(layer, fmt.params[0]).shape[0]
        st = LayerState(
            fmt=fmt,
            num_experts=e,
            prepared={
                g: torch.full((e,), kernel_layout or fmt.prepared_at_attach(layer, g), dtype=torch.bool, device="cpu")
                for g in fmt.groups()
            },
            loaded_params=tuple(getattr(layer, "_parameters", {})),
        )
        _set_own(layer, STATE_ATTR, st)
        _forget_plans(layer)
        _LAYERS.add(layer)
        _GENERATION[0] += 1
        return st


def adopt(layer: Layer, fmt: WeightFormat) -> LayerState:
    """Manage a layer whose parameters already hold `fmt`'s kernel layout, every expert (a remote instance's
    bytes): nothing is laid out again (that would pack it twice); the kernel scalars are computed from its
    parameters, and each group's parameters shown as this release shows prepared ones."""
    st = attach(layer, fmt, kernel_layout=True)
    with st.lock:
        for group in st.prepared:
            fmt.on_layout(layer, group, all_prepared=True)
        _flush(layer, st, None)
    return st


def _forget_plans(layer: Layer) -> None:
    d = getattr(layer, "__dict__", None)
    if d is not None:
        d.pop(PLANS_ATTR, None)


OBSERVED_ATTR = layer_attrs.OBSERVED


def observe(layer: Layer, fmt: WeightFormat) -> None:
    """A layer SGLang prepares itself (compat/defer.py: upstream is right for its format on this release): the
    plugin does not touch its layout, but still validates writes into it against `fmt`'s rules."""
    if observed(layer) is fmt:
        return  # SGLang's process_weights_after_loading runs again after every disk update: nothing changes
    if _own(layer, layer_attrs.LOADED_PARAMS) is None:  # before SGLang's preparation registers its own
        _set_own(layer, layer_attrs.LOADED_PARAMS, tuple(getattr(layer, "_parameters", {})))
    _set_own(layer, OBSERVED_ATTR, fmt)
    _forget_plans(layer)
    with _REGISTRY_LOCK:
        _GENERATION[0] += 1


def observed(layer: Layer) -> WeightFormat | None:
    return _own(layer, OBSERVED_ATTR)


def loaded_params(layer: Layer) -> tuple[str, ...]:
    """The parameter names `layer` had when the plugin first took it over or watched it (SGLang's, as its
    create_weights registered them); empty for a layer it never saw."""
    st = state_of(layer)
    if st is not None:
        return st.loaded_params
    return _own(layer, layer_attrs.LOADED_PARAMS) or ()


def managed_layers() -> list[Layer]:
    with _REGISTRY_LOCK:
        return list(_LAYERS)


@contextlib.contextmanager
def locked(layer: Layer) -> Iterator[LayerState | None]:
    """Hold `layer`'s lock (a no-op for layers the plugin does not manage): no write or flush of it meanwhile."""
    st = state_of(layer)
    if st is None:
        yield None
        return
    with st.lock:
        yield st


def before_write(layer: Layer, param_name: str, expert_id: int | None) -> None:
    """Called before SGLang's loader writes `param_name` of local expert `expert_id` (None = all experts)."""
    st = state_of(layer)
    if st is None:
        return
    with st.lock:
        _before_write(layer, st, param_name, expert_id)


def _before_write(layer: Layer, st: LayerState, param_name: str, expert_id: int | None) -> None:
    group = st.groups.get(param_name)
    if group is None:
        if param_name in st.fmt.scalar_params:
            st.scalars_dirty = True
        return
    if expert_id is None:
        ids = st.prepared[group].nonzero().flatten().tolist()
    else:
        if not 0 <= expert_id < st.num_experts:
            raise ValueError(
                f"{layer_name(layer)}: expert id {expert_id} is out of range for {param_name} "
                f"({st.num_experts} local experts)"
            )
        mask = st.prepared[group]
        m = st._mirror.get(group)
        if m is not None and m[0] is mask and m[1] == mask._version:  # LayerState.is_prepared, inlined
            ids = [expert_id] if m[2][expert_id] else []
        else:
            ids = [expert_id] if st.is_prepared(group, expert_id) else []
    if ids:
        unprepare_locked(layer, st, group, ids)
    st.scalars_dirty = True


#: `before_write` for a caller that holds the layer's lock (the loader hook: the check of the layout state, the
#: inverse and SGLang's write are one step under it)
before_write_locked = _before_write


def unprepare_locked(layer: Layer, st: LayerState, group: str, ids: list[int]) -> None:
    """Experts `ids` of `group` (prepared ones) back to checkpoint layout, marked dirty; the caller holds the lock."""
    mask = st.prepared[group]
    m = st._mirror.get(group)
    current = m is not None and m[0] is mask and m[1] == mask._version
    st.fmt.unprepare_(layer, group, ids)
    mask[ids] = False
    if current:  # the Python copy was current: keep it so (else it is rebuilt on its next read)
        assert m is not None
        bits = m[2]
        for i in ids:
            bits[i] = False
        st._mirror[group] = (mask, mask._version, bits)
    st.fmt.on_layout(layer, group, all_prepared=False)


def flush(layer: Layer, chunk: int | None = None) -> int:
    """Prepare exactly the dirty experts of `layer` and recompute its scalars. Returns experts prepared."""
    st = state_of(layer)
    if st is None:
        return 0
    with st.lock:
        return _flush(layer, st, chunk)


def _flush(layer: Layer, st: LayerState, chunk: int | None) -> int:
    done = 0
    chunk = chunk or max(1, st.num_experts // 8)
    for group, ids in st.dirty_experts().items():
        for i in range(0, len(ids), chunk):
            part = ids[i : i + chunk]
            try:
                st.fmt.prepare_(layer, group, part)
            except Exception as e:
                raise WeightPrepError(
                    f"{layer_name(layer)}: preparing {group} of experts {part} for the TRT-LLM kernel failed "
                    f"({type(e).__name__}: {e}); {len(ids) - i} expert(s) of {group} stay in checkpoint layout and "
                    "will be retried at the next flush (the layer refuses to run until then)"
                ) from e
            st.prepared[group][part] = True
            done += len(part)
        st.fmt.on_layout(layer, group, all_prepared=True)
    if done or st.scalars_dirty:
        scalars = st.fmt.compute_scalars(layer)
        for name, value in scalars.items():
            set_scalar_(layer, name, value)
        st.kernel_scalars = tuple(scalars)
        st.scalars_dirty = False
    if done:
        st.flushes += 1
        st.experts_prepared_total += done
        logger.debug("sglang-trtllm-moe: %s: prepared %d expert group(s)", layer_name(layer), done)
    return done


def flush_all(end_session: bool = False, model: torch.nn.Module | None = None) -> int:
    """End of a weight-update entry point: every managed layer (of `model`, when given) back to kernel layout
    (deferred while a begin/end weight-update session is open, until its end)."""
    if end_session:
        SESSION["open"] = False
    elif SESSION["open"]:
        return 0
    total = 0
    errors = []
    layers = managed_layers()
    if model is not None:
        mine = {id(m) for m in model.modules()}
        layers = [layer for layer in layers if id(layer) in mine]
    for layer in layers:
        try:
            total += flush(layer)
        except WeightPrepError as e:
            errors.append(str(e))
    if errors:
        raise WeightPrepError("; ".join(errors))
    return total


#: True between begin_weight_update and end_weight_update: writes may bypass the loader, so nothing is prepared
#: until the session ends (a flush in between would let the next direct write land on kernel-layout bytes).
SESSION = {"open": False}


def unprepare_all(
    model: torch.nn.Module | None = None, experts_of: Callable[[Layer], Sequence[int] | None] | None = None
) -> int:
    """Every managed layer (of `model`, when given) back to checkpoint layout, in place (before loader-free refits
    that write straight into the parameters, e.g. a `begin_weight_update` session). The next flush prepares them
    again; other models in the process (a draft model) keep running on their prepared weights meanwhile.
    `experts_of(layer)`: only those local experts of each layer (None: all of it; an empty list: none of it — a
    writer that said which experts it writes, updates/session_writes.py). Returns the experts un-prepared."""
    SESSION["open"] = True
    layers = managed_layers()
    if model is not None:
        mine = {id(m) for m in model.modules()}
        layers = [layer for layer in layers if id(layer) in mine]
    done = 0
    for layer in layers:
        st = state_of(layer)
        assert st is not None  # attach() gives a layer its state before it becomes a managed layer
        only = None if experts_of is None else experts_of(layer)
        with st.lock:
            if only is None:
                for p in st.fmt.params:
                    _before_write(layer, st, p.name, None)
                done += st.num_experts
                continue
            wanted = set(only)
            for group, mask in st.prepared.items():
                ids = [i for i in mask.nonzero().flatten().tolist() if i in wanted]
                if ids:
                    unprepare_locked(layer, st, group, ids)
            st.scalars_dirty = True
            done += len(wanted)
    return done


def on_reload_start() -> None:
    """Index maps are rebuilt on demand: drop them so no stale device copy survives a pause/resume (sglang#28676)."""
    layouts.clear_caches()
