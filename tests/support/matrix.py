"""The compat matrix: which tests prove which capability, which SGLang releases a test needs, and the pytest
plumbing that turns "does not apply to this release" into a skip that says why (never a silent one).

Loaded by `tests/conftest.py` as a pytest plugin; read by `ci/matrix` to build docs/compat.json and the table.
One table, not ifs in test files: a test needs a release range either through `@pytest.mark.sglang(spec,
reason=...)` or through a row of `REQUIREMENTS` below (so tests owned by others need no edit). A requirement can
also be a *capability* (the plugin registers a hook target of that capability on the running release): tests of a
capability the plugin does not provide on a release yet are reported "not provided by the plugin on <release>",
and start running there the day a target's `releases=` is widened.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass

from packaging.specifiers import SpecifierSet
from packaging.version import Version

#: (key, column title, selectors). A selector is "path::name-prefix" or "path" (a whole file); "~text" as a second
#: element restricts it to node ids containing text. A test may prove several capabilities.
CAPABILITIES: tuple[tuple[str, str, tuple], ...] = (
    (
        "loads",
        "plugin loads",
        (
            ("tests/test_plugin.py::test_sglang_load_plugins", None),
            ("tests/test_plugin.py::test_doctor_cli_json", None),
            ("tests/test_compat_release.py::test_plugin_loads", None),
        ),
    ),
    (
        "targets",
        "targets landed",
        (
            ("tests/test_plugin.py::test_sglang_load_plugins_runs_register_and_every_target_lands", None),
            ("tests/test_compat_release.py::test_every_capability", None),
        ),
    ),
    ("runtime", "CPU runtime", (("tests/test_compat_release.py::test_single_process_runtime", None),)),
    # the layer contract (tests/test_layer_contract.py) counts for each format by its case ids
    (
        "nvfp4",
        "NVFP4 prep",
        (
            ("tests/test_nvfp4_layer.py", None),
            ("tests/test_ct_nvfp4_layer.py", None),
            ("tests/test_layer_contract.py", "[nvfp4"),
            ("tests/test_layer_contract.py", "[ct_nvfp4"),
        ),
    ),
    # online NVFP4: layers on every release; a whole BF16 model served with --quantization nvfp4_online (0.5.21+) and
    # the README's server recipe (0.5.23)
    (
        "nvfp4_online",
        "NVFP4 online",
        (
            ("tests/test_nvfp4_online_layer.py", None),
            ("tests/test_models.py", "nvfp4_online"),
            ("tests/test_http_online.py", None),
        ),
    ),
    ("fp8", "FP8 prep", (("tests/test_fp8_layer.py", None), ("tests/test_layer_contract.py", "[fp8_"))),
    ("bf16", "BF16 prep", (("tests/test_bf16_layer.py", None), ("tests/test_layer_contract.py", "[bf16"))),
    (
        "relu2",
        "relu2",
        (
            ("tests/test_nvfp4_layer.py", "relu2"),
            ("tests/test_fp8_layer.py", "relu2"),
            ("tests/test_bf16_layer.py", "relu2"),
            ("tests/test_ct_nvfp4_layer.py", "relu2"),
            ("tests/test_layer_contract.py", "[fp8_tensor-relu2"),
            ("tests/test_layer_contract.py", "[fp8_block-relu2"),
        ),
    ),
    ("rl_disk", "RL update: disk", (("tests/test_rl_updates.py::test_full_update_from_disk", None),)),
    (
        "rl_tensor",
        "RL update: tensor",
        (
            ("tests/test_rl_updates.py::test_update_from_tensor", None),
            ("tests/test_rl_updates.py::test_five_updates", None),
            ("tests/test_rl_updates.py::test_begin_end", None),
        ),
    ),
    (
        "rl_partial",
        "RL update: partial",
        (
            ("tests/test_rl_updates.py::test_partial_update", None),
            ("tests/test_rl_updates.py::test_w2_only", None),
            ("tests/test_mxfp8_layer.py::test_one_expert_update", None),
            ("tests/test_mxfp4_experts_layer.py::test_one_expert_update", None),
            ("tests/test_layer_contract.py::test_one_expert_update", "[mxfp"),
        ),
    ),
    ("mxfp8", "MXFP8 prep", (("tests/test_mxfp8_layer.py", None), ("tests/test_layer_contract.py", "[mxfp8"))),
    (
        "mxfp4_experts",
        "MXFP4 experts prep",
        (("tests/test_mxfp4_experts_layer.py", None), ("tests/test_layer_contract.py", "[mxfp4_experts")),
    ),
    (
        "mxfp4_gptoss",
        "gpt-oss MXFP4 prep",
        (("tests/test_mxfp4_gptoss_layer.py", None), ("tests/test_layer_contract.py", "[mxfp4_gptoss")),
    ),
    # INT4 W4A16 group 32 (compressed-tensors, Kimi-K2) on trtllm_mxint4_block_scale_moe: layers on every release
    # (SGLang's CompressedTensorsMxInt4MoE exists on each); a whole DeepSeek-V3 model where the model tests run
    (
        "int4",
        "INT4 W4A16 prep",
        (
            ("tests/test_ct_int4_layer.py", None),
            ("tests/test_layer_contract.py", "[ct_int4"),
            ("tests/test_models.py", "ct_int4"),
            ("tests/test_engine_smoke.py::test_int4_engine_smoke", None),
        ),
    ),
    ("checker", "weight checker", (("tests/test_checker.py", None), ("tests/test_checker_coordinates.py", None))),
    # the checker's checksum of a plugin-prepared model == SGLang alone's for the same weights (whole models, 0.5.21+)
    ("checksum", "checker checksum", (("tests/test_models.py::test_checksum", None),)),
    (
        "auto",
        "auto-select",
        (
            ("tests/test_selection.py::test_the_hook_lands", None),
            ("tests/test_selection.py::test_sglang_resolution", None),
            ("tests/test_selection.py::test_speculative_draft", None),
        ),
    ),
    (
        "threads",
        "concurrent loaders",
        (
            ("tests/test_concurrency.py", None),
            ("tests/test_layer_contract.py::test_concurrent", None),
        ),
    ),
    ("defer", "defer table", (("tests/test_defer.py", None),)),
    # whole SGLang models through SGLang's ModelRunner (0.5.21+: every model and flow; the known gaps of 0.5.21 /
    # 0.5.22 are strict xfails, tests/test_models.py KNOWN), the HTTP server and the RL loop (0.5.23)
    (
        "models",
        "whole models",
        (
            ("tests/test_models.py", None),
            ("tests/test_engine.py", None),
            ("tests/test_demo.py", None),
            ("tests/test_http_server.py", None),
            ("tests/test_http_online.py", None),
            ("tests/test_verl_weight_sync.py", None),
        ),
    ),
    # sglang.Engine(device="cpu") through the plugin: the smoke on every release (start-up on the plugin's runner,
    # disk and tensor updates bit-exact, a refused bucket), the whole RL loop where the sandbox spells it (0.5.23)
    ("engine", "sglang.Engine", (("tests/test_engine_smoke.py", None), ("tests/test_engine.py", None))),
    # issue #27: a bad or failed update changes nothing (refused before a byte, or put back), and empty forwards
    (
        "nothing_lost",
        "nothing lost",
        (
            ("tests/test_nothing_lost.py", None),
            ("tests/test_models.py::test_a_disk_update_that_fails_after_the_check", None),
            ("tests/test_models.py::test_one_bad_block_scale", None),
        ),
    ),
    ("empty_forward", "0-token forward", (("tests/test_empty_forward.py", None),)),
    # R3: the experts the fused runner's kernel routed, through SGLang's own capturer (layers on every release,
    # whole models and the HTTP server where they run)
    (
        "routed_experts",
        "routed experts (R3)",
        (
            ("tests/test_routed_experts.py", None),
            ("tests/test_models.py::test_routed_experts", None),
            ("tests/test_http_server.py::test_routed_experts", None),
        ),
    ),
    # update_weights_from_distributed (NCCL in production; gloo on CPU): the whole-model flow and the whole-bucket
    # refusal (README support table row)
    (
        "rl_distributed",
        "RL update: distributed",
        (
            ("tests/test_models.py", "distributed"),
            ("tests/test_validation.py::test_distributed", None),
            ("tests/test_distributed_updates.py", None),
            ("tests/test_http_server.py::test_nccl_style", None),
        ),
    ),
    # checkpoint-engine (Moonshot): many update_weights_from_ipc buckets, then SGLang's post hook (whole DeepSeek-V3
    # models and a NextN draft, 0.5.21+; before, a target and its draft's plugin-prepared layers behind the release's
    # own scheduler; its worker loop stood in on CPU: tests/support/checkpoint_engine.py)
    (
        "rl_ipc",
        "RL update: checkpoint-engine",
        (
            ("tests/test_models.py::test_checkpoint_engine_buckets_then_finish_equal_a_fresh_load", None),
            ("tests/test_draft_moe.py::test_ipc_updates", None),
            ("tests/test_draft_before_selector.py::test_checkpoint_engine", None),
        ),
    ),
    # custom weight loaders (--custom-weight-loader): verl 0.9.1's sparse delta sync with its own loader and sender
    # code, on sglang.Engine (before 0.5.23) and the CPU HTTP recipe (0.5.23); masked writes, NaN scales refused, a
    # raising loader answered with the weights put back, at the layer level on every release
    (
        "rl_custom_loader",
        "RL update: custom loader (verl delta)",
        (("tests/test_custom_loaders.py", None), ("tests/test_verl_delta.py", None)),
    ),
    # speculative-draft (NextN / MTP) MoE layers: a DeepSeek-V3 target and its draft ModelRunner, updated with
    # SGLang's runner selector (0.5.21+); before, the release's own scheduler and EAGLE worker over two plugin-prepared
    # layers (tensor / disk reach the draft exactly, a distributed update leaves it stale and the plugin says so)
    (
        "draft_moe",
        "speculative draft MoE",
        (("tests/test_draft_moe.py", None), ("tests/test_draft_before_selector.py", None)),
    ),
    # bytes that never pass through a loader (issue #53): P2P / RDMA writes inside a weight-update session (0.5.21+:
    # sessions that end with run_post_load), and new instances booting from a running one's memory (every release)
    ("loader_free", "RL update: loader-free session (P2P / RDMA)", (("tests/test_loader_free.py", None),)),
    ("remote_instance", "remote-instance boot", (("tests/test_remote_instance.py", None),)),
    # EPLB / redundant experts: SGLang's own rebalance moves plugin-prepared experts between slots, then RL updates
    # land in every replica (one layer on every release, whole models 0.5.21+), and between two EP ranks with its
    # P2P ops (gloo; 0.5.21+)
    (
        "eplb",
        "EPLB / redundant experts",
        (("tests/test_eplb_layers.py", None), ("tests/test_eplb.py", None), ("tests/test_eplb_p2p.py", None)),
    ),
)


@dataclass(frozen=True)
class Requirement:
    selector: str  # node-id prefix
    #: PEP 440 specifier on the SGLang release, "capability:<name>" (the plugin has a target of it here), or
    #: "flashinfer:<dotted name>" (the flashinfer this env imports has it: an oracle function or API of a newer
    #: flashinfer than the release pins)
    needs: str
    reason: str


REQUIREMENTS: tuple[Requirement, ...] = (
    Requirement(
        "tests/test_custom_loaders.py::test_the_plugins_layout_moves_never_go_through_a_replaced_copy[mxfp4_experts",
        ">=0.5.12",
        "Mxfp4FlashinferTrtllmMoEMethod (MXFP4 experts on an FP8 config: DeepSeek-V4, MiMo-V2) arrives "
        "upstream in 0.5.12",
    ),
    Requirement(
        "tests/test_custom_loaders.py::test_the_plugins_layout_moves_never_go_through_a_replaced_copy[nvfp4_online",
        ">=0.5.14",
        "--quantization nvfp4_online (layers/quantization/nvfp4_online.py) arrives upstream in 0.5.14",
    ),
    Requirement(
        "tests/test_custom_loaders.py::test_the_plugins_layout_moves_never_go_through_a_replaced_copy[nvfp4_online_tensor",
        ">=0.5.18",
        "--quantization modelopt_fp4 on a BF16 checkpoint (_ModelOptFp4OnlineConfig) arrives upstream in 0.5.18",
    ),
    Requirement(
        "tests/test_custom_loaders.py::test_nan_in_a_scale_or_an_online_source_is_refused_under_a_masking_loader[nvfp4_online",
        ">=0.5.14",
        "--quantization nvfp4_online (layers/quantization/nvfp4_online.py) arrives upstream in 0.5.14",
    ),
    Requirement(
        "tests/test_batched_writes.py::test_batched_writes_give_the_bytes_of_sglangs_per_tensor_loader[mxfp4_experts",
        ">=0.5.12",
        "Mxfp4FlashinferTrtllmMoEMethod (MXFP4 experts on an FP8 config: DeepSeek-V4, MiMo-V2) arrives "
        "upstream in 0.5.12",
    ),
    Requirement(
        "tests/test_batched_writes.py::test_a_disk_update_is_written_batched_with_the_bytes_of_sglangs_loader[mxfp4_experts",
        ">=0.5.12",
        "Mxfp4FlashinferTrtllmMoEMethod (MXFP4 experts on an FP8 config: DeepSeek-V4, MiMo-V2) arrives "
        "upstream in 0.5.12",
    ),
    Requirement(
        "tests/test_batched_writes.py::test_batched_writes_give_the_bytes_of_sglangs_per_tensor_loader[nvfp4_online",
        ">=0.5.14",
        "--quantization nvfp4_online (layers/quantization/nvfp4_online.py) arrives upstream in 0.5.14",
    ),
    Requirement(
        "tests/test_batched_writes.py::test_a_disk_update_is_written_batched_with_the_bytes_of_sglangs_loader[nvfp4_online",
        ">=0.5.14",
        "--quantization nvfp4_online (layers/quantization/nvfp4_online.py) arrives upstream in 0.5.14",
    ),
    Requirement(
        "tests/test_batched_writes.py::test_batched_writes_give_the_bytes_of_sglangs_per_tensor_loader[nvfp4_online_tensor",
        ">=0.5.18",
        "--quantization modelopt_fp4 on a BF16 checkpoint (_ModelOptFp4OnlineConfig) arrives upstream in 0.5.18",
    ),
    Requirement(
        "tests/test_batched_writes.py::test_a_disk_update_is_written_batched_with_the_bytes_of_sglangs_loader[nvfp4_online_tensor",
        ">=0.5.18",
        "--quantization modelopt_fp4 on a BF16 checkpoint (_ModelOptFp4OnlineConfig) arrives upstream in 0.5.18",
    ),
    Requirement(
        "tests/test_remote_instance.py::test_a_transfer_engine_boot_serves_exactly_what_the_seed_serves[mxfp4_experts",
        ">=0.5.12",
        "Mxfp4FlashinferTrtllmMoEMethod (MXFP4 experts on an FP8 config: DeepSeek-V4, MiMo-V2) arrives "
        "upstream in 0.5.12",
    ),
    Requirement(
        "tests/test_remote_instance.py::test_a_transfer_engine_boot_serves_exactly_what_the_seed_serves[nvfp4_online",
        ">=0.5.14",
        "--quantization nvfp4_online (layers/quantization/nvfp4_online.py) arrives upstream in 0.5.14",
    ),
    Requirement(
        "tests/test_remote_instance.py::test_a_transfer_engine_boot_serves_exactly_what_the_seed_serves[nvfp4_online_tensor",
        ">=0.5.18",
        "--quantization modelopt_fp4 on a BF16 checkpoint (_ModelOptFp4OnlineConfig) arrives upstream in 0.5.18",
    ),
    Requirement(
        "tests/test_mxfp4_experts_layer.py",
        ">=0.5.12",
        "Mxfp4FlashinferTrtllmMoEMethod (MXFP4 experts on an FP8 config: DeepSeek-V4, MiMo-V2) arrives "
        "upstream in 0.5.12",
    ),
    Requirement(
        "tests/test_layer_contract.py::test_one_expert_update_equals_a_fresh_load_in_place[mxfp4_experts",
        ">=0.5.12",
        "Mxfp4FlashinferTrtllmMoEMethod (MXFP4 experts on an FP8 config: DeepSeek-V4, MiMo-V2) arrives "
        "upstream in 0.5.12",
    ),
    Requirement(
        "tests/test_layer_contract.py::test_refused_write_leaves_every_byte[mxfp4_experts",
        ">=0.5.12",
        "Mxfp4FlashinferTrtllmMoEMethod (MXFP4 experts on an FP8 config: DeepSeek-V4, MiMo-V2) arrives "
        "upstream in 0.5.12",
    ),
    Requirement(
        "tests/test_layer_contract.py::test_checker_dequantizes_like_sglang_passes_a_correct_update_and_locates_a_flipped_byte[mxfp4_experts",
        ">=0.5.12",
        "Mxfp4FlashinferTrtllmMoEMethod (MXFP4 experts on an FP8 config: DeepSeek-V4, MiMo-V2) arrives "
        "upstream in 0.5.12",
    ),
    Requirement(
        "tests/test_layer_contract.py::test_concurrent_writes_with_a_flusher_equal_a_fresh_load[mxfp4_experts",
        ">=0.5.12",
        "Mxfp4FlashinferTrtllmMoEMethod (MXFP4 experts on an FP8 config: DeepSeek-V4, MiMo-V2) arrives "
        "upstream in 0.5.12",
    ),
    Requirement(
        "tests/test_checker.py::test_layout_aware_tolerance",
        ">=0.5.15",
        "WeightChecker.handle(action, allow_quant_error) (SGLang's tolerance for quantization error) arrives "
        "upstream in 0.5.15; before, every compare is exact",
    ),
    Requirement(
        "tests/test_rl_updates.py::test_begin_end_session",
        ">=0.5.21",
        "WeightUpdater.begin_weight_update/end_weight_update sessions do not exist upstream before 0.5.21",
    ),
    Requirement(
        "tests/test_bf16_layer.py::test_routed_scaling_factor_reaches_the_kernel",
        ">=0.5.23",
        "TopKConfig(routing_method_type=...) (the test's logits-path router) exists upstream from 0.5.23",
    ),
    Requirement(
        "tests/test_bf16_layer.py::test_sglang_restore_hooks_are_harmless",
        ">=0.5.21",
        "restore_weights_before_loading and begin/end_weight_update sessions arrive upstream in 0.5.21",
    ),
    Requirement(
        "tests/test_bf16_layer.py::test_prepared_bytes_equal_sglang_and_flashinfer_preparation_in_place[relu2",
        ">=0.5.13",
        "SGLang's own BF16 trtllm preparation lays out a non-gated w13 with the gated row order "
        "before 0.5.13 (no is_gated_act_gemm; its BF16 leaf is gated-silu-only on 0.5.11): no upstream oracle "
        "for non-gated BF16 there (flashinfer's is checked by test_checker's bf16-relu2 case)",
    ),
    Requirement(
        "tests/test_bf16_layer.py::test_prepared_bytes_equal_sglang_and_flashinfer",
        "flashinfer:fused_moe.api.ReLU2",
        "flashinfer.fused_moe.api.ReLU2 (the oracle's prepare_trtllm_bf16_weights API) is absent from the "
        "flashinfer 0.6.x this release pins",
    ),
    Requirement(
        "tests/test_checker.py::test_bf16_prepared_vs_checkpoint",
        "flashinfer:fused_moe.api.ReLU2",
        "flashinfer.fused_moe.api.ReLU2 (the oracle's prepare_trtllm_bf16_weights API) is absent from the "
        "flashinfer 0.6.x this release pins",
    ),
    Requirement(
        "tests/test_checker.py::test_other_formats_layout_aware_dequant_and_a_corrupted_update_located_through_sglang[fp8",
        "capability:fp8-prep",
        "the plugin's FP8 (per-tensor / block) preparation hooks are not registered on "
        "this release (builtins/fp8_hooks.py releases=)",
    ),
    Requirement(
        "tests/test_fp8_layer.py::test_per_tensor_bytes_and_scalars_match_flashinfer_prepare",
        "flashinfer:fused_moe.prepare.prepare_trtllm_fp8_per_tensor_weights",
        "the oracle, flashinfer's prepare_trtllm_fp8_per_tensor_weights, is absent from the flashinfer 0.6.14 / "
        "0.6.15.post1 this release pins (it arrives in 0.6.17)",
    ),
    Requirement(
        "tests/test_fp8_layer.py::test_block_bytes_equal_flashinfer_prepare",
        "flashinfer:fused_moe.prepare.prepare_trtllm_fp8_block_weights",
        "the oracle, flashinfer's prepare_trtllm_fp8_block_weights, is absent from the flashinfer 0.6.14 / "
        "0.6.15.post1 this release pins (it arrives in 0.6.17)",
    ),
    Requirement(
        "tests/test_fp8_layer.py::test_per_tensor_bytes_and_scalars_match_flashinfer_prepare[relu2]",
        "flashinfer:fused_moe.api.ReLU2",
        "the oracle, flashinfer's prepare_trtllm_fp8_per_tensor_weights, takes an activation (non-gated "
        "ReLU2) from flashinfer 0.7; the 0.6.x this release pins prepares gated SwiGLU weights only",
    ),
    Requirement(
        "tests/test_fp8_layer.py",
        "capability:fp8-prep",
        "the plugin's FP8 (per-tensor / block) preparation hooks are not registered on this release "
        "(builtins/fp8_hooks.py releases=)",
    ),
    Requirement(
        "tests/test_layer_contract.py::test_one_expert_update_equals_a_fresh_load_in_place[fp8_",
        "capability:fp8-prep",
        "the plugin's FP8 (per-tensor / block) preparation hooks are not registered on this release "
        "(builtins/fp8_hooks.py releases=)",
    ),
    Requirement(
        "tests/test_layer_contract.py::test_unservable_layer_on_explicit_trtllm_is_one_clear_error[fp8_",
        "capability:fp8-prep",
        "the plugin's FP8 (per-tensor / block) preparation hooks are not registered on this release "
        "(builtins/fp8_hooks.py releases=)",
    ),
    Requirement(
        "tests/test_layer_contract.py::test_without_emulator_on_cpu_the_runner_says_what_to_do[fp8_",
        "capability:fp8-prep",
        "the plugin's FP8 (per-tensor / block) preparation hooks are not registered on this release "
        "(builtins/fp8_hooks.py releases=)",
    ),
    Requirement(
        "tests/test_checker.py",
        "capability:weight-check",
        "the plugin's weight-checker hooks are not registered on this release (builtins/checker_hooks.py, "
        "checker_legacy_hooks.py)",
    ),
    Requirement(
        "tests/test_selection.py::test_activation_table_matches_sglang",
        "capability:auto-select",
        "the selection tables describe the releases the auto-select hook serves (compat/platform.py ADAPTERS)",
    ),
    Requirement(
        "tests/test_selection.py::test_a2a_table_matches_sglang",
        "capability:auto-select",
        "the selection tables describe the releases the auto-select hook serves (compat/platform.py ADAPTERS)",
    ),
)


#: fixtures that stand for a capability (every test using one needs it)
FIXTURE_REQUIREMENTS = {
    "sglang_runs": (
        "capability:auto-select",
        "the plugin's auto-select hook is not registered on this release (compat/platform.py ADAPTERS)",
    ),
}


def installed_release() -> Version | None:
    from sglang_trtllm_moe.compat.releases import installed_version

    v = installed_version()
    return None if v is None else Version(v.base_version)


def plugin_capabilities(release: Version) -> set[str]:
    """Capabilities for which the built-ins register at least one target applicable on `release`."""
    import importlib

    from sglang_trtllm_moe.plugin import builtin_modules

    caps: set[str] = set()
    for mod in builtin_modules():
        targets = []
        importlib.import_module(mod).register_sglang_hooks(register=targets.append, release=release)
        caps.update(t.capability for t in targets if t.applies_to(release))
    return caps


def flashinfer_has(name: str) -> bool:
    """The flashinfer this env imports defines `flashinfer.<name>` (imported only when a selected test asks)."""
    if name not in _FLASHINFER_HAS:
        import pkgutil

        try:
            pkgutil.resolve_name(f"flashinfer.{name}")
            _FLASHINFER_HAS[name] = True
        except Exception:  # noqa: BLE001 - not importable here, or not defined by this flashinfer
            _FLASHINFER_HAS[name] = False
    return _FLASHINFER_HAS[name]


_FLASHINFER_HAS: dict[str, bool] = {}


def unmet(needs: str, release: Version, caps: set[str]) -> bool:
    if needs.startswith("capability:"):
        return needs.split(":", 1)[1] not in caps
    if needs.startswith("flashinfer:"):
        return not flashinfer_has(needs.split(":", 1)[1])
    return not SpecifierSet(needs).contains(release, prereleases=True)


def skip_reason(needs: str, reason: str, release: Version, caps: set[str]) -> str | None:
    """None when the requirement holds on `release`; else the skip reason the matrix reports: the release, whether
    the capability is absent upstream or not provided by the plugin there, why, and the requirement."""
    if not unmet(needs, release, caps):
        return None
    what = "not provided by the plugin" if needs.startswith("capability:") else "absent upstream"
    return f"sglang {release}: {what}: {reason} (needs {needs})"


def flashinfer_missing_reason(release) -> str | None:
    if importlib.util.find_spec("flashinfer") is not None:
        return None
    return (
        f"sglang {release}: flashinfer (the oracle / SGLang's trtllm prep) cannot be imported on CPU in this env: "
        "the flashinfer-python this release pins (< 0.6.14) asserts libcudart at import, and this env lacks the "
        "oracle flashinfer that ci/make-env adds to such envs (ensure_oracle; ci/releases.tsv)"
    )


# ---- pytest plugin ---------------------------------------------------------------------------------------------

try:
    import pytest
except ImportError:  # imported outside a test run (ci/matrix reads the tables only)
    pytest = None

if pytest is not None:

    def pytest_configure(config):
        config.addinivalue_line(
            "markers",
            "sglang(spec, reason=''): the SGLang releases this test applies to (skipped elsewhere, with "
            "the reason); spec may be 'capability:<name>'",
        )

    def pytest_collection_modifyitems(config, items):
        release = installed_release()
        if release is None:
            return
        caps = plugin_capabilities(release)
        for item in items:
            needs = [(m.args[0], m.kwargs.get("reason", "")) for m in item.iter_markers("sglang")]
            needs += [(r.needs, r.reason) for r in REQUIREMENTS if item.nodeid.startswith(r.selector)]
            needs += [FIXTURE_REQUIREMENTS[f] for f in getattr(item, "fixturenames", ()) if f in FIXTURE_REQUIREMENTS]
            for spec, reason in needs:
                why = skip_reason(spec, reason, release, caps)
                if why is not None:
                    item.add_marker(pytest.mark.skip(reason=why))
                    break

    def _flashinfer_absent(exc) -> str | None:
        if isinstance(exc, ModuleNotFoundError) and (exc.name or "").split(".")[0] == "flashinfer":
            return flashinfer_missing_reason(installed_release())
        return None

    def _skip_where_flashinfer_cannot_load(item):
        try:
            return (yield)
        except ModuleNotFoundError as e:
            reason = _flashinfer_absent(e)
            if reason:
                pytest.skip(reason)
            raise

    # the same wrapper for a test's set-up and its call
    pytest_runtest_setup = pytest.hookimpl(wrapper=True)(_skip_where_flashinfer_cannot_load)
    pytest_runtest_call = pytest.hookimpl(wrapper=True)(_skip_where_flashinfer_cannot_load)

    @pytest.hookimpl(wrapper=True)
    def pytest_make_collect_report(collector):
        """A test module that imports flashinfer at the top is skipped as a whole where flashinfer cannot load."""
        rep = yield
        if rep.failed and isinstance(collector, pytest.Module) and "No module named 'flashinfer" in str(rep.longrepr):
            reason = flashinfer_missing_reason(installed_release())
            if reason:
                rep.outcome = "skipped"
                rep.longrepr = (str(collector.path), 0, f"Skipped: {reason}")
        return rep


# ---- report: JUnit results per release -> docs/compat.json, docs/COMPAT.md, README table ------------------------


def _nodeid(classname: str, name: str, root) -> str:
    """JUnit's dotted classname back to a pytest node id (tests.test_x.TestY + name -> tests/test_x.py::TestY::name)."""
    import os

    parts = classname.split(".") if classname else []
    for i in range(len(parts), 0, -1):
        path = "/".join(parts[:i]) + ".py"
        if os.path.exists(os.path.join(root, path)):
            return "::".join([path, *parts[i:], name])
    if not parts and name.startswith("tests."):  # a module skipped as a whole at collection
        return name.replace(".", "/") + ".py"
    return "::".join([*parts, name])


def read_junit(path, root) -> dict:
    import xml.etree.ElementTree as ET

    out = {}
    for tc in ET.parse(path).getroot().iter("testcase"):
        nid = _nodeid(tc.get("classname", ""), tc.get("name", ""), root)
        outcome, reason = "passed", ""
        for child in tc:
            if child.tag in ("failure", "error"):
                outcome, reason = "failed", (child.get("message") or "")[:300]
            elif child.tag == "skipped":
                xfail = child.get("type") == "pytest.xfail"
                outcome = "xfailed" if xfail else "skipped"
                reason = child.get("message") or ""
                if reason.startswith("xfail-reason: ") or reason.startswith("Skipped: "):
                    reason = reason.split(": ", 1)[1]
        out[nid] = {"outcome": outcome, "reason": reason}
    return out


def _selected(nodeid: str, selectors) -> bool:
    for prefix, text in selectors:
        if (nodeid == prefix or nodeid.startswith(prefix)) and (text is None or text in nodeid):
            return True
    return False


def _short(reason: str, release: str) -> str:
    for pre in (f"sglang {release}: ",):
        if reason.startswith(pre):
            reason = reason[len(pre) :]
    return reason.strip()


SM100_SKIP = "needs an NVIDIA Blackwell GPU"


def capability_cells(tests: dict, release: str) -> dict:
    cells = {}
    for key, _title, selectors in CAPABILITIES:
        # real-kernel tests (requires_sm100) are n/a on every CPU row alike: they say nothing about the release
        mine = {n: r for n, r in tests.items() if _selected(n, selectors) and not r["reason"].startswith(SM100_SKIP)}
        if not mine:
            cells[key] = {"status": "no test", "detail": "no test of this capability ran on this release"}
            continue
        by = {}
        for n, r in mine.items():
            by.setdefault(r["outcome"], []).append(n)
        reasons = sorted({_short(mine[n]["reason"], release) for n in by.get("skipped", []) + by.get("xfailed", [])})
        if by.get("failed"):
            names = sorted(n.split("::", 1)[-1] for n in by["failed"])
            cells[key] = {
                "status": "FAIL",
                "detail": f"{len(names)} failed: " + ", ".join(names[:4]) + (" ..." if len(names) > 4 else ""),
            }
        elif by.get("xfailed"):
            cells[key] = {"status": "bug", "detail": "; ".join(reasons)}
        elif by.get("passed") and by.get("skipped"):
            cells[key] = {
                "status": "pass (partly n/a)",
                "detail": f"{len(by['passed'])} passed, {len(by['skipped'])} n/a: " + "; ".join(reasons),
            }
        elif by.get("passed"):
            cells[key] = {"status": "pass", "detail": f"{len(by['passed'])} tests passed"}
        else:
            cells[key] = {"status": "n/a", "detail": "; ".join(reasons)}
    return cells


def releases_tsv(path="ci/releases.tsv") -> list[dict]:
    """The rows of ci/releases.tsv in file order: {"release": name, "sglang": the SGLang release, "lane": bool,
    "transformers", "tvm_ffi", "openai", "flashinfer", "extra"}. A lane (named <release>+flashinfer-<version>) is
    its release's env with another flashinfer; its "=" columns are the release row's."""
    rows: list[dict] = []
    with open(path) as f:
        for line in f:
            if line.strip() and not line.startswith("#"):
                name, tf, tvm, oai, fi, extra = (line.split() + ["-"] * 6)[:6]
                row = {"release": name, "sglang": name.split("+")[0], "lane": "+" in name}
                row.update(transformers=tf, tvm_ffi=tvm, openai=oai, flashinfer=fi, extra=extra)
                if row["lane"]:
                    base = next(r for r in rows if r["release"] == row["sglang"])
                    row.update({k: base[k] for k, v in row.items() if v == "="})
                rows.append(row)
    return rows


def tested_versions(path="ci/releases.tsv") -> dict[str, tuple[str, ...]]:
    """SGLang release -> the flashinfer versions the matrix runs it with (compat/releases.py TESTED)."""
    tested: dict[str, tuple[str, ...]] = {}
    for r in releases_tsv(path):
        fi = () if r["flashinfer"] == "-" else (r["flashinfer"],)
        tested[r["sglang"]] = tested.get(r["sglang"], ()) + fi
    return tested


TESTED_BEGIN = "# >>> tested (generated from ci/releases.tsv by ci/add-release"
TESTED_END = "# <<< tested"


def render_tested(path="ci/releases.tsv") -> str:
    """compat/releases.py's TESTED dict, as ruff formats it."""
    lines = ["TESTED: dict[str, tuple[str, ...]] = {"]
    for rel, fis in tested_versions(path).items():
        inner = ", ".join(f'"{v}"' for v in fis) + ("," if len(fis) == 1 else "")
        lines.append(f'    "{rel}": ({inner}),')
    return "\n".join([*lines, "}"]) + "\n"


def tested_block(py_text: str) -> tuple[int, int]:
    """(start, end) offsets of the TESTED dict inside the generated block of compat/releases.py's text."""
    begin = py_text.index(TESTED_BEGIN)
    start = py_text.index("TESTED: dict", begin)
    end = py_text.index(TESTED_END, start)
    return start, end


def write_tested(py_path="sglang_trtllm_moe/compat/releases.py", tsv="ci/releases.tsv") -> bool:
    """Regenerate the TESTED dict from the tsv; True if the file changed."""
    with open(py_path) as f:
        text = f.read()
    start, end = tested_block(text)
    new = text[:start] + render_tested(tsv) + text[end:]
    if new != text:
        with open(py_path, "w") as f:
            f.write(new)
    return new != text


def _rows(releases_tsv_path):
    return [
        {k: r[k] for k in ("release", "transformers", "flashinfer", "extra")} | ({"lane": True} if r["lane"] else {})
        for r in releases_tsv(releases_tsv_path)
    ]


SYMBOL = {
    "pass": "pass",
    "pass (partly n/a)": "pass*",
    "n/a": "n/a",
    "bug": "bug",
    "FAIL": "**FAIL**",
    "no test": "-",
    "not run": "-",
}


def render_markdown(data: dict) -> str:
    # the capabilities the results know (JSON written before a capability was added has no cell for it)
    known = {k for row in data["releases"] for k in row.get("capabilities", {})}
    caps = [(k, t) for k, t, _ in CAPABILITIES if k in known or not known]
    head = "| release | " + " | ".join(t for _, t in caps) + " | flashinfer | tests |"
    lines = [head, "|" + "---|" * (len(caps) + 3)]
    notes: list[str] = []

    def note(text: str) -> str:
        if text not in notes:
            notes.append(text)
        return f"[{notes.index(text) + 1}]"

    for row in data["releases"]:
        rel = row["release"]
        if row.get("env_error") or "capabilities" not in row:
            lines.append(
                f"| {rel} | "
                + " | ".join("not run" for _ in caps)
                + f" | {row.get('flashinfer', '?')} | {'env build failed' if row.get('env_error') else 'not run'} |"
            )
            continue
        cells = []
        for k, _ in caps:
            c = row["capabilities"].get(k, {"status": "not run", "detail": ""})
            sym = SYMBOL.get(c["status"], c["status"])
            cells.append(sym if c["status"] in ("pass", "not run") else f"{sym} {note(c['detail'])}")
        t = row.get("timing", {})
        counts = row.get("counts", {})
        tests = (
            f"{row.get('scope', '?')}: {counts.get('passed', 0)} pass, {counts.get('skipped', 0)} n/a"
            + (f", {counts['failed']} fail" if counts.get("failed") else "")
            + (f", {counts['xfailed']} bug" if counts.get("xfailed") else "")
            + (f"; {t.get('tests_s', '?')} s" if t else "")
        )
        lines.append(f"| {rel} | " + " | ".join(cells) + f" | {row.get('flashinfer', '?')} | {tests} |")
    out = "\n".join(lines) + "\n"
    full = data.get("last_full_run")
    if full:
        wheel = full.get("wheel")
        checked = ""
        if wheel:
            checked = f", the wheel check {'passed' if wheel['rc'] == 0 else 'FAILED'} in {wheel['tests_s']} s"
        if full.get("builder_overlaps_tests"):  # ci/matrix's background builder (since the lanes)
            lanes = sum("+" in r for r in full["releases"])
            out += (
                f"\nLast full `ci/matrix` run ({len(full['releases']) - lanes} releases, {lanes} lane(s){checked}): "
                f"{full['total_s']} s wall on 2 cores; env builds (or reuse) + plugin installs took {full['env_s']} s "
                "in the background builder, overlapping the tests.\n"
            )
        else:
            out += (
                f"\nLast full `ci/matrix` run (all {len(full['releases'])} releases): {full['total_s']} s wall on 2 "
                f"cores, {full['env_s']} s of it env reuse + plugin install (envs cached; a cold build adds about "
                "1 min for the shared base and 0.5-2 min per release).\n"
            )
    part = data.get("last_partial_run")
    if part:
        out += f"Last partial run: {', '.join(part['releases'])} in {part['total_s']} s.\n"
    if notes:
        out += "\n" + "\n".join(f"{i + 1}. {n}" for i, n in enumerate(notes)) + "\n"
    return out


MD_HEADER = """# SGLang compatibility matrix

Generated by `ci/matrix` (do not edit by hand, except the hand-written sections at the end: [what the plugin cannot
serve](#what-the-plugin-cannot-serve), [log lines](#log-lines-and-what-they-mean)): one CPU env per SGLang release (`ci/make-env`, pins in
`ci/releases.tsv`), the plugin from this checkout, real SGLang layers and update paths driven on CPU. Raw results
per test: `docs/compat.json`.

How a cell is computed: the tests that prove a capability are listed in `tests/support/matrix.py`
(`CAPABILITIES`). **pass**: all of them passed. **pass\\***: those that apply passed, others do not apply (note).
**n/a**: none applies on that release; the note says whether it is absent upstream or not (yet) provided by the
plugin, or that flashinfer (SGLang's own trtllm preparation, and the oracle) cannot be imported on CPU there.
**bug**: a known bug, expected to fail (note names it). **FAIL**: a test failed (note names it). The newest
release runs the whole suite; older ones the SGLang-dependent subset (`ci/matrix`), so their counts are smaller; a
lane (`<release>+flashinfer-<version>`: that release with the newest flashinfer) runs the tests that compare against
flashinfer (`ci/matrix` `LANE_TESTS`), so its "-" cells are capabilities proven on its release's row.
Real-kernel tests (`requires_sm100`) are left out of the cells: no CPU row can run them.

## Release differences the plugin (or the CPU test runtime) handles

Read from the wheels (`pip download --no-deps sglang==V`) and confirmed by the matrix:

| what | releases | handled by |
|---|---|---|
| flashinfer pin asserts `libcudart` at import (`flashinfer.comm.cuda_ipc`, made lazy in 0.6.14) | 0.5.11-0.5.15 (0.6.8.post1, 0.6.11.post1, 0.6.12) | env without the pin; the newest flashinfer (the last row's) on the path as an oracle, not the release's pin (`ci/make-env` `ensure_oracle`; docs/TESTING.md says what it changes) |
| FP8 per-tensor / block on flashinfer_trtllm: SGLang requantizes w1/w3 and replaces the Parameters | 0.5.11-0.5.22 | the plugin prepares in place on every release (`builtins/fp8_hooks.py`); 0.5.18's apply reads `layer._flashinfer_trtllm_gemm1_*` (set like SGLang does) |
| `Fp8MoEMethod` allocates non-gated w13 with 2I rows | < 0.5.19 | allocated at the kernel's I rows (below) |
| weight checker: comparator module / module-level `_postprocess_tensors` + `_check_tensors` (bitwise, `.cuda()`); `WeightChecker(model_runner)` | >= 0.5.15 / < 0.5.15; < 0.5.16 | `builtins/checker_hooks.py` / `checker_legacy_hooks.py` targets per range |
| `--moe-runner-backend` resolution: pipeline / `__post_init__` with the overrides stash / `__post_init__` with in-place field writes (the model rules overwrite the user's value) | >= 0.5.19 / 0.5.15-0.5.18 / < 0.5.15 | `compat/platform.py` (ADAPTERS, SERVER_ARGS_FIELD_WRITES: the requested value recorded before the model rules) |
| FlashInfer A2A has a TRT-LLM (routed) runner | >= 0.5.15 (before: SGLang asserts flashinfer_cutlass) | selection never picks a TRT-LLM runner under FlashInfer A2A there |
| ModelOpt NVFP4 maps gelu | >= 0.5.13 (before: SGLang asserts silu / relu2) | selection refuses gelu there |
| per-tensor w13 scales (`weight_scale_2`) stored [Up, Gate] by the trtllm loader's w1/w3 swap, read as [Gate, Up] by SGLang's own prep (gate/up alphas swapped when they differ) | 0.5.11-0.5.22 | `formats/nvfp4.w13_scales_up_first` reads them as stored |
| `MoeRunnerConfig.layer` absent | < 0.5.16 | `FusedMoE.__init__` AFTER hook sets it |
| `w13/w2_blockscale_swizzled` are registered Parameters (placeholders) on the trtllm path | 0.5.11-0.5.12 (None from 0.5.13) | kept, so every registered parameter stays the same object |
| FusedMoE rounds the intermediate up to 128 for flashinfer_trtllm (per half for w13) | < 0.5.23 (0.5.23 aligns NVFP4 in create_weights) | nothing to do: prepared in place at SGLang's size |
| weight updates live in `ModelRunner` / `WeightUpdater`; `update_weights_from_distributed` renamed `load_weights_from_distributed`; begin/end sessions | < 0.5.16 / >= 0.5.16; 0.5.21; >= 0.5.21 | `builtins/weight_updates.py` targets per range |
| platform facts: `is_sm100_supported()`-style globals / `runtime_context.override_platform` | < 0.5.19 / >= 0.5.19 | `compat/fake_platform.py` (`explain --sm`, the CPU sandbox) |
| ServerArgs published by `set_global_server_args_for_scheduler` / `publish(ranks=SpawnRanks)` | < 0.5.21 / >= 0.5.21 | `sandbox/runtime.py` (`sandbox/releases.py` PUBLISH_WITH_RANKS) |
| `swizzle_blockscale` ends in `.cuda()` (NVFP4 `create_weights` cannot run without a GPU) | < 0.5.20 | `sandbox/runtime.py` neutralises `.cuda()` for that call on CUDA-less boxes only |
| MXFP8 leaf quantizes with `flashinfer.mxfp8_quantize` / `fp8_utils.flashinfer_mxfp8_quantize`; SwiGLU alpha/beta/clamp tensors (`_flashinfer_trtllm_gemm1_*`) | < 0.5.17 / >= 0.5.17; >= 0.5.18 | `formats/mxfp8.py`, `compat/features.py` (MXFP8_*) |
| non-gated MXFP8 w13 allocated with 2I rows and sliced at SGLang's prep (new storage) | < 0.5.19 | left to SGLang with one log line |
| FusedMoE's `MoeRunnerConfig` is built without `layer` (the plugin runner finds MXFP8 layers through it; NVFP4's methods set it) | 0.5.16-0.5.21 | `FusedMoE.__init__` AFTER hook sets it |
| FP4 experts on an FP8 config (`Mxfp4FlashinferTrtllmMoEMethod`); its own prep pads I to 128 | >= 0.5.12; >= 0.5.21 | `builtins/mx_hooks.py`: storage allocated padded from create_weights where the loader can fill it (>= 0.5.17) |
| gpt-oss MXFP4 pads I and H to 256 (128 from 0.5.17), scales filled 0 (127 from 0.5.17); SM100 path through `Mxfp4MoEMethod.apply` / the flashinfer_trtllm MXFP4 leaf | < 0.5.17; < 0.5.20 / >= 0.5.20 | prepared in place at SGLang's size; the `apply` hook covers both |
| .post releases (0.5.12.post1, 0.5.13.post1, 0.5.15.post1) | - | no row: their `srt/` diffs touch nothing the plugin hooks |

"""  # noqa: E501  markdown: each table row must stay one line, rendered verbatim into docs/COMPAT.md


def defer_markdown() -> str:
    """The formats' defer verdicts (`upstream_verdicts`, compat/defer.py) as a table: where SGLang's own preparation
    is right and the plugin defers, with evidence."""
    from sglang_trtllm_moe.formats import FORMATS

    lines = [
        "## Where SGLang is right: the defer table (compat/defer.py)",
        "",
        "Measured with the plugin switched off (`python -m tests.support.upstream_rl FORMAT`, re-checked on every "
        "release by `tests/test_defer.py`): a one-expert disk update, a whole disk update, a tensor update (in a "
        "begin/end session where the release has them) and another one-expert tensor update, each compared with a "
        "fresh load byte for byte, storage, Parameters and weight_loaders checked. **SGLang** = the plugin leaves "
        "preparation to SGLang and only watches (validation of writes, the emulator); **plugin** = the plugin "
        "prepares in place.",
        "",
        "| format | releases | who prepares | evidence |",
        "|---|---|---|---|",
    ]
    for fmt in FORMATS:
        for v in fmt.upstream_verdicts:
            who = "SGLang" if v.upstream_correct else "plugin"
            lines.append(f"| {fmt.name} | {v.releases} | {who} | {v.evidence} |")
    return "\n".join(lines) + "\n"


MD_CONTRACT = """
## SGLang's own unit tests, with and without the plugin

SGLang's CPU unit tests for the code the plugin hooks (upstream `test/registered/unit/`: `plugins/test_hook_registry.py`,
`plugins/test_load_plugins.py`, `server_args/test_resolution_hook_registry.py`, `utils/test_weight_checker_comparator.py`,
`layers/quantization/test_flashinfer_trtllm_bf16_moe_reload.py`, `layers/quantization/test_compressed_tensors_fp4_moe_scheme.py`,
`model_executor/model_runner_components/test_weight_updater.py` and `test_weight_updater_post_load_weights.py`) were run
against every release's env twice, with `SGLANG_TRTLLM_MOE_DISABLE=1` and with the plugin loaded through SGLang's own
`load_plugins()` (SGLang's files are read and run from a scratch directory, never copied here). Each file runs where its
API exists (the BF16 reload tests need 0.5.23's session API; the compressed-tensors scheme tests 0.5.22+; the
resolution hooks 0.5.20+); tests that need CUDA fail with and without the plugin alike.

Result: on every release 0.5.11 - 0.5.23 no test passes without the plugin and fails with it. Before this release of
the plugin, five BF16 reload tests (eight runs with subtests) failed only with the plugin on 0.5.23: the plugin read
runner-config fields a stand-in config does not have (now: a layer the plugin cannot read goes back to SGLang's own
code), and it replaced SGLang's BF16 preparation where SGLang is right (now: 0.5.23 BF16 is SGLang's own, see the defer
table) and kept 3-D parameters where SGLang shows them 4-D (now: the same 4-D view of the same storage). Run again
after whole-request validation landed (2026-12-01, every release): one more test failed only with the plugin on
0.5.16 - 0.5.19, `test_weight_updater_post_load_weights.py::test_model_without_hook_is_noop` (a model with no
`load_weights`, updated by direct writes: the plugin's request check read the attribute); now a model with nothing of
the plugin's in it goes to SGLang unchanged (`tests/test_validation.py`), and every release is back to no difference.

## Where the plugin changes what SGLang observes, and why

Where the plugin prepares a layer itself (the defer table says SGLang is wrong there), it keeps SGLang's parameter
names, shapes and dtypes, except:

| what | SGLang | the plugin | why |
|---|---|---|---|
| FP8 per-tensor scales (ModelOpt FP8, `fp8` static) | requantizes w1/w3 to one scale; `w13_weight_scale` per expert, input scales reduced to scalars; new Parameters | keeps the loaded bytes and per-shard scales ([E, 2]) and passes separate gate and up scalars to the kernel; same Parameters | no precision lost the kernel does not ask for; the next RL update needs the Parameters and their weight_loader |
| compressed-tensors NVFP4 parameter names | renames `w13_weight_packed` / `w2_weight_packed` to `w13_weight` / `w2_weight` and deletes the originals | keeps the `*_packed` Parameters and registers the kernel names as aliases of the same objects | a reload by checkpoint name must find its parameter |
| compressed-tensors NVFP4 non-gated GEMM1 | allocated with 2I rows | allocated with I rows (the kernel's shape) before anything is loaded | the relu2 kernel reads I rows |
| NVFP4 per-tensor w13 scales, 0.5.11 - 0.5.22 | stored [up, gate] by the trtllm loader, read as [gate, up] by SGLang's own prep | read as stored | SGLang's alphas are swapped whenever the gate and up scales differ |
| where hooks are visible | `HookRegistry._hooks` lists every registered target after `load_plugins()` | a target is registered when its module is imported | start-up stays free in processes that never build a MoE layer; `doctor` imports the hooked modules to prove every target lands |
| MXFP4-expert scale Parameters (DeepSeek-V4 / MiMo-V2, `flashinfer_mxfp4`) | float32 until its prep, then new `float8_e8m0fnu` Parameters (and new padded storage, 0.5.21+) without `weight_loader` | `float8_e8m0fnu` from create_weights on (byte 127 = 1.0 until loaded); weights int8, allocated padded per half when I % 128 != 0 (0.5.17+) | SGLang's loader writes a float32 or e8m0 scale with `copy_`, the same value conversion as its `.to(e8m0)` (measured equal on CPU and H200): SGLang's bytes, one Parameter and storage for the layer's life, 1/4 of the pre-prep scale memory; code that rebinds `param.data` to a new float32 tensor would break it (none in SGLang does) |
| gpt-oss MXFP4 biases and scales (`flashinfer_mxfp4`, SM100) | bf16 biases widened to fp32 and scales rebound to `float8_e4m3fn` in new Parameters at prep (its reload then raises TypeError, or value-converts every scale byte) | fp32 biases from create_weights on, uint8 scale Parameters kept (the kernel gets an e4m3 view of the same storage) | storage and loaders stable across updates; an fp32 bias from a trainer is kept exactly (SGLang rounds it to bf16) |
| gpt-oss `gemm1_alpha/beta/clamp_limit` | sized by the global expert count <= 0.5.16 | sized by the local expert count on every release | EP > 1 (the kernel indexes local experts) |
| MXFP4-expert output scales, MXFP8 SwiGLU tensors | re-registered (new storage) at every prep | made once, updated in place | storage stable for CUDA graphs |
| `Fp8MoEMethod` non-gated (relu2) per-tensor w13 on flashinfer_trtllm, < 0.5.19 | allocated [E, 2I, H] (`is_concat=True`): the kernel reads an uninitialised second half | re-allocated [E, I, H] right after `create_weights`, same attributes (weight_loader, ...), before anything is loaded | the kernel's shape (0.5.19+ SGLang allocates it so itself); SGLang's own path there is broken, so nothing depends on 2I |
| ModelOpt NVFP4 on a global `auto` (Blackwell), 0.5.16+ | `create_moe_runner` runs flashinfer_trtllm while the weights are laid out for CUTLASS (0.5.16-0.5.20 NotImplementedError, 0.5.21+ AttributeError `g1_scale_c` at the first forward) | right after `create_moe_runner`, the method's `enable_flashinfer_trtllm_moe` / `use_flashinfer_trtllm_weight_layout` and the layer's `use_flashinfer_trtllm_moe` follow the runner SGLang resolved; an intermediate size not allocated for that kernel is a `TrtllmLayerError` at construction | lay out for the runner that actually runs; SGLang's choice is read, not repeated |
| weight checker, 0.5.11 - 0.5.14 | compares every tensor bitwise (max/mean error only); 0.5.11 asserts on float32 FP8 block scales | plugin-laid-out weights compared by the plugin (raw or layout-aware, expert/row/col); SGLang-prepared FP8 block layers on 0.5.11 dequantized as 0.5.12 does; NVFP4 placeholders (0.5.11-0.5.12) reported, not compared; everything else is SGLang's own compare | a laid-out layer must compare correctly, and a mismatch must say where |
"""  # noqa: E501  markdown: each table row must stay one line, rendered verbatim into docs/COMPAT.md


def report(out_dir, releases_tsv, json_path, md_path, readme=None, total_s=None, root=".") -> dict:
    import glob
    import json
    import os

    data = {"releases": []}
    if os.path.exists(json_path):
        with open(json_path) as f:
            data = json.load(f)
    old = {r["release"]: r for r in data.get("releases", [])}
    rows = []
    for row in _rows(releases_tsv):
        rel = row["release"]
        timing_f = os.path.join(out_dir, f"timing-{rel}.json")
        junit_f = os.path.join(out_dir, f"junit-{rel}.xml")
        if not os.path.exists(timing_f):
            rows.append(old.get(rel, row))  # not run this time: keep the last result
            continue
        with open(timing_f) as f:
            timing = json.load(f)
        new = {**row, "timing": timing, "scope": timing.get("scope")}
        if timing.get("env_error") or not os.path.exists(junit_f):
            new["env_error"] = True
        else:
            tests = read_junit(junit_f, root)
            counts = {}
            for r in tests.values():
                counts[r["outcome"]] = counts.get(r["outcome"], 0) + 1
            # per test "outcome" or "outcome: reason #i" (reasons listed once per release): small enough to diff
            reasons = sorted({r["reason"] for r in tests.values() if r["reason"]})
            compact = {
                n: r["outcome"] + (f" #{reasons.index(r['reason'])}" if r["reason"] else "")
                for n, r in sorted(tests.items())
            }
            sglang = rel.split("+")[0]  # a lane's skip reasons name its SGLang release
            new.update(tests=compact, reasons=reasons, counts=counts, capabilities=capability_cells(tests, sglang))
        rows.append(new)
    previous = data
    data = {
        "generated_by": "ci/matrix",
        "capabilities": [{"key": k, "title": t} for k, t, _ in CAPABILITIES],
        "releases": rows,
    }
    for k in ("last_full_run", "last_partial_run"):
        if k in previous:
            data[k] = previous[k]
    if total_s is not None:
        ran = sorted(os.path.basename(p)[7:-5] for p in glob.glob(os.path.join(out_dir, "timing-*.json")))
        envs = 0
        for rel in ran:
            with open(os.path.join(out_dir, f"timing-{rel}.json")) as f:
                envs += json.load(f).get("env_s", 0)
        run = {"total_s": total_s, "env_s": envs, "releases": ran, "builder_overlaps_tests": True}
        wheel_f = os.path.join(out_dir, "wheel.json")
        if os.path.exists(wheel_f):  # ci/wheel-check's job: the built wheel installed and checked
            with open(wheel_f) as f:
                run["wheel"] = json.load(f)
        data["last_full_run" if set(ran) >= {r["release"] for r in rows} else "last_partial_run"] = run
    with open(json_path, "w") as f:
        json.dump(data, f, indent=0, sort_keys=True)
        f.write("\n")
    write_docs(data, md_path, readme)
    return data


#: docs/COMPAT.md's hand-written part starts at this line: every rendering keeps it, and what follows it, as it is
HAND_WRITTEN = "<!-- hand-written below this line: ci/matrix and `python -m tests.support.matrix render` keep it -->"

SUPPORT_HEADER = """## The README's support table, every row

The README shows short labels, one sentence for the rows that are yes on every release, and notes cut short; here is
each row with its whole question and each note whole (`tests/support/support_table.py`).

"""


def write_docs(data: dict, md_path, readme=None) -> None:
    """docs/COMPAT.md (the per-capability matrix with its notes, for maintainers; its hand-written part kept) and the
    README's user-facing support table, from the results in `data` (docs/compat.json)."""
    from .support_table import render as render_support
    from .support_table import render_full

    kept = ""
    try:
        with open(md_path) as f:
            text = f.read()
        if HAND_WRITTEN in text:
            kept = "\n" + text[text.index(HAND_WRITTEN) :]
    except FileNotFoundError:
        pass
    table = render_markdown(data)
    with open(md_path, "w") as f:
        f.write(MD_HEADER + table + "\n" + SUPPORT_HEADER + render_full(data) + "\n")
        f.write(defer_markdown() + MD_CONTRACT + kept)
    if readme:
        _update_readme(readme, render_support(data))


def render(json_path, md_path, readme=None) -> dict:
    """Re-render docs/COMPAT.md and the README table from docs/compat.json as it is: no test runs, no JSON change."""
    import json

    with open(json_path) as f:
        data = json.load(f)
    write_docs(data, md_path, readme)
    return data


BEGIN, END = "<!-- support-table:begin (generated by ci/matrix) -->", "<!-- support-table:end -->"


def _update_readme(path, table: str) -> None:
    with open(path) as f:
        text = f.read()
    if BEGIN not in text or END not in text:
        return  # the README's "What works on my release" section carries the markers; nothing to do without them
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    with open(path, "w") as f:
        f.write(head + BEGIN + "\n" + table + END + tail)


def main(argv=None) -> int:
    import argparse

    ap = argparse.ArgumentParser(prog="python -m tests.support.matrix")
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("report", help="JUnit results of ci/matrix -> JSON + Markdown")
    r.add_argument("out_dir")
    r.add_argument("--releases", default="ci/releases.tsv")
    r.add_argument("--json", default="docs/compat.json")
    r.add_argument("--markdown", default="docs/COMPAT.md")
    r.add_argument("--readme", default=None)
    r.add_argument("--total-s", type=int, default=None)
    g = sub.add_parser(
        "render",
        help="re-render docs/COMPAT.md and the README table from docs/compat.json "
        "(nothing runs; use after editing the renderers or the README)",
    )
    g.add_argument("--json", default="docs/compat.json")
    g.add_argument("--markdown", default="docs/COMPAT.md")
    g.add_argument("--readme", default="README.md")
    a = ap.parse_args(argv)
    if a.cmd == "render":
        render(a.json, a.markdown, a.readme)
    else:
        report(a.out_dir, a.releases, a.json, a.markdown, a.readme, a.total_s)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())


__all__ = [
    "CAPABILITIES",
    "REQUIREMENTS",
    "FIXTURE_REQUIREMENTS",
    "Requirement",
    "plugin_capabilities",
    "report",
    "skip_reason",
    "unmet",
]
