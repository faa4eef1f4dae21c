"""checkpoint_headers reads what a disk update will load (names, dtypes, shapes) without reading the data."""

import pytest
import torch

from sglang_trtllm_moe import checkpoint_headers

safetensors_torch = pytest.importorskip("safetensors.torch", reason="safetensors ships with SGLang")


def test_meta_tensors_match_the_saved_tensors(tmp_path):
    saved = {
        "model.layers.1.mlp.experts.3.gate_proj.weight": torch.zeros(8, 4, dtype=torch.uint8),
        "model.layers.1.mlp.experts.3.gate_proj.weight_scale": torch.ones(8, 1).to(torch.float8_e4m3fn),
        "model.layers.1.mlp.experts.3.down_proj.weight": torch.zeros(4, 16, dtype=torch.bfloat16),
        "model.layers.1.mlp.experts.3.down_proj.input_scale": torch.ones((), dtype=torch.float32),
    }
    safetensors_torch.save_file(dict(list(saved.items())[:2]), str(tmp_path / "a.safetensors"))
    safetensors_torch.save_file(dict(list(saved.items())[2:]), str(tmp_path / "b.safetensors"))
    files = checkpoint_headers.files_of(str(tmp_path), "auto")
    assert [f.rsplit("/", 1)[-1] for f in files] == ["a.safetensors", "b.safetensors"]
    metas = dict(checkpoint_headers.meta_tensors(files))
    assert set(metas) == set(saved)
    for name, t in saved.items():
        assert (metas[name].dtype, tuple(metas[name].shape)) == (t.dtype, tuple(t.shape)), name
        if name.endswith("input_scale"):  # a per-tensor scale: its value is read too (validation checks it)
            assert metas[name].device.type == "cpu" and torch.equal(metas[name], t), name
        else:
            assert metas[name].device.type == "meta", name
    kept = checkpoint_headers.meta_tensors(files, keep=lambda n: "down_proj" in n)
    assert sorted(n for n, _ in kept) == sorted(n for n in saved if "down_proj" in n)


@pytest.mark.parametrize("path,fmt", [("hub-org/model-id", "auto"), (None, "auto"), ("DIR", "pt"), ("DIR", "dummy")])
def test_paths_sglang_would_not_read_as_local_safetensors_are_left_alone(tmp_path, path, fmt):
    safetensors_torch.save_file({"x": torch.zeros(1)}, str(tmp_path / "a.safetensors"))
    assert checkpoint_headers.files_of(str(tmp_path) if path == "DIR" else path, fmt) == []
