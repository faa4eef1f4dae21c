"""SGLang's expert placement and rebalance for one FusedMoE without a model runner: shared by the one-process layer
test (tests/test_eplb_layers.py) and the two-rank P2P test (tests/support/eplb_p2p_worker.py).

A server's model runner builds the placement with `ExpertLocationMetadata.init_by_mapping` (which needs a model
config these layer tests have no model for) and installs it process-wide; here `metadata` fills SGLang's own
dataclass with the fields `init_by_mapping` computes, and `installed` hands it to the two callers that read it (the
loader, the updater). The rebalance itself is SGLang's own `ExpertLocationUpdater.update` on what a model's
`get_moe_weights()` lists, as EPLBManager.rebalance runs it.
"""

from __future__ import annotations

import contextlib
import dataclasses

import torch


@contextlib.contextmanager
def cpu_empty_cache():
    """`torch.cpu.empty_cache` as a no-op where CPU torch lacks it: `ExpertLocationUpdater.update` starts its first
    rebalance with `torch.get_device_module().empty_cache()`, which only hands cached CUDA blocks back to the
    driver (docs/TESTING.md lists this stand-in)."""
    missing = not hasattr(torch.cpu, "empty_cache")
    if missing:
        torch.cpu.empty_cache = lambda: None
    try:
        yield
    finally:
        if missing:
            del torch.cpu.empty_cache


def metadata(p2l: list[int], num_logical: int, ep_size: int = 1):
    """SGLang's ExpertLocationMetadata of one layer with placement `p2l` (physical slot -> logical expert) over
    `ep_size` EP ranks: logical -> all its slots (padded with -1), no static dispatch, as `init_by_mapping` fills it."""
    from sglang.srt.eplb.expert_location import ExpertLocationMetadata

    p = torch.tensor([p2l])
    l2a = torch.full((1, num_logical, len(p2l)), -1)
    for logical in range(num_logical):
        slots = [i for i, x in enumerate(p2l) if x == logical]
        l2a[0, logical, : len(slots)] = torch.tensor(slots)
    kw = dict(
        physical_to_logical_map=p,
        physical_to_logical_map_cpu=p.clone(),
        logical_to_all_physical_map=l2a,
        logical_to_all_physical_map_cpu=l2a.clone(),
        logical_to_all_physical_map_num_valid=(l2a != -1).sum(-1),
        ep_size=ep_size,
        logical_to_rank_dispatch_physical_map=None,
    )
    names = {f.name for f in dataclasses.fields(ExpertLocationMetadata)}
    return ExpertLocationMetadata(**{k: v for k, v in kw.items() if k in names})


def getter_modules() -> tuple:
    """The modules whose `get_global_expert_location_metadata` SGLang's loader and rebalance call."""
    from sglang.srt.eplb import expert_location_updater
    from sglang.srt.layers.moe.fused_moe_triton import layer as fused_moe

    return (fused_moe, expert_location_updater)


@contextlib.contextmanager
def installed(current: list):
    """The placement `current[0]` answers both callers for the duration (what the model runner installs process-wide
    at start-up; SGLang's updater changes that object in place, `ExpertLocationMetadata.update`)."""
    saved = [(m, m.get_global_expert_location_metadata) for m in getter_modules()]
    for m, _ in saved:
        m.get_global_expert_location_metadata = lambda: current[0]
    try:
        yield current
    finally:
        for m, own in saved:
            m.get_global_expert_location_metadata = own


def moe_weights(layer) -> dict[str, torch.Tensor]:
    """What a model's get_moe_weights() hands SGLang's rebalance (qwen3_moe.py / nemotron_h.py), by parameter name:
    the parameters SGLang's `filter_moe_weight_param_global_expert` keeps (one row per local slot)."""
    from sglang.srt.layers.moe.utils import filter_moe_weight_param_global_expert

    return {
        name: x.data
        for name, x in layer.named_parameters()
        if name != "correction_bias" and filter_moe_weight_param_global_expert(name, x, layer.num_local_experts)
    }


def rebalance(layer, new, rank: int = 0) -> None:
    """SGLang's own weight move of an EPLB rebalance of layer 0 onto placement `new` (a metadata), on EP rank `rank`
    of the default process group (one node), then the placement it installs."""
    from sglang.srt.eplb.expert_location_updater import ExpertLocationUpdater

    weights = {0: list(moe_weights(layer).values())}
    with cpu_empty_cache():
        ExpertLocationUpdater().update(weights, new, update_layer_ids=[0], nnodes=1, rank=rank)
