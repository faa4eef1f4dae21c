"""What FlashInfer's TRT-LLM-Gen fused MoE kernels compute, in torch, from the same prepared bytes the kernels read.

Why: the kernels only run on Blackwell (SM100). To prove on CPU (or any GPU) that the plugin's prepared weights are
right, the emulator takes the *prepared* tensors exactly as the kernel would (shuffled rows, gated interleave, 128x4
swizzled scales, block-major K), undoes the layouts with `layouts`' inverses, and runs the per-format math of the
kernels in float32 (read from the CUDA sources flashinfer ships in its wheel: data/csrc/trtllm_fused_moe_*.cu).
The entry points have the newest tested flashinfer's exact signatures (0.7.4: kernel_api.SIGNATURES, made into
functions by `entry_points`; older ones predate the parameters in kernel_api.FLASHINFER_ADDED), so `runner` can swap
one for the other. `workspace_buffer` (0.7.4: scratch
the kernel carves its temporaries from) changes no result and is accepted as such.

Structure shared by every format:
  route -> per local expert e (every one, in order): dequantize its weights, GEMM1 (fp32), activation (+ the format's
  scalars), re-quantize the intermediate like the kernel, GEMM2 (fp32), round to bf16 (the GEMM2 output dtype), on
  all T tokens' rows -> keep y[t,k] = expert(ids[t,k])'s row t (a select on ids == offset + e) -> finalize:
  out[t] = sum_k w[t,k] * y[t,k] in fp32, in slot order, to bf16.
Slots routed to experts outside [local_expert_offset, local_expert_offset + local_num_experts) contribute nothing.

Static shapes, no host reads (CUDA graphs): SGLang captures the MoE forward into a CUDA graph, and capture refuses
anything that reads a device tensor on the host (`.item()`, `float(t)`, `.tolist()`), whose output shape depends on
values (`nonzero`, `unique`, grouping tokens by expert) or that copies host data to the device
(`torch.tensor(python data, device=...)`). So the forward loops over the local experts as Python ints, computes each
on every row, selects on the device, and keeps per-expert scalars as 0-d device tensors; its constants and index
maps are made on the device per call (quant.py, layouts' `cache=False`). Each row gets what running each expert on
its own routed rows only (the grouped formulation) gives: nothing in the math mixes rows, and only BLAS may round a
GEMM's last fp32 bit differently for another row count; the price is n_local * T expert rows per call instead of
T * top_k. tests/test_capture_safe.py runs every entry point and every format's layer forward under a guard that
raises on each refused operation, and compares with the grouped formulation bit for bit.

Not bit-exact by design: the kernels' fused epilogues live in cubins (reciprocal approximations, accumulation order);
expect FP4/FP8-level agreement, see tests/test_emulator.py for the tolerances. Options the emulator does not model
raise NotImplementedError naming the option, never silently compute something else.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .. import layouts
from ..kernel_api import ROUTING_LOGITS_DTYPES, ActivationType
from .routing import route

GATED_ACTIVATIONS = {ActivationType.Swiglu, ActivationType.Geglu, ActivationType.GegluTanh}
NON_GATED_ACTIVATIONS = {
    ActivationType.Gelu,
    ActivationType.Relu,
    ActivationType.Silu,
    ActivationType.Relu2,
    ActivationType.Identity,
}
FLT_MIN = float(torch.finfo(torch.float32).tiny)


def is_gated(activation_type: int) -> bool:
    """Gated activations read GEMM1 as two halves [up; gate] (the kernel's x1 = first half, x2 = second half)."""
    a = int(activation_type)
    if a in GATED_ACTIVATIONS:
        return True
    if a in NON_GATED_ACTIVATIONS:
        return False
    raise NotImplementedError(
        f"activation_type={a} ({act_name(a)}) is not emulated; supported: "
        f"{sorted(x.name for x in GATED_ACTIVATIONS | NON_GATED_ACTIVATIONS)}"
    )


def act_name(a: int) -> str:
    try:
        return ActivationType(a).name
    except ValueError:
        return "unknown"


# ----------------------------------------------------------------------------------------------------------------
# Activation (the FC1 epilogue / DeepSeek activation kernel)
# ----------------------------------------------------------------------------------------------------------------


Scalar = float | torch.Tensor


def scalar(t: torch.Tensor | None, e: int, default: float) -> Scalar:
    """Expert e's entry of a per-expert scalar tensor as a 0-d tensor on its device (never read on the host: CUDA
    graphs), or `default` when there is no tensor. Arithmetic with it rounds as with the float it holds."""
    return default if t is None else t.reshape(-1)[e]


def scalar_or_none(t: torch.Tensor | None, e: int) -> torch.Tensor | None:
    """`scalar` of an optional control (gemm1_alpha / beta / clamp_limit): None when not given."""
    return None if t is None else t.reshape(-1)[e]


def _gelu(x: torch.Tensor, tanh: bool = False) -> torch.Tensor:
    return torch.nn.functional.gelu(x, approximate="tanh" if tanh else "none")


def activate(
    a1: torch.Tensor,
    act: int,
    gate_scale: Scalar = 1.0,
    out_scale: Scalar = 1.0,
    *,
    alpha: torch.Tensor | None = None,
    beta: torch.Tensor | None = None,
    limit: torch.Tensor | None = None,
    valid_intermediate: int | None = None,
) -> torch.Tensor:
    """GEMM1 output (raw accumulator units) -> activation, as the kernels' epilogue computes it.

    Gated: x1 = up = first half, x2 = gate = second half (dev_kernel.cu gatedSilu(xLinear=x1, xGlu=x2)). The OAI
    controls act on raw accumulator units (clamp limit and beta are passed divided by the dequant scale, SGLang
    modelopt_quant.py), then `gate_scale` (output1_scale_gate_scalar) dequantizes the gate and `out_scale`
    (output1_scale_scalar) scales the product:
        h = act(min(x2, L) * gate_scale) * (clamp(x1, -L, L) + beta) * out_scale,
    with act(g) = g / (1 + exp(-alpha g)) for Swiglu (gatedSilu's exact expression).
    Non-gated: h = act(A1 * gate_scale) * out_scale (SGLang and flashinfer's own prepare put the dequant scale in
    the gate scalar and only the re-quantization factor in output1_scale_scalar for Relu2).
    """
    if is_gated(act):
        ip = a1.shape[-1] // 2
        up, gate = a1[..., :ip], a1[..., ip:]
        if limit is not None:
            gate = gate.clamp(max=limit)
            up = up.clamp(-limit, limit)
        g = gate * gate_scale
        if act == ActivationType.Swiglu:
            a = 1.0 if alpha is None else alpha
            h = g / (1.0 + torch.exp(-a * g))
        elif alpha is not None or beta is not None or limit is not None:
            raise NotImplementedError(f"gemm1_alpha/beta/clamp_limit with activation_type={act_name(act)}")
        else:
            h = _gelu(g, tanh=(act == ActivationType.GegluTanh))
        h = h * (up + (0.0 if beta is None else beta)) * out_scale
        if valid_intermediate is not None and valid_intermediate < ip:
            h[..., valid_intermediate:] = 0
        return h
    if alpha is not None or beta is not None or limit is not None:
        raise NotImplementedError(f"gemm1_alpha/beta/clamp_limit with non-gated activation {act_name(act)}")
    x = a1 * gate_scale
    if act == ActivationType.Relu2:
        h = torch.relu(x).square()
    elif act == ActivationType.Relu:
        h = torch.relu(x)
    elif act == ActivationType.Silu:
        h = x / (1.0 + torch.exp(-x))
    elif act == ActivationType.Gelu:
        h = _gelu(x)
    else:  # Identity
        h = x
    h = h * out_scale
    if valid_intermediate is not None and valid_intermediate < h.shape[-1]:
        h[..., valid_intermediate:] = 0
    return h


# ----------------------------------------------------------------------------------------------------------------
# Shared driver: routing, every local expert on every row, select, finalize
# ----------------------------------------------------------------------------------------------------------------

#: expert_fn(e, rows, slot_weights) -> bf16-valued fp32 [rows, hidden_out]: local expert e on `rows` [n, H] (fp32);
#: slot_weights [n] (fp32) is the routing weight of each row's slot when the weights go on the input, else None
ExpertFn = Callable[[int, torch.Tensor, torch.Tensor | None], torch.Tensor]


def row_inverses(m1: int, gated: bool, hidden: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverses of the kernel's GEMM1 (m1 rows) and GEMM2 (hidden rows) row maps, made on `device` for this call and
    cached nowhere (`layouts.cached`: a map first made inside CUDA-graph capture must not serve later calls)."""
    return (
        layouts.invert_map(layouts.w13_row_map(m1, gated, device, cache=False)),
        layouts.invert_map(layouts.w2_row_map(hidden, device, cache=False)),
    )


def run_experts(
    x: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor | None,
    offset: int,
    n_local: int,
    expert_fn: ExpertFn,
    hidden_out: int,
    output: torch.Tensor | None,
    routing_replay_out: torch.Tensor | None = None,
    weights_on_input: bool = False,
) -> torch.Tensor:
    """x [T, H] float32 (dequantized activations) -> bf16 [T, hidden_out]. Every local expert runs on all T rows
    (static shapes, module docstring); slot (t, k) keeps row t of expert ids[t, k] - offset by a select, so rows of
    other experts (whatever they hold, NaN included) never reach it, and a slot of no local expert stays 0.
    `weights_on_input`: the expert takes each row's slot weight (Llama4), so it runs once per (expert, slot)."""
    T, K = ids.shape
    if routing_replay_out is not None:
        routing_replay_out[:T].copy_(ids.to(routing_replay_out.dtype))
    local = ids.long() - int(offset)
    y = torch.zeros(T, K, hidden_out, dtype=torch.float32, device=x.device)
    for e in range(int(n_local)):
        hit = (local == e).unsqueeze(-1)  # [T, K, 1]
        if weights_on_input and weights is not None:
            for k in range(K):
                y[:, k] = torch.where(hit[:, k], expert_fn(e, x, weights[:, k].float()), y[:, k])
        else:
            y = torch.where(hit, expert_fn(e, x, None).unsqueeze(1), y)
    acc = torch.zeros(T, hidden_out, dtype=torch.float32, device=x.device)
    for k in range(K):  # finalize: fp32 sum in slot order (finalize kernel), weight in its own dtype
        if weights_on_input or weights is None:
            acc = acc + y[:, k]
        else:
            acc = acc + weights[:, k].float().unsqueeze(1) * y[:, k]
    out = acc.to(torch.bfloat16)
    if output is not None:
        output.copy_(out)
        return output
    return out


#: what flashinfer's launcher accepts (kernel_api.ROUTING_LOGITS_DTYPES, the newest contract): router logits and the
#: routing bias in float32 or bfloat16 (trtllm_fused_moe_kernel_launcher.cu of 0.7.2.post1, `check_routing_logits`
#: 1238-1252 and `check_routing_bias_shape` 1277-1283; the same checks in every version from 0.6.8)
ROUTING_DTYPES = tuple(getattr(torch, d) for d in ROUTING_LOGITS_DTYPES)


def routing(
    routing_logits, routing_bias, top_k, n_group, topk_group, routed_scaling_factor, routing_method_type, norm_topk_prob
):
    if routing_logits.dtype not in ROUTING_DTYPES:
        raise ValueError(f"routing_logits must be float or bfloat16, got {routing_logits.dtype} (flashinfer's check)")
    if routing_bias is not None and routing_bias.dtype not in ROUTING_DTYPES:
        raise ValueError(f"routing_bias must be bfloat16 or float, got {routing_bias.dtype} (flashinfer's check)")
    return route(
        routing_method_type,
        routing_logits,
        top_k,
        bias=routing_bias,
        n_group=n_group,
        topk_group=topk_group,
        routed_scaling_factor=routed_scaling_factor,
        norm_topk_prob=norm_topk_prob,
    )


def unsupported(**opts) -> None:
    """Raise NotImplementedError for the first option that is set to something the emulator does not model."""
    for name, (value, ok) in opts.items():
        if not ok:
            raise NotImplementedError(f"the TRT-LLM-Gen MoE emulator does not model {name}={value!r}")


def check_local(name: str, w: torch.Tensor, local_num_experts: int) -> None:
    if w.shape[0] != local_num_experts:
        raise ValueError(
            f"{name} has {w.shape[0]} experts but local_num_experts={local_num_experts}: "
            "weights hold only this rank's experts"
        )


def gemm1_rows(intermediate_size: int, act: int) -> int:
    return 2 * intermediate_size if is_gated(act) else intermediate_size


def unshuffle_rows(w: torch.Tensor, inv: torch.Tensor) -> torch.Tensor:
    """Rows of one expert's prepared matrix back to logical order (row permutation on the byte view)."""
    return w.view(torch.uint8).index_select(0, inv).view(w.dtype)


def sf_numel(n_experts: int, rows: int, cols: int) -> int:
    return n_experts * (-(-rows // 128) * 128) * (-(-cols // 4) * 4)


def expert_sf(sf: torch.Tensor, e: int, n_experts: int, rows: int, cols: int) -> torch.Tensor:
    """Expert e's 128x4-swizzled scales -> linear [rows, cols] uint8, accepting [E, R, C], [E, Rp, Cp] or flat."""
    rp, cp = -(-rows // 128) * 128, -(-cols // 4) * 4
    flat = sf.reshape(-1).view(torch.uint8) if sf.is_contiguous() else sf.contiguous().reshape(-1).view(torch.uint8)
    if flat.numel() != n_experts * rp * cp:
        raise ValueError(
            f"scale tensor of shape {tuple(sf.shape)} does not hold {n_experts} experts of "
            f"{rows}x{cols} scales swizzled to {rp}x{cp}"
        )
    return layouts.unswizzle_sf_128x4(flat[e * rp * cp : (e + 1) * rp * cp].view(rp, cp), rows, cols)


def round_bf16(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.bfloat16).float()


#: the fewest rows a CPU GEMM of the emulator runs with (zero rows appended, dropped after)
GEMM_MIN_ROWS = 8


def gemm(rows: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """`rows @ w.t()` in fp32, every row rounded the same whatever the row count. CPU BLAS picks its kernel by the
    number of rows, and a small-M kernel may round the last fp32 bit differently (measured: torch 2.13's MKL on an
    AVX2 AMD EPYC, 1-3 rows vs 4 or more), so a decode step of 3 requests would differ from the same rows
    prefilled — the batch invariance tests/test_models.py asserts. Fewer than GEMM_MIN_ROWS rows on the CPU are
    padded with zero rows (a static shape: CUDA-graph safe); elsewhere the product is taken as is."""
    n = rows.shape[0]
    if rows.device.type != "cpu" or n >= GEMM_MIN_ROWS:
        return rows @ w.t()
    padded = torch.cat([rows, rows.new_zeros(GEMM_MIN_ROWS - n, rows.shape[1])])
    return (padded @ w.t())[:n]
