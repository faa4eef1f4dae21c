"""Routing methods against a plain per-token reference written here from the kernel sources' description.

The reference loops over tokens in Python and sorts with `sorted` (no torch.topk), so it shares no code with
`routing.route`. Inputs are drawn from a generator that makes ties essentially impossible (continuous floats), and
each case asserts the ids exactly and the bf16 weights exactly (both sides round the same fp32-ish value to bf16;
we allow 1 bf16 ulp for the different summation order).

The packed top-k format is checked bit-for-bit against flashinfer's own `pack_flashinfer_trtllm_topk_ids_weights`.
"""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sglang_trtllm_moe.emulator.routing import pack_topk, route, split_routed_input, unpack_topk
from sglang_trtllm_moe.kernel_api import RoutingMethodType


def _sig(x):
    return 1.0 / (1.0 + math.exp(-x))


def _ref_token(method, s, k, bias, n_group, topk_group, rsf, norm):
    """One token: list of (expert, weight float) best first."""
    E = len(s)
    order = lambda score: sorted(range(E), key=lambda e: (-score[e], e))  # noqa: E731
    if method == 0:
        mx = max(s)
        ex = [math.exp(v - mx) for v in s]
        p = [v / sum(ex) for v in ex]
        ids = order(p)[:k]
        return [(e, p[e]) for e in ids]
    if method in (1, 4):
        ids = order(s)[:k]
        mx = max(s[e] for e in ids)
        ex = {e: math.exp(s[e] - mx) for e in ids}
        tot = sum(ex.values())
        return [(e, ex[e] / tot) for e in ids]
    if method in (2, 7):
        sig = [_sig(v) for v in s]
        b = [sig[e] + (bias[e] if bias is not None else 0.0) for e in range(E)]
        allowed = set(range(E))
        if method == 2 and n_group and n_group > 1:
            gsz = E // n_group
            gscore = []
            for g in range(n_group):
                top2 = sorted(b[g * gsz : (g + 1) * gsz], reverse=True)[:2]
                gscore.append(sum(top2))
            keep = sorted(range(n_group), key=lambda g: (-gscore[g], g))[:topk_group]
            allowed = {e for g in keep for e in range(g * gsz, (g + 1) * gsz)}
        masked = [b[e] if e in allowed else -math.inf for e in range(E)]
        ids = order(masked)[:k]
        tot = sum(sig[e] for e in ids)
        return [(e, sig[e] * rsf / (tot + 1e-20)) for e in ids]
    if method == 3:
        e = order(s)[0]
        return [(e, _sig(s[e]))]
    if method == 5:
        return [(e, s[e]) for e in order(s)[:k]]
    if method in (6, 8):
        sig = [_sig(v) for v in s]
        ids = order(sig)[:k]
        tot = sum(sig[e] for e in ids) if (method == 6 and norm) else 1.0
        return [(e, sig[e] / tot) for e in ids]
    if method == 9:
        return [(e, _sig(s[e])) for e in order(s)[:k]]
    raise AssertionError(method)


def _check(method, logits, k, bias=None, n_group=None, topk_group=None, rsf=None, norm=True):
    ids, w = route(
        method,
        logits,
        k,
        bias=bias,
        n_group=n_group,
        topk_group=topk_group,
        routed_scaling_factor=rsf,
        norm_topk_prob=norm,
    )
    assert ids.dtype == torch.int32 and w.dtype == torch.bfloat16
    assert ids.shape == (logits.shape[0], k) == w.shape
    s_all = logits.float().tolist()
    b = bias.float().tolist() if bias is not None else None
    for t, s in enumerate(s_all):
        ref = _ref_token(int(method), s, k, b, n_group, topk_group, 1.0 if rsf is None else rsf, norm)
        assert ids[t].tolist() == [e for e, _ in ref], (t, ids[t].tolist(), ref)
        ref_w = torch.tensor([v for _, v in ref], dtype=torch.float64).to(torch.bfloat16).float()
        got = w[t].float()
        assert torch.allclose(got, ref_w, rtol=2**-7, atol=0), (t, got, ref_w)


ALL_CUSTOM = [
    RoutingMethodType.Default,
    RoutingMethodType.Renormalize,
    RoutingMethodType.RenormalizeNaive,
    RoutingMethodType.TopK,
    RoutingMethodType.SigmoidRenorm,
    RoutingMethodType.Sigmoid,
    RoutingMethodType.TopKSigmoid,
]


def test_enum_values_match_flashinfer():
    import flashinfer.tllm_enums as fi

    for m in fi.RoutingMethodType:
        assert RoutingMethodType[m.name] == int(m)


@settings(max_examples=30, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    method=st.sampled_from(ALL_CUSTOM),
    k=st.integers(1, 8),
    T=st.integers(1, 6),
    bf16=st.booleans(),
)
def test_custom_methods_vs_reference(seed, method, k, T, bf16):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(T, 32, generator=g) * 2
    if bf16:
        logits = logits.to(torch.bfloat16)
    _check(method, logits, k)


def test_sigmoid_renorm_without_norm_equals_sigmoid():
    logits = torch.randn(5, 16, generator=torch.Generator().manual_seed(5))
    _check(RoutingMethodType.SigmoidRenorm, logits, 3, norm=False)
    a = route(6, logits, 3, norm_topk_prob=False)
    b = route(8, logits, 3)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    # and with normalization the weights sum to ~1
    assert torch.allclose(route(6, logits, 3)[1].float().sum(-1), torch.ones(5), atol=1e-2)


@settings(max_examples=30, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    grouped=st.booleans(),
    rsf=st.sampled_from([None, 1.0, 2.5]),
    bias_bf16=st.booleans(),
)
def test_deepseek_v3_vs_reference(seed, grouped, rsf, bias_bf16):
    g = torch.Generator().manual_seed(seed)
    E, k = 64, 6
    logits = torch.randn(5, E, generator=g)
    bias = torch.randn(E, generator=g) * 0.5
    if bias_bf16:
        bias = bias.to(torch.bfloat16)
    if grouped:
        _check(RoutingMethodType.DeepSeekV3, logits, k, bias=bias, n_group=8, topk_group=3, rsf=rsf)
    else:
        _check(RoutingMethodType.DeepSeekV3, logits, k, bias=bias, n_group=None, topk_group=None, rsf=rsf)


def test_deepseek_groups_actually_restrict():
    """A group whose best two are only moderate loses to groups with two strong experts."""
    E = 16
    logits = torch.full((1, E), -4.0)
    logits[0, 0] = 4.0  # group 0 (experts 0-3): one very strong expert, rest weak
    logits[0, [4, 5]] = 2.0  # group 1: two strong
    logits[0, [8, 9]] = 1.9  # group 2: two strong
    ids, _ = route(2, logits, 2, bias=torch.zeros(E), n_group=4, topk_group=2)
    assert sorted(ids[0].tolist()) == [4, 5]
    ids, _ = route(2, logits, 2, bias=torch.zeros(E))  # no groups: expert 0 wins
    assert ids[0, 0].item() == 0


def test_minimax2_vs_reference():
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(7, 32, generator=g)
    bias = torch.randn(32, generator=g)
    _check(RoutingMethodType.MiniMax2, logits, 4, bias=bias, rsf=1.7)


def test_llama4_vs_reference_and_needs_top1():
    logits = torch.randn(9, 16, generator=torch.Generator().manual_seed(9))
    _check(RoutingMethodType.Llama4, logits, 1)
    with pytest.raises(ValueError):
        route(3, logits, 2)


def test_unknown_method_raises():
    with pytest.raises(NotImplementedError, match="10"):
        route(10, torch.randn(2, 8), 2)


def _flashinfer_pack_reference():
    """flashinfer's b12x `pack_flashinfer_trtllm_topk_ids_weights`, lifted from its source file.

    Importing that module needs cuda-python (absent on CPU), but the function itself is pure torch, so we compile
    just its definition out of the installed file.
    """
    import ast
    import importlib.util
    import pathlib

    spec = importlib.util.find_spec("flashinfer")
    path = pathlib.Path(spec.origin).parent / "experimental/b12x/moe/_shared/kernels/reference_flashinfer.py"
    tree = ast.parse(path.read_text())
    name = "pack_flashinfer_trtllm_topk_ids_weights"
    fn = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == name)
    ns = {"torch": torch}
    exec(compile(ast.Module(body=[fn], type_ignores=[]), str(path), "exec"), ns)
    return ns[fn.name]


def test_pack_matches_flashinfer_b12x_reference_and_roundtrips():
    ids, w = route(1, torch.randn(13, 300, generator=torch.Generator().manual_seed(13)), 4)
    ids = ids + 200  # ids above 255 exercise the high bits
    packed = pack_topk(ids, w)
    ref = _flashinfer_pack_reference()(ids, w)
    assert packed.dtype == torch.int32 and torch.equal(packed, ref)
    ids2, w2 = unpack_topk(packed)
    assert torch.equal(ids2, ids) and torch.equal(w2.view(torch.int16), w.view(torch.int16))
    # negative weights (TopK method) keep their sign bit through the packing
    neg = torch.tensor([[-0.5, 0.25]], dtype=torch.bfloat16)
    i3, w3 = unpack_topk(pack_topk(torch.tensor([[7, 1023]]), neg))
    assert i3.tolist() == [[7, 1023]] and w3.tolist() == neg.tolist()
    # split_routed_input accepts both forms and keeps unpacked weight dtype
    i4, w4 = split_routed_input((ids.long(), w.float()))
    assert i4.dtype == torch.int32 and w4.dtype == torch.float32
