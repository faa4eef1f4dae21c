"""Selection and the layers SGLang builds answer the same: one registry (formats/) decides both.

For every format x activation x gating: what `can_implement` accepts on a faked SM100, a real SGLang FusedMoE of
that shape (explicitly on flashinfer_trtllm) loads, is prepared (by the plugin, or by SGLang where compat/defer.py
says upstream is right) and runs through the emulator; what it refuses names the reason, and the layer refuses too
(a TrtllmLayerError naming the same problem, or SGLang's own refusal) — never "auto-selected here, error at load".
The case that used to disagree: a non-gated relu2 FP8 128x128 block layer (explain picked flashinfer_trtllm, the
load raised; flashinfer's DeepSeekFp8 kernel only implements SwiGLU).
"""

from __future__ import annotations

import pytest
import torch

from sglang_trtllm_moe import TrtllmLayerError, formats, kernel_api, layer_state
from sglang_trtllm_moe.sandbox import layers as cpu_layers
from sglang_trtllm_moe.sandbox.format_examples import example_of
from sglang_trtllm_moe.selection import Code, DeviceInfo, MoeProblem, can_implement

from .support import format_examples, sglang_runtime

#: the CPU harness's layer kinds -> what the checkpoint's config says (as SGLang names it, read by selection from
#: the format's own example) and its maker; every format of the registry that SGLang builds on flashinfer_trtllm
#: (gpt-oss MXFP4 is built on its own backend only: test_registry_completeness NO_TRTLLM_LAYER)
KINDS = {
    example_of(f).kind: (format_examples.checkpoint(f), cpu_layers.LAYERS[example_of(f).kind].checkpoint)
    for f in formats.FORMATS
    if f is not formats.MXFP4_GPTOSS
}
#: every (activation, gated) SGLang can name, plus gated relu2 (never a kernel activation)
ACTIVATIONS = sorted(
    {(a, True) for a in kernel_api.GATED} | {(a, False) for a in kernel_api.NON_GATED} | {("relu2", True)}
)
SM100 = DeviceInfo(sm=100, flashinfer_version="0.7.2", source="test")

CASES = [
    pytest.param(kind, act, gated, id=f"{kind}-{'gated' if gated else 'plain'}-{act}")
    for kind in KINDS
    for act, gated in ACTIVATIONS
]


@pytest.fixture(scope="module", autouse=True)
def runtime():
    sglang_runtime.ensure("flashinfer_trtllm")


@pytest.mark.parametrize("kind,activation,gated", CASES)
def test_what_selection_accepts_a_real_layer_serves(kind, activation, gated, monkeypatch):
    ck, make = KINDS[kind]
    shape = dict(hidden_size=256, intermediate_size=128, num_experts=4, top_k=2)
    problem = MoeProblem(**shape, activation=activation, gated=gated, checkpoint=ck)
    verdict = can_implement("flashinfer_trtllm", problem, SM100)
    spec = cpu_layers.MoeSpec(num_experts=4, hidden=256, intermediate=128, activation=activation, gated=gated, fmt=kind)

    def build_and_prepare():
        layer = cpu_layers.build_layer(spec)
        cpu_layers.load_checkpoint(layer, make(spec, seed=0), spec.num_experts)
        layer.quant_method.process_weights_after_loading(layer)
        return layer

    if not verdict.eligible:
        assert verdict.code != Code.OK and verdict.reason, verdict
        try:
            layer = build_and_prepare()
        except TrtllmLayerError as e:  # the plugin's refusal says the same thing selection said
            if verdict.code == Code.ACTIVATION_UNSUPPORTED:
                assert repr(activation) in str(e) and ("non-gated" in str(e)) != gated, (str(e), verdict.reason)
            return
        except Exception as e:  # noqa: BLE001 - SGLang's own refusal (its layer or quant method rejects the shape)
            assert "sglang" in type(e).__module__ or type(e).__module__ == "builtins", (type(e), e)
            return
        pytest.fail(
            f"selection refuses ({verdict.code}: {verdict.reason}) but the layer was prepared: "
            f"managed={layer_state.state_of(layer) is not None}, observed={layer_state.observed(layer)}"
        )

    layer = build_and_prepare()
    assert layer_state.state_of(layer) is not None or layer_state.observed(layer) is not None, (
        "an eligible layer must be prepared by the plugin, or left to SGLang where it is right (and watched)"
    )
    monkeypatch.setenv("SGLANG_TRTLLM_MOE_EMULATE", "1")
    g = torch.Generator().manual_seed(0)
    x = torch.randn(8, spec.hidden, generator=g).to(torch.bfloat16)
    logits = torch.randn(8, spec.num_experts, generator=g)
    out, _ = sglang_runtime.forward(layer, x, logits, bypass=kind == "fp8_modelopt")
    assert out.shape == x.shape and bool(torch.isfinite(out.float()).all()) and float(out.float().abs().sum()) > 0
