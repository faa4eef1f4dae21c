"""Issue #27 at the layer level, every format family, at the shapes real checkpoints have: one bad value in a block
scale — of any size, float or 1-byte — is refused by `update_weights_from_disk` and `update_weights_from_tensor`
(SGLang's own WeightUpdater, or ModelRunner before 0.5.16) as (False, message) before a byte changes; a good update
afterwards equals a fresh load. An all-zero 1-byte block scale is valid (a zero block) and is taken.

Formats: NVFP4 (e4m3 block scales: NaN bytes 0x7F / 0xFF, negative 0x81), compressed-tensors NVFP4, DeepSeek-V3 FP8
block at its real expert size (hidden 7168, intermediate 2048: weight_scale_inv [16, 56] / [56, 16], float32),
MXFP8 (UE8M0 bytes in uint8: 0xFF), MXFP4 experts on an FP8 config (float8_e8m0fnu: 0xFF) and gpt-oss MXFP4 (fused
all-expert tensors, UE8M0 bytes: 0xFF — checked at the entry point now, not only when SGLang's loader writes them).
The whole-model cases (SGLang's own model classes, a truncated or vanished shard, an I/O error mid-load) are in
tests/test_models.py; the property tests over real-size shapes at the end of this file.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sglang_trtllm_moe.sandbox import layers as cpu_layers
from sglang_trtllm_moe.sandbox.layers import MoeSpec
from sglang_trtllm_moe.updates import bucket_validation, checkpoint_checks, checkpoint_headers

from .support import sglang_runtime
from .support.bad_updates import MAKERS

TRTLLM, MXFP4 = "flashinfer_trtllm", "flashinfer_mxfp4"
FP8 = pytest.mark.sglang("capability:fp8-prep", reason="the plugin prepares FP8 layers from 0.5.19")
FP4_EXPERTS = pytest.mark.sglang(
    ">=0.5.12", reason="FP4 experts on an FP8 config (Fp8Config.is_fp4_experts) arrive in 0.5.12"
)
#: DeepSeek-V3's routed expert: hidden 7168, moe_intermediate 2048 (2 experts here: the scales are what matters)
DEEPSEEK_V3_EXPERT = dict(hidden=7168, intermediate=2048)

#: (backend, spec, the block-scale tensor hit (checkpoint name below the layer), the bad bytes / values)
CASES = [
    pytest.param(
        TRTLLM,
        MoeSpec(num_experts=4, hidden=256, intermediate=128, fmt="nvfp4"),
        "experts.2.up_proj.weight_scale",
        (0x7F, 0xFF, 0x81),
        id="nvfp4",
    ),
    pytest.param(
        TRTLLM,
        MoeSpec(num_experts=4, hidden=256, intermediate=128, fmt="ct_nvfp4"),
        "experts.2.down_proj.weight_scale",
        (0x7F,),
        id="ct_nvfp4",
    ),
    pytest.param(
        TRTLLM,
        MoeSpec(num_experts=4, hidden=256, fmt="ct_int4"),
        "experts.2.down_proj.weight_scale",
        (float("nan"), float("-inf"), -1.0),
        id="ct_int4",
    ),
    pytest.param(
        TRTLLM,
        MoeSpec(num_experts=2, fmt="fp8_block", **DEEPSEEK_V3_EXPERT),
        "experts.1.gate_proj.weight_scale_inv",
        (float("nan"), float("-inf"), -1.0),
        id="fp8_block-deepseek-v3-size",
        marks=FP8,
    ),
    pytest.param(
        TRTLLM,
        MoeSpec(num_experts=4, intermediate=128, fmt="mxfp8"),
        "experts.3.up_proj.weight_scale_inv",
        (0xFF,),
        id="mxfp8",
    ),
    pytest.param(
        MXFP4,
        MoeSpec(num_experts=4, intermediate=128, fmt="mxfp4_experts"),
        "experts.1.down_proj.weight_scale_inv",
        (0xFF,),
        id="mxfp4_experts",
        marks=FP4_EXPERTS,
    ),
    pytest.param(
        MXFP4,
        MoeSpec(num_experts=4, hidden=256, intermediate=128, fmt="mxfp4_gptoss"),
        "experts.gate_up_proj_scales",
        (0xFF,),
        id="mxfp4_gptoss",
    ),
]


def _real_size_checkpoint(spec, seed):
    """A valid checkpoint at a real expert size without quantizing anything (the pure-torch quantizers take a minute
    on 88 MB of weights here): random packed / e4m3 weight bytes, valid random scales — what validation and the
    layouts see is the same kind of tensors."""
    g = torch.Generator().manual_seed(seed)
    out: dict[str, torch.Tensor] = {}
    for e in range(spec.num_experts):
        for proj in spec.shards:
            down = proj == cpu_layers.DOWN
            rows, cols = (spec.hidden, spec.intermediate) if down else (spec.intermediate, spec.hidden)
            base = f"experts.{e}.{proj}."
            if spec.fmt == "nvfp4":
                out[base + "weight"] = torch.randint(0, 256, (rows, cols // 2), dtype=torch.uint8, generator=g)
                out[base + "weight_scale"] = torch.randint(
                    0x20, 0x7F, (rows, cols // 16), dtype=torch.uint8, generator=g
                ).view(torch.float8_e4m3fn)
                out[base + "weight_scale_2"] = torch.tensor(1e-3 * (1 + e), dtype=torch.float32)
                out[base + "input_scale"] = torch.tensor(0.5, dtype=torch.float32)
            else:  # DeepSeek FP8 block: e4m3 weights (finite bytes), fp32 scales per 128x128 block
                out[base + "weight"] = torch.randint(0, 0x7F, (rows, cols), dtype=torch.uint8, generator=g).view(
                    torch.float8_e4m3fn
                )
                out[base + "weight_scale_inv"] = torch.rand(-(-rows // 128), -(-cols // 128), generator=g) + 1e-3
    return out


def _checkpoint(spec, seed):
    """{checkpoint name below the model prefix: tensor}"""
    if spec.hidden == DEEPSEEK_V3_EXPERT["hidden"] and spec.fmt in ("nvfp4", "fp8_block"):
        return _real_size_checkpoint(spec, seed)
    if spec.fmt == "mxfp4_gptoss":
        return cpu_layers.below_block(cpu_layers.random_checkpoint(spec, seed))
    make = MAKERS.get(spec.fmt) or (lambda s, seed: cpu_layers.random_checkpoint(s, seed))
    return make(spec, seed=seed)


def _model(backend, spec, tensors):
    sglang_runtime.ensure(backend)
    model = cpu_layers.TinyMoeModel(spec)
    model.load_weights([(model.prefix + k, v) for k, v in tensors.items()])
    model.experts.quant_method.process_weights_after_loading(model.experts)
    return model


def _write(path, spec, tensors, prefix) -> str:
    from safetensors.torch import save_file

    sglang_runtime.write_safetensors_checkpoint(path, {}, spec)  # config.json
    save_file({prefix + k: v.contiguous() for k, v in tensors.items()}, os.path.join(path, "model.safetensors"))
    return path


def _bytes(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().contiguous().reshape(-1).view(torch.uint8).clone() for n, p in model.named_parameters()}


def _same_as_fresh(model, backend, spec, tensors) -> list[str]:
    """Parameters of `model` whose bytes differ from a fresh load of `tensors`, among those two fresh loads agree
    on (SGLang <= 0.5.1x allocates ModelOpt NVFP4's `*_blockscale_swizzled` with torch.empty for its CUTLASS path;
    nothing on the trtllm path ever writes them)."""
    a, b = _bytes(_model(backend, spec, tensors)), _bytes(_model(backend, spec, tensors))
    mine = _bytes(model)
    return [n for n in a if torch.equal(a[n], b[n]) and not torch.equal(mine[n], a[n])]


def _spoil(t: torch.Tensor, bad) -> torch.Tensor:
    """`t` with its very last value bad: a byte of a 1-byte scale, or a float."""
    t = t.clone()
    if isinstance(bad, int):
        t.view(torch.uint8).view(-1)[-1] = bad
    else:
        t.view(-1)[-1] = bad
    return t


@pytest.mark.parametrize("backend,spec,hit,bads", CASES)
def test_one_bad_block_scale_is_refused_by_disk_and_tensor_and_a_good_update_follows(
    backend, spec, hit, bads, tmp_path
):
    base, new = _checkpoint(spec, 0), _checkpoint(spec, 1)
    model = _model(backend, spec, base)
    before = _bytes(model)
    assert hit in new and new[hit].numel() > 64, (hit, tuple(new[hit].shape))  # more than the old header read
    for i, bad in enumerate(bads):
        spoilt = {**new, hit: _spoil(new[hit], bad)}
        d = _write(str(tmp_path / f"bad{i}"), spec, spoilt, model.prefix)
        for how in ("disk", "tensor"):
            up = sglang_runtime.updater(model, d)
            if how == "disk":
                ok, msg = up.update_weights_from_disk(d, "auto")[:2]
            else:
                ok, msg = up.update_weights_from_tensor([(model.prefix + k, v) for k, v in spoilt.items()])[:2]
            assert not ok, (how, bad, msg)
            assert "refused the whole" in msg and "model.layers.0.mlp.experts" in msg and "scale" in msg, (how, msg)
            assert "NaN" in msg or "nan" in msg or "negative" in msg or "-inf" in msg or "-1.0" in msg, (how, msg)
            after = _bytes(model)
            assert [n for n in before if not torch.equal(before[n], after[n])] == [], (how, bad)
    good = _write(str(tmp_path / "good"), spec, new, model.prefix)
    ok, msg = sglang_runtime.updater(model, good).update_weights_from_disk(good, "auto")[:2]
    assert ok, msg
    assert _same_as_fresh(model, backend, spec, new) == []


def test_an_all_zero_e4m3_block_scale_is_a_zero_block_and_is_taken(tmp_path):
    """Decision (docs/RELIABILITY.md): a 1-byte block scale of 0 is valid — the block is zero (SGLang zero-fills
    padding the same way); only NaN and negative bytes are refused."""
    spec = MoeSpec(num_experts=4, hidden=256, intermediate=128, fmt="nvfp4")
    base, new = _checkpoint(spec, 0), _checkpoint(spec, 1)
    model = _model(TRTLLM, spec, base)
    name = "experts.1.gate_proj.weight_scale"
    zero = {**new, name: torch.zeros_like(new[name])}
    d = _write(str(tmp_path / "zero"), spec, zero, model.prefix)
    ok, msg = sglang_runtime.updater(model, d).update_weights_from_disk(d, "auto")[:2]
    assert ok, msg
    assert _same_as_fresh(model, TRTLLM, spec, zero) == []


# ---- properties at real sizes ---------------------------------------------------------------------------------------

_REAL: dict = {}


def _real(fmt: str):
    """A DeepSeek-V3-size layer (2 experts), loaded, and one valid checkpoint of it: built once per format."""
    if fmt not in _REAL:
        spec = MoeSpec(num_experts=2, fmt=fmt, **DEEPSEEK_V3_EXPERT)
        tensors = _checkpoint(spec, 0)
        _REAL[fmt] = (spec, _model(TRTLLM, spec, tensors), tensors)
    return _REAL[fmt]


REAL_FORMATS = [pytest.param("nvfp4", id="nvfp4"), pytest.param("fp8_block", id="fp8_block", marks=FP8)]


@pytest.mark.parametrize("fmt", REAL_FORMATS)
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_property_a_bad_scale_anywhere_in_a_real_size_tensor_is_found_and_located(fmt, data, tmp_path_factory):
    """Any expert, projection, position and kind of bad value, in a DeepSeek-V3-size scale tensor: the whole request
    is refused, by the tensor path's check and by the checkpoint's, naming the parameter and the index it is at."""
    spec, model, tensors = _real(fmt)
    scales = sorted(n for n in tensors if n.endswith(("weight_scale", "weight_scale_inv")) and tensors[n].dim() == 2)
    name = data.draw(st.sampled_from(scales), label="tensor")
    t = tensors[name]
    idx = tuple(data.draw(st.integers(0, d - 1), label=f"index {i}") for i, d in enumerate(t.shape))
    if t.element_size() == 1:
        bad = data.draw(st.sampled_from([0x7F, 0xFF, 0x81, 0xC0]), label="byte")
    else:
        bad = data.draw(st.sampled_from([float("nan"), float("inf"), float("-inf"), -1.0, -1e-30]), label="value")
    spoilt = t.clone()
    if isinstance(bad, int):
        spoilt.view(torch.uint8)[idx] = bad
    else:
        spoilt[idx] = bad
    named = [(model.prefix + n, spoilt if n == name else v) for n, v in tensors.items()]
    with pytest.raises(bucket_validation.BucketRefused) as tensor_path:
        bucket_validation.check_bucket(model, named)
    d = tmp_path_factory.mktemp("ckpt")
    from safetensors.torch import save_file

    # the checkpoint of a partial update holding the layer's scales (the weights would only make the file bigger)
    held = {n: v.contiguous() for n, v in named if n[len(model.prefix) :] in scales}
    save_file(held, os.path.join(d, "s.safetensors"))
    with pytest.raises(bucket_validation.BucketRefused) as disk_path:
        checkpoint_checks.check_checkpoint(model, checkpoint_headers.files_of(str(d), "auto"))
    for e in (tensor_path.value, disk_path.value):
        msg = str(e)
        assert "1 refused" in msg and f"at {list(idx)}" in msg, msg
        assert name.rsplit(".", 1)[1] in msg, msg


def test_the_check_reads_every_scale_once_and_no_weight(tmp_path, monkeypatch):
    """The checkpoint check reads the values of scales only (NVFP4 block scales are 1/8 of the packed weight bytes),
    each once, one tensor at a time."""
    spec = MoeSpec(num_experts=4, hidden=256, intermediate=128, fmt="nvfp4")
    model = _model(TRTLLM, spec, _checkpoint(spec, 0))
    tensors = _checkpoint(spec, 1)
    d = _write(str(tmp_path / "c"), spec, tensors, model.prefix)
    read: list[str] = []
    real = checkpoint_headers.read_tensors

    def counting(headers, names):
        for n, t in real(headers, names):
            read.append(n)
            yield n, t

    monkeypatch.setattr(checkpoint_headers, "read_tensors", counting)
    checkpoint_checks.check_checkpoint(model, checkpoint_headers.files_of(d, "auto"))
    assert sorted(read) == sorted(model.prefix + n for n in tensors if "scale" in n.rsplit(".", 1)[1])
    assert len(read) == len(set(read))
    with open(os.path.join(d, "config.json")) as f:
        assert json.load(f)["hidden_size"] == spec.hidden


def test_a_load_refused_half_way_is_put_back_and_answered(tmp_path):
    """A checkpoint the plugin cannot check up front (PyTorch .bin weights: no safetensors headers) with one NaN
    e4m3 byte in its last expert's scale: the loader hook refuses that write after SGLang has loaded the tensors
    before it, SGLang's rollback reads the same file and is refused again — before, that exception left the
    scheduler. Now the update answers (False, message) and every byte is the previous one (the host snapshot, as
    this layer was not loaded from disk by SGLang's loader)."""
    spec = MoeSpec(num_experts=4, hidden=256, intermediate=128, fmt="nvfp4")
    base, new = _checkpoint(spec, 0), _checkpoint(spec, 1)
    model = _model(TRTLLM, spec, base)
    before = _bytes(model)
    name = "experts.3.down_proj.weight_scale"
    spoilt = {**new, name: _spoil(new[name], 0x7F)}
    d = str(tmp_path / "bin")
    sglang_runtime.write_safetensors_checkpoint(d, {}, spec)
    os.remove(os.path.join(d, "model.safetensors"))
    ordered = dict(sorted(spoilt.items(), key=lambda kv: kv[0] == name))  # the bad tensor last: others load first
    torch.save({model.prefix + k: v.contiguous() for k, v in ordered.items()}, os.path.join(d, "pytorch_model.bin"))
    ok, msg = sglang_runtime.updater(model, d).update_weights_from_disk(d, "auto")[:2]
    assert not ok and "refused weight update of w2_weight_scale" in msg and "snapshot" in msg, msg
    after = _bytes(model)
    assert [n for n in before if not torch.equal(before[n], after[n])] == []
    ok, msg = sglang_runtime.updater(model, d).update_weights_from_tensor(
        [(model.prefix + k, v) for k, v in new.items()]
    )[:2]
    assert ok, msg
    assert _same_as_fresh(model, TRTLLM, spec, new) == []
