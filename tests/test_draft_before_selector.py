"""A speculative draft under RL updates before 0.5.21 (issue #39), through SGLang's own scheduler entry points and
spec workers of the release (tests/support/spec_worker.py says what runs and what stands in): `EAGLEWorkerV2`,
`MultiLayerEagleWorkerV2` (two draft steps) and, on 0.5.11-0.5.12, the v1 `EAGLEWorker`.

What each release does, read from its code and checked here: a tensor request reaches the draft, then the target
(`EAGLEWorkerV2` / v1 `EAGLEWorker.update_weights_from_tensor`; `MultiLayerEagleWorkerV2` has none); a disk or
checkpoint-engine (IPC) request the target, then every draft runner (the spec worker's `update_weights_from_disk` /
`_ipc`); after each, every runner equals a fresh load of the new checkpoint, byte for byte. SGLang stops at the first
runner that answers False, so a tensor only the later runner refuses would be in the earlier one: the plugin checks
the whole request against every runner it reaches first (builtins/runner_requests.py `selected_runners_around`,
compat/update_runners.py), and a bad draft expert on disk / IPC or a bad target expert in a tensor bucket changes
neither runner. `update_weights_from_distributed` reaches the target alone (features.DISTRIBUTED_UPDATE_SKIPS_DRAFT):
the target equals a fresh load of the broadcast, the draft keeps its old bytes — and the plugin says so once per
scheduler, naming the draft and what to do; a scheduler without a draft hears nothing.

Not covered here: real NextN draft models (0.5.21+: tests/test_draft_moe.py).
"""

from __future__ import annotations

import logging
import tempfile

import pytest
import torch

from sglang_trtllm_moe.compat import features, update_runners
from sglang_trtllm_moe.sandbox import layers as cpu_layers

from .support import gloo_trainer, sglang_runtime, spec_worker
from .support.bad_updates import compared

pytestmark = pytest.mark.sglang(
    features.DISTRIBUTED_UPDATE_SKIPS_DRAFT.releases,
    reason="the releases whose distributed update leaves the draft stale (from 0.5.21 the manager loads every "
    "selected runner: tests/test_draft_moe.py)",
)

# The tensor test serializes CPU tensors in this process as SGLang's client does. Once any test of the session has run
# SGLang's monkey_patch_torch_reductions (its tensor update path does), SGLang's reducer raises IndexError for a CPU
# tensor unless the CPU sandbox's stand-in was in place first (sandbox/standins.py
# cpu_tensors_through_the_reduction_patch; idempotent): installed at collection, before any test runs.
if features.DISTRIBUTED_UPDATE_SKIPS_DRAFT.present():
    from sglang_trtllm_moe.sandbox import standins

    standins.cpu_tensors_through_the_reduction_patch()

SPEC = cpu_layers.MoeSpec(num_experts=4, hidden=256, intermediate=128)


@pytest.fixture(scope="module", autouse=True)
def runtime():
    sglang_runtime.ensure("flashinfer_trtllm")


def ckpt(seed):
    return cpu_layers.random_nvfp4_checkpoint(SPEC, seed=seed)


def _bytes(model) -> dict:
    names = compared(model.experts)
    return {n: p.data.reshape(-1).view(torch.uint8).clone() for n, p in model.experts.named_parameters() if n in names}


def differs_from_fresh(model, seed) -> list[str]:
    got, want = _bytes(model), _bytes(sglang_runtime.prepared_model(SPEC, ckpt(seed)))
    return [n for n in want if not torch.equal(got[n], want[n])]


#: the draft's layer is loaded from seed + DRAFT_SEED (a NextN layer's weights are not the target's)
DRAFT_SEED = 100


def both(seed) -> dict:
    """One request's tensors for both runners: the target's layer of `seed`, the draft's of seed + DRAFT_SEED."""
    target = spec_worker.named(spec_worker.Target, ckpt(seed))
    return {**target, **spec_worker.named(spec_worker.Draft, ckpt(seed + DRAFT_SEED))}


def malformed(named: dict, cls) -> tuple[dict, str]:
    """`named` with `cls`'s expert 3 gate weight one column too wide, last (after good tensors of its layer); and
    how a refusal names it (the layer, the expert)."""
    name = f"{cls.prefix}experts.3.gate_proj.weight"
    bad = named[name]
    bad_named = {**{k: v for k, v in named.items() if k != name}, name: torch.cat([bad, bad[:, :1]], 1)}
    return bad_named, f"{cls.prefix}experts: refused weight update of w13_weight (shard 'w1', expert 3)"


class Pair:
    """Target and draft (loaded from seed 0 and 0 + DRAFT_SEED) behind the release's scheduler, a spec worker of
    `kind` (spec_worker.WORKERS; MultiLayerEagleWorkerV2: two draft steps, each its own runner and model) and the
    target's worker."""

    def __init__(self, with_draft: bool = True, kind: str = "eagle_v2", seed: int = 0):
        self.target = sglang_runtime.prepared_model(SPEC, ckpt(seed), spec_worker.Target)
        steps = 2 if kind == "multi_layer_v2" else 1
        self.drafts = [
            sglang_runtime.prepared_model(SPEC, ckpt(seed + DRAFT_SEED), spec_worker.Draft) for _ in range(steps)
        ]
        self.draft = self.drafts[0]
        self.tp = spec_worker.tp_worker(spec_worker.runner(self.target))
        self.draft_runners = [spec_worker.runner(d) for d in self.drafts]
        self.spec = spec_worker.spec_worker(self.tp, self.draft_runners, kind) if with_draft else None
        self.scheduler = spec_worker.scheduler(self.tp, self.spec)

    def exact(self, seed) -> list[str]:
        """What differs from a fresh load of `both(seed)`, per runner."""
        out = [f"target.{n}" for n in differs_from_fresh(self.target, seed)]
        for i, d in enumerate(self.drafts):
            out += [f"draft{i}.{n}" for n in differs_from_fresh(d, seed + DRAFT_SEED)]
        return out

    def state(self) -> dict:
        out = {f"target.{k}": v for k, v in _bytes(self.target).items()}
        for i, d in enumerate(self.drafts):
            out.update({f"draft{i}.{k}": v for k, v in _bytes(d).items()})
        return out


#: the spec workers each test runs with (spec_worker.WORKERS); MultiLayerEagleWorkerV2 has no update_weights_from_tensor
#: before 0.5.21 (a tensor request to it is an AttributeError in SGLang itself), so the tensor tests leave it out
KINDS = list(spec_worker.WORKERS)
TENSOR_KINDS = [k for k in KINDS if k != "multi_layer_v2"]


def pair(kind: str) -> Pair:
    """A Pair with a spec worker of `kind`; skipped, with the release named, where this release has no such worker."""
    if spec_worker.worker_class(kind) is None:
        from sglang_trtllm_moe.compat import installed_version

        name = spec_worker.WORKERS[kind][1]
        pytest.skip(f"SGLang {installed_version()} has no {name} (the v1 worker left in 0.5.13)")
    return Pair(kind=kind)


def changed(before: dict, after: dict) -> list[str]:
    return [n for n in before if not torch.equal(before[n], after[n])]


class Said(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(record.getMessage())


@pytest.fixture
def said():
    h = Said()
    log = logging.getLogger("sglang_trtllm_moe")
    log.addHandler(h)
    try:
        yield h.lines
    finally:
        log.removeHandler(h)


def _ok(out):
    success = out.success if hasattr(out, "success") else out[0]
    message = out.message if hasattr(out, "message") else out[1]
    assert success, message


def tensor_request(named: dict):
    from sglang.srt.managers.io_struct import UpdateWeightsFromTensorReqInput
    from sglang.srt.utils import MultiprocessingSerializer

    return UpdateWeightsFromTensorReqInput(
        serialized_named_tensors=[MultiprocessingSerializer.serialize(list(named.items()))],
        load_format=None,
        flush_cache=False,
    )


def disk_request(named: dict):
    from sglang.srt.managers.io_struct import UpdateWeightFromDiskReqInput

    d = tempfile.mkdtemp(prefix="trtllm-moe-draft-")
    sglang_runtime.write_safetensors_checkpoint(d, {}, SPEC, named=named)
    return UpdateWeightFromDiskReqInput(model_path=d, load_format="auto")


@pytest.mark.parametrize("kind", TENSOR_KINDS)
def test_a_tensor_update_reaches_the_draft_then_the_target_exactly(said, kind):
    p = pair(kind)
    target_only = tensor_request(both(2))
    target_only.disable_draft_model = True
    for req, want in ((tensor_request(both(2)), [p.target, *p.drafts]), (target_only, [p.target])):
        runners = update_runners.selected_runners(p.scheduler, req, "update_weights_from_tensor")
        assert [r.model for r in runners] == want
    _ok(p.scheduler.update_weights_from_tensor(tensor_request(both(2))))
    assert p.exact(2) == []
    assert not [s for s in said if "draft" in s], said


@pytest.mark.parametrize("kind", KINDS)
def test_a_disk_update_reaches_the_target_then_the_draft_exactly(said, kind):
    p = pair(kind)
    # the runners the plugin checks a request against (compat/update_runners.py): exactly those SGLang loads
    runners = update_runners.selected_runners(p.scheduler, disk_request(both(1)), "update_weights_from_disk")
    assert [r.model for r in runners] == [p.target, *p.drafts]
    _ok(p.scheduler.update_weights_from_disk(disk_request(both(1))))
    assert p.exact(1) == []
    assert not [s for s in said if "draft" in s], said


def _refused(out) -> str:
    success = out.success if hasattr(out, "success") else out[0]
    message = out.message if hasattr(out, "message") else out[1]
    assert not success, message
    return message


def refused_unchanged(p: Pair, send, bad: tuple) -> None:
    """`send(named)` of a request with one malformed tensor (`malformed`'s (named, how it is named)) answers False
    naming it, and no byte of any runner changed."""
    before = p.state()
    named, name = bad
    message = _refused(send(named))
    assert name in message and "refused" in message, message
    assert changed(before, p.state()) == []


@pytest.mark.parametrize("kind", KINDS)
def test_a_disk_checkpoint_with_a_bad_draft_expert_changes_neither_runner(kind):
    """SGLang loads the target, then the draft, and stops at the draft's refusal: the target would already serve the
    new checkpoint. The plugin checks the checkpoint against both runners before the target loads any of it."""
    p = pair(kind)
    send = lambda named: p.scheduler.update_weights_from_disk(disk_request(named))  # noqa: E731
    refused_unchanged(p, send, malformed(both(3), spec_worker.Draft))
    _ok(p.scheduler.update_weights_from_disk(disk_request(both(4))))  # and a good one still lands in both
    assert p.exact(4) == []


@pytest.mark.parametrize("kind", TENSOR_KINDS)
def test_a_tensor_bucket_with_a_bad_target_expert_changes_neither_runner(kind):
    """The tensor path loads the draft first: without the whole-request check the draft would serve the bucket's
    draft tensors while the target refused its own."""
    p = pair(kind)
    send = lambda named: p.scheduler.update_weights_from_tensor(tensor_request(named))  # noqa: E731
    refused_unchanged(p, send, malformed(both(5), spec_worker.Target))
    refused_unchanged(p, send, malformed(both(5), spec_worker.Draft))  # the draft's own: refused by the draft first


@pytest.mark.parametrize("kind", KINDS)
def test_checkpoint_engine_buckets_reach_both_runners_and_a_bad_draft_expert_changes_neither(kind):
    """checkpoint-engine's flow (tests/support/checkpoint_engine.py: its worker loop, SGLang's extension and post hook
    of the release) through the scheduler's update_weights_from_ipc: the target, then the draft, each running every
    bucket. Good buckets: both equal a fresh load. A bucket with the draft's expert malformed after the target's
    experts: (False, the draft's tensor named), neither runner changed, no post hook ran."""
    from sglang_trtllm_moe.sandbox import models

    from .support import checkpoint_engine as ce

    p = pair(kind)
    server = ce.ParameterServer(models.buckets(sorted(both(6).items()), 4))
    with ce.installed(server):
        _ok(p.scheduler.update_weights_from_ipc(ce.request()))
    assert server.post_hook_ran and server.replies == [""] * 4 * (1 + len(p.drafts)), server.replies
    assert p.exact(6) == []

    servers = []

    def send(named):
        servers.append(ce.ParameterServer([list(named.items())]))
        with ce.installed(servers[-1]):
            return p.scheduler.update_weights_from_ipc(ce.request())

    refused_unchanged(p, send, malformed(both(7), spec_worker.Draft))
    assert not servers[0].post_hook_ran


@pytest.mark.parametrize("how", ["disk", "tensor", "ipc"])
def test_each_tensor_is_checked_once_for_its_runner_per_request(monkeypatch, how):
    """Each runner's entry point checks the request against the layers of every runner still to load, and the
    request remembers what was checked for which runner (updates/request.py): each expert tensor is checked
    once, for the runner whose layer it targets (not once per runner's entry point; checkpoint-engine hands each
    runner's loop new views of its buffer, so the draft's are checked again in its turn), and a checkpoint's values
    are read from the files once per runner. Counted through the plugin's own per-tensor check and file reads
    (spies around the real functions); both runners still equal a fresh load."""
    from sglang_trtllm_moe.updates import bucket_validation, checkpoint_headers

    from .support import checkpoint_engine as ce

    checked, reads = [], []
    real_check, real_read = bucket_validation.check_items, checkpoint_headers.read_tensors

    def check_items(model, named, *a, **k):
        found = real_check(model, named, *a, **k)
        checked.extend(named[i][0] for i, _ in found.checked)
        return found

    def read_tensors(headers, names):
        reads.append(len(names))
        return real_read(headers, names)

    monkeypatch.setattr(bucket_validation, "check_items", check_items)
    monkeypatch.setattr(checkpoint_headers, "read_tensors", read_tensors)
    p = Pair()
    named = both(8)
    if how == "disk":
        req = disk_request(named)  # written before counting starts
        checked.clear()
        _ok(p.scheduler.update_weights_from_disk(req))
        assert len(reads) == 2, reads  # the target's scales, the draft's: each once
    elif how == "tensor":
        _ok(p.scheduler.update_weights_from_tensor(tensor_request(named)))
    else:
        server = ce.ParameterServer([list(named.items())])
        with ce.installed(server):
            _ok(p.scheduler.update_weights_from_ipc(ce.request()))
    want = list(named)
    if how == "ipc":  # each runner's loop gets new views of the buffer: the draft's tensors again in its own turn
        want += [n for n in named if n.startswith(spec_worker.Draft.prefix)]
    assert sorted(checked) == sorted(want), (len(checked), len(want))
    assert p.exact(8) == []


def test_the_weight_checker_covers_the_draft_through_the_scheduler():
    """SGLang's weight checker through the release's scheduler (`check_weights`: from the 0.5.13 manager it also
    asks the draft's runner, `_get_draft_model_runner`, and merges its checksums under `draft.`), each runner's
    WeightChecker as its ModelRunner builds it (sglang_runtime.weight_checker) over plugin-prepared layers:
    snapshot, reset_tensors, a disk update of the same checkpoint, compare passes on both runners; a flipped byte of
    the draft's expert weight is caught; the checksum lists the draft's expert tensors under `draft.`, equal to a
    fresh pair's."""
    from sglang.srt.managers.io_struct import CheckWeightsReqInput

    if not features.SCHEDULER_UPDATE_MANAGER.present():
        from sglang_trtllm_moe.compat import installed_version

        pytest.skip(
            f"SGLang {installed_version()}'s scheduler checks the target's weights only (its mixin's check_weights; "
            "the draft joins with the 0.5.13 manager)"
        )

    def checked(p):
        for runner in (p.tp.model_runner, *p.draft_runners):
            runner._weight_checker = sglang_runtime.weight_checker(runner.model)
        return p

    def check(p, action):
        with sglang_runtime.cpu_checksum(action):
            out = p.scheduler.check_weights(CheckWeightsReqInput(action=action))
        return out.success, str(out.message)[:400], out.payload

    def checksums(p) -> dict:
        ok, msg, payload = check(p, "checksum")
        assert ok, msg
        first = payload[0] if isinstance(payload, list) else payload
        return dict(first.checksums if hasattr(first, "checksums") else first["checksums"])

    p = checked(Pair())
    _ok(p.scheduler.update_weights_from_disk(disk_request(both(9))))
    for action in ("snapshot", "reset_tensors"):
        ok, msg, _ = check(p, action)
        assert ok, (action, msg)
    assert p.exact(9) != []  # reset_tensors changed the served bytes
    _ok(p.scheduler.update_weights_from_disk(disk_request(both(9))))
    ok, msg, _ = check(p, "compare")
    assert ok, msg
    check(p, "snapshot")
    flat = p.draft.experts.w2_weight.data.view(torch.uint8).reshape(-1)
    flat[flat.numel() // 3] ^= 0x10
    try:
        ok, msg, _ = check(p, "compare")
        assert not ok and "w2_weight" in msg, msg
    finally:
        flat[flat.numel() // 3] ^= 0x10
    sums = checksums(p)
    draft_experts = sorted(k for k in sums if k.startswith("draft.") and "experts.w" in k)
    assert draft_experts and any(not k.startswith("draft.") and "experts.w" in k for k in sums), sorted(sums)
    assert checksums(checked(Pair(seed=9))) == sums  # a fresh load of the same checkpoint


def test_a_worker_that_cannot_say_its_runners_refuses_a_request_with_a_draft():
    """A spec worker this release's spellings do not fit, or one that fails when asked for its runners: the runners
    are not told (None, never the scheduler's error); with a speculative draft the request is refused before any
    runner loads it (the probe that found nothing is a missing target: request-checks steps aside), without one the
    target's own checks keep it whole."""
    from types import SimpleNamespace

    from sglang_trtllm_moe import capabilities
    from sglang_trtllm_moe.builtins import runner_requests

    class Unbuilt:
        def weight_update_runners(self):
            raise RuntimeError("runners not built yet")

    p = Pair()
    req = disk_request(both(1))
    assert runner_requests.selected_models(p.scheduler, req, "update_weights_from_disk") == (p.target, p.draft)
    odd = SimpleNamespace(tp_worker=p.tp, draft_worker=SimpleNamespace(server_args=None))  # no runner spelling
    assert runner_requests.selected_models(odd, req, "update_weights_from_disk") is None
    failing = SimpleNamespace(tp_worker=Unbuilt(), draft_worker=None)
    assert runner_requests.selected_models(failing, req, "update_weights_from_disk") is None
    assert runner_requests.unknown_runners(failing, "update_weights_from_disk") is None
    try:
        why = runner_requests.unknown_runners(odd, "update_weights_from_disk")
        assert why and "refused" in why and "draft" in why, why
        d = capabilities.decide("request-checks")
        assert d.status == capabilities.STEPPED_ASIDE and runner_requests.DRAFT_RUNNERS in d.why[0], d
    finally:
        capabilities.reset_for_tests()


def test_a_distributed_update_leaves_the_draft_stale_and_the_plugin_says_so(said):
    """Two broadcasts through the release's scheduler: with a draft (target updated, draft's bytes kept, one
    warning naming the draft and what to do), then through a scheduler without one (updated, nothing said)."""
    from sglang.srt.managers.io_struct import UpdateWeightsFromDistributedReqInput

    p = Pair()
    plain = Pair(with_draft=False)
    draft_before = _bytes(p.draft)
    buckets = []
    for seed in (5, 6):
        new = cpu_layers.checkpoint_names(ckpt(seed))
        buckets.append(gloo_trainer.ordered(new))
    with gloo_trainer.running([buckets[0], buckets[0], buckets[1]]) as (port, trainer):
        # one update group, received by both targets' owners in turn (each receive is one broadcast)
        owner = p.tp.model_runner
        owner = getattr(owner, "weight_updater", owner)
        if not hasattr(owner, "_model_update_group"):  # the ModelRunner shell before 0.5.16 (its __init__ sets it)
            owner._model_update_group = {}
        ok, msg = owner.init_weights_update_group("127.0.0.1", port, 1, 2, gloo_trainer.GROUP, backend="gloo")
        assert ok, msg
        plain_owner = plain.tp.model_runner
        plain_owner = getattr(plain_owner, "weight_updater", plain_owner)
        if not hasattr(plain_owner, "_model_update_group"):
            plain_owner._model_update_group = {}
        plain_owner._model_update_group.update(owner._model_update_group)

        for _ in range(2):  # a step's buckets: said once
            req = UpdateWeightsFromDistributedReqInput(**gloo_trainer.request_fields(buckets[0]), flush_cache=False)
            _ok(p.scheduler.update_weights_from_distributed(req))
        assert differs_from_fresh(p.target, 5) == []
        after = _bytes(p.draft)
        assert [n for n in draft_before if not torch.equal(after[n], draft_before[n])] == []  # as the release does
        told = [s for s in said if "update_weights_from_distributed into the target model only" in s]
        assert len(told) == 1, said
        assert spec_worker.DRAFT_PATH in told[0] and "update_weights_from_tensor" in told[0], told[0]
        assert "0.5.21" in told[0], told[0]

        req = UpdateWeightsFromDistributedReqInput(**gloo_trainer.request_fields(buckets[1]), flush_cache=False)
        _ok(plain.scheduler.update_weights_from_distributed(req))
        assert differs_from_fresh(plain.target, 6) == []
        assert len([s for s in said if "draft" in s]) == 1, said
        owner.destroy_weights_update_group(gloo_trainer.GROUP)
    assert trainer.exitcode == 0


def test_the_start_up_log_and_explain_say_it_too(tmp_path, monkeypatch, said):
    """The same note where a user looks before the first update: `explain --speculative-algorithm` and the
    selection hook's start-up warning (builtins/selection_hooks.say_stale_draft)."""
    from types import SimpleNamespace

    from sglang_trtllm_moe.builtins.selection_hooks import say_stale_draft
    from sglang_trtllm_moe.compat import platform
    from sglang_trtllm_moe.explain import explain_model
    from sglang_trtllm_moe.sandbox import checkpoints as ck

    model = ck.write(str(tmp_path / "tiny"), ck.TinySpec(arch="deepseek_v3", quant="fp8_block"))
    rep = explain_model(model, sm=100, run_sglang=False, speculative_algorithm="EAGLE")["draft_updates"]
    assert rep["stale_after"] == ["update_weights_from_distributed"], rep
    assert "keeps serving its old weights" in rep["reason"] and "update_weights_from_disk" in rep["reason"], rep
    assert "draft_updates" not in explain_model(model, sm=100, run_sglang=False)
    # what ServerArgs say of the draft, read as compat/platform reads a half-resolved ServerArgs (its view: tested
    # with real ServerArgs by tests/test_selection.py); here, what is said
    monkeypatch.setattr(platform, "resolved_view", lambda server_args: server_args)
    args = SimpleNamespace(speculative_algorithm="EAGLE", speculative_draft_model_path=spec_worker.DRAFT_PATH)
    text = say_stale_draft(args)
    assert text is not None and spec_worker.DRAFT_PATH in text and "(EAGLE)" in text, text
    assert say_stale_draft(SimpleNamespace(speculative_algorithm=None, speculative_draft_model_path=None)) is None
    # n-gram speculation has no draft model: nothing goes stale, nothing is said
    assert say_stale_draft(SimpleNamespace(speculative_algorithm="NGRAM", speculative_draft_model_path=None)) is None
    ngram = explain_model(model, sm=100, run_sglang=False, speculative_algorithm="NGRAM")["draft_updates"]
    assert ngram["stale_after"] == [], ngram
    from sglang_trtllm_moe.builtins.draft_updates import warn_stale_draft_after

    worker = SimpleNamespace(server_args=SimpleNamespace(speculative_algorithm="NGRAM"))
    before = len(said)  # the EAGLE start-up warning above
    assert warn_stale_draft_after(SimpleNamespace(success=True), SimpleNamespace(draft_worker=worker)) is None
    assert said[before:] == [] and before == 1, said
