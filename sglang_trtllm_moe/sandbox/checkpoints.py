"""Tiny real checkpoints of SGLang's MoE model classes: a model directory SGLang's own loader reads as it reads a
Hugging Face download (config.json, model.safetensors with the checkpoint's own tensor names, the quant config),
with random but calibrated weights.

Architectures (arch: SGLang model class; MoE layer, checkpoint names as the released checkpoints spell them;
experts; router):

- qwen3_moe: Qwen3MoeForCausalLM; `model.layers.N.mlp.experts.E.{gate,up,down}_proj`; gated SwiGLU; softmax top-k,
  renormalized
- deepseek_v3: DeepseekV3ForCausalLM; `model.layers.N.mlp.experts.E.*` + `mlp.shared_experts.*`; gated SwiGLU, MLA
  attention, first layer dense; sigmoid + `e_score_correction_bias`, grouped
- nemotron_h: NemotronHForCausalLM; `backbone.layers.N.mixer.experts.E.{up,down}_proj` + shared; non-gated relu2;
  sigmoid + correction bias
- mixtral: MixtralForCausalLM; `model.layers.N.block_sparse_moe.experts.E.w{1,2,3}`; gated SwiGLU; softmax top-k

Formats (`quant`): every format's tiny checkpoint (`format_examples.TINY`; `tiny_spec.QUANTS`), its experts written in
the stored encoding of that name (`WeightFormat.encoding`, formats/encodings.py: the tensors' names, dtypes and
scales are the encoding's `quantize`, config.json's quant config its `quant_config`); a format SGLang quantizes as it
loads (`nvfp4_online`) is stored in another's (a BF16 checkpoint, served with `--quantization nvfp4_online`:
`TinySpec.server_args()`).

Only the routed experts are quantized. Attention, dense MLPs, shared experts, routers, embeddings and lm_head stay
BF16 and are listed in the quant config's exclude/ignore list, as real mixed-precision checkpoints list what they
keep unquantized: SGLang's quantized dense Linear kernels (ModelOpt FP4 GEMM, FP8 triton GEMMs) are CUDA-only, so
on a CPU box only BF16 dense layers can run (docs/TESTING.md).

Calibration: weights are drawn per tensor from a generator seeded by (seed, tensor name), so any subset of a
checkpoint (one expert, one layer) is byte-identical to the same tensors of the full checkpoint; std is
1/sqrt(fan_in) (varied per expert), so every block contributes to the output. Static activation scales are
measured, not guessed: each expert's GEMM1 input (RMSNorm output, ~N(0, 1)) and its GEMM1 activation output on a
fixed calibration batch give amax, and input_scale = amax / 448 (FP8) or amax / (448 * 6) (NVFP4), as ModelOpt's
max calibration computes them.

Dequantized reference: `reference_state(...)` gives every tensor as float32 with the experts dequantized (the
values SGLang's kernels see), and `write_reference(...)` a float32 model directory that transformers' own model
class loads with `from_pretrained` (its converters fuse the per-expert tensors).

CLI: `sglang-trtllm-moe tiny-checkpoint --arch qwen3_moe --quant nvfp4 --out DIR [--seed N] [--experts 0,3]
[--layers 1] [--reference]`.
"""

from __future__ import annotations

import json
import math
import os
import zlib

import torch

from ..formats.encodings import Calibration
from .checkpoint_configs import (  # noqa: F401 (API)
    config,
    encoding,
    hf_quant_config,
    quantization_config,
    write_tokenizer,
)
from .tiny_spec import (  # noqa: F401 (re-exported: the checkpoint API in one module)
    ARCHS,
    DOWN,
    GATE,
    QUANTS,
    SUPPORTED,
    UP,
    TinySpec,
    dense_shapes,
    expert_base,
    expert_proj_names,
    expert_shapes,
    layer_prefix,
    moe_prefix,
)

# ---- deterministic calibrated weights --------------------------------------------------------------------------


def _gen(seed: int, name: str) -> torch.Generator:
    return torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63))


def _draw(seed: int, name: str, shape: tuple) -> torch.Tensor:
    """One tensor, from a generator seeded by (seed, name): independent of which other tensors are drawn."""
    g = _gen(seed, name)
    leaf = name.rsplit(".", 2)[-2] if name.endswith(".weight") else name.rsplit(".", 1)[-1]
    if "norm" in leaf:
        return 1.0 + 0.1 * torch.randn(shape, generator=g)
    if leaf == "e_score_correction_bias":
        return 0.1 * torch.randn(shape, generator=g)
    if leaf in ("embed_tokens", "embeddings"):
        return torch.randn(shape, generator=g)
    std = 1.0 / math.sqrt(shape[-1])
    if leaf == "gate" and len(shape) == 2 and shape[0] < shape[1]:
        std *= 4.0  # routers: well-separated expert scores, so top-k does not hinge on rounding
    return torch.randn(shape, generator=g) * std


def float_experts(spec: TinySpec, layers=None, experts=None, roles=None) -> dict[str, torch.Tensor]:
    """base name -> float32 [out, in] master weight of each routed-expert projection."""
    out = {}
    for base, shape in expert_shapes(spec, layers, experts, roles).items():
        e = int(base.split(".experts.")[1].split(".")[0])
        out[base] = _draw(spec.seed, base, shape) * (1.0 + 0.25 * (e % 3))
    return out


def float_dense(spec: TinySpec) -> dict[str, torch.Tensor]:
    return {n: _draw(spec.seed, n, s) for n, s in dense_shapes(spec).items()}


_CALIB_TOKENS = 512


def _act(spec: TinySpec, g1: torch.Tensor, g3: torch.Tensor | None) -> torch.Tensor:
    if not spec.gated:
        return torch.relu(g1) ** 2
    assert g3 is not None  # gated experts have an up projection
    return torch.nn.functional.silu(g1) * g3


def _calibrate(spec: TinySpec, layer: int, expert: int, ws: dict[str, torch.Tensor]) -> tuple[float, float]:
    """amax of (GEMM1 input, GEMM2 input) of one expert on a fixed ~N(0, 1) batch (the RMSNorm output scale)."""
    x = torch.randn(_CALIB_TOKENS, spec.hidden, generator=_gen(0, f"calib.{layer}"))
    g1 = x @ ws[GATE if spec.gated else UP].T
    g3 = x @ ws[UP].T if spec.gated else None
    a2 = _act(spec, g1, g3)
    return float(x.abs().max()), float(a2.abs().max())


def quantized_experts(spec: TinySpec, layers=None, experts=None, roles=None) -> dict[str, torch.Tensor]:
    """The checkpoint tensors of the routed experts in `spec.stored`'s encoding (`Encoding.quantize`), by full
    checkpoint name."""
    fl = float_experts(spec, layers, experts, None)  # all roles: calibration needs both halves
    enc = encoding(spec)
    out: dict[str, torch.Tensor] = {}
    by_expert: dict[tuple[int, int], dict[str, torch.Tensor]] = {}
    for base, w in fl.items():
        layer = int(base.split(".layers.")[1].split(".")[0])
        e = int(base.split(".experts.")[1].split(".")[0])
        role = {v: k for k, v in expert_proj_names(spec).items()}[base.rsplit(".", 1)[1]]
        by_expert.setdefault((layer, e), {})[role] = w
    for (layer, e), ws in by_expert.items():
        x_amax, a_amax = _calibrate(spec, layer, e, ws)
        gate_up_amax = max(float(ws[r].abs().max()) for r in ws if r != DOWN)
        for role, w in ws.items():
            if roles is not None and role not in roles:
                continue
            base = expert_base(spec, layer, e, role)
            calib = Calibration(a_amax if role == DOWN else x_amax, gate_up_amax, role == DOWN)
            out.update({f"{base}.{suffix}": t for suffix, t in enc.quantize(w, calib).items()})
    return out


def dequantize_experts(spec: TinySpec, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`{base}.weight` float32 of every expert projection in `tensors` (what the kernels compute with:
    `Encoding.dequantize`)."""
    enc = encoding(spec)
    by_base: dict[str, dict[str, torch.Tensor]] = {}
    for n, t in tensors.items():
        if ".experts." in n:
            base, suffix = n.rsplit(".", 1)
            by_base.setdefault(base, {})[suffix] = t
    return {f"{b}.weight": enc.dequantize(by_base[b]) for b in sorted(by_base)}


def checkpoint(spec: TinySpec, layers=None, experts=None, roles=None, dense: bool = True) -> dict[str, torch.Tensor]:
    """Checkpoint tensors by name. `layers` / `experts` / `roles` restrict the routed experts (a partial checkpoint);
    `dense=False` leaves out every non-expert tensor."""
    out = {}
    if dense:
        out.update(
            {n: (t if "e_score_correction_bias" in n else t.to(torch.bfloat16)) for n, t in float_dense(spec).items()}
        )
    out.update(quantized_experts(spec, layers, experts, roles))
    return out


def reference_state(spec: TinySpec) -> dict[str, torch.Tensor]:
    """Every tensor as float32 in the checkpoint's names, experts dequantized, dense tensors as stored (BF16 values)."""
    out = {n: t.float() for n, t in checkpoint(spec, dense=True).items() if ".experts." not in n}
    out.update(dequantize_experts(spec, quantized_experts(spec)))
    return out


# ---- writing ---------------------------------------------------------------------------------------------------------


def _save(path: str, tensors: dict[str, torch.Tensor], cfg: dict, extra: dict | None = None, shards: int = 1) -> str:
    from safetensors.torch import save_file

    os.makedirs(path, exist_ok=True)
    if shards <= 1:
        save_file(
            {k: v.contiguous() for k, v in tensors.items()},
            os.path.join(path, "model.safetensors"),
            metadata={"format": "pt"},
        )
    else:  # as Hugging Face shards a checkpoint: model-0000i-of-0000N.safetensors, an index naming each tensor's file
        names = sorted(tensors)
        size = -(-len(names) // shards)
        weight_map = {}
        for i in range(shards):
            fname = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
            part = names[i * size : (i + 1) * size]
            save_file({k: tensors[k].contiguous() for k in part}, os.path.join(path, fname), metadata={"format": "pt"})
            weight_map.update({k: fname for k in part})
        with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {}, "weight_map": weight_map}, f, indent=1)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f, indent=1)
    for name, body in (extra or {}).items():
        with open(os.path.join(path, name), "w") as f:
            json.dump(body, f, indent=1)
    write_tokenizer(path, cfg["vocab_size"])
    return path


def write(out: str, spec: TinySpec, layers=None, experts=None, roles=None, dense: bool = True) -> str:
    """A model directory SGLang loads: config.json (with its quant config), hf_quant_config.json for ModelOpt,
    model.safetensors, generation_config.json and a tiny tokenizer. Partial checkpoints (`layers`, `experts`,
    `roles`, `dense=False`) hold only those tensors — what an RL trainer writes for a partial disk update."""
    extra = {"generation_config.json": {"bos_token_id": 1, "eos_token_id": 2, "do_sample": False}}
    hq = hf_quant_config(spec)
    if hq is not None:
        extra["hf_quant_config.json"] = hq
    return _save(out, checkpoint(spec, layers, experts, roles, dense), config(spec), extra)


def write_tensors(out: str, spec: TinySpec, tensors: dict[str, torch.Tensor], shards: int = 1) -> str:
    """A model directory holding exactly `tensors` (e.g. a mix of two checkpoints), with `spec`'s configs, in
    `shards` safetensors files."""
    extra = {}
    hq = hf_quant_config(spec)
    if hq is not None:
        extra["hf_quant_config.json"] = hq
    return _save(out, tensors, config(spec), extra, shards=shards)


def write_reference(out: str, spec: TinySpec) -> str:
    """A float32 model directory (experts dequantized, no quant config) for transformers' own model class."""
    return _save(out, reference_state(spec), config(spec, with_quant=False))


def _ints(s: str | None):
    return None if s is None else [int(x) for x in s.split(",") if x != ""]


def main(args) -> int:
    spec = TinySpec(arch=args.arch, quant=args.quant, seed=args.seed)
    if not spec.supported and not args.force:
        raise SystemExit(
            f"SGLang does not build {args.arch} in {args.quant} with FusedMoE layers "
            f"(supported: {', '.join(SUPPORTED[args.arch])}); --force writes it anyway"
        )
    write(args.out, spec, layers=_ints(args.layers), experts=_ints(args.experts), dense=not args.experts_only)
    print(f"wrote {args.arch} {args.quant} (seed {args.seed}) to {args.out}")
    if spec.quantization is not None:
        print(f"a {spec.stored} checkpoint: serve it with --quantization {spec.quantization}")
    if args.reference:
        ref = args.out.rstrip("/") + "-reference"
        write_reference(ref, spec)
        print(f"wrote the float32 dequantized reference to {ref}")
    return 0
