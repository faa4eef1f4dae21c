"""Tiny real checkpoints of SGLang's MoE model classes: a model directory SGLang's own loader reads as it reads a
Hugging Face download (config.json, model.safetensors with the checkpoint's own tensor names, the quant config),
with random but calibrated weights.

Architectures (SGLang model class, checkpoint names as the released checkpoints spell them):

| arch | SGLang class | MoE layer | experts | router |
|---|---|---|---|---|
| qwen3_moe | Qwen3MoeForCausalLM | `model.layers.N.mlp.experts.E.{gate,up,down}_proj` | gated SwiGLU | softmax top-k, renormalized |
| deepseek_v3 | DeepseekV3ForCausalLM | `model.layers.N.mlp.experts.E.*` + `mlp.shared_experts.*` | gated SwiGLU, MLA attention, first layer dense | sigmoid + `e_score_correction_bias`, grouped |
| nemotron_h | NemotronHForCausalLM | `backbone.layers.N.mixer.experts.E.{up,down}_proj` + shared | non-gated relu2 | sigmoid + correction bias |
| mixtral | MixtralForCausalLM | `model.layers.N.block_sparse_moe.experts.E.w{1,2,3}` | gated SwiGLU | softmax top-k |

Formats (`quant`): `nvfp4` (ModelOpt NVFP4: `weight` packed e2m1, `weight_scale` e4m3 per 16, `weight_scale_2`,
`input_scale`), `ct_nvfp4` (llm-compressor compressed-tensors NVFP4: `weight_packed`, `weight_scale`,
`weight_global_scale`, `input_global_scale`), `fp8` (ModelOpt FP8 per-tensor, static input scales), `fp8_static`
(`quant_method: fp8`, per-tensor, static: the FP8 format Mixtral's FusedMoE class takes), `fp8_block` (DeepSeek
128x128 block FP8, `weight_scale_inv`), `bf16`.

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
from dataclasses import dataclass, field, replace

import torch

from .. import quant

ARCHS = ("qwen3_moe", "deepseek_v3", "nemotron_h", "mixtral")
QUANTS = ("nvfp4", "ct_nvfp4", "fp8", "fp8_static", "fp8_block", "bf16")

#: (arch, quant) pairs SGLang builds with FusedMoE layers. Quantized Mixtral other than `fp8` / compressed-tensors
#: is built as QuantMixtralForCausalLM (model_loader/utils.py: per-expert linear layers, no FusedMoE).
#: Nemotron-H's loader has no compressed-tensors expert names; DeepSeek block FP8 is the only block recipe here.
SUPPORTED = {
    "qwen3_moe": ("nvfp4", "ct_nvfp4", "fp8", "fp8_static", "bf16"),
    "deepseek_v3": ("nvfp4", "ct_nvfp4", "fp8", "fp8_static", "fp8_block", "bf16"),
    "nemotron_h": ("nvfp4", "ct_nvfp4", "fp8", "fp8_static", "bf16"),
    "mixtral": ("ct_nvfp4", "fp8_static", "bf16"),
}

GATE, UP, DOWN = "gate", "up", "down"


@dataclass(frozen=True)
class TinySpec:
    arch: str = "qwen3_moe"
    quant: str = "nvfp4"
    seed: int = 0
    hidden: int = 256
    moe_intermediate: int = 128
    dense_intermediate: int = 256
    num_experts: int = 8
    top_k: int = 2
    vocab: int = 512
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 64
    #: layer kinds: "moe", "dense" (MLP), "attn" (Nemotron-H attention-only block)
    layers: tuple[str, ...] = field(default=None)

    def __post_init__(self):
        if self.arch not in ARCHS:
            raise ValueError(f"arch {self.arch!r}: one of {ARCHS}")
        if self.quant not in QUANTS:
            raise ValueError(f"quant {self.quant!r}: one of {QUANTS}")
        if self.layers is None:
            default = {
                "qwen3_moe": ("moe", "moe"),
                "mixtral": ("moe", "moe"),
                "deepseek_v3": ("dense", "moe", "moe"),  # first_k_dense_replace = 1
                "nemotron_h": ("attn", "moe", "dense", "moe"),  # hybrid_override_pattern "*E-E"
            }[self.arch]
            object.__setattr__(self, "layers", default)

    @property
    def gated(self) -> bool:
        return self.arch != "nemotron_h"

    @property
    def moe_layers(self) -> list[int]:
        return [i for i, k in enumerate(self.layers) if k == "moe"]

    @property
    def supported(self) -> bool:
        return self.quant in SUPPORTED[self.arch]

    def with_seed(self, seed: int) -> "TinySpec":
        return replace(self, seed=seed)


# ---- names ------------------------------------------------------------------------------------------------------

# DeepSeek MLA sizes (tiny, kernel-aligned)
Q_LORA, KV_LORA, QK_NOPE, QK_ROPE, V_HEAD = 128, 128, 64, 32, 64


def _root(spec: TinySpec) -> str:
    return "backbone" if spec.arch == "nemotron_h" else "model"


def layer_prefix(spec: TinySpec, i: int) -> str:
    return f"{_root(spec)}.layers.{i}"


def moe_prefix(spec: TinySpec, i: int) -> str:
    """Checkpoint prefix of MoE layer i's block (router, experts, shared experts)."""
    sub = {"qwen3_moe": "mlp", "deepseek_v3": "mlp", "nemotron_h": "mixer", "mixtral": "block_sparse_moe"}[spec.arch]
    return f"{layer_prefix(spec, i)}.{sub}"


def expert_proj_names(spec: TinySpec) -> dict[str, str]:
    """role (gate/up/down) -> the checkpoint's projection name."""
    if spec.arch == "mixtral":
        return {GATE: "w1", UP: "w3", DOWN: "w2"}
    if spec.arch == "nemotron_h":
        return {UP: "up_proj", DOWN: "down_proj"}
    return {GATE: "gate_proj", UP: "up_proj", DOWN: "down_proj"}


def expert_base(spec: TinySpec, layer: int, expert: int, role: str) -> str:
    return f"{moe_prefix(spec, layer)}.experts.{expert}.{expert_proj_names(spec)[role]}"


def _attn_shapes(spec: TinySpec, p: str) -> dict[str, tuple]:
    h, nh, nkv, hd = spec.hidden, spec.heads, spec.kv_heads, spec.head_dim
    if spec.arch == "deepseek_v3":
        a = f"{p}.self_attn"
        return {
            f"{a}.q_a_proj.weight": (Q_LORA, h),
            f"{a}.q_a_layernorm.weight": (Q_LORA,),
            f"{a}.q_b_proj.weight": (nh * (QK_NOPE + QK_ROPE), Q_LORA),
            f"{a}.kv_a_proj_with_mqa.weight": (KV_LORA + QK_ROPE, h),
            f"{a}.kv_a_layernorm.weight": (KV_LORA,),
            f"{a}.kv_b_proj.weight": (nh * (QK_NOPE + V_HEAD), KV_LORA),
            f"{a}.o_proj.weight": (h, nh * V_HEAD),
        }
    a = f"{p}.mixer" if spec.arch == "nemotron_h" else f"{p}.self_attn"
    out = {
        f"{a}.q_proj.weight": (nh * hd, h),
        f"{a}.k_proj.weight": (nkv * hd, h),
        f"{a}.v_proj.weight": (nkv * hd, h),
        f"{a}.o_proj.weight": (h, nh * hd),
    }
    if spec.arch == "qwen3_moe":
        out[f"{a}.q_norm.weight"] = (hd,)
        out[f"{a}.k_norm.weight"] = (hd,)
    return out


def dense_shapes(spec: TinySpec) -> dict[str, tuple]:
    """Every tensor that is not a routed expert: name -> shape."""
    h, root = spec.hidden, _root(spec)
    out: dict[str, tuple] = {}
    out[f"{root}.embeddings.weight" if spec.arch == "nemotron_h" else f"{root}.embed_tokens.weight"] = (spec.vocab, h)
    for i, kind in enumerate(spec.layers):
        p = layer_prefix(spec, i)
        if spec.arch == "nemotron_h":
            # one block per layer: a mixer (attention, MLP or MoE) behind one norm
            out[f"{p}.norm.weight"] = (h,)
            if kind == "attn":
                out.update(_attn_shapes(spec, p))
            elif kind == "dense":
                out[f"{p}.mixer.up_proj.weight"] = (spec.dense_intermediate, h)
                out[f"{p}.mixer.down_proj.weight"] = (h, spec.dense_intermediate)
            else:
                m = moe_prefix(spec, i)
                out[f"{m}.gate.weight"] = (spec.num_experts, h)
                out[f"{m}.gate.e_score_correction_bias"] = (spec.num_experts,)
                out[f"{m}.shared_experts.up_proj.weight"] = (spec.moe_intermediate, h)
                out[f"{m}.shared_experts.down_proj.weight"] = (h, spec.moe_intermediate)
            continue
        out[f"{p}.input_layernorm.weight"] = (h,)
        out[f"{p}.post_attention_layernorm.weight"] = (h,)
        out.update(_attn_shapes(spec, p))
        if kind == "dense":
            for proj, shape in (("gate_proj", (spec.dense_intermediate, h)), ("up_proj", (spec.dense_intermediate, h)),
                                ("down_proj", (h, spec.dense_intermediate))):
                out[f"{p}.mlp.{proj}.weight"] = shape
            continue
        m = moe_prefix(spec, i)
        out[f"{m}.gate.weight"] = (spec.num_experts, h)
        if spec.arch == "deepseek_v3":
            out[f"{m}.gate.e_score_correction_bias"] = (spec.num_experts,)
            for proj, shape in (("gate_proj", (spec.moe_intermediate, h)), ("up_proj", (spec.moe_intermediate, h)),
                                ("down_proj", (h, spec.moe_intermediate))):
                out[f"{m}.shared_experts.{proj}.weight"] = shape
    out[f"{root}.norm_f.weight" if spec.arch == "nemotron_h" else f"{root}.norm.weight"] = (h,)
    out["lm_head.weight"] = (spec.vocab, h)
    return out


def expert_shapes(spec: TinySpec, layers=None, experts=None, roles=None) -> dict[str, tuple]:
    """Routed-expert float weights: base name (without `.weight`) -> HF shape [out, in]."""
    out = {}
    for i in spec.moe_layers if layers is None else layers:
        for e in range(spec.num_experts) if experts is None else experts:
            for role in expert_proj_names(spec):
                if roles is not None and role not in roles:
                    continue
                shape = (spec.hidden, spec.moe_intermediate) if role == DOWN else (spec.moe_intermediate, spec.hidden)
                out[expert_base(spec, i, e, role)] = shape
    return out


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
    return torch.nn.functional.silu(g1) * g3


def _calibrate(spec: TinySpec, layer: int, expert: int, ws: dict[str, torch.Tensor]) -> tuple[float, float]:
    """amax of (GEMM1 input, GEMM2 input) of one expert on a fixed ~N(0, 1) batch (the RMSNorm output scale)."""
    x = torch.randn(_CALIB_TOKENS, spec.hidden, generator=_gen(0, f"calib.{layer}"))
    g1 = x @ ws[GATE if spec.gated else UP].T
    g3 = x @ ws[UP].T if spec.gated else None
    a2 = _act(spec, g1, g3)
    return float(x.abs().max()), float(a2.abs().max())


def _nvfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, float]:
    gs = float(quant.FP8_E4M3_MAX * 6 / w.abs().max())
    packed, sf = quant.nvfp4_quantize(w, gs)
    return packed, sf, gs


def quantized_experts(spec: TinySpec, layers=None, experts=None, roles=None) -> dict[str, torch.Tensor]:
    """The checkpoint tensors of the routed experts in `spec.quant`, by full checkpoint name."""
    fl = float_experts(spec, layers, experts, None)  # all roles: calibration needs both halves
    out: dict[str, torch.Tensor] = {}
    by_expert: dict[tuple[int, int], dict[str, torch.Tensor]] = {}
    for base, w in fl.items():
        layer = int(base.split(".layers.")[1].split(".")[0])
        e = int(base.split(".experts.")[1].split(".")[0])
        role = {v: k for k, v in expert_proj_names(spec).items()}[base.rsplit(".", 1)[1]]
        by_expert.setdefault((layer, e), {})[role] = w
    for (layer, e), ws in by_expert.items():
        x_amax, a_amax = _calibrate(spec, layer, e, ws)
        gemm1 = [r for r in ws if r != DOWN]
        fused_gs = float(quant.FP8_E4M3_MAX * 6 / max(float(ws[r].abs().max()) for r in gemm1))
        for role, w in ws.items():
            if roles is not None and role not in roles:
                continue
            base = expert_base(spec, layer, e, role)
            in_amax = a_amax if role == DOWN else x_amax
            q = spec.quant
            if q == "nvfp4":
                packed, sf, gs = _nvfp4(w)
                out[f"{base}.weight"] = packed
                out[f"{base}.weight_scale"] = sf
                out[f"{base}.weight_scale_2"] = torch.tensor(1.0 / gs, dtype=torch.float32)
                out[f"{base}.input_scale"] = torch.tensor(in_amax / (quant.FP8_E4M3_MAX * 6), dtype=torch.float32)
            elif q == "ct_nvfp4":
                # llm-compressor fuses the gate/up global scale; its scales are quantize scales (inverse of ModelOpt's)
                gs = fused_gs if role != DOWN else float(quant.FP8_E4M3_MAX * 6 / w.abs().max())
                packed, sf = quant.nvfp4_quantize(w, gs)
                out[f"{base}.weight_packed"] = packed
                out[f"{base}.weight_scale"] = sf
                out[f"{base}.weight_global_scale"] = torch.tensor([gs], dtype=torch.float32)
                out[f"{base}.input_global_scale"] = torch.tensor([quant.FP8_E4M3_MAX * 6 / in_amax], dtype=torch.float32)
            elif q in ("fp8", "fp8_static"):
                scale = (w.abs().max() / quant.FP8_E4M3_MAX).to(torch.float32)
                out[f"{base}.weight"] = quant.fp8_quantize(w, scale)
                out[f"{base}.weight_scale"] = scale
                out[f"{base}.input_scale"] = torch.tensor(in_amax / quant.FP8_E4M3_MAX, dtype=torch.float32)
            elif q == "fp8_block":
                qw, s = quant.fp8_block_quantize(w)
                out[f"{base}.weight"] = qw
                out[f"{base}.weight_scale_inv"] = s
            elif q == "bf16":
                out[f"{base}.weight"] = w.to(torch.bfloat16)
            else:  # pragma: no cover - TinySpec validates
                raise ValueError(q)
    return out


def dequantize_experts(spec: TinySpec, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`{base}.weight` float32 of every expert projection in `tensors` (what the kernels compute with)."""
    out = {}
    bases = {n.rsplit(".", 1)[0] for n in tensors if ".experts." in n}
    for b in sorted(bases):
        q = spec.quant
        if q == "nvfp4":
            w = quant.nvfp4_dequantize(tensors[f"{b}.weight"], tensors[f"{b}.weight_scale"],
                                       1.0 / float(tensors[f"{b}.weight_scale_2"]))
        elif q == "ct_nvfp4":
            w = quant.nvfp4_dequantize(tensors[f"{b}.weight_packed"], tensors[f"{b}.weight_scale"],
                                       float(tensors[f"{b}.weight_global_scale"]))
        elif q in ("fp8", "fp8_static"):
            w = quant.fp8_dequantize(tensors[f"{b}.weight"], tensors[f"{b}.weight_scale"])
        elif q == "fp8_block":
            w = quant.fp8_block_dequantize(tensors[f"{b}.weight"], tensors[f"{b}.weight_scale_inv"])
        else:
            w = tensors[f"{b}.weight"].float()
        out[f"{b}.weight"] = w
    return out


def checkpoint(spec: TinySpec, layers=None, experts=None, roles=None, dense: bool = True) -> dict[str, torch.Tensor]:
    """Checkpoint tensors by name. `layers` / `experts` / `roles` restrict the routed experts (a partial checkpoint);
    `dense=False` leaves out every non-expert tensor."""
    out = {}
    if dense:
        out.update({n: (t if "e_score_correction_bias" in n else t.to(torch.bfloat16))
                    for n, t in float_dense(spec).items()})
    out.update(quantized_experts(spec, layers, experts, roles))
    return out


def reference_state(spec: TinySpec) -> dict[str, torch.Tensor]:
    """Every tensor as float32 in the checkpoint's names, experts dequantized, dense tensors as stored (BF16 values)."""
    out = {n: t.float() for n, t in checkpoint(spec, dense=True).items() if ".experts." not in n}
    out.update(dequantize_experts(spec, quantized_experts(spec)))
    return out


# ---- config.json and quant configs ---------------------------------------------------------------------------------


def _excluded_modules(spec: TinySpec) -> list[str]:
    """What stays BF16, in the glob style ModelOpt's exclude_modules uses (SGLang matches them per dotted part)."""
    if spec.arch == "nemotron_h":
        ex = ["lm_head"]
        for i, kind in enumerate(spec.layers):
            p = layer_prefix(spec, i)
            if kind == "attn":
                ex += [f"{p}.mixer.{x}" for x in ("q_proj", "k_proj", "v_proj", "o_proj")]
            elif kind == "dense":
                ex += [f"{p}.mixer.up_proj", f"{p}.mixer.down_proj"]
            else:
                ex += [f"{p}.mixer.shared_experts*", f"{p}.mixer.gate"]
        # SGLang names the model "model.", the checkpoint "backbone.": list both spellings
        return ex + [e.replace("backbone.", "model.", 1) for e in ex if e.startswith("backbone.")]
    ex = ["lm_head", "*self_attn*", "*shared_experts*", "*.mlp.gate", "*.block_sparse_moe.gate"]
    ex += [f"{layer_prefix(spec, i)}.mlp.{p}" for i, k in enumerate(spec.layers) if k == "dense"
           for p in ("gate_proj", "up_proj", "down_proj")]
    return ex


def _ignored_layers_fp8(spec: TinySpec) -> list[str]:
    """Fp8Config's ignored_layers: module paths matched on dotted boundaries (no globs)."""
    out = ["lm_head"]
    for i, kind in enumerate(spec.layers):
        p = layer_prefix(spec, i).replace("backbone.", "model.", 1)
        if spec.arch == "nemotron_h":
            if kind == "attn":
                out += [f"{p}.mixer.{x}" for x in ("q_proj", "k_proj", "v_proj", "o_proj")]
            elif kind == "dense":
                out += [f"{p}.mixer.up_proj", f"{p}.mixer.down_proj"]
            else:
                out += [f"{p}.mixer.shared_experts", f"{p}.mixer.gate"]
            continue
        out.append(f"{p}.self_attn")
        if kind == "dense":
            out += [f"{p}.mlp.{x}" for x in ("gate_proj", "up_proj", "down_proj")]
        else:
            m = moe_prefix(spec, i)
            out.append(f"{m}.gate")
            if spec.arch == "deepseek_v3":
                out.append(f"{m}.shared_experts")
    return out


def quantization_config(spec: TinySpec) -> dict | None:
    q = spec.quant
    if q == "bf16":
        return None
    if q in ("nvfp4", "fp8"):
        algo = "NVFP4" if q == "nvfp4" else "FP8"
        cfg = {"quant_method": "modelopt", "quant_algo": algo, "ignore": _excluded_modules(spec),
               "producer": {"name": "modelopt", "version": "0.29.0"}}
        if q == "nvfp4":
            cfg["group_size"] = 16
        return cfg
    if q == "ct_nvfp4":
        ignore = _excluded_modules(spec)
        return {
            "quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized", "quantization_status": "compressed",
            "ignore": [("re:.*" + i.replace(".", r"\.").replace("*", ".*") + ".*") for i in ignore],
            "config_groups": {"group_0": {
                "targets": ["Linear"],
                "weights": {"num_bits": 4, "type": "float", "strategy": "tensor_group", "group_size": 16,
                            "symmetric": True, "dynamic": False},
                "input_activations": {"num_bits": 4, "type": "float", "strategy": "tensor_group", "group_size": 16,
                                      "symmetric": True, "dynamic": "local"},
            }},
        }
    if q == "fp8_static":
        return {"quant_method": "fp8", "activation_scheme": "static", "ignored_layers": _ignored_layers_fp8(spec)}
    if q == "fp8_block":
        return {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128],
                "fmt": "e4m3", "ignored_layers": _ignored_layers_fp8(spec)}
    raise ValueError(q)


def hf_quant_config(spec: TinySpec) -> dict | None:
    """ModelOpt's hf_quant_config.json (the legacy file SGLang still reads first for ModelOpt checkpoints)."""
    if spec.quant not in ("nvfp4", "fp8"):
        return None
    qc = quantization_config(spec)
    body = {"quant_algo": qc["quant_algo"], "kv_cache_quant_algo": None, "exclude_modules": qc["ignore"]}
    if spec.quant == "nvfp4":
        body["group_size"] = 16
    return {"producer": qc["producer"], "quantization": body}


def config(spec: TinySpec, with_quant: bool = True) -> dict:
    h, a = spec.hidden, spec.arch
    common = {"hidden_size": h, "vocab_size": spec.vocab, "num_attention_heads": spec.heads,
              "num_key_value_heads": spec.kv_heads, "max_position_embeddings": 512, "torch_dtype": "bfloat16",
              "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2, "initializer_range": 0.02}
    if a == "qwen3_moe":
        cfg = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "head_dim": spec.head_dim,
               "num_hidden_layers": len(spec.layers), "intermediate_size": spec.dense_intermediate,
               "moe_intermediate_size": spec.moe_intermediate, "num_experts": spec.num_experts,
               "num_experts_per_tok": spec.top_k, "norm_topk_prob": True, "decoder_sparse_step": 1,
               "mlp_only_layers": [i for i, k in enumerate(spec.layers) if k != "moe"], "rms_norm_eps": 1e-6,
               "rope_theta": 10000.0, "hidden_act": "silu", "attention_bias": False, "use_sliding_window": False,
               "output_router_logits": False, "router_aux_loss_coef": 0.0}
    elif a == "mixtral":
        cfg = {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "head_dim": spec.head_dim,
               "num_hidden_layers": len(spec.layers), "intermediate_size": spec.moe_intermediate,
               "num_local_experts": spec.num_experts, "num_experts_per_tok": spec.top_k, "rms_norm_eps": 1e-5,
               "rope_theta": 10000.0, "hidden_act": "silu", "sliding_window": None, "output_router_logits": False,
               "router_aux_loss_coef": 0.0}
    elif a == "deepseek_v3":
        cfg = {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
               "num_hidden_layers": len(spec.layers), "intermediate_size": spec.dense_intermediate,
               "moe_intermediate_size": spec.moe_intermediate, "n_routed_experts": spec.num_experts,
               "n_shared_experts": 1, "num_experts_per_tok": spec.top_k,
               "first_k_dense_replace": sum(1 for k in spec.layers[: spec.layers.index("moe")]), "moe_layer_freq": 1,
               # 4 groups of 2 experts, best 2 groups: exercises the group restriction of DeepSeek-V3 routing
               "n_group": 4, "topk_group": 2, "topk_method": "noaux_tc", "scoring_func": "sigmoid",
               "norm_topk_prob": True,
               # 1.0: SGLang applies routed_scaling_factor a second time when not on CUDA (deepseek_v2.py,
               # `if not _is_cuda: final_hidden_states *= self.routed_scaling_factor`); with 1.0 CPU and GPU agree
               "routed_scaling_factor": 1.0,
               "q_lora_rank": Q_LORA, "kv_lora_rank": KV_LORA, "qk_nope_head_dim": QK_NOPE,
               "qk_rope_head_dim": QK_ROPE, "v_head_dim": V_HEAD, "num_key_value_heads": spec.heads,
               "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
               # DeepSeek-V3's own YaRN recipe, scaled down (SGLang's CPU rope path only implements deepseek_yarn)
               "rope_scaling": {"type": "yarn", "rope_type": "yarn", "factor": 4.0,
                                "original_max_position_embeddings": 128, "beta_fast": 32, "beta_slow": 1,
                                "mscale": 1.0, "mscale_all_dim": 1.0}, "hidden_act": "silu",
               "attention_bias": False, "num_nextn_predict_layers": 0, "ep_size": 1}
    else:
        pattern = "".join({"attn": "*", "moe": "E", "dense": "-"}[k] for k in spec.layers)
        cfg = {"architectures": ["NemotronHForCausalLM"], "model_type": "nemotron_h", "head_dim": spec.head_dim,
               "hybrid_override_pattern": pattern, "num_hidden_layers": len(spec.layers),
               "intermediate_size": spec.dense_intermediate, "mlp_hidden_act": "relu2", "mlp_bias": False,
               "moe_intermediate_size": spec.moe_intermediate,
               "moe_shared_expert_intermediate_size": spec.moe_intermediate, "n_routed_experts": spec.num_experts,
               "n_shared_experts": 1, "num_experts_per_tok": spec.top_k, "n_group": 1, "topk_group": 1,
               "norm_topk_prob": True, "routed_scaling_factor": 1.0, "layer_norm_epsilon": 1e-5,
               "attention_bias": False, "use_bias": False, "residual_in_fp32": False,
               "rescale_prenorm_residual": True, "num_nextn_predict_layers": 0,
               # Mamba sizes (no Mamba layer in the default pattern; the config classes still read them)
               "ssm_state_size": 16, "mamba_num_heads": 8, "mamba_head_dim": 32, "n_groups": 1, "conv_kernel": 4,
               "expand": 1, "chunk_size": 64, "use_conv_bias": True, "mamba_hidden_act": "silu",
               "time_step_limit": [0.0, 1e9], "rope_theta": 10000.0}
    cfg = {**common, **cfg}
    qc = quantization_config(spec) if with_quant else None
    if qc is not None:
        cfg["quantization_config"] = qc
    if not with_quant:
        cfg["torch_dtype"] = "float32"
    return cfg


# ---- writing ---------------------------------------------------------------------------------------------------------


def _save(path: str, tensors: dict[str, torch.Tensor], cfg: dict, extra: dict | None = None) -> str:
    from safetensors.torch import save_file

    os.makedirs(path, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, os.path.join(path, "model.safetensors"),
              metadata={"format": "pt"})
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


def write_tensors(out: str, spec: TinySpec, tensors: dict[str, torch.Tensor]) -> str:
    """A model directory holding exactly `tensors` (e.g. a mix of two checkpoints), with `spec`'s configs."""
    extra = {}
    hq = hf_quant_config(spec)
    if hq is not None:
        extra["hf_quant_config.json"] = hq
    return _save(out, tensors, config(spec), extra)


def write_reference(out: str, spec: TinySpec) -> str:
    """A float32 model directory (experts dequantized, no quant config) for transformers' own model class."""
    return _save(out, reference_state(spec), config(spec, with_quant=False))


def write_tokenizer(path: str, vocab: int) -> None:
    """A byte-level BPE tokenizer without merges, built offline (no hub): 256 byte tokens + specials up to `vocab`.
    Enough for SGLang's tokenizer manager and detokenizer; token ids are what the tests drive."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    specials = ["<unk>", "<s>", "</s>"]
    vocab_map = {t: i for i, t in enumerate(specials)}
    for ch in sorted(alphabet):
        vocab_map[ch] = len(vocab_map)
    i = 0
    while len(vocab_map) < vocab:
        vocab_map[f"<extra_{i}>"] = len(vocab_map)
        i += 1
    tok = Tokenizer(models.BPE(vocab=vocab_map, merges=[], unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.save(os.path.join(path, "tokenizer.json"))
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
                   "unk_token": "<unk>", "model_max_length": 512, "clean_up_tokenization_spaces": False}, f)
    with open(os.path.join(path, "special_tokens_map.json"), "w") as f:
        json.dump({"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}, f)


def _ints(s: str | None):
    return None if s is None else [int(x) for x in s.split(",") if x != ""]


def main(args) -> int:
    spec = TinySpec(arch=args.arch, quant=args.quant, seed=args.seed)
    if not spec.supported and not args.force:
        raise SystemExit(f"SGLang does not build {args.arch} in {args.quant} with FusedMoE layers "
                         f"(supported: {', '.join(SUPPORTED[args.arch])}); --force writes it anyway")
    write(args.out, spec, layers=_ints(args.layers), experts=_ints(args.experts), dense=not args.experts_only)
    print(f"wrote {args.arch} {args.quant} (seed {args.seed}) to {args.out}")
    if args.reference:
        ref = args.out.rstrip("/") + "-reference"
        write_reference(ref, spec)
        print(f"wrote the float32 dequantized reference to {ref}")
    return 0
