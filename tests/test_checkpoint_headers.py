"""checkpoint_headers reads what a disk update will load (names, dtypes, shapes) without reading the data, says
which files are shorter than their headers, and reads the values of the tensors asked for, one at a time."""

import os

import pytest
import torch

from sglang_trtllm_moe.updates import checkpoint_headers

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
        assert metas[name].device.type == "meta", name  # no data read
    kept = checkpoint_headers.meta_tensors(files, keep=lambda n: "down_proj" in n)
    assert sorted(n for n, _ in kept) == sorted(n for n in saved if "down_proj" in n)
    headers = checkpoint_headers.read_headers(files)
    assert headers.problems == []
    wanted = [n for n in saved if "scale" in n]
    read = dict(checkpoint_headers.read_tensors(headers, wanted))
    assert set(read) == set(wanted)
    for n in wanted:
        assert torch.equal(read[n].reshape(-1).view(torch.uint8), saved[n].reshape(-1).view(torch.uint8)), n


def test_a_file_shorter_than_its_header_says_is_a_problem(tmp_path):
    big = {"model.layers.1.mlp.experts.0.up_proj.weight": torch.ones(64, 64, dtype=torch.bfloat16)}
    safetensors_torch.save_file(big, str(tmp_path / "a.safetensors"))
    safetensors_torch.save_file({"x": torch.zeros(4)}, str(tmp_path / "b.safetensors"))
    path = str(tmp_path / "a.safetensors")
    size = os.path.getsize(path)
    with open(path, "r+b") as f:
        f.truncate(size - 100)
    with open(str(tmp_path / "c.safetensors"), "wb") as f:
        f.write(b"\x05\x00")  # not even a header length
    headers = checkpoint_headers.read_headers(checkpoint_headers.files_of(str(tmp_path), "auto"))
    assert len(headers.problems) == 2, headers.problems
    assert "a.safetensors: truncated" in headers.problems[0] and str(size - 100) in headers.problems[0]
    assert "c.safetensors: cannot be read as safetensors" in headers.problems[1]
    assert "x" in dict(headers.tensors)  # the readable file is read


@pytest.mark.parametrize("path,fmt", [("hub-org/model-id", "auto"), (None, "auto"), ("DIR", "pt"), ("DIR", "dummy")])
def test_paths_sglang_would_not_read_as_local_safetensors_are_left_alone(tmp_path, path, fmt):
    safetensors_torch.save_file({"x": torch.zeros(1)}, str(tmp_path / "a.safetensors"))
    assert checkpoint_headers.files_of(str(tmp_path) if path == "DIR" else path, fmt) == []
