"""The one-pass Triton layouts on CUDA give the bytes of the pure-torch reference, in place.

Runs where a CUDA GPU and triton exist (the lent H200: `python -m pytest tests/test_layouts_cuda.py`); skipped
elsewhere with the missing piece named. Imports neither SGLang nor flashinfer, so it runs on a bare torch machine.
The reference itself is checked against flashinfer and SGLang in tests/test_layouts.py.
"""

import importlib.util
from types import SimpleNamespace

import pytest
import torch

from sglang_trtllm_moe import layouts as L
from sglang_trtllm_moe.formats.nvfp4 import NVFP4

if not torch.cuda.is_available():
    pytest.skip(
        "needs a CUDA GPU (the Triton layout kernels run on CUDA): no CUDA device on this machine",
        allow_module_level=True,
    )
if importlib.util.find_spec("triton") is None:
    pytest.skip("needs triton (the layout kernels are Triton kernels): not installed", allow_module_level=True)

from sglang_trtllm_moe.layouts import _triton as T  # noqa: E402

DEV = torch.device("cuda")


def _rand(shape, seed, hi=256):
    g = torch.Generator(device="cpu").manual_seed(seed)
    return torch.randint(0, hi, shape, dtype=torch.uint8, generator=g).to(DEV)


def _ref(fn, *args, **kw):
    old = L.set_fast_path(False)
    try:
        return fn(*args, **kw)
    finally:
        L.set_fast_path(old)


@pytest.fixture(
    params=[
        {},  # the defaults
        dict(rows_tile_words=2048, rows_slice_words=16, sf_cols=8),  # more programs per set (G up to 64 / 448)
        dict(rows_tile_words=16384, rows_slice_words=4),  # one program holds a whole gated expert column slice (G = 1)
        dict(programs_per_sm=2, num_warps=8),  # persistent grid: programs loop over tickets
        dict(tickets=False),  # (set, part) from the program id
        dict(sf_tiles=2, rows_tile_words=4096, rows_slice_words=32),  # scale programs of two 128-row tiles
        dict(sf_tiles=4, sf_cols=32, programs_per_sm=1),
    ]
)
def config(request):
    saved = dict(T.CONFIG)
    T.CONFIG.update(request.param)
    yield request.param
    T.CONFIG.clear()
    T.CONFIG.update(saved)


ROW_CASES = [  # (E, M, row bytes, map): closed blocks 32 (w2), M (gated w13, power of two or not), 32 (relu2 w13)
    (3, 256, 1024, lambda m: L.w2_row_map(m)),
    (4, 512, 3584, lambda m: L.w13_row_map(m, True)),
    (3, 384, 448, lambda m: L.w13_row_map(m, True)),
    (2, 192, 96, lambda m: L.w13_row_map(m, True)),
    (3, 256, 40, lambda m: L.w13_row_map(m, False)),
]


@pytest.mark.parametrize("e,m,c,mk", ROW_CASES)
@pytest.mark.parametrize("experts", [None, "first and last", [1]])
def test_rows_fast_equals_reference(config, e, m, c, mk, experts):
    if experts == "first and last":
        experts = [e - 1, 0]
    assert L.fast_path_for(torch.empty((1, 32, 4), dtype=torch.uint8, device=DEV)) is T
    x = _rand((e, m, c), seed=e * m + c)
    rmap = mk(m)
    want = x.clone()
    _ref(L.permute_rows_, want, rmap, experts)
    got = x.clone()
    ptr = got.data_ptr()
    L.permute_rows_(got, rmap, experts)
    assert got.data_ptr() == ptr and torch.equal(got, want)
    L.unpermute_rows_(got, rmap, experts)
    assert torch.equal(got, x)


SF_CASES = [  # (E, M, C scale bytes, map or None)
    (3, 256, 128, lambda m: L.w2_row_map(m)),
    (2, 512, 448, lambda m: L.w13_row_map(m, True)),
    (3, 384, 24, lambda m: L.w13_row_map(m, True)),
    (2, 256, 12, lambda m: L.w13_row_map(m, False)),
    (2, 256, 448, None),
    (2, 128, 4, None),
]


@pytest.mark.parametrize("e,m,c,mk", SF_CASES)
@pytest.mark.parametrize("experts", [None, [1]])
def test_scales_fast_equals_reference(config, e, m, c, mk, experts):
    x = _rand((e, m, c), seed=m + c, hi=0x7F).view(torch.float8_e4m3fn)
    rmap = mk(m) if mk is not None else None
    step = L.swizzle_sf_128x4_ if rmap is None else (lambda t, ex: L.permute_rows_and_swizzle_sf_(t, rmap, ex))
    undo = L.unswizzle_sf_128x4_ if rmap is None else (lambda t, ex: L.unswizzle_sf_and_unpermute_rows_(t, rmap, ex))
    want = x.clone()
    _ref(step, want, experts)
    got = x.clone()
    ptr = got.data_ptr()
    step(got, experts)
    assert got.data_ptr() == ptr and torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    flat = x[0].view(torch.int32).flatten()[L.composed_sf_map(rmap, m, c, device=DEV)]
    if experts is None:  # the composed map the kernel applies, as one torch gather
        assert torch.equal(flat.view(torch.uint8).view(m, c), got[0].view(torch.uint8))
    undo(got, experts)
    assert torch.equal(got.view(torch.uint8), x.view(torch.uint8))


@pytest.mark.parametrize("gated", [True, False])
def test_nvfp4_layer_cuda_equals_cpu(gated):
    e, h, i = 4, 512, 256
    m13 = (2 if gated else 1) * i

    def layer(device):
        return SimpleNamespace(
            moe_runner_config=SimpleNamespace(is_gated=gated, activation="silu"),
            w13_weight=_rand((e, m13, h // 2), 1).to(device),
            w2_weight=_rand((e, h, i // 2), 2).to(device),
            w13_weight_scale=_rand((e, m13, h // 16), 3, 0x7F).view(torch.float8_e4m3fn).to(device),
            w2_weight_scale=_rand((e, h, i // 16), 4, 0x7F).view(torch.float8_e4m3fn).to(device),
        )

    names = ("w13_weight", "w13_weight_scale", "w2_weight", "w2_weight_scale")
    cpu, gpu = layer("cpu"), layer(DEV)
    ptrs = [getattr(gpu, n).data_ptr() for n in names]
    for g in ("w13", "w2"):
        NVFP4.prepare_(cpu, g, [0, 1, 2, 3])
        NVFP4.prepare_(gpu, g, [1, 3])
        NVFP4.prepare_(gpu, g, [0, 2])
    for n in names:
        assert torch.equal(getattr(cpu, n).view(torch.uint8), getattr(gpu, n).view(torch.uint8).cpu()), n
    assert [getattr(gpu, n).data_ptr() for n in names] == ptrs
    for g in ("w13", "w2"):
        NVFP4.unprepare_(gpu, g, [0, 1, 2, 3])
    fresh = layer(DEV)
    for n in names:
        assert torch.equal(getattr(gpu, n).view(torch.uint8), getattr(fresh, n).view(torch.uint8)), n


@pytest.mark.parametrize("e,m,c,mk", [(2, 512, 224, lambda m: L.w13_row_map(m, True)), (3, 7168, 8, L.w2_row_map)])
@pytest.mark.parametrize("experts", [None, [1]])
def test_bf16_scales_fast_equals_reference(config, e, m, c, mk, experts):
    """INT4's bf16 block scales (Kimi-K2 at TP 8: w13 [512, 224], w2 [7168, 8]) move as int64 words of 4 scales."""
    x = _rand((e, m, 2 * c), seed=m + c).view(torch.bfloat16)
    rmap = mk(m)
    want = x.clone()
    _ref(L.permute_rows_and_swizzle_sf_, want, rmap, experts)
    got = x.clone()
    ptr = got.data_ptr()
    L.permute_rows_and_swizzle_sf_(got, rmap, experts)
    assert got.data_ptr() == ptr and torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    L.unswizzle_sf_and_unpermute_rows_(got, rmap, experts)
    assert torch.equal(got.view(torch.uint8), x.view(torch.uint8))


def test_int4_layer_cuda_equals_cpu():
    """The INT4 format's prep (weights: rows + sign flip + block-major K, the torch path; scales: the Triton one) on
    CUDA, per expert subsets, gives the CPU bytes; storage kept; the inverse restores the checkpoint words."""
    from sglang_trtllm_moe.formats.ct_int4 import CT_INT4

    e, h, i = 4, 512, 256

    def layer(device):
        return SimpleNamespace(
            moe_runner_config=SimpleNamespace(is_gated=True, activation="silu"),
            w13_weight_packed=_rand((e, 2 * i, h // 2), 1).view(torch.int32).to(device),
            w2_weight_packed=_rand((e, h, i // 2), 2).view(torch.int32).to(device),
            w13_weight_scale=_rand((e, 2 * i, h // 16), 3).view(torch.bfloat16).to(device),
            w2_weight_scale=_rand((e, h, i // 16), 4).view(torch.bfloat16).to(device),
        )

    names = ("w13_weight_packed", "w13_weight_scale", "w2_weight_packed", "w2_weight_scale")
    cpu, gpu = layer("cpu"), layer(DEV)
    ptrs = [getattr(gpu, n).data_ptr() for n in names]
    for g in ("w13", "w2"):
        CT_INT4.prepare_(cpu, g, [0, 1, 2, 3])
        CT_INT4.prepare_(gpu, g, [1, 3])
        CT_INT4.prepare_(gpu, g, [0, 2])
    for n in names:
        assert torch.equal(getattr(cpu, n).view(torch.uint8), getattr(gpu, n).view(torch.uint8).cpu()), n
    assert [getattr(gpu, n).data_ptr() for n in names] == ptrs
    for g in ("w13", "w2"):
        CT_INT4.unprepare_(gpu, g, [0, 1, 2, 3])
    fresh = layer(DEV)
    for n in names:
        assert torch.equal(getattr(gpu, n).view(torch.uint8), getattr(fresh, n).view(torch.uint8)), n
