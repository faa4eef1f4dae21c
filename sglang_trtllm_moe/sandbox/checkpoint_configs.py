"""The files beside a tiny checkpoint's tensors: config.json with its quant config (exclude / ignore lists naming
what the checkpoint keeps in BF16, as real mixed-precision checkpoints do), hf_quant_config.json for ModelOpt, and
an offline tokenizer — what SGLang's loader and tokenizer manager read before any weight."""

from __future__ import annotations

import json
import os

from ..formats import FORMATS
from ..formats.encodings import Encoding, Unquantized
from .tiny_spec import Q_LORA, QK_NOPE, QK_ROPE, V_HEAD, TinySpec, layer_prefix, moe_prefix

#: every stored encoding of the registry by its name (`Encoding.name`, the tiny quant a checkpoint is stored in)
ENCODINGS: dict[str, Encoding] = {f.encoding.name: f.encoding for f in FORMATS}

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
    ex += [
        f"{layer_prefix(spec, i)}.mlp.{p}"
        for i, k in enumerate(spec.layers)
        if k == "dense"
        for p in ("gate_proj", "up_proj", "down_proj")
    ]
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


def encoding(spec: TinySpec) -> Encoding:
    """The encoding a tiny checkpoint of `spec` stores its experts in (`spec.stored`: the registry's encoding of
    that name, `WeightFormat.encoding`)."""
    try:
        return ENCODINGS[spec.stored]
    except KeyError:
        raise ValueError(f"no format stores its experts as {spec.stored!r}; encodings: {sorted(ENCODINGS)}") from None


def quantization_config(spec: TinySpec) -> dict | None:
    """config.json's `quantization_config`: the encoding's (`Encoding.quant_config`), naming what stays BF16."""
    unquantized = Unquantized(tuple(_excluded_modules(spec)), tuple(_ignored_layers_fp8(spec)))
    return encoding(spec).quant_config(unquantized)


def hf_quant_config(spec: TinySpec) -> dict | None:
    """ModelOpt's hf_quant_config.json (the legacy file SGLang still reads first for ModelOpt checkpoints), where
    the encoding writes one (`Encoding.hf_quant_config`)."""
    qc = quantization_config(spec)
    return None if qc is None else encoding(spec).hf_quant_config(qc)


def config(spec: TinySpec, with_quant: bool = True) -> dict:
    h, a = spec.hidden, spec.arch
    common = {
        "hidden_size": h,
        "vocab_size": spec.vocab,
        "num_attention_heads": spec.heads,
        "num_key_value_heads": spec.kv_heads,
        "max_position_embeddings": 512,
        "torch_dtype": "bfloat16",
        "tie_word_embeddings": False,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "initializer_range": 0.02,
    }
    if a == "qwen3_moe":
        cfg = {
            "architectures": ["Qwen3MoeForCausalLM"],
            "model_type": "qwen3_moe",
            "head_dim": spec.head_dim,
            "num_hidden_layers": len(spec.layers),
            "intermediate_size": spec.dense_intermediate,
            "moe_intermediate_size": spec.moe_intermediate,
            "num_experts": spec.num_experts,
            "num_experts_per_tok": spec.top_k,
            "norm_topk_prob": True,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [i for i, k in enumerate(spec.layers) if k != "moe"],
            "rms_norm_eps": 1e-6,
            "rope_theta": 10000.0,
            "hidden_act": "silu",
            "attention_bias": False,
            "use_sliding_window": False,
            "output_router_logits": False,
            "router_aux_loss_coef": 0.0,
        }
    elif a == "mixtral":
        cfg = {
            "architectures": ["MixtralForCausalLM"],
            "model_type": "mixtral",
            "head_dim": spec.head_dim,
            "num_hidden_layers": len(spec.layers),
            "intermediate_size": spec.moe_intermediate,
            "num_local_experts": spec.num_experts,
            "num_experts_per_tok": spec.top_k,
            "rms_norm_eps": 1e-5,
            "rope_theta": 10000.0,
            "hidden_act": "silu",
            "sliding_window": None,
            "output_router_logits": False,
            "router_aux_loss_coef": 0.0,
        }
    elif a == "deepseek_v3":
        cfg = {
            "architectures": ["DeepseekV3ForCausalLM"],
            "model_type": "deepseek_v3",
            "num_hidden_layers": len(spec.layers),
            "intermediate_size": spec.dense_intermediate,
            "moe_intermediate_size": spec.moe_intermediate,
            "n_routed_experts": spec.num_experts,
            "n_shared_experts": 1,
            "num_experts_per_tok": spec.top_k,
            "first_k_dense_replace": sum(1 for k in spec.layers[: spec.layers.index("moe")]),
            "moe_layer_freq": 1,
            # 4 groups of 2 experts, best 2 groups: exercises the group restriction of DeepSeek-V3 routing
            "n_group": 4,
            "topk_group": 2,
            "topk_method": "noaux_tc",
            "scoring_func": "sigmoid",
            "norm_topk_prob": True,
            # 1.0: SGLang applies routed_scaling_factor a second time when not on CUDA (deepseek_v2.py,
            # `if not _is_cuda: final_hidden_states *= self.routed_scaling_factor`); with 1.0 CPU and GPU agree
            "routed_scaling_factor": 1.0,
            "q_lora_rank": Q_LORA,
            "kv_lora_rank": spec.kv_lora,
            "qk_nope_head_dim": QK_NOPE,
            "qk_rope_head_dim": QK_ROPE,
            "v_head_dim": V_HEAD,
            "num_key_value_heads": spec.heads,
            "rms_norm_eps": 1e-6,
            "rope_theta": 10000.0,
            # DeepSeek-V3's own YaRN recipe, scaled down (SGLang's CPU rope path only implements deepseek_yarn)
            "rope_scaling": {
                "type": "yarn",
                "rope_type": "yarn",
                "factor": 4.0,
                "original_max_position_embeddings": 128,
                "beta_fast": 32,
                "beta_slow": 1,
                "mscale": 1.0,
                "mscale_all_dim": 1.0,
            },
            "hidden_act": "silu",
            "attention_bias": False,
            "num_nextn_predict_layers": 0,
            "ep_size": 1,
        }
    else:
        pattern = "".join({"attn": "*", "moe": "E", "dense": "-"}[k] for k in spec.layers)
        cfg = {
            "architectures": ["NemotronHForCausalLM"],
            "model_type": "nemotron_h",
            "head_dim": spec.head_dim,
            "hybrid_override_pattern": pattern,
            "num_hidden_layers": len(spec.layers),
            "intermediate_size": spec.dense_intermediate,
            "mlp_hidden_act": "relu2",
            "mlp_bias": False,
            "moe_intermediate_size": spec.moe_intermediate,
            "moe_shared_expert_intermediate_size": spec.moe_intermediate,
            "n_routed_experts": spec.num_experts,
            "n_shared_experts": 1,
            "num_experts_per_tok": spec.top_k,
            "n_group": 1,
            "topk_group": 1,
            "norm_topk_prob": True,
            "routed_scaling_factor": 1.0,
            "layer_norm_epsilon": 1e-5,
            "attention_bias": False,
            "use_bias": False,
            "residual_in_fp32": False,
            "rescale_prenorm_residual": True,
            "num_nextn_predict_layers": 0,
            # Mamba sizes (no Mamba layer in the default pattern; the config classes still read them)
            "ssm_state_size": 16,
            "mamba_num_heads": 8,
            "mamba_head_dim": 32,
            "n_groups": 1,
            "conv_kernel": 4,
            "expand": 1,
            "chunk_size": 64,
            "use_conv_bias": True,
            "mamba_hidden_act": "silu",
            "time_step_limit": [0.0, 1e9],
            "rope_theta": 10000.0,
        }
    cfg = {**common, **cfg}
    qc = quantization_config(spec) if with_quant else None
    if qc is not None:
        cfg["quantization_config"] = qc
    if not with_quant:
        cfg["torch_dtype"] = "float32"
    return cfg


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
        json.dump(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": "<s>",
                "eos_token": "</s>",
                "unk_token": "<unk>",
                "model_max_length": 512,
                "clean_up_tokenization_spaces": False,
            },
            f,
        )
    with open(os.path.join(path, "special_tokens_map.json"), "w") as f:
        json.dump({"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}, f)
