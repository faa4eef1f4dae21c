"""Loader-free weight-update sessions (issue #53): a writer puts raw bytes straight into the served parameters between
`begin_weight_update` and `end_weight_update` (P2P / RDMA; SGLang 0.5.21+ then ends with `run_post_load=True`).

On real SGLang FusedMoE layers of every kind the sandbox builds (every format of the registry; the formats SGLang
prepares itself on a release are watched by the plugin and covered too), through SGLang's own `WeightUpdater` and
its scheduler-side `SchedulerWeightUpdaterManager`:

* the bytes a writer writes are what SGLang's loader leaves in a layer that is not laid out (a model loaded with the
  new checkpoint, not prepared: the checkpoint layout of the writer's contract), copied raw into the parameters;
  after `end` the layer equals a fresh load of that checkpoint, byte for byte, kernel scalars included, storage kept;
* with the writer's hint (the begin request's `rid`, or `session_writes.expect`) only the named experts are returned
  to checkpoint layout at `begin` and laid out at `end`, and the layer equals a fresh load of the mix;
* a refused value (NaN / negative e4m3 byte, UE8M0 0xFF, NaN float scale, a zero per-tensor scale) in one expert is
  found at `end`: the scheduler answers (False, message naming the layer, the parameter, the expert and the value);
  that expert is served as a zero expert (every byte 0, valid scales), every other expert as written, no NaN in the
  forward; the next good session is exact again.
"""

from __future__ import annotations

import math

import pytest
import torch

from sglang_trtllm_moe import layer_state
from sglang_trtllm_moe.builtins import sessions
from sglang_trtllm_moe.compat import features
from sglang_trtllm_moe.formats.load_rules import E4M3_BYTES, UE8M0_BYTES
from sglang_trtllm_moe.sandbox import layers as cpu_layers
from sglang_trtllm_moe.updates import session_writes

from .support import bad_updates as B
from .support import sglang_runtime
from .support.releases import SPAWN_RANKS

pytestmark = pytest.mark.sglang(
    features.LOADER_FREE_SESSIONS.releases,
    reason="weight-update sessions that end with run_post_load (loader-free writers) arrive upstream in 0.5.21",
)

LAYER = "model.layers.0.mlp.experts"
# each kind at its own intermediate (INT4: 256, what its kernel needs)
SPECS = {kind: cpu_layers.MoeSpec(num_experts=4, hidden=256, fmt=kind) for kind in cpu_layers.LAYERS}
SPECS["nvfp4-I96-padded"] = cpu_layers.MoeSpec(num_experts=4, hidden=256, intermediate=96, fmt="nvfp4")
SPECS["nvfp4-relu2"] = cpu_layers.MoeSpec(
    num_experts=4, hidden=256, intermediate=128, fmt="nvfp4", gated=False, activation="relu2"
)
KINDS = sorted(SPECS)


@pytest.fixture(scope="module", autouse=True)
def runtime():
    sglang_runtime.ensure("flashinfer_trtllm")


def _ckpt(spec, seed):
    return spec.kind.checkpoint(spec, seed=seed)


def _model(spec, seed=0):
    sglang_runtime.ensure(spec.kind.format.own_backend or "flashinfer_trtllm")
    return sglang_runtime.prepared_model(spec, _ckpt(spec, seed))


def _staged(spec, tensors):
    """What a writer writes: SGLang's loader's bytes in a layer that is not laid out (checkpoint layout)."""
    staged = cpu_layers.TinyMoeModel(spec)
    staged.load_weights(cpu_layers.checkpoint_names(tensors).items())
    return staged


def _raw_write(model, staged, experts=None) -> None:
    """The writer: every parameter SGLang created, raw bytes (all experts, or the slots `experts`)."""
    src = dict(staged.experts.named_parameters())
    e = model.spec.num_experts
    for name, p in model.experts.named_parameters():
        if name not in src or src[name].shape != p.shape:
            continue
        if experts is None:
            p.data.copy_(src[name].data)
        elif p.dim() and p.shape[0] == e:
            for i in experts:
                p.data[i].copy_(src[name].data[i])


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def differences(model, fresh) -> list[str]:
    pa, pb = dict(model.experts.named_parameters()), dict(fresh.experts.named_parameters())
    return sorted(n for n in B.compared(model.experts) if not torch.equal(_bytes(pa[n]), _bytes(pb[n])))


def _pointers(model):
    return {n: p.data_ptr() for n, p in model.named_parameters()}


def _mixed(spec, base, new, experts):
    return {k: (new[k] if int(k.split(".")[1]) in experts else v) for k, v in base.items()}


def _manager(updater):
    """SGLang's scheduler-side session manager over one runner (its own begin / end, barrier included)."""
    import dataclasses
    from types import SimpleNamespace

    from sglang.srt.managers.scheduler_components.weight_updater import SchedulerWeightUpdaterManager

    runner = SimpleNamespace(weight_updater=updater)
    extra = {}
    if any(f.name == "tp_cpu_group" and f.init for f in dataclasses.fields(SchedulerWeightUpdaterManager)):
        from sglang.srt.distributed import get_tp_group

        extra["tp_cpu_group"] = get_tp_group().cpu_group
    return SchedulerWeightUpdaterManager(
        **extra,
        tp_worker=SimpleNamespace(weight_update_runners=lambda: [("target", runner)]),
        draft_worker=None,
        memory_saver_adapter=None,
        flush_cache=lambda **kw: True,
        is_fully_idle=lambda **kw: True,
    )


def _session(manager, write, rid=None):
    from sglang.srt.managers.io_struct import BeginWeightUpdateReqInput, EndWeightUpdateReqInput

    out = manager.begin_weight_update(BeginWeightUpdateReqInput(selector="all", rid=rid))
    assert out.success, out.message
    write()
    return manager.end_weight_update(EndWeightUpdateReqInput())


@pytest.mark.parametrize("kind", KINDS)
def test_a_loader_free_session_equals_a_fresh_load(kind):
    spec = SPECS[kind]
    model = _model(spec)
    ptrs = _pointers(model)
    staged = _staged(spec, _ckpt(spec, 1))
    out = _session(_manager(sglang_runtime.updater(model)), lambda: _raw_write(model, staged))
    assert out.success, out.message
    assert differences(model, _model(spec, 1)) == []
    assert _pointers(model) == ptrs
    st = layer_state.state_of(model.experts)
    assert st is None or st.clean


@pytest.mark.parametrize("kind", ["nvfp4", "fp8_tensor", "mxfp8", "bf16", "mxfp4_experts"])
def test_the_writers_hint_lays_out_only_the_experts_it_names(kind):
    spec = SPECS[kind]
    model = _model(spec)
    st = layer_state.state_of(model.experts)
    base, new = _ckpt(spec, 0), _ckpt(spec, 2)
    staged = _staged(spec, new)
    written = [1, 3]
    before = st.experts_prepared_total if st is not None else 0

    def write():
        if st is not None:  # only the named experts went back to checkpoint layout
            assert {g: ids for g, ids in st.dirty_experts().items()} == {g: written for g in st.prepared}
        _raw_write(model, staged, written)

    out = _session(_manager(sglang_runtime.updater(model)), write, rid=session_writes.rid({LAYER: written}))
    assert out.success, out.message
    assert differences(model, sglang_runtime.prepared_model(spec, _mixed(spec, base, new, written))) == []
    if st is not None:
        assert st.experts_prepared_total - before == len(written) * len(st.prepared)
        assert st.clean


def _bad_value(t: torch.Tensor, code: str) -> None:
    """The last value of `t` (one expert's slice) made what `code` refuses."""
    flat = t.reshape(-1)
    if code == E4M3_BYTES:
        flat.view(torch.uint8)[-1] = 0x7F
    elif code == UE8M0_BYTES:
        flat.view(torch.uint8)[-1] = 0xFF
    else:
        flat[-1] = math.nan


def _scale_param(fmt, scalar: bool) -> str | None:
    """The format's first block-scale parameter (or per-tensor / input scale, `scalar`) a load checks the values of."""
    from sglang_trtllm_moe.formats.load_rules import BLOCK_SCALE

    if scalar:
        names = [n for n in fmt.scalar_params if n not in fmt.recomputed_params]
    else:
        names = [p.name for p in fmt.params if fmt.load_rule(p.name).kind == BLOCK_SCALE]
    return names[0] if names else None


#: (kind, which scale): every kind of layer with each kind of scale parameter it has
CASES = [
    (kind, which)
    for kind in KINDS
    for which, scalar in (("block_scale", False), ("tensor_scale", True))
    if _scale_param(SPECS[kind].kind.format, scalar) is not None
]


@pytest.mark.parametrize(("kind", "which"), CASES, ids=[f"{k}-{w}" for k, w in CASES])
def test_a_refused_value_is_answered_and_its_expert_served_as_a_zero_expert(kind, which):
    spec = SPECS[kind]
    fmt = spec.kind.format
    model = _model(spec)
    staged = _staged(spec, _ckpt(spec, 1))
    name = _scale_param(fmt, which == "tensor_scale")
    t = getattr(staged.experts, name).data
    code = fmt.load_rule(name).value_rule(t.dtype)
    assert code is not None, f"{name} of {fmt.name}: no value rule for {t.dtype}"
    _bad_value(getattr(staged.experts, name).data[2], code)
    manager = _manager(sglang_runtime.updater(model))
    out = _session(manager, lambda: _raw_write(model, staged))
    assert not out.success
    assert LAYER in out.message and f"{name} of expert 2" in out.message, out.message
    assert "zero experts" in out.message
    # served: expert 2 every byte 0, the others as written (a fresh load of what the writer wrote), nothing NaN
    fresh = _model(spec, 1)
    for p in fmt.params:
        served, want = fmt.tensor(model.experts, p), fmt.tensor(fresh.experts, p)
        assert not bool(_bytes(served[2]).any()), f"{p.name} of the refused expert is not zero"
        for e in (0, 1, 3):
            assert torch.equal(_bytes(served[e]), _bytes(want[e])), f"{p.name} of expert {e} is not what was written"
    st = layer_state.state_of(model.experts)
    assert st is None or st.clean
    for s in fmt.compute_scalars(model.experts) if st is not None else ():
        v = getattr(model.experts, s).data.float()
        assert bool(torch.isfinite(v).all()), f"kernel scalar {s} is not finite after the fence"
    # the next good session is exact again
    out = _session(manager, lambda: _raw_write(model, _staged(spec, _ckpt(spec, 3))))
    assert out.success, out.message
    assert differences(model, _model(spec, 3)) == []


def test_a_fenced_expert_contributes_zero_to_the_forward(monkeypatch):
    """NVFP4 through SGLang's TopK and FusedMoE on the emulator: every token routed to the refused expert (and one
    other) gets exactly what the other expert alone gives — the output of a model whose refused expert is zero."""
    monkeypatch.setenv("SGLANG_TRTLLM_MOE_EMULATE", "1")
    spec = SPECS["nvfp4"]
    model = _model(spec)
    staged = _staged(spec, _ckpt(spec, 1))
    staged.experts.w2_weight_scale.data[2].reshape(-1)[-1:].view(torch.uint8).fill_(0xFF)
    out = _session(_manager(sglang_runtime.updater(model)), lambda: _raw_write(model, staged))
    assert not out.success
    torch.manual_seed(0)
    x = torch.randn(6, spec.hidden, dtype=torch.bfloat16)
    logits = torch.full((6, spec.num_experts), -10.0)
    logits[:, 2], logits[:, 0] = 5.0, 4.0
    y, _ = sglang_runtime.forward(model.experts, x, logits)
    assert bool(torch.isfinite(y.float()).all())
    # the reference: a fresh load of what was written with expert 2 a zero expert (weights and block scales 0; its
    # input scales no larger than the others', so the layer's shared 1 / max(input_scale) is theirs)
    ref_ckpt = dict(_ckpt(spec, 1))
    for k in list(ref_ckpt):
        if not k.startswith("experts.2."):
            continue
        proj, suffix = k.split(".")[2], k.split(".", 3)[3]
        if suffix in ("weight", "weight_scale"):
            ref_ckpt[k] = torch.zeros_like(ref_ckpt[k])
        elif suffix == "input_scale":
            ref_ckpt[k] = max(ref_ckpt[f"experts.{e}.{proj}.input_scale"] for e in (0, 1, 3)).clone()
    ref, _ = sglang_runtime.forward(sglang_runtime.prepared_model(spec, ref_ckpt).experts, x, logits)
    assert torch.equal(y, ref)


def test_an_in_process_hint_and_a_malformed_rid():
    spec = SPECS["nvfp4"]
    model = _model(spec)
    st = layer_state.state_of(model.experts)
    manager = _manager(sglang_runtime.updater(model))
    from sglang.srt.managers.io_struct import BeginWeightUpdateReqInput

    out = manager.begin_weight_update(BeginWeightUpdateReqInput(rid=session_writes.RID_PREFIX + "{not json"))
    assert not out.success and "not JSON" in out.message
    assert st.clean, "a refused begin must leave the model laid out"
    session_writes.expect({"*": [0]})
    out = _session(manager, lambda: None)
    assert out.success and st.clean
    assert session_writes.take() is None, "the hint is consumed by the session that used it"
    with pytest.raises(ValueError, match="slot"):
        session_writes.expect({LAYER: [-1]})


def test_a_loaded_session_is_not_checked_again():
    """run_post_load=False (a load ran in the session): its writes were checked by the loader hooks; nothing here."""
    spec = SPECS["nvfp4"]
    model = _model(spec)
    u = sglang_runtime.updater(model)
    u.begin_weight_update()
    model.experts.w13_weight_scale.data[1].reshape(-1)[-1:].view(torch.uint8).fill_(0x7F)
    u.end_weight_update(run_post_load=False)
    assert sessions.last_refusal() is None


#: checkpoint projection of each shard (the sandbox's checkpoints: experts.<e>.<proj>.<suffix>)
PROJ = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}


#: kinds whose checkpoint holds the bytes a writer writes (not gpt-oss's all-expert tensors, not an online format's
#: BF16 sources, which SGLang's loader quantizes: there the writer writes the quantizer's output)
CONTRACT_KINDS = [k for k in KINDS if not SPECS[k].kind.format.fused and SPECS[k].kind.format.source_values is None]


@pytest.mark.parametrize("kind", CONTRACT_KINDS)
def test_a_writer_that_follows_the_writer_contract_alone_gets_a_fresh_load(kind):
    """The contract (sglang_trtllm_moe.writer_contract) is enough to write a session: a writer that knows only the
    checkpoint's tensors and the contract's placements (not SGLang's loader) writes every expert; after `end` the
    layer equals a fresh load of that checkpoint. The rendered contract names every parameter it places."""
    import sglang_trtllm_moe

    spec = SPECS[kind]
    model = _model(spec)
    new = _ckpt(spec, 4)
    contract = sglang_trtllm_moe.writer_contract(model, text=False)
    (layer,) = contract
    assert layer.layer == LAYER and layer.experts == spec.num_experts and layer.first_slot == 0
    text = sglang_trtllm_moe.writer_contract(model)
    for p in layer.params:
        assert p.placement, f"{p.name}: no placement traced from SGLang's loader"
        assert p.name in text

    def write():
        fmt = spec.kind.format
        for p in layer.params:
            view = next((fmt.tensor(model.experts, q) for q in fmt.params if q.name == p.name), None)
            view = getattr(model.experts, p.name).data if view is None else view
            suffix = p.name.split("_", 1)[1]
            for e in range(spec.num_experts):
                for w in p.placement:
                    dst = view[e][w.index(w.dst)]
                    proj = "up_proj" if (w.shard == "w1" and not spec.gated) else PROJ[w.shard]  # non-gated: one half
                    src = new[f"experts.{e}.{proj}.{suffix}"]
                    if w.src is None:
                        dst.fill_(w.value)
                    elif not w.src:  # one value per expert and shard (0-dim or [1] in a checkpoint)
                        dst.copy_(src.reshape(-1)[0])
                    else:
                        dst.copy_(src[w.index(w.src)])

    out = _session(_manager(sglang_runtime.updater(model)), write)
    assert out.success, out.message
    assert differences(model, _model(spec, 4)) == []


def test_explain_prints_the_writer_contract_of_a_models_format(tmp_path, capsys):
    """`sglang-trtllm-moe explain --writer-contract`: the format-level contract from config.json alone."""
    from sglang_trtllm_moe import cli
    from sglang_trtllm_moe.sandbox import checkpoints as ck

    d = ck.write(str(tmp_path / "ds"), ck.TinySpec("deepseek_v3", "nvfp4", seed=0))
    assert cli.main(["explain", "--model", d, "--sm", "100", "--writer-contract", "--no-sglang"]) == 0
    out = capsys.readouterr().out
    assert "writer contract (loader-free sessions) for nvfp4" in out
    assert "w13_weight_scale (w13, block_scale; values checked at the end): laid out in place" in out
    assert "w13_input_scale (w13, input_scale; values checked at the end)" in out


@pytest.mark.sglang(
    SPAWN_RANKS.releases,
    reason="weight-update sessions that end with run_post_load (loader-free writers) arrive upstream in 0.5.21, with "
    "the per-rank placement the two-rank test needs (runtime_context.SpawnRanks)",
)
def test_the_ranks_agree_on_a_refusal_and_fence_the_same_expert(tmp_path):
    """Two CPU ranks (gloo), TP 2 then EP 2: rank 1's shard of one expert holds a NaN e4m3 byte. Each rank checks
    its own shard; one all-gather of the refusals makes both answer the same refusal and fence the same expert — TP:
    both shards of expert 2 (the other rank's shard was fine), EP: the slot on the rank that holds it."""
    from .support import ranks

    scenarios = [{"name": "tp2", "tp": 2, "ep": 1}, {"name": "ep2", "tp": 2, "ep": 2}]
    procs = ranks.launch("tests.support.loader_free_ranks", 2, {"scenarios": scenarios}, tmp_path)
    results = ranks.collect(procs, tmp_path, timeout=600)
    for name, expert in (("tp2", 0), ("ep2", 2)):
        got = [r[name] for r in results]
        for r in got:
            assert "error" not in r, r.get("trace", r)
        assert got[0]["refusal"] is not None and got[0]["refusal"] == got[1]["refusal"], got
        assert f"w13_weight_scale of expert {expert}" in got[0]["refusal"], got[0]["refusal"]
        assert all(r["clean"] for r in got)
    tp = [r["tp2"] for r in results]
    assert tp[0]["zero"] == tp[1]["zero"] == [0] and tp[0]["same"] == tp[1]["same"] == [1, 2, 3], tp
    ep = [r["ep2"] for r in results]  # 2 local experts each: global 2 is rank 1's first
    assert ep[0]["zero"] == [] and ep[0]["same"] == [0, 1], ep
    assert ep[1]["zero"] == [0] and ep[1]["same"] == [1], ep
