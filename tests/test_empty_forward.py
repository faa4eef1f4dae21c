"""A MoE forward with 0 tokens returns an empty output, on every format, kernel path and emulator path alike.

SGLang runs 0-token forwards: idle ranks under DP attention / EP (their idle batches), and the HTTP server's warm-up
on a model directory without tokenizer files. The plugin's runner used to reach the format's activation quantizer
with the empty batch (`RuntimeError: cannot reshape tensor of 0 elements into shape [0, -1]` in NVFP4's kernel
arguments), which killed the scheduler. Real SGLang layers of every format, through SGLang's own TopK and FusedMoE
forward; after the empty batch, a real one still runs."""

from __future__ import annotations

import pytest
import torch

from sglang_trtllm_moe import layer_state, runner
from sglang_trtllm_moe.sandbox import layers as cpu_layers

from .support import sglang_runtime

TRTLLM, MXFP4 = "flashinfer_trtllm", "flashinfer_mxfp4"
MAKERS = {
    "nvfp4": cpu_layers.random_nvfp4_checkpoint,
    "ct_nvfp4": cpu_layers.random_ct_nvfp4_checkpoint,
    "fp8_modelopt": cpu_layers.random_fp8_checkpoint,
    "fp8_tensor": cpu_layers.random_fp8_checkpoint,
    "fp8_block": cpu_layers.random_fp8_checkpoint,
    "bf16": cpu_layers.random_bf16_checkpoint,
}
MX_FP4 = pytest.mark.sglang(
    ">=0.5.12", reason="FP4 experts on an FP8 config (Fp8Config.is_fp4_experts) arrive in 0.5.12"
)
CASES = [
    pytest.param(TRTLLM, cpu_layers.MoeSpec(num_experts=4, hidden=128, intermediate=128, fmt=f), id=f) for f in MAKERS
] + [
    pytest.param(
        TRTLLM,
        cpu_layers.MoeSpec(num_experts=4, hidden=128, intermediate=128, fmt="nvfp4", gated=False, activation="relu2"),
        id="nvfp4-relu2",
    ),
    pytest.param(TRTLLM, cpu_layers.MoeSpec(num_experts=4, intermediate=128, fmt="mxfp8"), id="mxfp8"),
    pytest.param(
        MXFP4,
        cpu_layers.MoeSpec(num_experts=4, intermediate=128, fmt="mxfp4_experts"),
        id="mxfp4_experts",
        marks=MX_FP4,
    ),
    pytest.param(
        MXFP4, cpu_layers.MoeSpec(num_experts=4, hidden=256, intermediate=128, fmt="mxfp4_gptoss"), id="mxfp4_gptoss"
    ),
    pytest.param(TRTLLM, cpu_layers.MoeSpec(num_experts=4, hidden=256, fmt="ct_int4"), id="ct_int4"),
]


def _layer(backend, spec):
    sglang_runtime.ensure(backend)
    layer = cpu_layers.build_layer(spec)
    if spec.fmt == "mxfp4_gptoss":
        cpu_layers.load_fused(layer, cpu_layers.random_checkpoint(spec, 0))
    else:
        make = MAKERS.get(spec.fmt) or (lambda s, seed: cpu_layers.random_checkpoint(s, seed))
        cpu_layers.load_checkpoint(layer, make(spec, seed=0), spec.num_experts)
    layer.quant_method.process_weights_after_loading(layer)
    return layer


def _forward(layer, spec, x, logits):
    if spec.fmt == "mxfp4_gptoss":  # gpt-oss routes the bypassed logits in the kernel (what its CUDA TopK returns)
        from sglang.srt.layers.moe.topk import TopK, TopKOutputFormat

        topk = TopK(top_k=2, renormalize=True, layer_id=0, output_format=TopKOutputFormat.BYPASSED)
        return layer(x, topk.forward_cuda(x, logits))
    return sglang_runtime.forward(layer, x, logits, bypass=spec.fmt == "fp8_modelopt")[0]


@pytest.mark.parametrize("backend,spec", CASES)
@pytest.mark.parametrize("emulate", ["1", "0"], ids=["emulator", "kernel-path"])
def test_a_forward_with_no_tokens_returns_an_empty_output(backend, spec, emulate, monkeypatch):
    monkeypatch.setenv("SGLANG_TRTLLM_MOE_EMULATE", emulate)
    layer = _layer(backend, spec)
    assert layer_state.state_of(layer) is not None or layer_state.observed(layer) is not None
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, spec.hidden, generator=g).to(torch.bfloat16)
    logits = torch.randn(4, spec.num_experts, generator=g)
    if emulate == "0" and layer_state.state_of(layer) is None:
        # a layer SGLang prepares itself (compat/defer.py) runs SGLang's own leaf off the emulator, untouched by the
        # plugin's runner (on this CPU box that leaf is SGLang's torch fallback, not a TRT-LLM-Gen path)
        assert runner.format_for("fp8" if "fp8" in spec.fmt else spec.fmt, layer.moe_runner_config) is None
        return
    out = _forward(layer, spec, x[:0], logits[:0])
    assert out.shape == (0, spec.hidden) and out.dtype == x.dtype
    if emulate == "1":  # the layer still serves a real batch afterwards
        out = _forward(layer, spec, x, logits)
        assert out.shape == x.shape and bool(torch.isfinite(out.float()).all()) and float(out.float().abs().sum()) > 0
