"""FusedMoE's loader: every write into a layer the plugin manages is validated and un-prepares just its expert.

* `_weight_loader_impl` (AROUND): under the layer's lock, the shard is validated before anything changes
  (validation.py) and the written expert's group is returned to checkpoint layout; then SGLang's loader writes it.
* `weight_loader` (AROUND): SGLang silently drops a shard whose global expert id maps to no local expert (right for
  EP ranks that do not own it); an id no rank owns is a caller bug that would leave the old weights in place.
* `__init__` (AFTER): FusedMoE does not keep its checkpoint prefix; errors and reports name layers by it.
"""

from __future__ import annotations

from .. import hookimpl, layer_state, validation
from ..compat import features
from ..errors import WeightUpdateRefused
from ..targets import HookTarget

FUSED_MOE = "sglang.srt.layers.moe.fused_moe_triton.layer.FusedMoE"


def weight_loader_impl(original, layer, param, loaded_weight, weight_name, shard_id, expert_id, *args, **kwargs):
    st = layer_state.state_of(layer)
    if st is None:
        return original(layer, param, loaded_weight, weight_name, shard_id, expert_id, *args, **kwargs)
    name = validation.param_name(layer, param) or weight_name
    # One step under the layer's lock (SGLang's DeepSeek loader writes shards of one expert from a thread pool):
    # a concurrent writer of the same expert must neither see it half un-prepared nor have its rows overwritten
    # by this writer's in-place inverse.
    with st.lock:
        validation.validate_shard(layer, name, param, loaded_weight, shard_id, expert_id)
        layer_state.before_write(layer, name, None if expert_id is None else int(expert_id))
        return original(layer, param, loaded_weight, weight_name, shard_id, expert_id, *args, **kwargs)


def weight_loader(original, layer, param, loaded_weight, weight_name, shard_id, expert_id=None, *args, **kwargs):
    st = layer_state.state_of(layer)
    if st is None:
        return original(layer, param, loaded_weight, weight_name, shard_id, expert_id, *args, **kwargs)
    if expert_id is None and st.fmt.fused:
        # all experts at once (gpt-oss MXFP4: SGLang's fast path never reaches _weight_loader_impl): validate, then
        # return the whole group to checkpoint layout, then SGLang's copy, as one step under the layer's lock
        name = validation.param_name(layer, param) or weight_name
        with st.lock:
            validation.validate_fused(layer, name, param, loaded_weight)
            layer_state.before_write(layer, name, None)
            return original(layer, param, loaded_weight, weight_name, shard_id, expert_id, *args, **kwargs)
    if expert_id is not None:
        total = int(getattr(layer, "num_experts", 0)) + int(getattr(layer, "num_fused_shared_experts", 0) or 0)
        if total and not 0 <= int(expert_id) < total:
            raise WeightUpdateRefused(
                f"{layer_state.layer_name(layer)}: refused weight update of {weight_name}: expert id {expert_id} is "
                f"not an expert of this model (0..{total - 1}); nothing was written"
            )
    group = st.fmt.group_of(validation.param_name(layer, param) or weight_name)
    if group is None:
        return original(layer, param, loaded_weight, weight_name, shard_id, expert_id, *args, **kwargs)
    with st.lock:
        # SGLang's loader narrows the parameter in its checkpoint shape: a format that shows prepared parameters in
        # another shape (BF16's 4-D block layout) is seen 3-D for the load, and 4-D again if nothing was written
        st.fmt.on_layout(layer, group, all_prepared=False)
        try:
            return original(layer, param, loaded_weight, weight_name, shard_id, expert_id, *args, **kwargs)
        finally:
            if bool(st.prepared[group].all()):
                st.fmt.on_layout(layer, group, all_prepared=True)


def remember_prefix(result, layer, *args, **kwargs):
    import inspect

    from sglang.srt.layers.moe.fused_moe_triton.layer import FusedMoE

    init = FusedMoE.__init__
    while hasattr(init, "__wrapped__"):
        init = init.__wrapped__
    try:
        prefix = inspect.signature(init).bind(layer, *args, **kwargs).arguments.get("prefix")
    except TypeError:
        prefix = kwargs.get("prefix")
    if prefix:
        object.__setattr__(layer, "_trtllm_moe_prefix", prefix)
    cfg = getattr(layer, "moe_runner_config", None)
    # the plugin runner finds the layer being run through its config: the field is absent before 0.5.16, and FusedMoE
    # builds the config without it before 0.5.22 (MXFP8 layers would not be found)
    if cfg is not None and (not features.MOE_RUNNER_CONFIG_LAYER.present() or getattr(cfg, "layer", None) is None):
        cfg.layer = layer
    return None


@hookimpl
def register_sglang_hooks(register, release):
    register(HookTarget(f"{FUSED_MOE}.weight_loader", weight_loader, "around", releases=">=0.5.11",
                        capability="rl-update", why="refuse expert ids that no rank owns (SGLang drops them silently)"))
    register(HookTarget(f"{FUSED_MOE}.__init__", remember_prefix, "after", releases=">=0.5.11", capability="core",
                        why="remember each MoE layer's checkpoint prefix so errors and reports can name it"))
    register(HookTarget(f"{FUSED_MOE}._weight_loader_impl", weight_loader_impl, "around", releases=">=0.5.11",
                        capability="rl-update",
                        why="validate shards and un-prepare an expert before SGLang's loader writes into it"))
