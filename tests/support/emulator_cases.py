"""Arguments for every emulator entry point, per kernel family and variant, from random bytes of the prepared
dtypes and shapes (e2m1 / e4m3 / UE8M0 / bf16, scales in a range that keeps the math finite and away from
saturation): not a calibrated model. For tests of *how* the emulator computes (tests/test_capture_safe.py: no host
reads, and the same numbers as the grouped formulation); tests/test_emulator.py checks *what* it computes against
references.

`case(variant, T, ...)` gives the family and the keyword arguments of its logits-routed entry point;
`routed_kwargs` turns them into the `*_routed_moe` call's (precomputed top-k, packed or as a pair).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sglang_trtllm_moe import emulator, kernel_api, layouts, quant
from sglang_trtllm_moe.emulator.routing import pack_topk, route
from sglang_trtllm_moe.kernel_api import ActivationType, RoutingMethodType

E, H, INTER, TOP_K = 8, 256, 128, 2
#: the expert-parallel rank the `ep` cases run: experts [EP_OFFSET, EP_OFFSET + EP_LOCAL) of E
EP_OFFSET, EP_LOCAL = 2, 4
SWIGLU, RELU2 = int(ActivationType.Swiglu), int(ActivationType.Relu2)


@dataclass(frozen=True)
class Variant:
    family: str  # kernel_api.FAMILIES
    act: int = SWIGLU
    #: fp4: "nvfp4" (NVFP4 weights and activations), "mxfp8" / "bf16" (MXFP4 weights with those activations)
    acts: str = ""
    #: SwiGLU alpha / beta / clamp tensors (the OAI controls), for the fp4 family also fp32 GEMM biases
    oai: bool = False
    #: fp8_block: 1 = DeepSeekFp8, 2 = MxFp8; weight layout 0 = MajorK, 2 = BlockMajorK
    quant_type: int = 1
    layout: int = 0
    #: fp8 per-tensor: the routing weight goes on the input (Llama4 routing, top-1)
    on_input: bool = False


VARIANTS = {
    "nvfp4-swiglu": Variant("fp4_block_scale", acts="nvfp4"),
    "nvfp4-relu2": Variant("fp4_block_scale", RELU2, acts="nvfp4"),
    "mxfp4-mxfp8-swiglu-clamp": Variant("fp4_block_scale", acts="mxfp8"),
    "mxfp4-mxfp8-swiglu-bias-oai": Variant("fp4_block_scale", acts="mxfp8", oai=True),
    "mxfp4-bf16-swiglu-bias-oai": Variant("fp4_block_scale", acts="bf16", oai=True),
    "fp8_block-deepseek-majork": Variant("fp8_block_scale"),
    "fp8_block-deepseek-blockmajork": Variant("fp8_block_scale", layout=2),
    "mxfp8-swiglu-oai": Variant("fp8_block_scale", quant_type=2, oai=True),
    "mxfp8-relu2": Variant("fp8_block_scale", RELU2, quant_type=2),
    "fp8_tensor-swiglu": Variant("fp8_per_tensor_scale"),
    "fp8_tensor-relu2": Variant("fp8_per_tensor_scale", RELU2),
    "fp8_tensor-llama4-on-input": Variant("fp8_per_tensor_scale", on_input=True),
    "bf16-swiglu": Variant("bf16"),
    "bf16-relu2": Variant("bf16", RELU2),
    "bf16-swiglu-oai": Variant("bf16", oai=True),
    "mxint4-swiglu": Variant("mxint4_block_scale"),
    "mxint4-swiglu-oai": Variant("mxint4_block_scale", oai=True),
}

#: routing arguments per method: (top_k, n_group, topk_group, routed_scaling_factor, with a selection bias)
ROUTING = {
    RoutingMethodType.Default: (TOP_K, None, None, None, False),
    RoutingMethodType.Renormalize: (TOP_K, None, None, None, False),
    RoutingMethodType.DeepSeekV3: (TOP_K, 4, 2, 2.5, True),
    RoutingMethodType.Llama4: (1, None, None, None, False),
    RoutingMethodType.RenormalizeNaive: (TOP_K, None, None, None, False),
    RoutingMethodType.TopK: (TOP_K, None, None, None, False),
    RoutingMethodType.SigmoidRenorm: (TOP_K, None, None, None, False),
    RoutingMethodType.MiniMax2: (TOP_K, None, None, 1.5, True),
    RoutingMethodType.Sigmoid: (TOP_K, None, None, None, False),
    RoutingMethodType.TopKSigmoid: (TOP_K, None, None, None, False),
}


def _uniform(g: torch.Generator, shape: tuple[int, ...], lo: float, hi: float) -> torch.Tensor:
    return torch.rand(shape, generator=g) * (hi - lo) + lo


def _swizzled(g: torch.Generator, n: int, rows: int, cols: int, mx: bool) -> torch.Tensor:
    """Block scales of n experts in the kernel's 128x4 layout, uint8: UE8M0 2^-6..2^-4 or e4m3 0.01..0.05."""
    if mx:
        lin = torch.randint(121, 124, (n, rows, cols), generator=g, dtype=torch.uint8)
    else:
        lin = _uniform(g, (n, rows, cols), 0.01, 0.05).to(torch.float8_e4m3fn).view(torch.uint8)
    return layouts.swizzle_sf_128x4(lin)


def _fp8(g: torch.Generator, *shape: int) -> torch.Tensor:
    return (torch.randn(shape, generator=g) * 0.05).to(torch.float8_e4m3fn)


def _oai(g: torch.Generator, n: int) -> dict:
    return dict(
        gemm1_alpha=torch.full((n,), 1.702),
        gemm1_beta=torch.ones(n),
        gemm1_clamp_limit=_uniform(g, (n,), 1.0, 7.0),
    )


def _fp4(v: Variant, g: torch.Generator, x: torch.Tensor, n: int) -> dict:
    m = 2 * INTER if v.act == SWIGLU else INTER
    mx = v.acts != "nvfp4"
    block = 32 if mx else 16
    if v.acts == "nvfp4":
        hs, hs_sf = quant.nvfp4_quantize(x, 1.0)
        hs_sf = hs_sf.view(torch.float8_e4m3fn)
    elif v.acts == "mxfp8":
        hs, hs_sf = quant.mxfp8_quantize(x)
        hs_sf = hs_sf.view(torch.float8_e4m3fn)
    else:
        hs, hs_sf = x, None
    args = dict(
        hidden_states=hs,
        hidden_states_scale=hs_sf,
        gemm1_weights=torch.randint(0, 256, (n, m, H // 2), generator=g, dtype=torch.uint8),
        gemm1_weights_scale=_swizzled(g, n, m, H // block, mx).view(torch.float8_e4m3fn),
        gemm1_bias=None,
        gemm1_alpha=None,
        gemm1_beta=None,
        gemm1_clamp_limit=None,
        gemm2_weights=torch.randint(0, 256, (n, H, INTER // 2), generator=g, dtype=torch.uint8),
        gemm2_weights_scale=_swizzled(g, n, H, INTER // block, mx).view(torch.float8_e4m3fn),
        gemm2_bias=None,
        output1_scale_scalar=_uniform(g, (n,), 0.5, 1.5),
        output1_scale_gate_scalar=_uniform(g, (n,), 0.5, 1.5),
        output2_scale_scalar=_uniform(g, (n,), 0.5, 1.5),
        intermediate_size=INTER,
    )
    if mx and v.act == SWIGLU:
        args.update(gemm1_clamp_limit=_uniform(g, (n,), 1.0, 7.0))
    if v.oai:  # gpt-oss: biases in the kernel's row layout, SwiGLU controls, no output scalars
        args.update(
            _oai(g, n),
            gemm1_bias=torch.randn(n, m, generator=g) * 0.1,
            gemm2_bias=torch.randn(n, H, generator=g) * 0.1,
            output1_scale_scalar=None,
            output1_scale_gate_scalar=None,
            output2_scale_scalar=None,
        )
    if v.acts == "bf16":  # the padded intermediate's tail and a narrower caller output (gpt-oss)
        args.update(valid_intermediate_size=INTER - 32, output=torch.empty(x.shape[0], H - 64, dtype=torch.bfloat16))
    return args


def _fp8_block(v: Variant, g: torch.Generator, x: torch.Tensor, n: int) -> dict:
    m = 2 * INTER if v.act == SWIGLU else INTER
    w1, w2 = _fp8(g, n, m, H), _fp8(g, n, H, INTER)
    args = dict(intermediate_size=INTER, fp8_quantization_type=v.quant_type, weight_layout=v.layout)
    if v.quant_type == 2:  # MxFp8: shuffled rows, swizzled UE8M0 bytes
        hs, hs_sf = quant.mxfp8_quantize(x)
        args.update(
            hidden_states=hs,
            hidden_states_scale=hs_sf,
            gemm1_weights=w1,
            gemm1_weights_scale=_swizzled(g, n, m, H // 32, True) + 5,  # 2^-1..2^1: weights already ~0.05
            gemm2_weights=w2,
            gemm2_weights_scale=_swizzled(g, n, H, INTER // 32, True) + 5,
            use_shuffled_weight=True,
        )
    else:  # DeepSeekFp8: 128x128 weight scales, 1x128 activation scales handed over transposed
        hs, hs_sf = quant.fp8_group_quantize(x)
        s1, s2 = _uniform(g, (n, m // 128, H // 128), 0.5, 2.0), _uniform(g, (n, H // 128, INTER // 128), 0.5, 2.0)
        if v.layout == 2:
            w1 = layouts.to_block_major_k(w1.view(torch.uint8)).view(torch.float8_e4m3fn)
            w2 = layouts.to_block_major_k(w2.view(torch.uint8)).view(torch.float8_e4m3fn)
        args.update(
            hidden_states=hs,
            hidden_states_scale=hs_sf.t().contiguous(),
            gemm1_weights=w1,
            gemm1_weights_scale=s1,
            gemm2_weights=w2,
            gemm2_weights_scale=s2,
            use_shuffled_weight=False,
        )
    if v.oai:
        args.update(_oai(g, n))
    return args


def _fp8_tensor(v: Variant, g: torch.Generator, x: torch.Tensor, n: int) -> dict:
    m = 2 * INTER if v.act == SWIGLU else INTER
    return dict(
        hidden_states=quant.fp8_quantize(x, 1.0),
        gemm1_weights=_fp8(g, n, m, H),
        output1_scales_scalar=_uniform(g, (n,), 0.5, 1.5),
        output1_scales_gate_scalar=_uniform(g, (n,), 0.5, 1.5),
        gemm2_weights=_fp8(g, n, H, INTER),
        output2_scales_scalar=_uniform(g, (n,), 0.5, 1.5),
        intermediate_size=INTER,
        use_routing_scales_on_input=v.on_input,
    )


def _bf16(v: Variant, g: torch.Generator, x: torch.Tensor, n: int) -> dict:
    m = 2 * INTER if v.act == SWIGLU else INTER
    w1 = (torch.randn(n, m, H, generator=g) * 0.05).to(torch.bfloat16)
    w2 = (torch.randn(n, H, INTER, generator=g) * 0.05).to(torch.bfloat16)
    args = dict(
        hidden_states=x,
        gemm1_weights=layouts.to_block_major_k(w1),
        gemm2_weights=layouts.to_block_major_k(w2),
        intermediate_size=INTER,
    )
    if v.oai:
        args.update(_oai(g, n))
    return args


def _mxint4(v: Variant, g: torch.Generator, x: torch.Tensor, n: int) -> dict:
    """INT4 nibbles (any byte), bf16 scales per 32 values in the 128x4 layout, block-major K weights; the
    intermediate is 2 x INTER (the kernel's 128-byte K blocks of GEMM2 need 256)."""
    inter = 2 * INTER
    m = 2 * inter

    def scales(rows: int, cols: int) -> torch.Tensor:
        return layouts.swizzle_sf_128x4(_uniform(g, (n, rows, cols), 0.015, 0.06).to(torch.bfloat16))

    def weights(rows: int, cols: int) -> torch.Tensor:
        return layouts.to_block_major_k(torch.randint(0, 256, (n, rows, cols // 2), generator=g, dtype=torch.uint8))

    args = dict(
        hidden_states=x,
        gemm1_weights=weights(m, H),
        gemm1_weights_scale=scales(m, H // 32),
        gemm1_alpha=None,
        gemm1_beta=None,
        gemm1_clamp_limit=None,
        gemm2_weights=weights(H, inter),
        gemm2_weights_scale=scales(H, inter // 32),
        intermediate_size=inter,
    )
    if v.oai:
        args.update(_oai(g, n))
    return args


_BUILD = {
    "fp4_block_scale": _fp4,
    "fp8_block_scale": _fp8_block,
    "fp8_per_tensor_scale": _fp8_tensor,
    "bf16": _bf16,
    "mxint4_block_scale": _mxint4,
}


def case(name: str, tokens: int, seed: int = 0, ep: bool = False, method: int | None = None) -> tuple[str, dict]:
    """(family, keyword arguments of its logits-routed entry point) for VARIANTS[name] on `tokens` tokens; `ep`: this
    rank holds experts [EP_OFFSET, EP_OFFSET + EP_LOCAL) of E; `method`: the routing method (default Renormalize,
    Llama4 for the weights-on-input variant); a routing_replay_out buffer two rows longer than the batch, all -1."""
    v = VARIANTS[name]
    g = torch.Generator().manual_seed(seed)
    if method is None:
        method = RoutingMethodType.Llama4 if v.on_input else RoutingMethodType.Renormalize
    top_k, n_group, topk_group, rsf, biased = ROUTING[RoutingMethodType(method)]
    x = torch.randn(tokens, H, generator=g).to(torch.bfloat16)
    n = EP_LOCAL if ep else E
    args = _BUILD[v.family](v, g, x, n)
    args.update(
        routing_logits=torch.randn(tokens, E, generator=g),
        routing_bias=torch.randn(E, generator=g) * 0.1 if biased else None,
        num_experts=E,
        top_k=top_k,
        n_group=n_group,
        topk_group=topk_group,
        local_expert_offset=EP_OFFSET if ep else 0,
        local_num_experts=n,
        routed_scaling_factor=rsf,
        routing_method_type=int(method),
        activation_type=v.act,
        routing_replay_out=torch.full((tokens + 2, top_k), -1, dtype=torch.int16),
    )
    params = kernel_api.SIGNATURES[kernel_api.kernel_function(v.family, False)].parameters
    return v.family, {k: a for k, a in args.items() if k in params}  # (the INT4 launcher takes no activation_type)


def topk_of(args: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """The (ids, weights) the fused call's routing picks: what `routing_replay_out` must record."""
    return route(
        args["routing_method_type"],
        args["routing_logits"],
        args["top_k"],
        bias=args["routing_bias"],
        n_group=args["n_group"],
        topk_group=args["topk_group"],
        routed_scaling_factor=args["routed_scaling_factor"],
    )


def routed_kwargs(family: str, args: dict, packed: bool) -> dict:
    """The `*_routed_moe` call of the same case: the fused call's top-k precomputed (packed int32, or the pair), the
    arguments that entry point does not take left out."""
    ids, w = topk_of(args)
    params = kernel_api.SIGNATURES[kernel_api.kernel_function(family, True)].parameters
    out = {k: v for k, v in args.items() if k in params}
    out["topk_ids"] = pack_topk(ids, w) if packed else (ids, w)
    return out


def entry_point(family: str, routed: bool):
    return getattr(emulator, kernel_api.kernel_function(family, routed))
