"""The plugin's pure-torch NVFP4 quantizers (quant.py) against flashinfer's on the same CUDA inputs, at a DeepSeek-like
expert weight / hidden-state shape ([256, 7168], bf16): byte for byte (e2m1 codes, e4m3 block scales, per-token fp32
scales), for each flashinfer backend that runs on this GPU ("cuda": TRT-LLM's kernel, JIT-built by flashinfer with
nvcc; "cute-dsl": what SGLang's nvfp4_online loader and trtllm leaf call, with the CuTe DSL). A backend that does not
run here is recorded with its error; the test is skipped, with those errors, when none runs.

Codes and block scales need an SM100+ GPU (Blackwell): flashinfer 0.6.15's FP4 quantization kernels
(`quantize_with_block_size`, nv_internal/tensorrt_llm/kernels/quantization.cuh) have their body under
`__CUDA_ARCH__ >= 1000`, so on the H200 (SM90) the "cuda" backend JIT-builds, launches an empty kernel and returns
unwritten buffers — no error (measured: docs/measurements/gpu-h200-0.5.17-nvfp4-quantizers.json, 99.5% of the bytes
"differ"); cute-dsl is not importable there (no `cutlass`). The per-token FP32 scales come from a kernel built for
SM90+ too: those are compared on the H200.

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
SM100_REASON = (
    "needs an SM100+ GPU (Blackwell): flashinfer's NVFP4 quantization kernels are compiled out below SM100 (on the "
    "H200 its cuda backend returns unwritten buffers, no error)"
)


def _blackwell() -> bool:
    return torch.cuda.get_device_capability() >= (10, 0)


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
    if not _blackwell():
        pytest.skip(SM100_REASON)
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


def test_per_token_scales_equal_flashinfer_on_any_gpu():
    """flashinfer's per-token NVFP4 ("cuda" backend) computes its FP32 per-token scales (row amax * 1 / (448 * 6))
    in a kernel that runs on SM90 as well: byte-equal to quant.nvfp4_quantize_per_token's, the zero row's 0 included.
    (Its codes and block scales are compared by the test above, on SM100+ only.)"""
    x = _input(11)
    _, _, pts = quant.nvfp4_quantize_per_token(x, PER_TOKEN_INV)
    try:
        theirs = _run("cuda", True, x)
        torch.cuda.synchronize()
    except Exception as e:  # noqa: BLE001 - flashinfer's JIT needs nvcc; none here is a skip, not a failure
        pytest.skip(f"needs flashinfer's per-token NVFP4 quantizer built for this GPU (JIT, nvcc): {e}"[:500])
    found = _compare("per_token_scales/cuda", {"per_token_scales": pts}, theirs)
    assert float(pts[3]) == 0.0 and bool((pts[4:] > 0).all())
    assert found["per_token_scales"] == {"bytes": 4 * SHAPE[0], "differing_bytes": 0}, found
