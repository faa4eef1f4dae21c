"""The test-only sandbox on a real GPU below SM100 (the lent H200) that fakes an SM100 for the plugin's path
(SGLANG_TRTLLM_MOE_EMULATE=1 with SGLANG_TRTLLM_MOE_TEST_FAKE_SM=100, `cpu_sandbox.activate`): the two pieces that
ask the real GPU a question only an SM100 answers, each listed in docs/TESTING.md's stand-in table. Nothing here
runs on a Blackwell GPU or without the test-only switches."""

from __future__ import annotations


def below_sm100() -> list[str]:
    """On a real GPU below SM100 faking one: flashinfer's FP4 quantizer does not run there (cpu_nvfp4.py), and the
    model loader's "is this GPU new enough for the quantization" (nvfp4_online asks for 100) reads the real device
    capability by its own name (`loader.get_device_capability`, which the faked platform leaves real so the kernels'
    own choices stay the H200's): it gets the faked SM100's."""
    import torch

    if not torch.cuda.is_available() or torch.cuda.get_device_capability() >= (10, 0):
        return []
    from .cpu_nvfp4 import route_flashinfer_quantizer

    done = ["flashinfer.nvfp4_quantize below SM100"] if route_flashinfer_quantizer(cuda=True) else []
    from sglang.srt.model_loader import loader

    if callable(getattr(loader, "get_device_capability", None)):
        loader.get_device_capability = lambda *args, **kwargs: (10, 0)
        done.append("the model loader's capability check sees SM100")
    return done


__all__ = ["below_sm100"]
