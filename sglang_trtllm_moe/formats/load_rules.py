"""What a weight update may write into a parameter: the kinds of parameter, the value rules and the `LoadRule`
each laid-out parameter and scalar of a format has (`WeightFormat.load_rule`, derived from the format's declarations
in base.py). updates/validation.py applies them and knows no format names."""

from __future__ import annotations

from dataclasses import dataclass

import torch

#: Kinds of parameter a weight update writes; validation.py applies one rule set per kind (docs/RELIABILITY.md).
#: weight: per-expert [rows, cols] tensor split by TP along the intermediate; block_scale: the same geometry, one
#: value per block of the weight; tensor_scale: one weight scale per expert and shard (weight_scale_2, FP8
#: weight_scale, global scales); input_scale: one activation scale per expert and shard.
WEIGHT, BLOCK_SCALE, TENSOR_SCALE, INPUT_SCALE = "weight", "block_scale", "tensor_scale", "input_scale"
KINDS = (WEIGHT, BLOCK_SCALE, TENSOR_SCALE, INPUT_SCALE)
#: value rules of float values (LoadRule.values): every value finite and > 0 / finite and >= 0
POSITIVE, NONNEGATIVE = "positive", "nonnegative"
#: value rules of 1-byte scale encodings, checked on the bytes (value_checks.py): e4m3 (NVFP4 block scales) has NaN
#: at 0x7F / 0xFF and negative values above 0x80 (a block scale is >= 0, as in 16/32-bit floats; 0x80 is -0 = 0);
#: UE8M0 (MXFP8 / MXFP4 scales, as float8_e8m0fnu or uint8 bytes) has NaN at 0xFF and no negative values. An all-zero
#: e4m3 block scale is valid: the block is zero (SGLang's loader zero-fills padding the same way).
E4M3_BYTES, UE8M0_BYTES = "e4m3 bytes", "ue8m0 bytes"
#: the value rule of a source tensor SGLang's loader converts itself (an online quant's BF16 / FP16 / FP32 expert
#: weight, `WeightFormat.source_values`): every value finite. Its amax-derived scales would be NaN, or (SGLang takes
#: the amax after nan_to_num) saturated by an inf; any sign and zero are fine
FINITE = "finite"
VALUE_RULES = (POSITIVE, NONNEGATIVE, E4M3_BYTES, UE8M0_BYTES, FINITE)
#: the byte encoding a 1-byte scale storage dtype implies (uint8 storage says nothing: the format declares it)
BYTE_CODES = {torch.float8_e4m3fn: E4M3_BYTES}
if hasattr(torch, "float8_e8m0fnu"):
    BYTE_CODES[torch.float8_e8m0fnu] = UE8M0_BYTES


@dataclass(frozen=True)
class LoadRule:
    """What a write into one parameter through SGLang's FusedMoE loader must look like (validation.py enforces it).

    Derived from the format's declarations (`WeightFormat.load_rule`): every `ParamLayout` and every name in
    `scalar_params` has one; a format overrides a scalar's with `scalar_rules`.

    dtypes: a loaded tensor may have the parameter's own dtype; into 16/32-bit float storage any 16/32/64-bit
    float (SGLang's copy_ converts it, as it loads every dense layer); into 1-byte storage nothing else (copy_
    would value-convert, not copy, e.g. float32 into packed FP4 bytes); plus `dtypes` declared here.
    """

    name: str
    group: str
    kind: str
    #: accepted besides the derived ones
    dtypes: tuple = ()
    #: POSITIVE | NONNEGATIVE | None: float values written into it (None = derived, see `value_rule`)
    values: str | None = None
    #: E4M3_BYTES | UE8M0_BYTES | None: 1-byte scale bytes written into it (None = derived from the storage dtype)
    byte_code: str | None = None

    @property
    def scalar(self) -> bool:
        """One value per expert and shard (loaded as a 0-dim or [1] tensor)."""
        return self.kind in (TENSOR_SCALE, INPUT_SCALE)

    def accepts_dtype(self, loaded: torch.dtype, storage: torch.dtype) -> bool:
        if loaded == storage or loaded in self.dtypes:
            return True
        return (
            storage.is_floating_point
            and storage.itemsize >= 2
            and loaded.is_floating_point
            and loaded.itemsize >= 2
            and not loaded.is_complex
        )

    def value_rule(self, storage: torch.dtype, loaded: torch.dtype | None = None) -> str | None:
        """The rule every value of a tensor of dtype `loaded` (default: the storage's) written into `storage` must
        satisfy, or None (weights are data: not value-checked). Scales only: per-tensor and input scales finite and
        > 0, block scales finite and >= 0 — as float values, or on the bytes of a 1-byte encoding."""
        loaded = storage if loaded is None else loaded
        if loaded.itemsize == 1:
            if self.kind != BLOCK_SCALE:
                return None
            return self.byte_code or BYTE_CODES.get(loaded)
        if not loaded.is_floating_point:
            return None
        if self.values is not None or self.scalar:
            return self.values
        return NONNEGATIVE if self.kind == BLOCK_SCALE else None
