"""Route SGLang's flashinfer_trtllm fused MoE leaves through the plugin runner (kernel or emulator)."""

from __future__ import annotations

from .. import hookimpl, runner
from ..targets import HookTarget

TRTLLM = "sglang.srt.layers.moe.moe_runner.flashinfer_trtllm"


def fp8_leaf(original, dispatch_output, quant_info, runner_config, use_routed_topk=False):
    """One SGLang leaf serves every FP8 flavour; layers the plugin prepared (per-tensor, DeepSeek block) run on the
    plugin runner, the rest (MXFP8, layers left to SGLang) on SGLang's own leaf. ModelOptFp8MoEMethod.apply imports
    the leaf at call time, so it goes through here too."""
    if runner.serves_fp8(runner_config):
        return runner.fused_experts_fp8(dispatch_output, quant_info, runner_config, use_routed_topk)
    return original(dispatch_output, quant_info, runner_config, use_routed_topk)


@hookimpl
def register_sglang_hooks(register, release):
    register(HookTarget(
        f"{TRTLLM}.fused_experts_none_to_flashinfer_trtllm_fp4", runner.fused_experts_fp4, "replace",
        releases=">=0.5.11", capability="runner",
        why="NVFP4 leaf looked up at call time by the flashinfer_trtllm(_routed) dispatchers",
    ))
    register(HookTarget(
        f"{TRTLLM}.fused_experts_none_to_flashinfer_trtllm_bf16", runner.fused_experts_bf16, "replace",
        releases=">=0.5.11", capability="runner",
        why="BF16 leaf looked up at call time by the flashinfer_trtllm(_routed) dispatchers",
    ))
    register(HookTarget(
        f"{TRTLLM}.fused_experts_none_to_flashinfer_trtllm_fp8", fp8_leaf, "around",
        releases=">=0.5.19", capability="runner",
        why="FP8 per-tensor / DeepSeek block leaf for plugin-prepared layers (MXFP8 stays on SGLang's leaf)",
    ))
