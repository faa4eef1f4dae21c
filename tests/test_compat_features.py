"""Every named release flag (compat/features.py: the product's; sandbox/releases.py: the CPU
sandbox's; tests/support/releases.py: the test fixtures') against the installed SGLang's own code.

A flag is a claim ("on these releases, SGLang does X"); here each claim is checked by looking at what the installed
release really has — a class field, a function, a signature, a line of its source. Run on every release of the
matrix, so a wrong range fails on the release where it is wrong.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect

import pytest

from sglang_trtllm_moe.compat import features
from sglang_trtllm_moe.sandbox import releases as sandbox_releases

from .support import releases as support_releases

#: every flag, by name: a name is one fact, whichever module holds it
FLAGS = {**features.all_features(), **sandbox_releases.all_features(), **support_releases.all_features()}


def _has(module: str, attr: str) -> bool:
    try:
        return hasattr(importlib.import_module(module), attr)
    except ImportError:
        return False


def _source(obj_path: str) -> str:
    module, _, name = obj_path.rpartition(":")
    obj = importlib.import_module(module)
    for part in name.split("."):
        obj = getattr(obj, part)
    return inspect.getsource(inspect.unwrap(obj))


def _fields(module: str, cls: str) -> set:
    import dataclasses

    return {f.name for f in dataclasses.fields(getattr(importlib.import_module(module), cls))}


def _nvfp4_scales_swapped() -> bool:
    src = _source("sglang.srt.layers.moe.fused_moe_triton.layer:FusedMoE._weight_loader_impl")
    i = src.index('{"w1": "w3", "w3": "w1"')
    return "ModelOptNvFp4FusedMoEMethod" in src[max(0, i - 700) : i]


def _modelopt_nvfp4_gelu() -> bool:
    """ModelOpt NVFP4's apply has no private activation table (0.5.13+), or one that maps gelu."""
    src = inspect.getsource(importlib.import_module("sglang.srt.layers.quantization.modelopt_quant"))
    if "ACT_STR_TO_TYPE_MAP = {" not in src:
        return True
    return '"gelu"' in src.split("ACT_STR_TO_TYPE_MAP = {", 1)[1].split("}", 1)[0]


def _topk_remaps_off_gpu() -> bool:
    """The last branch of `_post_process_topk_ids` (neither CUDA nor HIP) applies the logical -> physical remap."""
    src = _source("sglang.srt.layers.moe.topk:_post_process_topk_ids")
    tail = src.rsplit("\n    else:", 1)
    return len(tail) == 2 and "topk_ids_logical_to_physical" in tail[1]


MODELOPT = "sglang.srt.layers.quantization.modelopt_quant"
TRTLLM = "sglang.srt.layers.moe.moe_runner.flashinfer_trtllm"


def _distributed_update_skips_draft() -> bool:
    """The scheduler's distributed entry point of this release names no draft (the disk one does: the check reads
    the right method)."""
    if _has(MANAGER, "SchedulerWeightUpdaterManager"):
        where = f"{MANAGER}:SchedulerWeightUpdaterManager"
    else:
        where = "sglang.srt.managers.scheduler_update_weights_mixin:SchedulerUpdateWeightsMixin"
    disk = _source(f"{where}.update_weights_from_disk")
    assert "draft" in disk or "_select_runners" in disk, "the disk entry point reaches no draft: the probe is wrong"
    src = _source(f"{where}.update_weights_from_distributed")
    return "draft" not in src and "_select_runners" not in src


UPDATER = "sglang.srt.model_executor.model_runner_components.weight_updater"
FP4E = "sglang.srt.layers.quantization.mxfp4_flashinfer_trtllm_moe"
MANAGER = "sglang.srt.managers.scheduler_components.weight_updater"
EXPORTER = "sglang.srt.model_executor.model_runner_components.weight_exporter"

PROBES = {
    "TOPK_REMAPS_OFF_GPU": _topk_remaps_off_gpu,
    "NVFP4_W13_SCALE_2_UP_GATE": _nvfp4_scales_swapped,
    "FP4_QUANT_INFO_SWIGLU": lambda: "gemm1_alpha" in _fields(TRTLLM, "FlashInferTrtllmFp4MoeQuantInfo"),
    "FP8_QUANT_INFO_SWIGLU": lambda: "gemm1_alpha" in _fields(TRTLLM, "FlashInferTrtllmFp8MoeQuantInfo"),
    "MOE_RUNNER_CONFIG_LAYER": lambda: (
        "layer=self,"
        in _source("sglang.srt.layers.moe.fused_moe_triton.layer:FusedMoE.__init__").split("MoeRunnerConfig(", 1)[-1][
            :1500
        ]
    ),
    "NVFP4_BLOCKSCALE_SWIZZLED_PARAMETERS": lambda: (
        "w13_blockscale_swizzled = None" not in _source(f"{MODELOPT}:ModelOptNvFp4FusedMoEMethod.create_weights")
    ),
    "MODELOPT_NVFP4_GELU": lambda: _modelopt_nvfp4_gelu(),
    "NVFP4_AUTO_RUNNER_MISMATCH": lambda: (
        "self._moe_runner_backend = moe_runner_backend"
        in _source(f"{MODELOPT}:ModelOptNvFp4FusedMoEMethod.create_moe_runner")
        and "cutlass_moe_fp4(" not in _source(f"{MODELOPT}:ModelOptNvFp4FusedMoEMethod.apply")
    ),
    "NVFP4_APPLY_REFUSES_UNSERVED_BACKEND": lambda: (
        "Unsupported moe_runner_backend for NVFP4 MoE" in _source(f"{MODELOPT}:ModelOptNvFp4FusedMoEMethod.apply")
        and "mxfp4" not in _source(f"{MODELOPT}:ModelOptNvFp4FusedMoEMethod.apply").lower()
        and "mxfp4" not in _source(f"{MODELOPT}:ModelOptNvFp4FusedMoEMethod.create_moe_runner").lower()
    ),
    "NVFP4_MEGAMOE_LAYOUT": lambda: (
        "use_flashinfer_trtllm_weight_layout" in _source(f"{MODELOPT}:ModelOptNvFp4FusedMoEMethod.__init__")
    ),
    "NVFP4_W13_INTERLEAVED_CHECKPOINTS": lambda: (
        "inference_moe_w13_interleaved" in inspect.getsource(importlib.import_module(MODELOPT))
    ),
    "MODELOPT_FP8_OWN_BACKEND": lambda: (
        "self._moe_runner_backend" in _source(f"{MODELOPT}:ModelOptFp8MoEMethod.create_moe_runner")
    ),
    "FP8_TRTLLM_ACTIVATION_PARAMS": lambda: hasattr(
        importlib.import_module("sglang.srt.layers.quantization.fp8").Fp8MoEMethod,
        "_prepare_flashinfer_trtllm_activation_params",
    ),
    "FP8_OWNS_MOE_RUNNER": lambda: (
        "_owns_moe_runner" in inspect.getsource(importlib.import_module("sglang.srt.layers.quantization.fp8"))
    ),
    "FP8_W13_ALWAYS_TWO_HALVES": lambda: (
        "is_concat=True" in inspect.getsource(importlib.import_module("sglang.srt.layers.quantization.fp8"))
    ),
    "BF16_LOAD_RESTORES_LAYOUT": lambda: (
        "_restore_trtllm_bf16_canonical_layout"
        in _source(
            "sglang.srt.layers.quantization.unquant:"
            "UnquantizedFusedMoEMethod.maybe_restore_flashinfer_trtllm_bf16_weight_shape_for_load"
        )
    ),
    "CT_NVFP4_APPLY_CALLS_FLASHINFER": lambda: (
        "trtllm_fp4_block_scale_moe"
        in _source(
            "sglang.srt.layers.quantization.compressed_tensors.schemes.compressed_tensors_w4a4_nvfp4_moe:"
            "CompressedTensorsW4A4Nvfp4MoE.apply_weights"
        )
    ),
    "TRTLLM_ROUTING_GUESSED": lambda: not _has("sglang.srt.layers.moe.topk", "_can_bypass_trtllm_routing"),
    "ROUTED_EXPERTS_CAPTURE_SITE": lambda: _has("sglang.srt.layers.moe.topk", "capture_routed_experts_if_allowed"),
    "ROUTED_EXPERTS_NOOP_CAPTURER": lambda: _has(
        "sglang.srt.layers.moe.routed_experts_capturer", "_RoutedExpertsCapturerNoop"
    ),
    "WEIGHT_UPDATER": lambda: _has(UPDATER, "WeightUpdater"),
    "DISTRIBUTED_UPDATE_RENAMED": lambda: (
        _has(UPDATER, "WeightUpdater")
        and hasattr(importlib.import_module(UPDATER).WeightUpdater, "load_weights_from_distributed")
    ),
    "UPDATE_SESSIONS": lambda: (
        _has(UPDATER, "WeightUpdater")
        and hasattr(importlib.import_module(UPDATER).WeightUpdater, "begin_weight_update")
    ),
    "LOADER_FREE_SESSIONS": lambda: (
        _has(MANAGER, "SchedulerWeightUpdaterManager")
        and hasattr(importlib.import_module(MANAGER).SchedulerWeightUpdaterManager, "end_weight_update")
        and "run_post_load = not self._session.loaded_weights"
        in _source(f"{MANAGER}:SchedulerWeightUpdaterManager.end_weight_update")
        and "run_post_load"
        in inspect.signature(importlib.import_module(UPDATER).WeightUpdater.end_weight_update).parameters
    ),
    "REMOTE_INSTANCE_LOADER": lambda: all(
        hasattr(importlib.import_module("sglang.srt.model_loader.loader").RemoteInstanceModelLoader, m)
        for m in ("load_model_from_remote_instance_by_nccl", "load_model_from_remote_instance_by_transfer_engine")
    ),
    "WEIGHT_EXPORTER": lambda: (
        _has(EXPORTER, "WeightExporter")
        and hasattr(importlib.import_module(EXPORTER).WeightExporter, "send_weights_to_remote_instance")
    ),
    "UPDATE_RUNNER_SELECTOR": lambda: (
        _has(MANAGER, "SchedulerWeightUpdaterManager")
        and "self._select_runners(recv_req.selector)"
        in _source(f"{MANAGER}:SchedulerWeightUpdaterManager.update_weights_from_distributed")
        and "self._select_runners(recv_req.selector)"
        in _source(f"{MANAGER}:SchedulerWeightUpdaterManager.update_weights_from_tensor")
        and "self._select_runners()" in _source(f"{MANAGER}:SchedulerWeightUpdaterManager.update_weights_from_disk")
    ),
    "SCHEDULER_UPDATE_MANAGER": lambda: _has(MANAGER, "SchedulerWeightUpdaterManager"),
    "DISTRIBUTED_UPDATE_SKIPS_DRAFT": _distributed_update_skips_draft,
    "WEIGHT_CHECKER_COMPARATOR": lambda: _has("sglang.srt.utils.weight_checker", "_build_quantized_set"),
    "WEIGHT_CHECKER_LEGACY_COMPARE": lambda: (
        "_check_tensors(" in _source("sglang.srt.utils.weight_checker:WeightChecker._compare")
        and _has("sglang.srt.utils.weight_checker", "_postprocess_tensors")
    ),
    "WEIGHT_CHECKER_UE8M0_SCALES_ONLY": lambda: (
        _has("sglang.srt.utils.weight_checker", "_postprocess_tensors")
        and "torch.int32" not in _source("sglang.srt.utils.weight_checker:_postprocess_tensors")
    ),
    "WEIGHT_CHECKER_OF_MODEL_RUNNER": lambda: (
        "model_runner"
        in inspect.signature(
            importlib.import_module("sglang.srt.utils.weight_checker").WeightChecker.__init__
        ).parameters
    ),
    "FLASHINFER_A2A_TRTLLM_ROUTED": lambda: (
        'register_fused_func("flashinfer", "flashinfer_trtllm_routed")'
        in open(importlib.util.find_spec(TRTLLM).origin).read()
    ),
    "MOE_RUNNER_CORE_REGISTRY": lambda: _has("sglang.srt.layers.moe.moe_runner.runner", "register_moe_runner_core"),
    "SERVER_ARGS_FIELD_WRITES": lambda: not _has("sglang.srt.arg_groups.overrides", "resolved_view"),
    "PUBLISHED_SERVER_ARGS": lambda: _has("sglang.srt.runtime_context", "get_server_args"),
    "WEIGHT_CACHE": lambda: (
        _has("sglang.srt.weight_cache.ipc_loader", "IpcModelLoader")
        and "Skip _post_load_weights" in _source("sglang.srt.weight_cache.ipc_loader:IpcModelLoader.load_model")
        and "load_plugins" not in inspect.getsource(importlib.import_module("sglang.srt.weight_cache.daemon"))
    ),
    "PLATFORM_OVERRIDE": lambda: _has("sglang.srt.runtime_context", "override_platform"),
    "PUBLISH_WITH_RANKS": lambda: (
        _has("sglang.srt.runtime_context", "SpawnRanks")
        and "ranks" in inspect.signature(importlib.import_module("sglang.srt.runtime_context").publish).parameters
    ),
    "MOE_CONFIG_TAKES_ARGS": lambda: (
        len(inspect.signature(importlib.import_module("sglang.srt.layers.moe.utils").initialize_moe_config).parameters)
        > 0
    ),
    "BF16_GEMM_TORCH": lambda: (
        _has("sglang.srt.layers.quantization.unquant", "Bf16GemmBackend")
        and "torch"
        in [b.value for b in importlib.import_module("sglang.srt.layers.quantization.unquant").Bf16GemmBackend]
    ),
    "DETOKENIZER_IMPORTS_XGRAMMAR": lambda: (
        importlib.util.find_spec("sglang.srt.function_call.inkling_detector") is not None
    ),
    # the `if` that guards the module-level import names CUDA from 0.5.13 (before: "if not (_is_npu or ...)")
    "HOST_KV_POOL_IMPORTS_SGL_KERNEL": lambda: (
        "_is_cuda"
        not in open(importlib.util.find_spec("sglang.srt.mem_cache.memory_pool_host").origin)
        .read()
        .split("\n    from sgl_kernel.kvcacheio import")[0]
        .rsplit("\n", 1)[-1]
    ),
    # read, not imported: before 0.5.16 the scheduler module imports sgl_kernel on a CPU
    "SAVE_SHARDED_MODEL_TAKES_PARAMS": lambda: (
        "def save_sharded_model(self, **kwargs)"
        not in open(importlib.util.find_spec("sglang.srt.managers.scheduler").origin).read()
    ),
    "SWIZZLE_MOVES_TO_CUDA": lambda: ".cuda()" in _source("sglang.srt.layers.quantization.utils:swizzle_blockscale"),
    "WEIGHT_CACHE_CHECK": lambda: (
        _has(UPDATER, "WeightUpdater")
        and "get_model_runner().server_args.weight_cache_mode" in inspect.getsource(importlib.import_module(UPDATER))
    ),
    "WEIGHT_CHECKER_TAKES_PS": lambda: (
        "ps"
        in inspect.signature(
            importlib.import_module("sglang.srt.utils.weight_checker").WeightChecker.__init__
        ).parameters
    ),
    "SPAWN_RANKS": lambda: _has("sglang.srt.runtime_context", "SpawnRanks"),
    # MX formats
    "MXFP8_ACTIVATION_PARAMS": lambda: hasattr(
        importlib.import_module("sglang.srt.layers.quantization.fp8").Fp8MoEMethod,
        "_prepare_flashinfer_trtllm_activation_params",
    ),
    "MXFP8_QUANTIZE_IN_FP8_UTILS": lambda: (
        "flashinfer_mxfp8_quantize" in _source(f"{TRTLLM}:fused_experts_none_to_flashinfer_trtllm_fp8")
    ),
    "MXFP8_NON_GATED_W13_ROWS": lambda: (
        "is_concat=layer.moe_runner_config.is_gated"
        in inspect.getsource(importlib.import_module("sglang.srt.layers.quantization.fp8"))
    ),
    "FP4_EXPERTS_METHOD": lambda: _has(FP4E, "Mxfp4FlashinferTrtllmMoEMethod"),
    "FP4_EXPERTS_PADDED_LOAD": lambda: (
        "loaded_shard_size" in _source("sglang.srt.layers.moe.fused_moe_triton.layer:FusedMoE._load_w13")
    ),
    "FP4_EXPERTS_SGLANG_PADS": lambda: _has(FP4E, "_pad_intermediate_size"),
    "NVFP4_ONLINE": lambda: importlib.util.find_spec("sglang.srt.layers.quantization.nvfp4_online") is not None,
    "MODELOPT_FP4_ONLINE": lambda: (
        importlib.util.find_spec("sglang.srt.layers.quantization.nvfp4_online") is not None
        and _has("sglang.srt.layers.quantization.nvfp4_online", "_ModelOptFp4OnlineConfig")
        and "for_online_weight_quantization"
        in inspect.getsource(importlib.import_module("sglang.srt.model_loader.weight_utils"))
        and "input_scale_fill = 1.0 if not is_nvfp4_online"
        in inspect.getsource(importlib.import_module("sglang.srt.layers.quantization.modelopt_quant"))
    ),
    "NVFP4_ONLINE_4OVER6": lambda: (
        importlib.util.find_spec("sglang.srt.layers.quantization.nvfp4_online") is not None
        and "nvfp4_4over6="
        in _source(
            "sglang.srt.layers.quantization.nvfp4_online:ModelOptNvFp4OnlineFusedMoEMethod._quantize_weight_nvfp4"
        )
    ),
    "NVFP4_ONLINE_NON_GATED": lambda: (
        importlib.util.find_spec("sglang.srt.layers.quantization.nvfp4_online") is not None
        and "moe_runner_config.is_gated"
        in inspect.getsource(importlib.import_module("sglang.srt.layers.quantization.nvfp4_online"))
    ),
    "NVFP4_ONLINE_LOADER_4OVER6": lambda: (
        'FLASHINFER_NVFP4_4OVER6="1"' in inspect.getsource(importlib.import_module("sglang.srt.model_loader.loader"))
    ),
    "GPTOSS_FI_KERNEL_ATTR": lambda: (
        "_fi_kernel" in _source("sglang.srt.layers.quantization.mxfp4:Mxfp4MoEMethod.__init__")
    ),
}


def test_every_flag_has_a_probe():
    modules = (features.all_features(), sandbox_releases.all_features(), support_releases.all_features())
    assert sum(len(m) for m in modules) == len(FLAGS), "a flag name is defined in two modules"
    assert set(PROBES) == set(FLAGS), set(PROBES) ^ set(FLAGS)


@pytest.mark.parametrize("name", sorted(PROBES))
def test_flag_matches_the_installed_release(name):
    import tests.conftest  # noqa: F401  (torchvision shim: the probes import SGLang modules)

    flag = FLAGS[name]
    assert flag.present() == PROBES[name](), f"{name} ({flag.releases}): {flag.why}"


def test_before_is_the_complement_of_a_lower_bound_and_the_entry_points_partition_the_releases():
    """Targets spell an older code path as `Feature.before`: each update entry point of weight_updates exists on
    exactly one side on every tested release (a gap or an overlap would leave an update unchecked or checked twice)."""
    from sglang_trtllm_moe.builtins import weight_updates as wu
    from sglang_trtllm_moe.compat.releases import TESTED

    assert features.WEIGHT_UPDATER.before == "<0.5.16"
    with pytest.raises(ValueError, match="no single 'before'"):
        _ = features.Feature(">=0.5.16,<0.5.21", "a bounded range").before
    targets = wu.LOAD_ONLY_ENTRY_POINTS + wu.RELOAD_START + wu.DIRECT
    for release in TESTED:
        present = [path.rsplit(".", 1)[1] for path, rel in targets if features.Feature(rel, "").present(release)]
        on = set(present)
        assert len(present) == len(on), (release, "an entry point hooked at two paths", present)
        assert {"update_weights_from_tensor", "update_weights_from_disk", "_model_load_weights_direct"} <= on, release
        assert len({"update_weights_from_distributed", "load_weights_from_distributed"} & on) == 1, (release, on)
