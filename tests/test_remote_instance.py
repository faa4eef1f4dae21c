"""A new SGLang instance that boots from a running one's memory (`--load-format remote_instance`; issue #53).

SGLang's RemoteInstanceModelLoader copies every parameter's raw bytes from a seed instance and never runs
process_weights_after_loading on the new one. The seed here is a real SGLang FusedMoE layer (every kind the sandbox
builds) loaded from a checkpoint and prepared by the plugin; the new instance is the same layer as SGLang's
create_weights allocated it, filled by SGLang's own transfer methods — `load_model_from_remote_instance_by_
transfer_engine` and `load_model_from_remote_instance_by_nccl`, with the seed's own `send_weights_to_remote_instance`
on the other end — over the CPU stand-ins of tests/support/remote_instance.py (an in-process memmove for Mooncake's
RDMA read; gloo, and a forked seed process, for NCCL). After the boot the new instance's layer is the seed's, byte
for byte (nothing laid out again: never packed twice), laid out in the plugin's state, with the seed's kernel
scalars; its forward is the seed's; and an RL update afterwards lands on both exactly alike. A seed refuses to send
while a weight-update session is open on it; a ModelExpress peer copy of a layer the plugin serves stops start-up.
The whole-model boot (tokens) is tests/support/remote_instance_worker.py's, run below on the releases it spells.
"""

from __future__ import annotations

import pytest
import torch

from sglang_trtllm_moe import TrtllmLayerError, layer_state
from sglang_trtllm_moe.builtins import remote_instance
from sglang_trtllm_moe.sandbox import layers as cpu_layers
from sglang_trtllm_moe.sandbox.releases import MODEL_RUNNER_RELEASES

from .support import remote_instance as R
from .support import sglang_runtime

# each kind at its own intermediate (INT4: 256, what its kernel needs)
SPECS = {kind: cpu_layers.MoeSpec(num_experts=4, hidden=256, fmt=kind) for kind in cpu_layers.LAYERS}
SPECS["nvfp4-I96-padded"] = cpu_layers.MoeSpec(num_experts=4, hidden=256, intermediate=96, fmt="nvfp4")
KINDS = sorted(SPECS)
#: the NCCL path (a forked seed per case): one kind per layout family
NCCL_KINDS = ["nvfp4-I96-padded", "fp8_tensor", "bf16", "mxfp4_gptoss"]


@pytest.fixture(scope="module", autouse=True)
def runtime():
    sglang_runtime.ensure("flashinfer_trtllm")


@pytest.fixture(autouse=True)
def cpu_sync(monkeypatch):
    """Releases before 0.5.21 call torch.cuda.synchronize() around the transfer: nothing to wait for on a CPU."""
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)


def _seed(spec, seed=0):
    sglang_runtime.ensure(spec.kind.format.own_backend or "flashinfer_trtllm")
    return sglang_runtime.prepared_model(spec, spec.kind.checkpoint(spec, seed=seed))


def _bytes(t):
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def differences(a, b) -> list[str]:
    """Parameters of two models' MoE layers (both sides' names) whose bytes or shapes differ, and the layout state."""
    pa, pb = dict(a.experts.named_parameters()), dict(b.experts.named_parameters())
    out = sorted(set(pa) ^ set(pb))
    both = sorted(set(pa) & set(pb))
    out += [n for n in both if pa[n].shape != pb[n].shape or not torch.equal(_bytes(pa[n]), _bytes(pb[n]))]
    sa, sb = layer_state.state_of(a.experts), layer_state.state_of(b.experts)
    if sa is not None and sb is not None:  # (a seed SGLang prepares itself has no plugin state: its bytes count)
        out += [f"state of {g}" for g in sa.prepared if not torch.equal(sa.prepared[g], sb.prepared[g])]
    return out


def boot_transfer_engine(seed_model, spec, monkeypatch):
    from sglang.srt.model_loader import loader

    engine = R.InProcessTransferEngine()
    info = R.seed_weight_info(seed_model, engine)
    published = (engine.session_id, info)  # what the seed's bootstrap server answers the new instance's GET
    monkeypatch.setattr(loader, "get_remote_instance_transfer_engine_info_per_rank", lambda url, rank: published)
    new = cpu_layers.TinyMoeModel(spec)
    ok = R.loader("transfer_engine").load_model_from_remote_instance_by_transfer_engine(new, engine, "http://seed", 0)
    assert ok
    return new


def boot_nccl(seed_model, spec, monkeypatch):
    from sglang.srt.model_loader import loader

    new = cpu_layers.TinyMoeModel(spec)
    seed = R.Seed(seed_model)
    try:
        monkeypatch.setattr(loader, "trigger_transferring_weights_request", seed.trigger)
        with R.bytes_over_gloo():
            R.loader("nccl").load_model_from_remote_instance_by_nccl(new, seed, R.MODEL_CONFIG, R.DEVICE_CONFIG)
        answer = seed.answer()
        assert answer is not None and answer[0], answer
        after = seed.ask("call", R.seed_state)
    finally:
        seed.close()
    return new, after


def _forward(model, monkeypatch):
    monkeypatch.setenv("SGLANG_TRTLLM_MOE_EMULATE", "1")
    torch.manual_seed(1)
    x = torch.randn(5, model.spec.hidden, dtype=torch.bfloat16)
    logits = torch.randn(5, model.spec.num_experts)
    bypass = model.spec.fmt in ("fp8_modelopt", "mxfp4_gptoss")  # their trtllm apply routes in the kernel only
    return sglang_runtime.forward(model.experts, x, logits, bypass=bypass)[0]


def _then_the_same_update(seed_model, new, spec):
    """An RL update of two experts through SGLang's WeightUpdater lands on both alike."""
    tensors = spec.kind.checkpoint(spec, seed=5)
    if spec.kind.format.fused:
        named = list(cpu_layers.checkpoint_names(tensors).items())
    else:
        named = [(k, v) for k, v in cpu_layers.checkpoint_names(tensors).items() if k.split(".")[4] in ("1", "2")]
    for m in (seed_model, new):
        ok, msg = sglang_runtime.updater(m).update_weights_from_tensor(named)
        assert ok, msg
    assert differences(new, seed_model) == []


@pytest.mark.parametrize("kind", KINDS)
def test_a_transfer_engine_boot_serves_exactly_what_the_seed_serves(kind, monkeypatch):
    spec = SPECS[kind]
    seed_model = _seed(spec)
    new = boot_transfer_engine(seed_model, spec, monkeypatch)
    assert differences(new, seed_model) == []
    st = layer_state.state_of(new.experts)
    assert st is not None and st.clean, "the new instance's layer is the plugin's, laid out"
    assert torch.equal(_forward(new, monkeypatch), _forward(seed_model, monkeypatch))
    # preparation running again (a second post-load pass) must not pack the adopted layer twice
    new.experts.quant_method.process_weights_after_loading(new.experts)
    assert differences(new, seed_model) == []
    _then_the_same_update(seed_model, new, spec)


@pytest.mark.parametrize("kind", NCCL_KINDS)
def test_an_nccl_boot_serves_exactly_what_the_seed_serves(kind, monkeypatch):
    spec = SPECS[kind]
    seed_model = _seed(spec)
    new, seed_after = boot_nccl(seed_model, spec, monkeypatch)
    assert differences(new, seed_model) == []
    # the seed handed out SGLang's parameters only, and has its own (kernel scalars included) back, laid out
    seed_params = [n for n, _ in seed_model.experts.named_parameters(recurse=False)]
    assert seed_after["experts"]["params"] == seed_params and seed_after["experts"]["clean"] in (True, None)
    st = layer_state.state_of(new.experts)
    if st is not None:
        assert st.clean and set(st.kernel_scalars) <= set(seed_params) - set(st.loaded_params)
    assert torch.equal(_forward(new, monkeypatch), _forward(seed_model, monkeypatch))
    _then_the_same_update(seed_model, new, spec)


def test_a_seed_refuses_to_send_while_a_session_is_open():
    spec = SPECS["nvfp4"]
    seed_model = _seed(spec)
    runner = R.seed_runner(seed_model)
    try:
        assert R.open_session(seed_model)
        ok, message = runner.send_weights_to_remote_instance("127.0.0.1", "1", "g")
    finally:
        layer_state.flush_all(end_session=True)
    assert not ok and message == remote_instance.SESSION_OPEN


def test_a_peer_copy_of_unknown_layout_is_refused_at_start_up_and_a_checkpoint_load_is_not():
    """ModelExpress: the plugin cannot tell which layout a peer's bytes hold (its copy, or its fallback load)."""
    spec = SPECS["nvfp4"]
    copied = cpu_layers.TinyMoeModel(spec)  # what a peer copy leaves: bytes, no process_weights_after_loading
    with pytest.raises(TrtllmLayerError, match="modelexpress") as e:
        remote_instance.adopt(copied, remote_instance.MODELEXPRESS_REFUSAL)
    assert "model.layers.0.mlp.experts" in str(e.value) and "Fix:" in str(e.value)
    loaded = _seed(spec)  # the fallback: SGLang's DefaultModelLoader, prepared by the plugin as on any load
    before = {n: _bytes(p).clone() for n, p in loaded.experts.named_parameters()}
    remote_instance.adopt(loaded, remote_instance.MODELEXPRESS_REFUSAL)
    assert all(torch.equal(before[n], _bytes(p)) for n, p in loaded.experts.named_parameters())


@pytest.mark.sglang(
    str(MODEL_RUNNER_RELEASES),
    reason="sandbox.models spells SGLang's runner set-up of these releases (the whole-model seed); the layer-level "
    "boots above run on every release",
)
@pytest.mark.parametrize(("arch", "quant"), [("qwen3_moe", "nvfp4")])
def test_a_whole_model_booted_from_a_seed_generates_the_seeds_tokens(arch, quant):
    import json
    import subprocess
    import sys

    from .support.helpers import REPO, last_json

    proc = subprocess.run(
        [sys.executable, "-m", "tests.support.remote_instance_worker", arch, quant],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=900,
    )
    report = last_json(proc)
    assert report is not None, proc.stderr[-3000:]
    for check in ("transfer_engine", "nccl", "control"):
        assert report[check]["ok"], json.dumps(report[check], indent=1)[:4000]
