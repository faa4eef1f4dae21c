"""Route SGLang's flashinfer_trtllm fused MoE leaves through the plugin runner (kernel or emulator)."""

from __future__ import annotations

from .. import hookimpl, runner
from ..targets import HookTarget

TRTLLM = "sglang.srt.layers.moe.moe_runner.flashinfer_trtllm"


@hookimpl
def register_sglang_hooks(register, release):
    register(HookTarget(
        f"{TRTLLM}.fused_experts_none_to_flashinfer_trtllm_fp4", runner.fused_experts_fp4, "replace",
        releases=">=0.5.11", capability="runner",
        why="NVFP4 leaf looked up at call time by the flashinfer_trtllm(_routed) dispatchers",
    ))
