"""Run on a CUDA machine (the lent H200): the end of a loader-free weight-update session (issue #53) for one
DeepSeek-V3-size NVFP4 MoE layer (256 experts, H 7168, I 2048) on CUDA tensors, the writer's writes excluded: what
the plugin's `end_weight_update` costs — the value check of every written expert's scales before anything is laid
out (updates/loader_free.py), then the layout — against the re-layout alone, in the same run; and the same with the
writer's hint (only `--hint` experts written: begin un-prepares and end checks and lays out only those).

    PYTHONPATH=. python benchmarks/h200_loader_free.py [--out result.json] [--experts 256] [--repeats 7]
    PYTHONPATH=. python benchmarks/h200_loader_free.py --tiny          (CPU, 4 experts, H 256: a smoke run)

What runs is the plugin's own code: `builtins/sessions.begin_before` (the session's layer to checkpoint layout, all of
it or the hinted experts) and `builtins/sessions.end_around` with `run_post_load=True` (as SGLang's scheduler ends a
session in which no load ran): `loader_free.check`, then SGLang's end — stood in by what its postprocess reaches, the
quant-method hook's flush of the layer (`layer_state.flush`: formats/nvfp4.py through layouts/, the Triton kernels on
CUDA) — then the session's `flush_all`. The layer, its model and the WeightUpdater are the stand-ins of
benchmarks/h200_update_path.py (SGLang 0.5.23's ModelOpt NVFP4 FusedMoE parameters; SGLang does not run there).

Rows (wall seconds, each run ends with torch.cuda.synchronize; interleaved, min and median; the layer is returned
to checkpoint layout before each run, untimed):
* ``relayout``: the layout alone (every expert, or the hinted ones): `layer_state.flush`;
* ``check_and_layout``: the plugin's end of the session (the check, the layout, the bookkeeping);
* ``check``: `loader_free.check` alone, with the device read-backs it made (counted: one per request);
* ``refused``: the end of a session with one NaN e4m3 byte in one expert's block scale (found, fenced, laid out);
* the same three with ``--hint`` experts written (`hint_*`).
The goal (issue #53): check_and_layout <= relayout + 2 ms, and the hinted rows proportional to the experts written.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import h200_update_path as bench  # noqa: E402  (the layer, model and updater stand-ins; the timing helpers)

from sglang_trtllm_moe import layer_state  # noqa: E402
from sglang_trtllm_moe.builtins import sessions  # noqa: E402
from sglang_trtllm_moe.formats.nvfp4 import NVFP4  # noqa: E402
from sglang_trtllm_moe.sandbox.bench_update_modes import device_path  # noqa: E402
from sglang_trtllm_moe.updates import loader_free, session_writes  # noqa: E402


def sglang_end(layer):
    """SGLang's end_weight_update as it reaches the plugin: postprocess_weights -> the quant-method hook -> a flush."""

    def end(updater, *args, **kwargs):
        layer_state.flush(layer)

    return end


def main(argv=None) -> int:
    ap = bench.layer_arguments(__doc__, repeats=7)
    ap.add_argument("--hint", type=int, default=8, help="experts a hinted session writes")
    a = ap.parse_args(argv)
    if a.tiny:
        a.experts, a.hidden, a.intermediate, a.hint, a.repeats = 4, 256, 128, 2, 2
    dev = torch.device(a.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    e, h, i = a.experts, a.hidden, a.intermediate
    layer = bench.Layer(e, h, i, dev)
    model = bench.Model(layer)
    updater = bench.Updater(model)
    with bench.mode(model, plugin=False):
        model.load_weights(bench.request(bench.new_checkpoint(e, h, i, dev, seed=0), range(e)))
    layer_state.attach(layer, NVFP4)
    layer_state.flush(layer)
    end = sglang_end(layer)
    hinted = {bench.PREFIX: list(range(0, e, max(1, e // a.hint)))[: a.hint]}
    res: dict = dict(
        device=str(torch.cuda.get_device_name(dev)) if dev.type == "cuda" else "cpu",
        experts=e,
        hidden=h,
        intermediate=i,
        hint_experts=len(hinted[bench.PREFIX]),
        layer_MiB=round(sum(p.numel() * p.element_size() for p in layer.parameters()) / 2**20, 1),
    )

    def begin(hint=None):
        """Untimed: the session opens (all of the layer, or the hinted experts, to checkpoint layout)."""
        session_writes.expect(hint)
        sessions.begin_before(updater)
        bench.sync(dev)

    def relayout():
        layer_state.flush(layer)

    def check_and_layout():
        sessions.end_around(end, updater, run_post_load=True)

    def check_only():
        hint = session_writes.current()
        experts_of = None if hint is None else (lambda ly: hint.local_ids(ly, layer_state.layer_name(ly)))
        assert loader_free.check(model, experts_of) == []

    rows: dict = {}
    for label, hint in (("", None), ("hint_", hinted)):
        samples: dict = {"relayout": [], "check_and_layout": [], "check": []}
        for r in range(a.repeats + 1):  # the first round warms up (kernels, caches), not counted
            for name, fn in (("relayout", relayout), ("check_and_layout", check_and_layout), ("check", check_only)):
                begin(hint)
                t = bench.wall(fn, dev)
                if r:
                    samples[name].append(t)
                layer_state.flush_all(end_session=True)
                session_writes.opened(None)
        for name, ts in samples.items():
            ts = sorted(ts)
            rows[label + name] = dict(min_s=ts[0], median_s=ts[len(ts) // 2])
        begin(hint)
        with device_path(), bench.count_syncs() as c:
            check_only()
        layer_state.flush_all(end_session=True)
        rows[label + "check"]["read_backs"] = sum(c.get(dev.type, {}).values())
        rows[label + "overhead_ms"] = dict(
            median_ms=(rows[label + "check_and_layout"]["median_s"] - rows[label + "relayout"]["median_s"]) * 1e3
        )
    # a refused session: one NaN e4m3 byte in expert 1's w2 block scale
    begin()
    layer.w2_weight_scale.data[1].view(torch.uint8).reshape(-1)[-1] = 0x7F
    t = bench.wall(check_and_layout, dev)
    refusal = sessions.last_refusal()
    rows["refused"] = dict(
        seconds=t,
        answered=refusal is not None and "w2_weight_scale of expert 1" in refusal,
        fenced_expert_zero=not bool(bench.u8(layer.w2_weight.data[1]).any()),
        layer_clean=layer_state.state_of(layer).clean,
    )
    res["rows"] = rows
    doc = json.dumps(res)
    if a.out:
        with open(a.out, "w") as f:
            f.write(json.dumps(res, indent=2) + "\n")
    for k, v in rows.items():
        print(f"{k}: {json.dumps(v)}")
    print(doc)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
