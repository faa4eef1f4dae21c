"""What every weight format shares, and what each one MUST and MAY declare.

A format is the one place for everything the plugin knows about a weight format: what it serves (the quantization
names SGLang gives such checkpoints, per runner backend; activations per gating; alignment), how its parameters are
laid out for the kernel and prepared in place per expert (with exact inverses), its kernel scalars, the arguments of
its kernel family, and how the checker dequantizes it. Selection, explain, the hooks and the runner derive from the
registry (`formats/__init__.py`); no format name appears outside `formats/`.

Parameters of one `group` ("w13" or "w2") share a row map and are prepared / un-prepared together for an expert:
the gated row interleave mixes the w1 and w3 halves, so a loader writing one half of one expert must first return
the whole group of that expert to checkpoint layout. Scalars are recomputed from the parameters after every flush.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from .. import layouts
from .dequant import grid_dequantize
from .load_rules import BLOCK_SCALE, INPUT_SCALE, POSITIVE, TENSOR_SCALE, WEIGHT, LoadRule

#: the runner backends the formats serve (SGLang's --moe-runner-backend names)
TRTLLM = "flashinfer_trtllm"
TRTLLM_ROUTED = "flashinfer_trtllm_routed"
BACKENDS = (TRTLLM, TRTLLM_ROUTED)

#: an SGLang FusedMoE layer (or a stand-in with its attributes); SGLang ships no type information
Layer = Any


#: a named predicate's answer (vLLM's fused-MoE oracle convention, `_supports_*` -> (ok, reason)): (True, None) when
#: the kernel serves it, else (False, the sentence users see in `explain`, the resolution log and load-time errors)
Support = tuple[bool, "str | None"]
SUPPORTED: Support = (True, None)


@dataclass(frozen=True)
class ParamLayout:
    name: str
    #: "w13" | "w2": which row map (and which group of prepared state)
    group: str
    #: 128x4 scale-factor swizzle after the row permutation (NVFP4 / MXFP8 block scales)
    sf_swizzle: bool = False
    #: BlockMajorK after the row permutation (BF16), in place: shape stays [E, M, K]
    block_major_k: bool = False
    #: some formats (DeepSeek FP8 block) keep checkpoint row order
    permute_rows: bool = True
    # ---- what a weight update may write into it (validation.py; "" / () / None = derived, see LoadRule) -----
    #: WEIGHT | BLOCK_SCALE; "" = BLOCK_SCALE when `sf_swizzle` or "scale" is in the name, else WEIGHT
    kind: str = ""
    #: dtypes a loaded tensor may have besides the derived ones (e.g. float32 block scales SGLang's loader
    #: converts into 1-byte e8m0 storage)
    load_dtypes: tuple = ()
    #: POSITIVE | NONNEGATIVE | None: the rule for float values written into it; None = derived (NONNEGATIVE for
    #: block scales)
    values: str | None = None
    #: E4M3_BYTES | UE8M0_BYTES | None: how 1-byte block scales are encoded; None = derived from the storage dtype
    #: (float8_e4m3fn, float8_e8m0fnu); uint8 scale storage declares it (MXFP8, gpt-oss: UE8M0 bytes)
    byte_code: str | None = None


@dataclass(frozen=True)
class Checkpoint:
    """What a model's config says about its MoE weights, as SGLang names it (selection/hf_config.py reads it)."""

    #: SGLang's quantization name (modelopt_fp4, modelopt_fp8, fp8, compressed-tensors, ...); None = unquantized
    quantization: str | None = None
    #: fp8: the checkpoint's weight_block_size, e.g. (128, 128); None = per-tensor
    weight_block_size: tuple[int, ...] | None = None
    #: compressed-tensors: the scheme ("nvfp4", "w8a8_fp8", "int4", ...)
    quant_scheme: str | None = None
    #: fp8: "static" | "dynamic" activation scales (None = not said)
    activation_scheme: str | None = None
    #: fp8: the routed experts are MXFP4 (SGLang's ModelConfig.is_fp4_experts: DeepSeek-V4, MiMo-V2, Bailing-V3)
    fp4_experts: bool = False
    #: `--quantization X` on a checkpoint without a quantization_config: SGLang quantizes at load time
    online: bool = False


@dataclass
class KernelCall:
    """One call of SGLang's fused MoE leaf for a layer: what a format needs to build its kernel arguments."""

    layer: Any
    #: SGLang's QuantInfo for the layer (the fields SGLang's own leaf reads)
    quant_info: Any
    runner_config: Any
    #: the layer's input activations (bf16)
    hidden: torch.Tensor
    #: True for flashinfer's kernels (SGLang's CUDA quantizers), False for the emulator (pure-torch quantizers)
    on_kernel: bool
    #: activation scales when the dispatcher already quantized `hidden` (a2a pre-quantized input), else None
    hidden_scale: Any = None


class WeightFormat:
    """Base of every format. Subclasses MUST define:

    * `name` (unique), `params` (a ParamLayout per laid-out parameter);
    * `kernel` — the flashinfer kernel family (`kernel_api.FAMILIES`) and `kernel_args(call, routing, routed)`;
    * `quantizations` — {runner backend: SGLang quantization names} this format serves, and `describes(checkpoint)`;
    * `gated_activations` / `non_gated_activations` — what the kernel family computes for this format on every
      flashinfer the supported releases pin (checked against SGLang's runner sets and `kernel_api`);
    * `intermediate_align` — (gated, non-gated) per-rank intermediate alignment as SGLang allocates the layer.

    What the kernel serves is asked through named predicates, each `(ok, reason)` (`Support`): `supports_backend`,
    `supports_activation`, `supports_hidden`, `supports_intermediate` (the checkpoint's sizes: selection asks them
    all, each under its reason code) and `check_layout` (the layer as SGLang allocated it: asked at load; it asks
    `supports_activation` of the layer's runner config first). A format overrides the predicate whose rule differs.

    MAY define: `hidden_align` (default 128), `scalar_params` + `compute_scalars` (kernel scalars recomputed at every
    flush), `check_layout` (extra shape rules; call super), `supports_*` (see above), `row_map` (a format-specific
    half order), `dequantize_param` / `scale_of` (the checker), `routing_method` (where the layer's routing method is
    kept), what a weight update may write (`ParamLayout.kind / load_dtypes / values`, `scalar_rules`, and
    `converted_by_sglang` for writes SGLang's loader converts itself; see `LoadRule`), `fused` (all experts are
    written at once: gpt-oss) with `fused_checkpoint_names`, `own_backend` (the non-trtllm runner backend SGLang
    serves the format on, e.g. flashinfer_mxfp4: reported by selection, never auto-selected),
    `accepts_prequantized` (activations quantized by the dispatcher reach `kernel_args` as
    `KernelCall.hidden_scale`), `sglang_leaf` (SGLang's own prepared layers of that leaf are this layout),
    `batched_where_sglang_prepares` (batched expert writes into the layers SGLang prepares itself)."""

    # name, title and quantizations are plain attributes, not ClassVars: one class may serve several formats, set
    # per instance (Fp8PerTensor)
    name: str = "base"
    params: ClassVar[tuple[ParamLayout, ...]] = ()
    #: parameters whose writes only change scalars (recomputed at every flush)
    scalar_params: ClassVar[tuple[str, ...]] = ()
    #: LoadRule overrides for `scalar_params` (default: group from the "w13_"/"w2_" prefix, INPUT_SCALE when
    #: "input" is in the name else TENSOR_SCALE, values POSITIVE)
    scalar_rules: ClassVar[Mapping[str, LoadRule]] = {}
    kernel: ClassVar[str] = ""
    quantizations: Mapping[str, frozenset] = {}
    gated_activations: ClassVar[frozenset[str]] = frozenset()
    non_gated_activations: ClassVar[frozenset[str]] = frozenset()
    intermediate_align: ClassVar[tuple[int, int]] = (128, 128)
    #: w2's rows are the hidden dim and go through the same 128-row scale/shuffle tiling
    hidden_align: ClassVar[int] = 128
    #: a sentence naming the format in reports ("NVFP4 (modelopt_fp4)")
    title: str = ""
    #: why the activation sets are what they are, added to a refusal (e.g. a kernel that only implements SwiGLU)
    activation_note: ClassVar[str] = ""
    #: the runner may hand `kernel_args` activations the dispatcher already quantized (KernelCall.hidden_scale)
    accepts_prequantized: ClassVar[bool] = False
    #: the loader writes all experts of a parameter at once (gpt-oss: `expert_id=None`); a "partial" update is a
    #: whole-group write, validated and un-prepared in the FusedMoE.weight_loader hook
    fused: ClassVar[bool] = False
    #: `fused` formats: the checkpoint's names of all-expert tensors below the MoE layer -> the parameter SGLang's
    #: model loader writes them into (so a whole request's check finds them)
    fused_checkpoint_names: ClassVar[Mapping[str, str]] = {}
    #: the runner backend SGLang serves this format on when it is not flashinfer_trtllm(_routed) (e.g.
    #: "flashinfer_mxfp4"); selection reports it, never auto-switches to it
    own_backend: ClassVar[str | None] = None
    #: SGLang's fused-MoE leaf ("fp4" | "fp8" | "bf16") on which a layer SGLang prepared itself holds exactly this
    #: format's kernel layout, so the emulator can run it as this format (`formats.sglang_prepared`); None = no leaf
    #: of SGLang's own preparation is read as this format (FP8 layers SGLang prepares are MXFP8 or its own
    #: requantized per-tensor layout: they stay on SGLang's leaf)
    sglang_leaf: ClassVar[str | None] = None
    #: where SGLang prepares this format itself (compat/defer.py), a layer keeps the loaded layout and SGLang's loader
    #: does nothing but write the bytes: a validated bucket's expert tensors may then be written batched
    #: (batched_writes.py) into such a layer too. False: SGLang's per-tensor loader writes them (its own restore
    #: before a load, e.g. BF16's whole-layer un-block on 0.5.23, stays SGLang's)
    batched_where_sglang_prepares: ClassVar[bool] = False

    def __repr__(self) -> str:
        return f"<weight format {self.name}>"

    # ---- what it serves ---------------------------------------------------------------------------------------
    def describes(self, checkpoint: Checkpoint) -> bool:
        """True when a checkpoint of this kind is held in this format on the TRT-LLM-Gen path."""
        return False

    def refusal(self, checkpoint: Checkpoint) -> str | None:
        """Why a checkpoint of this format's quantization that the format does not describe is not prepared (a
        variant of it the kernels or SGLang's path do not serve), or None when the checkpoint is not this format's
        to refuse. `formats.for_checkpoint` asks it when no format describes the checkpoint."""
        return None

    def serves(self, backend: str, checkpoint: Checkpoint) -> bool:
        return checkpoint.quantization in self.quantizations.get(backend, ())

    def activations(self, gated: bool) -> frozenset[str]:
        return self.gated_activations if gated else self.non_gated_activations

    # ---- eligibility: named predicates, each -> (ok, reason) ---------------------------------------------------
    # One set per format, read by selection (selection/rules.py, offline: the checkpoint's sizes, per rank) and by
    # the load-time `check_layout` (SGLang's allocation of the layer: `supports_activation` on its runner config, then
    # its storage, whose sizes SGLang may already have padded).
    def supports_backend(self, backend: str, checkpoint: Checkpoint) -> Support:
        """SGLang has a path for this format's checkpoints on runner `backend` that the plugin prepares."""
        if self.serves(backend, checkpoint):
            return SUPPORTED
        where = (
            f"; SGLang serves it on {self.own_backend} (TRT-LLM-Gen kernels too), where the plugin prepares it in place"
            if self.own_backend
            else ""
        )
        return False, f"{backend} has no {self.title} path in SGLang{where}"

    def supports_activation(self, activation: str, gated: bool) -> Support:
        """The kernel computes (activation, gating) for this format on every flashinfer the releases pin."""
        allowed = self.activations(gated)
        if activation in allowed:
            return SUPPORTED
        kind = "gated" if gated else "non-gated"
        note = f"; {self.activation_note}" if self.activation_note else ""
        return False, (
            f"{kind} {activation!r} is not computed by the TRT-LLM-Gen {self.title or self.name} kernel "
            f"(supported {kind}: {sorted(allowed) or 'none'}{note})"
        )

    def supports_hidden(self, hidden: int) -> Support:
        """The checkpoint's hidden size fits the kernel's tiling (`hidden_align`)."""
        if hidden % self.hidden_align:
            return False, f"hidden size {hidden} is not a multiple of {self.hidden_align}"
        return SUPPORTED

    def supports_intermediate(self, per_rank: int, gated: bool) -> Support:
        """The checkpoint's per-rank intermediate can be served: by default SGLang's allocation pads it to
        `intermediate_align` (`padded_intermediate`); a format whose scale blocks cannot be padded overrides this."""
        return SUPPORTED

    def activation_problem(self, activation: str, gated: bool) -> str | None:
        """None when the kernel computes (activation, gating) for this format, else the sentence saying why not
        (`supports_activation`'s reason)."""
        return self.supports_activation(activation, gated)[1]

    def padded_intermediate(self, per_rank: int, gated: bool) -> int:
        """The per-rank intermediate as SGLang allocates this format's layer (per half for gated w13): rounded up to
        the format's `intermediate_align` — a multiple of the kernel's own tiling (`layouts.padded_intermediate`)."""
        return layouts.padded_intermediate(per_rank, gated, align=self.intermediate_align[0 if gated else 1])

    # ---- geometry -------------------------------------------------------------------------------------------
    @staticmethod
    def is_gated(layer: Layer) -> bool:
        return bool(layer.moe_runner_config.is_gated)

    def groups(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(p.group for p in self.params))

    def group_of(self, param_name: str) -> str | None:
        for p in self.params:
            if p.name == param_name:
                return p.group
        return None

    def load_rule(self, param_name: str) -> LoadRule | None:
        """The rule for writes into `param_name`, or None when the format does not manage it (cached)."""
        rules = self.__dict__.get("_load_rules")
        if rules is None:
            rules = {}
            for p in self.params:
                kind = p.kind or (BLOCK_SCALE if (p.sf_swizzle or "scale" in p.name) else WEIGHT)
                rules[p.name] = LoadRule(p.name, p.group, kind, tuple(p.load_dtypes), p.values, p.byte_code)
            for n in self.scalar_params:
                rules[n] = self.scalar_rules.get(n) or LoadRule(
                    n,
                    "w2" if n.startswith("w2") else "w13",
                    INPUT_SCALE if "input" in n else TENSOR_SCALE,
                    values=POSITIVE,
                )
            self.__dict__["_load_rules"] = rules
        return rules.get(param_name)

    def converted_by_sglang(self, layer: Layer, param_name: str, loaded: torch.Tensor, expert: int, scope: str) -> bool:
        """True when SGLang's loader converts this write itself before storing it (its own dtypes and shapes, e.g. a
        fused FP8 shared expert requantized into FP4-expert storage): validation checks only the shard and expert id.
        `scope`: "global" (a checkpoint expert id) or "local"."""
        return False

    def converted_shape(self, layer: Layer, param_name: str, loaded: torch.Tensor) -> tuple | None:
        """For a write `converted_by_sglang`: the shape SGLang's conversion stores (checked like a direct write of
        the parameter's dtype), or None (only the ids are checked)."""
        return None

    def source_problem(self, layer: Layer, param_name: str, loaded: torch.Tensor) -> str | None:
        """For a write `converted_by_sglang` on a real device: why its values cannot be converted, or None."""
        return None

    #: True when SGLang converts a gated expert's w1 and w3 source writes together (one scale per pair) and holds a
    #: half until its partner arrives: a disk update's checkpoint must hold both halves of every such expert it holds
    pairs_sources: bool = False
    #: the value rule (load_rules.VALUE_RULES) of a write `converted_by_sglang` whose values are read later (a disk
    #: update's checkpoint, from its files before SGLang loads anything), or None: not value-checked there
    source_values: str | None = None

    def row_map(self, layer: Layer, p: ParamLayout, t: torch.Tensor) -> torch.Tensor:
        m = t.shape[1]
        if p.group == "w13":
            return layouts.w13_row_map(m, self.is_gated(layer), device=t.device)
        return layouts.w2_row_map(m, device=t.device)

    # ---- how a parameter is seen --------------------------------------------------------------------------------
    def tensor(self, layer: Layer, p: ParamLayout) -> torch.Tensor:
        """Parameter `p`'s storage as the layout machinery works on it, [experts, rows, cols] (MAY be overridden
        where the release shows the prepared parameter in another shape: BF16's 4-D block layout)."""
        return getattr(layer, p.name).data

    def prepared_at_attach(self, layer: Layer, group: str) -> bool:
        """True when `group` already holds kernel layout when the plugin first sees the layer (SGLang prepared it)."""
        return False

    def on_layout(self, layer: Layer, group: str, all_prepared: bool) -> None:
        """After `group`'s layout state changed: give its Parameters the shape this release shows for that state
        (same storage; only a view changes). Default: shapes never change."""

    def check_layout(self, layer: Layer) -> str | None:
        """None when every parameter can be laid out in place and the kernel computes the layer's activation;
        else a sentence naming the problem. Reads everything a flush will read first: an object that lacks any of
        it raises (AttributeError) — the caller hands such a layer back to SGLang, it is not a kernel limitation."""
        cfg = layer.moe_runner_config
        activation, gated = cfg.activation, bool(cfg.is_gated)
        for name in (*(p.name for p in self.params), *self.scalar_params):
            getattr(layer, name)
        ok, problem = self.supports_activation(activation, gated)
        if not ok:
            return problem
        for p in self.params:
            if getattr(layer, p.name) is None:
                return f"parameter {p.name} is not allocated on this layer"
            t = self.tensor(layer, p)
            if t.dim() != 3:
                return f"{p.name} has shape {tuple(t.shape)}, expected [experts, rows, cols]"
            m = t.shape[1]
            if p.permute_rows and m % 32:
                return (
                    f"{p.name} has {m} rows; the kernel's row shuffle needs a multiple of 32 (pad the intermediate "
                    "size)"
                )
            if p.sf_swizzle and (m % layouts.SF_ROW_TILE or t.shape[2] % layouts.SF_COL_TILE):
                return (
                    f"{p.name} is {tuple(t.shape)}; the 128x4 scale layout needs rows % 128 == 0 and cols % 4 == 0 "
                    "to be prepared in place (allocate the scales padded)"
                )
        return None

    # ---- layout, per group and experts ----------------------------------------------------------------------
    def prepare_(self, layer: Layer, group: str, experts: Sequence[int]) -> None:
        for p in self.params:
            if p.group != group:
                continue
            t = self.tensor(layer, p)
            rmap = self.row_map(layer, p, t) if p.permute_rows else None
            if p.sf_swizzle:
                if rmap is None:
                    layouts.swizzle_sf_128x4_(t, experts=experts)
                else:
                    layouts.permute_rows_and_swizzle_sf_(t, rmap, experts=experts)
            elif p.block_major_k:
                if rmap is None:
                    layouts.to_block_major_k_(t, experts=experts)
                else:
                    layouts.permute_rows_to_block_major_k_(t, rmap, experts=experts)
            elif rmap is not None:
                layouts.permute_rows_(t, rmap, experts=experts)

    def unprepare_(self, layer: Layer, group: str, experts: Sequence[int]) -> None:
        for p in self.params:
            if p.group != group:
                continue
            t = self.tensor(layer, p)
            if p.sf_swizzle and p.permute_rows:
                layouts.unswizzle_sf_and_unpermute_rows_(t, self.row_map(layer, p, t), experts=experts)
                continue
            if p.sf_swizzle:
                layouts.unswizzle_sf_128x4_(t, experts=experts)
            elif p.block_major_k:
                layouts.from_block_major_k_(t, experts=experts)
            if p.permute_rows:
                layouts.unpermute_rows_(t, self.row_map(layer, p, t), experts=experts)

    # ---- weight checker -------------------------------------------------------------------------------------
    def scale_of(self, name: str) -> str | None:
        """The laid-out parameter holding `name`'s block scales (a `*scale*` parameter of its group), if any.

        The checker compares a weight and its block scales as one entry: a weight alone has no value, and
        SGLang's checker likewise consumes `*_weight_scale_inv` into its weight's comparison. Matches
        w13_weight -> w13_weight_scale(_inv), and compressed-tensors' w13_weight_packed -> w13_weight_scale."""
        if "scale" in name:
            return None
        group = self.group_of(name)
        cands = [p.name for p in self.params if p.group == group and p.name != name and "scale" in p.name]

        def common(a: str) -> int:
            return len(os.path.commonprefix([a, name]))

        return max(cands, key=common) if cands else None

    def dequant_scales(self, layer: Layer) -> dict[str, torch.Tensor]:
        """The per-tensor / global dequantization scales of the layer's checkpoint projections — "w1" (gate_proj),
        "w3" (up_proj), "w2" (down_proj) — one float32 per local expert: what multiplies `dequantize_param`'s values
        (block-scale units) to give the weight's values, as flashinfer's CPU dequantizer applies it ((value * block
        scale) * dequant scale). {} where the block scales are all there is (BF16, DeepSeek FP8 block, MX formats).
        Read by the weight checker's checksum (`checker.TrtllmMoeComparable.dequantize`)."""
        return {}

    def dequantize_param(
        self, name: str, weight: torch.Tensor, scale: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Checkpoint-layout `[E, M, K]` (+ its block scales) -> (float32 values, float32 per-element tolerance).

        The tolerance is one step of the quantization grid at each value (SGLang's `_quant_ulp` rule), so two
        quantizations of the same weight that differ by rounding stay within tolerance of each other. Values are in
        block-scale units: per-tensor / global scales are scalar parameters, compared bit for bit on their own.
        Default: a dense weight (BF16, FP8 per-tensor), or float block scales that tile the weight (DeepSeek FP8).
        """
        return grid_dequantize(weight, scale)

    # ---- scalars --------------------------------------------------------------------------------------------
    def compute_scalars(self, layer: Layer) -> dict[str, torch.Tensor]:
        return {}

    # ---- the kernel -------------------------------------------------------------------------------------------
    def routes_in_kernel(self, call: KernelCall) -> bool:
        """True when SGLang's own call of this format routes bypassed logits in the kernel whatever the layer
        declares (gpt-oss: Renormalize); False: the runner asks the layer (runner.routing_declared)."""
        return False

    def routing_method(self, call: KernelCall) -> int | None:
        """The layer's routing method (SGLang's QuantInfo carries it for the quantized leaves)."""
        return call.quant_info.routing_method_type

    def kernel_args(self, call: KernelCall, routing: dict, routed: bool) -> dict:
        """Every argument of `trtllm_<kernel>[_routed]_moe` except `activation_type` and `do_finalize` (the runner's),
        given the routing arguments (which a format may adjust)."""
        raise NotImplementedError(f"format {self.name} has no kernel arguments")


def set_scalar_(layer: Layer, name: str, value: torch.Tensor) -> None:
    """Create a kernel scalar once, then update it in place forever after (storage-stable for CUDA graphs)."""
    value = value.detach()
    cur = getattr(layer, name, None)
    if isinstance(cur, torch.Tensor) and cur.shape == value.shape and cur.dtype == value.dtype:
        cur.data.copy_(value)
        return
    if cur is not None and isinstance(cur, torch.Tensor):
        raise RuntimeError(
            f"{name} changed shape/dtype from {tuple(cur.shape)}/{cur.dtype} to {tuple(value.shape)}/{value.dtype}; "
            "a kernel scalar must keep its storage"
        )
    layer.register_parameter(name, torch.nn.Parameter(value.clone().contiguous(), requires_grad=False))
