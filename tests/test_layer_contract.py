"""The layer contract every weight format of the registry (`sglang_trtllm_moe.formats.FORMATS`) keeps, one scenario
per test, parametrized over the formats (CASES: a real FusedMoE layer of the installed SGLang on CPU per format and
variant). What only one format has (its own oracle, its emulator reference, its refusals of layers it cannot serve)
stays in its own tests/test_<format>_layer.py.

- an RL update of one expert through SGLang's WeightUpdater re-lays out that expert's two groups only, keeps every
  Parameter (object, storage, shape, loader), and the layer equals a fresh load of the intended checkpoint;
- a refused write (wrong dtype, shape, expert) names the layer, says nothing was written, and leaves every byte;
- SGLang's weight checker dequantizes the prepared layer like SGLang's own dequantizer, passes a correct update and
  locates a flipped byte in checkpoint coordinates;
- writes from SGLang's threaded loader while another thread flushes equal a fresh load (the per-layer lock).

`test_every_format_is_in_the_contract` fails for a registered format that is in no scenario and not exempted with
the reason (tests/test_rl_updates.py, tests/test_checker.py and tests/test_concurrency.py run the same scenarios on
the formats they cover).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import pytest
import torch

from sglang_trtllm_moe import checker, layer_state
from sglang_trtllm_moe.errors import WeightUpdateRefused
from sglang_trtllm_moe.formats import FORMATS
from sglang_trtllm_moe.sandbox import layers as cpu_layers
from sglang_trtllm_moe.sandbox.layers import MoeSpec

from .support import sglang_runtime

TRTLLM, ROUTED, MXFP4 = "flashinfer_trtllm", "flashinfer_trtllm_routed", "flashinfer_mxfp4"
LAYER = "model.layers.0.mlp.experts"

#: marks kept from the per-format files the scenarios came from
MX_PADDED = pytest.mark.sglang(
    ">=0.5.17",
    reason="FusedMoE's plain loader writes a smaller shard into a larger expert "
    "buffer from 0.5.17; before, an intermediate that is not a multiple of 128 cannot be "
    "padded (and SGLang's own prep asserts until 0.5.21): the plugin leaves such layers to SGLang",
)
CHECKER = pytest.mark.sglang(
    ">=0.5.16", reason="SGLang's weight checker (utils.weight_checker_comparator) exists from 0.5.16"
)
CHECKER_MXFP8 = pytest.mark.sglang(
    ">=0.5.16",
    reason="SGLang's weight checker (utils.weight_checker_comparator) and its pure-torch "
    "MXFP8 dequantizer (mxfp8_block_convert) exist from 0.5.16",
)


def as_bytes(t):
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def _expert(tensors: dict, e: int, part: str = "") -> dict:
    return {k: v for k, v in tensors.items() if k.startswith(f"experts.{e}.") and part in k}


@dataclass(frozen=True)
class Case:
    """One format's layer as a scenario builds it: its spec, the backend SGLang resolves for it, its checkpoint
    maker `make(spec, seed)`, and whether the plugin must be made to prepare it where compat/defer.py would defer."""

    spec: MoeSpec
    backend: str = TRTLLM
    make: Callable = cpu_layers.random_checkpoint
    plugin_prepares: bool = False
    fused: bool = False  # gpt-oss: fused all-expert tensors (expert_id=None)
    options: dict = field(default_factory=dict)

    @property
    def fmt(self) -> str:
        """The registered format's name (a layer kind of the sandbox, `MoeSpec.fmt`, serves one format)."""
        return cpu_layers.LAYERS[self.spec.fmt].format.name

    def up(self, monkeypatch) -> None:
        sglang_runtime.ensure(self.backend)
        if self.plugin_prepares:
            sglang_runtime.plugin_prepares(monkeypatch, self.fmt)

    def ckpt(self, seed: int, **kw) -> dict:
        return self.make(self.spec, seed, **kw)

    def model(self, tensors: dict):
        """A TinyMoeModel loaded through SGLang's loader and prepared (the plugin must have taken the layer)."""
        if self.fused:
            model = cpu_layers.TinyMoeModel(self.spec)
            model.load_weights(cpu_layers.checkpoint_names(tensors).items())
            model.experts.quant_method.process_weights_after_loading(model.experts)
        else:
            model = sglang_runtime.prepared_model(self.spec, tensors)
        st = layer_state.state_of(model.experts)
        assert st is not None and st.clean and st.fmt.name == self.fmt, "the plugin did not take the layer"
        return model


def _bf16(spec, seed, **kw):
    return cpu_layers.random_bf16_checkpoint(spec, seed=seed, **kw)


def _ct_int4(spec, seed, **kw):
    return cpu_layers.random_ct_int4_checkpoint(spec, seed=seed, **kw)


def _ct_nvfp4(spec, seed, **kw):
    return cpu_layers.random_ct_nvfp4_checkpoint(spec, seed=seed, **kw)


def _fp8(spec, seed, **kw):
    return cpu_layers.random_fp8_checkpoint(spec, seed=seed, **kw)


def _nvfp4(spec, seed, **kw):
    return cpu_layers.random_nvfp4_checkpoint(spec, seed=seed, **kw)


def _f32_scales(spec, seed, **kw):  # an RL trainer sending float32 scales (SGLang's copy_ converts them to e8m0)
    return cpu_layers.random_checkpoint(spec, seed, scale_dtype=torch.float32, **kw)


MXFP4_EXPERTS = Case(MoeSpec(num_experts=4, intermediate=128, fmt="mxfp4_experts"), backend=MXFP4)
MXFP8 = Case(MoeSpec(num_experts=4, intermediate=128, fmt="mxfp8"))
GPTOSS = Case(MoeSpec(num_experts=4, hidden=192, intermediate=96, fmt="mxfp4_gptoss"), backend=MXFP4, fused=True)


# ---- an RL update of one expert through SGLang's WeightUpdater ------------------------------------------------------

#: (case, the expert updated, the seed of the new weights, what follows: "gate-half" (one expert's gate rows only),
#: "whole" (the whole layer again))
UPDATES = [
    pytest.param(
        Case(MoeSpec(intermediate=96, fmt="bf16"), make=_bf16, plugin_prepares=True), 5, 7, ("whole",), id="bf16-I96"
    ),
    pytest.param(Case(MoeSpec(intermediate=96, fmt="ct_nvfp4"), make=_ct_nvfp4), 5, 7, (), id="ct_nvfp4-I96"),
    pytest.param(
        Case(MoeSpec(num_experts=4, hidden=256, fmt="ct_int4"), make=_ct_int4),
        2,
        7,
        ("gate-half", "whole"),
        id="ct_int4-H256",
    ),
    pytest.param(Case(MoeSpec(intermediate=96, fmt="fp8_modelopt"), make=_fp8), 3, 5, (), id="fp8_modelopt-gated-I96"),
    pytest.param(
        Case(MoeSpec(intermediate=200, activation="relu2", gated=False, fmt="fp8_tensor"), make=_fp8),
        3,
        5,
        (),
        id="fp8_tensor-relu2-I200",
    ),
    pytest.param(
        Case(MoeSpec(intermediate=96, fmt="fp8_block"), make=_fp8, plugin_prepares=True),
        3,
        5,
        (),
        id="fp8_block-gated-I96",
    ),
    pytest.param(
        Case(MoeSpec(num_experts=4, intermediate=128, fmt="mxfp4_experts"), backend=MXFP4, make=_f32_scales),
        2,
        1,
        (),
        id="mxfp4_experts-I128",
    ),
    pytest.param(
        Case(MoeSpec(num_experts=4, intermediate=96, fmt="mxfp4_experts"), backend=MXFP4, make=_f32_scales),
        2,
        1,
        (),
        id="mxfp4_experts-I96-padded",
        marks=MX_PADDED,
    ),
    pytest.param(Case(MoeSpec(num_experts=4, intermediate=96, fmt="mxfp8")), 2, 1, (), id="mxfp8-trtllm-I96"),
    pytest.param(
        Case(MoeSpec(num_experts=4, intermediate=96, fmt="mxfp8"), backend=ROUTED), 2, 1, (), id="mxfp8-routed-I96"
    ),
]


def assert_same_as_fresh(case: Case, model, intended: dict, what: str) -> None:
    """Every parameter and buffer byte of the layer equals a fresh load of `intended`, and the layer is clean."""
    fresh = case.model(intended)
    mine = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    theirs = {**dict(fresh.named_parameters()), **dict(fresh.named_buffers())}
    assert mine.keys() == theirs.keys(), mine.keys() ^ theirs.keys()
    for n, p in theirs.items():
        assert mine[n].shape == p.shape, (n, mine[n].shape, p.shape)
        assert torch.equal(as_bytes(mine[n]), as_bytes(p)), f"{n} differs from {what}"
    assert layer_state.state_of(model.experts).clean


def _kept(layer) -> dict:
    return {
        n: (p, p.data_ptr(), tuple(p.shape), getattr(p, "weight_loader", None)) for n, p in layer.named_parameters()
    }


@pytest.mark.parametrize("case,expert,seed,then", UPDATES)
def test_one_expert_update_equals_a_fresh_load_in_place(case, expert, seed, then, monkeypatch):
    case.up(monkeypatch)
    base = case.ckpt(0)
    model = case.model(base)
    layer = model.experts
    kept = _kept(layer)
    st = layer_state.state_of(layer)
    before = st.experts_prepared_total
    one = _expert(case.ckpt(seed), expert)
    update = sglang_runtime.updater(model).update_weights_from_tensor
    ok, msg = update(list(cpu_layers.checkpoint_names(one).items()))
    assert ok, msg
    assert st.clean and st.experts_prepared_total - before == 2  # the expert's w13 and w2 groups, nothing else
    assert _kept(layer) == kept  # the same Parameter objects, storage, shapes and loaders (the next update needs it)
    intended = {**base, **one}
    assert_same_as_fresh(case, model, intended, "a fresh load of the mixed checkpoint")
    if case.fmt == "mxfp4_experts":  # pad scales stay 1.0 (127)
        assert bool((layer.w13_weight_scale_inv.data.view(torch.uint8) != 0).all())
    for step in then:
        if step == "gate-half":  # one expert's gate rows only (its up rows, interleaved in the kernel, are kept)
            sent = _expert(case.ckpt(seed + 1), 1, ".gate_proj.")
        else:
            sent = case.ckpt(seed + 2)
        ok, msg = update(list(cpu_layers.checkpoint_names(sent).items()))
        assert ok, msg
        intended = {**intended, **sent}
        assert _kept(layer) == kept, step
        assert_same_as_fresh(case, model, intended, f"a fresh load after the {step} update")


# ---- a refused write leaves every byte ------------------------------------------------------------------------------


def _bad_mxfp4_experts(layer, spec, bad):
    new = cpu_layers.random_checkpoint(spec, 1, experts=[1])
    return {  # (parameter, tensor, shard, what the message names besides the layer)
        # raw UE8M0 bytes as uint8: SGLang would store the integers as scale values; the message names what to send
        "uint8-scale": (
            "w13_weight_scale_inv",
            new["experts.1.up_proj.weight_scale_inv"].view(torch.uint8),
            "w3",
            ("float8_e8m0fnu", "float32"),
        ),
        "bf16-weight": ("w13_weight", new["experts.1.gate_proj.weight"].to(torch.bfloat16), "w1", ()),
        # FP8 is only requantized by SGLang for fused *shared* experts
        "fp8-weight-routed-expert": (
            "w2_weight",
            torch.zeros(spec.hidden, spec.intermediate // 2, dtype=torch.float8_e4m3fn),
            "w2",
            (),
        ),
        "shape": ("w2_weight", new["experts.1.down_proj.weight"][:-32], "w2", ()),
    }[bad]


def _bad_mxfp8(layer, spec, bad):
    new = cpu_layers.random_checkpoint(spec, 1, experts=[1])
    return {
        # UE8M0 bytes as float8_e8m0fnu: the uint8 parameter would store the integers 2^k; the message names uint8
        "e8m0-scale": (
            "w13_weight_scale_inv",
            new["experts.1.up_proj.weight_scale_inv"].view(torch.float8_e8m0fnu),
            "w3",
            ("torch.uint8",),
        ),
        "bf16-weight": ("w13_weight", new["experts.1.gate_proj.weight"].to(torch.bfloat16), "w1", ()),
        "shape": ("w2_weight", new["experts.1.down_proj.weight"][:-32], "w2", ()),
    }[bad]


def _bad_gptoss(layer, spec, bad):
    new = cpu_layers.random_checkpoint(spec, 1)
    return {  # whole-layer tensors (expert_id None): the message says they go all experts at once
        "e8m0-scale": ("w13_weight_scale", new["w13_weight_scale"].view(torch.float8_e8m0fnu), None, ()),
        "bf16-weight": ("w2_weight", new["w2_weight"].to(torch.bfloat16), None, ()),
        "experts": ("w13_weight", new["w13_weight"][:3], None, ()),
        "too-wide": ("w2_weight_bias", torch.zeros(spec.num_experts, 512), None, ()),
    }[bad]


REFUSALS = [
    *(
        pytest.param(MXFP4_EXPERTS, _bad_mxfp4_experts, bad, id=f"mxfp4_experts-{bad}")
        for bad in ("uint8-scale", "bf16-weight", "fp8-weight-routed-expert", "shape")
    ),
    *(pytest.param(MXFP8, _bad_mxfp8, bad, id=f"mxfp8-{bad}") for bad in ("e8m0-scale", "bf16-weight", "shape")),
    *(
        pytest.param(GPTOSS, _bad_gptoss, bad, id=f"mxfp4_gptoss-{bad}")
        for bad in ("e8m0-scale", "bf16-weight", "experts", "too-wide")
    ),
]


@pytest.mark.parametrize("case,bads,bad", REFUSALS)
def test_refused_write_leaves_every_byte(case, bads, bad, monkeypatch):
    case.up(monkeypatch)
    model = case.model(case.ckpt(0))
    layer = model.experts
    snap = {n: p.detach().clone() for n, p in layer.named_parameters()}
    name, t, shard, named = bads(layer, case.spec, bad)
    param = getattr(layer, name)
    with pytest.raises(WeightUpdateRefused) as e:
        if case.fused:
            param.weight_loader(param, t, weight_name=name, shard_id=None, expert_id=None)
        else:
            layer.weight_loader(param, t, weight_name=name, shard_id=shard, expert_id=1)
    msg = str(e.value)
    assert isinstance(e.value, ValueError), type(e.value)
    assert LAYER in msg and "nothing was written" in msg, msg
    assert ("all experts at once" if case.fused else "expected") in msg, msg
    assert all(w in msg for w in named), (named, msg)
    for n, p in layer.named_parameters():
        assert torch.equal(as_bytes(p), as_bytes(snap[n])), f"{n} changed"
    assert layer_state.state_of(layer).clean  # refused before the group was un-prepared


# ---- SGLang's weight checker on the prepared layer ------------------------------------------------------------------


def _mxfp4_dequantized(ck, name, scale, experts, shape):
    from sglang.srt.layers.quantization.mxfp4_tensor import MXFP4QuantizeUtil

    return torch.stack(
        [
            MXFP4QuantizeUtil.dequantize(
                ck[name][e].view(torch.uint8), torch.float32, ck[scale][e].view(torch.uint8), [1, 32]
            ).reshape(shape)
            for e in range(experts)
        ]
    ).float()


def _mxfp8_dequantized(ck, name, scale, experts, shape):
    from sglang.srt.layers.quantization.mxfp8_block_convert import dequant_mxfp8_2d_to_bf16

    return torch.stack([dequant_mxfp8_2d_to_bf16(ck[name][e], ck[scale][e]).float() for e in range(experts)])


@dataclass(frozen=True)
class CheckerCase:
    case: Case
    dequantized: Callable  # SGLang's own dequantizer of the loaded (checkpoint-layout) bytes
    sides: tuple  # (parameter, its scale or None: a bias, compared as is)
    raw_differs: bool  # the kernel layout moved the bytes: a raw compare must see it
    flip: tuple  # (checkpoint key, index of the flipped byte) and where the checker must point
    where: str


CHECKERS = [
    pytest.param(
        CheckerCase(
            MXFP4_EXPERTS,
            _mxfp4_dequantized,
            (("w13_weight", "w13_weight_scale_inv"), ("w2_weight", "w2_weight_scale_inv")),
            True,
            ("experts.2.up_proj.weight", (5, 3)),
            "w13_weight[expert 2, row 133, col 3]",  # checkpoint layout [gate; up]: up row 5 is row 128 + 5
        ),
        id="mxfp4_experts",
        marks=CHECKER,
    ),
    pytest.param(
        CheckerCase(
            MXFP8,
            _mxfp8_dequantized,
            (("w13_weight", "w13_weight_scale_inv"), ("w2_weight", "w2_weight_scale_inv")),
            True,
            ("experts.2.gate_proj.weight", (5, 3)),
            "w13_weight[expert 2, row 133, col 3]",  # gate rows follow the 128 up rows in the loaded [up; gate] layout
        ),
        id="mxfp8",
        marks=CHECKER_MXFP8,
    ),
    pytest.param(
        CheckerCase(
            GPTOSS,
            _mxfp4_dequantized,
            (
                ("w13_weight", "w13_weight_scale"),
                ("w2_weight", "w2_weight_scale"),
                ("w13_weight_bias", None),
                ("w2_weight_bias", None),
            ),
            False,
            ("w13_weight", (2, 11, 3)),
            "w13_weight[expert 2, row 11, col 3]",  # checkpoint row 11: up_5 in the interleaved order
        ),
        id="mxfp4_gptoss",
        marks=CHECKER,
    ),
]


@pytest.mark.parametrize("cc", CHECKERS)
def test_checker_dequantizes_like_sglang_passes_a_correct_update_and_locates_a_flipped_byte(cc, monkeypatch):
    from .support.sglang_runtime import weight_checker

    case = cc.case
    case.up(monkeypatch)
    spec = case.spec
    good = case.ckpt(8)
    model = cpu_layers.TinyMoeModel(spec)
    model.load_weights(cpu_layers.checkpoint_names(good).items())
    layer = model.experts
    ck = {n: p.data.clone() for n, p in layer.named_parameters(recurse=False)}
    layer.quant_method.process_weights_after_loading(layer)
    for name, scale in cc.sides:
        live = checker.live_side(layer, name)
        assert live.scale_name == scale
        got = torch.cat([v for _, v, _ in checker.iter_dequantized(live)])
        if scale is None:
            want = ck[name].unsqueeze(-1).float()
        else:
            want = cc.dequantized(ck, name, scale, spec.num_experts, got.shape[1:])
        assert torch.equal(got, want), name
        ckpt_side = checker.snapshot_side(layer, name, ck, checkpoint=True)
        assert checker.compare_layout(ckpt_side, live).equal
        if cc.raw_differs:
            assert not checker.compare_raw(ckpt_side, live).equal  # the kernel layout moved the bytes

    def load(tensors):
        if case.fused:
            cpu_layers.load_fused(layer, tensors)
        else:
            cpu_layers.load_checkpoint(layer, tensors, spec.num_experts)
        layer_state.flush_all()

    # SGLang's flow (snapshot, update, compare): re-sending the same weights passes (one expert; gpt-oss: the whole
    # layer); a flipped byte of expert 2 is located in checkpoint coordinates
    wc = weight_checker(model)
    wc.handle("snapshot", role="target")
    load(good if case.fused else _expert(good, 1))
    wc.handle("compare", role="target")
    wc.handle("snapshot", role="target")
    key, index = cc.flip
    w = good[key].clone()
    w.view(torch.uint8)[index] ^= 0x11
    load({key: w})
    with pytest.raises(Exception) as err:
        wc.handle("compare", role="target")
    msg = str(err.value)
    assert cc.where in msg and "in experts [2]" in msg and " 1 of " in msg, msg[-600:]


# ---- threaded writes while another thread flushes -------------------------------------------------------------------


def _fused_writes_with_a_flusher_round(case: Case, r: int) -> list[str]:
    """gpt-oss: the six fused tensors written from six threads while another flushes: each write un-prepares its
    whole group under the layer's lock, so no writer sees (or leaves) a half-laid-out group. The parameters whose
    bytes differ from a fresh load."""
    import threading

    base, new = case.ckpt(10 * r), case.ckpt(10 * r + 1)
    layer = case.model(base).experts
    barrier = threading.Barrier(len(new) + 1)
    done, errors = threading.Event(), []

    def write(name):
        try:
            barrier.wait()
            cpu_layers.load_fused(layer, {name: new[name]})
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    def flush():
        try:
            barrier.wait()
            while not done.is_set():
                layer_state.flush(layer)
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=write, args=(n,)) for n in new] + [threading.Thread(target=flush)]
    for t in threads:
        t.start()
    for t in threads[:-1]:
        t.join()
    done.set()
    threads[-1].join()
    assert not errors, errors[0]
    layer_state.flush(layer)
    fresh = case.model(new).experts
    names = cpu_layers.GPTOSS_PARAMS + ("gemm1_alpha", "gemm1_beta", "gemm1_clamp_limit")
    return [n for n in names if not torch.equal(as_bytes(getattr(layer, n)), as_bytes(getattr(fresh, n)))]


MX_PARAMS = ("w13_weight", "w13_weight_scale_inv", "w2_weight", "w2_weight_scale_inv")
THREADED = [
    pytest.param(
        Case(MoeSpec(num_experts=8, intermediate=128, fmt="mxfp4_experts"), backend=MXFP4, make=_f32_scales),
        id="mxfp4_experts-shards",  # float32 scales converted by SGLang's copy_ into the e8m0 storage
    ),
    pytest.param(Case(MoeSpec(num_experts=8, intermediate=128, fmt="mxfp8")), id="mxfp8-shards"),
    pytest.param(GPTOSS, id="mxfp4_gptoss-fused"),
]


@pytest.mark.parametrize("case", THREADED)
def test_concurrent_writes_with_a_flusher_equal_a_fresh_load(case, monkeypatch):
    """SGLang's threaded loader: shards of the same experts written from 8 threads while another flushes (the
    per-layer lock makes un-prepare + write one step; tests/test_concurrency.py's rounds), or gpt-oss's fused
    tensors one per thread; three rounds each."""
    from .test_concurrency import _race_round

    case.up(monkeypatch)
    if case.fused:
        wrong = {r: bad for r in range(3) if (bad := _fused_writes_with_a_flusher_round(case, r))}
    else:
        wrong = {r: bad for r in range(3) if (bad := _race_round(case.spec, case.make, MX_PARAMS, r, True))}
    assert not wrong, f"rounds with bytes different from a fresh load (round: parameters): {wrong}"


# ---- a layer the plugin cannot serve, on an explicit flashinfer_trtllm: one clear error, nothing changed ----------


def _narrow_w2_scale(layer):  # a scale tensor whose rows cannot take the 128x4 layout in place (an older allocation)
    layer.w2_weight_scale.data = layer.w2_weight_scale.data[:, :, :6].contiguous()


#: (case, what the message names besides the layer and "Fix:", a change to the loaded layer before its prep)
UNSERVABLE = [
    pytest.param(
        Case(MoeSpec(fmt="bf16", activation="gelu"), make=_bf16, plugin_prepares=True),
        ("'gelu'",),
        None,
        id="bf16-gelu",
    ),
    pytest.param(
        Case(MoeSpec(fmt="bf16", hidden=96), make=_bf16, plugin_prepares=True),
        ("w13_weight", "multiple of 64"),
        None,
        id="bf16-hidden96",
    ),
    pytest.param(
        Case(
            MoeSpec(intermediate=128, activation="relu2", gated=False, fmt="fp8_block"), make=_fp8, plugin_prepares=True
        ),
        ("SwiGLU",),
        None,
        id="fp8_block-relu2",
    ),
    pytest.param(
        Case(
            MoeSpec(intermediate=128, activation="gelu", gated=True, fmt="fp8_modelopt"),
            make=_fp8,
        ),
        ("'gelu'",),
        None,
        id="fp8_modelopt-gelu",
    ),
    pytest.param(
        Case(MoeSpec(fmt="ct_nvfp4", activation="relu2", gated=True), make=_ct_nvfp4),
        ("'relu2'", "gated"),
        None,
        id="ct_nvfp4-gated-relu2",
    ),
    pytest.param(
        Case(MoeSpec(fmt="ct_nvfp4", hidden=192), make=_ct_nvfp4),
        ("w2_weight_scale", "128x4"),
        None,
        id="ct_nvfp4-hidden192",
    ),
    pytest.param(
        Case(MoeSpec(num_experts=2, hidden=384, fmt="ct_int4"), make=_ct_int4),
        ("hidden 384", "256"),
        None,
        id="ct_int4-hidden384",
    ),
    pytest.param(
        Case(MoeSpec(num_experts=2, hidden=256, intermediate=128, fmt="ct_int4"), make=_ct_int4),
        ("intermediate 128", "256"),
        None,
        id="ct_int4-intermediate128",
    ),
    pytest.param(
        Case(MoeSpec(intermediate=128), make=_nvfp4), ("w2_weight_scale",), _narrow_w2_scale, id="nvfp4-narrow-w2-scale"
    ),
]


@pytest.mark.parametrize("case,words,change", UNSERVABLE)
def test_unservable_layer_on_explicit_trtllm_is_one_clear_error(case, words, change, monkeypatch):
    from sglang_trtllm_moe import TrtllmLayerError

    case.up(monkeypatch)
    layer = cpu_layers.build_layer(case.spec)
    cpu_layers.load_checkpoint(layer, case.ckpt(0), case.spec.num_experts)
    if change is not None:
        change(layer)
    before = {n: as_bytes(p).clone() for n, p in layer.named_parameters()}
    with pytest.raises(TrtllmLayerError) as e:
        layer.quant_method.process_weights_after_loading(layer)
    msg = str(e.value)
    assert LAYER in msg and "Fix:" in msg and all(w in msg for w in words), msg
    assert layer_state.state_of(layer) is None
    for n, p in layer.named_parameters():
        assert torch.equal(as_bytes(p), before[n]), f"{n} was modified by a refused prep"


# ---- no emulator on a CPU: the runner says what to do ---------------------------------------------------------------

NO_EMULATOR = [
    pytest.param(Case(MoeSpec(fmt="bf16"), make=_bf16, plugin_prepares=True), False, id="bf16"),
    pytest.param(Case(MoeSpec(), make=_nvfp4), False, id="nvfp4"),
    pytest.param(
        Case(MoeSpec(intermediate=128, fmt="fp8_block"), make=_fp8, plugin_prepares=True), True, id="fp8_block"
    ),
]


@pytest.mark.parametrize("case,bypass", NO_EMULATOR)
def test_without_emulator_on_cpu_the_runner_says_what_to_do(case, bypass, monkeypatch):
    from sglang_trtllm_moe.runner import KernelUnavailableError

    monkeypatch.delenv("SGLANG_TRTLLM_MOE_EMULATE", raising=False)
    case.up(monkeypatch)
    spec = case.spec
    layer = case.model(case.ckpt(0)).experts
    x = torch.randn(2, spec.hidden).to(torch.bfloat16)
    with pytest.raises(KernelUnavailableError) as e:  # never SGLang's CPU path reading kernel-layout bytes
        sglang_runtime.forward(layer, x, torch.randn(2, spec.num_experts), bypass)
    msg = str(e.value)
    assert "SM100" in msg and "SGLANG_TRTLLM_MOE_EMULATE=1" in msg and LAYER in msg, msg


# ---- every registered format is in the contract ---------------------------------------------------------------------

#: formats in no scenario above (or in only some), and where the same scenarios run on them
ELSEWHERE = {
    "nvfp4": "tests/test_rl_updates.py (updates), tests/test_checker.py, tests/test_concurrency.py",
    "nvfp4_online": "tests/test_nvfp4_online_layer.py (its BF16 updates are quantized by SGLang's online loader)",
    "nvfp4_online_tensor": "tests/test_nvfp4_online_layer.py (the per-tensor kind of every online scenario)",
}


def test_every_format_is_in_the_contract():
    scenarios = {
        "update": {p.values[0].fmt for p in UPDATES},
        "refusal": {p.values[0].fmt for p in REFUSALS},
        "checker": {p.values[0].case.fmt for p in CHECKERS},
        "threads": {p.values[0].fmt for p in THREADED},
        "unservable": {p.values[0].fmt for p in UNSERVABLE},
        "no emulator": {p.values[0].fmt for p in NO_EMULATOR},
    }
    covered = set().union(*scenarios.values())
    names = {f.name for f in FORMATS}
    assert not (covered | set(ELSEWHERE)) ^ names, (covered | set(ELSEWHERE)) ^ names
