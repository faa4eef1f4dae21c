"""Routing of the TRT-LLM-Gen fused MoE kernels, in torch: which experts each token goes to, with which weight.

Why: the emulator must pick the same experts and weights as the kernel's routing stage for every
`routing_method_type`, and the routed (`*_routed_moe`) entry points take the packed top-k format, so both live here.
The math follows flashinfer's CUDA sources (trtllm_fused_moe_routing_runner.cu, RoutingCustomPolicy.cuh,
trtllm_fused_moe_routing_deepseek.cu): float32 scores, weights rounded to bf16 at the end.

Ties: the kernel's warp top-k prefers the larger value and, on equal values, the lower expert index (reduceTopK
packs (value, ~index)); `_topk` reproduces that with a stable sort.
"""

from __future__ import annotations

import torch

from ..kernel_api import RoutingMethodType

_SUM_EPS = 1e-20  # mSumEpsilon of the DeepSeekV3 / MiniMax2 ScaledSumNormalize, and SumNormalize's floor


def _topk(scores: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k, largest first, equal scores ordered by lower expert index (the kernel's warp reduceTopK rule).

    A stable descending sort gives that tie order; `torch.topk` does not promise any, and ties are common with
    bf16 logits.
    """
    v, i = torch.sort(scores, dim=-1, descending=True, stable=True)
    return v[..., :k], i[..., :k]


def _scaled_sum_normalize(sig_sel: torch.Tensor, rsf: float) -> torch.Tensor:
    """sigma_i * routed_scaling_factor / (sum_k sigma + 1e-20), the DeepSeekV3/MiniMax2 weight (fp32)."""
    return sig_sel * rsf / (sig_sel.sum(dim=-1, keepdim=True) + _SUM_EPS)


def _group_limited_selection(biased: torch.Tensor, n_group: int, topk_group: int) -> torch.Tensor:
    """Mask (to -inf) the experts outside the `topk_group` best groups; group score = sum of its top-2 biased scores."""
    T, E = biased.shape
    if E % n_group:
        raise ValueError(f"num_experts {E} is not divisible by n_group {n_group}")
    grouped = biased.view(T, n_group, E // n_group)
    group_score = _topk(grouped, min(2, E // n_group))[0].sum(dim=-1)
    keep = _topk(group_score, topk_group)[1]
    group_mask = torch.zeros(T, n_group, dtype=torch.bool, device=biased.device).scatter_(1, keep, True)
    expert_mask = group_mask.unsqueeze(-1).expand(T, n_group, E // n_group).reshape(T, E)
    return biased.masked_fill(~expert_mask, float("-inf"))


def route(
    method: int | RoutingMethodType,
    logits: torch.Tensor,
    top_k: int,
    *,
    bias: torch.Tensor | None = None,
    n_group: int | None = None,
    topk_group: int | None = None,
    routed_scaling_factor: float | None = None,
    norm_topk_prob: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Route `logits [T, E]` -> (`topk_ids` int32 `[T, k]`, `topk_weights` bf16 `[T, k]`), best expert first.

    `method` is a `RoutingMethodType` value (ours or flashinfer's enum, or a plain int). `routed_scaling_factor`
    None means 1.0 (the launcher's `value_or(1.0)`); `bias` is used for selection only (DeepSeekV3, MiniMax2).
    """
    m = int(method)
    s = logits.float()
    k = int(top_k)
    rsf = 1.0 if routed_scaling_factor is None else float(routed_scaling_factor)
    if m == RoutingMethodType.Default:
        w, ids = _topk(torch.softmax(s, dim=-1), k)
    elif m in (RoutingMethodType.Renormalize, RoutingMethodType.RenormalizeNaive):
        v, ids = _topk(s, k)
        w = torch.softmax(v, dim=-1)
    elif m in (RoutingMethodType.DeepSeekV3, RoutingMethodType.MiniMax2):
        sig = torch.sigmoid(s)
        biased = sig + (bias.float() if bias is not None else 0.0)
        if m == RoutingMethodType.DeepSeekV3 and n_group is not None and n_group > 1:
            if topk_group is None or topk_group < 1:
                raise ValueError("DeepSeekV3 routing with n_group > 1 needs topk_group >= 1")
            biased = _group_limited_selection(biased, int(n_group), int(topk_group))
        _, ids = _topk(biased, k)
        w = _scaled_sum_normalize(sig.gather(-1, ids), rsf)
    elif m == RoutingMethodType.Llama4:
        if k != 1:
            raise ValueError(f"Llama4 routing needs top_k == 1, got {k}")
        v, ids = _topk(s, 1)
        w = torch.sigmoid(v)
    elif m == RoutingMethodType.TopK:
        w, ids = _topk(s, k)
    elif m in (RoutingMethodType.SigmoidRenorm, RoutingMethodType.Sigmoid):
        w, ids = _topk(torch.sigmoid(s), k)
        if m == RoutingMethodType.SigmoidRenorm and norm_topk_prob:
            w = w / w.sum(dim=-1, keepdim=True).clamp(min=_SUM_EPS)
    elif m == RoutingMethodType.TopKSigmoid:
        v, ids = _topk(s, k)
        w = torch.sigmoid(v)
    else:
        raise NotImplementedError(f"routing_method_type={m} is not a routing method the TRT-LLM-Gen kernels implement")
    return ids.to(torch.int32), w.to(torch.bfloat16)


def pack_topk(topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
    """(ids, weights) -> int32 `(id << 16) | bf16_bits(weight)`: the packed input of the `*_routed_moe` kernels.

    Same as flashinfer's `pack_flashinfer_trtllm_topk_ids_weights` (b12x reference) and the kernel's
    `PackedScoreIdx<bf16>` {score in the low 16 bits, int16 idx in the high 16 bits}.
    """
    if topk_ids.shape != topk_weights.shape:
        raise ValueError(f"shape mismatch: ids {tuple(topk_ids.shape)} vs weights {tuple(topk_weights.shape)}")
    bits = topk_weights.contiguous().to(torch.bfloat16).view(torch.int16).to(torch.int32) & 0xFFFF
    return (topk_ids.contiguous().to(torch.int32) << 16) | bits


def unpack_topk(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of `pack_topk`: int32 -> (ids int32, weights bf16)."""
    p = packed.to(torch.int32)
    ids = p >> 16
    low = p & 0xFFFF
    low = (low ^ 0x8000) - 0x8000  # sign-extend the 16 weight bits so the int16 cast is exact
    return ids, low.to(torch.int16).view(torch.bfloat16)


def split_routed_input(
    topk_ids: torch.Tensor | tuple[torch.Tensor, torch.Tensor],
) -> tuple[torch.Tensor, torch.Tensor]:
    """The routed kernels' `topk_ids` argument (packed tensor or (ids, weights) pair) -> (ids int32, weights).

    Unpacked weights keep their dtype (bf16 or fp32): the kernel consumes them "at their native dtype (no cast)".
    """
    if isinstance(topk_ids, (tuple, list)):
        ids, weights = topk_ids
        return ids.to(torch.int32), weights
    return unpack_topk(topk_ids)


__all__ = ["RoutingMethodType", "route", "pack_topk", "unpack_topk", "split_routed_input"]
