"""Router logits as the fused TRT-LLM-Gen kernels take them (flashinfer#2796: a float32 router crashed the FP8 block
runner at its first forward). The contract is read from the installed flashinfer's launcher source; the emulator
refuses what the kernel refuses; the plugin's runner hands the kernel only a dtype it accepts — the logits as they
are (float32 and bfloat16: every pinned flashinfer takes both for every method), an exact widening (float16 ->
float32), or, where no accepted dtype holds them, SGLang's own top-k with the routed kernel — never a lossy cast:
a float32 router keeps the experts it picked (the FP8 per-tensor path used to cast to bfloat16, as SGLang's does).
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest
import torch

from sglang_trtllm_moe import emulator, kernel_api
from sglang_trtllm_moe.emulator import common
from sglang_trtllm_moe.sandbox import layers as cpu_layers

from .support import emulator_cases, sglang_runtime

BOTH = ("float32", "bfloat16")


def _launcher_source() -> str:
    spec = importlib.util.find_spec("flashinfer")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("flashinfer-python is not installed in this environment (no launcher source to read)")
    path = Path(next(iter(spec.submodule_search_locations))) / "data/csrc/trtllm_fused_moe_kernel_launcher.cu"
    if not path.exists():
        pytest.skip(f"this flashinfer wheel ships no launcher source ({path})")
    return path.read_text()


def test_the_contract_is_the_installed_flashinfers():
    """Every entry point's launcher takes float32 or bfloat16 logits (`check_routing_logits`), and the only
    single-dtype checks are for routing weights applied on the input (Llama4 on the per-channel launcher), which the
    plugin never asks for: kernel_api.routing_logits_dtypes says both, for every family and method."""
    from sglang_trtllm_moe.selection import flashinfer_version

    src = _launcher_source()
    assert re.search(
        r"routing_logits\.value\(\)\.dtype\(\) == dl_float32 \|\|\s*routing_logits\.value\(\)\.dtype\(\) == "
        r"dl_bfloat16\)\s*<< \"routing_logits must be float or bfloat16\.\"",
        src,
    ), "flashinfer's generic routing_logits dtype check moved or changed"
    single = list(re.finditer(r"TVM_FFI_ICHECK_EQ\(routing_logits(?:\.value\(\))?\.dtype\(\), dl_\w+\)", src))
    for m in single:
        guard = src[max(0, m.start() - 200) : m.start()]
        assert "mUseRoutingScalesOnInput" in guard, src[m.start() - 300 : m.end() + 100]
    version = flashinfer_version()
    for family in kernel_api.FAMILIES:
        for method in kernel_api.RoutingMethodType:
            assert kernel_api.routing_logits_dtypes(version, family, int(method)) == BOTH, (version, family, method)


def test_the_contract_before_flashinfer_0_6_8_and_the_exact_casts():
    """flashinfer < 0.6.8 (before flashinfer#2534; older than every pin): the FP8 launchers wanted float32 for
    DeepSeekV3 and bfloat16 for the rest, FP4 float32 for DeepSeekV3. A cast is only ever a widening that keeps
    every value; float32 logits where only bfloat16 is taken are not cast (SGLang's top-k routes them)."""
    ds, rn = int(kernel_api.RoutingMethodType.DeepSeekV3), int(kernel_api.RoutingMethodType.Renormalize)
    old = "0.6.7"
    assert kernel_api.routing_logits_dtypes(old, "fp8_block_scale", ds) == ("float32",)
    assert kernel_api.routing_logits_dtypes(old, "fp8_per_tensor_scale", rn) == ("bfloat16",)
    assert kernel_api.routing_logits_dtypes(old, "fp4_block_scale", ds) == ("float32",)
    assert kernel_api.routing_logits_dtypes(old, "fp4_block_scale", rn) == BOTH
    assert kernel_api.routing_logits_dtypes(old, "bf16", ds) == BOTH
    assert kernel_api.routing_logits_dtypes("0.6.8.post1", "fp8_block_scale", rn) == BOTH
    assert kernel_api.routing_logits_dtypes(None, "fp8_block_scale", rn) == BOTH
    pick = kernel_api.routing_logits_dtype
    assert pick("float32", BOTH) == "float32" and pick("bfloat16", BOTH) == "bfloat16"
    assert pick("float16", BOTH) == "float32" and pick("bfloat16", ("float32",)) == "float32"
    assert pick("float32", ("bfloat16",)) is None and pick("float64", BOTH) is None


@pytest.mark.parametrize("variant", ["nvfp4-swiglu", "fp8_block-deepseek-majork", "fp8_tensor-swiglu", "bf16-swiglu"])
def test_the_emulator_refuses_what_the_kernel_refuses(variant):
    family, args = emulator_cases.case(variant, 4)
    fn = emulator_cases.entry_point(family, False)
    outs = {}
    for dtype in (torch.float32, torch.bfloat16):
        a = dict(args, routing_logits=args["routing_logits"].to(torch.bfloat16).to(dtype))
        outs[dtype] = fn(**a)
    for dtype in (torch.float16, torch.float64):
        with pytest.raises(ValueError, match="routing_logits must be float or bfloat16"):
            fn(**dict(args, routing_logits=args["routing_logits"].to(dtype)))
    bias = torch.zeros(emulator_cases.E, dtype=torch.float16)
    with pytest.raises(ValueError, match="routing_bias must be bfloat16 or float"):
        fn(**dict(args, routing_bias=bias))


# ---- the runner, on real SGLang layers --------------------------------------------------------------------------

KINDS = ["nvfp4", "fp8_modelopt", "bf16"]


@pytest.fixture(scope="module", autouse=True)
def runtime():
    sglang_runtime.ensure("flashinfer_trtllm")


@pytest.fixture
def spy(monkeypatch):
    """What the emulated kernel routed: the logits' dtype and the experts, per call; and every entry point called."""
    seen: dict = {"route": [], "calls": []}
    real_route = common.route

    def route(method, logits, top_k, **kw):
        ids, w = real_route(method, logits, top_k, **kw)
        seen["route"].append((logits.dtype, ids.clone()))
        return ids, w

    monkeypatch.setattr(common, "route", route)
    for name in kernel_api.KERNEL_FUNCTIONS:
        real = getattr(emulator, name)

        def wrapped(*a, _real=real, _name=name, **kw):
            seen["calls"].append((_name, kw.get("use_routing_scales_on_input")))
            return _real(*a, **kw)

        monkeypatch.setattr(emulator, name, wrapped)
    return seen


def _layer(kind: str, monkeypatch):
    """A prepared layer declaring Renormalize routing (as Qwen3-MoE's does), so SGLang's TopK leaves the routing to
    the fused kernel."""
    from sglang.srt.layers.moe.utils import RoutingMethodType

    monkeypatch.setenv("SGLANG_TRTLLM_MOE_EMULATE", "1")
    spec = cpu_layers.MoeSpec(fmt=kind)
    layer = cpu_layers.build_layer(spec, routing_method_type=RoutingMethodType.Renormalize)
    cpu_layers.load_checkpoint(layer, cpu_layers.random_checkpoint(spec, 0), spec.num_experts)
    layer.quant_method.process_weights_after_loading(layer)
    return spec, layer


def _near_ties(tokens: int, experts: int) -> torch.Tensor:
    """float32 logits whose experts differ below bfloat16's resolution: a bfloat16 cast ties them all (the kernel
    then takes the lowest indices), float32 keeps their order (the highest indices win)."""
    base = torch.linspace(-0.5, 0.5, tokens).unsqueeze(1).to(torch.bfloat16).float()
    return base + torch.arange(experts, dtype=torch.float32) * 2.0**-12


@pytest.mark.parametrize("kind", KINDS)
def test_float32_logits_route_as_float32(kind, monkeypatch, spy):
    spec, layer = _layer(kind, monkeypatch)
    x = torch.randn(5, spec.hidden, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    logits = _near_ties(5, spec.num_experts)
    sglang_runtime.forward(layer, x, logits, bypass=True)
    (dtype, ids), *_ = spy["route"]
    assert dtype == torch.float32, dtype
    top = set(range(spec.num_experts - spec.top_k, spec.num_experts))
    assert all(set(row) == top for row in ids.tolist()), ids  # a bfloat16 cast would give experts {0, 1}
    assert all(flag in (None, False) for _, flag in spy["calls"]), spy["calls"]


@pytest.mark.parametrize("kind", KINDS)
def test_float16_logits_are_widened_exactly_and_others_routed_by_sglang(kind, monkeypatch, spy):
    spec, layer = _layer(kind, monkeypatch)
    g = torch.Generator().manual_seed(2)
    x = torch.randn(6, spec.hidden, generator=g).to(torch.bfloat16)
    logits = torch.randn(6, spec.num_experts, generator=g).to(torch.float16).float()  # fp16-exact values
    want, _ = sglang_runtime.forward(layer, x, logits, bypass=True)
    got, _ = sglang_runtime.forward(layer, x, logits.half(), bypass=True)
    assert spy["route"][-1][0] == torch.float32 and torch.equal(spy["route"][-1][1], spy["route"][0][1])
    assert torch.equal(got, want)
    # float64: no dtype the kernel takes holds it exactly, so SGLang's own top-k routes and the routed kernel runs
    spy["calls"].clear()
    out64, _ = sglang_runtime.forward(layer, x, logits.double(), bypass=True)
    assert [name for name, _ in spy["calls"]] == [kernel_api.kernel_function(layer_kind_family(layer), True)]
    assert (out64.float() - want.float()).norm() / want.float().norm() < 0.02

    # the check can fail: without the runner's widening, the emulator refuses float16 as the kernel would
    monkeypatch.setattr(kernel_api, "routing_logits_dtype", lambda dtype, accepted: dtype)
    with pytest.raises(ValueError, match="routing_logits must be float or bfloat16"):
        sglang_runtime.forward(layer, x, logits.half(), bypass=True)


def layer_kind_family(layer) -> str:
    from sglang_trtllm_moe import layer_state

    st = layer_state.state_of(layer)
    return (st.fmt if st is not None else layer_state.observed(layer)).kernel
