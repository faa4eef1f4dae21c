"""What FlashInfer's TRT-LLM-Gen fused MoE kernels compute, in torch, from the same prepared bytes the kernels read.

Why: the kernels only run on Blackwell (SM100). To prove on CPU (or any GPU) that the plugin's prepared weights are
right, the emulator takes the *prepared* tensors exactly as the kernel would, undoes the layouts with `layouts`'
inverses, and runs each format's math in float32. The entry points have the exact signatures of the newest flashinfer
tested (0.7.4), made from kernel_api.SIGNATURES (`entry_points`; a test compares names, kinds and defaults with the
installed flashinfer, leaving out what an older one predates: kernel_api.FLASHINFER_ADDED), so the runner can call
either. One module per kernel family (its impl); `common` holds the structure every family shares (routing,
grouping by expert, activation, finalize).
"""

from ..kernel_api import KERNEL_FUNCTIONS, ActivationType, Fp8QuantizationType, WeightLayout
from .bf16 import trtllm_bf16_moe, trtllm_bf16_routed_moe
from .common import is_gated
from .fp8_block import trtllm_fp8_block_scale_moe, trtllm_fp8_block_scale_routed_moe
from .fp8_tensor import trtllm_fp8_per_tensor_scale_moe, trtllm_fp8_per_tensor_scale_routed_moe
from .mxint4 import trtllm_mxint4_block_scale_moe, trtllm_mxint4_block_scale_routed_moe
from .nvfp4 import trtllm_fp4_block_scale_moe, trtllm_fp4_block_scale_routed_moe

__all__ = [
    "ActivationType",
    "WeightLayout",
    "Fp8QuantizationType",
    "is_gated",
    "KERNEL_FUNCTIONS",
    # the entry points: every name in KERNEL_FUNCTIONS, in its order
    "trtllm_fp4_block_scale_moe",
    "trtllm_fp4_block_scale_routed_moe",
    "trtllm_fp8_block_scale_moe",
    "trtllm_fp8_block_scale_routed_moe",
    "trtllm_fp8_per_tensor_scale_moe",
    "trtllm_fp8_per_tensor_scale_routed_moe",
    "trtllm_bf16_moe",
    "trtllm_bf16_routed_moe",
    "trtllm_mxint4_block_scale_moe",
    "trtllm_mxint4_block_scale_routed_moe",
]
