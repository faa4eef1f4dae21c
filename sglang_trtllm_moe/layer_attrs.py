"""The attributes the plugin sets on SGLang's objects, named once.

Most per-layer facts live in `layer_state.LayerState`; these cannot: they are written before the plugin knows
whether it will manage the layer (at `FusedMoE.__init__`, at weight allocation), on layers it never manages (the
weight checker's snapshots), or on objects that are not layers (`ServerArgs`). Every module reads and writes them
through these names, so a rename or a new one is one line here. All start with `_trtllm_moe_`: never a name SGLang
uses.
"""

from __future__ import annotations

#: FusedMoE.__init__'s `prefix` (the layer's checkpoint path, e.g. "model.layers.3.mlp.experts"): names in messages,
#: and a request's checkpoint names resolved to the layer
PREFIX = "_trtllm_moe_prefix"
#: FusedMoE.__init__'s `intermediate_size` (the whole model's, before the TP split): the TP extents a write must fit
INTERMEDIATE = "_trtllm_moe_intermediate"
#: the layer's LayerState (a managed layer)
STATE = "_trtllm_moe_state"
#: the format a watched layer (one SGLang prepares itself) was recognised as
OBSERVED = "_trtllm_moe_observed"
#: a watched layer's parameter names before SGLang prepared it (what a new instance built from the same config holds:
#: builtins/remote_instance.py; a managed layer keeps them in its LayerState)
LOADED_PARAMS = "_trtllm_moe_loaded_params"
#: validation's write plans per parameter (dropped when the layer's state or watched format is set)
PLANS = "_trtllm_moe_plans"
#: batched_writes' plans per (parameter, shard, tensor geometry): where SGLang's loader of this release writes a tensor
#: inside an expert's slot (traced once)
BATCH_PLANS = "_trtllm_moe_batch_plans"
#: MXFP4 experts whose storage the plugin allocated: their unpadded per-rank intermediate size
UNPADDED_INTERMEDIATE = "_trtllm_moe_unpadded_intermediate"
#: gpt-oss MXFP4 layers whose storage the plugin allocated
GPTOSS_ALLOCATED = "_trtllm_moe_gptoss"
#: on a weight-checker snapshot tensor: its layer group's prepared mask when the snapshot was taken
SNAPSHOT_PREPARED = "_trtllm_moe_prepared"
#: on ServerArgs (<= 0.5.14): what the caller asked for, before SGLang's model rules overwrite the fields
REQUESTED = "_trtllm_moe_requested"


def record(obj: object, attr: str, value: object) -> None:
    """Set `attr` on `obj` past any __setattr__ override (nn.Module's would register tensors as buffers)."""
    object.__setattr__(obj, attr, value)
