"""Process-wide set-up for tests that drive real SGLang layers in the pytest process.

SGLang loads plugins and publishes its config once per process; this does both once (SGLang's own
`load_plugins()` runs our `register()` through the entry point, exactly as a server would)."""

from __future__ import annotations


def ensure(backend: str = "flashinfer_trtllm") -> None:
    from sglang.srt.plugins import load_plugins

    from sglang_trtllm_moe.sandbox.runtime import init_single_process

    load_plugins()
    init_single_process(backend)


def upstream_process_weights_after_loading(method, layer, monkeypatch) -> None:
    """SGLang's own NVFP4 trtllm preparation, as an oracle on CPU.

    The hooked method keeps SGLang's original at `__wrapped__`. Its only CUDA-only step is flashinfer's
    `nvfp4_block_scale_interleave`; it is replaced by SGLang's own pure-torch `swizzle_blockscale` (flattened,
    as flashinfer returns it), byte-identical to it (tests/test_layouts.py checks the swizzle against SGLang's).
    """
    import flashinfer
    import torch
    from sglang.srt.layers.quantization.modelopt_quant import ModelOptNvFp4FusedMoEMethod
    from sglang.srt.layers.quantization.utils import swizzle_blockscale

    monkeypatch.setattr(
        flashinfer,
        "nvfp4_block_scale_interleave",
        lambda x: swizzle_blockscale(x.view(torch.float8_e4m3fn)).view(torch.uint8).reshape(-1),
    )
    original = ModelOptNvFp4FusedMoEMethod.process_weights_after_loading
    while hasattr(original, "__wrapped__"):
        original = original.__wrapped__
    original(method, layer)


_CONFIG_DIRS: dict = {}


def write_safetensors_checkpoint(path, tensors, spec) -> None:
    """A model directory SGLang's update_weights_from_disk can read: config.json + model.safetensors of a
    TinyMoeModel (`tensors` below the MoE block, as sandbox.layers' random checkpoints name them)."""
    import json
    import os

    from safetensors.torch import save_file

    from sglang_trtllm_moe.sandbox import layers as cpu_layers

    os.makedirs(path, exist_ok=True)
    save_file(
        {k: v.contiguous() for k, v in cpu_layers.checkpoint_names(tensors).items()},
        os.path.join(path, "model.safetensors"),
    )
    cfg = {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        "hidden_size": spec.hidden,
        "moe_intermediate_size": spec.intermediate,
        "intermediate_size": 4 * spec.hidden,
        "n_routed_experts": spec.num_experts,
        "num_experts_per_tok": spec.top_k,
        "num_hidden_layers": 1,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "vocab_size": 256,
        "torch_dtype": "bfloat16",
        "quantization_config": {"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16},
    }
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)


def updater(model, path=None):
    """The object that owns SGLang's weight-update entry points on this release (WeightUpdater, or ModelRunner
    before 0.5.16) around `model`. ModelConfig needs a config.json and must not reach a hub; update_weights_from_tensor
    never reads the directory, so one per format is written once."""
    import tempfile

    from sglang.srt.configs.model_config import ModelConfig

    from sglang_trtllm_moe.sandbox.runtime import weight_updater

    if path is None:
        fmt = model.spec.fmt
        if fmt not in _CONFIG_DIRS:
            _CONFIG_DIRS[fmt] = tempfile.mkdtemp(prefix=f"trtllm-moe-cfg-{fmt}-")
            write_safetensors_checkpoint(_CONFIG_DIRS[fmt], {}, model.spec)
        path = _CONFIG_DIRS[fmt]
    return weight_updater(model, ModelConfig(model_path=path))


def prepared_model(spec, tensors):
    """A TinyMoeModel loaded with `tensors` through SGLang's loader and prepared, as after a server's model load."""
    from sglang_trtllm_moe.sandbox import layers as cpu_layers

    model = cpu_layers.TinyMoeModel(spec)
    model.load_weights(cpu_layers.checkpoint_names(tensors).items())
    model.experts.quant_method.process_weights_after_loading(model.experts)
    return model


def forward(layer, x, logits, bypass: bool = False):
    """A forward through SGLang's own TopK (softmax, renormalize) and FusedMoE layer; returns (output, topk).

    `bypass`: routing in the kernel from the logits (the only routing ModelOptFp8MoEMethod's trtllm apply accepts).
    SGLang builds the bypassed output in TopK.forward_cuda (a CPU box dispatches TopK to forward_native, which always
    materializes); on CPU tensors it is the same code a Blackwell server runs."""
    from sglang.srt.layers.moe.topk import TopK

    topk = TopK(top_k=2, renormalize=True, layer_id=0)
    if not bypass:
        out = topk(x, logits)
        return layer(x, out), out
    if hasattr(topk, "bind_runner_backend"):  # 0.5.23+; before, forward_cuda reads the global backend
        topk.bind_runner_backend(layer.runner_backend, routing_method_type=layer.routing_method_type)
    out = topk.forward_cuda(x, logits)
    assert type(out).__name__ == "BypassedTopKOutput"
    return layer(x, out), out


def plugin_prepares(monkeypatch, *formats: str) -> None:
    """Make the plugin prepare `formats` even where compat/defer.py leaves them to SGLang (upstream right on this
    release): the plugin's replacement path for those formats — what serves the releases where upstream is wrong —
    stays tested on every release, the newest included. tests/test_defer.py checks the verdicts themselves."""
    from sglang_trtllm_moe.compat import defer

    real = defer.verdict
    monkeypatch.setattr(defer, "verdict", lambda fmt, release=None: None if fmt in formats else real(fmt, release))
