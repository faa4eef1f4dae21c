"""Nsight Compute view of the layout kernels (where the lent H200's runtime allows hardware counters):

    ncu --clock-control none --profile-from-start off -k regex:'_rows_kernel|_sf_kernel' \\
        --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \\
        --metrics dram__bytes_read.sum,dram__bytes_write.sum --csv --page details \\
        python benchmarks/h200_layouts_ncu.py [--experts 32]

`--tiny`: the same launches on the CPU at 2 experts, H 512, I 256, without the profiler calls (a smoke run).
Prints one JSON line naming what was launched.

One launch of each in-place kernel on a DeepSeek-V3-shaped NVFP4 layer (fewer experts: ncu replays each kernel
and saves/restores the memory it writes). DRAM bytes read / written show whether each byte moves once.
"""

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from h200_layouts import NAMES, nvfp4_layer, param_fn  # noqa: E402

from sglang_trtllm_moe import layouts  # noqa: E402


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--experts", type=int, default=32)
    p.add_argument("--tiny", action="store_true", help="CPU, 2 experts, H 512, I 256, no profiler: a smoke run")
    a = p.parse_args()
    cuda = not a.tiny
    dev = torch.device("cuda" if cuda else "cpu")
    layer = nvfp4_layer(2 if a.tiny else a.experts, *((512, 256) if a.tiny else (7168, 2048)), dev)
    fns = [param_fn(layer, n) for n in NAMES]
    for fn in fns:  # compile and warm up outside the profiled range
        fn()
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.cudart().cudaProfilerStart()
    for fn in fns:
        fn()
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.cudart().cudaProfilerStop()
    fast = layouts.fast_path_for(layer.w13_weight.view(torch.uint8)) is not None
    print(json.dumps({"profiled": list(NAMES), "device": str(dev), "fast_path": fast, "profiler": cuda}))


if __name__ == "__main__":
    main()
