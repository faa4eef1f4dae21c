"""`sglang-trtllm-moe bench`: the plugin against SGLang's own code, in the same run, on real SGLang layers.

Rows (each: name, plugin_s, upstream_s, ratio = upstream_s / plugin_s, plus bytes and memory):
* NVFP4 layer preparation at DeepSeek-V3 and Qwen3-MoE-235B shapes (expert count scaled down to fit 24 GB; the
  row name says how many of how many): the plugin's in-place prep (the hooked `process_weights_after_loading`)
  against SGLang 0.5.23's original (`__wrapped__`), whose only CUDA-only helper (flashinfer's
  `nvfp4_block_scale_interleave`) is replaced by SGLang's own pure-torch `swizzle_blockscale` so it runs here.
* RL update of one expert, and of the whole layer: the plugin (loader writes → flush of the dirty experts) against
  upstream's flow (loader writes → `process_weights_after_loading` over the whole layer, which is also what
  corrupts the experts that were not updated: tests/support/upstream_rl.py measures it).
* `load_plugins()`: the time SGLang's plugin loading takes with the plugin enabled vs disabled (fresh processes).
* RL update of a whole model (DeepSeek-V3 architecture, NVFP4 and block FP8, small sizes: `bench_update.SIZES`)
  through SGLang's WeightUpdater, tensor buckets in a session and from disk: the plugin against the same update with
  its checks bypassed, in the same process (`bench_update_modes.bypass` says what is replaced), CPU seconds with the
  layout work excluded; the layout work on its own row (SGLang 0.5.21+: sandbox/models.py).
Peak extra memory is the growth of the process's peak RSS during each step (ru_maxrss; plugin measured first, so
upstream's figure is a lower bound). Timings are medians of `repeats` runs. Never used as a test.
"""

from __future__ import annotations

import functools
import json
import resource
import statistics
import subprocess
import sys
import time

import torch

from . import bench_startup, bench_update

SHAPES = {
    # name: (experts in the real model, hidden, moe intermediate)
    "DeepSeek-V3": (256, 7168, 2048),
    "Qwen3-MoE-235B": (128, 4096, 1536),
}


def _maxrss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _fill_random_nvfp4(layer, seed: int = 0) -> None:
    """Random packed FP4 bytes and positive finite e4m3 scales straight into the parameters (content is irrelevant
    to the cost of a permutation; generating quantized experts of this size would dominate the run)."""
    g = torch.Generator().manual_seed(seed)
    for name in ("w13_weight", "w2_weight"):
        p = getattr(layer, name).data
        p.copy_(torch.randint(0, 256, p.shape, dtype=torch.uint8, generator=g))
    for name in ("w13_weight_scale", "w2_weight_scale"):
        p = getattr(layer, name).data
        p.view(torch.uint8).copy_(torch.randint(0, 0x7F, p.shape, dtype=torch.uint8, generator=g))
    for name in ("w13_weight_scale_2", "w2_weight_scale_2", "w13_input_scale", "w2_input_scale"):
        getattr(layer, name).data.fill_(0.5)


def _median_time(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def _upstream_pwal():
    from sglang.srt.layers.quantization.modelopt_quant import ModelOptNvFp4FusedMoEMethod

    fn = ModelOptNvFp4FusedMoEMethod.process_weights_after_loading
    while hasattr(fn, "__wrapped__"):
        fn = fn.__wrapped__
    return fn


def _with_cpu_interleave():
    import flashinfer
    from sglang.srt.layers.quantization.utils import swizzle_blockscale

    flashinfer.nvfp4_block_scale_interleave = lambda sf: (
        swizzle_blockscale(sf.view(torch.float8_e4m3fn)).view(torch.uint8).reshape(-1)
    )


def _expert_shards(layer, e: int) -> list[tuple]:
    """(param, loaded tensor, name, shard, expert) for every shard of expert e, in checkpoint layout."""
    half = layer.w13_weight.shape[1] // 2
    out = []
    for name in ("w13_weight", "w13_weight_scale"):
        p = getattr(layer, name)
        out.append((p, p.data[e, half:].clone(), name, "w1", e))
        out.append((p, p.data[e, :half].clone(), name, "w3", e))
    for name in ("w2_weight", "w2_weight_scale"):
        p = getattr(layer, name)
        out.append((p, p.data[e].clone(), name, "w2", e))
    return out


def bench_nvfp4_layer(model: str, experts: int, repeats: int = 3) -> list[dict]:
    from .. import layer_state, layouts
    from . import layers as cpu_layers

    real_e, h, i = SHAPES[model]
    spec = cpu_layers.MoeSpec(num_experts=experts, hidden=h, intermediate=i)
    label = f"{model} layer ({experts} of {real_e} experts, H {h}, I {i})"
    ours, theirs = cpu_layers.build_layer(spec), cpu_layers.build_layer(spec)
    _fill_random_nvfp4(ours)
    _fill_random_nvfp4(theirs)
    nbytes = sum(
        getattr(ours, n).numel() * getattr(ours, n).element_size()
        for n in ("w13_weight", "w2_weight", "w13_weight_scale", "w2_weight_scale")
    )
    rows = []

    layouts.reset_scratch_peak()
    rss0 = _maxrss()
    t0 = time.perf_counter()
    ours.quant_method.process_weights_after_loading(ours)
    plugin_first = time.perf_counter() - t0
    rss1 = _maxrss()
    _with_cpu_interleave()
    upstream = _upstream_pwal()
    t0 = time.perf_counter()
    upstream(theirs.quant_method, theirs)
    upstream_first = time.perf_counter() - t0
    rss2 = _maxrss()
    same = all(
        torch.equal(getattr(ours, n).data.view(torch.uint8), getattr(theirs, n).data.view(torch.uint8))
        for n in ("w13_weight", "w2_weight", "w13_weight_scale", "w2_weight_scale")
    )
    rows.append(
        dict(
            name=f"nvfp4 prep, {label}",
            plugin_s=plugin_first,
            upstream_s=upstream_first,
            ratio=upstream_first / plugin_first,
            bytes=nbytes,
            plugin_gbps=2 * nbytes / plugin_first / 1e9,
            plugin_peak_extra_bytes=rss1 - rss0,
            upstream_peak_extra_bytes=rss2 - rss1,
            plugin_scratch_bytes=layouts.scratch_peak_bytes(),
            same_bytes=same,
        )
    )

    def plugin_update(expert_ids):
        for e in expert_ids:
            for p, t, name, shard, eid in _expert_shards_cache[e]:
                p.weight_loader(p, t, name, shard_id=shard, expert_id=eid)
        layer_state.flush(ours)

    def upstream_update(expert_ids):
        # Upstream's flow: the loader writes, then the whole layer is re-prepared (re-shuffling untouched experts).
        for e in expert_ids:
            for p, t, _name, _shard, eid in _expert_shards_cache[e]:
                p.data[eid].view(torch.uint8).reshape(-1)[: t.numel()].copy_(t.view(torch.uint8).reshape(-1))
        upstream(theirs.quant_method, theirs)

    _expert_shards_cache = {e: _expert_shards(ours, e) for e in range(experts)}
    for what, ids in (("1 expert", [3]), ("whole layer", list(range(experts)))):
        p_s = _median_time(functools.partial(plugin_update, ids), repeats)
        u_s = _median_time(functools.partial(upstream_update, ids), repeats)
        rows.append(
            dict(
                name=f"nvfp4 RL update of {what}, {label}",
                plugin_s=p_s,
                upstream_s=u_s,
                ratio=u_s / p_s,
                bytes=nbytes * len(ids) // experts,
            )
        )
    return rows


# ---- MX formats: MXFP8 (flashinfer_trtllm), MXFP4 experts and gpt-oss MXFP4 (flashinfer_mxfp4) --------------------

#: format -> (runner backend, shape name, (experts in the real model, hidden, moe intermediate))
MX_SHAPES = {
    "mxfp8": ("flashinfer_trtllm", "DeepSeek-V3", SHAPES["DeepSeek-V3"]),
    "mxfp4_experts": (
        "flashinfer_mxfp4",
        "FP4-expert (H 4096, I 2048: an assumed DeepSeek-V4-like shape)",
        (256, 4096, 2048),
    ),
    "mxfp4_gptoss": ("flashinfer_mxfp4", "gpt-oss-120b", (128, 2880, 2880)),
    # Kimi-K2: 384 routed experts, H 7168, I 2048, INT4 W4A16 group 32 (compressed-tensors), here unsharded (EP)
    "ct_int4": ("flashinfer_trtllm", "Kimi-K2 INT4", (384, 7168, 2048)),
}


def _fill_random_mx(layer, seed: int = 0) -> None:
    """Random weight bytes and sane UE8M0 scale bytes (2^-8 .. 2^2) straight into the parameters (as
    _fill_random_nvfp4: content is irrelevant to the cost of a permutation)."""
    g = torch.Generator().manual_seed(seed)
    for name, p in layer.named_parameters(recurse=False):
        u8 = p.data.view(torch.uint8)
        if "bias" in name:  # bf16-exact values: SGLang's gpt-oss bias Parameters are bf16 until its prep
            p.data.copy_((torch.randn(p.shape, generator=g) * 0.1).to(torch.bfloat16))
        elif "scale" in name and p.dtype == torch.bfloat16:  # INT4's bf16 group scales: positive values
            p.data.copy_((torch.rand(p.shape, generator=g) * 0.02 + 0.005).to(torch.bfloat16))
        elif "scale" in name:
            u8.copy_(torch.randint(119, 130, u8.shape, dtype=torch.uint8, generator=g))
        else:
            u8.copy_(torch.randint(0, 256, u8.shape, dtype=torch.uint8, generator=g))


def _mx_layers(fmt: str, experts: int):
    from . import layers as mx_layers
    from . import sglang_oracle
    from .layers import MoeSpec

    real_e, h, i = MX_SHAPES[fmt][2]
    spec = MoeSpec(num_experts=experts, hidden=h, intermediate=i, fmt=fmt)
    ours, theirs = mx_layers.build_layer(spec), sglang_oracle.sglang_layer(spec)
    _fill_random_mx(ours)
    for name, p in ours.named_parameters(recurse=False):  # the same values in SGLang's dtypes (exact but biases)
        getattr(theirs, name).data.copy_(p.data)
    return spec, ours, theirs


def bench_mx_layer(fmt: str, experts: int, repeats: int = 3) -> list[dict]:
    """Plugin vs SGLang's own preparation of the same MX layer (SGLang's CUDA-only helpers replaced by CPU ones of the
    same bytes: sandbox/sglang_oracle.sglang_prepare), and an RL update: one expert for MXFP8 / MXFP4 experts (the
    plugin: loader writes + flush of that expert; SGLang: loader writes + its prep of the whole layer, which is also
    what re-shuffles the experts it did not reload), the whole layer for gpt-oss (its loader writes all experts).
    For the MXFP4 paths SGLang's own loader cannot write after its prep (the Parameters it made have no
    weight_loader): its update figure is its whole-layer prep alone, a lower bound."""
    from .. import layer_state, layouts
    from . import layers as mx_layers
    from . import sglang_oracle

    backend, shape, (real_e, h, i) = MX_SHAPES[fmt]
    spec, ours, theirs = _mx_layers(fmt, experts)
    label = f"{shape} layer ({experts} of {real_e} experts, H {h}, I {i})"
    names = [p.name for p in layer_state_fmt(fmt).params]
    nbytes = sum(getattr(ours, n).numel() * getattr(ours, n).element_size() for n in names)
    loaded = {n: getattr(ours, n).data.clone() for n in names}
    layouts.reset_scratch_peak()
    rss0 = _maxrss()
    t0 = time.perf_counter()
    ours.quant_method.process_weights_after_loading(ours)
    plugin_s = time.perf_counter() - t0
    rss1 = _maxrss()
    t0 = time.perf_counter()
    sglang_oracle.sglang_prepare(theirs)
    upstream_s = time.perf_counter() - t0
    rss2 = _maxrss()
    same = all(
        torch.equal(
            getattr(ours, n).data.view(torch.uint8).reshape(-1), getattr(theirs, n).data.view(torch.uint8).reshape(-1)
        )
        for n in names
    )
    rows = [
        dict(
            name=f"{fmt} prep, {label}",
            plugin_s=plugin_s,
            upstream_s=upstream_s,
            ratio=upstream_s / plugin_s,
            bytes=nbytes,
            plugin_gbps=2 * nbytes / plugin_s / 1e9,
            plugin_peak_extra_bytes=rss1 - rss0,
            upstream_peak_extra_bytes=rss2 - rss1,
            plugin_scratch_bytes=layouts.scratch_peak_bytes(),
            same_bytes=same,
        )
    ]

    if fmt == "mxfp4_gptoss":

        def plugin_update():
            mx_layers.load_fused(ours, {n: loaded[n] for n in names})
            layer_state.flush(ours)

        what, ids = "whole layer", list(range(experts))
    else:
        half = loaded[names[0]].shape[1] // 2
        # the trtllm loader swaps w1 / w3 for Fp8MoEMethod and CompressedTensorsMxInt4MoE
        first, second = ("w3", "w1") if fmt in ("mxfp8", "ct_int4") else ("w1", "w3")

        def plugin_update():
            e = 3 % experts
            for n in names:
                p = getattr(ours, n)
                if n.startswith("w13"):
                    p.weight_loader(p, loaded[n][e, :half], n, shard_id=first, expert_id=e)
                    p.weight_loader(p, loaded[n][e, half:], n, shard_id=second, expert_id=e)
                else:
                    p.weight_loader(p, loaded[n][e], n, shard_id="w2", expert_id=e)
            layer_state.flush(ours)

        what, ids = "1 expert", [3 % experts]

    def upstream_update():
        if fmt == "mxfp8":  # in place: the loader's write, then SGLang's prep of the whole layer
            for n in names:
                getattr(theirs, n).data[ids].view(torch.uint8).copy_(loaded[n][ids].view(torch.uint8))
        sglang_oracle.sglang_prepare(theirs)

    p_s = _median_time(plugin_update, repeats)
    if fmt == "ct_int4":  # SGLang's prep replaced the Parameters (its loader cannot write after it): its figure is
        for n in names:  # its prep of the loaded bytes again, a lower bound
            theirs.register_parameter(n, torch.nn.Parameter(loaded[n].clone(), requires_grad=False))
    u_s = _median_time(upstream_update, 1 if fmt != "mxfp8" else repeats)
    rows.append(
        dict(
            name=f"{fmt} RL update of {what}, {label}",
            plugin_s=p_s,
            upstream_s=u_s,
            ratio=u_s / p_s,
            bytes=nbytes * len(ids) // experts,
        )
    )
    return rows


def layer_state_fmt(name: str):
    from ..formats import by_name

    return by_name(name)


def _one_mx_in_this_process(fmt: str, experts: int, repeats: int, threads: int | None) -> list[dict]:
    from sglang.srt.plugins import load_plugins

    from .runtime import init_single_process

    if threads:
        torch.set_num_threads(threads)
    load_plugins()
    init_single_process(MX_SHAPES[fmt][0])
    return bench_mx_layer(fmt, experts, repeats)


def _one_model_in_this_process(model: str, experts: int, repeats: int, threads: int | None) -> list[dict]:
    from sglang.srt.plugins import load_plugins

    from .runtime import init_single_process

    if threads:
        torch.set_num_threads(threads)
    load_plugins()
    init_single_process("flashinfer_trtllm")
    return bench_nvfp4_layer(model, experts, repeats)


def run(
    models=("DeepSeek-V3", "Qwen3-MoE-235B"),
    experts: int = 32,
    repeats: int = 3,
    threads: int | None = None,
    mx_formats=tuple(MX_SHAPES),
    mx_experts: int | None = None,
    model_update: bool = True,
) -> list[dict]:
    """Each model (and each MX format) runs in a fresh process, so its peak-RSS figures start from that layer alone."""
    rows = []
    jobs = [f"bench._one_model_in_this_process({m!r}, {experts}, {repeats}, {threads!r})" for m in models]
    mx_e = mx_experts or max(2, experts // 4)  # MX layers are 2-4x the bytes of NVFP4 ones: fewer experts, same RAM
    jobs += [f"bench._one_mx_in_this_process({f!r}, {mx_e}, {repeats}, {threads!r})" for f in mx_formats]
    for job in jobs:
        code = f"import json, sys; from sglang_trtllm_moe.sandbox import bench; print(json.dumps({job}))"
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
        if out.returncode:
            raise RuntimeError(f"bench {job} failed:\n{out.stderr[-3000:]}")
        rows.extend(json.loads(out.stdout.strip().splitlines()[-1]))
    rows.extend(bench_startup.bench_load_plugins(repeats))
    if model_update:
        rows.extend(model_update_rows(experts, repeats))
    env = dict(torch_threads=threads or torch.get_num_threads(), torch=torch.__version__, device="cpu")
    for r in rows:
        r.update(env)
    return rows


def model_update_rows(experts: int, repeats: int) -> list[dict]:
    """The model-level update rows (bench_update.run at its "small" size, `experts` per layer), or one row saying why
    they are not measured on this release."""
    from .releases import MODEL_RUNNER_RELEASES as SUPPORTED_RELEASES
    from .runtime import release

    if release() not in SUPPORTED_RELEASES:
        nan = float("nan")
        return [
            dict(
                name=f"model RL update: not measured (sandbox.models builds whole models on SGLang "
                f"{SUPPORTED_RELEASES}; this is {release()})",
                plugin_s=nan,
                upstream_s=nan,
                ratio=nan,
            )
        ]
    return bench_update.bench_rows(bench_update.run(size="small", repeats=repeats, experts=experts))


def format_rows(rows: list[dict]) -> str:
    w = max(len(r["name"]) for r in rows)
    lines = [f"{'name':<{w}}  {'plugin_s':>9}  {'upstream_s':>10}  {'ratio':>6}  notes"]
    for r in rows:
        notes = []
        if "plugin_gbps" in r:
            notes.append(
                f"{r['plugin_gbps']:.1f} GB/s, same bytes: {r['same_bytes']}, peak extra "
                f"{r['plugin_peak_extra_bytes'] / 2**20:.0f} MiB vs {r['upstream_peak_extra_bytes'] / 2**20:.0f} MiB"
            )
        if "overhead_pct" in r:
            notes.append(
                f"plugin adds {r['overhead_pct']:.1f} % ({r['loader_calls']} loader calls, "
                f"{r['syncs_in_validation']} tensor-to-Python conversions in validation)"
            )
        if "added_s" in r:
            notes.append(
                f"plugin adds {r['added_s'] * 1000:.0f} ms CPU"
                + (f", {r['added_peak_rss_mib']:.0f} MiB peak RSS" if "added_peak_rss_mib" in r else "")
            )
        lines.append(
            f"{r['name']:<{w}}  {r['plugin_s']:9.4f}  {r['upstream_s']:10.4f}  {r['ratio']:6.1f}  {'; '.join(notes)}"
        )
    return "\n".join(lines)


def main(args) -> int:
    rows = run(
        experts=args.experts,
        repeats=args.repeats,
        threads=args.threads,
        model_update=not getattr(args, "no_model_update", False),
    )
    print(json.dumps(rows, indent=2) if args.json else format_rows(rows))
    return 0
