"""Each format's stored encoding (formats/encodings.py `Encoding`): the kernel family it names is the format's, its
writer and reader are inverses up to its grid, the checker's grid reads the same values, and format modules share
helpers through formats/encodings.py only (issue #54)."""

from __future__ import annotations

import ast
import pathlib

import pytest
import torch

from sglang_trtllm_moe import formats, kernel_api
from sglang_trtllm_moe.formats.encodings import Calibration, grid_dequantize

ENCODINGS = {f.encoding.name: f.encoding for f in formats.FORMATS}
FORMATS_DIR = pathlib.Path(formats.__file__).parent
#: a variant subclasses its parent in the parent's module (the only import between format modules)
PARENTS = {"ct_nvfp4": {"nvfp4"}, "nvfp4_online": {"nvfp4"}}


def test_every_format_runs_its_encodings_kernel_family():
    for fmt in formats.FORMATS:
        assert fmt.kernel == fmt.encoding.kernel in kernel_api.FAMILIES, fmt.name


@pytest.mark.parametrize("name", sorted(ENCODINGS))
def test_quantize_then_dequantize_is_the_weight_up_to_its_grid(name):
    enc = ENCODINGS[name]
    w = torch.randn(256, 256, generator=torch.Generator().manual_seed(0)) * 0.05
    tensors = enc.quantize(w, Calibration(input_amax=4.0, gate_up_amax=float(w.abs().max()), down=False))
    back = enc.dequantize(tensors)
    assert back.shape == w.shape and back.dtype == torch.float32
    assert float((back - w).norm() / w.norm()) < 0.2, name


@pytest.mark.parametrize("name", sorted(ENCODINGS))
def test_the_checkers_grid_reads_the_values_the_writer_wrote(name):
    enc = ENCODINGS[name]
    w = torch.randn(2, 256, 256, generator=torch.Generator().manual_seed(1)) * 0.05
    per_expert = [enc.quantize(w[e], Calibration(4.0, float(w[e].abs().max()), True)) for e in range(2)]
    weight_key = next(k for k in per_expert[0] if k in ("weight", "weight_packed"))
    scale_key = next((k for k in ("weight_scale", "weight_scale_inv") if k in per_expert[0]), None)
    weight = torch.stack([t[weight_key] for t in per_expert])
    if scale_key is None or per_expert[0][scale_key].dim() == 0:  # dense or per-tensor: no block scales to read
        values, tol = grid_dequantize(weight, None)
        assert torch.equal(values, weight.float()) and bool((tol >= 0).all())
        return
    scale = torch.stack([t[scale_key] for t in per_expert])
    values, tol = enc.grid(weight, scale)
    global_scale = {"nvfp4": "weight_scale_2", "ct_nvfp4": "weight_global_scale"}.get(name)
    for e in range(2):
        want = enc.dequantize(per_expert[e])
        if global_scale is not None:  # the checker's values are in block-scale units (global scales: scalars)
            g = float(per_expert[e][global_scale])
            want = want / g if name == "nvfp4" else want * g
        torch.testing.assert_close(values[e], want, rtol=1e-6, atol=0)
    assert bool((tol > 0).any()) and bool((tol >= 0).all())


def test_format_modules_import_no_other_format_module():
    modules = {p.stem for p in FORMATS_DIR.glob("*.py")} - {"__init__"}
    format_modules = {type(f).__module__.rsplit(".", 1)[1] for f in formats.FORMATS}
    for mod in sorted(format_modules):
        tree = ast.parse((FORMATS_DIR / f"{mod}.py").read_text())
        imported = {
            (node.module or "").split(".")[0]
            for node in ast.walk(tree)
            if isinstance(node, ast.ImportFrom) and node.level == 1
        }
        others = (imported & modules & format_modules) - PARENTS.get(mod, set())
        assert not others, f"formats/{mod}.py imports format module(s) {sorted(others)}: share through encodings.py"
