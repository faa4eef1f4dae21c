"""FusedMoE's loader: every write into a layer the plugin manages or watches is validated before anything changes;
a managed layer un-prepares just the written expert.

* `weight_loader` (AROUND): the whole write is validated (validation.check_write) before SGLang maps the checkpoint
  expert id to EP ranks, so every rank refuses the same bad tensor, and the expert id reaches SGLang as an int (a
  0-dim integer tensor is accepted) — unless the running update request's entry-point check already validated this
  very write (checked_writes.checked_write: the same tensor object into the same parameter, shard and expert id), which
  is then not checked again. SGLang then drops a shard whose expert this EP rank does not own (right: the
  owning rank writes it). Layers SGLang prepares itself (layer_state.observed, compat/defer.py) are validated the
  same way and otherwise left to SGLang.
* `_weight_loader_impl` (AROUND): under the layer's lock, the local expert id is checked (everything, for callers
  that reach it without `weight_loader`: paged experts) and the written expert's group is returned to checkpoint
  layout; then SGLang's loader writes it.
* `__init__` (AFTER): FusedMoE does not keep its checkpoint prefix nor its logical intermediate size; errors and
  reports name layers by the first, validation tells a short tensor from a padded one by the second. The first
  layer built in a process that maps its weights from SGLang's weight cache (--weight-cache-mode daemon | client,
  0.5.17+) logs once that the plugin prepares nothing there (selection.weight_cache_why).
"""

from __future__ import annotations

import logging

from .. import PROJECT_NAME, aside, hookimpl, layer_attrs, layer_state
from ..compat import features
from ..targets import HookTarget
from ..updates import checked_writes, layer_params, undo, validation

logger = logging.getLogger(PROJECT_NAME)

FUSED_MOE = "sglang.srt.layers.moe.fused_moe_triton.layer.FusedMoE"


_STATE = layer_state.STATE_ATTR


def _state(layer):
    d = getattr(layer, "__dict__", None)
    return d.get(_STATE) if d is not None else layer_state.state_of(layer)


def weight_loader_impl(original, layer, param, loaded_weight, weight_name, shard_id, expert_id, *args, **kwargs):
    undo.before_write(layer)  # a request the plugin could not check first (a custom loader's): copied once, first
    st = _state(layer)
    if st is None:
        if not checked_writes.was_validated(param, loaded_weight):
            checked = validation.check_write(layer, param, loaded_weight, weight_name, shard_id, expert_id)
            if checked is not None:  # a layer SGLang prepares itself: validated, then SGLang's loader
                expert_id = checked[1]
        return original(layer, param, loaded_weight, weight_name, shard_id, expert_id, *args, **kwargs)
    # One step under the layer's lock (SGLang's DeepSeek loader writes shards of one expert from a thread pool):
    # a concurrent writer of the same expert must neither see it half un-prepared nor have its rows overwritten
    # by this writer's in-place inverse.
    with st.lock:
        v = checked_writes.validated(param, loaded_weight)  # the thread-local handshake with weight_loader (below)
        if v is not None:
            # weight_loader validated this write: only the local expert id is left
            name = v[2]
            if type(expert_id) is int and 0 <= expert_id < v[3]:
                e = expert_id
            else:
                e = validation.check_local_expert(layer, param, name, expert_id, shard_id)
        else:
            checked = validation.check_write(layer, param, loaded_weight, weight_name, shard_id, expert_id)
            if checked is None:
                return original(layer, param, loaded_weight, weight_name, shard_id, expert_id, *args, **kwargs)
            name, e = checked
        group = st.groups.get(name)
        if group is None:  # a kernel-scalar input (per-tensor / input scales): the scalars are recomputed
            if name in st.fmt.scalar_params:
                st.scalars_dirty = True
        elif st.known_unprepared(group, e):
            # in checkpoint layout already (a session, or another shard of it written): dirty from now on
            st.scalars_dirty = True
        else:  # a prepared expert (or its state not read yet)
            layer_state.before_write_locked(layer, st, name, e)
        return original(layer, param, loaded_weight, weight_name, shard_id, e, *args, **kwargs)


def weight_loader(original, layer, param, loaded_weight, weight_name, shard_id, expert_id=None, *args, **kwargs):
    st = _state(layer)
    if st is not None and expert_id is None and st.fmt.fused:
        # all experts at once (gpt-oss MXFP4: SGLang's fast path never reaches _weight_loader_impl): validate, then
        # return the whole group to checkpoint layout, then SGLang's copy, as one step under the layer's lock
        name = layer_params.param_name(layer, param, st.fmt) or weight_name
        with st.lock:
            validation.validate_fused(layer, name, param, loaded_weight)
            undo.before_write(layer)
            layer_state.before_write(layer, name, None)
            return original(layer, param, loaded_weight, weight_name, shard_id, expert_id, *args, **kwargs)
    # validated whole by the running request's entry-point check (the same tensor into the same slot), or now
    hit = checked_writes.checked_write(param, loaded_weight, weight_name, shard_id, expert_id)
    if hit is not None:
        name, _, local_n = hit
        e = expert_id
    else:
        checked = validation.check_write(layer, param, loaded_weight, weight_name, shard_id, expert_id, scope="global")
        if checked is None:  # not a layer or a parameter the plugin manages or watches: SGLang's own loader
            return original(layer, param, loaded_weight, weight_name, shard_id, expert_id, *args, **kwargs)
        (name, e), local_n = checked, 0
    # the thread-local handshake: _weight_loader_impl, which SGLang calls inside, checks only the local expert id
    prev = checked_writes.mark_validated(param, loaded_weight, name, local_n)
    try:
        if st is None or not st.views or (group := st.groups.get(name)) is None:
            # _weight_loader_impl takes the layer's lock for the un-prepare and the write
            return original(layer, param, loaded_weight, weight_name, shard_id, e, *args, **kwargs)
        with st.lock:
            # SGLang's loader narrows the parameter in its checkpoint shape: a format that shows prepared parameters
            # in another shape (BF16's 4-D block layout) is seen 3-D for the load, and 4-D again if nothing was written
            st.fmt.on_layout(layer, group, all_prepared=False)
            try:
                return original(layer, param, loaded_weight, weight_name, shard_id, e, *args, **kwargs)
            finally:
                if st.all_prepared(group):
                    st.fmt.on_layout(layer, group, all_prepared=True)
    finally:
        checked_writes.restore_validated(prev)


def remember_prefix(result, layer, *args, **kwargs):
    import inspect

    from sglang.srt.layers.moe.fused_moe_triton.layer import FusedMoE

    init = FusedMoE.__init__
    while hasattr(init, "__wrapped__"):
        init = init.__wrapped__
    try:
        arguments = inspect.signature(init).bind(layer, *args, **kwargs).arguments
    except TypeError:
        arguments = kwargs
    prefix = arguments.get("prefix")
    if prefix:
        layer_attrs.record(layer, layer_attrs.PREFIX, prefix)
    if isinstance(arguments.get("intermediate_size"), int):
        layer_attrs.record(layer, layer_attrs.INTERMEDIATE, arguments["intermediate_size"])
    cfg = getattr(layer, "moe_runner_config", None)
    if cfg is not None and not features.MOE_RUNNER_CONFIG_LAYER.present():
        cfg.layer = layer  # the plugin runner finds the layer being run through its config
    if not WEIGHT_CACHE_WARNED and features.WEIGHT_CACHE.present():
        warn_weight_cache()
    aside.check_built(layer)  # a format the plugin stepped aside for, where only it can serve: stop at start-up
    return None


#: set once this process said (or found it need not say) that its weights come from SGLang's weight cache
WEIGHT_CACHE_WARNED: list[str] = []


def warn_weight_cache() -> str | None:
    """Once per process, at its first MoE layer: with --weight-cache-mode daemon | client SGLang skips
    process_weights_after_loading here, so the plugin prepares, lays out and compares none of its layers; say so
    (the log line) instead of letting a user believe they run the plugin's path. Returns the line, or None."""
    from ..compat.platform import weight_cache_mode
    from ..selection import weight_cache_why

    mode = weight_cache_mode()
    WEIGHT_CACHE_WARNED.append(mode)
    if mode == "off":
        return None
    line = (
        f"sglang-trtllm-moe: {weight_cache_why(mode)}. This process's MoE layers run SGLang's own preparation and "
        "runner (routed experts of fused flashinfer_trtllm layers are SGLang's own, zeros); a fallback disk load "
        "(daemon not answering) is prepared by the plugin as usual"
    )
    logger.warning(line)
    return line


@hookimpl
def register_sglang_hooks(register, release):
    register(
        HookTarget(
            f"{FUSED_MOE}.weight_loader",
            weight_loader,
            "around",
            capability="rl-update",
            group="loader",
            why="validate every write (shard, expert id, dtype, shape, device, scale values) before SGLang "
            "maps expert ids to ranks, so every rank refuses the same bad tensor",
        )
    )
    register(
        HookTarget(
            f"{FUSED_MOE}.__init__",
            remember_prefix,
            "after",
            capability="core",
            why="remember each MoE layer's checkpoint prefix (errors and reports name it) and logical "
            "intermediate size (validation tells a short tensor from a padded one)",
        )
    )
    register(
        HookTarget(
            f"{FUSED_MOE}._weight_loader_impl",
            weight_loader_impl,
            "around",
            capability="rl-update",
            group="loader",
            why="validate shards and un-prepare an expert before SGLang's loader writes into it",
        )
    )
