"""`update_weights_from_distributed` — the NCCL path of verl / OpenRLHF / slime, gloo on a CPU — on every release,
at the layer: SGLang's own `init_weights_update_group` and update entry point as that release spells them
(ModelRunner before 0.5.16, WeightUpdater after; from 0.5.21 `receive_weights_from_distributed` then
`load_weights_from_distributed`, as the scheduler calls them), against a trainer process that is rank 0 of SGLang's
`init_custom_process_group` and broadcasts flattened buckets (`load_format="flattened_bucket"`: gloo cannot
broadcast float8_e4m3fn, which NVFP4 block scales are).

A whole checkpoint of a new seed in two buckets: every parameter of the layer == a fresh prepared load of that
checkpoint, byte for byte, storage kept. A bucket with one bad tensor (float32 for packed FP4 bytes): answered
(False, "refused the whole weight-update bucket ..."), nothing changed. The server-level flow (sessions, the HTTP
endpoints, checksums against a fresh server load) is tests/test_http_server.py on 0.5.23.
"""

from __future__ import annotations

import pytest
import torch

from sglang_trtllm_moe.sandbox import layers as cpu_layers

from .support import sglang_runtime
from .support.bad_updates import compared
from .support.gloo_trainer import GROUP, ordered, request_fields, running

SPEC = cpu_layers.MoeSpec(num_experts=4, hidden=256, intermediate=128)


@pytest.fixture(scope="module", autouse=True)
def runtime():
    sglang_runtime.ensure("flashinfer_trtllm")


def _update(u, bucket: list[tuple[str, torch.Tensor]]):
    """One update_weights_from_distributed as this release's scheduler / runner calls it: (success, message)."""
    kw = request_fields(bucket)
    if hasattr(u, "receive_weights_from_distributed"):  # 0.5.21+: the scheduler receives, the runner loads
        return u.load_weights_from_distributed(u.receive_weights_from_distributed(**kw))
    return u.update_weights_from_distributed(**kw)


def _bytes(layer) -> dict[str, torch.Tensor]:
    """What a fresh load defines (not the never-written placeholders some releases register: bad_updates.compared)."""
    names = compared(layer)
    return {
        n: p.data.reshape(-1).view(torch.uint8).clone() for n, p in layer.named_parameters(recurse=False) if n in names
    }


def test_update_from_distributed_over_gloo_is_bit_exact_and_a_bad_bucket_is_refused_whole():
    model = sglang_runtime.prepared_model(SPEC, cpu_layers.random_nvfp4_checkpoint(SPEC, seed=0))
    ptrs = {n: p.data_ptr() for n, p in model.experts.named_parameters(recurse=False)}
    new = cpu_layers.checkpoint_names(cpu_layers.random_nvfp4_checkpoint(SPEC, seed=5))
    pairs = ordered(new)
    buckets = [pairs[0::2], pairs[1::2]]
    bad = dict(cpu_layers.checkpoint_names(cpu_layers.random_nvfp4_checkpoint(SPEC, seed=6)))
    key = next(n for n in bad if n.endswith("experts.3.down_proj.weight"))
    bad[key] = bad[key].float()
    bad_bucket = ordered(bad)

    u = sglang_runtime.updater(model)
    if not hasattr(u, "_model_update_group"):  # the ModelRunner shell of releases before 0.5.16 (its __init__ sets it)
        u._model_update_group = {}
    with running([*buckets, bad_bucket]) as (port, trainer):
        ok, msg = u.init_weights_update_group("127.0.0.1", port, 1, 2, GROUP, backend="gloo")
        assert ok, msg
        for bucket in buckets:
            ok, msg = _update(u, bucket)
            assert ok, msg
        fresh = sglang_runtime.prepared_model(SPEC, cpu_layers.random_nvfp4_checkpoint(SPEC, seed=5))
        got, want = _bytes(model.experts), _bytes(fresh.experts)
        assert [n for n in want if not torch.equal(got[n], want[n])] == []
        assert {n: p.data_ptr() for n, p in model.experts.named_parameters(recurse=False)} == ptrs

        ok, msg = _update(u, bad_bucket)
        assert not ok and msg.startswith("refused the whole weight-update bucket"), msg
        assert "expert 3" in msg and "partially updated" not in msg, msg
        after = _bytes(model.experts)
        assert [n for n in want if not torch.equal(after[n], want[n])] == []  # nothing of it was written
        u.destroy_weights_update_group(GROUP)
    assert trainer.exitcode == 0
