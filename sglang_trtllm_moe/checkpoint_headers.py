"""The tensors of a safetensors checkpoint directory as meta tensors: names, dtypes and shapes from the file
headers, no data read.

`update_weights_from_disk` lets SGLang return every layer to checkpoint layout before it reads the first tensor
(0.5.23 `restore_weights_before_loading`), and on a failure it rolls back by loading the same path again: one
malformed tensor leaves the model in checkpoint layout, or half old and half new. The headers say enough (name,
dtype, shape) to refuse such a checkpoint before SGLang touches the model. Values are not in the headers, but
the ones validation checks (per-tensor weight and input scales) are scalars per expert and shard: those few bytes
are read too, so a NaN or zero scale is refused with the rest instead of raising half-way through SGLang's load
(whose rollback would then re-read the same bad value).
"""

from __future__ import annotations

import glob
import math
import os

import torch

#: safetensors header dtype codes -> torch dtypes (the ones a MoE checkpoint holds; others are skipped)
DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
if hasattr(torch, "float8_e8m0fnu"):
    DTYPES["F8_E8M0"] = torch.float8_e8m0fnu

#: scales ("scale" in the name's last part) of 16/32-bit floats up to this many elements are read with their values
#: (per-tensor scales: one per expert and shard); everything else, 1-byte block scales (not value-checked)
#: included, stays a meta tensor
VALUE_NUMEL = 64

#: load formats whose weights come from *.safetensors files of the directory (SGLang's DefaultModelLoader)
SAFETENSORS_FORMATS = (None, "auto", "safetensors")


def files_of(model_path, load_format) -> list[str]:
    """The *.safetensors files SGLang would read for (model_path, load_format); [] when it would not read local
    safetensors (a hub id, .bin / .pt weights, another loader): those are left to the per-tensor checks."""
    if load_format not in SAFETENSORS_FORMATS or not isinstance(model_path, str) or not os.path.isdir(model_path):
        return []
    return sorted(glob.glob(os.path.join(model_path, "*.safetensors")))


def meta_tensors(files, keep=None) -> list[tuple[str, torch.Tensor]]:
    """[(name, tensor)] of every tensor in `files` whose name `keep` accepts (all when None): a meta tensor, or
    the real CPU tensor for small scales (VALUE_NUMEL)."""
    from safetensors import safe_open

    out = []
    for path in files:
        with safe_open(path, framework="pt", device="cpu") as f:
            for name in f.keys():
                if keep is not None and not keep(name):
                    continue
                sl = f.get_slice(name)
                dtype = DTYPES.get(sl.get_dtype())
                if dtype is None:
                    continue
                shape = tuple(sl.get_shape())
                if _valued(name, dtype, shape):
                    out.append((name, f.get_tensor(name)))
                else:
                    out.append((name, torch.empty(shape, dtype=dtype, device="meta")))
    return out


def _valued(name: str, dtype: torch.dtype, shape: tuple[int, ...]) -> bool:
    return (
        "scale" in name.rsplit(".", 1)[-1]
        and dtype.is_floating_point
        and dtype.itemsize >= 2
        and math.prod(shape) <= VALUE_NUMEL
    )
