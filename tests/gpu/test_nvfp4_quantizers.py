"""The plugin's pure-torch NVFP4 quantizers (quant.py) against flashinfer's on the same CUDA inputs, at a DeepSeek-like
expert weight / hidden-state shape ([256, 7168], bf16): byte for byte (e2m1 codes, e4m3 block scales, per-token fp32
scales), for each flashinfer backend that runs on this GPU ("cuda": TRT-LLM's kernel, JIT-built by flashinfer with
nvcc; "cute-dsl": what SGLang's nvfp4_online loader and trtllm leaf call, SM100+ with the CuTe DSL). A backend that
does not run here is recorded with its error; the test is skipped, with those errors, when none runs.

What each comparison found is written to $SGLANG_TRTLLM_MOE_GPU_OUT/gpu-nvfp4-quantizers.json before asserting.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from sglang_trtllm_moe import quant

SHAPE = (256, 7168)
PER_TOKEN_INV = 1.0 / (448.0 * 6.0)
RESULTS: dict[str, dict] = {}


def _input(seed: int) -> torch.Tensor:
    """Rows of different magnitudes (1e-3 .. 1e2), one all-zero row, one row with a zero block."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(*SHAPE, generator=g, device="cuda")
    x = x * torch.logspace(-3, 2, SHAPE[0], device="cuda").unsqueeze(1)
    x[3] = 0
    x[7, 32:48] = 0
    return x.to(torch.bfloat16)


def _write():
    out = os.environ.get("SGLANG_TRTLLM_MOE_GPU_OUT")
    if out:
        with open(os.path.join(out, "gpu-nvfp4-quantizers.json"), "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "shape": list(SHAPE), "results": RESULTS}, f, indent=1)


def _compare(name: str, ours: dict[str, torch.Tensor], theirs: dict[str, torch.Tensor]) -> dict:
    """Byte comparison of each output; for e2m1 codes also how far apart differing nibbles decode."""
    found = {}
    for k, a in ours.items():
        b = theirs[k]
        a8 = a.contiguous().view(torch.uint8).reshape(-1)
        b8 = b.contiguous().view(torch.uint8).reshape(-1)
        if a8.numel() != b8.numel():
            found[k] = {"sizes": [a8.numel(), b8.numel()]}
            continue
        found[k] = {"bytes": a8.numel(), "differing_bytes": int((a8 != b8).sum())}
        if k == "codes" and found[k]["differing_bytes"]:
            da = quant.e2m1_to_float(a8).reshape(-1)
            db = quant.e2m1_to_float(b8).reshape(-1)
            found[k]["differing_values"] = int((da != db).sum())
            found[k]["max_value_gap"] = float((da - db).abs().max())
    RESULTS[name] = found
    _write()
    return found


def _run(backend: str, per_token: bool, x: torch.Tensor):
    from flashinfer import SfLayout, nvfp4_quantize

    if per_token:
        inv = torch.full((1,), PER_TOKEN_INV, dtype=torch.float32, device="cuda")
        q, sf, pts = nvfp4_quantize(x, inv, sfLayout=SfLayout.layout_linear, per_token_activation=True, backend=backend)
        return {"codes": q, "block_scales": sf, "per_token_scales": pts.float().reshape(-1)}
    gs = ((448.0 * 6.0) / x.float().abs().amax()).reshape(1)
    q, sf = nvfp4_quantize(x, gs, sfLayout=SfLayout.layout_linear, backend=backend)
    return {"codes": q, "block_scales": sf}


@pytest.mark.parametrize("per_token", [False, True], ids=["per_tensor", "per_token"])
def test_quantizers_equal_flashinfer_byte_for_byte(per_token):
    x = _input(11 if per_token else 5)
    if per_token:
        q, sf, pts = quant.nvfp4_quantize_per_token(x, PER_TOKEN_INV)
        ours = {"codes": q, "block_scales": sf, "per_token_scales": pts}
    else:
        q, sf = quant.nvfp4_quantize(x, (448.0 * 6.0) / x.float().abs().amax())
        ours = {"codes": q, "block_scales": sf}
    kind = "per_token" if per_token else "per_tensor"
    errors, compared = {}, {}
    for backend in ("cuda", "cute-dsl"):
        try:
            theirs = _run(backend, per_token, x)
            torch.cuda.synchronize()
        except Exception as e:  # noqa: BLE001 - a backend that does not run here is recorded, not failed
            errors[backend] = f"{type(e).__name__}: {str(e)[:300]}"
            RESULTS[f"{kind}/{backend}"] = {"error": errors[backend]}
            _write()
            continue
        compared[backend] = _compare(f"{kind}/{backend}", ours, theirs)
    if not compared:
        pytest.skip(f"needs flashinfer's NVFP4 quantizer running on this GPU; none did: {errors}")
    for backend, found in compared.items():
        for k, f in found.items():
            assert f.get("differing_bytes") == 0, f"{kind} {backend} {k}: {f}"
