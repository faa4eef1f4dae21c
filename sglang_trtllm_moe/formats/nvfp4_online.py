"""Online NVFP4 (`--quantization nvfp4_online`): BF16 / FP16 / FP8 source experts quantized to NVFP4 as they load,
activations quantized per token at run time.

SGLang's `ModelOptNvFp4OnlineFusedMoEMethod` subclasses ModelOpt's NVFP4 method: its weight loader quantizes each
expert (w1 and w3 together, one global scale per pair) and writes ModelOpt NVFP4 parameters, so the kernel layout,
the row maps and the scale swizzle are ModelOpt NVFP4's (formats/nvfp4.py). What differs:
* activations: per token. SGLang's trtllm leaf quantizes the hidden states with flashinfer
  `nvfp4_quantize(..., per_token_activation=True)` (global scale inverse 1 / (448 * 6)) and hands the kernel the
  per-token FP32 scales as `per_token_scale` (by keyword here); the kernel then re-quantizes GEMM1's output per
  token too. The static input scales are never loaded (SGLang leaves them unfilled) and its prep takes a1 = a2 = 1
  (`use_per_token_activation`), as `NvFp4.compute_scalars` does.
* non-gated (relu2, Nemotron-H): the kernel's per-token non-gated tiles are right only at hidden sizes that are
  multiples of 512 (SGLang's `trtllm_nvfp4_hidden_alignment`: garbage at Nemotron's 2688 on flashinfer 0.7.0.post1;
  SGLang pads hidden to 512 into new tensors from 0.5.22, before it runs unaligned). The plugin prepares in place
  and pads no hidden dimension: it serves non-gated relu2 where hidden % 512 == 0 and refuses other hidden sizes
  with that reason (selection's HIDDEN_ALIGNMENT, and the layer at load). Before SGLang 0.5.18 the online loader
  never writes a non-gated layer (compat/features.py NVFP4_ONLINE_NON_GATED): refused there.
* the weight recipe is release-specific (compat/features.py NVFP4_ONLINE_4OVER6): SGLang 0.5.23 quantizes with
  flashinfer's "4over6" MSE recipe (`quant.nvfp4_quantize_4over6`), earlier releases with the plain one.

Its sibling `NvFp4OnlineTensor` (compat/features.py MODELOPT_FP4_ONLINE, 0.5.18+): `--quantization modelopt_fp4` on a
checkpoint without serialized NVFP4 metadata (BF16; or FP8, dequantized first) builds `_ModelOptFp4OnlineConfig`,
the same online method and weight loader with `use_per_token_activation` False. The weights, the RL updates in the
trainer's dtype and the recipe are nvfp4_online's; the activations are ModelOpt NVFP4's, static per tensor: SGLang's
`create_weights` fills w13_input_scale / w2_input_scale with 1.0 (a BF16 checkpoint has none; an FP8 one's are
dropped: they do not describe the requantized input), its prep reads them as ModelOpt's does (a1 / a2 = their max),
so the kernel gets 1/a1 and SGLang's static quantizer, as for a serialized ModelOpt NVFP4 checkpoint. Gated layers
only (non-gated ones are left to SGLang: no layer test here against its own prep).
"""

from __future__ import annotations

import torch

from ..compat import defer, features
from .base import TRTLLM, TRTLLM_ROUTED, Checkpoint, KernelCall, Layer, Support
from .load_rules import FINITE
from .nvfp4 import NvFp4

#: flashinfer's per-token global scale inverse: 1 / (e4m3 max * e2m1 max)
PER_TOKEN_SCALE_INV = 1.0 / (448.0 * 6.0)


class NvFp4Online(NvFp4):
    name = "nvfp4_online"
    title = "NVFP4 online (nvfp4_online, per-token activations)"
    quantizations = {TRTLLM: frozenset({"nvfp4_online"}), TRTLLM_ROUTED: frozenset({"nvfp4_online"})}
    #: SGLang's own FP4-leaf layers are read as ModelOpt NVFP4 (static activation scales), not as this format
    sglang_leaf = None
    #: relu2 only: Nemotron-H's, the non-gated activation SGLang's online NVFP4 users run
    non_gated_activations = frozenset({"relu2"})
    #: the per-token non-gated kernel's hidden alignment (SGLang's `trtllm_nvfp4_hidden_alignment`)
    NON_GATED_HIDDEN_ALIGN = 512
    upstream_verdicts: tuple[defer.Verdict, ...] = (
        defer.Verdict(
            defer.CPU_ORACLE.releases,
            False,
            "measured: ModelOpt NVFP4's prep (the online method inherits it): a one-expert update re-shuffles the "
            "experts that were not reloaded; the unused static input scales are unfilled memory on 0.5.23 (every "
            "flow differs there)",
        ),
        defer.Verdict(defer.between(features.NVFP4_ONLINE, defer.CPU_ORACLE), False, "read: " + defer.NO_CPU_ORACLE),
        defer.Verdict(
            features.NVFP4_ONLINE.before,
            False,
            "read: upstream lacks it (no --quantization nvfp4_online before 0.5.14)",
        ),
    )
    #: activations quantized per token (SGLang's QuantInfo.use_per_token_activation); False: static per tensor
    per_token = True

    def supports_activation(self, activation: str, gated: bool) -> Support:
        if not gated and not features.NVFP4_ONLINE_NON_GATED.present():
            return False, (
                f"non-gated {activation!r}: nvfp4_online layers without a gate are not loaded by this SGLang "
                "release: its online loader holds each w1 "
                f"for a w3 that a non-gated layer never has, so the experts stay unwritten (fixed in SGLang "
                f"{features.NVFP4_ONLINE_NON_GATED.releases})"
            )
        return super().supports_activation(activation, gated)

    def supports_hidden(self, hidden: int, gated: bool) -> Support:
        if not gated and hidden % self.NON_GATED_HIDDEN_ALIGN:
            return False, (
                f"hidden size {hidden} is not a multiple of {self.NON_GATED_HIDDEN_ALIGN}: the per-token non-gated "
                "NVFP4 kernel is only right at such sizes (SGLang pads hidden to it into new tensors; the plugin "
                "prepares in place and pads no hidden dimension)"
            )
        return super().supports_hidden(hidden, gated)

    def check_layout(self, layer: Layer) -> str | None:
        problem = super().check_layout(layer)
        if problem is None:
            problem = self.supports_hidden(int(layer.w2_weight.shape[1]), self.is_gated(layer))[1]
        return problem

    def describes(self, checkpoint: Checkpoint) -> bool:
        return checkpoint.quantization == "nvfp4_online"

    #: `compute_scalars` refills them with 1.0 at every flush
    recomputed_params = ("w13_input_scale", "w2_input_scale")

    def compute_scalars(self, layer: Layer) -> dict[str, torch.Tensor]:
        """ModelOpt NVFP4's scalars with a1 = a2 = 1 (NvFp4 reads `use_per_token_activation`). The static input
        scales are never loaded online; SGLang 0.5.23 allocates them unfilled (torch.empty: whatever the allocator
        held, so two loads of one checkpoint differ there), 0.5.17 fills them with 1.0: the plugin fills 1.0 on
        every release, so the served bytes are a function of the checkpoint (the weight checker, RL bit-exactness).
        Per tensor, SGLang fills 1.0 itself and reads them (a1 = a2 = 1 too): refilled all the same, since nothing
        of a BF16 checkpoint rewrites them (SGLang's weight checker's reset_tensors would leave them random), and
        `check_layout` hands a layer whose checkpoint did load other values back to SGLang."""
        for name in ("w13_input_scale", "w2_input_scale"):
            getattr(layer, name).data.fill_(1.0)
        return super().compute_scalars(layer)

    # ---- RL updates in the trainer's dtype ------------------------------------------------------------------
    #: the parameters SGLang's online loader quantizes into from a BF16 / FP16 / FP32 source tensor
    SOURCE_PARAMS = ("w13_weight", "w2_weight")
    SOURCE_DTYPES = (torch.bfloat16, torch.float16, torch.float32)

    def converted_by_sglang(self, layer: Layer, param_name: str, loaded: torch.Tensor, expert: int, scope: str) -> bool:
        """A source-dtype expert weight: SGLang's online loader quantizes it (w1 with w3 of the same expert: one
        global scale) and writes the NVFP4 bytes and scales through FusedMoE's loader, where the plugin checks them
        and marks the expert for layout again; the plugin's batched tensor path leaves such writes to it."""
        return param_name in self.SOURCE_PARAMS and loaded.dtype in self.SOURCE_DTYPES

    def converted_shape(self, layer: Layer, param_name: str, loaded: torch.Tensor) -> tuple | None:
        """Two e2m1 codes per byte along K: [rows, K] -> [rows, K / 2] (an odd K keeps its shape: refused)."""
        if loaded.dim() != 2 or loaded.shape[-1] % 2:
            return tuple(loaded.shape)
        return (int(loaded.shape[0]), int(loaded.shape[1]) // 2)

    #: a disk update's source weights are read from the files and checked before SGLang loads anything: an inf would
    #: not show in the NVFP4 bytes (SGLang's amax takes nan_to_num first), a NaN only after SGLang wrote it
    source_values = FINITE
    #: SGLang's online loader quantizes w1 with w3 (one global scale) and holds the first half of a pair until the
    #: second arrives: a checkpoint with one half of an expert would leave it unwritten, and held into later updates
    pairs_sources = True

    def source_problem(self, layer: Layer, param_name: str, loaded: torch.Tensor) -> str | None:
        """NaN / inf in a source weight would become NaN global and block scales (amax-derived): refused. One
        device read per tensor."""
        bad = int((~torch.isfinite(loaded)).sum())
        if bad:
            return f"{bad} non-finite value(s) (NaN / inf) in the {loaded.dtype} source weight"
        return None

    #: the releases with SGLang's path for this format, and what a refusal elsewhere says that path is
    upstream = features.NVFP4_ONLINE
    upstream_path = "--quantization nvfp4_online exists"

    def supports_backend(self, backend: str, checkpoint: Checkpoint) -> Support:
        if self.serves(backend, checkpoint) and not self.upstream.present():
            return False, f"no: upstream lacks it ({self.upstream_path} in SGLang {self.upstream.releases} only)"
        return super().supports_backend(backend, checkpoint)

    def activation_args(self, call: KernelCall) -> dict:
        """Per-token NVFP4 activations, as SGLang's trtllm leaf makes them: linear e4m3 block scales and the
        per-token FP32 scales, handed over by keyword (`per_token_scale`; flashinfer#2906 moves
        `hidden_states_scale` in the positional order). Static per-tensor activations: ModelOpt NVFP4's."""
        if not self.per_token:
            return super().activation_args(call)
        if call.on_kernel:
            from flashinfer import SfLayout, nvfp4_quantize

            inv = torch.full((1,), PER_TOKEN_SCALE_INV, dtype=torch.float32, device=call.hidden.device)
            hs, hs_sf, pts = nvfp4_quantize(
                call.hidden, inv, sfLayout=SfLayout.layout_linear, per_token_activation=True, backend="cute-dsl"
            )
        else:
            from ..quant import nvfp4_quantize_per_token

            hs, hs_sf, pts = nvfp4_quantize_per_token(call.hidden, PER_TOKEN_SCALE_INV)
        t, h = call.hidden.shape
        return dict(
            hidden_states=hs.view(torch.uint8).reshape(t, h // 2),
            hidden_states_scale=hs_sf.view(torch.float8_e4m3fn).reshape(t, h // 16),
            per_token_scale=pts.reshape(t).to(torch.float32),
        )


NVFP4_ONLINE = NvFp4Online()


class NvFp4OnlineTensor(NvFp4Online):
    name = "nvfp4_online_tensor"
    title = "NVFP4 online, per-tensor activations (modelopt_fp4 on a BF16 / FP8 checkpoint)"
    quantizations = {TRTLLM: frozenset({"modelopt_fp4"}), TRTLLM_ROUTED: frozenset({"modelopt_fp4"})}
    per_token = False
    upstream = features.MODELOPT_FP4_ONLINE
    upstream_path = "--quantization modelopt_fp4 quantizes a checkpoint without NVFP4 metadata online"
    #: an FP8 checkpoint too (SGLang's make_modelopt_fp4_online_config_from_fp8, 0.5.18+): dequantized, then quantized
    online_sources = frozenset({"fp8"})
    upstream_verdicts = (
        defer.Verdict(
            features.MODELOPT_FP4_ONLINE.releases,
            False,
            "read: nvfp4_online's method and ModelOpt NVFP4's prep (measured for nvfp4_online above: a one-expert "
            "update re-shuffles the experts that were not reloaded); only the activation scales differ",
        ),
        defer.Verdict(
            features.MODELOPT_FP4_ONLINE.before,
            False,
            "read: upstream lacks it (modelopt_fp4 needs serialized NVFP4 metadata before 0.5.18)",
        ),
    )

    def describes(self, checkpoint: Checkpoint) -> bool:
        return checkpoint.quantization == "modelopt_fp4" and checkpoint.online

    def supports_activation(self, activation: str, gated: bool) -> Support:
        if not gated:
            return False, (
                f"non-gated {activation!r}: online per-tensor NVFP4 layers are prepared by the plugin for gated "
                "activations only (no non-gated layer of this kind is tested against SGLang's own preparation); "
                "SGLang prepares such a layer itself"
            )
        return super().supports_activation(activation, gated)

    def check_layout(self, layer: Layer) -> str | None:
        """The online loader also loads `*input_scale` tensors a source checkpoint carries (an FP8 source's are
        dropped); SGLang would quantize the activations with them. The plugin serves the default 1.0 only (what
        `compute_scalars` refills): a layer loaded with other values is SGLang's. One host read, at first prep."""
        problem = super().check_layout(layer)
        if problem:
            return problem
        for name in ("w13_input_scale", "w2_input_scale"):
            if not bool((getattr(layer, name).data == 1.0).all()):
                return (
                    f"its checkpoint loaded static activation scales ({name} other than SGLang's default 1.0), "
                    "which the plugin does not serve for online per-tensor NVFP4"
                )
        return None


NVFP4_ONLINE_TENSOR = NvFp4OnlineTensor()
