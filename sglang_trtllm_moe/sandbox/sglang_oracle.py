"""SGLang's own preparation of a harness layer, run on CPU as a byte oracle (the plugin's hooks bypassed), with the
fewest stand-ins, each a CUDA-only helper whose CPU equivalent computes the same bytes:
* MXFP8: `fp8._is_cuda` (a guard) is set True, and `flashinfer.block_scale_interleave` (CUDA kernel) is the
  plugin's pure-torch 128x4 swizzle, returned flat as flashinfer returns it. Index helpers are FlashInfer's own.
* MXFP4 experts: the module binds flashinfer's names only when `is_flashinfer_available()` (CUDA), so FlashInfer's
  own `_maybe_get_cached_w3_w1_permute_indices` / `get_w2_permute_indices_with_cache` are bound there and
  `block_scale_interleave` is the torch swizzle; `torch.cuda.empty_cache` is a no-op.
* gpt-oss: likewise `nvfp4_block_scale_interleave` (torch) and FlashInfer's `get_w2_permute_indices_with_cache` are
  bound in `mxfp4`, and `Tensor.cuda` is the identity while it runs (it moves the alpha/beta/clamp scalars).
* INT4 (compressed-tensors `CompressedTensorsMxInt4MoE`, the layer's `scheme`): FlashInfer's own permute-index caches
  and `convert_to_block_layout` are bound in its module, `block_scale_interleave` is the torch swizzle (on bf16:
  flashinfer's host loop uses the same index map for both dtypes).
"""

from __future__ import annotations

import contextlib

import torch

from .. import layouts
from .layers import MoeSpec, build_layer, patched, unhooked


def torch_block_scale_interleave(x, *args, **kwargs):
    """flashinfer.block_scale_interleave on CPU: 128x4 swizzle of a 2-D [R, C], returned flat (and padded)."""
    if x.dim() != 2:
        raise ValueError(f"expects a 2-D scale matrix, got {tuple(x.shape)}")
    return layouts.swizzle_sf_128x4(x.contiguous()).reshape(-1)


def prep_patches(method) -> contextlib.AbstractContextManager:
    """The CPU stand-ins SGLang's own preparation of `method`'s layers needs (module doc), as one context."""
    name = type(method).__name__
    if name == "Fp8MoEMethod":
        import flashinfer
        from sglang.srt.layers.quantization import fp8 as fp8_mod

        return patched(
            (fp8_mod, "_is_cuda", True), (flashinfer, "block_scale_interleave", torch_block_scale_interleave)
        )
    if name == "Mxfp4FlashinferTrtllmMoEMethod":
        from flashinfer.fused_moe import core as ficore
        from sglang.srt.layers.quantization import mxfp4_flashinfer_trtllm_moe as fte

        return patched(
            (fte, "_maybe_get_cached_w3_w1_permute_indices", ficore._maybe_get_cached_w3_w1_permute_indices),
            (fte, "get_w2_permute_indices_with_cache", ficore.get_w2_permute_indices_with_cache),
            (fte, "block_scale_interleave", torch_block_scale_interleave),
            (torch.cuda, "empty_cache", lambda: None),
        )
    if name == "Mxfp4MoEMethod":
        from flashinfer.fused_moe import core as ficore
        from sglang.srt.layers.quantization import mxfp4 as mx

        return patched(
            (mx, "nvfp4_block_scale_interleave", torch_block_scale_interleave),
            (mx, "get_w2_permute_indices_with_cache", ficore.get_w2_permute_indices_with_cache),
            (torch.Tensor, "cuda", lambda self, *a, **k: self),
            (torch.cuda, "empty_cache", lambda: None),
        )
    if name == "CompressedTensorsMxInt4MoE":
        from flashinfer.fused_moe import core as ficore
        from sglang.srt.layers.quantization.compressed_tensors.schemes import compressed_tensors_w4a4_mxint4_moe as mi

        return patched(
            (mi, "_maybe_get_cached_w3_w1_permute_indices", ficore._maybe_get_cached_w3_w1_permute_indices),
            (mi, "get_w2_permute_indices_with_cache", ficore.get_w2_permute_indices_with_cache),
            (mi, "convert_to_block_layout", ficore.convert_to_block_layout),
            (mi, "block_scale_interleave", torch_block_scale_interleave),
        )
    raise NotImplementedError(name)


def sglang_prepare(layer) -> None:
    """SGLang's own process_weights_after_loading of an MX or INT4 `layer` (the plugin's hook bypassed), on CPU: the
    quant method's, or for compressed-tensors its layer's scheme's."""
    method = getattr(layer, "scheme", None) or layer.quant_method
    with prep_patches(method):
        unhooked(type(method).process_weights_after_loading)(method, layer)


def sglang_layer(spec: MoeSpec, prefix: str = "model.layers.0.mlp.experts", **kwargs):
    """A layer exactly as SGLang allocates it (the plugin's allocation hook bypassed): for SGLang's own flow."""
    if spec.fmt == "mxfp4_experts":
        from sglang.srt.layers.quantization.mxfp4_flashinfer_trtllm_moe import Mxfp4FlashinferTrtllmMoEMethod as cls
    elif spec.fmt == "mxfp4_gptoss":
        from sglang.srt.layers.quantization.mxfp4 import Mxfp4MoEMethod as cls
    else:
        return build_layer(spec, prefix, **kwargs)
    with patched((cls, "create_weights", unhooked(cls.create_weights))):
        return build_layer(spec, prefix, **kwargs)


__all__ = ["prep_patches", "sglang_layer", "sglang_prepare", "torch_block_scale_interleave"]
