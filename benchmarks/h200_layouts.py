"""Run on a CUDA machine (the lent H200): NVFP4 layer preparation in place against the copy bandwidth and against a
per-expert loop, all in one run; CUDA == CPU bytes; the emulator's quantizer on CUDA == on CPU.
Needs only torch (+ triton for the fast path) and this package (no SGLang, no flashinfer).

    python benchmarks/h200_layouts.py --out result.json [--variants]
    python benchmarks/h200_layouts.py --tiny          (CPU, 2 experts, H 512, I 256: a smoke run of the script)

Bandwidths count each byte read once and written once (2 x tensor bytes / time), the way the copy is counted.
"fast" is the default path on CUDA (one-pass Triton kernels, layouts._triton_layouts); "reference" is the pure-torch
in-place path (gather a chunk of experts into scratch, copy back) that CPU runs, forced with set_fast_path(False).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import time
from types import SimpleNamespace

import torch

from sglang_trtllm_moe import layouts, quant
from sglang_trtllm_moe.formats.nvfp4 import NVFP4

NAMES = ("w13_weight", "w13_weight_scale", "w2_weight", "w2_weight_scale")
GROUPS = ("w13", "w2")


def cuda_time(fn, repeats=5, warmup=1, hide_launch=False):
    """Min over repeats of device time between events around fn(). Default: as a caller sees it, the CPU-side
    launch cost included (the GPU idles while Python launches). hide_launch: the GPU is first kept busy
    (torch.cuda._sleep) long enough for the CPU to queue fn() entirely, so the events time the GPU work alone."""
    for _ in range(warmup):
        fn()
    if not torch.cuda.is_available():  # a smoke run of this script on a CPU machine
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return min(times)
    torch.cuda.synchronize()
    sleep_cycles = 0
    if hide_launch:
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        sleep_cycles = int(min(0.2, 2 * (time.perf_counter() - t0) + 1e-3) * 2e9)
    times = []
    for _ in range(repeats):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        if sleep_cycles:
            torch.cuda._sleep(sleep_cycles)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    return min(times)


def timed(fn, nb, copy_bw, repeats=5):
    """Both views of one operation on nb bytes: wall (launch included) and GPU time (launch hidden)."""
    s = cuda_time(fn, repeats=repeats)
    g = cuda_time(fn, repeats=repeats, hide_launch=True)
    return dict(
        s=s,
        gbps=2 * nb / s / 1e9,
        fraction_of_copy=2 * nb / s / 1e9 / copy_bw,
        gpu_s=g,
        gpu_gbps=2 * nb / g / 1e9,
        gpu_fraction_of_copy=2 * nb / g / 1e9 / copy_bw,
    )


def nvfp4_layer(e, h, i, device, gated=True, seed=0):
    """Random packed-FP4 bytes and positive finite e4m3 scales (bytes < 0x7F), generated where they live."""
    g = torch.Generator(device=device).manual_seed(seed)
    m13 = (2 if gated else 1) * i

    def rnd(shape, hi=256):
        return torch.randint(0, hi, shape, dtype=torch.uint8, generator=g, device=device)

    return SimpleNamespace(
        moe_runner_config=SimpleNamespace(is_gated=gated, activation="silu"),
        w13_weight=rnd((e, m13, h // 2)),
        w2_weight=rnd((e, h, i // 2)),
        w13_weight_scale=rnd((e, m13, h // 16), 0x7F).view(torch.float8_e4m3fn),
        w2_weight_scale=rnd((e, h, i // 16), 0x7F).view(torch.float8_e4m3fn),
    )


def nbytes(t):
    return t.numel() * t.element_size()


def u8(t):
    return t.view(torch.uint8)


def prep(layer, experts):
    for g in GROUPS:
        NVFP4.prepare_(layer, g, experts)


def unprep(layer, experts):
    for g in GROUPS:
        NVFP4.unprepare_(layer, g, experts)


def param_fn(layer, name, inverse=False):
    pl = [pp for pp in NVFP4.params if pp.name == name][0]
    t = getattr(layer, name)
    rmap = NVFP4.row_map(layer, pl, t)
    if pl.sf_swizzle:
        if inverse:
            return lambda: layouts.unswizzle_sf_and_unpermute_rows_(t, rmap)
        return lambda: layouts.permute_rows_and_swizzle_sf_(t, rmap)
    if inverse:
        return lambda: layouts.unpermute_rows_(t, rmap)
    return lambda: layouts.permute_rows_(t, rmap)


def per_expert_loop(layer):
    """SGLang 0.5.23's prepare_static_weights_for_trtllm_fp4_moe algorithm in plain torch: a Python loop over experts,
    each expert's rows gathered with its cached permutation into preallocated outputs (out of place), scales gathered
    into a scratch and 128x4-interleaved (flashinfer's CUDA interleave replaced by the pure-torch swizzle)."""
    w13, w2 = u8(layer.w13_weight), u8(layer.w2_weight)
    s13, s2 = u8(layer.w13_weight_scale), u8(layer.w2_weight_scale)
    r13 = layouts.w13_row_map(w13.shape[1], True, device=w13.device)
    r2 = layouts.w2_row_map(w2.shape[1], device=w2.device)
    o13, o2, os13, os2 = (torch.empty_like(x) for x in (w13, w2, s13, s2))
    sc13, sc2 = torch.empty_like(s13[0]), torch.empty_like(s2[0])

    def run():
        for i in range(w13.shape[0]):
            o13[i] = w13[i][r13]
            torch.index_select(s13[i], 0, r13, out=sc13)
            os13[i] = layouts.swizzle_sf_128x4(sc13)
            o2[i] = w2[i][r2]
            torch.index_select(s2[i], 0, r2, out=sc2)
            os2[i] = layouts.swizzle_sf_128x4(sc2)

    def run_w13():
        for i in range(w13.shape[0]):
            o13[i] = w13[i][r13]

    return run, run_w13, (o13, os13, o2, os2)


def measure_peak(fn):
    if not torch.cuda.is_available():
        fn()
        return 0
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


@contextlib.contextmanager
def fast_path(fast: bool):
    """The layout path for the block: fast (Triton kernels on CUDA) or the pure-torch reference."""
    old = layouts.set_fast_path(fast)
    try:
        yield
    finally:
        layouts.set_fast_path(old)


def copy_bandwidth(dev, nbytes=None):
    """Read + write GB/s of one large device copy (the buffers are freed on return)."""
    x = torch.empty(nbytes or (4 * 2**30 if dev.type == "cuda" else 2**28), dtype=torch.uint8, device=dev)
    y = torch.empty_like(x)
    return 2 * x.numel() / cuda_time(lambda: y.copy_(x), repeats=10) / 1e9


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out")
    p.add_argument("--tiny", action="store_true", help="CPU, 2 experts, H 512, I 256: a smoke run of the script")
    p.add_argument("--experts", type=int, default=256)
    p.add_argument(
        "--variants",
        action="store_true",
        help="also time the kernels' tile variants (each row: the defaults updated with its config)",
    )
    p.add_argument("--device", default="cuda", help="cpu: a smoke run of the script itself (use few --experts)")
    a = p.parse_args()
    shape = (7168, 2048)
    if a.tiny:
        a.device, a.experts, a.variants, shape = "cpu", 2, False, (512, 256)
    elif not a.out:
        p.error("--out is required (except with --tiny)")
    dev = torch.device(a.device)
    fastmod = layouts._triton_layouts()
    res = {
        "device": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "code_commit": os.environ.get("CODE_COMMIT"),
        "triton": getattr(__import__("triton"), "__version__", None) if fastmod is not None else None,
        "fast_path_config": dict(fastmod.CONFIG) if fastmod is not None else None,
    }

    copy_bw = copy_bandwidth(dev, 2**22 if a.tiny else None)
    res["copy_gbps_read_plus_write"] = copy_bw

    # ---- one DeepSeek-V3 NVFP4 layer (its tensors are freed when this returns)
    deepseek_layer(res, a.experts, dev, copy_bw, fastmod if a.variants else None, shape)
    torch.cuda.empty_cache()

    # ---- CUDA == CPU, bytes, on small layers (gated and non-gated), storage unchanged
    same = {}
    for gated in (True, False):
        cpu = nvfp4_layer(4, 512, 256, "cpu", gated=gated, seed=3)
        gpu = SimpleNamespace(**{k: (v.to(dev) if isinstance(v, torch.Tensor) else v) for k, v in vars(cpu).items()})
        gptrs = {n: getattr(gpu, n).data_ptr() for n in NAMES}
        prep(cpu, [0, 1, 2, 3])
        prep(gpu, [0, 1, 2, 3])
        same[f"gated={gated}"] = all(
            torch.equal(u8(getattr(cpu, n)), u8(getattr(gpu, n)).cpu()) for n in NAMES
        ) and all(getattr(gpu, n).data_ptr() == gptrs[n] for n in NAMES)
    res["cuda_equals_cpu_bytes_and_in_place"] = same

    w = torch.randn(256, 512, generator=torch.Generator().manual_seed(1))
    pc, sc = quant.nvfp4_quantize(w, 100.0)
    pg, sg = quant.nvfp4_quantize(w.to(dev), 100.0)
    res["nvfp4_quantize_cuda_equals_cpu"] = bool(torch.equal(pc, pg.cpu()) and torch.equal(u8(sc), u8(sg).cpu()))
    if a.out:
        with open(a.out, "w") as f:
            json.dump(res, f, indent=2)
    summary(res)
    print(json.dumps(res))


def deepseek_layer(res, e, dev, copy_bw, variants_mod, shape=(7168, 2048)):
    """One DeepSeek-V3 NVFP4 layer (e of 256 experts, H 7168, I 2048 = `shape`), in place through formats/nvfp4.py: byte
    checks, prep/unprep rows per path, same-run references, RL updates, and the tile variants when variants_mod (the
    fast path's module) is given. Writes its sections into res."""

    def rate(nb, s):
        gbps = 2 * nb / s / 1e9
        return dict(s=s, gbps=gbps, fraction_of_copy=gbps / copy_bw)

    layer = nvfp4_layer(e, *shape, dev)
    orig = {n: getattr(layer, n).clone() for n in NAMES}
    total = sum(nbytes(getattr(layer, n)) for n in NAMES)
    ptrs = {n: getattr(layer, n).data_ptr() for n in NAMES}
    allx = list(range(e))

    # bytes: fast == reference on the whole layer, both ways, storage unchanged
    with fast_path(True):
        prep(layer, allx)
    fast_bytes = {n: getattr(layer, n).clone() for n in NAMES}
    with fast_path(True):
        unprep(layer, allx)
    round_trip = all(torch.equal(u8(getattr(layer, n)), u8(orig[n])) for n in NAMES)
    with fast_path(False):
        prep(layer, allx)
    same = all(torch.equal(u8(getattr(layer, n)), u8(fast_bytes[n])) for n in NAMES)
    with fast_path(False):
        unprep(layer, allx)
    del fast_bytes
    res["whole_layer_checks"] = dict(
        fast_equals_reference_bytes=same,
        fast_round_trip_restores_checkpoint=round_trip,
        data_ptr_unchanged=all(getattr(layer, n).data_ptr() == ptrs[n] for n in NAMES),
    )

    def one():
        prep(layer, allx)

    layer_rows = {}
    for fast, label in ((True, "fast"), (False, "reference")):
        reps = 5 if fast else 3
        comps = {}
        with fast_path(fast):
            peak = measure_peak(one)
            prep_row = timed(one, total, copy_bw, reps)
            unprep_row = timed(lambda: unprep(layer, allx), total, copy_bw, reps)
            for n in NAMES:
                nb = nbytes(getattr(layer, n))
                comps[n] = dict(
                    bytes=nb,
                    prep=timed(param_fn(layer, n), nb, copy_bw),
                    unprep=timed(param_fn(layer, n, inverse=True), nb, copy_bw),
                )
        layer_rows[label] = dict(
            prep=prep_row,
            unprep=unprep_row,
            peak_extra_bytes=peak,
            peak_extra_fraction_of_layer=peak / total,
            components=comps,
        )
    res["deepseek_layer"] = dict(experts=e, bytes=total, **layer_rows)

    # same-run comparisons: one out-of-place batched gather of w13, SGLang's per-expert loop (out of place)
    w13 = u8(layer.w13_weight)
    oop = out_of_place_gather(w13, copy_bw)
    t_oop = oop["s"]
    loop, loop_w13, outs = per_expert_loop(layer)
    t_loop = cuda_time(loop, repeats=3)
    t_loop_w13 = cuda_time(loop_w13, repeats=3)
    loop_peak = measure_peak(lambda: per_expert_loop(layer)[0]())
    fast_prep = layer_rows["fast"]["prep"]["s"]
    res["same_run_references"] = dict(
        w13_out_of_place_batched_gather=oop,
        per_expert_loop_whole_layer=dict(**rate(total, t_loop), peak_extra_bytes=loop_peak),
        per_expert_loop_w13_only=rate(nbytes(w13), t_loop_w13),
        fast_speedup_vs_per_expert_loop=t_loop / fast_prep,
        fast_speedup_vs_reference_in_place=layer_rows["reference"]["prep"]["s"] / fast_prep,
        fast_w13_weight_vs_out_of_place_gather=layer_rows["fast"]["components"]["w13_weight"]["prep"]["s"] / t_oop,
    )
    # the per-expert loop's bytes equal ours (it is out of place; ours in place)
    with fast_path(True):
        prep(layer, allx)
    res["whole_layer_checks"]["fast_equals_per_expert_loop_bytes"] = all(
        torch.equal(u8(getattr(layer, n)), o) for n, o in zip(NAMES, outs, strict=True)
    )
    with fast_path(True):
        unprep(layer, allx)
    del outs, loop, loop_w13

    res["rl_update"] = rl_updates(layer, e, dev)
    if variants_mod is not None:
        res["variants"] = tile_variants(layer, variants_mod, copy_bw)


def out_of_place_gather(w13, copy_bw):
    """One out-of-place batched gather of w13's rows with the w13 row map (its index and output freed on return)."""
    e, m, k = w13.shape
    r13 = layouts.w13_row_map(m, True, device=w13.device)
    flat_idx = (r13.unsqueeze(0) + torch.arange(0, e * m, m, device=w13.device).unsqueeze(1)).reshape(-1)
    out = torch.empty_like(w13)
    return timed(lambda: torch.index_select(w13.view(-1, k), 0, flat_idx, out=out.view(-1, k)), nbytes(w13), copy_bw)


def rl_updates(layer, e, dev):
    """An RL update of some experts: un-prepare them, write new bytes, prepare them (what weights.py does). The layer
    is left prepared (fast path)."""
    new = {n: torch.randint(0, 0x7F, getattr(layer, n).shape, dtype=torch.uint8, device=dev) for n in NAMES}
    with fast_path(True):
        prep(layer, list(range(e)))
    upd = {}
    for k in sorted({kk for kk in (1, 8, 32, e) if kk <= e}):
        lo = 3 if k + 3 <= e else 0
        upd[f"{k}_experts"] = rl_update_row(layer, new, lo, k)
    return upd


def rl_update_row(layer, new, lo, k):
    """Experts lo .. lo + k - 1 updated with their bytes from new, timed on both paths."""
    ids = list(range(lo, lo + k))

    def write():  # what the loader does for these experts: copy their new bytes in
        for n in NAMES:
            u8(getattr(layer, n))[lo : lo + k].copy_(new[n][lo : lo + k])

    def update():
        unprep(layer, ids)
        write()
        prep(layer, ids)

    def layout_only():
        unprep(layer, ids)
        prep(layer, ids)

    row = {}
    for fast, label in ((True, "fast"), (False, "reference")):
        with fast_path(fast):
            row[label] = dict(
                update_s=cuda_time(update, repeats=5),
                layout_only_s=cuda_time(layout_only, repeats=5),
            )
            row[label]["update_gpu_s"] = cuda_time(update, repeats=5, hide_launch=True)
    row["write_only_s"] = cuda_time(write, repeats=5)
    return row


def tile_variants(layer, fastmod, copy_bw):
    """Kernel tile variants (fast path), on the tensors where tiles matter; fastmod.CONFIG is restored after."""
    base_cfg = dict(fastmod.CONFIG)
    var = []
    cfgs = [
        ("w13_weight", dict(programs_per_sm=8)),
        ("w13_weight", dict(programs_per_sm=0)),
        ("w13_weight", dict(programs_per_sm=4)),
        ("w13_weight", dict(rows_tile_words=16384, rows_slice_words=64, programs_per_sm=0)),
        ("w13_weight", dict(rows_tile_words=4096, rows_slice_words=32, programs_per_sm=8)),
        ("w13_weight", dict(tickets=False, programs_per_sm=0)),
        ("w2_weight", dict(rows_tile_words=8192)),
        ("w2_weight", dict(rows_tile_words=4096)),
        ("w13_weight_scale", dict(sf_tiles=1, programs_per_sm=0)),
        ("w13_weight_scale", dict(sf_tiles=2, programs_per_sm=0)),
        ("w13_weight_scale", dict(sf_tiles=4, programs_per_sm=0)),
        ("w13_weight_scale", dict(sf_tiles=2, programs_per_sm=8)),
        ("w13_weight_scale", dict(sf_tiles=4, programs_per_sm=8)),
        ("w13_weight_scale", dict(sf_tiles=2, programs_per_sm=4)),
        ("w13_weight_scale", dict(sf_tiles=4, num_warps=8, programs_per_sm=0)),
        ("w13_weight_scale", dict(sf_tiles=2, sf_cols=32, programs_per_sm=0)),
        ("w13_weight_scale", dict(sf_tiles=2, tickets=False, programs_per_sm=0)),
        ("w2_weight_scale", dict(sf_tiles=1)),
        ("w2_weight_scale", dict(sf_tiles=2)),
        ("w2_weight_scale", dict(sf_tiles=4)),
        ("w2_weight_scale", dict(sf_tiles=1, num_warps=8)),
    ]
    for n, cfg in cfgs:
        fastmod.CONFIG.update(base_cfg)
        fastmod.CONFIG.update(cfg)
        try:
            with fast_path(True):
                row_ = timed(param_fn(layer, n), nbytes(getattr(layer, n)), copy_bw)
            var.append(dict(param=n, config=cfg, **row_, full_config=dict(fastmod.CONFIG)))
        except Exception as ex:  # a variant that does not compile is a row, not a failed run
            var.append(dict(param=n, config=cfg, error=f"{type(ex).__name__}: {ex}"[:300]))
        print("variant", var[-1], flush=True)
    fastmod.CONFIG.clear()
    fastmod.CONFIG.update(base_cfg)
    return var


def summary(res):
    c = res["copy_gbps_read_plus_write"]
    L_ = res["deepseek_layer"]
    print(f"\ncopy {c:.0f} GB/s")
    for label in ("fast", "reference"):
        r = L_[label]
        print(
            f"{label:9s} layer prep {r['prep']['s'] * 1e3:.2f} ms {100 * r['prep']['fraction_of_copy']:.0f}% "
            f"(gpu {r['prep']['gpu_s'] * 1e3:.2f} ms {100 * r['prep']['gpu_fraction_of_copy']:.0f}%) "
            f"unprep {r['unprep']['s'] * 1e3:.2f} ms peak {r['peak_extra_bytes'] / 2**20:.0f} MiB | "
            + " ".join(
                f"{n} {v['prep']['s'] * 1e3:.3f}ms {100 * v['prep']['fraction_of_copy']:.0f}% "
                f"(gpu {v['prep']['gpu_s'] * 1e3:.3f} {100 * v['prep']['gpu_fraction_of_copy']:.0f}%)"
                for n, v in r["components"].items()
            )
        )
    s = res["same_run_references"]
    print(
        f"per-expert loop {s['per_expert_loop_whole_layer']['s'] * 1e3:.2f} ms, "
        f"speedup {s['fast_speedup_vs_per_expert_loop']:.1f}x; "
        f"oop w13 gather {s['w13_out_of_place_batched_gather']['s'] * 1e3:.2f} ms"
    )
    for k, v in res["rl_update"].items():
        print(
            f"update {k}: fast {v['fast']['update_s'] * 1e3:.3f} ms (layout {v['fast']['layout_only_s'] * 1e3:.3f}, "
            f"gpu {v['fast']['update_gpu_s'] * 1e3:.3f}) "
            f"ref {v['reference']['update_s'] * 1e3:.3f} ms write {v['write_only_s'] * 1e3:.3f} ms"
        )
    print("checks", res["whole_layer_checks"], res["cuda_equals_cpu_bytes_and_in_place"])


if __name__ == "__main__":
    main()
