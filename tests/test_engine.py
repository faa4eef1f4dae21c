"""sglang.Engine(device="cpu") as the top (issue #19, item 4): Qwen3-MoE NVFP4 and Nemotron-H NVFP4 (relu2) through
the Engine's public API only — generate, update_weights_from_disk (full and partial), update_weights_from_tensor
(buckets in a begin/end session, flattened buckets), the weight checker (snapshot / reset_tensors / compare), a
corrupted update caught — with the CPU stand-ins and the faked SM100 reaching the Engine's spawned scheduler and
detokenizer through SGLang's own plugin loading (sandbox.standins.spawn_path).

What is proven how: after every step the served model is read back through `Engine.save_sharded_model` (the
scheduler writes its state_dict: the prepared bytes) and compared tensor by tensor with a fresh get_model() of the
intended checkpoint, loaded by SGLang's ModelRunner in another process (the model tests prove that load is
plugin-managed and bit-exact); the greedy tokens the Engine generates equal that fresh model's; the prefill logits
of the model are within the NVFP4 bound of transformers' own class; the weight checker passes after a correct
replay and names the expert (in checkpoint layout: the plugin's comparator ran in the scheduler) after a corrupted
one. Not observable through the Engine's API: data_ptr (storage kept is proven at the model level).

Runs tests/support/engine_worker.py once (both models, one process, one Engine after the other; ~1-2 min).
"""

from __future__ import annotations

import json

import pytest

from sglang_trtllm_moe.sandbox.releases import RL_LOOP_RELEASES

from .support.helpers import last_json, run_module

pytestmark = pytest.mark.sglang(
    str(RL_LOOP_RELEASES),
    reason="sglang.Engine's weight-update sessions (begin/end_weight_update), "
    "the weight-checker request and the Engine's spawn flow (sandbox/releases.py RL_LOOP_RELEASES)",
)

MODELS = ("qwen3_moe:nvfp4", "nemotron_h:nvfp4")
STEPS = (
    "explain",
    "engine up",
    "reference",
    "load",
    "routed experts",
    "forward vs transformers",
    "round 1: disk",
    "round 2: tensor buckets",
    "round 3: flattened buckets",
    "partial disk",
    "bad update answered",
    "still serving",
    "weight checker",
    "corrupted update caught",
    "restored",
)

_RUN: dict = {}


def run() -> dict:
    if not _RUN:
        proc = run_module("tests.support.engine_worker", ",".join(MODELS), timeout=1200)
        _RUN.update(last_json(proc))
        _RUN["_stderr_tail"] = proc.stderr[-4000:]
    return _RUN


def steps_of(model: str) -> dict:
    checks = run().get(model)
    assert checks is not None, run()["_stderr_tail"]
    loop = [c for c in checks if c["step"] == "loop"]
    assert not loop, f"{loop[0]['detail']}\n{loop[0].get('traceback', '')}"
    return {c["step"]: c for c in checks}


@pytest.mark.parametrize("step", STEPS)
@pytest.mark.parametrize("model", MODELS)
def test_engine_rl_loop(model, step):
    steps = steps_of(model)
    assert step in steps, f"step {step!r} did not run: {list(steps)}\n{run()['_stderr_tail']}"
    c = steps[step]
    assert c["ok"], json.dumps(c, default=str)[:3000]


@pytest.mark.parametrize("model", MODELS)
def test_engine_serves_the_fresh_load_bytes_and_tokens(model):
    """Every served state: no tensor differs from the fresh load, the greedy tokens are the fresh model's."""
    steps = steps_of(model)
    for name in (
        "load",
        "round 1: disk",
        "round 2: tensor buckets",
        "round 3: flattened buckets",
        "partial disk",
        "still serving",
        "restored",
    ):
        assert steps[name]["differs"] == [] and steps[name]["tokens"] == steps[name]["fresh_tokens"], steps[name]
    # the rounds really changed what is served (not the same bytes every time)
    tokens = [steps[n]["tokens"] for n in ("load", "round 1: disk", "round 2: tensor buckets")]
    assert tokens[0] != tokens[1] != tokens[2]


def test_plugin_loaded_in_the_engine_launcher():
    c = steps_of(MODELS[0])["plugin loaded by SGLang"]
    assert c["ok"], c
