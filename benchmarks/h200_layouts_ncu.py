"""Nsight Compute view of the layout kernels (where the lent H200's runtime allows hardware counters):

    ncu --clock-control none --profile-from-start off -k regex:'_rows_kernel|_sf_kernel' \\
        --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \\
        --metrics dram__bytes_read.sum,dram__bytes_write.sum --csv --page details \\
        python benchmarks/h200_layouts_ncu.py [--experts 32]

One launch of each in-place kernel on a DeepSeek-V3-shaped NVFP4 layer (fewer experts: ncu replays each kernel
and saves/restores the memory it writes). DRAM bytes read / written show whether each byte moves once.
"""

import argparse

import torch
from h200_layouts import NAMES, nvfp4_layer, param_fn  # noqa: E402

from sglang_trtllm_moe import layouts


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--experts", type=int, default=32)
    a = p.parse_args()
    layer = nvfp4_layer(a.experts, 7168, 2048, torch.device("cuda"))
    fns = [param_fn(layer, n) for n in NAMES]
    for fn in fns:  # compile and warm up outside the profiled range
        fn()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    for fn in fns:
        fn()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()
    print("profiled", NAMES, "fast path:", layouts.fast_path_for(layer.w13_weight.view(torch.uint8)) is not None)


if __name__ == "__main__":
    main()
