"""verl 0.9.1's sparse delta sync against `sglang.Engine(device="cpu")` through the plugin, on the installed release:
verl's own loader registered with `custom_weight_loader` and named as each flush's `load_format`, the flushes built by
verl's own sender code (tests/support/verl_delta.py), a tiny BF16 Qwen3-MoE.

The reference is the Engine's own fresh load: it starts on B' (A with about 1 % of the elements of 20 tensors
changed: experts of both MoE layers, an attention weight, a router), then takes verl's seed sync of A, then the delta
A -> B', which must give the fresh load's bytes and greedy tokens back; verl's verify sweep of B' must pass, and a
sweep of B'' (one expert element off) must fail naming the expert — then, and after a corrupted flush and a flush that
fails after writing experts, the Engine answers (False, message) and serves B' byte for byte.

    python -m tests.support.verl_delta_engine SITE      one JSON line: {"steps": [...], "release": ..., "log": ...}
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import traceback

os.environ.setdefault("OMP_NUM_THREADS", os.environ.get("SGLANG_TRTLLM_MOE_TEST_THREADS", "1"))

PROMPTS = [[5, 17, 42, 99, 260, 311, 7], [3, 9, 27, 81]]
#: the tensors the training step changes (about 1 % of their elements): experts of both MoE layers, one attention
#: weight, one router — 20 in all
PROJ = ("gate", "up", "down")
CHANGED = (
    *(f"model.layers.{i}.mlp.experts.{e}.{p}_proj.weight" for i in (0, 1) for e in (0, 3, 6) for p in PROJ),
    "model.layers.0.self_attn.k_proj.weight",
    "model.layers.1.mlp.gate.weight",
)
EXPERT = "model.layers.1.mlp.experts.3.down_proj.weight"


def flow(site: str, work: str, steps) -> None:
    from sglang_trtllm_moe.compat.features import UPDATE_SESSIONS
    from sglang_trtllm_moe.sandbox import checkpoints as ck
    from sglang_trtllm_moe.sandbox.engine import TinyEngine, differences

    from . import verl_delta as vd

    spec = ck.TinySpec("qwen3_moe", "bf16", seed=0)
    a = ck.checkpoint(spec)
    b = vd.perturbed(a, list(CHANGED), share=0.01, seed=1)
    b2 = dict(b)
    b2[EXPERT] = b[EXPERT].clone()
    b2[EXPERT].view(-1)[7] += 1
    path = ck.write_tensors(os.path.join(work, "B"), spec, b)

    eng = TinyEngine(path, workdir=work, log=os.path.join(work, "sglang.log"), custom_weight_loader=[vd.LOADER_FQN])
    try:
        fresh, tokens = eng.state(), eng.generate(PROMPTS)
        experts = [n for n in fresh if ".experts." in n]
        steps.check("engine up", bool(experts), f"fresh load of B': {len(fresh)} tensors, greedy tokens {tokens}")

        def sync(flushes: list) -> tuple[bool, str]:
            """One sync: every flush through verl's loader (in one session where the release has them)."""
            if UPDATE_SESSIONS.present():
                eng.begin()
            try:
                for f in flushes:
                    ok, msg = eng.update_from_tensor(f, load_format=vd.LOADER_FQN, check=False)
                    if not ok:
                        return ok, msg
                return True, ""
            finally:
                if UPDATE_SESSIONS.present():
                    eng.end()

        def served(step: str, ok_msg: tuple, want_ok: bool, want_in: str, what: str) -> bool:
            state = eng.state()
            diff = differences(state, fresh)
            nan = [n for n in state if state[n].is_floating_point() and bool(state[n].isnan().any())]
            got = eng.generate(PROMPTS)
            ok, msg = ok_msg
            return steps.check(
                step,
                ok == want_ok and want_in in str(msg) and not diff and not nan and got == tokens,
                f"{what}: ({ok}, {str(msg)[:300]!r}); {len(diff)} of {len(state)} tensors differ from the fresh load "
                f"of B' ({', '.join(diff[:4]) or 'byte for byte equal'}), {len(nan)} hold NaN; greedy tokens "
                f"{'equal' if got == tokens else 'DIFFER: ' + str(got)}",
            )

        seed = vd.seed_flushes(site, sorted(a.items()))
        ok, msg = sync(seed)
        seeded = eng.state()
        moved = differences(seeded, fresh)
        steps.check(
            "seed A",
            ok and bool(moved) and all(".experts." in n or "qkv" in n or ".gate." in n for n in moved),
            f"verl's seed sync of A ({len(seed)} flushes): ({ok}, {msg[:200]!r}); {len(moved)} served tensors differ "
            f"from B' ({', '.join(moved[:6])})",
        )
        delta = vd.delta_flushes(site, a, b)
        served("delta A -> B'", sync(delta), True, "", f"verl's delta A -> B' ({len(delta)} flush(es))")
        verify = vd.seed_flushes(site, sorted(b.items()), verify=True)
        served("verify B' passes", sync(verify), True, "", f"verl's verify sweep of B' ({len(verify)} flushes)")
        # one flush: the sweep is one request (verl fails at its last flush; flushes before it are requests of their
        # own, written and answered before it)
        bad = vd.seed_flushes(site, sorted(b2.items()), bucket_bytes=1 << 40, verify=True)
        served(
            "verify B'' fails",
            sync(bad),
            False,
            "mlp.experts.3.down_proj.weight",
            f"verl's verify sweep of B'' ({EXPERT} one element off): refused naming it, the served weights put back",
        )
        c = vd.perturbed(b, list(CHANGED), share=0.01, seed=2)
        spoilt = vd.corrupted(vd.delta_flushes(site, b, c)[0])
        served("corrupted flush", sync([spoilt]), False, "checksum mismatch", "a flush changed after its checksum")
        late = vd.transposed_last(vd.delta_flushes(site, b, c)[0], "k_proj.weight")
        served(
            "fails after writing experts",
            sync([late]),
            False,
            "(2 MoE layer(s) it wrote and the other parameters copied back",
            "a flush whose last tensor (k_proj, transposed) fails in SGLang's loader after its experts were written",
        )
    finally:
        eng.shutdown()


def main(argv=None) -> int:
    from sglang_trtllm_moe.sandbox.rl_loop import Steps
    from sglang_trtllm_moe.sandbox.runtime import release

    argv = sys.argv[1:] if argv is None else argv
    site = argv[0]
    sys.path.insert(0, site)
    os.environ["PYTHONPATH"] = os.pathsep.join([site, *filter(None, [os.environ.get("PYTHONPATH")])])
    steps = Steps(out=sys.stderr)
    work = tempfile.mkdtemp(prefix="sglang-trtllm-moe-verl-delta-")
    log_tail = ""
    try:
        flow(site, work, steps)
    except Exception as e:  # noqa: BLE001 - reported as a failed step, with SGLang's own output
        steps.check("flow", False, f"{type(e).__name__}: {str(e)[:500]}", traceback=traceback.format_exc()[-3000:])
    finally:
        log = os.path.join(work, "sglang.log")
        if os.path.exists(log):
            with open(log, errors="replace") as f:
                log_tail = f.read()[-6000:]
        shutil.rmtree(work, ignore_errors=True)
    print(json.dumps({"release": str(release()), "steps": steps.checks, "log": log_tail}))
    return 0


if __name__ == "__main__":  # sglang.Engine spawns its scheduler: the children import this module again
    sys.exit(main())
