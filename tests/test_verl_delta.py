"""verl 0.9.1's sparse delta weight sync through the plugin (issue #49), with verl's own code from its PyPI wheel
(tests/support/verl_delta.py: its receiver `delta_loader.apply_delta` registered with `--custom-weight-loader` and
named as each flush's `load_format`, the flushes built by its sender code) and a tiny BF16 Qwen3-MoE — the format the
plugin prepares itself before 0.5.23, where SGLang does on 0.5.23.

- `sglang.Engine(device="cpu")`, on 0.5.12 and 0.5.22 (ENGINE_SAMPLE; 0.5.12 is the release verl 0.9.1 pins;
  tests/support/verl_delta_engine.py): the Engine starts on B' (A with ~1 % of the elements of 20 tensors changed:
  experts of both MoE layers, an attention weight, a router); verl's seed sync of A, then the delta A -> B': the
  served bytes and greedy tokens are the fresh load's, no NaN anywhere; verl's verify sweep of B' passes; a sweep of
  B'' (one expert element off) is answered (False, "... top offenders: [expert ...]") and the served weights are B'
  again, as after a corrupted flush ("delta checksum mismatch") and a flush whose last tensor fails in SGLang's
  loader after its experts were written — each answered, never raised, the Engine alive.
- the README's CPU HTTP recipe on 0.5.23 with `--custom-weight-loader` and begin/end sessions (verl 0.9.1 opens
  none; 0.5.23 refuses tensor updates outside one): the same flow, each flush POSTed by a client process as SGLang's
  serializer hands it over; the weight checker's checksums are the fresh load's after the delta and after every
  failed flush (HTTP 400 with verl's message), and the server keeps serving.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from packaging.specifiers import SpecifierSet

from sglang_trtllm_moe.sandbox.releases import ENGINE_RELEASES, RL_LOOP_RELEASES

from .support import http_client, matrix
from .support import http_server as hs
from .support import verl_delta as vd
from .support.helpers import REPO, last_json

#: the Engine flow runs where the HTTP recipe does not (tests/test_engine_smoke.py's split)
ENGINE_ONLY = ENGINE_RELEASES & SpecifierSet(f"<{min(s.version for s in RL_LOOP_RELEASES)}")
#: ... on these of them (one Engine ~45 s a release on the CI box; the CI budget): 0.5.12 is the release verl 0.9.1
#: pins, 0.5.22 the newest Engine-only one. Every release runs the layer-level proofs of the same writes
#: (tests/test_custom_loaders.py: verl's masking copy_, a raising loader, the step-aside)
ENGINE_SAMPLE = ("0.5.12", "0.5.22")
_INSTALLED = matrix.installed_release()

ENGINE_STEPS = (
    "engine up",
    "seed A",
    "delta A -> B'",
    "verify B' passes",
    "verify B'' fails",
    "corrupted flush",
    "fails after writing experts",
)


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    if vd.wheel() is None:
        pytest.fail(f"no verl {vd.VERSION} wheel in the env root: ci/make-env downloads it (or set {vd.ENV_WHEEL})")
    return vd.make_site(tmp_path_factory.mktemp("verl-site"))


_ENGINE: dict = {}


@pytest.mark.sglang(
    str(ENGINE_ONLY),
    reason="sglang.Engine as sandbox/engine.py drives it; from RL_LOOP_RELEASES on the HTTP recipe runs the flow "
    "(sandbox/releases.py)",
)
@pytest.mark.skipif(
    _INSTALLED is not None and str(_INSTALLED) not in ENGINE_SAMPLE and ENGINE_ONLY.contains(_INSTALLED),
    reason=f"sglang {_INSTALLED}: the verl Engine flow runs on {', '.join(ENGINE_SAMPLE)} only (CI budget); this "
    "release's custom-loader writes are proven on its layers (tests/test_custom_loaders.py)",
)
@pytest.mark.parametrize("step", ENGINE_STEPS)
def test_verl_delta_on_the_engine(site, step):
    if not _ENGINE:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), site, os.environ.get("PYTHONPATH", "")])}
        proc = subprocess.run(
            [sys.executable, "-m", "tests.support.verl_delta_engine", site],
            cwd=str(REPO),
            capture_output=True,
            text=True,
            timeout=900,
            env=env,
            check=False,
        )
        _ENGINE.update(last_json(proc))
    steps = {c["step"]: c for c in _ENGINE["steps"]}
    other = [c for c in _ENGINE["steps"] if not c["ok"] and c["step"] not in ENGINE_STEPS]
    assert not other, f"{other}\nSGLang's output:\n{_ENGINE['log']}"
    assert step in steps, f"step {step!r} did not run: {list(steps)}\nSGLang's output:\n{_ENGINE['log']}"
    assert steps[step]["ok"], steps[step]["detail"]


# ---- the README's CPU HTTP recipe on 0.5.23 ----------------------------------------------------------------------


def _flush_step(work: Path, label: str, flush: list) -> dict:
    from safetensors.torch import save_file

    path = work / f"{label}.safetensors"
    save_file({n: t.contiguous() for n, t in flush}, str(path))
    tensors = {"file": str(path), "load_format": vd.LOADER_FQN}
    return {"label": label, "path": "/update_weights_from_tensor", "tensors": tensors}


def _sync(work: Path, label: str, flushes: list) -> list[dict]:
    """One sync as a trainer sends it: a session, the flushes, the end; then the served weights' checksums and
    tokens (plain POSTs of the same client)."""
    steps = [{"label": f"{label} begin", "path": "/begin_weight_update", "body": {}}]
    steps += [_flush_step(work, f"{label} {i}", f) for i, f in enumerate(flushes)]
    steps += [
        {"label": f"{label} end", "path": "/end_weight_update", "body": {}},
        {"label": f"{label} checksums", "path": "/weights_checker", "body": {"action": "checksum"}},
        {"label": f"{label} tokens", "path": "/generate", "body": hs.gen_body(PROMPTS, 4)},
    ]
    return steps


PROMPTS = [[5, 17, 42, 99, 260, 311, 7], [3, 9, 27, 81]]


@pytest.fixture(scope="module")
def http(site, tmp_path_factory):
    pytest.importorskip("xgrammar", reason="SGLang's detokenizer imports xgrammar (ci/releases.tsv pin of 0.5.23)")
    pytest.importorskip("jsonschema", reason="SGLang's HTTP server imports jsonschema (ci/make-env base recipe)")
    from sglang_trtllm_moe.sandbox import checkpoints as ck

    from .support.verl_delta_engine import CHANGED, EXPERT

    work = tmp_path_factory.mktemp("verl-http")
    spec = ck.TinySpec("qwen3_moe", "bf16", seed=0)
    a = ck.checkpoint(spec)
    b = vd.perturbed(a, list(CHANGED), share=0.01, seed=1)
    b2 = {**b, EXPERT: b[EXPERT].clone()}
    b2[EXPERT].view(-1)[7] += 1
    c = vd.perturbed(b, list(CHANGED), share=0.01, seed=2)
    model_dir = ck.write_tensors(str(work / "B"), spec, b)
    syncs = {
        "seed": vd.seed_flushes(site, sorted(a.items())),
        "delta": vd.delta_flushes(site, a, b),
        "verify": vd.seed_flushes(site, sorted(b.items()), verify=True),
        "bad verify": vd.seed_flushes(site, sorted(b2.items()), bucket_bytes=1 << 40, verify=True),
        "corrupted": [vd.corrupted(vd.delta_flushes(site, b, c)[0])],
        "late": [vd.transposed_last(vd.delta_flushes(site, b, c)[0], "k_proj.weight")],
    }
    port = hs.free_port()
    env = hs.recipe_env()
    launch = None
    for cmd in hs.recipe():
        argv = hs.split(cmd.replace(hs.RECIPE_DIR, model_dir).replace(hs.RECIPE_PORT, str(port)), {})
        if argv[0] == "export":
            env.update(dict(x.split("=", 1) for x in argv[1:]))
        elif "sglang.launch_server" in cmd:
            launch = argv[:-1] if argv[-1] == "&" else argv
    assert launch is not None, "the README's HTTP recipe starts no server"
    # what the README's verl recipe adds: verl's loader registered, verl importable by the server
    launch += ["--custom-weight-loader", vd.LOADER_FQN]
    env["PYTHONPATH"] = os.pathsep.join([site, env["PYTHONPATH"]])
    server = hs.Server(launch, env, work / "server.log", port).start()
    logs: list[Path] = []
    try:
        server.wait_ready()
        fresh = server.post("/weights_checker", {"action": "checksum"}, timeout=300)
        tokens = server.post("/generate", hs.gen_body(PROMPTS, 4), timeout=300)
        assert fresh.ok and tokens.ok, (fresh, tokens, server.log_tail())
        steps = [s for label, flushes in syncs.items() for s in _sync(work, label, flushes)]
        spec = {"arch": "qwen3_moe", "quant": "bf16"}
        answers = {r["label"]: r for r in http_client.run(server.url, spec, steps, work, "client", logs, timeout=900)}

        yield {
            "fresh": dict(fresh.body["ranks"][0]["checksums"]),
            "tokens": [o["output_ids"] for o in tokens.body],
            "answers": answers,
            "alive": server.alive() and server.post("/generate", hs.gen_body(PROMPTS, 4), timeout=300).ok,
            "log": server,
        }
    finally:
        left = server.stop()
        managers = hs.shm_managers(logs)
        t0 = time.monotonic()
        while managers and time.monotonic() - t0 < 30:
            time.sleep(1)
            managers = hs.shm_managers(logs)
        for pid in managers:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, 9)
        assert not left, f"server processes still running after stop: {left}"


def _served(http, label: str) -> None:
    """After sync `label`: the checksums and tokens of the fresh load of B'."""
    a = http["answers"]
    sums = a[f"{label} checksums"]
    assert sums["status"] == 200, sums
    mine = dict(sums["body"]["ranks"][0]["checksums"])
    diff = sorted(n for n in set(mine) | set(http["fresh"]) if mine.get(n) != http["fresh"].get(n))
    assert not diff, f"after {label}: the served weights differ from the fresh load of B': {diff}"
    tokens = a[f"{label} tokens"]
    assert tokens["status"] == 200 and [o["output_ids"] for o in tokens["body"]] == http["tokens"], tokens


def _answers(http, label: str) -> list[dict]:
    answers = http["answers"].items()
    return [r for k, r in answers if k.startswith(f"{label} ") and r["path"] == "/update_weights_from_tensor"]


HTTP_MARK = pytest.mark.sglang(
    str(RL_LOOP_RELEASES),
    reason="the README's CPU server recipe with begin/end weight-update sessions (sandbox/releases.py "
    "RL_LOOP_RELEASES)",
)


@HTTP_MARK
def test_http_seed_delta_and_verify_equal_a_fresh_load(http):
    for label in ("seed", "delta", "verify"):
        answers = _answers(http, label)
        assert answers and all(r["status"] == 200 and r["body"]["success"] for r in answers), (label, answers)
    seeded = dict(http["answers"]["seed checksums"]["body"]["ranks"][0]["checksums"])
    assert any(seeded[n] != http["fresh"][n] for n in seeded), "the seed of A changed nothing of B'"
    _served(http, "delta")
    _served(http, "verify")


@HTTP_MARK
@pytest.mark.parametrize(
    "label, message",
    [
        ("bad verify", "mlp.experts.3.down_proj.weight"),
        ("corrupted", "delta checksum mismatch"),
        ("late", "the served weights are as before the request, bit for bit"),
    ],
)
def test_http_a_failed_flush_is_answered_and_changes_nothing(http, label, message):
    (answer,) = _answers(http, label)
    assert answer["status"] == 400 and not answer["body"]["success"], answer
    assert message in answer["body"]["message"], answer
    _served(http, label)
    assert http["alive"], http["log"].log_tail()
