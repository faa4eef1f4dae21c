"""Benchmark: NVFP4 MoE layer preparation, ours (batched, in place) vs SGLang 0.5.23's per-expert loop.

Why: weight preparation runs at load time and on every RL weight update; SGLang's per-expert Python loop allocates
new tensors and launches ~4 small ops per expert, which is slow on CPU and launch-bound on GPU. This measures both
on the same random NVFP4 checkpoint tensors and checks that the prepared bytes are identical.

"upstream" is `sglang.srt.layers.quantization.utils.prepare_static_weights_for_trtllm_fp4_moe` itself, with
flashinfer's CUDA-JIT-only `nvfp4_block_scale_interleave` swapped (where that function imports it, the `flashinfer`
module attribute) for SGLang's own pure-torch `swizzle_blockscale`, so it runs on CPU and without SM100 on CUDA.

Run: `python benchmarks/layouts_cpu.py [--experts 32] [--hidden 7168] [--intermediate 2048] [--device cpu]`
(`--tiny`: 2 experts, H 256, I 128, one repeat: a smoke run). The last line printed is the rows as JSON.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import time

import torch

from sglang_trtllm_moe import layouts as L

#: DeepSeek-V3 / R1 routed experts per layer; used only to label a scaled-down run honestly.
DEEPSEEK_V3_EXPERTS = 256


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _random_nvfp4_checkpoint(e: int, h: int, ip: int, gated: bool, device: torch.device, seed: int = 0):
    """Packed-FP4 weights (any byte is a valid pair of e2m1) and positive, finite e4m3 block scales (bytes < 0x7F)."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    m13 = (2 if gated else 1) * ip

    def rnd(shape, hi=256):
        return torch.randint(0, hi, shape, dtype=torch.uint8, generator=g).to(device)

    w13, w2 = rnd((e, m13, h // 2)), rnd((e, h, ip // 2))
    s13 = rnd((e, m13, h // 16), 0x7F).view(torch.float8_e4m3fn)
    s2 = rnd((e, h, ip // 16), 0x7F).view(torch.float8_e4m3fn)
    return w13, w2, s13, s2


@contextlib.contextmanager
def _sglang_interleave_on_any_device():
    """Temporarily point flashinfer.nvfp4_block_scale_interleave at SGLang's swizzle_blockscale (flat output)."""
    import flashinfer
    from sglang.srt.layers.quantization.utils import swizzle_blockscale

    missing = object()
    saved = flashinfer.__dict__.get("nvfp4_block_scale_interleave", missing)
    flashinfer.nvfp4_block_scale_interleave = lambda sf: (
        swizzle_blockscale(sf.view(torch.float8_e4m3fn)).view(torch.uint8).reshape(-1)
    )
    try:
        yield
    finally:
        if saved is missing:
            del flashinfer.nvfp4_block_scale_interleave
        else:
            flashinfer.nvfp4_block_scale_interleave = saved


def _upstream_prep(w13, w2, s13, s2, h, ip, gated):
    from sglang.srt.layers.quantization.utils import prepare_static_weights_for_trtllm_fp4_moe

    with _sglang_interleave_on_any_device():
        return prepare_static_weights_for_trtllm_fp4_moe(w13, w2, s13, s2, h, ip, w13.shape[0], is_gated=gated)


def prepare_nvfp4_layer_(w13, w2, s13, s2, gated: bool = True, experts=None, chunk=None) -> None:
    """Our whole-layer NVFP4 prep, in place: weight rows + scale rows + 128x4 scale swizzle, chunked over experts."""
    m13, h = w13.shape[1], w2.shape[1]
    rows13 = L.w13_row_map(m13, gated, device=w13.device)
    rows2 = L.w2_row_map(h, device=w2.device)
    L.permute_rows_(w13, rows13, experts, chunk)
    L.permute_rows_and_swizzle_sf_(s13, rows13, experts, chunk)
    L.permute_rows_(w2, rows2, experts, chunk)
    L.permute_rows_and_swizzle_sf_(s2, rows2, experts, chunk)


def _layer_name(e: int, h: int, i: int) -> str:
    if (h, i) == (7168, 2048):
        return f"nvfp4 DeepSeek-V3 layer, {e} of {DEEPSEEK_V3_EXPERTS} experts (H 7168, I 2048, gated)"
    return f"nvfp4 layer, {e} experts (H {h}, I {i}, gated)"


def bench_nvfp4_layer_prep(
    num_experts: int = 32, hidden: int = 7168, intermediate: int = 2048, device: str = "cpu", repeats: int = 3
) -> list[dict]:
    """Best-of-`repeats` wall time of both preparations of one gated NVFP4 MoE layer.

    Row keys: name, plugin_s, upstream_s, ratio (upstream/plugin), bytes (all four tensors), peak_extra_bytes
    (ours: largest scratch alive at once on CPU; allocator peak above the inputs on CUDA), upstream_extra_bytes
    (same measure for upstream), plugin_gbps / upstream_gbps (bytes read + written per second), same_bytes.
    Map building is included on both sides (our cache is cleared before every repeat, as on a weight reload).
    """
    dev = torch.device(device)
    ip = L.padded_intermediate(intermediate, True)
    ckpt = _random_nvfp4_checkpoint(num_experts, hidden, ip, True, dev)
    total_bytes = sum(t.numel() * t.element_size() for t in ckpt)

    def timed(fn):
        """(seconds, extra bytes) of one run; CUDA extra is the allocator peak above what was live before."""
        if dev.type == "cuda":
            torch.cuda.reset_peak_memory_stats(dev)
            base = torch.cuda.memory_allocated(dev)
        _sync(dev)
        t0 = time.perf_counter()
        out = fn()
        _sync(dev)
        dt = time.perf_counter() - t0
        return dt, out, (torch.cuda.max_memory_allocated(dev) - base) if dev.type == "cuda" else None

    # Upstream and ours alternate within each repeat, so both see the same background load on a shared machine.
    work = [t.clone() for t in ckpt]
    up_best = ours_best = float("inf")
    up_out = None
    for _ in range(repeats):
        up_out = None  # free the previous outputs before measuring again
        dt, up_out, up_extra = timed(lambda: _upstream_prep(*ckpt, hidden, ip, True))
        up_best = min(up_best, dt)
        if up_extra is None:  # CPU: new outputs for every tensor, plus two per-expert scale scratch buffers
            up_extra = sum(t.numel() * t.element_size() for t in up_out) + ckpt[2][0].numel() + ckpt[3][0].numel()

        for w, c in zip(work, ckpt, strict=True):
            w.copy_(c)
        L.clear_caches()
        L.reset_scratch_peak()
        dt, _, ours_extra = timed(lambda: prepare_nvfp4_layer_(*work, gated=True))
        ours_best = min(ours_best, dt)
        if ours_extra is None:
            ours_extra = L.scratch_peak_bytes()

    w13, w2, s13, s2 = work
    same = all(
        torch.equal(a.view(torch.uint8), b.reshape(a.shape).view(torch.uint8))
        for a, b in zip((w13, s13, w2, s2), up_out, strict=True)
    )
    return [
        {
            "name": _layer_name(num_experts, hidden, intermediate),
            "device": str(dev),
            "threads": torch.get_num_threads(),
            "plugin_s": ours_best,
            "upstream_s": up_best,
            "ratio": up_best / ours_best,
            "bytes": total_bytes,
            "peak_extra_bytes": int(ours_extra),
            "upstream_extra_bytes": int(up_extra),
            "plugin_gbps": 2 * total_bytes / ours_best / 1e9,
            "upstream_gbps": 2 * total_bytes / up_best / 1e9,
            "same_bytes": bool(same),
        }
    ]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--experts", type=int, default=32)
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--intermediate", type=int, default=2048)
    p.add_argument("--device", default="cpu")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's choice)")
    p.add_argument("--tiny", action="store_true", help="2 experts, H 256, I 128, one repeat: a smoke run")
    a = p.parse_args(argv)
    if a.tiny:
        a.experts, a.hidden, a.intermediate, a.repeats = 2, 256, 128, 1
    if a.threads:
        torch.set_num_threads(a.threads)
    rows = bench_nvfp4_layer_prep(a.experts, a.hidden, a.intermediate, a.device, a.repeats)
    for row in rows:
        print(f"{row['name']} on {row['device']} ({row['threads']} threads)")
        print(
            f"  plugin   {row['plugin_s']:.3f} s  {row['plugin_gbps']:.2f} GB/s  "
            f"extra {row['peak_extra_bytes'] / 2**20:.1f} MiB"
        )
        print(
            f"  upstream {row['upstream_s']:.3f} s  {row['upstream_gbps']:.2f} GB/s  "
            f"extra {row['upstream_extra_bytes'] / 2**20:.1f} MiB"
        )
        print(f"  ratio {row['ratio']:.1f}x, {row['bytes'] / 2**30:.2f} GiB, same bytes: {row['same_bytes']}")
    print(json.dumps({"rows": rows}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
