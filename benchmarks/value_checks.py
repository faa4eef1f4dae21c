"""Benchmark: what checking every scale's values costs on a DeepSeek-V3-size MoE layer (issue #27), against the
copy the update does anyway, in the same run.

Why: a weight update is refused when any scale holds a bad value (NaN, negative; 1-byte scales on their bytes), so
every scale of every update is read once more. This measures that read on one layer's scales, as an RL bucket holds
them (one tensor per expert and projection: 256 x 3), with the plugin's batched check (value_checks.find_bad: one
verdict per tensor from max / min reductions on its device, one transfer per call) and with an elementwise mask
read back per tensor (the first implementation; on CUDA one synchronisation each), and the copy of the same layer's
weights and scales into their storage (what the update itself writes).

`--disk` (CPU, SGLang installed): the pre-check of a disk update of a real SGLang FusedMoE NVFP4 layer at hidden 7168
/ intermediate 2048 (`--disk-experts` of them) — checkpoint_checks.check_checkpoint: headers, file sizes, every scale
read and checked — against reading the same checkpoint's tensors once (what SGLang's loader reads).

Run: `python benchmarks/value_checks.py [--device cpu|cuda] [--experts 256] [--disk] [--tiny]`; prints JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

import torch

from sglang_trtllm_moe.formats.load_rules import E4M3_BYTES, NONNEGATIVE, UE8M0_BYTES
from sglang_trtllm_moe.updates import value_checks

#: DeepSeek-V3 / R1: routed experts per layer, hidden, moe intermediate
DEEPSEEK_V3 = (256, 7168, 2048)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def layer_tensors(fmt: str, e: int, h: int, i: int, device: torch.device):
    """(weights, [(scale, rule)]) of one layer, one tensor per expert and projection, valid values."""
    g = torch.Generator(device="cpu").manual_seed(0)

    def u8(shape, lo=0, hi=256):
        return torch.randint(lo, hi, shape, dtype=torch.uint8, generator=g).to(device)

    weights, scales = [], []
    for _ in range(e):
        for rows, cols in ((i, h), (i, h), (h, i)):  # gate, up, down
            if fmt == "nvfp4":
                weights.append(u8((rows, cols // 2)))
                scales.append((u8((rows, cols // 16), 0, 0x7F).view(torch.float8_e4m3fn), E4M3_BYTES))
            elif fmt == "fp8_block":
                weights.append(u8((rows, cols)).view(torch.float8_e4m3fn))
                scales.append((torch.rand((-(-rows // 128), -(-cols // 128)), generator=g).to(device), NONNEGATIVE))
            elif fmt == "mxfp8":
                weights.append(u8((rows, cols)).view(torch.float8_e4m3fn))
                scales.append((u8((rows, cols // 32), 100, 140), UE8M0_BYTES))
            else:
                raise ValueError(fmt)
    return weights, scales


def _best(fn, device, repeat: int) -> float:
    fn()
    _sync(device)
    best = float("inf")
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        _sync(device)
        best = min(best, time.perf_counter() - t)
    return best


def bucket_row(fmt: str, e: int, h: int, i: int, device: torch.device, repeat: int) -> dict:
    weights, scales = layer_tensors(fmt, e, h, i, device)
    dst_w = [torch.empty_like(w) for w in weights]
    dst_s = [torch.empty_like(s) for s, _ in scales]

    def batched():
        assert value_checks.find_bad(scales) == []

    def elementwise():  # the first implementation: a 4-op mask per tensor, read back per tensor
        for s, rule in scales:
            assert not bool(value_checks.bad_mask(s, rule).any())  # one synchronisation each on CUDA

    def copy():
        for d, w in zip(dst_w, weights, strict=True):
            d.copy_(w)
        for d, (s, _) in zip(dst_s, scales, strict=True):
            d.copy_(s)

    t_batched, t_per, t_copy = (_best(f, device, repeat) for f in (batched, elementwise, copy))
    scale_bytes = sum(s.numel() * s.element_size() for s, _ in scales)
    weight_bytes = sum(w.numel() * w.element_size() for w in weights)
    return {
        "format": fmt,
        "device": str(device),
        "experts": e,
        "hidden": h,
        "intermediate": i,
        "scale_tensors": len(scales),
        "scale_MiB": round(scale_bytes / 2**20, 1),
        "weight_MiB": round(weight_bytes / 2**20, 1),
        "check_batched_ms": round(t_batched * 1e3, 3),
        "check_elementwise_per_tensor_ms": round(t_per * 1e3, 3),
        "copy_layer_ms": round(t_copy * 1e3, 3),
        "check_over_copy": round(t_batched / t_copy, 3),
    }


def disk_row(experts: int, h: int, i: int, repeat: int) -> dict:
    """check_checkpoint of a real FusedMoE NVFP4 layer's checkpoint vs reading its tensors once."""
    from safetensors import safe_open
    from safetensors.torch import save_file
    from sglang.srt.plugins import load_plugins

    from sglang_trtllm_moe.sandbox import layers as cpu_layers
    from sglang_trtllm_moe.sandbox.runtime import init_single_process
    from sglang_trtllm_moe.updates import bucket_validation, checkpoint_checks, checkpoint_headers

    load_plugins()
    init_single_process("flashinfer_trtllm")
    spec = cpu_layers.MoeSpec(num_experts=experts, hidden=h, intermediate=i, fmt="nvfp4")
    model = cpu_layers.TinyMoeModel(spec)
    ck = cpu_layers.random_nvfp4_checkpoint(spec, seed=1)
    model.load_weights([(model.prefix + k, v) for k, v in ck.items()])
    model.experts.quant_method.process_weights_after_loading(model.experts)  # the plugin manages the layer now
    assert bucket_validation.managed_modules(model), "the layer is not managed: nothing would be checked"
    with tempfile.TemporaryDirectory(prefix="value-checks-") as d:
        save_file({model.prefix + k: v.contiguous() for k, v in ck.items()}, os.path.join(d, "model.safetensors"))
        files = checkpoint_headers.files_of(d, "auto")

        def check():
            checkpoint_checks.check_checkpoint(model, files)

        def read():  # what SGLang's loader does with each tensor at least: read it (mmap) and copy its bytes out
            with safe_open(files[0], framework="pt", device="cpu") as f:
                for n in f.keys():
                    f.get_tensor(n).clone()

        t_check, t_read = _best(check, torch.device("cpu"), repeat), _best(read, torch.device("cpu"), repeat)
        size = os.path.getsize(files[0])
    return {
        "format": "nvfp4",
        "path": "disk pre-check (check_checkpoint) vs reading and copying the checkpoint's tensors once",
        "experts": experts,
        "hidden": h,
        "intermediate": i,
        "checkpoint_MiB": round(size / 2**20, 1),
        "check_checkpoint_ms": round(t_check * 1e3, 2),
        "read_copy_ms": round(t_read * 1e3, 2),
        "check_over_read_copy": round(t_check / t_read, 3),
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--experts", type=int, default=DEEPSEEK_V3[0])
    p.add_argument("--formats", default="nvfp4,fp8_block,mxfp8")
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--disk", action="store_true", help="also the disk pre-check on a real SGLang layer (CPU)")
    p.add_argument("--disk-experts", type=int, default=16)
    p.add_argument("--tiny", action="store_true", help="tiny sizes (smoke test)")
    a = p.parse_args(argv)
    torch.set_num_threads(int(os.environ.get("SGLANG_TRTLLM_MOE_BENCH_THREADS", "1")))
    _, h, i = DEEPSEEK_V3
    e = a.experts
    if a.tiny:
        e, h, i, a.repeat, a.disk_experts = 2, 256, 128, 1, 2
    device = torch.device(a.device)
    rows = [bucket_row(f, e, h, i, device, a.repeat) for f in a.formats.split(",")]
    if a.disk:
        rows.append(disk_row(a.disk_experts, h, i, a.repeat))
    print(json.dumps({"benchmark": "value_checks", "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
