"""EPLB / redundant experts on every release (issue #39), one MoE layer: SGLang's own rebalance of a layer the
plugin prepared, then an RL update, against a fresh load under the new placement.

The whole-model test (tests/test_eplb.py) needs SGLang's ModelRunner set-up (0.5.21+). Here, on every release, a
FusedMoE with 8 experts in 12 slots is built and loaded the way a server does with `ep_num_redundant_experts=4`:
SGLang's expert-location metadata says which slots hold which expert (an `ExpertLocationMetadata` filled from a
placement, as `init_by_mapping` fills it: that constructor needs a model config this test has no model for; the
`placement` fixture hands it to the two callers that read it), and SGLang's own `FusedMoE.weight_loader` writes
every replica. The rebalance is SGLang's own
`ExpertLocationUpdater.update` (gloo world of one) on what a model's `get_moe_weights()` lists — the parameters
SGLang's own `filter_moe_weight_param_global_expert` keeps — as EPLBManager.rebalance runs it.

Oracles: every parameter's bytes equal a layer freshly loaded and prepared under the new placement (SGLang's
`*_blockscale_swizzled` placeholders excepted: nothing ever writes them, so their bytes are whatever allocation
left, on both sides); the layout state is clean; the forward for the same logical experts, routed to replica slots
through the old placement before and the new one after, is bit-identical, and equals the fresh layer's; after a
tensor update of some experts (replicated ones among them) the bytes equal a fresh load of the updated checkpoint
under the same placement.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from sglang_trtllm_moe import layer_state
from sglang_trtllm_moe.sandbox import layers as cpu_layers

from .support import eplb_placement, sglang_runtime

E, R = 8, 4
INIT = list(range(E)) + list(range(R))
NEW = list(reversed(range(E))) + [5, 5, 0, 3]
#: parameters SGLang allocates from a placeholder and no loader writes (ModelOpt NVFP4 before 0.5.16)
UNWRITTEN = ("w13_blockscale_swizzled", "w2_blockscale_swizzled")
SPECS = [
    pytest.param(cpu_layers.MoeSpec(num_experts=E, hidden=128, intermediate=128, fmt="nvfp4"), id="nvfp4"),
    pytest.param(
        cpu_layers.MoeSpec(num_experts=E, hidden=128, intermediate=128, fmt="nvfp4", gated=False, activation="relu2"),
        id="nvfp4-relu2",
    ),
    pytest.param(cpu_layers.MoeSpec(num_experts=E, hidden=128, intermediate=128, fmt="fp8_block"), id="fp8_block"),
]


@pytest.fixture
def placement():
    """The placement SGLang's loader and rebalance see (what the model runner installs process-wide at start-up),
    undone after the test, so other layers of the process are built without a placement."""
    with eplb_placement.installed([eplb_placement.metadata(INIT, E)]) as current:
        yield current


def _model(spec, tensors):
    """A TinyMoeModel with E + R slots loaded with `tensors` (E logical experts) under the installed placement."""
    model = cpu_layers.TinyMoeModel(dataclasses.replace(spec, num_experts=E + R))
    model.load_weights(cpu_layers.checkpoint_names(tensors).items())
    model.experts.quant_method.process_weights_after_loading(model.experts)
    return model


def _rebalance(layer, new):
    eplb_placement.rebalance(layer, eplb_placement.metadata(new, E))


def _clean(layer) -> bool:
    """No expert of a layer the plugin prepares is left dirty or in checkpoint layout (True for observed layers)."""
    st = layer_state.state_of(layer)
    return st is None or st.clean


def _bytes(t):
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def _differs(a, b) -> list[str]:
    theirs = dict(b.named_parameters())
    return [
        n
        for n, p in a.named_parameters()
        if not n.endswith(UNWRITTEN) and not torch.equal(_bytes(p), _bytes(theirs[n]))
    ]


def _forward(layer, p2l, x, logits, top_k):
    """The layer on the same logical experts per token, each sent to its last replica slot under `p2l`."""
    from sglang.srt.layers.moe.topk import StandardTopKOutput

    weights, logical = torch.topk(torch.softmax(logits, dim=-1), top_k, dim=-1)
    weights = weights / weights.sum(-1, keepdim=True)
    last = {lg: max(i for i, x in enumerate(p2l) if x == lg) for lg in range(E)}
    physical = logical.clone().apply_(lambda lg: last[lg]).to(torch.int32)
    return layer(x, StandardTopKOutput(weights, physical, logits))


@pytest.mark.parametrize("spec", SPECS)
def test_rebalance_then_update_equals_a_fresh_load_under_the_new_placement(spec, placement, monkeypatch):
    monkeypatch.setenv("SGLANG_TRTLLM_MOE_EMULATE", "1")
    sglang_runtime.ensure("flashinfer_trtllm_routed")
    ck = cpu_layers.random_checkpoint(spec, 0)
    g = torch.Generator().manual_seed(4)
    x, logits = torch.randn(9, spec.hidden, generator=g).to(torch.bfloat16), torch.randn(9, E, generator=g)

    model = _model(spec, ck)
    layer = model.experts
    # the plugin prepares the layer, or observes one SGLang prepares itself on this release (compat/defer.py)
    assert layer_state.state_of(layer) is not None or layer_state.observed(layer) is not None
    assert _clean(layer)
    ptrs = {n: p.data_ptr() for n, p in layer.named_parameters()}
    w13 = _bytes(layer.w13_weight).reshape(E + R, -1)
    assert all(torch.equal(w13[s], w13[INIT[s]]) for s in range(E, E + R)), "SGLang's loader wrote every replica"
    before = _forward(layer, INIT, x, logits, spec.top_k)

    _rebalance(layer, NEW)
    assert placement[0].physical_to_logical_map_cpu.tolist() == [NEW], "SGLang's updater installs the placement"
    fresh = _model(spec, ck).experts
    assert _differs(layer, fresh) == []
    assert _clean(layer)
    after = _forward(layer, NEW, x, logits, spec.top_k)
    assert torch.equal(after, before), "a rebalance changed what the layer computes for the same experts"
    assert torch.equal(after, _forward(fresh, NEW, x, logits, spec.top_k))

    new = cpu_layers.random_checkpoint(spec, 1, experts=[0, 5, 7])
    ok, msg = sglang_runtime.updater(model).update_weights_from_tensor(list(cpu_layers.checkpoint_names(new).items()))[
        :2
    ]
    assert ok, msg
    fresh = _model(spec, {**ck, **new}).experts
    assert _differs(layer, fresh) == []
    assert _clean(layer)
    assert {n: p.data_ptr() for n, p in layer.named_parameters()} == ptrs
    assert torch.equal(_forward(layer, NEW, x, logits, spec.top_k), _forward(fresh, NEW, x, logits, spec.top_k))


def test_the_placement_helper_fills_every_field_sglang_declares():
    """`eplb_placement.metadata` builds SGLang's own dataclass from the fields it declares on this release: none
    left unset."""
    from sglang.srt.eplb.expert_location import ExpertLocationMetadata

    m = eplb_placement.metadata(NEW, E)
    assert m.logical_to_all_physical(0, 5) == [2, 8, 9]
    assert {f.name for f in dataclasses.fields(ExpertLocationMetadata)} <= set(vars(m))
