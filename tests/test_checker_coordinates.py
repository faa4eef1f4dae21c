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
from sglang_trtllm_moe.sandbox import layers as cpu_layers

from .support import sglang_runtime

GENERATORS = {
    "nvfp4": cpu_layers.random_nvfp4_checkpoint,
    "ct_nvfp4": cpu_layers.random_ct_nvfp4_checkpoint,
    "fp8_modelopt": cpu_layers.random_fp8_checkpoint,
    "fp8_tensor": cpu_layers.random_fp8_checkpoint,
    "fp8_block": cpu_layers.random_fp8_checkpoint,
    "bf16": cpu_layers.random_bf16_checkpoint,
    "mxfp8": cpu_layers.random_checkpoint,
}
#: (expert, checkpoint projection, row, col) of the corrupted elements: one per projection, each in its own expert
CORRUPTIONS = ((1, "gate_proj", 5, 3), (2, "up_proj", 10, 20), (3, "down_proj", 7, 11))


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


def _weight_key(tensors: dict, e: int, proj: str) -> str:
    return next(k for k in tensors if k.startswith(f"experts.{e}.{proj}.weight") and "scale" not in k)


@pytest.mark.parametrize("fmt", list(GENERATORS))
def test_a_mismatch_is_named_in_checkpoint_coordinates_in_both_modes(fmt):
    spec = cpu_layers.MoeSpec(num_experts=4, intermediate=128, fmt=fmt)
    good = GENERATORS[fmt](spec, seed=3)
    bad = {}
    for e, proj, r, c in CORRUPTIONS:
        key = _weight_key(good, e, proj)
        bad[key] = _corrupt(good[key], r, c)
    model = cpu_layers.TinyMoeModel(spec)
    model.load_weights(cpu_layers.checkpoint_names(good).items())
    layer = model.experts
    layer.quant_method.process_weights_after_loading(layer)
    st = layer_state.state_of(layer)
    assert st is not None and st.clean, f"{fmt}: the plugin did not take the layer"
    weights = {g: next(p.name for p in st.fmt.params if p.group == g and "scale" not in p.name) for g in ("w13", "w2")}
    expect = {}
    for g, pname in weights.items():
        clean = {n: t.clone() for n, t in checker.live_side(layer, pname).tensors.items()}
        expect[g] = checker.snapshot_side(layer, pname, clean)

    cpu_layers.load_checkpoint(layer, bad, spec.num_experts)  # through SGLang's own FusedMoE.weight_loader
    layer_state.flush_all()
    for g, pname in weights.items():
        want = {}
        for e, proj, r, c in CORRUPTIONS:
            if (proj == "down_proj") == (g == "w2"):
                key = _weight_key(good, e, proj)
                want[e] = (f"model.layers.0.mlp.{key}[{r}, {c}]", 2 * c)
        actual = checker.live_side(layer, pname)
        packed = actual.tensors[pname].dtype == torch.uint8 and "fp4" in fmt
        for mode in ("raw", "layout"):
            rep = checker.compare(expect[g], actual, mode=mode)
            assert rep.experts == sorted(want), (fmt, mode, rep.summary())
            got = {m.expert: m.where for m in rep.first}
            for e, (where, value) in want.items():
                assert got[e].startswith(where), (fmt, mode, got[e], where)
                if packed:  # the flipped bit is the low (even) FP4 value of byte c
                    assert f"(packed: value {value})" in got[e], (mode, got[e])
                assert where in rep.summary()
