"""Route SGLang's flashinfer_trtllm fused MoE leaves through the plugin runner for the layers it prepared.

One AROUND hook per leaf: a layer the plugin prepared runs on its format's kernel family (runner.run); any other
layer goes to SGLang's own leaf unchanged (under the emulator, NVFP4 and BF16 layers SGLang prepared itself run on
the emulator, which reads the same bytes as the kernel).
"""

from __future__ import annotations

from .. import hookimpl
from ..targets import HookTarget

TRTLLM = "sglang.srt.layers.moe.moe_runner.flashinfer_trtllm"


def _leaf(kind: str):
    def leaf(original, dispatch_output, quant_info, runner_config, use_routed_topk=False, *args, **kwargs):
        from .. import runner

        fmt = runner.format_for(kind, runner_config, dispatch_output)
        if fmt is None:
            return original(dispatch_output, quant_info, runner_config, use_routed_topk, *args, **kwargs)
        return runner.run(fmt, dispatch_output, quant_info, runner_config, use_routed_topk)

    leaf.__name__ = leaf.__qualname__ = f"{kind}_leaf"
    return leaf


fp4_leaf, bf16_leaf, fp8_leaf = _leaf("fp4"), _leaf("bf16"), _leaf("fp8")


@hookimpl
def register_sglang_hooks(register, release):
    why = "layers the plugin prepared run on their format's kernel (or the emulator); others on SGLang's leaf"
    register(
        HookTarget(
            f"{TRTLLM}.fused_experts_none_to_flashinfer_trtllm_fp4",
            fp4_leaf,
            "around",
            capability="runner",
            why="NVFP4 leaf: " + why,
        )
    )
    register(
        HookTarget(
            f"{TRTLLM}.fused_experts_none_to_flashinfer_trtllm_bf16",
            bf16_leaf,
            "around",
            capability="runner",
            why="BF16 leaf: " + why,
        )
    )
    register(
        HookTarget(
            f"{TRTLLM}.fused_experts_none_to_flashinfer_trtllm_fp8",
            fp8_leaf,
            "around",
            capability="runner",
            why="FP8 / MXFP8 leaf (the trtllm dispatchers and ModelOptFp8MoEMethod.apply look it up at "
            "call time): " + why,
        )
    )
