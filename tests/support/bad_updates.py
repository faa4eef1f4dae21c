"""Invalid weight updates as an RL framework could send them, through SGLang's own `param.weight_loader(...)`.

One catalogue for three users: tests/test_validation.py (every case refused with a named error, no byte and no
layout state changed; hypothesis draws from the same mutations), and this module's command line, which runs the
catalogue with the plugin on or off (SGLANG_TRTLLM_MOE_DISABLE=1) and classifies what happened, for the
comparison table in docs/RELIABILITY.md:

    PYTHONPATH=. <venv>/bin/python -m tests.support.bad_updates [--json]

Outcomes: "refused" (WeightUpdateRefused naming the layer), "error" (another exception, no byte changed),
"error-after-write" (an exception after bytes changed), "silent-write" (no error, bytes changed: silent
corruption), "dropped" (no error, nothing written: the update is silently lost).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from sglang_trtllm_moe.sandbox import layers as cpu_layers
from sglang_trtllm_moe.sandbox.layers import MoeSpec

#: the layers the catalogue runs on: every format the plugin prepares, gated and not, padded and not
CONFIGS = {
    "nvfp4": MoeSpec(num_experts=4, hidden=128, intermediate=128, fmt="nvfp4"),
    "nvfp4-I96-padded": MoeSpec(num_experts=4, hidden=128, intermediate=96, fmt="nvfp4"),
    "nvfp4-relu2": MoeSpec(num_experts=4, hidden=128, intermediate=128, fmt="nvfp4", gated=False, activation="relu2"),
    "ct_nvfp4": MoeSpec(num_experts=4, hidden=128, intermediate=128, fmt="ct_nvfp4"),
    "fp8_modelopt": MoeSpec(num_experts=4, hidden=128, intermediate=128, fmt="fp8_modelopt"),
    "fp8_tensor": MoeSpec(num_experts=4, hidden=128, intermediate=128, fmt="fp8_tensor"),
    "fp8_tensor-relu2": MoeSpec(
        num_experts=4, hidden=128, intermediate=128, fmt="fp8_tensor", gated=False, activation="relu2"
    ),
    "fp8_block": MoeSpec(num_experts=4, hidden=128, intermediate=128, fmt="fp8_block"),
    "bf16": MoeSpec(num_experts=4, hidden=128, intermediate=128, fmt="bf16"),
    "bf16-I96-padded": MoeSpec(num_experts=4, hidden=128, intermediate=96, fmt="bf16"),
    "ct_int4": MoeSpec(num_experts=4, hidden=256, fmt="ct_int4"),
}
LAYER = "model.layers.0.mlp.experts"
#: the configs of the upstream comparison (one per format, as the issue measured)
COMPARED = ("nvfp4", "ct_nvfp4", "fp8_modelopt", "fp8_tensor", "fp8_block", "bf16")

MAKERS = {
    "nvfp4": cpu_layers.random_nvfp4_checkpoint,
    "ct_nvfp4": cpu_layers.random_ct_nvfp4_checkpoint,
    "bf16": cpu_layers.random_bf16_checkpoint,
    "fp8_modelopt": cpu_layers.random_fp8_checkpoint,
    "fp8_tensor": cpu_layers.random_fp8_checkpoint,
    "fp8_block": cpu_layers.random_fp8_checkpoint,
    "ct_int4": cpu_layers.random_ct_int4_checkpoint,
}


def checkpoint(spec: MoeSpec, seed: int = 0, experts=None) -> dict[str, torch.Tensor]:
    return MAKERS[spec.fmt](spec, seed=seed, experts=experts)


@dataclass
class Write:
    """One call of SGLang's loader: `param.weight_loader(param, tensor, weight_name, shard_id=, expert_id=)`."""

    param: str
    tensor: object
    weight_name: str
    shard_id: object
    expert_id: object
    ckpt_name: str = ""
    kind: str = ""
    extra: dict = field(default_factory=dict)

    def call(self, layer):
        p = getattr(layer, self.param)
        return p.weight_loader(p, self.tensor, self.weight_name, shard_id=self.shard_id, expert_id=self.expert_id)


def writes(spec: MoeSpec, tensors: dict[str, torch.Tensor], num_experts: int | None = None) -> list[Write]:
    """The loader calls a model's load_weights makes for `tensors` (the mapping of sandbox.layers.load_checkpoint)."""
    from sglang.srt.layers.moe.fused_moe_triton.layer import FusedMoE

    g = cpu_layers
    mapping = FusedMoE.make_expert_params_mapping(
        g.GATE if spec.gated else g.UP, g.DOWN, g.UP if spec.gated else "<none>", num_experts or spec.num_experts
    )
    out = []
    for name, t in tensors.items():
        full = "experts." + name.split("experts.", 1)[1]
        for param_name, weight_name, expert_id, shard_id in mapping:
            if full.startswith(weight_name):
                pname = param_name.split("experts.", 1)[1] + full[len(weight_name) :].replace(".", "_")
                # weight_name as SGLang's model loaders pass it (SGLang's own BF16 restore matches its suffix)
                out.append(Write(pname, t, f"{LAYER}.{pname}", shard_id, expert_id, ckpt_name=name))
                break
    return out


def load(layer, ws: list[Write]) -> None:
    for w in ws:
        w.call(layer)


# ---- the mutations ------------------------------------------------------------------------------------------


def scale_kind(pname: str) -> str | None:
    """ "tensor_scale" / "input_scale" for the parameters that hold one value per expert and shard, by name."""
    if "input" in pname:
        return "input_scale"
    if pname.endswith(("weight_scale_2", "global_scale")):
        return "tensor_scale"
    return None


def mutations(layer, spec: MoeSpec, w: Write) -> list[tuple[str, Write]]:
    """Every invalid variant of the valid write `w` on `layer` (plugin on or off: nothing here asks the plugin)."""
    p = getattr(layer, w.param)
    t = w.tensor
    gated = spec.gated
    group = "w2" if w.param.startswith("w2") else "w13"
    is_scalar = t.dim() <= 1 and t.numel() == 1
    kind = scale_kind(w.param) or ("tensor_scale" if is_scalar else ("block_scale" if "scale" in w.param else "weight"))
    out: list[tuple[str, Write]] = []

    def add(case, **changes):
        d = dict(w.__dict__)
        d.update(changes)
        d["kind"] = kind
        out.append((f"{kind}:{case}", Write(**d)))

    # 1. shard ids
    add("shard=other group", shard_id="w1" if group == "w2" else "w2")
    if group == "w13" and not gated:
        add("shard=w3 (not gated)", shard_id="w3")
    for bad in ("w4", "W1", "w13", None, 1):
        add(f"shard={bad!r}", shard_id=bad)
    # 2. expert ids
    total = int(getattr(layer, "num_experts", spec.num_experts))
    for case, bad in (
        ("str", "1"),
        ("None", None),
        ("float 2.5", 2.5),
        ("float 1.0", 1.0),
        ("bool", True),
        ("-1", -1),
        ("= num_experts", total),
        ("float tensor", torch.tensor(1.0)),
        ("[1] tensor", torch.tensor([1])),
        ("bool tensor", torch.tensor(True)),
    ):
        add(f"expert={case}", expert_id=bad)
    # 3. devices and types
    add("device=meta", tensor=t.to("meta"))
    add("not a tensor", tensor=[0.5] if is_scalar else t.float().tolist()[:1])
    # 4. weight_name naming another managed parameter of the layer
    other = next(
        n
        for n in ("w13_weight_scale", "w2_weight_scale", "w13_weight", "w2_weight")
        if n != w.param and n in layer._parameters
    )
    add("weight_name=another parameter", weight_name=f"{LAYER}.{other}")
    # 5. dtypes
    if p.dtype.itemsize == 1:
        add("dtype=float32 (value-converted)", tensor=t.float())
        add(
            "dtype=bfloat16",
            tensor=t.to(torch.bfloat16) if t.dtype != torch.uint8 else t.view(torch.int8).to(torch.bfloat16),
        )
        if t.dtype == torch.float8_e4m3fn:
            add("dtype=uint8 (same bytes)", tensor=t.view(torch.uint8))
        else:
            add("dtype=int8 (same bytes)", tensor=t.view(torch.int8))
    elif p.dtype == torch.int32:  # INT4 words (8 nibbles each): only int32 keeps them
        add("dtype=float32 (value-converted)", tensor=t.float())
        add("dtype=uint8 (same bytes)", tensor=t.view(torch.uint8))
        add("dtype=int64 (value-converted)", tensor=t.to(torch.int64))
    else:
        add("dtype=int32", tensor=t.to(torch.int32))
        add("dtype=bool", tensor=t != 0)
        add("dtype=float8_e4m3fn", tensor=t.to(torch.float8_e4m3fn))
    # 6. shapes
    if is_scalar:
        add("shape=[2]", tensor=t.reshape(1).repeat(2))
        add("shape=[1,1]", tensor=t.reshape(1, 1))
        add("shape=[num_experts]", tensor=t.reshape(1).repeat(spec.num_experts))
    else:
        rows, cols = t.shape
        split = 0 if group == "w13" else 1
        add("shape=3-D", tensor=t.unsqueeze(0))
        add("shape=1-D", tensor=t.reshape(-1))
        add("shape=0-dim", tensor=t[0, 0])
        if rows != cols:
            add("shape=transposed", tensor=t.t())
        if t.shape[split] > 1:
            add("shape=short (one slice)", tensor=t.narrow(split, 0, 1))
        add("shape=empty", tensor=t.narrow(split, 0, 0))
        add("shape=long (+1)", tensor=torch.cat([t, t.narrow(split, 0, 1)], dim=split))
        fixed = 1 - split
        add("shape=other dim -1", tensor=t.narrow(fixed, 0, t.shape[fixed] - 1))
        add("shape=other dim +1", tensor=torch.cat([t, t.narrow(fixed, 0, 1)], dim=fixed))
    # 7. values: one value per expert and shard (weight_scale_2, FP8 weight_scale, global and input scales)
    if is_scalar and t.dtype.is_floating_point:
        for case, v in (("nan", math.nan), ("inf", math.inf), ("-inf", -math.inf), ("0", 0.0), ("-1", -1.0)):
            add(f"value={case}", tensor=torch.full_like(t, v))
    elif kind == "block_scale" and t.dtype.itemsize >= 2 and t.dtype.is_floating_point:
        for case, v in (("nan", math.nan), ("inf", math.inf), ("-1", -1.0)):
            bad = t.clone()
            bad.view(-1)[-1] = v  # the last block: a check that reads only the first values misses it
            add(f"value={case} (one block)", tensor=bad)
    elif kind == "block_scale" and t.dtype.itemsize == 1:
        # 1-byte scales, checked on their bytes: e4m3 NaN (0x7F, 0xFF) and negative (0x81, -2^-9); UE8M0 NaN (0xFF)
        e4m3 = t.dtype == torch.float8_e4m3fn
        cases = (("0x7f NaN", 0x7F), ("0xff NaN", 0xFF), ("0x81 negative", 0x81)) if e4m3 else (("0xff NaN", 0xFF),)
        for case, byte in cases:
            bad = t.clone()
            bad.view(torch.uint8).view(-1)[-1] = byte
            add(f"value={case} (one block)", tensor=bad)
    return out


def managed(spec: MoeSpec, param: str) -> bool:
    """A parameter the format has a load rule for (not compressed-tensors' weight_shape: metadata SGLang loads)."""
    return spec.kind.format.load_rule(param) is not None


def catalogue(layer, spec: MoeSpec) -> list[tuple[str, Write]]:
    """For each managed parameter: one valid write (expert 1, the first shard of the parameter's group) of new
    values (another checkpoint seed; scales x 1.25, so that every valid write would change bytes) and every
    invalid variant of it."""
    seen, out = set(), []
    for w in writes(spec, checkpoint(spec, seed=1, experts=[1])):
        if w.param in seen or not managed(spec, w.param):
            continue
        seen.add(w.param)
        if w.tensor.numel() == 1:
            w.tensor = w.tensor * 1.25
        for case, bad in mutations(layer, spec, w):
            out.append((f"{w.param}/{case}", bad))
    return out


# ---- running a case ---------------------------------------------------------------------------------------------


def compared(layer) -> set[str]:
    """What a fresh load defines: the parameters the format loads and the kernel scalars the plugin computes (not
    the never-written placeholders some releases register, e.g. NVFP4 `*_blockscale_swizzled` up to 0.5.1x)."""
    from sglang_trtllm_moe.updates import layer_params

    fmt = layer_params.format_of(layer)
    return {n for n, _ in layer.named_parameters() if fmt.load_rule(n)} | set(fmt.compute_scalars(layer))


def _bytes(layer, only=None) -> tuple[list, torch.Tensor]:
    names, parts = [], []
    for n, p in layer.named_parameters():
        if only is not None and n not in only:
            continue
        names.append((n, p.numel() * p.element_size()))
        parts.append(p.detach().reshape(-1).view(torch.uint8))
    return names, torch.cat(parts)


def snapshot(layer, only=None) -> dict:
    """Every byte of every parameter of `layer` (or of the parameters named in `only`), and its layout state."""
    from sglang_trtllm_moe import layer_state

    names, data = _bytes(layer, only)
    st = layer_state.state_of(layer)
    state = None if st is None else ({g: m.clone() for g, m in st.prepared.items()}, st.scalars_dirty)
    return {"names": names, "bytes": data, "state": state, "only": only}


def changed(layer, snap) -> list[str]:
    """The parameters whose bytes differ from `snap` ("__layout_state__" when the layout state does)."""
    from sglang_trtllm_moe import layer_state

    names, data = _bytes(layer, snap.get("only"))
    out = []
    if names != snap["names"]:
        out.append("__parameters__")
    elif not torch.equal(data, snap["bytes"]):
        off = 0
        for n, size in names:
            if not torch.equal(data[off : off + size], snap["bytes"][off : off + size]):
                out.append(n)
            off += size
    st = layer_state.state_of(layer)
    if st is not None and snap["state"] is not None:
        masks, dirty = snap["state"]
        if dirty != st.scalars_dirty or any(not torch.equal(m, st.prepared[g]) for g, m in masks.items()):
            out.append("__layout_state__")
    return out


def outcome(layer, w: Write, snap=None) -> tuple[str, str]:
    """(outcome, detail) of one call, comparing every byte of the layer before and after (`snap`: the layer's
    snapshot, when the caller holds one)."""
    from sglang_trtllm_moe.errors import WeightUpdateRefused

    snap = snapshot(layer) if snap is None else snap
    try:
        w.call(layer)
    except WeightUpdateRefused as e:
        diff = changed(layer, snap)
        return ("refused" if not diff else "refused-after-write"), str(e)
    except Exception as e:  # noqa: BLE001 - classified
        diff = changed(layer, snap)
        if isinstance(e, ValueError) and "refused weight update" in str(e):  # the plugin before WeightUpdateRefused
            return ("refused" if not diff else "refused-after-write"), str(e)
        return ("error-after-write" if diff else "error"), f"{type(e).__name__}: {str(e)[:160]}"
    diff = changed(layer, snap)
    return ("silent-write", f"changed {diff}") if diff else ("dropped", "")


def build(config: str, prepare: bool = True):
    spec = CONFIGS[config]
    tensors = checkpoint(spec, seed=0)
    layer = cpu_layers.build_layer(spec)
    load(layer, writes(spec, tensors))
    if prepare:
        layer.quant_method.process_weights_after_loading(layer)
    return spec, tensors, layer


def run_catalogue(configs=COMPARED, prepare: bool = True) -> dict:
    """{config: {case: [outcome, detail]}}; every case runs on a layer freshly loaded from the same checkpoint
    (a silent write of one case must not leak into the next)."""
    results = {}
    for config in configs:
        spec, _, layer = build(config, prepare)
        snap = snapshot(layer)
        results[config] = {}
        for case, w in catalogue(layer, spec):
            o, detail = outcome(layer, w, snap)
            results[config][case] = [o, detail]
            if o not in ("refused", "error", "dropped"):
                spec, _, layer = build(config, prepare)
                snap = snapshot(layer)
    return results


OUTCOMES = ("refused", "silent-write", "error-after-write", "error", "dropped", "refused-after-write")


def case_class(case: str) -> str:
    """ "w13_weight/weight:shard='w4'" -> "shard"."""
    return case.split(":", 1)[1].split("=", 1)[0].split(" (", 1)[0]


def compare_table(plugin: dict, upstream: dict) -> str:
    """Markdown: per class of invalid update and per format, what SGLang alone does and what the plugin does."""
    import collections

    def count(results, key):
        c = collections.Counter()
        for config, cases in results.items():
            for case, (o, _) in cases.items():
                c[(key(config, case), o)] += 1
        return c

    lines = []
    for title, key in (
        ("kind of invalid update", lambda config, case: case_class(case)),
        ("format", lambda config, case: config),
    ):
        up = count(upstream, key)
        pl = count(plugin, key)
        rows = sorted({k for k, _ in up} | {k for k, _ in pl}, key=str)
        lines.append(
            f"| {title} | cases | SGLang: silent write | SGLang: error after writing | SGLang: another "
            "exception, nothing written | SGLang: silently dropped | plugin: refused, nothing written |"
        )
        lines.append("|---|---:|---:|---:|---:|---:|---:|")
        tot = collections.Counter()
        for r in rows:
            n = sum(v for (k, _), v in up.items() if k == r)
            cells = [
                up[(r, "silent-write")],
                up[(r, "error-after-write")],
                up[(r, "error")],
                up[(r, "dropped")],
                pl[(r, "refused")],
            ]
            tot.update({"n": n, **{str(i): c for i, c in enumerate(cells)}})
            lines.append(f"| {r} | {n} | " + " | ".join(map(str, cells)) + " |")
        lines.append(f"| **all** | **{tot['n']}** | " + " | ".join(f"**{tot[str(i)]}**" for i in range(5)) + " |")
        lines.append("")
    return "\n".join(lines)


def main(argv=None) -> int:
    import argparse
    import collections
    import json
    import os
    import subprocess
    import sys

    ap = argparse.ArgumentParser()
    ap.add_argument("--json", action="store_true", help="run the catalogue in this process, print JSON")
    ap.add_argument(
        "--compare",
        action="store_true",
        help="run it twice in fresh processes (plugin on, SGLANG_TRTLLM_MOE_DISABLE=1) and print the table",
    )
    args = ap.parse_args(argv)
    if args.compare:
        runs = {}
        for mode, extra in (("plugin", {}), ("upstream", {"SGLANG_TRTLLM_MOE_DISABLE": "1"})):
            env = {k: v for k, v in os.environ.items() if not k.startswith("SGLANG_TRTLLM_MOE_")}
            env.update(extra, OMP_NUM_THREADS="1")
            out = subprocess.run(
                [sys.executable, "-m", "tests.support.bad_updates", "--json"],
                env=env,
                capture_output=True,
                text=True,
                check=True,
            ).stdout
            runs[mode] = json.loads(out.strip().splitlines()[-1])["results"]
        print(compare_table(runs["plugin"], runs["upstream"]))
        return 0

    import torch

    import tests.conftest  # noqa: F401 - the torchvision shim, before sglang is imported
    from tests.support import sglang_runtime

    torch.set_num_threads(1)
    sglang_runtime.ensure("flashinfer_trtllm")
    plugin = os.environ.get("SGLANG_TRTLLM_MOE_DISABLE") != "1"
    # upstream: SGLang's loader on a loaded layer (its own preparation needs CUDA kernels for some formats; the
    # loader writes the same way before and after it, apart from BF16's 4-D reshape)
    results = run_catalogue(prepare=plugin)
    if args.json:
        print(json.dumps({"plugin": plugin, "results": results}))
        return 0
    for config, cases in results.items():
        print(config, dict(collections.Counter(o for o, _ in cases.values())))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
