"""A model's update names, indexed once: which layer, parameter, shard and expert each checkpoint name of a request
lands in, and whether this rank holds that expert.

RL frameworks send every expert tensor of a model every step, by name ("<layer>.<expert>.<projection>.<suffix>"); at
EP 8 a rank holds one eighth of them. The index answers a name with one dictionary look-up: a `Target` (its
`ParamShard` — layer, parameter, shard —, its checkpoint expert id, and the local slots SGLang's own
`FusedMoE.weight_loader` of this release writes it into: none for another rank's expert, several for EPLB replicas),
`OTHER` for a "<layer>.<param>" name, or None for a name that is not the plugin's (dense layers, routers, shared
experts: SGLang's loader). A name is resolved the first time a request brings it; the answer is kept for every later
request of the model.

Kept until a layer anywhere starts being managed or watched (layer_state.generation: the model's managed layers
change) or the expert placement changes (the mapping function SGLang's loader calls per layer, SGLang's
expert-location metadata, which an EPLB rebalance rewrites in place), checked once per request (`index_of`). Which
slots an expert lands in is asked of SGLang's own loader (slot_plans.local_slots), once per (layer, expert,
parameters kept per global expert or not).
"""

from __future__ import annotations

import threading
import weakref

import torch

from .. import layer_attrs, layer_state
from .layer_params import PROJECTIONS, format_of
from .slot_plans import local_slots, own_loader, traceable


class ParamShard:
    """One (layer, parameter, shard id) of a layer the plugin manages or watches, as a request's expert tensors reach
    it. What a request looks up for it once (its write plan, write_plans.plan_of) is kept here for the request
    (`epoch`); what the batched writes keep across requests (slot plans per tensor geometry) is theirs (`writes`)."""

    __slots__ = ("layer", "pname", "shard", "weight_name", "slotted", "global_ids", "plan", "param", "epoch", "writes")

    def __init__(self, layer, pname: str, shard: str):
        self.layer, self.pname, self.shard = layer, pname, shard
        #: the name SGLang's model code passes its loader for this parameter
        self.weight_name = f"{getattr(layer, layer_attrs.PREFIX, None) or 'experts'}.{pname}"
        param = layer._parameters.get(pname)
        #: the parameter is loaded by the layer's own FusedMoE.weight_loader (not a replacement: SGLang's online
        #: quantizing loader, someone else's): which slots an expert lands in is SGLang's mapping, known per expert (a
        #: tensor of another rank's expert is then never checked here: its rank checks it)
        self.slotted = param is not None and own_loader(layer, param)
        #: the parameter is kept for every global expert (input scales): every rank writes every expert
        self.global_ids = bool(getattr(param, "_sglang_require_global_experts", False))
        #: what the request with `epoch` looked up: the parameter and its write plan
        self.plan = None
        self.param = None
        self.epoch = -1
        #: the batched writes' own cache for this shard (batched_writes.py)
        self.writes: dict = {}


class Target:
    """What one checkpoint name of an expert tensor targets: its (layer, parameter, shard), checkpoint expert id, and
    local slots on this rank (a tuple: () — another rank's expert; None — not known: the tensor is checked and left to
    SGLang's loader). `ok`: the write plan under which the name's own checks (name, shard, expert range) passed."""

    __slots__ = ("ps", "expert", "slots", "ok")

    def __init__(self, ps: ParamShard, expert: int, slots):
        self.ps, self.expert, self.slots = ps, expert, slots
        self.ok = None


#: a "<layer>.<param>" name (a fused all-expert tensor, a whole-parameter write, or a parameter name refused)
OTHER = object()
_UNSEEN = object()


class Index:
    """The index of one model (see the module docstring)."""

    #: names kept per model at most (names past it are resolved every time)
    MAX_NAMES = 1 << 20

    def __init__(self, generation: int, layers: dict):
        self.generation = generation
        #: {name prefix: layer} of every layer the plugin manages or watches (`managed_modules`)
        self.layers = layers
        #: checkpoint name -> Target | OTHER | None
        self.targets: dict = {}
        self.shards: dict = {}  # (id(layer), parameter name, shard id) -> ParamShard
        self.slots: dict = {}  # (id(layer), expert id, global ids) -> local slots
        #: id(layer) -> (layer, its mapping function when the index was built)
        self.mappers = {id(m): (m, mapper_of(m)) for m in layers.values()}
        #: SGLang's expert-location metadata when the index was built
        self.location = location_key()
        self.lock = threading.Lock()

    def get(self, name: str):
        """`name`'s Target, OTHER or None (resolved once per model)."""
        target = self.targets.get(name, _UNSEEN)
        if target is _UNSEEN:
            target = self._resolve(name)
            if len(self.targets) < self.MAX_NAMES:
                self.targets[name] = target
        return target

    def placement_changed(self) -> bool:
        """Has the expert placement the slots came from changed since (EPLB, another mapping function)?"""
        return location_key() != self.location or any(mapper_of(m) is not f for m, f in self.mappers.values())

    def _resolve(self, name: str):
        layers = self.layers
        path = name.rpartition(".")[0]
        if layer_at(layers, path) is not None:
            return OTHER
        head = name.rsplit(".", 3)
        layer = layer_at(layers, head[0]) if len(head) == 4 else None
        if layer is None:
            return None
        hit = resolve(layer, name[len(head[0]) + 1 :])
        if hit is None:
            return None
        pname, shard, expert = hit
        with self.lock:
            key = (id(layer), pname, shard)
            ps = self.shards.get(key)
            if ps is None:
                ps = self.shards[key] = ParamShard(layer, pname, shard)
        return Target(ps, expert, self._slots(ps, expert))

    def _slots(self, ps: ParamShard, expert: int):
        """The local slots of `expert` for `ps` (SGLang's own mapping), or None where not known."""
        if not ps.slotted or not 0 <= expert < routed_experts(ps.layer) or not traceable():
            # fused shared experts, ids beyond the model, a loader no trace can follow: checked on every rank,
            # SGLang's loader
            return None
        key = (id(ps.layer), expert, ps.global_ids)
        slots = self.slots.get(key, _UNSEEN)
        if slots is _UNSEEN:
            param = ps.layer._parameters.get(ps.pname)
            try:
                probe = torch.empty((1,), device="meta")
                slots = local_slots(ps.layer, param, ps.weight_name, ps.shard, expert, probe)
            except Exception:  # noqa: BLE001 - SGLang's mapping on this release: not known, checked on every rank
                slots = None
            self.slots[key] = slots
        return slots


def routed_experts(layer) -> int:
    """Checkpoint expert ids of routed experts are below this (fused shared experts follow); 0 where not known."""
    n = getattr(layer, "_num_global_routed", None)
    if n is None:
        total = getattr(layer, "num_experts", None)
        if total is None:
            return 0
        n = int(total) - int(getattr(layer, "num_fused_shared_experts", 0) or 0)
    return int(n)


# ---- the expert placement a layer's slots depend on -------------------------------------------------------------


def mapper_of(layer):
    """The function SGLang's loader maps a checkpoint expert id to a local slot with (an instance attribute where
    one was set over the class's)."""
    return layer.__dict__.get("_map_global_expert_id_to_local_expert_id") or getattr(
        type(layer), "_map_global_expert_id_to_local_expert_id", None
    )


def location_key() -> tuple | None:
    """SGLang's expert-location metadata as its loader reads it (logical expert -> physical slots): the object, the
    map and the map's version counter (an EPLB rebalance rewrites it in place: `ExpertLocationMetadata.update`), or
    None where there is none (no EPLB, or a release or process without it)."""
    try:
        from sglang.srt.eplb.expert_location import get_global_expert_location_metadata

        meta = get_global_expert_location_metadata()
    except Exception:  # noqa: BLE001 - no EPLB module or metadata on this release or process
        return None
    if meta is None:
        return None
    rows = getattr(meta, "logical_to_all_physical_map_cpu", None)
    return (id(meta), id(rows), getattr(rows, "_version", None))


# ---- the model's managed layers, by the names a checkpoint gives them -----------------------------------------------

_INDEXES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_INDEXES_LOCK = threading.Lock()


def index_of(model, check_placement: bool = True) -> Index:
    """The model's index, current: rebuilt when a layer anywhere was attached or observed since, and — unless the
    caller already checked it in this request (`check_placement=False`) — when a layer's expert placement
    changed."""
    gen = layer_state.generation()
    try:
        idx = _INDEXES.get(model)
    except TypeError:  # not weak-referenceable / hashable: nothing kept
        return Index(gen, _managed_modules(model))
    if idx is None or idx.generation != gen or (check_placement and idx.placement_changed()):
        idx = Index(gen, _managed_modules(model))
        with _INDEXES_LOCK:
            _INDEXES[model] = idx
    return idx


def forget(model=None) -> None:
    """Drop the index of `model` (of every model when None): the next request builds it again."""
    with _INDEXES_LOCK:
        if model is None:
            _INDEXES.clear()
        else:
            _INDEXES.pop(model, None)


def managed_modules(model) -> dict[str, object]:
    """{name prefix: layer} of every FusedMoE under `model` the plugin manages or watches: its module path, the
    checkpoint prefix SGLang's model code built it with, and the path from "layers." on where only one layer has
    it (checkpoints name the model root their own way: Nemotron-H's "backbone." is SGLang's "model."). Walked once
    per model (again after a layer anywhere is attached or observed)."""
    return index_of(model, check_placement=False).layers


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
    for alias, m in nextn_aliases(model, out).items():
        out.setdefault(alias, m)
    return out


#: where SGLang's NextN / MTP draft classes (`*NextN`: DeepSeek-V3/V4, GLM-5, Hunyuan, LongCat) build their one
#: decoder layer; their loaders read it from the checkpoint's "model.layers.{N}." (N = num_hidden_layers, 0 for a
#: one-layer config: deepseek_common/deepseek_weight_loader.py `_initialize_nextn_conf`)
NEXTN_DECODER = "model.decoder."


def nextn_aliases(model, found: dict) -> dict:
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


def layer_at(layers: dict, path: str):
    layer = layers.get(path)
    if layer is None:
        tail = _from_layers(path)
        layer = layers.get(tail) if tail else None
    return layer


def resolve(layer, rest: str):
    """A checkpoint name below a managed layer, "<expert>.<projection>.<suffix>" -> (param name, shard id, expert
    id); None when it is not of that form."""
    parts = rest.split(".")
    if len(parts) != 3 or not parts[0].isdigit() or parts[1] not in PROJECTIONS:
        return None
    shard = PROJECTIONS[parts[1]]
    if shard == "w3" and not format_of(layer).is_gated(layer):
        shard = "w1"  # non-gated checkpoints name their one GEMM1 projection up_proj; SGLang loads it as w1
    return f"{'w2' if shard == 'w2' else 'w13'}_{parts[2]}", shard, int(parts[0])


def expert_targets(model, named_tensors) -> list:
    """What each item of a request targets, in order: (layer, parameter name, shard id, checkpoint expert id) for an
    expert tensor of a layer the plugin manages or watches, else None (after a request's check: dict look-ups)."""
    idx = index_of(model, check_placement=False)
    if not idx.layers:
        return [None] * len(named_tensors)
    out: list = []
    for item in named_tensors:
        name = item[0] if isinstance(item, (list, tuple)) and len(item) == 2 else None
        t = idx.get(name) if type(name) is str else None
        out.append((t.ps.layer, t.ps.pname, t.ps.shard, t.expert) if isinstance(t, Target) else None)
    return out
