"""What a custom weight loader's request costs with the plugin (issue #49): one prepared BF16 layer (the format verl's
sparse delta sync carries), updated through SGLang's own `update_weights_from_tensor` by verl 0.9.1's masking
`copy_` (tests/support/custom_loaders.py `masked_load`: NaN = keep; a delta of `--share` of each expert weight's
elements, NaN elsewhere), with the plugin as shipped — SGLang's per-tensor loader through the replaced `copy_`, and
the request's net (updates/undo.py: the layer copied to host memory before its first write) — and with that net
switched off (`Guard.save` / `save_rest` no-ops), interleaved; beside them the same bucket without NaN through the
normal path (batched writes, no custom loader) and the host copy of the layer's bytes alone.

    PYTHONPATH=. <venv>/bin/python benchmarks/custom_loader.py [--experts 32] [--hidden 2048] [--intermediate 768]
        [--share 0.01] [--repeats 5] [--tiny]

Needs verl 0.9.1's wheel (ci/make-env puts it in the env root). Prints one JSON line: seconds per request (min over
interleaved repeats) per mode, the net's share of the masked request, the layer's bytes, and whether every mode left
the layer equal to a fresh load of the merged weights. --tiny: 4 experts, H 256, I 128, one repeat (a smoke run).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # this checkout first


def main(argv=None) -> int:
    import pytest
    import torch

    import tests.conftest  # noqa: F401 - the torchvision shim, before sglang is imported
    from sglang_trtllm_moe.sandbox import layers as cpu_layers
    from sglang_trtllm_moe.updates import undo
    from tests.support import custom_loaders, sglang_runtime
    from tests.support import verl_delta as vd
    from tests.test_batched_writes import differences

    ap = argparse.ArgumentParser()
    ap.add_argument("--experts", type=int, default=32)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--intermediate", type=int, default=768)
    ap.add_argument("--share", type=float, default=0.01)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--tiny", action="store_true")
    args = ap.parse_args(argv)
    if args.tiny:
        args.experts, args.hidden, args.intermediate, args.repeats = 4, 256, 128, 1
    torch.set_num_threads(1)
    vd.modules(vd.make_site(tempfile.mkdtemp(prefix="verl-site-")))
    sglang_runtime.ensure("flashinfer_trtllm")
    mp = pytest.MonkeyPatch()
    sglang_runtime.plugin_prepares(mp, "bf16")  # the plugin's BF16 path (SGLang's own on 0.5.23)
    spec = cpu_layers.MoeSpec(num_experts=args.experts, hidden=args.hidden, intermediate=args.intermediate, fmt="bf16")
    old = cpu_layers.checkpoint_names(spec.kind.checkpoint(spec, seed=0))
    new = cpu_layers.checkpoint_names(spec.kind.checkpoint(spec, seed=1))
    g = torch.Generator().manual_seed(0)
    masked, merged = [], dict(old)
    for name, t in sorted(old.items()):
        pos = torch.randperm(t.numel(), generator=g)[: max(1, int(t.numel() * args.share))]
        src = torch.full_like(t, float("nan"))
        src.view(-1)[pos] = new[name].reshape(-1)[pos]
        merged[name] = t.clone()
        merged[name].view(-1)[pos] = new[name].reshape(-1)[pos]
        masked.append((name, src))
    model = sglang_runtime.prepared_model(spec, spec.kind.checkpoint(spec, seed=0))
    fresh = sglang_runtime.prepared_model(spec, {k[len(model.prefix) :]: v for k, v in merged.items()})
    layer_bytes = sum(p.numel() * p.element_size() for p in model.experts.parameters())

    def request(named, loader=None):
        u = sglang_runtime.updater(model, loaders=[loader] if loader else [])
        t = time.perf_counter()
        ok, msg = u.update_weights_from_tensor(list(named), load_format=loader)
        took = time.perf_counter() - t
        assert ok, msg
        return took

    def no_net():
        save, rest = undo.Guard.save, undo.Guard.save_rest
        undo.Guard.save = lambda self, layer: None  # type: ignore[method-assign]
        undo.Guard.save_rest = lambda self: None  # type: ignore[method-assign]
        try:
            return request(masked, custom_loaders.MASKED)
        finally:
            undo.Guard.save, undo.Guard.save_rest = save, rest  # type: ignore[method-assign]

    def host_copy():
        t = time.perf_counter()
        for st in undo.storages_of(model.experts.parameters()):
            torch.empty(st.nbytes(), dtype=torch.uint8).untyped_storage().copy_(st)
        return time.perf_counter() - t

    modes = {
        "masked, as shipped": lambda: request(masked, custom_loaders.MASKED),
        "masked, no net": no_net,
        "plain bucket, batched": lambda: request(sorted(merged.items())),
        "host copy of the layer": host_copy,
    }
    times: dict[str, list[float]] = {k: [] for k in modes}
    exact: dict[str, bool] = {}
    for _ in range(args.repeats):
        for name, fn in modes.items():
            request(sorted(old.items()))  # back to the old weights (the seed), then the mode's request
            times[name].append(fn())
            if name != "host copy of the layer":
                exact[name] = not differences(model, fresh)
    mp.undo()
    best = {k: min(v) for k, v in times.items()}
    net = best["masked, as shipped"] - best["masked, no net"]
    print(
        json.dumps(
            {
                "layer": {"experts": args.experts, "hidden": args.hidden, "intermediate": args.intermediate},
                "layer_mib": round(layer_bytes / 2**20, 1),
                "share": args.share,
                "seconds": {k: round(v, 4) for k, v in best.items()},
                "net_share_of_the_masked_request": round(net / best["masked, as shipped"], 3),
                "equal_to_a_fresh_load": exact,
            }
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
