"""What the plugin adds to an RL weight update of a whole model, measured through SGLang's own update entry points.

A DeepSeek-V3 model (sandbox/checkpoints.py TinySpec, `deepseek_v3`: a dense first layer, then MoE layers; experts,
hidden and intermediate scaled to fit the machine) is loaded by SGLang's ModelRunner (sandbox/models.py TinyModel,
0.5.21+), then updated the way SGLang's scheduler calls the runner's WeightUpdater:

* ``tensor``: ``begin_weight_update``; ``update_weights_from_tensor`` once per bucket (the whole model, every
  tensor, in buckets of about ``bucket_mib``); ``end_weight_update`` (the flush of every written expert);
* ``disk``: ``update_weights_from_disk`` of a second checkpoint directory (the whole model);
* ``flattened`` (not run unless asked: ``--flows tensor,flattened``): the ``tensor`` flow with each bucket sent as
  RL frameworks send them, one ``FlattenedTensorBucket`` (``load_format="flattened_bucket"``): SGLang hands the
  model views of one buffer (what an IPC buffer or a distributed broadcast hands it too).

Each flow runs in four modes, interleaved (order rotated per repeat), in the same process:

* ``plugin``: as shipped (a tensor bucket's expert tensors written batched: batched_writes.py);
* ``per_tensor``: the plugin with batched writes switched off (``batched_writes.disabled()``): every tensor through
  the model's ``load_weights`` and SGLang's loader with the plugin's hooks, as before issue #38;
* ``bypassed``: the plugin's checks and their bookkeeping replaced by pass-throughs (``bypass()`` says exactly
  what; no batched writes either): the update through SGLang's own loader; its layout work (un-prepare / prepare of
  the written experts) still runs, so the layer stays exact;
* ``unhooked`` (only where it is exact without the plugin's loader hooks: inside a begin/end session, where
  ``begin_weight_update`` already returned every managed layer to checkpoint layout, and for formats SGLang
  prepares itself, compat/defer.py): ``FusedMoE.weight_loader`` and ``_weight_loader_impl`` are SGLang's own
  functions (the hook wrappers unwrapped, per layer), the entry-point checks bypassed as above.

What each mode replaces, the clock and the counters are bench_update_modes.py's; the random checkpoint and its
buckets bench_update_checkpoint.py's; this module runs them per flow and format and reports.

Each update is timed in wall seconds and in CPU seconds of the process (`time.process_time`: less disturbed by
other work on a shared box; one torch thread, and the loader calls run in the calling thread: `_load_synchronously`).
Inside it, `Clock` times the plugin's layout work on its own (``layout_s``: ``layer_state.flush`` — prepare of the
dirty experts and the kernel scalars — plus every ``WeightFormat.unprepare_``), the entry points' whole-request
checks, the loader hooks' checks and the batched writes; ``overhead_pct_vs_bypassed_{cpu,wall}`` and
``ratio_vs_bypassed_{cpu,wall}`` compare the updates without the layout work ((plugin - layout) / (bypassed - layout),
medians; ``..._with_layout``: the totals). ``--ep N`` simulates EP rank 0 of N (`as_ep_rank_0`).

An untimed counting run per flow (plugin, per tensor, bypassed) says per update: SGLang's per-tensor loader writes
(``fused_moe_weight_loader_calls``, counted at ``_weight_loader_impl``), the expert tensors written batched, how
many times each expert tensor was validated (``check_write`` at the entry point's bucket check and in the loader
hooks), value checks (``value_checks.find_bad``), and the tensor-to-Python conversions in the validation path
(``bool(t)``, ``float(t)``, ``int(t)``, ``t.item()``, ``t.tolist()``): each one is a device synchronisation when the
tensor is on a GPU (IPC / NCCL updates deliver CUDA tensors).

Weights are random bytes of the checkpoint's dtypes and shapes (finite, positive scales): their values do not change
the cost of a copy or a permutation, and quantizing real weights of this size would dominate the run
(bench_update_checkpoint.py).

    PYTHONPATH=. python benchmarks/model_update.py [--tiny]     (the command line; sglang-trtllm-moe bench has rows)
"""

from __future__ import annotations

import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

import torch

from .bench_update_checkpoint import bucketed, model_spec, random_checkpoint
from .bench_update_modes import Clock, bypass, counting, device_path, summary, unhooked, unhooked_exact

#: experts / hidden / moe intermediate per size (DeepSeek-V3 has 256 experts, H 7168, I 2048)
SIZES = {
    "tiny": dict(experts=8, hidden=256, intermediate=128),
    "small": dict(experts=32, hidden=1024, intermediate=256),
    "default": dict(experts=256, hidden=2048, intermediate=512),
}
FLOWS = ("tensor", "disk")
MODES = ("plugin", "per_tensor", "bypassed", "unhooked")


def _profile(fn, context, calls: int, top: int) -> list[dict]:
    """cProfile of one update in `context`: the `top` functions by own time, in microseconds per expert tensor
    (cProfile's overhead inflates small functions; the timed updates are never profiled)."""
    import cProfile
    import pstats

    prof = cProfile.Profile()
    with context():
        prof.enable()
        fn()
        prof.disable()
    rows = []
    for (file, line, func), (_cc, nc, tt, ct, _callers) in pstats.Stats(prof).stats.items():  # type: ignore[attr-defined]
        where = file.split("site-packages/")[-1].split("sglang_trtllm_moe/")[-1]
        rows.append(
            dict(
                function=f"{where}:{line}({func})",
                calls_per_expert_tensor=round(nc / max(calls, 1), 2),
                own_us_per_expert_tensor=round(1e6 * tt / max(calls, 1), 2),
                cumulative_us_per_expert_tensor=round(1e6 * ct / max(calls, 1), 2),
            )
        )
    rows.sort(key=lambda r: -r["own_us_per_expert_tensor"])
    return rows[:top]


def _load_synchronously() -> None:
    """DeepSeek's load_weights hands each CPU tensor's loader call to a thread pool (`should_async_load`: to overlap
    host-to-device copies) and loads device tensors in the calling thread. Here every tensor is a CPU tensor; the
    pool would only add GIL contention on a small box and make per-call timing unreadable, so the loader calls run
    in the calling thread, as they do for the CUDA tensors of IPC / NCCL updates (`sglang_threads=True` keeps it)."""
    import importlib

    for mod in ("sglang.srt.models.deepseek_common.deepseek_weight_loader", "sglang.srt.models.deepseek_v2"):
        try:
            m = importlib.import_module(mod)
        except ImportError:
            continue
        if hasattr(m, "should_async_load"):
            setattr(m, "should_async_load", lambda weight: False)  # noqa: B010 - a name mypy cannot see


def _stats(got: list[dict]) -> dict:
    """min / median of each measure over the repeats (seconds, rounded). total / without_layout: wall and CPU seconds
    of the process (the layout work subtracted in the same clock); the kinds of work (Clock.KINDS): wall seconds,
    and CPU seconds of the thread for Clock.CPU_KINDS."""
    out = {}
    for clock_kind in ("wall", "cpu"):
        tot = [g[clock_kind] for g in got]
        excl = [g[clock_kind] - g["layout" if clock_kind == "wall" else "layout_cpu"] for g in got]
        out[f"total_{clock_kind}_s_min"] = round(min(tot), 4)
        out[f"total_{clock_kind}_s_median"] = round(statistics.median(tot), 4)
        out[f"without_layout_{clock_kind}_s_min"] = round(min(excl), 4)
        out[f"without_layout_{clock_kind}_s_median"] = round(statistics.median(excl), 4)
    for k in Clock.KINDS:
        out[f"{k}_s_median"] = round(statistics.median(g[k] for g in got), 4)
    for k in Clock.CPU_KINDS:
        out[f"{k}_cpu_s_median"] = round(statistics.median(g[f"{k}_cpu"] for g in got), 4)
    return out


# ---- one format in this process ---------------------------------------------------------------------------------


def run_in_this_process(
    quant: str = "nvfp4",
    experts: int = 8,
    hidden: int = 256,
    intermediate: int = 128,
    repeats: int = 3,
    bucket_mib: float = 64,
    flows=FLOWS,
    workdir: str | None = None,
    sglang_threads: bool = False,
    profile_top: int = 0,
    ep: int = 1,
) -> dict:
    """Build the model, then time and count every (flow, mode). Returns one JSON-able report. The two checkpoint
    directories go to `workdir`, or to a temporary directory removed at the end. ep > 1: every MoE layer's SGLang
    mapping answers as EP rank 0 of `ep` (`as_ep_rank_0`)."""
    args = (quant, experts, hidden, intermediate, repeats, bucket_mib, flows, sglang_threads, profile_top, ep)
    if workdir is not None:
        return _run_in(workdir, *args)
    with tempfile.TemporaryDirectory(prefix=f"sglang-trtllm-moe-update-{quant}-") as work:
        return _run_in(work, *args)


def as_ep_rank_0(model, ep: int) -> None:
    """A simulated EP rank 0 of `ep` (the model stays allocated for every expert, EP 1): each MoE layer's own
    `_map_global_expert_id_to_local_expert_id` answers "local" for the first 1/ep of the routed experts only, so
    SGLang's loader (and the plugin's batched writes, which ask it) drops the other ranks' experts, as a rank of a
    real EP group does with every tensor of a broadcast update. Parameters kept per global expert (input scales)
    are written for every expert, as there. Updates then no longer equal a fresh load of the second checkpoint."""
    from .models import moe_layers

    layer: Any
    for layer in moe_layers(model).values():
        local = int(layer.num_experts) // ep
        layer.__dict__["_map_global_expert_id_to_local_expert_id"] = lambda e, n=local: e if 0 <= e < n else -1


def _run_in(work, quant, experts, hidden, intermediate, repeats, bucket_mib, flows, sglang_threads, profile_top, ep=1):
    from .. import layer_state
    from . import checkpoints as ck
    from . import models

    spec = model_spec(quant, experts, hidden, intermediate)
    if not sglang_threads:
        _load_synchronously()
    t0 = time.perf_counter()
    first = random_checkpoint(spec, seed=0)
    dir_a = ck.write_tensors(os.path.join(work, "a"), spec, first)
    del first
    new = random_checkpoint(spec, seed=1)
    dir_b = ck.write_tensors(os.path.join(work, "b"), spec, new)
    made_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    m = models.TinyModel(dir_a)
    load_s = time.perf_counter() - t0
    layers = m.moe_layers()
    if ep > 1:
        as_ep_rank_0(m.model, ep)
    owners = sorted({"plugin" if layer_state.state_of(x) is not None else "sglang" for x in layers.values()})
    buckets = bucketed(new, bucket_mib)
    expert_tensors = sum(1 for n in new if ".experts." in n)
    nbytes = sum(t.numel() * t.element_size() for t in new.values())
    expert_bytes = sum(t.numel() * t.element_size() for n, t in new.items() if ".experts." in n)

    def tensor_update():
        with m.session():
            for b in buckets:
                m.update_from_tensor(b)

    def disk_update():
        m.update_from_disk(dir_b)

    def flattened_update():
        with m.session():
            for b in buckets:
                m.update_from_tensor(b, load_format="flattened_bucket")

    updates = {"tensor": tensor_update, "disk": disk_update, "flattened": flattened_update}
    clock = Clock(m.model)

    from ..updates import batched_writes

    contexts: dict[str, Any] = {
        "plugin": contextlib.nullcontext,
        "per_tensor": batched_writes.disabled,
        "bypassed": bypass,
        "unhooked": lambda: unhooked(m.model),
    }

    def once(flow, mode):
        clock.reset()
        with contexts[mode](), clock:
            t, c = time.perf_counter(), time.process_time()
            updates[flow]()
            total, cpu = time.perf_counter() - t, time.process_time() - c
        return {"wall": total, "cpu": cpu, **clock.s, **{f"{k}_cpu": v for k, v in clock.cpu.items()}}

    report: dict = {
        "model": f"DeepSeek-V3 architecture ({len(spec.moe_layers)} MoE layers of {experts} experts, H {hidden}, "
        f"I {intermediate}; a dense first layer)",
        "quant": quant,
        "experts": experts,
        "hidden": hidden,
        "intermediate": intermediate,
        "moe_layers": len(spec.moe_layers),
        "layers_prepared_by": owners,
        "request_tensors": len(new),
        "request_MiB": round(nbytes / 2**20, 1),
        "expert_MiB": round(expert_bytes / 2**20, 1),
        "buckets": len(buckets),
        "bucket_mib": bucket_mib,
        "repeats": repeats,
        "torch_threads": torch.get_num_threads(),
        "loader_calls_from": "SGLang's thread pool (CPU tensors)" if sglang_threads else "the calling thread",
        "simulated_ep_rank_0_of": ep,
        "checkpoint_write_s": round(made_s, 2),
        "model_load_s": round(load_s, 2),
        "flows": {},
    }
    for flow in flows:
        modes = [x for x in MODES if x != "unhooked" or unhooked_exact(flow, m.model)]
        for mode in modes:  # warm-up: caches, allocator, first-touch of pages
            once(flow, mode)
        samples: dict[str, list] = {x: [] for x in modes}
        for r in range(repeats):
            order = modes[r % len(modes) :] + modes[: r % len(modes)]
            for mode in order:
                samples[mode].append(once(flow, mode))
        rows = {mode: _stats(got) for mode, got in samples.items()}
        entry: dict = {"modes": rows}
        for clock_kind in ("cpu", "wall"):
            key = f"without_layout_{clock_kind}_s_median"
            base, plug = rows["bypassed"][key], rows["plugin"][key]
            entry[f"overhead_pct_vs_bypassed_{clock_kind}"] = round(100 * (plug - base) / base, 1)
            # the goal of issue #38: an update through the plugin in at most half the time of SGLang's own loader
            entry[f"ratio_vs_bypassed_{clock_kind}"] = round(plug / base, 3)
            total = f"total_{clock_kind}_s_median"
            with_layout = rows["plugin"][total] / rows["bypassed"][total]
            entry[f"ratio_vs_bypassed_{clock_kind}_with_layout"] = round(with_layout, 3)
            if "per_tensor" in rows:
                entry[f"ratio_vs_per_tensor_{clock_kind}"] = round(plug / rows["per_tensor"][key], 3)
            if "unhooked" in rows:
                u = rows["unhooked"][key]
                entry[f"overhead_pct_vs_unhooked_{clock_kind}"] = round(100 * (plug - u) / u, 1)
        if "unhooked" not in rows:
            entry["unhooked"] = "not exact on this flow (writes land on prepared experts): not run"
        n_buckets = 1 if flow == "disk" else len(buckets)
        for mode in ("plugin", "per_tensor", "bypassed"):
            with contexts[mode](), counting(m.model) as c:
                updates[flow]()
            entry[f"counts_{mode}"] = summary(c, expert_tensors, n_buckets)
        with device_path(), counting(m.model) as c:  # the conversions CUDA tensors would make: device syncs
            updates[flow]()
        entry["counts_plugin_device_path"] = summary(c, expert_tensors, n_buckets)
        if profile_top:
            for mode in ("plugin", "bypassed"):
                entry[f"profile_{mode}"] = _profile(updates[flow], contexts[mode], expert_tensors, profile_top)
        calls = entry["counts_plugin"]["expert_tensors_in_request"]
        if calls:
            key = "without_layout_cpu_s_median"
            added = rows["plugin"][key] - rows["bypassed"][key]
            entry["plugin_cpu_us_per_expert_tensor"] = round(1e6 * added / calls, 1)
        report["flows"][flow] = entry
    if ep > 1:  # a rank of EP `ep` keeps its experts: not a fresh load of the second checkpoint
        report["model_equals_fresh_load_of_the_update"] = None
        return report
    exact = m.differences(m.fresh(dir_b))
    report["model_equals_fresh_load_of_the_update"] = not exact
    if exact:
        report["differs"] = exact[:8]
    return report


# ---- one process per format -------------------------------------------------------------------------------------


def run(quants=("nvfp4", "fp8_block"), size: str = "default", repeats: int = 3, bucket_mib: float = 256, **over):
    """Each format in a fresh process (one ModelRunner per process: SGLang's expert-location metadata is global)."""
    kw = {**SIZES[size], **{k: v for k, v in over.items() if v is not None}}
    out = []
    for q in quants:
        args = dict(quant=q, repeats=repeats, bucket_mib=bucket_mib, **kw)
        code = (
            "import json; from sglang_trtllm_moe.sandbox import bench_update; "
            f"print(json.dumps(bench_update.run_in_this_process(**{args!r})))"
        )
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=_child_env())
        if proc.returncode:
            raise RuntimeError(f"model update bench ({q}) failed:\n{proc.stderr[-3000:]}")
        out.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    return out


def _child_env() -> dict:
    """This process's environment, with the directory this package was imported from first on PYTHONPATH (so a
    child imports the same copy: a checkout run with PYTHONPATH=. or sys.path set by a script)."""
    import sglang_trtllm_moe

    root = os.path.dirname(os.path.dirname(os.path.abspath(sglang_trtllm_moe.__file__)))
    rest = os.environ.get("PYTHONPATH")
    return {**os.environ, "PYTHONPATH": os.pathsep.join([root, rest] if rest else [root])}


def bench_rows(reports: list[dict]) -> list[dict]:
    """`sglang-trtllm-moe bench` rows: per format and flow, the plugin vs the same update with its checks bypassed
    (CPU seconds of the process, medians, the layout work excluded), and the layout work on its own row."""
    rows = []
    for rep in reports:
        label = f"{rep['quant']}, {rep['moe_layers']} MoE layers x {rep['experts']} experts, H {rep['hidden']}"
        for flow, e in rep["flows"].items():
            p, b = e["modes"]["plugin"], e["modes"]["bypassed"]
            what = {"tensor": "tensor buckets in a session", "flattened": "flattened buckets in a session"}.get(
                flow, "from disk"
            )
            key = "without_layout_cpu_s_median"
            rows.append(
                dict(
                    name=f"model RL update ({what}), {label}: plugin vs checks bypassed, layout work excluded",
                    plugin_s=p[key],
                    upstream_s=b[key],
                    ratio=b[key] / p[key],
                    overhead_pct=e["overhead_pct_vs_bypassed_cpu"],
                    loader_calls=e["counts_plugin"]["fused_moe_weight_loader_calls"],
                    syncs_in_validation=e["counts_plugin"]["syncs_in_validation_total"],
                    validations_per_write=e["counts_plugin"]["validations_per_write"],
                    clock="CPU seconds of the process (medians)",
                    compared_with="the same update, same run, the plugin's checks bypassed (bench_update_modes.bypass)",
                )
            )
            none = "" if "plugin" in rep["layers_prepared_by"] else " (none: SGLang prepares these layers itself here)"
            rows.append(
                dict(
                    name=f"model RL update ({what}), {label}: the plugin's layout work alone{none}",
                    plugin_s=p["layout_cpu_s_median"],
                    upstream_s=b["layout_cpu_s_median"],
                    ratio=(b["layout_cpu_s_median"] / p["layout_cpu_s_median"]) if p["layout_cpu_s_median"] else 1.0,
                    clock="CPU seconds in layer_state.flush and WeightFormat.unprepare_ (medians)",
                    compared_with="the same layout work in the bypassed run",
                )
            )
    return rows


def main(argv=None) -> int:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--tiny", action="store_true", help="NVFP4 (unless --quant), 8 experts, H 256, one repeat: a smoke run"
    )
    ap.add_argument("--size", choices=sorted(SIZES), default="default")
    ap.add_argument("--quant", action="append", help="nvfp4 | fp8_block (repeatable; default both)")
    ap.add_argument("--experts", type=int)
    ap.add_argument("--hidden", type=int)
    ap.add_argument("--intermediate", type=int)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--bucket-mib", type=float, default=256)
    ap.add_argument("--flows", default=",".join(FLOWS))
    ap.add_argument(
        "--sglang-threads", action="store_true", help="keep DeepSeek's thread pool for the loader calls of CPU tensors"
    )
    ap.add_argument("--out", help="also write the JSON here")
    ap.add_argument("--profile-top", type=int, default=0, help="cProfile one update per flow and mode: top N")
    ap.add_argument(
        "--ep", type=int, default=1, help="simulate EP rank 0 of N: the other ranks' experts are dropped (as_ep_rank_0)"
    )
    a = ap.parse_args(argv)
    size, repeats, bucket = ("tiny", 1, 1.0) if a.tiny else (a.size, a.repeats, a.bucket_mib)
    quants = tuple(a.quant or (("nvfp4",) if a.tiny else ("nvfp4", "fp8_block")))
    reports = run(
        quants,
        size,
        repeats,
        bucket,
        experts=a.experts,
        hidden=a.hidden,
        intermediate=a.intermediate,
        flows=tuple(a.flows.split(",")),
        sglang_threads=a.sglang_threads or None,
        profile_top=a.profile_top or None,
        ep=a.ep if a.ep > 1 else None,
    )
    doc = json.dumps({"reports": reports})
    if a.out:
        with open(a.out, "w") as f:
            f.write(json.dumps({"reports": reports}, indent=1) + "\n")
    print(doc)
    return 0
