"""The weight checker names a mismatch as the checkpoint does (issue #28, finding 5): for one corrupted element of
`experts.E.<gate_proj|up_proj|down_proj>.weight[row, col]`, both compare modes report that checkpoint tensor, its
expert, row and column — not SGLang's `w13_weight` row in the order SGLang's loader stacks the halves, nor a value
column where the checkpoint stores packed FP4 bytes.

The oracle is SGLang's own loader: the corruption goes through `FusedMoE.weight_loader` into a real layer of each
format (which half of w13 holds gate_proj is SGLang's decision, per format and release); the checker then compares
the clean prepared weights with the corrupted ones, raw and layout-aware.
"""

from __future__ import annotations

import pytest
import torch

from sglang_trtllm_moe import checker, layer_state
from sglang_trtllm_moe.testing import layers as cpu_layers
from sglang_trtllm_moe.testing import mx_layers

from .support import sglang_runtime

GENERATORS = {
    "nvfp4": cpu_layers.random_nvfp4_checkpoint,
    "ct_nvfp4": cpu_layers.random_ct_nvfp4_checkpoint,
    "fp8_modelopt": cpu_layers.random_fp8_checkpoint,
    "fp8_tensor": cpu_layers.random_fp8_checkpoint,
    "fp8_block": cpu_layers.random_fp8_checkpoint,
    "bf16": cpu_layers.random_bf16_checkpoint,
    "mxfp8": mx_layers.random_checkpoint,
}
#: (checkpoint projection, row, col) of the corrupted element: one per projection, rows in both halves' ranges
CORRUPTIONS = (("gate_proj", 5, 3), ("up_proj", 10, 20), ("down_proj", 7, 11))


@pytest.fixture(scope="module", autouse=True)
def runtime():
    sglang_runtime.ensure("flashinfer_trtllm")


@pytest.fixture(autouse=True)
def plugin_prepares(monkeypatch):
    sglang_runtime.plugin_prepares(monkeypatch, "bf16", "fp8_block")


def _corrupt(t: torch.Tensor, r: int, c: int) -> torch.Tensor:
    """One bit of element [r, c] flipped (of the byte [r, c] for 1-byte storage: the low FP4 value of a packed
    byte, i.e. value column 2c)."""
    t = t.clone()
    if t.element_size() == 1:
        t.view(torch.uint8)[r, c] ^= 0x01
    else:
        t.view(torch.int16)[r, c] ^= 0x0100
    return t


@pytest.mark.parametrize("fmt", list(GENERATORS))
@pytest.mark.parametrize("proj,r,c", CORRUPTIONS, ids=[p for p, _, _ in CORRUPTIONS])
def test_a_mismatch_is_named_in_checkpoint_coordinates_in_both_modes(fmt, proj, r, c):
    spec = cpu_layers.MoeSpec(num_experts=4, intermediate=128, fmt=fmt)
    good = GENERATORS[fmt](spec, seed=3)
    e = 2
    key = next(
        (k for k in good if k.startswith(f"experts.{e}.{proj}.weight") and "scale" not in k and good[k].dim() == 2),
        None,
    )
    assert key is not None, sorted(good)[:8]
    bad = _corrupt(good[key], r, c)
    model = cpu_layers.TinyMoeModel(spec)
    model.load_weights(cpu_layers.checkpoint_names(good).items())
    layer = model.experts
    layer.quant_method.process_weights_after_loading(layer)
    st = layer_state.state_of(layer)
    assert st is not None and st.clean, f"{fmt}: the plugin did not take the layer"
    pname = "w2_weight" if proj == "down_proj" else "w13_weight"
    pname = next(p.name for p in st.fmt.params if p.name.startswith(pname) and "scale" not in p.name)
    clean = {n: t.clone() for n, t in checker.live_side(layer, pname).tensors.items()}
    expect = checker.snapshot_side(layer, pname, clean)

    cpu_layers.load_checkpoint(layer, {key: bad}, spec.num_experts)
    layer_state.flush_all()
    actual = checker.live_side(layer, pname)
    suffix = key.split(f"{proj}.", 1)[1]
    want = f"model.layers.0.mlp.experts.{e}.{proj}.{suffix}[{r}, {c}]"
    packed = bad.dtype == torch.uint8 and "fp4" in fmt
    for mode in ("raw", "layout"):
        rep = checker.compare(expect, actual, mode=mode)
        assert not rep.equal and rep.experts == [e], (mode, rep.summary())
        where = rep.first[0].where
        assert where.startswith(want), (fmt, mode, where, rep.summary())
        if packed:  # the flipped bit is the low (even) FP4 value of byte c
            assert f"(packed: value {2 * c})" in where, (mode, where)
        assert want in rep.summary()
