"""Run on a CUDA machine (the lent H200): layout prep throughput against the copy bandwidth, CUDA == CPU bytes,
and the emulator on CUDA == on CPU. Needs only torch + this package (no SGLang, no flashinfer).

    python benchmarks/h200_layouts.py --out result.json
"""

from __future__ import annotations

import argparse
import json
import time
from types import SimpleNamespace

import torch

from sglang_trtllm_moe import layouts, quant
from sglang_trtllm_moe.formats.nvfp4 import NVFP4


def cuda_time(fn, repeats=5):
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    return min(times)


def nvfp4_layer(e, h, i, device, gated=True, seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    m13 = (2 if gated else 1) * i

    def rnd(shape, hi=256):
        return torch.randint(0, hi, shape, dtype=torch.uint8, generator=g).to(device)

    return SimpleNamespace(
        moe_runner_config=SimpleNamespace(is_gated=gated, activation="silu"),
        w13_weight=rnd((e, m13, h // 2)), w2_weight=rnd((e, h, i // 2)),
        w13_weight_scale=rnd((e, m13, h // 16), 0x7F).view(torch.float8_e4m3fn),
        w2_weight_scale=rnd((e, h, i // 16), 0x7F).view(torch.float8_e4m3fn),
    )


def nbytes(layer, names):
    return sum(getattr(layer, n).numel() * getattr(layer, n).element_size() for n in names)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--experts", type=int, default=256)
    a = p.parse_args()
    dev = torch.device("cuda")
    res = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}

    x = torch.empty(4 * 2**30, dtype=torch.uint8, device=dev)
    y = torch.empty_like(x)
    t = cuda_time(lambda: y.copy_(x))
    res["copy_gbps_read_plus_write"] = 2 * x.numel() / t / 1e9
    del x, y

    # whole DeepSeek-V3 NVFP4 layer, in place, through the format (what process_weights_after_loading runs)
    layer = nvfp4_layer(a.experts, 7168, 2048, dev)
    allnames = ("w13_weight", "w13_weight_scale", "w2_weight", "w2_weight_scale")
    total = nbytes(layer, allnames)
    experts = list(range(a.experts))

    def prep():
        for g in ("w13", "w2"):
            NVFP4.prepare_(layer, g, experts)

    def unprep():
        for g in ("w13", "w2"):
            NVFP4.unprepare_(layer, g, experts)

    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    t_prep = cuda_time(lambda: (prep(), unprep()))  # a round trip keeps the bytes comparable between repeats
    peak_extra = torch.cuda.max_memory_allocated() - base
    t_one = cuda_time(prep, repeats=1)
    res["deepseek_layer"] = dict(
        experts=a.experts, bytes=total, prep_plus_unprep_s=t_prep, prep_s=t_one,
        gbps_read_plus_write_one_pass=2 * total / t_one / 1e9,
        fraction_of_copy=(2 * total / t_one / 1e9) / res["copy_gbps_read_plus_write"],
        peak_extra_bytes=peak_extra, peak_extra_fraction_of_layer=peak_extra / total,
    )
    comp = {}
    for name, grp in (("w13_weight", "w13"), ("w13_weight_scale", "w13"), ("w2_weight", "w2"), ("w2_weight_scale", "w2")):
        pl = [pp for pp in NVFP4.params if pp.name == name][0]
        t_ = getattr(layer, name)
        rmap = NVFP4.row_map(layer, pl, t_)
        if pl.sf_swizzle:
            fn = lambda: layouts.permute_rows_and_swizzle_sf_(t_, rmap)
        else:
            fn = lambda: layouts.permute_rows_(t_, rmap)
        tt = cuda_time(fn, repeats=3)
        comp[name] = dict(s=tt, gbps=2 * t_.numel() * t_.element_size() / tt / 1e9)
    res["components"] = comp
    del layer
    torch.cuda.empty_cache()

    # CUDA == CPU, bytes, on a small layer (gated and non-gated)
    same = {}
    for gated in (True, False):
        cpu = nvfp4_layer(4, 512, 256, "cpu", gated=gated, seed=3)
        gpu = nvfp4_layer(4, 512, 256, dev, gated=gated, seed=3)
        ptrs = {n: getattr(gpu, n).data_ptr() for n in allnames}
        for g in ("w13", "w2"):
            NVFP4.prepare_(cpu, g, [0, 1, 2, 3])
            NVFP4.prepare_(gpu, g, [0, 1, 2, 3])
        same[f"gated={gated}"] = all(
            torch.equal(getattr(cpu, n).view(torch.uint8), getattr(gpu, n).view(torch.uint8).cpu()) for n in allnames
        ) and all(getattr(gpu, n).data_ptr() == ptrs[n] for n in allnames)
    res["cuda_equals_cpu_bytes_and_in_place"] = same

    # quantizer CUDA == CPU
    w = torch.randn(256, 512, generator=torch.Generator().manual_seed(1))
    pc, sc = quant.nvfp4_quantize(w, 100.0)
    pg, sg = quant.nvfp4_quantize(w.to(dev), 100.0)
    res["nvfp4_quantize_cuda_equals_cpu"] = bool(torch.equal(pc, pg.cpu()) and torch.equal(sc.view(torch.uint8), sg.view(torch.uint8).cpu()))
    with open(a.out, "w") as f:
        json.dump(res, f, indent=2)
    print(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
