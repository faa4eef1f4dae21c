"""Every hook serves a call completely or hands it to SGLang unchanged: a layer the plugin cannot fully read (a
wrapper, a LoRA-wrapped layer, a stand-in, another release's object) goes back to SGLang's own code — never an
AttributeError out of the plugin, never a TrtllmLayerError for a layer the plugin could not even read.

Each quant-method hook is called as HookRegistry calls it, `hook(original, method, layer)`, with a real loaded layer
seen through a stand-in that lacks one attribute the plugin reads (a parameter, a scalar, the runner config or one
of its fields); `original` records the call. The same layer, complete, is taken over by the plugin (the control).
"""

from __future__ import annotations

import pytest

from sglang_trtllm_moe import layer_state
from sglang_trtllm_moe.builtins import bf16_hooks, fp8_hooks, nvfp4_hooks, runner_hooks
from sglang_trtllm_moe.formats import by_name
from sglang_trtllm_moe.sandbox import layers as cpu_layers

from .support import sglang_runtime


@pytest.fixture(scope="module", autouse=True)
def runtime():
    sglang_runtime.ensure("flashinfer_trtllm")


@pytest.fixture(autouse=True)
def plugin_prepares(monkeypatch):
    sglang_runtime.plugin_prepares(monkeypatch, "bf16", "fp8_block")


class Without:
    """`obj` without attribute `hidden` (everything else, including writes, goes to `obj`)."""

    def __init__(self, obj, hidden: str):
        object.__setattr__(self, "_obj", obj)
        object.__setattr__(self, "_hidden", hidden)

    def __getattr__(self, name):
        if name == object.__getattribute__(self, "_hidden"):
            raise AttributeError(f"stand-in has no {name}")
        return getattr(object.__getattribute__(self, "_obj"), name)

    def __setattr__(self, name, value):
        setattr(object.__getattribute__(self, "_obj"), name, value)


#: (layer kind, hook, format in the registry, checkpoint maker)
HOOKS = [
    ("nvfp4", nvfp4_hooks.modelopt_process_weights_after_loading, "nvfp4", cpu_layers.random_nvfp4_checkpoint),
    ("ct_nvfp4", nvfp4_hooks.ct_process_weights_after_loading, "ct_nvfp4", cpu_layers.random_ct_nvfp4_checkpoint),
    (
        "fp8_modelopt",
        fp8_hooks.modelopt_fp8_process_weights_after_loading,
        "fp8_tensor_modelopt",
        cpu_layers.random_fp8_checkpoint,
    ),
    ("fp8_tensor", fp8_hooks.fp8_process_weights_after_loading, "fp8_tensor", cpu_layers.random_fp8_checkpoint),
    ("fp8_block", fp8_hooks.fp8_process_weights_after_loading, "fp8_block", cpu_layers.random_fp8_checkpoint),
    ("bf16", bf16_hooks.process_weights_after_loading, "bf16", cpu_layers.random_bf16_checkpoint),
]
CONFIG_FIELDS = ("activation", "is_gated")


def _loaded(kind, make):
    spec = cpu_layers.MoeSpec(num_experts=4, intermediate=128, fmt=kind)
    layer = cpu_layers.build_layer(spec)
    cpu_layers.load_checkpoint(layer, make(spec, seed=0), spec.num_experts)
    return layer


def _method(kind, layer):
    """What SGLang calls process_weights_after_loading on: the quant method, or compressed-tensors' per-layer scheme."""
    return layer.scheme if kind == "ct_nvfp4" else layer.quant_method


def _missing(fmt_name):
    fmt = by_name(fmt_name)
    return (
        [p.name for p in fmt.params]
        + list(fmt.scalar_params)
        + ["moe_runner_config"]
        + [f"moe_runner_config.{f}" for f in CONFIG_FIELDS]
    )


CASES = [
    pytest.param(kind, hook, fmt, make, attr, id=f"{kind}-{attr}")
    for kind, hook, fmt, make in HOOKS
    for attr in _missing(fmt)
]


@pytest.mark.parametrize("kind,hook,fmt,make,attr", CASES)
def test_a_layer_the_plugin_cannot_read_goes_to_sglang_unchanged(kind, hook, fmt, make, attr):
    layer = _loaded(kind, make)
    if attr.startswith("moe_runner_config."):
        stand_in = _WithConfig(layer, Without(layer.moe_runner_config, attr.split(".", 1)[1]))
    else:
        stand_in = Without(layer, attr)
    calls = []
    hook(lambda *a, **k: calls.append(a), _method(kind, layer), stand_in)
    assert len(calls) == 1 and calls[0][1] is stand_in, f"{kind}: the plugin did not hand the call back unchanged"
    assert layer_state.state_of(layer) is None, "a layer handed back must carry no plugin layout state"


class _WithConfig:
    """The layer with its runner config replaced by a stand-in."""

    def __init__(self, layer, cfg):
        object.__setattr__(self, "_obj", layer)
        object.__setattr__(self, "_cfg", cfg)

    def __getattr__(self, name):
        if name == "moe_runner_config":
            return object.__getattribute__(self, "_cfg")
        return getattr(object.__getattribute__(self, "_obj"), name)

    def __setattr__(self, name, value):
        setattr(object.__getattribute__(self, "_obj"), name, value)


@pytest.mark.parametrize("kind,hook,fmt,make", HOOKS, ids=[h[0] for h in HOOKS])
def test_the_complete_layer_is_taken_over(kind, hook, fmt, make):
    layer = _loaded(kind, make)
    calls = []
    hook(lambda *a, **k: calls.append(a), _method(kind, layer), layer)
    assert calls == [] and layer_state.state_of(layer) is not None and layer_state.state_of(layer).fmt.name == fmt


@pytest.mark.parametrize("leaf", [runner_hooks.fp4_leaf, runner_hooks.fp8_leaf, runner_hooks.bf16_leaf])
def test_runner_leaves_hand_unknown_layers_to_sglang(leaf, monkeypatch):
    """A layer the plugin did not prepare (or a runner config without a layer) runs on SGLang's own leaf."""
    monkeypatch.delenv("SGLANG_TRTLLM_MOE_EMULATE", raising=False)
    calls = []

    class Config:
        pass

    leaf(lambda *a, **k: calls.append(a) or "sglang", "dispatch", "quant_info", Config(), False)
    assert len(calls) == 1 and calls[0][:2] == ("dispatch", "quant_info")


def test_bf16_apply_hands_unmanaged_layers_to_sglang():
    calls = []
    layer = _loaded("bf16", cpu_layers.random_bf16_checkpoint)
    bf16_hooks.apply(lambda *a, **k: calls.append(a), layer.quant_method, layer, "dispatch")
    assert len(calls) == 1 and calls[0][1] is layer
