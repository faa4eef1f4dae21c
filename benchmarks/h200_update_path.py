"""Run on a CUDA machine (the lent H200): what the plugin adds to the RL update of one DeepSeek-V3-size NVFP4 MoE layer
(256 experts, H 7168, I 2048) on CUDA tensors, against the bare writes + re-layout in the same run; and what value
checks of every scale of that layer cost (per tensor, as today, and batched). Needs only torch (+ triton for the
fast layout path) and this package: SGLang does not run there.

    PYTHONPATH=. python benchmarks/h200_update_path.py [--out result.json] [--experts 256] [--repeats 5]
    PYTHONPATH=. python benchmarks/h200_update_path.py --tiny          (CPU, 4 experts, H 256: a smoke run)

What runs is the plugin's own code: the entry-point hook `builtins/weight_updates.check_buckets_around` and the
request object it builds (updates/request.py, issue #52: the bucket checked whole against the model's name index —
per run of experts where the tensors are views of one buffer, as here —, its values with one read-back, the verdict
of the ranks — one process here: none exchanged —, then its expert tensors written batched, one copy per run of
experts of one (layer, parameter)), the loader hooks `builtins/loader_hooks.weight_loader` and `weight_loader_impl`
(for the per-tensor modes: the request's record looked up — `validation.check_write` only for writes it does not
hold —, the thread-local handshake, the layer lock, the per-expert layout state), `begin_weight_update`'s
`layer_state.unprepare_all` and the end of the session's `layer_state.flush_all` (formats/nvfp4.py through layouts/:
the Triton kernels on CUDA). What stands in for SGLang (the `STAND_INS` table, also in the JSON):

* the layer: a torch.nn.Module with SGLang 0.5.23's ModelOpt NVFP4 FusedMoE parameters (names, shapes, dtypes as
  `create_weights` makes them) and the attributes the plugin reads (num_experts, moe_tp_size, moe_runner_config, the
  checkpoint prefix and intermediate size the plugin's `FusedMoE.__init__` hook records);
* `FusedMoE.weight_loader`: EP 1, no expert-location metadata, so it calls `_weight_loader_impl` with the same id;
* `FusedMoE._weight_loader_impl`, ModelOpt NVFP4 branch at TP 1 (`_load_w13` / `_load_w2` /
  `_load_per_tensor_weight_scale` / `_load_single_value`): `param.data[e].narrow(0, start, I).copy_(loaded)` for
  w1 / w3 (w1 into the second half: `load_up_proj_weight_first`), `param.data[e].copy_(loaded)` for w2, an
  indexed store for the per-tensor and input scales;
* the model's `load_weights` (DeepSeek's loop): checkpoint name -> (parameter, shard, expert) from a precomputed
  dict, then `param.weight_loader(...)`. SGLang's own loop scans its expert mapping per tensor (slower): the bare
  path here is cheaper than SGLang's, so the ratio errs against the plugin;
* the update request: one tensor per (expert, projection, suffix) on the GPU, views of one buffer per kind (what
  SGLang hands the loader after an IPC / NCCL / flattened-bucket update), in buckets of `--bucket-experts` experts.

Rows (wall seconds, each run ends with torch.cuda.synchronize; plugin and bare interleaved, min and median):
* ``session``: a whole-layer update in a begin/end session (the 0.5.23 scheduler's tensor path): plugin (as
  shipped: each bucket checked, then its expert tensors written batched, `batched_writes.py`) vs bare (the same
  layout work: every expert to checkpoint layout at begin, every expert prepared at the end), and
  ``plugin_per_tensor``: the plugin with batched writes switched off (every tensor through the stand-in loader and
  the plugin's loader hooks: the plugin before issue #38), ``bypassed``: that with its checks replaced by
  pass-throughs (`sandbox/bench_update_modes.bypass`), which splits what the per-tensor path adds into its checks
  and its hooks' bookkeeping;
* ``partial``: `--partial` experts updated outside a session (the disk path's shape) through the entry point
  (`update_weights_from_tensor` of one bucket, then its flush): the plugin un-prepares the bucket's experts (one
  call per group) and writes them batched, then flushes; bare: unprepare_ of those experts, the writes, prepare_;
  and the same writes through the model's `load_weights` without an entry point (``partial_no_entry``: every write
  checked whole in the loader hook, its values with a read-back each — what a user's own loader gets);
* the parts: validation alone (each bucket's check and record, and the loader hooks' look-ups of every write),
  writes alone, layout alone;
* ``value_checks``: every scale of the layer: the float per-tensor / input scales (checked one by one:
  `value_checks.bad_one`, a read-back each — a write outside a request; batched: `value_checks.find_bad`, one
  read-back), the 1-byte e4m3 block scales' NaN bytes (per tensor with a sync each, per tensor with one sync at the
  end, one reduction per buffer) and every scale of the layer at once as a request's check takes them
  (`value_checks.find_bad`: groups of one rule, dtype and trailing shape concatenated, one read-back), each with the
  device synchronisations counted (`bool` / `float` / `int` / `item` / `tolist` of a tensor).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import statistics
import time
from types import SimpleNamespace

import torch

from sglang_trtllm_moe import layer_state, layouts
from sglang_trtllm_moe.builtins import loader_hooks, sessions, weight_updates
from sglang_trtllm_moe.formats.load_rules import E4M3_BYTES, POSITIVE
from sglang_trtllm_moe.formats.nvfp4 import NVFP4
from sglang_trtllm_moe.sandbox.bench_update_modes import bypass, device_path  # torch-only: pass-throughs, device path
from sglang_trtllm_moe.updates import batched_writes, bucket_validation, checked_writes, value_checks

PREFIX = "model.layers.3.mlp.experts"
PROJ = (("gate_proj", "w1"), ("up_proj", "w3"), ("down_proj", "w2"))
SUFFIXES = ("weight", "weight_scale", "weight_scale_2", "input_scale")

STAND_INS = {
    "FusedMoE layer": "torch.nn.Module with SGLang 0.5.23 ModelOpt NVFP4 create_weights' parameters and the "
    "attributes the plugin reads",
    "FusedMoE.weight_loader": "EP 1, no expert-location metadata: calls _weight_loader_impl with the same id",
    "FusedMoE._weight_loader_impl": "ModelOpt NVFP4 branch at TP 1: narrow + copy_ per shard, indexed store "
    "for per-tensor and input scales",
    "model.load_weights": "checkpoint name -> (param, shard, expert) from a dict, then param.weight_loader",
    "update request": "CUDA tensors, views of one buffer per kind (IPC / NCCL / flattened bucket)",
    "WeightUpdater": "builtins/weight_updates and builtins/sessions hooks called as SGLang's HookRegistry calls them "
    "(begin: sessions.begin_before, each bucket: check_buckets_around + flush_after, end: sessions.end_around)",
}


def sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


# ---- the stand-ins --------------------------------------------------------------------------------------------


class Layer(torch.nn.Module):
    def __init__(self, e, h, i, dev):
        super().__init__()
        u8, f8, f32 = torch.uint8, torch.float8_e4m3fn, torch.float32

        def param(shape, dtype):
            data = torch.zeros(shape, dtype=torch.uint8 if dtype.itemsize == 1 else dtype, device=dev).view(dtype)
            return torch.nn.Parameter(data, requires_grad=False)

        self.w13_weight = param((e, 2 * i, h // 2), u8)
        self.w2_weight = param((e, h, i // 2), u8)
        self.w13_weight_scale = param((e, 2 * i, h // 16), f8)
        self.w2_weight_scale = param((e, h, i // 16), f8)
        self.w13_weight_scale_2 = param((e, 2), f32)
        self.w2_weight_scale_2 = param((e,), f32)
        self.w13_input_scale = param((e, 2), f32)
        self.w2_input_scale = param((e,), f32)
        self.num_experts, self.num_fused_shared_experts, self.layer_id = e, 0, 3
        self.moe_tp_size, self.moe_tp_rank, self.use_presharded_weights = 1, 0, False
        self.moe_runner_config = SimpleNamespace(is_gated=True, activation="silu")
        object.__setattr__(self, "_trtllm_moe_prefix", PREFIX)
        object.__setattr__(self, "_trtllm_moe_intermediate", i)
        self.impl = sglang_impl  # what FusedMoE.weight_loader calls (the plugin's hook around it, or SGLang's own)
        for p in self.parameters(recurse=False):  # as create_weights binds them: what batched writes look for
            p.weight_loader = self.weight_loader

    def weight_loader(self, param, loaded_weight, weight_name, shard_id, expert_id):
        """FusedMoE.weight_loader, EP 1 (the plugin's batched writes ask it for an expert's slots)."""
        return self._weight_loader_impl(param, loaded_weight, weight_name, shard_id, expert_id)

    def _weight_loader_impl(self, param, loaded_weight, weight_name, shard_id, expert_id):
        """FusedMoE._weight_loader_impl (the plugin's batched writes trace where it writes)."""
        return sglang_impl(self, param, loaded_weight, weight_name, shard_id, expert_id)


def sglang_impl(layer, param, loaded, weight_name, shard_id, expert_id):
    """SGLang 0.5.23 FusedMoE._weight_loader_impl, ModelOpt NVFP4 branch, TP 1 (see the module doc)."""
    if "input_scale" in weight_name:  # _load_single_value
        param.data[expert_id] = loaded
        return
    if "weight_scale_2" in weight_name:  # _load_per_tensor_weight_scale
        if shard_id == "w2":
            param.data[expert_id] = loaded
        else:
            param.data[expert_id][0 if shard_id == "w1" else 1] = loaded
        return
    expert = param.data[expert_id]
    if shard_id == "w2":  # _load_w2: narrow the loaded weight by TP rank along dim 1
        size = expert.shape[1]
        expert.copy_(loaded.narrow(1, 0, size))
        return
    half = expert.shape[0] // 2  # _load_w13, load_up_proj_weight_first: w1 into the second half
    start = half if shard_id == "w1" else 0
    expert.narrow(0, start, half).copy_(loaded.narrow(0, 0, loaded.shape[0]))


def sglang_weight_loader(layer, param, loaded, weight_name, shard_id, expert_id):
    """FusedMoE.weight_loader with EP 1 and no expert-location metadata."""
    return layer.impl(layer, param, loaded, weight_name, shard_id, expert_id)


def plugin_impl(layer, param, loaded, weight_name, shard_id, expert_id):
    return loader_hooks.weight_loader_impl(sglang_impl, layer, param, loaded, weight_name, shard_id, expert_id)


def plugin_weight_loader(param, loaded, weight_name, shard_id, expert_id):
    layer = param._layer
    return loader_hooks.weight_loader(sglang_weight_loader, layer, param, loaded, weight_name, shard_id, expert_id)


def bare_weight_loader(param, loaded, weight_name, shard_id, expert_id):
    return sglang_weight_loader(param._layer, param, loaded, weight_name, shard_id, expert_id)


class Model(torch.nn.Module):
    """The model around the layer: `load_weights` as DeepSeek's loop (a dict lookup per name), the loaders of the
    running mode."""

    def __init__(self, layer):
        super().__init__()
        self.experts = layer
        self.loader = bare_weight_loader
        self.route = {}
        for e in range(layer.num_experts):
            for proj, shard in PROJ:
                for s in SUFFIXES:
                    pname = f"{'w2' if shard == 'w2' else 'w13'}_{s}"
                    self.route[f"{PREFIX}.{e}.{proj}.{s}"] = (getattr(layer, pname), f"{PREFIX}.{pname}", shard, e)
        for p in layer.parameters(recurse=False):
            p._layer = layer

    def load_weights(self, weights):
        for name, t in weights:
            param, mapped, shard, e = self.route[name]
            self.loader(param, t, mapped, shard, e)


class Updater:
    """SGLang's WeightUpdater, as the plugin's entry-point hooks see it."""

    def __init__(self, model):
        self.model = model

    def get_model(self):
        return self.model

    @staticmethod
    def update_weights_from_tensor(owner, named_tensors, load_format=None):
        owner.model.load_weights(named_tensors)
        return True, "Succeeded to update model weights."


@contextlib.contextmanager
def mode(model, plugin: bool):
    model.loader = plugin_weight_loader if plugin else bare_weight_loader
    model.experts.impl = plugin_impl if plugin else sglang_impl
    try:
        yield
    finally:
        model.loader, model.experts.impl = bare_weight_loader, sglang_impl


# ---- the request --------------------------------------------------------------------------------------------------


def new_checkpoint(e, h, i, dev, seed=1):
    """One buffer per (projection, suffix), [E, ...] on `dev`: packed FP4 bytes, positive finite e4m3 scales,
    positive float32 scales; the tensors of the request are its per-expert views."""
    g = torch.Generator(device=dev).manual_seed(seed)

    def rnd(shape, lo=0, hi=256):
        return torch.randint(lo, hi, shape, dtype=torch.uint8, generator=g, device=dev)

    def pos(shape):
        return torch.rand(shape, generator=g, device=dev) * 0.01 + 1e-3

    buf = {}
    for proj, shard in PROJ:
        rows, cols = (h, i) if shard == "w2" else (i, h)
        buf[(proj, "weight")] = rnd((e, rows, cols // 2))
        buf[(proj, "weight_scale")] = rnd((e, rows, cols // 16), 0x08, 0x7F).view(torch.float8_e4m3fn)
        buf[(proj, "weight_scale_2")] = pos((e,))
    a1 = pos((e,))  # one activation feeds gate and up: one input scale
    buf[("gate_proj", "input_scale")] = a1
    buf[("up_proj", "input_scale")] = a1.clone()
    buf[("down_proj", "input_scale")] = pos((e,))
    return buf


def request(buf, experts):
    return [(f"{PREFIX}.{e}.{proj}.{s}", buf[(proj, s)][e]) for e in experts for proj, _ in PROJ for s in SUFFIXES]


def buckets(items, per_bucket_tensors):
    return [items[k : k + per_bucket_tensors] for k in range(0, len(items), per_bucket_tensors)]


# ---- counting tensor -> Python conversions (device synchronisations on CUDA) -------------------------------------

SYNCS = ("__bool__", "__float__", "__int__", "__index__", "item", "tolist")


#: the modules of the plugin's checks (their conversions on the CPU are what CUDA tensors would synchronise on:
#: `validation_conversions`); layer_state's and layouts' are on CPU masks on every device
CHECKS = (
    "sglang_trtllm_moe.updates.validation",
    "sglang_trtllm_moe.updates.layer_params",
    "sglang_trtllm_moe.updates.refusal",
    "sglang_trtllm_moe.updates.write_plans",
    "sglang_trtllm_moe.updates.checked_writes",
    "sglang_trtllm_moe.updates.bucket_validation",
    "sglang_trtllm_moe.updates.value_checks",
    "sglang_trtllm_moe.updates.name_index",
    "sglang_trtllm_moe.updates.request",
    "sglang_trtllm_moe.updates.verdicts",
    "sglang_trtllm_moe.builtins.loader_hooks",
    "sglang_trtllm_moe.builtins.weight_updates",
)


@contextlib.contextmanager
def count_syncs():
    """{device type: {conversion: count}}: on a CUDA tensor each one waits for the device; on the CPU masks of
    layer_state it does not. Also {"checks": {conversion: count}}: the conversions the plugin's checks (CHECKS) made,
    on any device."""
    import sys

    counts: dict = {}
    saved = {n: getattr(torch.Tensor, n) for n in SYNCS}

    def wrap(n, orig):
        @functools.wraps(orig)
        def w(self, *a, **k):
            per = counts.setdefault(self.device.type, {})
            per[n] = per.get(n, 0) + 1
            caller = sys._getframe(1).f_globals.get("__name__", "")
            if caller in CHECKS:
                mine = counts.setdefault("checks", {})
                mine[n] = mine.get(n, 0) + 1
            return orig(self, *a, **k)

        return w

    own = {n for n in SYNCS if n in vars(torch.Tensor)}  # defined on torch.Tensor itself, not inherited
    for n, orig in saved.items():
        setattr(torch.Tensor, n, wrap(n, orig))
    try:
        yield counts
    finally:
        for n, orig in saved.items():
            if n in own:
                setattr(torch.Tensor, n, orig)
            else:
                delattr(torch.Tensor, n)


# ---- timing -------------------------------------------------------------------------------------------------------


def wall(fn, dev):
    sync(dev)
    t = time.perf_counter()
    fn()
    sync(dev)
    return time.perf_counter() - t


def interleaved(fns: dict, dev, repeats: int) -> dict:
    """{name: fn} run in turn (order rotated each repeat, one warm-up each): {name: {min_s, median_s}}."""
    names = list(fns)
    for n in names:
        wall(fns[n], dev)
    got: dict[str, list] = {n: [] for n in names}
    for r in range(repeats):
        for n in names[r % len(names) :] + names[: r % len(names)]:
            got[n].append(wall(fns[n], dev))
    return {n: {"min_s": min(v), "median_s": statistics.median(v)} for n, v in got.items()}


def u8(t):
    return t.view(torch.uint8)


LAID_OUT = ("w13_weight", "w13_weight_scale", "w2_weight", "w2_weight_scale")


def layer_bytes(layer):
    return {n: u8(getattr(layer, n).data).clone() for n in LAID_OUT}


def layer_arguments(doc: str, repeats: int) -> argparse.ArgumentParser:
    """The arguments of a script over one such layer (this one's, benchmarks/h200_loader_free.py's)."""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("--tiny", action="store_true", help="CPU, 4 experts, H 256, I 128: a smoke run of the script")
    ap.add_argument("--experts", type=int, default=256)
    ap.add_argument("--hidden", type=int, default=7168)
    ap.add_argument("--intermediate", type=int, default=2048)
    ap.add_argument("--repeats", type=int, default=repeats)
    ap.add_argument("--device", default=None)
    ap.add_argument("--out")
    return ap


def main(argv=None) -> int:
    ap = layer_arguments(__doc__, repeats=5)
    ap.add_argument("--bucket-experts", type=int, default=32, help="experts per update_weights_from_tensor bucket")
    ap.add_argument("--partial", type=int, default=8, help="experts of the partial update (outside a session)")
    a = ap.parse_args(argv)
    if a.tiny:
        a.experts, a.hidden, a.intermediate, a.bucket_experts, a.partial, a.repeats = 4, 256, 128, 2, 2, 2
        a.device = a.device or "cpu"
    dev = torch.device(a.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    e, h, i = a.experts, a.hidden, a.intermediate
    res: dict = {
        "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "code_commit": os.environ.get("CODE_COMMIT"),
        "fast_layout_path": layouts._triton_layouts() is not None and dev.type == "cuda",
        "layer": dict(experts=e, hidden=h, intermediate=i, fmt="nvfp4 (ModelOpt)", prefix=PREFIX),
        "stand_ins": STAND_INS,
    }

    layer = Layer(e, h, i, dev)
    model = Model(layer)
    updater = Updater(model)
    buf0 = new_checkpoint(e, h, i, dev, seed=0)
    with mode(model, plugin=False):
        model.load_weights(request(buf0, range(e)))
    del buf0
    layer_state.attach(layer, NVFP4)
    layer_state.flush(layer)  # the first load's process_weights_after_loading: everything to kernel layout
    buf = new_checkpoint(e, h, i, dev, seed=1)
    everything = request(buf, range(e))
    per_bucket = a.bucket_experts * len(PROJ) * len(SUFFIXES)
    parts = buckets(everything, per_bucket)
    nbytes = sum(t.numel() * t.element_size() for _, t in everything)
    res["request"] = dict(tensors=len(everything), bytes=nbytes, buckets=len(parts), loader_calls=len(everything))

    # ---- a whole-layer update in a begin/end session ----------------------------------------------------------
    def plugin_session():
        with mode(model, plugin=True):
            sessions.begin_before(updater)
            for part in parts:
                weight_updates.drop_caches_before(updater, part)
                ok, msg = weight_updates.check_buckets_around(Updater.update_weights_from_tensor, updater, part)
                assert ok, msg
                weight_updates.flush_after((ok, msg), updater, part)
            sessions.end_around(lambda owner, **kw: None, updater, run_post_load=False)

    def per_tensor_session():  # the plugin before batched writes: every tensor through SGLang's loader, hooked
        with batched_writes.disabled():
            plugin_session()

    def bypassed_session():
        with bypass():
            plugin_session()

    def bare_session():
        layer_state.unprepare_all(model)
        for part in parts:
            model.load_weights(part)
        layer_state.flush_all(end_session=True)

    def validation_only():
        with mode(model, plugin=True):
            for part in parts:
                record = checked_writes.Checked()
                bucket_validation.check_bucket(model, part, record=record)
                for name, t in part:
                    param, mapped, shard, ex = model.route[name]
                    assert checked_writes.checked_write(param, t, mapped, shard, ex) is not None
                record.close()

    def writes_only():
        for part in parts:
            model.load_weights(part)

    def layout_only():
        layer_state.unprepare_all(model)
        layer_state.flush_all(end_session=True)

    plugin_session()
    after_plugin = layer_bytes(layer)
    bare_session()
    same = all(torch.equal(after_plugin[n], u8(getattr(layer, n).data)) for n in LAID_OUT)
    del after_plugin
    before = batched_writes.counts().get("tensors", 0)
    plugin_session()
    batched_tensors = batched_writes.counts().get("tensors", 0) - before
    sess = interleaved(
        {
            "plugin": plugin_session,
            "plugin_per_tensor": per_tensor_session,
            "bypassed": bypassed_session,
            "bare": bare_session,
        },
        dev,
        a.repeats,
    )
    parts_t = interleaved(
        {"validation_only": validation_only, "writes_only": writes_only, "layout_only": layout_only}, dev, a.repeats
    )
    layout_only()  # leaves the layer prepared (writes_only wrote checkpoint bytes into it)
    with count_syncs() as c:
        plugin_session()
    session_syncs = dict(c)
    with count_syncs() as c:
        bare_session()
    bare_syncs = dict(c)
    with device_path(), count_syncs() as c:  # CPU tensors take the device path too: the checks' read-backs
        plugin_session()
    checks_device_path = c.get("checks", {})
    res["session"] = dict(
        what=f"whole layer ({e} experts) in a begin/end session, {len(parts)} buckets of {a.bucket_experts} experts",
        **sess,
        ratio_median=sess["plugin"]["median_s"] / sess["bare"]["median_s"],
        ratio_min=sess["plugin"]["min_s"] / sess["bare"]["min_s"],
        per_tensor_ratio_median=sess["plugin_per_tensor"]["median_s"] / sess["bare"]["median_s"],
        bypassed_ratio_median=sess["bypassed"]["median_s"] / sess["bare"]["median_s"],
        batched_expert_tensors=batched_tensors,
        plugin_us_per_loader_call=1e6 * (sess["plugin"]["median_s"] - sess["bare"]["median_s"]) / len(everything),
        checks_us_per_loader_call=1e6 * (sess["plugin"]["median_s"] - sess["bypassed"]["median_s"]) / len(everything),
        parts=parts_t,
        same_bytes_plugin_vs_bare=same,
        tensor_to_python_in_plugin_update=session_syncs,
        tensor_to_python_in_bare_update=bare_syncs,
        device_syncs_in_plugin_update=sum(session_syncs.get(dev.type, {}).values()) if dev.type != "cpu" else None,
        device_syncs_in_bare_update=sum(bare_syncs.get(dev.type, {}).values()) if dev.type != "cpu" else None,
        checks_read_backs_device_path=sum(checks_device_path.values()),
        buckets=len(parts),
        copy_gbps_of_writes_only=2 * nbytes / parts_t["writes_only"]["median_s"] / 1e9,
    )

    # ---- a partial update outside a session (the disk path's shape) --------------------------------------------
    ids = list(range(min(a.partial, e)))
    some = request(buf, ids)

    def plugin_partial():
        with mode(model, plugin=True):
            weight_updates.drop_caches_before(updater, some)
            ok, msg = weight_updates.check_buckets_around(Updater.update_weights_from_tensor, updater, some)
            assert ok, msg
            weight_updates.flush_after((ok, msg), updater, some)

    def plugin_partial_no_entry():
        with mode(model, plugin=True):
            model.load_weights(some)
        layer_state.flush(layer)

    def bypassed_partial():
        with bypass():
            plugin_partial()

    def bare_partial():
        for g in NVFP4.groups():
            NVFP4.unprepare_(layer, g, ids)
        model.load_weights(some)
        for g in NVFP4.groups():
            NVFP4.prepare_(layer, g, ids)

    part = interleaved(
        {
            "plugin": plugin_partial,
            "bypassed": bypassed_partial,
            "bare": bare_partial,
            "plugin_no_entry_point": plugin_partial_no_entry,
        },
        dev,
        a.repeats,
    )
    with device_path(), count_syncs() as c:  # as on CUDA: the bucket's values read back once
        plugin_partial()
    partial_syncs = dict(c)
    with count_syncs() as c:
        plugin_partial_no_entry()
    no_entry_syncs = dict(c)
    res["partial"] = dict(
        what=f"{len(ids)} experts written outside a session (each un-prepared before its first write), then flushed",
        **part,
        ratio_median=part["plugin"]["median_s"] / part["bare"]["median_s"],
        bypassed_ratio_median=part["bypassed"]["median_s"] / part["bare"]["median_s"],
        no_entry_point_ratio_median=part["plugin_no_entry_point"]["median_s"] / part["bare"]["median_s"],
        loader_calls=len(some),
        tensor_to_python=partial_syncs,
        tensor_to_python_no_entry_point=no_entry_syncs,
    )

    # ---- value checks of every scale of the layer ---------------------------------------------------------------
    floats = [t for n, t in everything if n.endswith(("weight_scale_2", "input_scale"))]
    bytes1 = [t for n, t in everything if n.endswith(".weight_scale")]
    bufs1 = [b for (_, s), b in buf.items() if s == "weight_scale"]

    def float_per_tensor():  # a write outside a request: its loader hook checks it alone
        for t in floats:
            assert not value_checks.bad_one(t, POSITIVE)

    def float_batched():  # a request's check of them
        assert value_checks.find_bad([(t, POSITIVE) for t in floats]) == []

    scales = [(t, POSITIVE if t.dtype == torch.float32 else E4M3_BYTES) for t in floats + bytes1]

    def all_scales_find_bad():  # a request's check of every scale of the layer
        assert value_checks.find_bad(scales) == []

    def nan_bytes(t):
        return (u8(t) & 0x7F) == 0x7F  # e4m3fn NaN: 0x7f, 0xff

    def bytes_per_tensor_sync():
        for t in bytes1:
            assert not bool(nan_bytes(t).any())

    def bytes_per_tensor_one_sync():
        flags = torch.stack([nan_bytes(t).any() for t in bytes1])
        assert not bool(flags.any())

    def bytes_per_buffer():
        flags = torch.stack([nan_bytes(b).any() for b in bufs1])
        assert not bool(flags.any())

    checks = {
        "float_scales_per_tensor": float_per_tensor,
        "float_scales_batched": float_batched,
        "all_scales_find_bad": all_scales_find_bad,
        "byte_scales_nan_per_tensor_sync_each": bytes_per_tensor_sync,
        "byte_scales_nan_per_tensor_one_sync": bytes_per_tensor_one_sync,
        "byte_scales_nan_one_reduction_per_buffer": bytes_per_buffer,
    }
    vt = interleaved(checks, dev, a.repeats)
    for n, fn in checks.items():
        # counted on the device path (on a CPU too: its scalars would otherwise be read one by one, no sync there)
        with device_path(), count_syncs() as c:
            fn()
        vt[n]["syncs"] = sum(c.get(dev.type, {}).values())  # the tensors checked are all on `dev`
    res["value_checks"] = dict(
        float_scale_tensors=len(floats),
        byte_scale_tensors=len(bytes1),
        byte_scale_bytes=sum(t.numel() for t in bytes1),
        rows=vt,
    )
    doc = json.dumps(res)
    if a.out:
        with open(a.out, "w") as f:
            f.write(json.dumps(res, indent=2) + "\n")
    summary(res)
    print(doc)
    return 0


def summary(res):
    s = res["session"]
    print(
        f"session: plugin {s['plugin']['median_s'] * 1e3:.2f} ms, bypassed {s['bypassed']['median_s'] * 1e3:.2f} ms, "
        f"bare {s['bare']['median_s'] * 1e3:.2f} ms, "
        f"ratio {s['ratio_median']:.2f} ({s['plugin_us_per_loader_call']:.1f} us per loader call); parts: "
        + ", ".join(f"{k} {v['median_s'] * 1e3:.2f} ms" for k, v in s["parts"].items())
        + f"; tensor -> Python {s['tensor_to_python_in_plugin_update']}"
    )
    p = res["partial"]
    print(
        f"partial: plugin {p['plugin']['median_s'] * 1e3:.2f} ms, bypassed {p['bypassed']['median_s'] * 1e3:.2f} ms, "
        f"bare {p['bare']['median_s'] * 1e3:.2f} ms, "
        f"no entry point {p['plugin_no_entry_point']['median_s'] * 1e3:.2f} ms"
    )
    for k, v in res["value_checks"]["rows"].items():
        print(f"value check {k}: {v['median_s'] * 1e3:.3f} ms, {v['syncs']} syncs")


if __name__ == "__main__":
    raise SystemExit(main())
