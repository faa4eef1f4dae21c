"""sglang.Engine(device="cpu") through the plugin on the installed release, in under a minute: what an RL framework
pinned to an older SGLang does with its rollout engine — start it, generate, push weights from disk and as tensor
buckets, send one bad bucket — each state read back and compared byte for byte with a fresh load.

The fresh load is the Engine's own: it starts on checkpoint A, so its first state *is* a fresh load of A, and every
update that ends on A must give those bytes and those greedy tokens back. B is reached both ways (disk, then tensors
from A) and the two must agree byte for byte. No second process: SGLang's ModelRunner set-up that the full RL loop
(sandbox/rl_loop.py) uses as its reference is spelled for 0.5.21+ only (sandbox/releases.py).

    python -m tests.support.engine_smoke [ARCH:QUANT]      one JSON line: {"steps": [...], "release": ...}

tests/test_engine_smoke.py asserts it on every release (ci/matrix SUBSET).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import time
import traceback

os.environ.setdefault("OMP_NUM_THREADS", os.environ.get("SGLANG_TRTLLM_MOE_TEST_THREADS", "1"))

PROMPTS = [[5, 17, 42, 99, 260, 311, 7], [3, 9, 27, 81]]


def smoke(arch: str, quant: str, work: str, steps) -> None:
    import torch

    from sglang_trtllm_moe.compat.features import UPDATE_SESSIONS
    from sglang_trtllm_moe.sandbox import checkpoints as ck
    from sglang_trtllm_moe.sandbox import models
    from sglang_trtllm_moe.sandbox.engine import TinyEngine, differences

    spec = ck.TinySpec(arch, quant, seed=0)
    a, b = ck.checkpoint(spec), ck.checkpoint(spec.with_seed(1))
    dirs = {k: ck.write_tensors(os.path.join(work, k), spec, v) for k, v in (("A", a), ("B", b))}

    t = time.perf_counter()
    eng = TinyEngine(dirs["A"], workdir=work, log=os.path.join(work, "sglang.log"))
    try:
        info = eng.engine.get_server_info()
        backend = info.get("moe_runner_backend")
        steps.check(
            "engine up",
            str(backend).startswith("flashinfer_trtllm"),
            f"scheduler + detokenizer up in {time.perf_counter() - t:.0f} s; --moe-runner-backend auto resolved to "
            f"{backend!r} on the faked SM100 (the plugin's runner: the only flashinfer_trtllm forward a CPU has)",
        )

        fresh = eng.state()
        fresh_tokens = eng.generate(PROMPTS)
        experts = [n for n in fresh if ".experts." in n]
        steps.check(
            "load",
            bool(experts) and all(len(t) == 4 for t in fresh_tokens),
            f"{len(fresh)} tensors read back ({len(experts)} of MoE experts), greedy tokens {fresh_tokens[0]}",
        )

        def tensors(named: dict) -> str:
            items = sorted(named.items())
            parts = models.buckets(items, 3)
            if UPDATE_SESSIONS.present():
                with eng.session():
                    for p in parts:
                        eng.update_from_tensor(p)
                return f"{len(items)} tensors in buckets of {[len(p) for p in parts]}, one begin/end session"
            for p in parts:
                eng.update_from_tensor(p)
            return f"{len(items)} tensors in buckets of {[len(p) for p in parts]} (no sessions before 0.5.21)"

        def served(step: str, want: dict, want_tokens, what: str) -> bool:
            state = eng.state()
            diff = differences(state, want)
            tokens = eng.generate(PROMPTS)
            return steps.check(
                step,
                not diff and tokens == want_tokens,
                f"{what}: {len(diff)} of {len(state)} tensors differ ({', '.join(diff[:3]) or 'byte for byte equal'})"
                f"; greedy tokens {'equal' if tokens == want_tokens else 'DIFFER: ' + str(tokens)}",
            )

        eng.update_from_disk(dirs["B"])
        by_disk = eng.state()
        b_tokens = eng.generate(PROMPTS)
        # the expert weights themselves (activation scales are the same in every tiny checkpoint, and releases before
        # 0.5.16 keep a shape-only swizzled block-scale placeholder nothing writes)
        weights = [
            n for n in experts if n.endswith(("w13_weight", "w2_weight", "w13_weight_packed", "w2_weight_packed"))
        ]
        unchanged = [n for n in weights if not differences({n: by_disk[n]}, {n: fresh[n]})]
        steps.check(
            "disk: A -> B",
            not unchanged and b_tokens != fresh_tokens,
            f"update_weights_from_disk(B): {len(weights) - len(unchanged)} of {len(weights)} expert weight "
            f"tensors changed ({', '.join(unchanged[:3]) or 'all'}); greedy tokens {b_tokens[0]} "
            f"(A's: {fresh_tokens[0]})",
        )

        what = tensors(a)
        served("tensor: B -> A", fresh, fresh_tokens, f"update_weights_from_tensor(A), {what} == the fresh load of A")
        what = tensors(b)
        served("tensor: A -> B", by_disk, b_tokens, f"update_weights_from_tensor(B), {what} == B from disk")
        eng.update_from_disk(dirs["A"])
        served("disk: B -> A", fresh, fresh_tokens, "update_weights_from_disk(A) == the fresh load of A")

        layer = spec.moe_layers[-1]
        up5 = ck.expert_base(spec, layer, 5, "up")
        name = next(n for n in sorted(a) if n.startswith(up5) and "scale" in n and a[n].dim() == 2)
        spoilt = a[name].clone()
        if spoilt.element_size() == 1:
            spoilt.view(torch.uint8)[-1, -1] = 0x7F  # NaN in e4m3
        else:
            spoilt[-1, -1] = float("nan")
        bucket = [*sorted(b.items())[:6], (name, spoilt)]
        ok, msg = eng.update_from_tensor(bucket, check=False)
        steps.check(
            "bad bucket refused",
            not ok and "refused the whole" in str(msg),
            f"a bucket of 6 good tensors of B and {name} with a NaN block scale -> ({ok}, "
            f"{str(msg)[str(msg).find('refused') :][:160]!r})",
        )
        served("still A", fresh, fresh_tokens, "after the refusal the Engine serves A, every byte")
    finally:
        eng.shutdown()


def main(argv=None) -> int:
    from sglang_trtllm_moe.sandbox.rl_loop import Steps
    from sglang_trtllm_moe.sandbox.runtime import release

    argv = sys.argv[1:] if argv is None else argv
    arch, quant = (argv[0] if argv else "qwen3_moe:nvfp4").split(":")
    steps = Steps(out=sys.stderr)
    work = tempfile.mkdtemp(prefix=f"sglang-trtllm-moe-engine-smoke-{arch}-")
    log_tail = ""
    try:
        smoke(arch, quant, work, steps)
    except Exception as e:  # noqa: BLE001 - reported as a failed step, with SGLang's own output
        steps.check("smoke", False, f"{type(e).__name__}: {str(e)[:500]}", traceback=traceback.format_exc()[-3000:])
        log = os.path.join(work, "sglang.log")
        if os.path.exists(log):
            with open(log, errors="replace") as f:
                log_tail = f.read()[-4000:]
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(json.dumps({"release": str(release()), "model": f"{arch}:{quant}", "steps": steps.checks, "log": log_tail}))
    return 0


if __name__ == "__main__":  # sglang.Engine spawns its scheduler: the children import this module again
    sys.exit(main())
