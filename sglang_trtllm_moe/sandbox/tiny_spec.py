"""What a tiny checkpoint holds: its architecture, its layer kinds, and the names and shapes of its tensors as the
released checkpoints spell them. One place for them: the weights (checkpoints.py) and the configs
(checkpoint_configs.py) both read them from here.

Which quants there are, the architectures each is built for and how an online one is served are the sandbox's
per-format table (format_examples.py `TINY`), derived here: a format whose checkpoint is stored in a
quant the sandbox already writes edits nothing in the sandbox; a new stored encoding adds its writers to
checkpoints.py (the tensors) and checkpoint_configs.py (config.json)."""

from __future__ import annotations

from dataclasses import dataclass, replace

from ..formats import FORMATS, WeightFormat
from .format_examples import TinyCheckpoint, example_of, tiny_of

ARCHS = ("qwen3_moe", "deepseek_v3", "nemotron_h", "mixtral")


def _served_as(fmt: WeightFormat) -> str:
    """The `--quantization` an online format's checkpoint is served with: the one SGLang quantization it serves."""
    names = {q for qs in fmt.quantizations.values() for q in qs}
    if len(names) != 1 or None in names:
        raise AssertionError(f"{fmt.name}: an online tiny checkpoint needs one --quantization, it serves {names}")
    return str(names.pop())


#: every format's tiny checkpoint (format_examples.TINY), in registry order
_TINY: tuple[tuple[WeightFormat, TinyCheckpoint], ...] = tuple(
    (f, t) for f in FORMATS if isinstance(t := tiny_of(f), TinyCheckpoint)
)

#: the quants: those written in their own encoding (the writers of checkpoints.py / checkpoint_configs.py), then those
#: served online, each in registry order
QUANTS = tuple(t.quant for _, t in _TINY if t.stored is None) + tuple(t.quant for _, t in _TINY if t.stored)

#: quants served with a `--quantization` of their own: the checkpoint holds the experts in another quant (its
#: tensors and config.json are that quant's), the server quantizes them as they load (its `TinyCheckpoint.stored`
#: and its one SGLang quantization). E.g. nvfp4_online: a plain BF16 checkpoint served with `--quantization
#: nvfp4_online`; nvfp4_online_tensor: the same checkpoint served with `--quantization modelopt_fp4`
ONLINE = {t.quant: (t.stored, _served_as(f)) for f, t in _TINY if t.stored}

#: the MoE intermediate size of each quant's tiny models (its format's `Example.intermediate`: 128, or what its
#: kernel's layout needs)
MOE_INTERMEDIATE = {t.quant: example_of(f).intermediate for f, t in _TINY}

#: (arch, quant) pairs SGLang builds with FusedMoE layers (each format's `TinyCheckpoint.archs`). Quantized Mixtral
#: other than `fp8` / compressed-tensors is built as QuantMixtralForCausalLM (model_loader/utils.py: per-expert linear
#: layers, no FusedMoE); DeepSeek block FP8 is the only block recipe here.
SUPPORTED = {arch: tuple(q for q in QUANTS for _, t in _TINY if t.quant == q and arch in t.archs) for arch in ARCHS}


def _check() -> None:
    """One quant per name; an online one stored in a quant the sandbox writes; architectures the sandbox has."""
    if len(set(QUANTS)) != len(QUANTS):
        raise AssertionError(f"two formats declare one tiny quant: {QUANTS}")
    for f, t in _TINY:
        if t.stored is not None and (t.stored in ONLINE or t.stored not in QUANTS):
            raise AssertionError(f"{f.name}: tiny checkpoint stored as {t.stored!r}, not a quant the sandbox writes")
        if not t.archs or not set(t.archs) <= set(ARCHS):
            raise AssertionError(f"{f.name}: tiny checkpoint architectures {t.archs}: a non-empty subset of {ARCHS}")


_check()


def quants_help() -> str:
    """`tiny-checkpoint --quant`'s help: every quant, an online one with what it is stored as and served with."""
    return " | ".join(
        f"{q} (a {ONLINE[q][0]} checkpoint, to serve with --quantization {ONLINE[q][1]})" if q in ONLINE else q
        for q in QUANTS
    )


GATE, UP, DOWN = "gate", "up", "down"


@dataclass(frozen=True)
class TinySpec:
    arch: str = "qwen3_moe"
    quant: str = "nvfp4"
    seed: int = 0
    hidden: int = 256
    #: 0: the quant's own (`MOE_INTERMEDIATE`: 128, or what its kernel's layout needs)
    moe_intermediate: int = 0
    dense_intermediate: int = 256
    num_experts: int = 8
    top_k: int = 2
    vocab: int = 512
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 64
    #: DeepSeek MLA: the compressed KV width. 128 by default; 256 where SGLang's triton MLA decode runs (a GPU): its
    #: kernel handles a latent + rope width of 576 or 288 only (sglang/kernels/ops/attention/decode_attention.py)
    kv_lora: int = 128
    #: layer kinds: "moe", "dense" (MLP), "attn" (Nemotron-H attention-only block)
    #: (empty: the arch's default stack, set in __post_init__)
    layers: tuple[str, ...] = ()

    def __post_init__(self):
        if self.arch not in ARCHS:
            raise ValueError(f"arch {self.arch!r}: one of {ARCHS}")
        if self.quant not in QUANTS:
            raise ValueError(f"quant {self.quant!r}: one of {QUANTS}")
        if not self.moe_intermediate:
            object.__setattr__(self, "moe_intermediate", MOE_INTERMEDIATE[self.quant])
        if not self.layers:
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
    def stored(self) -> str:
        """The quant the checkpoint's tensors and config.json are written in (an online quant's source)."""
        return ONLINE[self.quant][0] if self.quant in ONLINE else self.quant

    @property
    def quantization(self) -> str | None:
        """The `--quantization` to serve the checkpoint with (None: SGLang reads it from config.json)."""
        return ONLINE[self.quant][1] if self.quant in ONLINE else None

    def server_args(self) -> dict:
        """What a server / Engine / ModelRunner of this checkpoint is started with besides the harness's flags."""
        return {} if self.quantization is None else {"quantization": self.quantization}

    @property
    def moe_layers(self) -> list[int]:
        return [i for i, k in enumerate(self.layers) if k == "moe"]

    @property
    def supported(self) -> bool:
        return self.quant in SUPPORTED[self.arch]

    def with_seed(self, seed: int) -> TinySpec:
        return replace(self, seed=seed)


# ---- names ------------------------------------------------------------------------------------------------------

# DeepSeek MLA sizes (tiny, kernel-aligned; the KV LoRA width is the spec's `kv_lora`)
Q_LORA, QK_NOPE, QK_ROPE, V_HEAD = 128, 64, 32, 64


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
            f"{a}.kv_a_proj_with_mqa.weight": (spec.kv_lora + QK_ROPE, h),
            f"{a}.kv_a_layernorm.weight": (spec.kv_lora,),
            f"{a}.kv_b_proj.weight": (nh * (QK_NOPE + V_HEAD), spec.kv_lora),
            f"{a}.o_proj.weight": (h, nh * V_HEAD),
        }
    a = f"{p}.mixer" if spec.arch == "nemotron_h" else f"{p}.self_attn"
    out: dict[str, tuple[int, ...]] = {
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
            for proj, shape in (
                ("gate_proj", (spec.dense_intermediate, h)),
                ("up_proj", (spec.dense_intermediate, h)),
                ("down_proj", (h, spec.dense_intermediate)),
            ):
                out[f"{p}.mlp.{proj}.weight"] = shape
            continue
        m = moe_prefix(spec, i)
        out[f"{m}.gate.weight"] = (spec.num_experts, h)
        if spec.arch == "deepseek_v3":
            out[f"{m}.gate.e_score_correction_bias"] = (spec.num_experts,)
            for proj, shape in (
                ("gate_proj", (spec.moe_intermediate, h)),
                ("up_proj", (spec.moe_intermediate, h)),
                ("down_proj", (h, spec.moe_intermediate)),
            ):
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
