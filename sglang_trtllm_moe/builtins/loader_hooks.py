"""FusedMoE's loader: every write into a layer the plugin manages or watches is validated before anything changes;
a managed layer un-prepares just the written expert.

* `weight_loader` (AROUND): the whole write is validated (validation.check_write) before SGLang maps the checkpoint
  expert id to EP ranks, so every rank refuses the same bad tensor, and the expert id reaches SGLang as an int (a
  0-dim integer tensor is accepted). SGLang then drops a shard whose expert this EP rank does not own (right: the
  owning rank writes it). Layers SGLang prepares itself (layer_state.observed, compat/defer.py) are validated the
  same way and otherwise left to SGLang.
* `_weight_loader_impl` (AROUND): under the layer's lock, the local expert id is checked (everything, for callers
  that reach it without `weight_loader`: paged experts) and the written expert's group is returned to checkpoint
  layout; then SGLang's loader writes it.
* `__init__` (AFTER): FusedMoE does not keep its checkpoint prefix nor its logical intermediate size; errors and
  reports name layers by the first, validation tells a short tensor from a padded one by the second.
"""

from __future__ import annotations

from .. import hookimpl, layer_state, validation
from ..compat import features
from ..targets import HookTarget

FUSED_MOE = "sglang.srt.layers.moe.fused_moe_triton.layer.FusedMoE"


def weight_loader_impl(original, layer, param, loaded_weight, weight_name, shard_id, expert_id, *args, **kwargs):
    st = layer_state.state_of(layer)
    if st is None:
        if not validation.was_validated(param, loaded_weight):
            checked = validation.check_write(layer, param, loaded_weight, weight_name, shard_id, expert_id)
            if checked is not None:  # a layer SGLang prepares itself: validated, then SGLang's loader
                expert_id = checked[1]
        return original(layer, param, loaded_weight, weight_name, shard_id, expert_id, *args, **kwargs)
    # One step under the layer's lock (SGLang's DeepSeek loader writes shards of one expert from a thread pool):
    # a concurrent writer of the same expert must neither see it half un-prepared nor have its rows overwritten
    # by this writer's in-place inverse.
    with st.lock:
        if validation.was_validated(param, loaded_weight):
            name = validation.param_name(layer, param, st.fmt)
            assert name is not None  # weight_loader validated this write, so the format manages the parameter
            e = validation.check_local_expert(layer, param, name, expert_id, shard_id)
        else:
            checked = validation.check_write(layer, param, loaded_weight, weight_name, shard_id, expert_id)
            if checked is None:
                return original(layer, param, loaded_weight, weight_name, shard_id, expert_id, *args, **kwargs)
            name, e = checked
        layer_state.before_write(layer, name, e)
        return original(layer, param, loaded_weight, weight_name, shard_id, e, *args, **kwargs)


def weight_loader(original, layer, param, loaded_weight, weight_name, shard_id, expert_id=None, *args, **kwargs):
    st = layer_state.state_of(layer)
    if st is not None and expert_id is None and st.fmt.fused:
        # all experts at once (gpt-oss MXFP4: SGLang's fast path never reaches _weight_loader_impl): validate, then
        # return the whole group to checkpoint layout, then SGLang's copy, as one step under the layer's lock
        name = validation.param_name(layer, param, st.fmt) or weight_name
        with st.lock:
            validation.validate_fused(layer, name, param, loaded_weight)
            layer_state.before_write(layer, name, None)
            return original(layer, param, loaded_weight, weight_name, shard_id, expert_id, *args, **kwargs)
    checked = validation.check_write(layer, param, loaded_weight, weight_name, shard_id, expert_id, scope="global")
    if checked is None:  # not a layer or a parameter the plugin manages or watches: SGLang's own loader
        return original(layer, param, loaded_weight, weight_name, shard_id, expert_id, *args, **kwargs)
    name, e = checked
    prev = validation.mark_validated(param, loaded_weight)
    try:
        st = layer_state.state_of(layer)
        group = st.fmt.group_of(name) if st is not None else None
        if st is None or group is None:
            return original(layer, param, loaded_weight, weight_name, shard_id, e, *args, **kwargs)
        with st.lock:
            # SGLang's loader narrows the parameter in its checkpoint shape: a format that shows prepared parameters
            # in another shape (BF16's 4-D block layout) is seen 3-D for the load, and 4-D again if nothing was written
            st.fmt.on_layout(layer, group, all_prepared=False)
            try:
                return original(layer, param, loaded_weight, weight_name, shard_id, e, *args, **kwargs)
            finally:
                if bool(st.prepared[group].all()):
                    st.fmt.on_layout(layer, group, all_prepared=True)
    finally:
        validation.restore_validated(prev)


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
        object.__setattr__(layer, "_trtllm_moe_prefix", prefix)
    if isinstance(arguments.get("intermediate_size"), int):
        object.__setattr__(layer, "_trtllm_moe_intermediate", arguments["intermediate_size"])
    cfg = getattr(layer, "moe_runner_config", None)
    if cfg is not None and not features.MOE_RUNNER_CONFIG_LAYER.present():
        cfg.layer = layer  # the plugin runner finds the layer being run through its config
    return None


@hookimpl
def register_sglang_hooks(register, release):
    register(
        HookTarget(
            f"{FUSED_MOE}.weight_loader",
            weight_loader,
            "around",
            releases=">=0.5.11",
            capability="rl-update",
            why="validate every write (shard, expert id, dtype, shape, device, scale values) before SGLang "
            "maps expert ids to ranks, so every rank refuses the same bad tensor",
        )
    )
    register(
        HookTarget(
            f"{FUSED_MOE}.__init__",
            remember_prefix,
            "after",
            releases=">=0.5.11",
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
            releases=">=0.5.11",
            capability="rl-update",
            why="validate shards and un-prepare an expert before SGLang's loader writes into it",
        )
    )
