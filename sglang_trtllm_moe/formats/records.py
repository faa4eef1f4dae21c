"""The records every format and its callers speak in: the runner backends, a checkpoint's description, a
parameter's layout and one kernel call — kept apart from the roles (`roles/`) so that the roles and their callers
import them without importing a whole format.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

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
    #: every byte XORed with this at prepare and again at unprepare (an involution), with `block_major_k`: INT4's
    #: compressed-tensors nibbles are w/s + 8, the kernel's are w/s (0x88 flips both nibbles' sign bits)
    byte_xor: int = 0
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

    def __post_init__(self) -> None:
        if self.byte_xor and not self.block_major_k:
            raise ValueError(f"{self.name}: byte_xor is applied with the block-major K layout only")


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
