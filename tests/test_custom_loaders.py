"""Custom weight loaders and loads under a replaced `torch.Tensor.copy_` (issue #49), on real FusedMoE layers prepared
by the plugin, through SGLang's own `update_weights_from_tensor` with `load_format` naming a loader of
`--custom-weight-loader` (tests/support/custom_loaders.py: verl 0.9.1's own masking `copy_` from its wheel).

- NaN as "unchanged" (verl's contract for a masking loader): for every format whose weights are floating (BF16, FP8
  e4m3 per-tensor / block / MXFP8), a masked write of about 1 % of each expert weight's elements (NaN elsewhere)
  leaves every other element bit-exact — the layer equals a fresh load of the merged checkpoint, layout and kernel
  scalars included; NaN in a scale (NVFP4 e4m3 block scales, FP8 float32 scales) or in the BF16 source of an online
  NVFP4 layer is refused whole, nothing written;
- a loader that raises after writing is answered (False, message) and the layer is what it was, bit for bit;
- a plain request whose load raises after the plugin wrote its experts is answered, never raised, and laid out;
- while `torch.Tensor.copy_` is replaced, batched writes step aside: every expert tensor goes through SGLang's loader
  and so through the replacement, one real destination each, none on a meta tensor; the bytes are the same;
- the plugin's own layout moves never go through a replaced `torch.Tensor.copy_`.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from sglang_trtllm_moe import layer_state
from sglang_trtllm_moe.sandbox import layers as cpu_layers
from sglang_trtllm_moe.updates import batched_writes

from .support import custom_loaders as cl
from .support import sglang_runtime
from .support import verl_delta as vd
from .test_batched_writes import differences


def _spec(kind):
    return cpu_layers.MoeSpec(num_experts=4, hidden=256, fmt=kind)  # I: the kind's own (INT4: 256)


@pytest.fixture(scope="module", autouse=True)
def verl(tmp_path_factory):
    sglang_runtime.ensure("flashinfer_trtllm")
    if vd.wheel() is None:
        pytest.fail(f"no verl {vd.VERSION} wheel in the env root: ci/make-env downloads it (or set {vd.ENV_WHEEL})")
    vd.modules(vd.make_site(tmp_path_factory.mktemp("verl-site")))


@pytest.fixture(autouse=True)
def plugin_prepares(monkeypatch):
    """The plugin's own path for BF16 and DeepSeek FP8 block (SGLang's where compat/defer.py says it is right) is
    what serves the other releases: tested on every release."""
    sglang_runtime.plugin_prepares(monkeypatch, "bf16", "fp8_block")


def _tensors(spec, seed):
    return cpu_layers.checkpoint_names(spec.kind.checkpoint(spec, seed=seed))


def _model(spec, tensors=None):
    sglang_runtime.ensure(spec.kind.format.own_backend or "flashinfer_trtllm")  # MXFP4: SGLang's flashinfer_mxfp4
    model = sglang_runtime.prepared_model(spec, spec.kind.checkpoint(spec, seed=0))
    if tensors is not None:  # a fresh load of these checkpoint tensors instead
        model = sglang_runtime.prepared_model(spec, {k[len(model.prefix) :]: v for k, v in tensors.items()})
    return model


def _update(model, named, loader=None):
    """SGLang's update_weights_from_tensor around `model`, `loader` registered as a custom weight loader."""
    u = sglang_runtime.updater(model, loaders=[loader] if loader else [])
    return u.update_weights_from_tensor(list(named), load_format=loader)


def _masked(old: torch.Tensor, new: torch.Tensor, share: float = 0.01, seed: int = 0):
    """(source, merged): `new`'s values at about `share` of the positions and NaN elsewhere (verl's densified
    delta), and `old` with those positions taken from `new` (what the masked write must leave)."""
    g = torch.Generator().manual_seed(seed)
    pos = torch.randperm(old.numel(), generator=g)[: max(1, int(old.numel() * share))]
    src = torch.full_like(old, float("nan"))
    if old.numel() > 1:  # a one-element tensor stays all NaN: "unchanged"
        src.view(-1)[pos] = new.reshape(-1)[pos]
    merged = old.clone()
    merged.view(-1)[pos] = new.reshape(-1)[pos]
    return src, merged


def _is_weight(name: str, t: torch.Tensor) -> bool:
    return name.endswith("_proj.weight") and t.is_floating_point()


#: formats whose expert weights are floating (a NaN can say "unchanged") and written as they are
WEIGHT_KINDS = ["bf16", "fp8_block", "fp8_modelopt", "fp8_tensor", "mxfp8"]


@pytest.mark.parametrize("kind", WEIGHT_KINDS)
def test_a_masked_write_leaves_every_other_element_bit_exact(kind):
    spec = _spec(kind)
    old, new = _tensors(spec, 0), _tensors(spec, 1)
    model = _model(spec)
    named, merged = [], dict(old)
    for i, (name, t) in enumerate(sorted(old.items())):
        if _is_weight(name, t):
            src, merged[name] = _masked(t, new[name], seed=i)
            named.append((name, src))
    assert len(named) == 3 * spec.num_experts
    ok, msg = _update(model, sorted(old.items()))  # the seed (verl's first sync: the same weights, whole)
    assert ok, msg
    ok, msg = _update(model, named, cl.MASKED)
    assert ok, msg
    fresh = _model(spec, merged)
    assert differences(model, fresh) == []
    assert differences(model, _model(spec)), "the masked write changed nothing"
    st = layer_state.state_of(model.experts)
    assert st is None or st.clean


#: (kind, checkpoint tensor): NaN there means a bad value, not "unchanged", whatever the loader does with it
NAN_REFUSED = [
    ("nvfp4", "experts.2.up_proj.weight_scale"),  # e4m3 block scale
    ("nvfp4", "experts.1.down_proj.weight_scale_2"),  # float32 per-tensor scale
    ("fp8_block", "experts.3.gate_proj.weight_scale_inv"),  # float32 block scale
    ("fp8_tensor", "experts.0.up_proj.weight_scale"),
    ("nvfp4_online", "experts.2.gate_proj.weight"),  # BF16 source SGLang quantizes as it loads
]


@pytest.mark.parametrize("kind, name", NAN_REFUSED, ids=[f"{k}-{n.split('.', 2)[2]}" for k, n in NAN_REFUSED])
def test_nan_in_a_scale_or_an_online_source_is_refused_under_a_masking_loader(kind, name):
    spec = _spec(kind)
    old, new = _tensors(spec, 0), _tensors(spec, 1)
    full = f"{cpu_layers.TinyMoeModel.prefix}{name}"
    src, _ = _masked(old[full].float(), new[full].float(), share=0.5)
    bucket = [(n, t) for n, t in sorted(new.items()) if n != full and ".2." in n] + [(full, src.to(old[full].dtype))]
    model, before = _model(spec), _model(spec)
    ok, msg = _update(model, bucket, cl.MASKED)
    assert not ok and "refused the whole weight-update bucket" in msg and name.rsplit(".", 1)[-1] in msg, msg
    assert differences(model, before) == []


@pytest.mark.parametrize("kind", ["bf16", "nvfp4", "fp8_block"])
def test_a_loader_that_raises_after_writing_is_answered_and_changes_nothing(kind):
    spec = _spec(kind)
    model, before = _model(spec), _model(spec)
    ok, msg = _update(model, sorted(_tensors(spec, 1).items()), cl.RAISES)
    assert not ok and cl.MESSAGE in msg and "as before the request, bit for bit (1 MoE layer(s)" in msg, msg
    assert differences(model, before) == []


def test_a_plain_request_whose_load_raises_after_the_experts_is_answered_and_laid_out():
    """No custom loader: the plugin writes the bucket's experts (batched), then the model's loader raises on a name
    it cannot load. Answered (False, ...), not raised into the scheduler; every written expert laid out again."""
    spec = _spec("nvfp4")
    bucket = [*sorted(_tensors(spec, 1).items()), ("model.layers.0.mlp.not_a_weight", torch.zeros(1))]
    model = _model(spec)
    ok, msg = _update(model, bucket)
    assert not ok and msg.startswith("Failed to update weights: ") and "send the whole update again" in msg, msg
    assert layer_state.state_of(model.experts).clean
    assert differences(model, _model(spec)), "nothing was written before the load raised"


@contextlib.contextmanager
def recorded_copy():
    """`torch.Tensor.copy_` replaced for the block by one that records each destination and copies (as verl's
    verify sweep does)."""
    real = torch.Tensor.copy_
    seen: list[torch.Tensor] = []

    def copy_(self, src, *args, **kwargs):
        seen.append(self)
        return real(self, src, *args, **kwargs)

    torch.Tensor.copy_ = copy_  # type: ignore[method-assign]
    try:
        yield seen
    finally:
        torch.Tensor.copy_ = real  # type: ignore[method-assign]


@pytest.mark.parametrize("kind", ["bf16", "nvfp4", "fp8_block"])
def test_batched_writes_step_aside_while_copy_is_replaced(kind):
    spec = _spec(kind)
    bucket = sorted(_tensors(spec, 1).items())
    model, reference = _model(spec), _model(spec)
    before = batched_writes.counts()
    with recorded_copy() as seen:
        assert batched_writes.copy_replaced()
        ok, msg = _update(model, bucket)
    assert ok, msg
    assert not batched_writes.copy_replaced()
    after = batched_writes.counts()
    assert after.get("tensors", 0) == before.get("tensors", 0), "written batched under a replaced copy_"
    assert after.get("stepped_aside", 0) - before.get("stepped_aside", 0) == len(bucket)
    params = {p.untyped_storage().data_ptr() for p in model.experts.parameters()}
    into = [d for d in seen if d.untyped_storage().data_ptr() in params]
    assert len(into) >= len([n for n, t in bucket if _is_weight(n, t) or t.dtype == torch.uint8 and t.dim() == 2])
    assert not any(d.device.type == "meta" for d in seen), "a traced write reached the replacement"
    with batched_writes.disabled():
        ok, msg = _update(reference, bucket)
    assert ok, msg
    assert differences(model, reference) == []


@pytest.mark.parametrize("kind", sorted(k for k in cpu_layers.LAYERS if not cpu_layers.LAYERS[k].format.fused))
def test_the_plugins_layout_moves_never_go_through_a_replaced_copy(kind):
    spec = _spec(kind)
    model = _model(spec)
    if layer_state.state_of(model.experts) is None:
        pytest.skip(f"sglang: the plugin does not prepare {kind} layers on this release (compat/defer.py, formats/)")
    with recorded_copy() as seen:
        layer_state.unprepare_all(model)
        layer_state.flush_all(end_session=True)
    assert seen == []
    assert differences(model, _model(spec)) == []
