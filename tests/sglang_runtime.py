"""Process-wide set-up for tests that drive real SGLang layers in the pytest process.

SGLang loads plugins and publishes its config once per process; this does both once (SGLang's own
`load_plugins()` runs our `register()` through the entry point, exactly as a server would)."""

from __future__ import annotations


def ensure(backend: str = "flashinfer_trtllm") -> None:
    from sglang.srt.plugins import load_plugins

    from sglang_trtllm_moe.compat.runtime import init_single_process

    load_plugins()
    init_single_process(backend)


def upstream_process_weights_after_loading(method, layer, monkeypatch) -> None:
    """SGLang's own NVFP4 trtllm preparation, as an oracle on CPU.

    The hooked method keeps SGLang's original at `__wrapped__`. Its only CUDA-only step is flashinfer's
    `nvfp4_block_scale_interleave`; it is replaced by SGLang's own pure-torch `swizzle_blockscale` (flattened,
    as flashinfer returns it), which measured-upstream.md found byte-identical.
    """
    import flashinfer
    import torch
    from sglang.srt.layers.quantization.modelopt_quant import ModelOptNvFp4FusedMoEMethod
    from sglang.srt.layers.quantization.utils import swizzle_blockscale

    monkeypatch.setattr(
        flashinfer, "nvfp4_block_scale_interleave",
        lambda x: swizzle_blockscale(x.view(torch.float8_e4m3fn)).view(torch.uint8).reshape(-1),
    )
    original = ModelOptNvFp4FusedMoEMethod.process_weights_after_loading
    while hasattr(original, "__wrapped__"):
        original = original.__wrapped__
    original(method, layer)
