"""The sandbox switched on for a whole process: SGLang sees an SM100 GPU and gets the CPU stand-ins (standins.py).

`activate_from_env()` is what the sandbox's extension (`extension.py`, registered in the plugin's own entry-point
group like any extension) runs in every process SGLang starts — through the plugin's `register()`, which SGLang's
`load_plugins()` calls first — when both test-only switches are set (SGLANG_TRTLLM_MOE_EMULATE=1 with
SGLANG_TRTLLM_MOE_TEST_FAKE_SM=100), and only then: without them nothing here runs, and importing this module imports
neither torch nor SGLang. So a plain `python -m sglang.launch_server --device cpu ...` or
`sglang.Engine(device="cpu", ...)` serves through the plugin's path — auto-selection on the faked SM100, in-place
preparation, the emulated kernels — in its launcher, scheduler and detokenizer alike, with nothing on PYTHONPATH.

On a real GPU below SM100 (the lent H200) faking one, `below_sm100()` stands in for the two pieces that ask the real
GPU a question only an SM100 answers (docs/TESTING.md's stand-in table). Nothing here runs on a Blackwell GPU or
without the test-only switches.
"""

from __future__ import annotations

import os

from .. import env
from .switches import ENV_FAKE_SM

#: what the sandbox fakes for a whole process before 0.5.19 (a B200, without faking its device capability)
B200_PROBES = {
    "is_sm100_supported": True,
    "is_blackwell_supported": True,
    "is_blackwell": True,
    "is_sm90_supported": False,
    "is_sm120_supported": False,
}


def fake_blackwell() -> None:
    """For the rest of the process, SGLang sees a Blackwell (SM100) GPU (the sandbox's processes); the platform is
    faked the way compat/fake_platform.py fakes one for a block (`explain --sm`), per release."""
    from ..compat import fake_platform, features

    if features.PLATFORM_OVERRIDE.present():
        from sglang.srt.runtime_context import override_platform

        override_platform(is_blackwell=True, is_sm100=True).install()
        return
    # the modules whose import-time platform checks matter, loaded before the facts are rebound
    import sglang.srt.layers.moe.fused_moe_triton.layer  # noqa: F401
    import sglang.srt.layers.quantization.fp8  # noqa: F401  (0.5.14: flashinfer_trtllm is circular alone)
    import sglang.srt.layers.quantization.modelopt_quant  # noqa: F401

    fake_platform.rebind(*fake_platform.legacy_tables(B200_PROBES))


def below_sm100() -> list[str]:
    """On a real GPU below SM100 faking one: flashinfer's FP4 quantizer does not run there (nvfp4_quantizer.py), and
    the model loader's "is this GPU new enough for the quantization" (nvfp4_online asks for 100) reads the real
    device capability by its own name (`loader.get_device_capability`, which the faked platform leaves real so the
    kernels' own choices stay the H200's): it gets the faked SM100's."""
    import torch

    if not torch.cuda.is_available() or torch.cuda.get_device_capability() >= (10, 0):
        return []
    from .nvfp4_quantizer import route_flashinfer_quantizer

    done = ["flashinfer.nvfp4_quantize below SM100"] if route_flashinfer_quantizer(cuda=True) else []
    from sglang.srt.model_loader import loader

    if callable(getattr(loader, "get_device_capability", None)):
        loader.get_device_capability = lambda *args, **kwargs: (10, 0)
        done.append("the model loader's capability check sees SM100")
    return done


def requested_sm() -> int | None:
    """The SM the sandbox fakes when both test-only switches are set (SGLANG_TRTLLM_MOE_EMULATE=1 and
    SGLANG_TRTLLM_MOE_TEST_FAKE_SM), else None. Raises ValueError for an SM the sandbox cannot fake."""
    raw = os.environ.get(ENV_FAKE_SM, "").strip()
    if not raw:
        return None
    if not env.emulating():
        return None
    try:
        sm = int(raw)
    except ValueError:
        sm = -1
    if sm // 10 != 10:
        raise ValueError(
            f"{ENV_FAKE_SM}={raw}: the CPU sandbox fakes an SM100 (B200) only: set {ENV_FAKE_SM}=100, or unset it"
        )
    return sm


def activate(sm: int = 100) -> list[str]:
    """This process as the CPU sandbox needs it: the stand-ins, and SGLang seeing an SM `sm` GPU for the rest of
    the process (the same platform the launcher resolved its ServerArgs for). Returns the stand-ins applied."""
    from .standins import apply

    if sm // 10 != 10:
        raise ValueError(f"the CPU sandbox fakes an SM100 (B200) only, not SM{sm}")
    done = apply() or below_sm100()
    fake_blackwell()
    return done


def activate_from_env() -> str | None:
    """Activate the sandbox when both test-only switches are set. Returns a one-line description of what was done
    (None when SGLANG_TRTLLM_MOE_TEST_FAKE_SM is not set). Raises, saying what to set, when the fake SM is asked
    for without the emulator (a faked SM100 without it would reach the kernels) or is not an SM100."""
    if not os.environ.get(ENV_FAKE_SM, "").strip():
        return None
    sm = requested_sm()
    if sm is None:
        raise RuntimeError(
            f"{ENV_FAKE_SM} is set without SGLANG_TRTLLM_MOE_EMULATE=1: the test-only CPU sandbox is off (a faked "
            "SM100 without the emulator would reach the kernels); set both, or neither"
        )
    done = activate(sm)
    return f"test-only CPU sandbox: SGLang sees an SM{sm} GPU; stand-ins: {', '.join(done) or 'none (CUDA present)'}"


__all__ = [
    "B200_PROBES",
    "ENV_FAKE_SM",
    "activate",
    "activate_from_env",
    "below_sm100",
    "fake_blackwell",
    "requested_sm",
]
