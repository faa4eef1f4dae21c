"""Concurrent writers of one layer: SGLang's DeepSeek loader writes the shards of one expert from a thread pool.

Each round: a prepared layer (checkpoint A), then N threads released together by a barrier write every shard of
every expert of checkpoint B through SGLang's own `FusedMoE.weight_loader`, in a random order per round, while
one more thread keeps flushing the layer (what a forward's `ensure_prepared` or another entry point would do) and
dropping the cached index maps (what every update entry point does). After a final flush, every byte must equal a
fresh single-threaded load of B, with storage kept. Without the per-layer lock the un-prepare of a shared group
(w1 and w3 are interleaved) races with the other shard's write: measured 5 of 5 rounds wrong on 2 cores.
"""

from __future__ import annotations

import random
import threading

import pytest
import torch

from sglang_trtllm_moe import layer_state, layouts
from sglang_trtllm_moe.sandbox import layers as cpu_layers

from .support import sglang_runtime

ROUNDS = 6
WRITERS = 8


@pytest.fixture(scope="module", autouse=True)
def runtime():
    sglang_runtime.ensure("flashinfer_trtllm")


@pytest.fixture(autouse=True)
def plugin_prepares(monkeypatch):
    """The plugin's own preparation of formats SGLang prepares correctly on some releases (compat/defer.py) stays
    tested on every release."""
    sglang_runtime.plugin_prepares(monkeypatch, "bf16")


FORMATS = {
    "nvfp4": (cpu_layers.random_nvfp4_checkpoint, ("w13_weight", "w13_weight_scale", "w2_weight", "w2_weight_scale")),
    "bf16": (cpu_layers.random_bf16_checkpoint, ("w13_weight", "w2_weight")),
    "ct_int4": (
        cpu_layers.random_ct_int4_checkpoint,
        ("w13_weight_packed", "w13_weight_scale", "w2_weight_packed", "w2_weight_scale"),
    ),
}


def _race_round(spec, make, names, seed: int, flusher: bool) -> list[str]:
    model = sglang_runtime.prepared_model(spec, make(spec, seed=100))
    layer = model.experts
    ptrs = {n: p.data_ptr() for n, p in model.named_parameters()}
    shards = list(cpu_layers.checkpoint_names(make(spec, seed=101)).items())
    random.Random(seed).shuffle(shards)
    parts = [shards[i::WRITERS] for i in range(WRITERS)]
    barrier = threading.Barrier(WRITERS + (1 if flusher else 0))
    done = threading.Event()
    errors: list[BaseException] = []

    def write(part):
        try:
            barrier.wait()
            for item in part:  # one call per shard, as SGLang's thread pool submits them
                model.load_weights([item])
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    def flush_meanwhile():
        try:
            barrier.wait()
            while not done.is_set():
                layer_state.flush(layer)
                layouts.clear_caches()
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=write, args=(p,)) for p in parts]
    if flusher:
        threads.append(threading.Thread(target=flush_meanwhile))
    for t in threads:
        t.start()
    for t in threads[:WRITERS]:
        t.join()
    done.set()
    for t in threads[WRITERS:]:
        t.join()
    assert not errors, errors[0]
    layer_state.flush(layer)
    assert {n: p.data_ptr() for n, p in model.named_parameters()} == ptrs, "storage moved"
    fresh = sglang_runtime.prepared_model(spec, make(spec, seed=101)).experts
    return [
        n
        for n in names
        if not torch.equal(getattr(layer, n).data.view(torch.uint8), getattr(fresh, n).data.view(torch.uint8))
    ]


@pytest.mark.parametrize("flusher", [False, True], ids=["writers", "writers+flusher"])
@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_concurrent_shard_writes_equal_a_fresh_load(fmt, flusher):
    spec = cpu_layers.MoeSpec(num_experts=16, fmt=fmt)  # the kind's intermediate (128; INT4: 256)
    make, names = FORMATS[fmt]
    wrong = {r: bad for r in range(ROUNDS) if (bad := _race_round(spec, make, names, r, flusher))}
    assert not wrong, f"rounds with bytes different from a fresh load (round: parameters): {wrong}"
    assert layer_state.state_of(sglang_runtime.prepared_model(spec, make(spec, seed=1)).experts).clean
