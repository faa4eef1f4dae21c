"""flashinfer's NVFP4 quantizer on a CPU tensor: the CPU sandbox's stand-in for `flashinfer.nvfp4_quantize`.

Why: `--quantization nvfp4_online` makes SGLang quantize every BF16 expert as it loads (`nvfp4_online.py`
`_quantize_weight_nvfp4`: a function-local `from flashinfer import nvfp4_quantize`, every backend of which moves the
input to CUDA). The plugin's pure-torch quantizers (`quant.py`, a leaf) compute the same bytes for what SGLang asks
of it — linear scales, no shuffle, 16-element blocks; per token (`per_token_activation=True`), the plain recipe, or
the 4over6 recipe (MSE or MAE, e4m3 max 448, exact math under FLASHINFER_DISABLE_FP4_QUANT_FAST_MATH=1) — and
anything else raises NotImplementedError instead of computing something else. One function, used two ways: the
layer harness patches it in around a load (`layers.py` `online_quantizer`), and the CPU sandbox installs it
process-wide (`standins.flashinfer_nvfp4_quantize_on_cpu`) so whole models, `sglang.Engine` and the HTTP server
serve `nvfp4_online` on a CPU. The test-only sandbox on a real GPU below SM100 (the lent H200, faking an SM100) routes
CUDA tensors here too (`route_flashinfer_quantizer(cuda=True)`, `activation.below_sm100`): flashinfer's FP4 quantization
kernels are compiled for SM100+ only (quantization.cuh: their bodies under `__CUDA_ARCH__ >= 1000`; on SM90 they return
unwritten buffers, docs/measurements/gpu-h200-0.5.17-nvfp4-quantizers.json) and its cute-dsl backend needs the CuTe DSL.
"""

from __future__ import annotations

import os

from .. import quant

#: flashinfer's FLASHINFER_NVFP4_4OVER6* variables, which SGLang 0.5.18 - 0.5.22's model loader sets around an
#: nvfp4_online load (features.NVFP4_ONLINE_LOADER_4OVER6)
ENV_4OVER6 = "FLASHINFER_NVFP4_4OVER6"


def _recipe_from_env():
    if os.environ.get(ENV_4OVER6) != "1":
        return None
    from types import SimpleNamespace

    return SimpleNamespace(
        e4m3_max=256 if os.environ.get(f"{ENV_4OVER6}_E4M3_USE_256") == "1" else 448,
        err_mode_name=os.environ.get(f"{ENV_4OVER6}_ERR_MODE", "MAE").upper(),
        err_use_fast_math=os.environ.get(f"{ENV_4OVER6}_ERR_USE_FAST_MATH") == "1",
    )


def torch_nvfp4_quantize(a, a_global_sf, sfLayout=None, do_shuffle=False, sf_vec_size=16, *args, **kwargs):
    """flashinfer.nvfp4_quantize by the plugin's pure-torch quantizers, on the input's device (module doc).
    Returns what flashinfer returns: (uint8 [M, K/2], uint8 [M, K/16]) [, per-token float32 [M]]."""
    import torch
    from flashinfer import SfLayout

    per_token = kwargs.pop("per_token_activation", False)
    recipe = kwargs.pop("nvfp4_4over6", "env")
    kwargs.pop("backend", None)
    kwargs.pop("enable_pdl", None)
    extra = {k: v for k, v in kwargs.items() if v is not None}
    if args or extra or do_shuffle or sf_vec_size != 16 or sfLayout != SfLayout.layout_linear:
        raise NotImplementedError(f"the CPU nvfp4_quantize stand-in: {sfLayout}, shuffle {do_shuffle}, {extra}")
    if recipe == "env":
        recipe = _recipe_from_env()
    gs = a_global_sf.float().reshape(()) if isinstance(a_global_sf, torch.Tensor) else float(a_global_sf)
    if per_token:
        if recipe is not None:
            raise NotImplementedError(f"per-token NVFP4 with the 4over6 recipe {recipe}")
        q, sf, pts = quant.nvfp4_quantize_per_token(a, gs)
        return q, sf.view(torch.uint8), pts
    if recipe is None:
        q, sf = quant.nvfp4_quantize(a, gs)
    else:
        exact = os.environ.get("FLASHINFER_DISABLE_FP4_QUANT_FAST_MATH") == "1"
        if recipe.e4m3_max != 448 or not recipe.err_use_fast_math or not exact:
            raise NotImplementedError(f"NVFP4 4over6 recipe {recipe} (exact math: {exact})")
        q, sf = quant.nvfp4_quantize_4over6(a, gs, recipe.err_mode_name)
    return q, sf.view(torch.uint8)


def route_flashinfer_quantizer(cuda: bool) -> bool:
    """Make `flashinfer.nvfp4_quantize` (read by SGLang's online loader at each call) use `torch_nvfp4_quantize` for
    CPU tensors and, with `cuda`, for CUDA tensors as well; flashinfer's own serves the rest. Idempotent; False
    where flashinfer is not importable (nothing to stand in for) or has no nvfp4_quantize."""
    try:
        import flashinfer
    except Exception:  # noqa: BLE001 - flashinfer's import fails on CPU for some pins
        return False
    real = getattr(flashinfer, "nvfp4_quantize", None)
    if real is None:
        return False
    if getattr(real, "_trtllm_moe_standin", False):
        if not cuda or real._trtllm_moe_cuda:
            return True
        real = real.__wrapped__

    def nvfp4_quantize(a, *args, **kwargs):
        if a.is_cuda and not cuda:
            return real(a, *args, **kwargs)
        return torch_nvfp4_quantize(a, *args, **kwargs)

    vars(nvfp4_quantize).update(_trtllm_moe_standin=True, _trtllm_moe_cuda=cuda, __wrapped__=real)
    flashinfer.nvfp4_quantize = nvfp4_quantize
    return True


__all__ = ["route_flashinfer_quantizer", "torch_nvfp4_quantize"]
