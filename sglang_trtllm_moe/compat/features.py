"""Every difference between SGLang releases that the plugin acts on: one named flag each, its range, and why.

Code asks a flag (`features.NVFP4_W13_SCALE_2_UP_GATE.present()`) instead of comparing versions or probing for an
attribute, so a new release is a matter of widening or closing ranges here (docs/ARCHITECTURE.md, "add an SGLang
release"), and `tests/test_compat_features.py` checks each flag against the installed SGLang's code.
A hook target names its range through a flag here (`releases=features.X.releases`) or carries none (it exists on
every release the plugin runs on); release-range literals live in compat/ only (tests/test_house_rules.py, which
lists the files still pending). This module holds the facts that decide where a hook applies and what the
product must do once it runs (hooks, `explain`'s faked platform). What only the CPU sandbox or the test fixtures
need to know (how a process is stood up on each release) is named the same way apart from the product's flags:
sandbox/releases.py (the sandbox's), tests/support/releases.py (the test fixtures').
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

from packaging.specifiers import SpecifierSet
from packaging.version import Version

from .releases import installed_version


@cache
def _running() -> Version | None:
    v = installed_version()
    return None if v is None else Version(v.base_version)


@dataclass(frozen=True)
class Feature:
    #: PEP 440 specifier on the SGLang release (".post" and dev builds count as their base release)
    releases: str
    #: one line: what differs and why the plugin cares
    why: str

    def present(self, release: Version | str | None = None) -> bool:
        """On `release` (default: the installed SGLang; False when none is installed)."""
        if release is None:
            release = _running()
            if release is None:
                return False
        v = Version(Version(str(release)).base_version)
        return SpecifierSet(self.releases).contains(v, prereleases=True)

    @property
    def before(self) -> str:
        """The releases before a ">=X" range starts ("<X"): where the older code path of the same fact lives."""
        lower = self.releases.replace(" ", "")
        if not lower.startswith(">=") or "," in lower:
            raise ValueError(f"{self.releases!r} is not a '>=X' range: it has no single 'before'")
        return "<" + lower[2:]


# ---- what the runtime hooks act on -------------------------------------------------------------------------------

NVFP4_W13_SCALE_2_UP_GATE = Feature(
    "<0.5.23",
    "FusedMoE's trtllm loader swaps the w1/w3 shard ids for the per-tensor scales too, so w13_weight_scale_2 is "
    "stored [Up, Gate] (0.5.23 keeps [Gate, Up]); SGLang's own prep there still reads column 0 as the gate",
)
FP4_QUANT_INFO_SWIGLU = Feature(
    ">=0.5.17",
    "FlashInferTrtllmFp4MoeQuantInfo carries gemm1_alpha / gemm1_beta / gemm1_clamp_limit (SGLang passes None before)",
)
FP8_QUANT_INFO_SWIGLU = Feature(
    ">=0.5.18",
    "FlashInferTrtllmFp8MoeQuantInfo carries gemm1_alpha / gemm1_beta / gemm1_clamp_limit (the DeepSeek FP8 "
    "activation kernel's SwiGLU limits; None before)",
)
MOE_RUNNER_CONFIG_LAYER = Feature(
    ">=0.5.22",
    "FusedMoE fills MoeRunnerConfig.layer itself (layer=self); before, the plugin sets it so its runner finds the "
    "layer being run (0.5.16-0.5.21 have the field but leave it None, < 0.5.16 have no field)",
)
NVFP4_BLOCKSCALE_SWIZZLED_PARAMETERS = Feature(
    "<0.5.13",
    "the trtllm NVFP4 layer registers w13/w2_blockscale_swizzled as placeholder Parameters (None from 0.5.13); "
    "kept, so every registered parameter stays the same object",
)
MODELOPT_NVFP4_GELU = Feature(
    ">=0.5.13",
    "ModelOptNvFp4FusedMoEMethod.apply maps gelu (its ACT_STR_TO_TYPE_MAP has silu / relu2 only before, and asserts "
    "on anything else): a ModelOpt NVFP4 gelu layer cannot run on any backend before 0.5.13",
)
NVFP4_AUTO_RUNNER_MISMATCH = Feature(
    ">=0.5.16",
    "ModelOptNvFp4FusedMoEMethod.create_moe_runner resolves a global --moe-runner-backend auto to FLASHINFER_TRTLLM "
    "off SM80-90 (kept as _moe_runner_backend), while its __init__ set enable_flashinfer_trtllm_moe (post-load layout, "
    "apply's trtllm branch) and FusedMoE its loader flags from the global backend only: weights laid out for CUTLASS, "
    "run as TRT-LLM (apply raises NotImplementedError on 0.5.16-0.5.20, AttributeError g1_scale_c from 0.5.21); "
    "0.5.13-0.5.15 resolve auto the same way, but their apply falls back to sgl-kernel's cutlass_moe_fp4 for a layer "
    "not laid out for TRT-LLM: consistent, left alone",
)
NVFP4_APPLY_REFUSES_UNSERVED_BACKEND = Feature(
    ">=0.5.16",
    "ModelOptNvFp4FusedMoEMethod.apply (nvfp4_online's method inherits it) ends in NotImplementedError('Unsupported "
    "moe_runner_backend for NVFP4 MoE') for a backend it has no branch for, flashinfer_mxfp4 included, after "
    "create_moe_runner built that runner without complaint: `explain` warns that such a model fails at the first "
    "forward; before, apply falls back to sgl-kernel's cutlass_moe_fp4",
)
NVFP4_MEGAMOE_LAYOUT = Feature(
    ">=0.5.22",
    "ModelOptNvFp4FusedMoEMethod.use_flashinfer_trtllm_weight_layout is False under MegaMoE, which consumes the "
    "canonical layout: such layers stay SGLang's",
)
NVFP4_W13_INTERLEAVED_CHECKPOINTS = Feature(
    ">=0.5.16",
    "layer.inference_moe_w13_interleaved marks checkpoints that store w13 interleaved; SGLang de-interleaves them "
    "itself, so such layers stay SGLang's",
)
MODELOPT_FP8_OWN_BACKEND = Feature(
    ">=0.5.23",
    "ModelOptFp8MoEMethod keeps its own `_moe_runner_backend`; before, it reads the global get_moe_runner_backend()",
)
FP8_TRTLLM_ACTIVATION_PARAMS = Feature(
    ">=0.5.18",
    "Fp8MoEMethod._prepare_flashinfer_trtllm_activation_params(layer) sets the SwiGLU tensors its apply reads as "
    "layer._flashinfer_trtllm_gemm1_* (0.5.18 reads them by plain attribute access: a layer without them raises)",
)
FP8_OWNS_MOE_RUNNER = Feature(
    ">=0.5.19",
    "Fp8MoEMethod._owns_moe_runner: the SwiGLU tensors are set only when the method owns its MoeRunner (0.5.18 "
    "has no such attribute: every method owns its runner there)",
)
FP8_W13_ALWAYS_TWO_HALVES = Feature(
    "<0.5.19",
    "Fp8MoEMethod allocates w13 as [E, 2*I, H] (get_moe_weight_sizes(is_concat=True)) whatever the activation; from "
    "0.5.19 is_concat=is_gated. A non-gated (relu2) per-tensor layer on flashinfer_trtllm then hands the kernel an "
    "uninitialised second half: the plugin allocates it at the kernel's [E, I, H] before anything is loaded",
)
BF16_LOAD_RESTORES_LAYOUT = Feature(
    ">=0.5.23",
    "UnquantizedFusedMoEMethod.maybe_restore_flashinfer_trtllm_bf16_weight_shape_for_load un-blocks the whole 4-D "
    "BF16 layer (bytes and shape) before each load on both trtllm backends (sglang#33743; before, a shape-only "
    "restore on the routed backend): the plugin skips it for the [E, M, K] layers it manages",
)
CT_NVFP4_APPLY_CALLS_FLASHINFER = Feature(
    "<0.5.17",
    "CompressedTensorsW4A4Nvfp4MoE.apply_weights calls flashinfer itself (no MoeRunner), reading "
    "TopKOutput.topk_config and dropping the up-half scale; the plugin runs such layers on its runner with 0.5.17's "
    "QuantInfo",
)
TRTLLM_ROUTING_GUESSED = Feature(
    "<0.5.23",
    "TopK leaves routing to the trtllm kernel even for a layer that declares no routing method (Mixtral), which the "
    "kernel then routes with a guessed method (FP8: DeepSeekV3, BF16: Default); 0.5.23 materializes the top-k then "
    "(topk._can_bypass_trtllm_routing). The plugin runner takes SGLang's own top-k for such layers",
)
ROUTED_EXPERTS_CAPTURE_SITE = Feature(
    ">=0.5.15",
    "layers.moe.topk.capture_routed_experts_if_allowed(topk_config, layer_id, ids) is SGLang's one capture site of "
    "routed experts (R3), honouring TopKConfig.allow_routed_experts_capture (draft layers opt out); before, "
    "select_experts calls the global capturer's capture(layer_id, ids) itself and every layer captures",
)
ROUTED_EXPERTS_NOOP_CAPTURER = Feature(
    "<0.5.12",
    "the global routed-experts capturer (layers/moe/routed_experts_capturer.py) is a no-op object when "
    "--enable-return-routed-experts is off; from 0.5.12 (state_capturer/routed_experts.py) it is None then",
)
WEIGHT_UPDATER = Feature(
    ">=0.5.16",
    "weight updates live in model_runner_components.weight_updater.WeightUpdater (ModelRunner methods before)",
)
DISTRIBUTED_UPDATE_RENAMED = Feature(
    ">=0.5.21",
    "WeightUpdater.update_weights_from_distributed is renamed load_weights_from_distributed",
)
UPDATE_SESSIONS = Feature(
    ">=0.5.21",
    "WeightUpdater.begin_weight_update / end_weight_update sessions and restore_weights_before_loading exist",
)
LOADER_FREE_SESSIONS = Feature(
    ">=0.5.21",
    "SchedulerWeightUpdaterManager.end_weight_update calls WeightUpdater.end_weight_update(run_post_load=True) when "
    "no update_weights_from_tensor / _distributed loaded in the session (P2P / RDMA writers put raw bytes into the "
    "parameters), and answers success whatever its runners did: the plugin checks what such a session wrote and "
    "answers for it",
)
REMOTE_INSTANCE_LOADER = Feature(
    ">=0.5.11",
    "--load-format remote_instance (model_loader/loader.py RemoteInstanceModelLoader): backends nccl (the seed "
    "broadcasts its named_parameters in order: send_weights_to_remote_instance) and transfer_engine (the new "
    "instance RDMA-reads each of its named_parameters from the seed's by name, numel and element size), then only "
    "post_load_weights: process_weights_after_loading never runs there; modelexpress (a peer's bytes, or "
    "DefaultModelLoader when no peer has them)",
)
WEIGHT_EXPORTER = Feature(
    ">=0.5.16",
    "the seed's send_weights_to_remote_instance (nccl backend) lives in model_runner_components.weight_exporter."
    "WeightExporter (a ModelRunner method before)",
)
UPDATE_RUNNER_SELECTOR = Feature(
    ">=0.5.21",
    "the scheduler's SchedulerWeightUpdaterManager loads a disk update into every runner and a tensor / distributed "
    "one into every runner its `selector` names (target, then draft), one after another, stopping at the first that "
    "answers False: a bucket a draft refuses would already be in the target (before 0.5.21 no selector: disk / IPC "
    "load the target then the draft, tensor the draft then the target, distributed the target alone: "
    "DISTRIBUTED_UPDATE_SKIPS_DRAFT)",
)
SCHEDULER_UPDATE_MANAGER = Feature(
    ">=0.5.13",
    "the scheduler's update_weights_from_* requests are served by scheduler_components.weight_updater."
    "SchedulerWeightUpdaterManager; before, by the Scheduler's own SchedulerUpdateWeightsMixin methods",
)
DISTRIBUTED_UPDATE_SKIPS_DRAFT = Feature(
    "<0.5.21",
    "the scheduler loads update_weights_from_distributed into the target's runner only (tp_worker), while disk / IPC "
    "/ tensor requests reach a speculative draft too (its spec worker's own update methods): after a distributed "
    "update the draft silently serves its old weights (0.5.21 loads it into every runner the request's selector "
    "names)",
)
WEIGHT_CHECKER_COMPARATOR = Feature(
    ">=0.5.15",
    "utils.weight_checker_comparator (select_comparable_weight / compare_weights) and "
    "weight_checker._build_quantized_set, which the plugin's checker hooks attach to",
)

WEIGHT_CHECKER_LEGACY_COMPARE = Feature(
    "<0.5.15",
    "WeightChecker._compare is _check_tensors(_postprocess_tensors(snapshot), _postprocess_tensors(live)): module "
    "functions (no comparator module), a bitwise compare of every tensor after .cuda(), FP8 block weights dequantized "
    "by weight_scale_inv; the plugin's checker hooks attach to those functions there",
)
WEIGHT_CHECKER_UE8M0_SCALES_ONLY = Feature(
    "<0.5.12",
    "the checker's _postprocess_tensors dequantizes every *weight / *weight_scale_inv pair through "
    "inverse_transform_scale_ue8m0, which asserts on float32 scales (it expects DeepGEMM's packed int32): a DeepSeek "
    "FP8 block MoE layer on flashinfer_trtllm (float32 scales, SGLang's own prep) fails every compare; 0.5.12 "
    "dequantizes float32 scales directly",
)
WEIGHT_CHECKER_OF_MODEL_RUNNER = Feature(
    "<0.5.16",
    "WeightChecker(model_runner) reads the model as model_runner.model; from 0.5.16 WeightChecker(get_model=, ps=)",
)

FLASHINFER_A2A_TRTLLM_ROUTED = Feature(
    ">=0.5.15",
    "FusedOpPool registers ('flashinfer', 'flashinfer_trtllm_routed'); before, ServerArgs._handle_a2a_moe asserts "
    "that --moe-a2a-backend flashinfer runs on flashinfer_cutlass (or cutedsl): no TRT-LLM runner behind that A2A",
)
SERVER_ARGS_FIELD_WRITES = Feature(
    "<0.5.15",
    "ServerArgs.__post_init__'s rules assign moe_runner_backend in place (no arg_groups.overrides stash or "
    "resolved_view): the model rules overwrite the user's value before _handle_moe_kernel_config, so the plugin "
    "records it before them and writes its choice into the field as those rules do",
)
PLATFORM_OVERRIDE = Feature(
    ">=0.5.19",
    "runtime_context.override_platform fakes the platform; before, lru-cached is_sm100_supported()-style functions "
    "imported by name into many modules are rebound",
)
WEIGHT_CACHE = Feature(
    ">=0.5.17",
    "--weight-cache-mode daemon | client: a scheduler maps its weights from a weight-cache daemon "
    "(weight_cache/ipc_loader.py IpcModelLoader) and skips process_weights_after_loading, so the plugin neither "
    "prepares nor watches its MoE layers; the daemon (weight_cache/daemon.py) never calls load_plugins()",
)
PUBLISHED_SERVER_ARGS = Feature(
    ">=0.5.15",
    "runtime_context.get_server_args() returns the process's published ServerArgs (raw input retained); before, "
    "server_args.get_global_server_args()",
)

MOE_RUNNER_CORE_REGISTRY = Feature(
    ">=0.5.19",
    "moe_runner/runner.py register_moe_runner_core(backend_name, factory): SGLang's official point for a MoE runner "
    "core of a new or built-in backend name. For flashinfer_trtllm(_routed) MoeRunner.run still calls the fused func "
    "SGLang registers for the key first, so a core registered there never runs: it cannot carry the leaf hooks",
)

# ---- MX formats (MXFP8, MXFP4 experts, gpt-oss MXFP4) -----------------------------------------------------------

MXFP8_ACTIVATION_PARAMS = Feature(
    ">=0.5.18",
    "Fp8MoEMethod._prepare_flashinfer_trtllm_activation_params(layer) materializes the SwiGLU alpha/beta/clamp "
    "tensors its apply passes to the MXFP8 kernel as layer._flashinfer_trtllm_gemm1_* (apply reads them)",
)
MXFP8_QUANTIZE_IN_FP8_UTILS = Feature(
    ">=0.5.17",
    "the MXFP8 leaf quantizes activations with fp8_utils.flashinfer_mxfp8_quantize (flashinfer.mxfp8_quantize before)",
)
MXFP8_NON_GATED_W13_ROWS = Feature(
    ">=0.5.19",
    "Fp8MoEMethod allocates a non-gated (relu2) MXFP8 w13 with I rows; before it allocates 2I and SGLang slices "
    "(and rebinds) at prep, so the plugin leaves such layers to SGLang there",
)
FP4_EXPERTS_METHOD = Feature(
    ">=0.5.12",
    "Fp8Config.is_fp4_experts on flashinfer_mxfp4 builds Mxfp4FlashinferTrtllmMoEMethod (DeepSeek-V4 / MiMo-V2 "
    "MXFP4 routed experts on the TRT-LLM-Gen FP4 kernel)",
)
FP4_EXPERTS_PADDED_LOAD = Feature(
    ">=0.5.17",
    "FusedMoE's plain loader copies a smaller checkpoint shard into the leading slice of a larger expert buffer; "
    "before it narrows by the buffer's size, so FP4-expert buffers allocated padded (I % 128 != 0) cannot be loaded",
)
FP4_EXPERTS_SGLANG_PADS = Feature(
    ">=0.5.21",
    "Mxfp4FlashinferTrtllmMoEMethod pads I to 128 per half at prep (scales with 1.0) and sets "
    "layer.intermediate_size_per_partition to the padded size; before, I % 128 != 0 fails SGLang's own prep",
)
GPTOSS_FI_KERNEL_ATTR = Feature(
    ">=0.5.12",
    "Mxfp4MoEMethod._fi_kernel names the flashinfer kernel ('trtllm_sm100' on SM100); 0.5.11 has only use_flashinfer",
)

NVFP4_ONLINE = Feature(
    ">=0.5.14",
    "`--quantization nvfp4_online` (layers/quantization/nvfp4_online.py): BF16/FP16/FP8 experts quantized to NVFP4 "
    "as they load, per-token activation scales; before 0.5.14 upstream lacks it, so the plugin has nothing to serve",
)
NVFP4_ONLINE_NON_GATED = Feature(
    ">=0.5.18",
    "nvfp4_online's weight loader quantizes a non-gated layer's w1 on its own (`not moe_runner_config.is_gated`); "
    "before, it holds every w1 for its w3 partner, which a non-gated (relu2) layer never loads: its experts stay "
    "unwritten (NaN forwards), so the plugin refuses such layers there",
)
MODELOPT_FP4_ONLINE = Feature(
    ">=0.5.18",
    "`--quantization modelopt_fp4` on a checkpoint without serialized NVFP4 metadata (BF16, or FP8 through "
    "make_modelopt_fp4_online_config_from_fp8) builds _ModelOptFp4OnlineConfig: experts quantized to NVFP4 as they "
    "load by nvfp4_online's method, static per-tensor activation scales (create_weights fills them with 1.0); "
    "before 0.5.18 SGLang refuses such a checkpoint (no config file for modelopt_fp4)",
)
NVFP4_ONLINE_4OVER6 = Feature(
    ">=0.5.23",
    "nvfp4_online quantizes expert weights with flashinfer's 4over6 MSE recipe (NVFP44Over6Config(448, MSE)); "
    "before, with the plain NVFP4 recipe: a weight update quantized by the plugin must use the release's recipe",
)

NVFP4_ONLINE_LOADER_4OVER6 = Feature(
    ">=0.5.18,<0.5.23",
    "the model loader (initial load, update_weights_from_disk) runs load_weights of an nvfp4_online model under "
    "FLASHINFER_NVFP4_4OVER6=1 (MSE, e4m3 448, exact math): 4over6 weights there; update_weights_from_tensor calls "
    "load_weights without it, so SGLang quantizes tensor updates with the plain recipe on these releases",
)


def all_features() -> dict[str, Feature]:
    return {name: f for name, f in globals().items() if isinstance(f, Feature)}


__all__ = ["Feature", "all_features", *all_features()]
