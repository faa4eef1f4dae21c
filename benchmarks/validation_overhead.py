"""What validating every weight update costs per `FusedMoE.weight_loader` call: a full-layer load through SGLang's
FusedMoE.weight_loader, with the plugin's validation and without it (the same hooks, `validation.check_write`
replaced by a pass-through that returns the parameter's name and the expert id), on a prepared layer (the RL update
path: validate, un-prepare the expert, SGLang's write) — both as a user's own loader calls it (no entry point: every
write checked in the loader hook, values included) and as an update entry point does (the whole bucket checked
first, `bucket_validation.check_bucket` with a request record, then the loader hooks only look the writes up). Also
the whole-bucket check alone for the same tensors, where each `check_write` call's time goes (the write plan's
look-up and acceptance, and the full checks' pieces timed one by one, uninstrumented), and a cProfile of the checks
(the top functions by own time).

    PYTHONPATH=. <venv>/bin/python benchmarks/validation_overhead.py [--fmt nvfp4] [--experts 32] [--hidden 1024]
        [--intermediate 512] [--repeats 5] [--profile-top 15] [--tiny]

Prints one JSON line: seconds per full-layer load (min over interleaved repeats) with and without validation,
calls, microseconds of validation per call, the bucket check, the per-call breakdown and the profile.
--tiny: 4 experts, H 256, I 128, one repeat (a smoke run).
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # this checkout first


def main(argv=None) -> int:
    import torch

    import tests.conftest  # noqa: F401 - the torchvision shim, before sglang is imported
    from sglang_trtllm_moe import layer_state
    from sglang_trtllm_moe.sandbox import layers as cpu_layers
    from sglang_trtllm_moe.updates import bucket_validation, checked_writes, layer_params, validation
    from tests.support import bad_updates, sglang_runtime

    ap = argparse.ArgumentParser()
    ap.add_argument("--fmt", default="nvfp4")
    ap.add_argument("--experts", type=int, default=32)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--intermediate", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--profile-top", type=int, default=15, help="functions of the cProfile listed (0: no profile)")
    ap.add_argument("--tiny", action="store_true")
    args = ap.parse_args(argv)
    if args.tiny:
        args.experts, args.hidden, args.intermediate, args.repeats, args.profile_top = 4, 256, 128, 1, 15
    torch.set_num_threads(args.threads)
    sglang_runtime.ensure("flashinfer_trtllm")
    spec = cpu_layers.MoeSpec(
        num_experts=args.experts, hidden=args.hidden, intermediate=args.intermediate, fmt=args.fmt
    )
    tensors = bad_updates.checkpoint(spec, seed=0)
    layer = cpu_layers.build_layer(spec)
    writes = bad_updates.writes(spec, tensors)
    bad_updates.load(layer, writes)
    layer.quant_method.process_weights_after_loading(layer)

    def full_load():
        t = time.perf_counter()
        bad_updates.load(layer, writes)
        layer_state.flush(layer)
        return time.perf_counter() - t

    def best(fn):
        fn()
        return min(fn() for _ in range(args.repeats))

    real = validation.check_write

    def unchecked(layer, param, loaded, weight_name, shard_id, expert_id, scope="local", headers=False, values=True):
        st = layer_state.state_of(layer)
        return layer_params.param_name(layer, param, st.fmt), int(expert_id)

    def without_validation():
        validation.check_write = unchecked
        try:
            return full_load()
        finally:
            validation.check_write = real

    model = cpu_layers.TinyMoeModel.__new__(cpu_layers.TinyMoeModel)
    torch.nn.Module.__init__(model)
    model.experts = layer
    named = list(cpu_layers.checkpoint_names(tensors).items())

    def entry_point_load():
        """What an update entry point does: the bucket checked and recorded, then the same loads, then the flush."""
        t = time.perf_counter()
        record = checked_writes.Checked()
        try:
            bucket_validation.check_bucket(model, named, record=record)
            bad_updates.load(layer, writes)
        finally:
            record.close()
        layer_state.flush(layer)
        return time.perf_counter() - t

    # interleaved, so that load from other processes on a shared box hits both alike
    full_load(), without_validation(), entry_point_load()
    runs = [(full_load(), without_validation(), entry_point_load()) for _ in range(args.repeats)]
    with_validation, without, entry = (min(p[i] for p in runs) for i in range(3))
    calls = [(getattr(layer, w.param), w) for w in writes]

    def only_checks():
        t = time.perf_counter()
        for p, w in calls:
            real(layer, p, w.tensor, w.weight_name, w.shard_id, w.expert_id, scope="global")
        return time.perf_counter() - t

    checks = best(only_checks)

    def full_checks():
        t = time.perf_counter()
        for p, w in calls:
            validation._check_write(layer, p, w.tensor, w.weight_name, w.shard_id, w.expert_id, "global", False, True)
        return time.perf_counter() - t

    full = best(full_checks)

    def bucket_check():
        t = time.perf_counter()
        bucket_validation.check_bucket(model, named)
        return time.perf_counter() - t

    bucket = best(bucket_check)
    out = {
        "fmt": args.fmt,
        "experts": args.experts,
        "hidden": args.hidden,
        "intermediate": args.intermediate,
        "torch_threads": args.threads,
        "loader_calls": len(writes),
        "checkpoint_MiB": round(sum(t.numel() * t.element_size() for t in tensors.values()) / 2**20, 1),
        "full_load_s_with_validation": round(with_validation, 4),
        "full_load_s_without": round(without, 4),
        "overhead_pct": round(100 * (with_validation - without) / without, 1),
        "full_load_s_through_an_entry_point": round(entry, 4),
        "entry_point_overhead_pct": round(100 * (entry - without) / without, 1),
        "check_write_us_per_call": round(1e6 * checks / len(writes), 1),
        "check_write_without_plans_us_per_call": round(1e6 * full / len(writes), 1),
        "check_bucket_s": round(bucket, 4),
        "check_bucket_us_per_tensor": round(1e6 * bucket / len(named), 1),
        "check_write_breakdown_us_per_call": breakdown(layer, calls, args.repeats),
    }
    if args.profile_top:
        out["profile_check_write"] = profile(lambda: [only_checks() for _ in range(3)], 3 * len(writes), args)
        out["profile_full_load"] = profile(lambda: [full_load() for _ in range(3)], 3 * len(writes), args)
    print(json.dumps(out))
    return 0


def breakdown(layer, calls, repeats: int) -> dict:
    """Microseconds per loader call of each step `validation.check_write` takes for these writes (scope "global"),
    each step timed on its own over all calls (min over repeats); "check_write" is the whole call for comparison."""
    from sglang_trtllm_moe.updates import layer_params as lp
    from sglang_trtllm_moe.updates import refusal, value_checks, write_plans
    from sglang_trtllm_moe.updates import validation as v

    fmt = lp.format_of(layer)
    gated = fmt.is_gated(layer)
    prep = []
    for p, w in calls:
        name = lp.param_name(layer, p, fmt)
        rule = fmt.load_rule(name)
        refuse = refusal.Refusal(layer, name, w.shard_id, w.expert_id)
        view = lp.param_view(layer, fmt, name, p)
        prep.append((p, w, name, rule, refuse, view))
    n = len(calls)
    values = [(w.tensor, rule.value_rule(p.dtype, w.tensor.dtype)) for p, w, _, rule, _, _ in prep]
    values = [(t, r) for t, r in values if r is not None and t.numel()]
    plans = [write_plans.plan_of(layer, p) for p, _ in calls]
    steps = {
        "check_write (whole)": lambda: [
            v.check_write(layer, p, w.tensor, w.weight_name, w.shard_id, w.expert_id, scope="global") for p, w in calls
        ],
        "plan_of (the write plan's look-up)": lambda: [write_plans.plan_of(layer, p) for p, _ in calls],
        "WritePlan.accepts (everything a write is checked for, values included)": lambda: [
            plan.accepts(layer, p, w.tensor, w.weight_name, w.shard_id, w.expert_id, "global", False, True)
            for plan, (p, w) in zip(plans, calls, strict=True)
        ],
        "the full checks (no plan: _check_write)": lambda: [
            v._check_write(layer, p, w.tensor, w.weight_name, w.shard_id, w.expert_id, "global", False, True)
            for p, w in calls
        ],
        "format_of": lambda: [lp.format_of(layer) for _ in calls],
        "param_name": lambda: [lp.param_name(layer, p, fmt) for p, _ in calls],
        "Refusal(...) (its arguments kept: the message is built only when it refuses)": lambda: [
            refusal.Refusal(layer, name, w.shard_id, w.expert_id) for p, w, name, *_ in prep
        ],
        "_check_name": lambda: [
            v._check_name(layer, fmt, p, name, w.weight_name, refuse) for p, w, name, _, refuse, _ in prep
        ],
        "_check_shard": lambda: [v._check_shard(rule, w.shard_id, gated, refuse) for p, w, _, rule, refuse, _ in prep],
        "param_view": lambda: [lp.param_view(layer, fmt, name, p) for p, w, name, *_ in prep],
        "_check_expert": lambda: [
            v._check_expert(layer, view, p, w.expert_id, "global", refuse) for p, w, _, _, refuse, view in prep
        ],
        "check_tensor (device, dtype, shape, values)": lambda: [
            v.check_tensor(layer, fmt, rule, p, view, w.tensor, gated, refuse) for p, w, _, rule, refuse, view in prep
        ],
        "_intermediate_extents (inside check_tensor, weights and block scales)": lambda: [
            lp.intermediate_extents(layer, fmt, rule, view, gated) for p, w, _, rule, _, view in prep if not rule.scalar
        ],
        "value_checks.bad_one (inside check_tensor, scales with a value rule)": lambda: [
            value_checks.bad_one(t, r) for t, r in values
        ],
        "value_checks.find_bad of them all at once (a request's check)": lambda: value_checks.find_bad(values),
    }
    out = {}
    for label, fn in steps.items():
        fn()
        best = float("inf")
        for _ in range(max(3, repeats)):
            t = time.perf_counter()
            fn()
            best = min(best, time.perf_counter() - t)
        out[label] = round(1e6 * best / n, 2)  # per loader call (steps that run on some calls only: averaged over all)
    out["value-checked calls"] = f"{len(values)} of {n}"
    return out


def profile(fn, calls: int, args) -> list[dict]:
    """cProfile of fn: the top functions by own time, in microseconds per loader call (cProfile's own overhead
    inflates small functions; the breakdown above is uninstrumented)."""
    prof = cProfile.Profile()
    prof.enable()
    fn()
    prof.disable()
    st = pstats.Stats(prof)
    rows = []
    for (file, line, func), (_cc, nc, tt, ct, _callers) in st.stats.items():  # type: ignore[attr-defined]
        where = file.split("site-packages/")[-1].split("sglang_trtllm_moe/")[-1]
        rows.append(
            dict(
                function=f"{where}:{line}({func})",
                calls_per_loader_call=round(nc / calls, 2),
                own_us_per_loader_call=round(1e6 * tt / calls, 2),
                cumulative_us_per_loader_call=round(1e6 * ct / calls, 2),
            )
        )
    rows.sort(key=lambda r: -r["own_us_per_loader_call"])
    return rows[: args.profile_top]


if __name__ == "__main__":
    raise SystemExit(main())
