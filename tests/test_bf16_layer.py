"""BF16 (unquantized) FusedMoE layers of the installed SGLang on CPU, prepared in place by the plugin.

Oracles: SGLang 0.5.23's own BF16 trtllm preparation (`UnquantizedFusedMoEMethod.process_weights_after_loading`,
reached at `__wrapped__`), flashinfer's `prepare_trtllm_bf16_weights` (pure torch), SGLang's own DeepSeek routing
(`biased_grouped_topk_impl`), and a float MoE written here from the checkpoint tensors.
The scenarios every format shares (updates, refusals, the checker, threads, ...): tests/test_layer_contract.py.
"""

from __future__ import annotations

import pytest
import torch

from sglang_trtllm_moe import layer_state, layouts
from sglang_trtllm_moe.compat import features
from sglang_trtllm_moe.sandbox import layers as cpu_layers

from .support import sglang_runtime

CASES = [
    pytest.param(cpu_layers.MoeSpec(intermediate=128, fmt="bf16"), id="gated-I128"),
    pytest.param(cpu_layers.MoeSpec(intermediate=96, fmt="bf16"), id="gated-I96-padded"),
    pytest.param(cpu_layers.MoeSpec(intermediate=128, activation="relu2", gated=False, fmt="bf16"), id="relu2-I128"),
    pytest.param(
        cpu_layers.MoeSpec(intermediate=200, activation="relu2", gated=False, fmt="bf16"), id="relu2-I200-padded"
    ),
]
WEIGHTS = ("w13_weight", "w2_weight")


@pytest.fixture(scope="module", autouse=True)
def runtime():
    sglang_runtime.ensure("flashinfer_trtllm")


@pytest.fixture(autouse=True)
def plugin_prepares(monkeypatch):
    """Where SGLang's own preparation is right the plugin defers (compat/defer.py); these tests prove the plugin's
    own preparation, which serves the releases where it is not, on every release."""
    sglang_runtime.plugin_prepares(monkeypatch, "bf16")


def ckpt(spec, seed=0):
    return cpu_layers.random_bf16_checkpoint(spec, seed=seed)


def loaded_layer(spec, seed=0):
    layer = cpu_layers.build_layer(spec)
    cpu_layers.load_checkpoint(layer, ckpt(spec, seed), spec.num_experts)
    return layer


def prepared_layer(spec, seed=0):
    layer = loaded_layer(spec, seed)
    layer.quant_method.process_weights_after_loading(layer)
    return layer


def as_bytes(t):
    return t.detach().contiguous().view(torch.uint8).reshape(-1)


def upstream_prep(layer, monkeypatch):
    """SGLang's own BF16 post-load step. On CPU it would also AMX-pack the weights where AMX exists; that branch is
    not part of the trtllm preparation, so it is switched off (it is already off on this box)."""
    import sglang.srt.layers.quantization.unquant as unquant

    monkeypatch.setattr(unquant, "_is_cpu_amx_available", False)
    original = unquant.UnquantizedFusedMoEMethod.process_weights_after_loading
    while hasattr(original, "__wrapped__"):
        original = original.__wrapped__
    original(layer.quant_method, layer)


def padded_checkpoint(spec, ck):
    """[up; gate] w13 with each half padded to SGLang's 128-aligned intermediate, and w2 with padded columns."""
    ip = -(-spec.intermediate // 128) * 128
    e, h, i = spec.num_experts, spec.hidden, spec.intermediate
    w13 = torch.zeros(e, (2 if spec.gated else 1) * ip, h, dtype=torch.bfloat16)
    w2 = torch.zeros(e, h, ip, dtype=torch.bfloat16)
    for x in range(e):
        w13[x, :i] = ck[f"experts.{x}.up_proj.weight"]
        if spec.gated:
            w13[x, ip : ip + i] = ck[f"experts.{x}.gate_proj.weight"]
        w2[x, :, :i] = ck[f"experts.{x}.down_proj.weight"]
    return w13, w2, ip


@pytest.mark.parametrize("spec", CASES)
def test_prepared_bytes_equal_sglang_and_flashinfer_preparation_in_place(spec, monkeypatch):
    ours = loaded_layer(spec)
    before = {n: (p, p.data_ptr(), tuple(p.shape)) for n, p in ours.named_parameters()}
    ours.quant_method.process_weights_after_loading(ours)
    assert layer_state.state_of(ours) is not None and layer_state.state_of(ours).clean, "the plugin did not take over"
    for n, (obj, ptr, _shape) in before.items():  # in place: same Parameter and storage
        p = getattr(ours, n)
        assert p is obj and p.data_ptr() == ptr, n

    upstream = loaded_layer(spec)
    upstream_prep(upstream, monkeypatch)
    from flashinfer.fused_moe.api import ReLU2, SwiGLU
    from flashinfer.fused_moe.prepare import prepare_trtllm_bf16_weights

    w13, w2, ip = padded_checkpoint(spec, ckpt(spec))
    fi = prepare_trtllm_bf16_weights(
        w13,
        w2,
        num_local_experts=spec.num_experts,
        hidden_size=spec.hidden,
        intermediate_size=ip,
        activation=SwiGLU() if spec.gated else ReLU2(),
        permute_cache={},
    )
    for n, fi_name in zip(WEIGHTS, ("gemm1_weights", "gemm2_weights"), strict=True):
        a, b = getattr(ours, n), getattr(upstream, n)
        # SGLang shows a prepared layer's Parameters in the 4-D BlockMajorK shape; the plugin keeps that contract
        # (a view of the same storage, 3-D again whenever an expert is returned to checkpoint layout for a load)
        assert b.dim() == 4 and a.shape == b.shape, (tuple(a.shape), tuple(b.shape))
        assert layouts.block_major_k_view(a.data.reshape(before[n][2])).shape == b.shape
        assert torch.equal(as_bytes(a), as_bytes(b)), f"{n} differs from SGLang's own trtllm preparation"
        assert torch.equal(as_bytes(a), as_bytes(fi[fi_name])), (
            f"{n} differs from flashinfer prepare_trtllm_bf16_weights"
        )


def reference_moe(x, topk_ids, topk_weights, ck, spec):
    """Float MoE from the checkpoint, per token and selected expert (gate/up/down by name, no layouts)."""
    x = x.float()
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for k in range(topk_ids.shape[1]):
            base = f"experts.{int(topk_ids[t, k])}."
            up = ck[base + "up_proj.weight"].float() @ x[t]
            if spec.gated:
                h = torch.nn.functional.silu(ck[base + "gate_proj.weight"].float() @ x[t]) * up
            else:
                h = torch.relu(up) ** 2
            out[t] += float(topk_weights[t, k]) * (ck[base + "down_proj.weight"].float() @ h)
    return out


_forward = sglang_runtime.forward


def rel(a, b):
    return float((a.float() - b).norm() / b.norm())


@pytest.mark.parametrize("spec", CASES)
def test_forward_through_sglang_layer_with_emulator_matches_reference(spec, monkeypatch):
    monkeypatch.setenv("SGLANG_TRTLLM_MOE_EMULATE", "1")
    layer = prepared_layer(spec)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(6, spec.hidden, generator=g).to(torch.bfloat16)
    logits = torch.randn(6, spec.num_experts, generator=g)
    out, topk = _forward(layer, x, logits)
    ref = reference_moe(x, topk.topk_ids, topk.topk_weights, ckpt(spec), spec)
    # BF16 kernel: fp32 accumulation, the intermediate and each expert's output rounded to bf16 (8 mantissa bits,
    # <= 0.4 % each) and a bf16 result: ~0.5 % of the output norm. A wrong row/block layout mixes unrelated
    # weights and gives ~100 %.
    assert rel(out, ref) < 0.02, rel(out, ref)

    layer_state.state_of(layer).fmt.unprepare_(
        layer, "w13", list(range(spec.num_experts))
    )  # bytes not in kernel layout
    bad, _ = _forward(layer, x, logits)
    assert rel(bad, ref) > 0.5


def test_routed_scaling_factor_reaches_the_kernel_on_the_logits_path(monkeypatch):
    """DeepSeek-V3 routing done by the kernel from logits (SGLang's bypassed TopK): routed_scaling_factor must be
    passed (vllm#43769 dropped it for BF16). Routing oracle: SGLang's own biased_grouped_topk_impl."""
    from sglang.srt.layers.moe.topk import BypassedTopKOutput, TopKConfig, biased_grouped_topk_impl
    from sglang.srt.layers.moe.utils import RoutingMethodType

    monkeypatch.setenv("SGLANG_TRTLLM_MOE_EMULATE", "1")
    spec = cpu_layers.MoeSpec(intermediate=128, fmt="bf16")
    layer = prepared_layer(spec)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(5, spec.hidden, generator=g).to(torch.bfloat16)
    logits = torch.randn(5, spec.num_experts, generator=g)
    bias = torch.randn(spec.num_experts, generator=g) * 0.1
    monkeypatch.setattr(layer.moe_runner_config, "routing_method_type", RoutingMethodType.DeepSeekV3)
    outs = {}
    for rsf in (1.0, 2.5):
        monkeypatch.setattr(layer.moe_runner_config, "routed_scaling_factor", rsf)
        cfg = TopKConfig(
            top_k=2,
            use_grouped_topk=True,
            topk_group=1,
            num_expert_group=2,
            renormalize=True,
            correction_bias=bias,
            routed_scaling_factor=rsf,
            routing_method_type=RoutingMethodType.DeepSeekV3,
        )
        outs[rsf] = layer(x, BypassedTopKOutput(hidden_states=x, raw_router_logits=logits, topk_config=cfg))
        w, ids = biased_grouped_topk_impl(
            x,
            logits,
            bias,
            2,
            True,
            num_expert_group=2,
            topk_group=1,
            routed_scaling_factor=rsf,
            apply_routed_scaling_factor_on_output=True,
        )
        assert rel(outs[rsf], reference_moe(x, ids, w, ckpt(spec), spec)) < 0.02
    assert rel(outs[2.5], 2.5 * outs[1.0].float()) < 0.01


# ---- RL updates through SGLang's WeightUpdater -------------------------------------------------------------------

RL_SPEC = cpu_layers.MoeSpec(intermediate=96, fmt="bf16")  # gated, padded 96 -> 128 per half
updater = sglang_runtime.updater


def prepared_model(tensors):
    return sglang_runtime.prepared_model(RL_SPEC, tensors)


def assert_same_as_fresh(model, intended):
    fresh = prepared_model(intended)
    for n in WEIGHTS:
        assert torch.equal(as_bytes(getattr(model.experts, n)), as_bytes(getattr(fresh.experts, n))), n


def pointers(model):
    return {n: (p.data_ptr(), tuple(p.shape)) for n, p in model.named_parameters()}


def test_sglang_restore_hooks_are_harmless_and_loader_free_refits_get_checkpoint_layout():
    """SGLang's `maybe_restore_flashinfer_trtllm_bf16_weight_shape_for_load` (called before every load) must not
    touch a managed layer; `restore_weights_before_loading` (begin_weight_update, loader-free P2P refits) must leave
    the parameters in checkpoint layout, in place, and the next flush must prepare them again."""
    model = prepared_model(ckpt(RL_SPEC, 0))
    layer, method = model.experts, model.experts.quant_method
    ptrs = pointers(model)
    prepared = {n: as_bytes(getattr(layer, n)).clone() for n in WEIGHTS}
    for n in WEIGHTS:
        method.maybe_restore_flashinfer_trtllm_bf16_weight_shape_for_load(
            layer=layer, param=getattr(layer, n), weight_name=f"model.layers.0.mlp.experts.{n}"
        )
        assert torch.equal(as_bytes(getattr(layer, n)), prepared[n])

    updater(model).begin_weight_update()  # SGLang's entry point -> DefaultModelLoader.restore_weights_before_loading
    raw = cpu_layers.TinyMoeModel(RL_SPEC)
    raw.load_weights(cpu_layers.checkpoint_names(ckpt(RL_SPEC, 0)).items())  # loaded, never prepared
    for n in WEIGHTS:  # checkpoint bytes in the checkpoint shape, as SGLang's own restore leaves them
        assert torch.equal(as_bytes(getattr(layer, n)), as_bytes(getattr(raw.experts, n))), n
        assert getattr(layer, n).shape == getattr(raw.experts, n).shape, n
    assert {n: p for n, (p, _) in pointers(model).items()} == {n: p for n, (p, _) in ptrs.items()}
    # a loader-free refit writes checkpoint bytes straight into the storage, then the update ends
    new = ckpt(RL_SPEC, 9)
    raw2 = cpu_layers.TinyMoeModel(RL_SPEC)
    raw2.load_weights(cpu_layers.checkpoint_names(new).items())
    for n in WEIGHTS:
        getattr(layer, n).data.copy_(getattr(raw2.experts, n).data)
    updater(model).end_weight_update(run_post_load=False)  # SGLang's end of the session -> prepared again
    assert pointers(model) == ptrs
    assert_same_as_fresh(model, new)


@pytest.mark.requires_sm100
@pytest.mark.parametrize("spec", CASES)
def test_real_kernel_matches_emulator_on_sm100(spec, monkeypatch):
    import sglang_trtllm_moe.runner as runner

    layer = prepared_layer(spec)
    layer.to("cuda")
    g = torch.Generator().manual_seed(1)
    x = torch.randn(16, spec.hidden, generator=g).to(torch.bfloat16).cuda()
    logits = torch.randn(16, spec.num_experts, generator=g).cuda()
    monkeypatch.delenv("SGLANG_TRTLLM_MOE_EMULATE", raising=False)
    kernel, _ = _forward(layer, x, logits)
    monkeypatch.setattr(runner, "emulating", lambda: True)
    emulated, _ = _forward(layer, x, logits)
    assert rel(kernel, emulated.float()) < 0.01


@pytest.mark.skipif(
    not features.TRTLLM_ROUTING_GUESSED.present(),
    reason="this SGLang release materializes the top-k of a layer that declares no routing method "
    "itself (compat.features.TRTLLM_ROUTING_GUESSED: from 0.5.23)",
)
def test_undeclared_routing_method_gets_sglangs_own_topk(monkeypatch):
    """Mixtral declares no routing method; SGLang before 0.5.23 then lets the kernel route a bypassed TopK with a
    guessed method (BF16: Default = softmax over all experts, no renormalization: the wrong weights). The plugin
    runner takes SGLang's own top-k for such a layer (select_experts, what the model's TopK asked for): the bypassed
    forward equals the materialized one."""
    monkeypatch.setenv("SGLANG_TRTLLM_MOE_EMULATE", "1")
    spec = cpu_layers.MoeSpec(intermediate=128, fmt="bf16")
    layer = prepared_layer(spec)
    assert getattr(layer, "routing_method_type", None) is None  # as Mixtral builds it
    g = torch.Generator().manual_seed(5)
    x = torch.randn(8, spec.hidden, generator=g).to(torch.bfloat16)
    logits = torch.randn(8, spec.num_experts, generator=g)
    materialized, _ = sglang_runtime.forward(layer, x, logits)
    bypassed, _ = sglang_runtime.forward(layer, x, logits, bypass=True)
    assert torch.equal(bypassed, materialized)
