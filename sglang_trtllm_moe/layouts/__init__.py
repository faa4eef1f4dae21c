"""Pure-torch TRT-LLM-Gen weight layouts, batched over experts, each with its exact inverse.

Why this module exists: FlashInfer's TRT-LLM-Gen MoE kernels read weights in a layout that differs from the
checkpoint (gated row interleave, `shuffle_matrix_a` row blocks, 128x4 scale swizzle, block-major K). SGLang
builds it per expert in Python loops, allocates fresh tensors (moving storage under captured CUDA graphs) and
keeps index caches alive across weight reloads (sglang#28676). Here every transform is:

* one gather for many experts at once (the map depends only on the shape, so all experts share it);
* applied to the raw byte view, so one row map serves packed FP4, FP8 and BF16 alike;
* available in place (same storage, same `data_ptr()`), chunked over experts so the scratch memory is at most
  `chunk` experts' worth, and restricted to a subset of experts when only some were updated;
* exactly invertible, so a weight checker can undo it.

On CUDA (with Triton importable) the in-place transforms run as one-pass Triton kernels instead (layouts/_triton.py):
each program gathers its piece of the destination through the composed index map (row map, and for block scales the
128x4 swizzle) and writes it back once, with no scratch; the pure-torch code below stays the reference, the CPU path
and the fallback, and the two give identical bytes (`set_fast_path(False)` forces the reference).

One module per concern: maps (index maps and their cache, the padded intermediate), inplace (chunked in-place
machinery), scales (128x4 swizzle), blocks (block-major K), fastpath + _triton (the CUDA kernels).

Index maps are cached per (kind, m, gated, epilogue_tile_m, device); `clear_caches()` drops them all.
Formulas: flashinfer 0.7.2 `get_reorder_rows_for_gated_act_gemm_row_indices`, `get_shuffle_matrix_a_row_indices`,
`convert_to_block_layout`, and the TRT-LLM `get_sf_out_offset_128x4` swizzle (SGLang `swizzle_blockscale`).
"""

from .blocks import (
    BLOCK_K_BYTES,
    block_major_k_view,
    from_block_major_k,
    from_block_major_k_,
    permute_rows_to_block_major_k_,
    to_block_major_k,
    to_block_major_k_,
)
from .fastpath import FAST_PATH, fast_path_for, set_fast_path, triton_layouts
from .inplace import copy_bytes_, permute_rows_, reset_scratch_peak, scratch_peak_bytes, unpermute_rows_
from .maps import (
    GATED_ALIGN,
    NON_GATED_ALIGN,
    SF_COL_TILE,
    SF_ROW_TILE,
    clear_caches,
    closed_block,
    composed_sf_map,
    gated_reorder_map,
    invert_map,
    padded_intermediate,
    shuffle_block_size,
    shuffle_map,
    w2_row_map,
    w13_row_map,
)
from .scales import (
    permute_rows_and_swizzle_sf_,
    swizzle_sf_128x4,
    swizzle_sf_128x4_,
    unswizzle_sf_128x4,
    unswizzle_sf_128x4_,
    unswizzle_sf_and_unpermute_rows_,
)

__all__ = [
    "SF_ROW_TILE",
    "SF_COL_TILE",
    "GATED_ALIGN",
    "NON_GATED_ALIGN",
    "padded_intermediate",
    "gated_reorder_map",
    "shuffle_map",
    "shuffle_block_size",
    "w13_row_map",
    "w2_row_map",
    "invert_map",
    "clear_caches",
    "permute_rows_",
    "unpermute_rows_",
    "swizzle_sf_128x4",
    "unswizzle_sf_128x4",
    "swizzle_sf_128x4_",
    "unswizzle_sf_128x4_",
    "permute_rows_and_swizzle_sf_",
    "BLOCK_K_BYTES",
    "to_block_major_k",
    "from_block_major_k",
    "to_block_major_k_",
    "from_block_major_k_",
    "block_major_k_view",
    "permute_rows_to_block_major_k_",
    "scratch_peak_bytes",
    "reset_scratch_peak",
    "copy_bytes_",
    "unswizzle_sf_and_unpermute_rows_",
    "closed_block",
    "composed_sf_map",
    "set_fast_path",
    "fast_path_for",
    "FAST_PATH",
    "triton_layouts",
]

#: the name benchmarks/h200_layouts.py and benchmarks/h200_update_path.py still call (benchmarks/ belongs to the
#: hot-path work in progress): remove once they call `triton_layouts`
_triton_layouts = triton_layouts
