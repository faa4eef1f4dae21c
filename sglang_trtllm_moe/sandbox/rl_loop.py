"""The RL loop on `sglang.Engine` (sandbox/engine.py's TinyEngine): what `ci/demo` / `sglang-trtllm-moe demo` runs
and tests/test_engine.py asserts. Load and generate, the forward against transformers, RL rounds from disk and from
tensors in buckets, a partial update, the weight checker, a corrupted update caught — each served state read back
and compared byte for byte with a fresh load of the same weights, a line per step with its time."""

from __future__ import annotations

import os
import sys
import tempfile
import time

import torch

from . import models
from .engine import FAKE_SM, EngineUnavailable, TinyEngine, as_bytes, differences, prepare_process

PROMPTS = [[5, 17, 42, 99, 260, 311, 7], [100, 200, 300, 400], [3, 9, 27, 81, 243, 480, 11, 13, 15]]
NEW_TOKENS = 4


class Steps:
    """Steps that print as they run (one line per check, with its time) and a summary table at the end."""

    def __init__(self, out=None, quiet: bool = False):
        self.out = out if out is not None else sys.stdout
        self.quiet = quiet
        self.checks: list[dict] = []
        self._t = time.perf_counter()
        self._t0 = self._t

    def say(self, msg: str) -> None:
        if not self.quiet:
            print(msg, file=self.out, flush=True)

    def check(self, step: str, ok: bool, detail: str, **data) -> bool:
        now = time.perf_counter()
        self.checks.append({"step": step, "ok": bool(ok), "detail": detail, "seconds": round(now - self._t, 2), **data})
        self._t = now
        self.say(f"  [{'PASS' if ok else 'FAIL'}] {step} ({self.checks[-1]['seconds']:.1f} s): {detail}")
        return bool(ok)

    def failed(self) -> list[dict]:
        return [c for c in self.checks if not c["ok"]]

    def summary(self) -> int:
        w = max([len(c["step"]) for c in self.checks] + [4])
        self.say("\nsummary")
        self.say(f"  {'step':<{w}}  result  seconds  detail")
        for c in self.checks:
            detail = c["detail"] if len(c["detail"]) <= 110 else c["detail"][:107] + "..."
            self.say(f"  {c['step']:<{w}}  {'pass' if c['ok'] else 'FAIL':<6}  {c['seconds']:7.1f}  {detail}")
        failed = self.failed()
        self.say(
            f"\n{len(self.checks) - len(failed)} passed, {len(failed)} failed ({time.perf_counter() - self._t0:.0f} s)"
        )
        return 1 if failed else 0


def _hashes(state: dict[str, torch.Tensor]) -> dict[str, str]:
    import hashlib

    out = {}
    for n, t in state.items():
        b = as_bytes(t)
        out[n] = f"{t.dtype}|{tuple(t.shape)}|" + hashlib.sha256(b.numpy().tobytes()).hexdigest()[:16]
    return out


def _reference_child(spec, first: str, targets: dict[str, str], out_path: str) -> None:
    """In a forked process: SGLang's ModelRunner (the bench_one_batch flow of sandbox.models) loads `first`, then a
    fresh get_model() of every target: the bytes a new server would hold (state_dict, as save_sharded_model writes
    it) and its greedy tokens; and the first one's prefill logits vs transformers."""
    import json

    code = 1
    try:
        from sglang.srt.model_loader.loader import ShardedStateLoader

        m = models.TinyModel(first, **models.ROUTED_EXPERTS_ARGS)
        res = {"_forward": _forward_error(m, spec, os.path.dirname(out_path))}
        for key, d in targets.items():
            fresh = m.fresh(d)
            state = ShardedStateLoader._filter_subtensors(fresh.state_dict())
            tokens, routed = m.generate_routed(PROMPTS, NEW_TOKENS, model=fresh)
            res[key] = {"hashes": _hashes(state), "tokens": tokens, "routed": routed}
            del fresh
        with open(out_path, "w") as f:
            json.dump(res, f)
        code = 0
    except BaseException:  # noqa: BLE001 - the parent reports the missing file
        import traceback

        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


#: relative L2 error of the prefill next-token logits vs transformers on the float32 dequantized checkpoint, per
#: NVFP4 model (measured 0.14 / 0.115 / 0.128 on a CPU box with the emulated kernels; tests/test_models.py)
FORWARD_BOUND = {"qwen3_moe": 0.22, "deepseek_v3": 0.22, "nemotron_h": 0.25}


def _forward_error(m, spec, workdir: str) -> dict:
    """The ModelRunner's prefill next-token logits vs transformers' own model class on the float32 dequantized
    checkpoint (the kernels quantize activations to FP4 at both GEMMs, so the bound is a few tenths)."""
    from transformers import AutoModelForCausalLM

    from . import checkpoints as ck

    ref = AutoModelForCausalLM.from_pretrained(
        ck.write_reference(os.path.join(workdir, "reference-fp32"), spec), dtype=torch.float32
    )
    ref.eval()
    _, logits = m.generate(PROMPTS, 1)
    with torch.no_grad():
        want = torch.stack([ref(torch.tensor([p])).logits[0, -1] for p in PROMPTS]).float()
    return {
        "rel_err": float((logits - want).norm() / want.norm()),
        "top1_equal": (logits.argmax(-1) == want.argmax(-1)).tolist(),
        "reference_class": type(ref).__name__,
    }


def _compare(state: dict[str, torch.Tensor], ref: dict) -> list[str]:
    mine = _hashes(state)
    theirs = ref["hashes"]
    if set(mine) != set(theirs):
        return sorted(set(mine) ^ set(theirs))
    return [n for n in mine if mine[n] != theirs[n]]


def rl_loop(
    arch: str = "qwen3_moe",
    quant: str = "nvfp4",
    steps: Steps | None = None,
    workdir: str | None = None,
    doctor: bool = True,
    sglang_log: str | None = None,
) -> Steps:
    """The whole-model RL loop on sglang.Engine(device="cpu"): load, generate, three RL rounds (disk; tensors in
    buckets; flattened buckets), a partial disk update, the weight checker, a corrupted update caught. Every state
    the Engine serves is read back (save_sharded_model) and compared byte for byte, with its greedy tokens, to a
    fresh get_model() of the checkpoint intended, computed by SGLang's ModelRunner in a forked process."""
    from . import checkpoints as ck
    from .releases import RL_LOOP_RELEASES
    from .runtime import release

    if release() not in RL_LOOP_RELEASES:
        # the Engine itself runs on more releases (ENGINE_RELEASES); the loop's sessions, checker request and
        # ModelRunner reference do not
        raise EngineUnavailable(
            f"the RL loop drives sglang.Engine of SGLang {RL_LOOP_RELEASES}; this is SGLang {release()}"
        )
    st = steps or Steps()
    work = workdir or tempfile.mkdtemp(prefix=f"sglang-trtllm-moe-engine-{arch}-{quant}-")
    prepare_process(work)
    spec = ck.TinySpec(arch, quant, seed=0)
    moe = spec.moe_layers

    if doctor:
        from .. import doctor as doc

        r = doc.report(load=False, import_targets=True)
        states = [t["state"] for t in r["targets"]]
        st.check(
            "plugin loaded by SGLang",
            r["enabled"] and "missing" not in states,
            f"sglang {r['sglang_version']}: {states.count('landed')} hook targets landed, "
            f"{states.count('missing')} missing, {states.count('not_applicable')} not applicable",
        )

    # the checkpoints of every round and what the model must hold after each (intended = a full checkpoint)
    full = {s: ck.checkpoint(spec.with_seed(s)) for s in (0, 1, 2)}
    part3 = ck.quantized_experts(spec.with_seed(3), layers=moe, experts=[0, 2, 5, 7])
    part4 = ck.quantized_experts(spec.with_seed(4), layers=[moe[0]], experts=[1, 6])
    intended = {
        "A": full[0],
        "B": full[1],
        "C": full[2],
        "C+3": {**full[2], **part3},
        "C+3+4": {**full[2], **part3, **part4},
    }
    dirs = {k: ck.write_tensors(os.path.join(work, f"intended-{k}"), spec, v) for k, v in intended.items()}

    st.say(f"explain: which MoE runner SGLang's {arch} {quant} gets on a (faked) SM100, and why")
    from ..explain import explain_model

    server_extra = {
        k: v
        for k, v in models.DEFAULT_SERVER_ARGS.items()
        if k in ("disable_radix_cache", "attention_backend", "bf16_gemm_backend", "disable_cuda_graph")
    }
    rep = explain_model(dirs["A"], sm=FAKE_SM, server_args=server_extra)
    cands = ", ".join(
        f"{c['backend']} {'eligible' if c['eligible'] else 'rejected: ' + c['code']}" for c in rep.get("candidates", [])
    )
    st.check(
        "explain",
        rep.get("winner", "").startswith("flashinfer_trtllm") and rep["sglang"].get("with_plugin") == rep["winner"],
        f"{rep.get('winner')} [{rep.get('code')}] (SGLang's resolution with the plugin: "
        f"{rep['sglang'].get('with_plugin')}; candidates: {cands})",
        winner=rep.get("winner"),
        code=rep.get("code"),
    )

    st.say(
        "reference: SGLang's ModelRunner (bench_one_batch flow) loads a fresh model of every intended checkpoint "
        "(a forked process, while the Engine starts)"
    )
    import multiprocessing

    ref_path = os.path.join(work, "reference.json")
    child = multiprocessing.get_context("fork").Process(target=_reference_child, args=(spec, dirs["A"], dirs, ref_path))
    child.start()

    st.say(
        f'sglang.Engine(device="cpu", model_path=<tiny {arch} {quant}>, moe_runner_backend="auto") starts '
        f"its scheduler and detokenizer processes"
    )
    t = time.perf_counter()
    eng = TinyEngine(dirs["A"], workdir=work, log=sglang_log, **models.ROUTED_EXPERTS_ARGS)
    try:
        st.check(
            "engine up",
            True,
            f"scheduler + detokenizer up in {time.perf_counter() - t:.0f} s (stand-ins and "
            f"faked SM{FAKE_SM} in every process through SGLang's own plugin loading)",
        )
        child.join(600)
        import json

        ref = None
        if child.exitcode == 0 and os.path.exists(ref_path):
            with open(ref_path) as f:
                ref = json.load(f)
        st.check(
            "reference",
            ref is not None,
            f"{len(intended)} fresh get_model() loads hashed, tensor by tensor"
            if ref is not None
            else f"the reference process failed (exit code {child.exitcode})",
        )
        if ref is None:
            return st

        def served(step: str, key: str, what: str) -> bool:
            state = eng.state()
            diff = _compare(state, ref[key])
            tokens = eng.generate(PROMPTS, NEW_TOKENS)
            same_tokens = tokens == ref[key]["tokens"]
            moe_names = [n for n in state if ".experts." in n]
            return st.check(
                step,
                not diff and same_tokens and bool(moe_names),
                f"{what}; {len(state)} tensors read back, {len(diff)} differ from a fresh load "
                f"({', '.join(diff[:3]) or 'byte for byte equal'}); greedy tokens "
                f"{'equal' if same_tokens else 'DIFFER'} ({tokens[0]} ...)",
                differs=diff[:8],
                tokens=tokens,
                fresh_tokens=ref[key]["tokens"],
            )

        st.say("load and generate")
        served("load", "A", "the Engine's model == SGLang's fresh load of the checkpoint")
        fwd = ref["_forward"]
        bound = FORWARD_BOUND.get(arch, 0.25) if quant == "nvfp4" else 0.11
        st.check(
            "forward vs transformers",
            fwd["rel_err"] <= bound,
            f"prefill logits of the same model vs transformers' {fwd['reference_class']} on the float32 "
            f"dequantized checkpoint: relative error {fwd['rel_err']:.3f} (bound {bound}: the kernels quantize "
            f"activations too), top-1 equal {sum(fwd['top1_equal'])}/{len(fwd['top1_equal'])}",
            **fwd,
        )

        st.say("routed experts (R3): generate with return_routed_experts")
        tokens, routed = eng.generate_routed(PROMPTS, NEW_TOKENS)
        nonzero = any(e != 0 for req in routed for tok in req for lay in tok for e in lay)
        st.check(
            "routed experts",
            tokens == ref["A"]["tokens"] and routed == ref["A"]["routed"] and nonzero,
            "meta_info['routed_experts'] of every prompt and generated token, every layer, "
            f"{'equal' if routed == ref['A']['routed'] else 'NOT equal'} to what a fresh load's fused runner "
            f"reports for the same batch ({'not all zeros' if nonzero else 'ALL ZEROS'})",
        )

        st.say("RL round 1: update_weights_from_disk, a whole new checkpoint")
        eng.update_from_disk(dirs["B"])
        served("round 1: disk", "B", "update_weights_from_disk(B)")

        st.say("RL round 2: update_weights_from_tensor, a whole checkpoint in 3 buckets in one begin/end session")
        items = sorted(full[2].items())
        parts = models.buckets(items, 3)
        with eng.session():
            for p in parts:
                eng.update_from_tensor(p)
        served("round 2: tensor buckets", "C", f"{len(items)} tensors in buckets of {[len(p) for p in parts]}")

        st.say("RL round 3: update_weights_from_tensor, 4 experts of every MoE layer as 2 flattened buckets")
        items = sorted(part3.items())
        parts = models.buckets(items, 2)
        with eng.session():
            for p in parts:
                eng.update_from_tensor(p, load_format="flattened_bucket")
        served(
            "round 3: flattened buckets", "C+3", f'{len(items)} expert tensors, partial, load_format="flattened_bucket"'
        )

        st.say("partial update_weights_from_disk: a directory holding two experts of one layer")
        d = ck.write_tensors(os.path.join(work, "partial-disk"), spec, part4)
        eng.update_from_disk(d)
        served("partial disk", "C+3+4", f"{len(part4)} tensors of experts 1 and 6 of layer {moe[0]}")

        st.say("a bad update: one NaN in a block scale of expert 5 (e4m3 byte 0x7F / float NaN), by disk and by tensor")
        layer = moe[-1]
        sname = next(
            n
            for n in sorted(intended["C+3+4"])
            if n.startswith(ck.expert_base(spec, layer, 5, "up")) and "scale" in n and intended["C+3+4"][n].dim() == 2
        )
        spoilt = intended["C+3+4"][sname].clone()
        if spoilt.element_size() == 1:
            spoilt.view(torch.uint8)[-1, -1] = 0x7F
        else:
            spoilt[-1, -1] = float("nan")
        d = ck.write_tensors(os.path.join(work, "nan-block-scale"), spec, {**intended["C+3+4"], sname: spoilt})
        by_disk = eng.engine.update_weights_from_disk(d)
        by_tensor = eng.update_from_tensor([(sname, spoilt)], check=False)
        refused = [r for r in (by_disk, by_tensor) if not r[0] and "refused the whole" in str(r[1])]
        st.check(
            "bad update answered",
            len(refused) == 2,
            f"update_weights_from_disk -> {by_disk[0]}, update_weights_from_tensor -> {by_tensor[0]}: "
            + str(by_disk[1])[str(by_disk[1]).find("refused weight update") :][:160],
            messages=[str(by_disk[1])[:600], str(by_tensor[1])[:600]],
        )
        served("still serving", "C+3+4", "after both refusals the Engine serves the previous weights")

        st.say("the weight checker: snapshot, reset every tensor, replay the update, compare")
        ok1 = eng.check_weights("snapshot")
        ok2 = eng.check_weights("reset_tensors")
        eng.update_from_disk(dirs["C+3+4"])
        ok3 = eng.check_weights("compare")
        st.check(
            "weight checker",
            ok1[0] and ok2[0] and ok3[0],
            f"snapshot {ok1[1]!r}, reset_tensors {ok2[1]!r}, replay from disk, compare {ok3[1]!r} "
            f"(the plugin's comparator for the TRT-LLM layouts)",
        )

        st.say("a corrupted update: one flipped byte in expert 3's weight, caught by the checker")
        layer = moe[-1]
        role = "gate" if spec.gated else "up"
        wname = f"{ck.expert_base(spec, layer, 3, role)}.{'weight_packed' if quant == 'ct_nvfp4' else 'weight'}"
        good = intended["C+3+4"][wname]
        bad = good.clone()
        flat = bad.view(torch.uint8).reshape(-1) if bad.element_size() == 1 else bad.view(torch.int16).reshape(-1)
        flat[len(flat) // 3] ^= 0x30
        eng.check_weights("snapshot")
        eng.check_weights("reset_tensors")
        eng.update_from_disk(dirs["C+3+4"])
        eng.update_from_tensor([(wname, bad)])
        ok, msg = eng.check_weights("compare")
        mark = "first, in checkpoint coordinates: "
        where = msg[msg.find(mark) + len(mark) :][:160] if mark in msg else msg[:200]
        st.check(
            "corrupted update caught",
            not ok and "expert 3" in msg and f"layers.{layer}." in msg,
            f"compare failed as it must: {where}",
            message=msg[:2000],
        )

        eng.update_from_tensor([(wname, good)])
        served("restored", "C+3+4", "the correct tensor sent again")
    finally:
        eng.shutdown()
        if child.is_alive():
            child.kill()
    return st


__all__ = ["EngineUnavailable", "Steps", "TinyEngine", "differences", "prepare_process", "rl_loop"]
