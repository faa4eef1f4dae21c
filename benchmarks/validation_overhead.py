"""What validating every weight update costs: a full-layer load through SGLang's FusedMoE.weight_loader, with the
plugin's validation and without it (the same hooks, `validation.check_write` replaced by a pass-through), on a
prepared layer (the RL update path: validate, un-prepare the expert, SGLang's write). Also the cost of the
whole-bucket check at the update entry points (`validation.check_bucket`) for the same tensors.

    PYTHONPATH=. <venv>/bin/python -m benchmarks.validation_overhead [--fmt nvfp4] [--experts 32] [--hidden 1024]
        [--intermediate 512] [--repeats 5]

Prints JSON: seconds per full-layer load (min over repeats) with and without validation, calls, microseconds of
validation per call, and the bucket check.
"""

from __future__ import annotations

import argparse
import json
import time


def main(argv=None) -> int:
    import torch

    import tests.conftest  # noqa: F401 - the torchvision shim, before sglang is imported
    from sglang_trtllm_moe import layer_state, validation
    from sglang_trtllm_moe.testing import layers as cpu_layers
    from tests.support import bad_updates, sglang_runtime

    ap = argparse.ArgumentParser()
    ap.add_argument("--fmt", default="nvfp4")
    ap.add_argument("--experts", type=int, default=32)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--intermediate", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
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

    def unchecked(layer, param, loaded, weight_name, shard_id, expert_id, scope="local"):
        st = layer_state.state_of(layer)
        return validation.param_name(layer, param, st.fmt), int(expert_id)

    def without_validation():
        validation.check_write = unchecked
        try:
            return full_load()
        finally:
            validation.check_write = real

    # interleaved, so that load from other processes on a shared box hits both alike
    full_load(), without_validation()
    pairs = [(full_load(), without_validation()) for _ in range(args.repeats)]
    with_validation, without = min(p[0] for p in pairs), min(p[1] for p in pairs)

    def only_checks():
        t = time.perf_counter()
        for w in writes:
            p = getattr(layer, w.param)
            real(layer, p, w.tensor, w.weight_name, w.shard_id, w.expert_id, scope="global")
        return time.perf_counter() - t

    checks = best(only_checks)
    model = cpu_layers.TinyMoeModel.__new__(cpu_layers.TinyMoeModel)
    torch.nn.Module.__init__(model)
    model.experts = layer
    named = list(cpu_layers.checkpoint_names(tensors).items())

    def bucket_check():
        t = time.perf_counter()
        validation.check_bucket(model, named)
        return time.perf_counter() - t

    bucket = best(bucket_check)
    print(
        json.dumps(
            {
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
                "check_write_us_per_call": round(1e6 * checks / len(writes), 1),
                "check_bucket_s": round(bucket, 4),
            }
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
