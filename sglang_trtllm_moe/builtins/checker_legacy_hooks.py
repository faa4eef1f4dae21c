"""SGLang's weight checker before 0.5.15 (features.WEIGHT_CHECKER_LEGACY_COMPARE), on every layer the plugin lays out.

Why a module of its own: those releases compare through two module functions instead of the comparator module
checker_hooks.py hooks; the concerns are the same (our comparable per laid-out weight, our compare with expert / row
/ col), the places differ.

There `WeightChecker._compare` runs `_check_tensors(_postprocess_tensors(snapshot), _postprocess_tensors(live))`: a
bitwise compare of every tensor, the mismatch reported as max/mean abs error only. The concerns, attached there:

* `WeightChecker._compare` (AROUND): names the model being compared for the two functions below (they are never
  given it), for the duration of the call;
* `_postprocess_tensors` (AROUND): the laid-out weights of managed layers (with their block scales) become one
  `TrtllmMoeComparable` each, yielded after SGLang's own entries for everything else (SGLang 0.5.11's FP8-block
  dequant, which asserts on float32 scales, never sees them); the NVFP4 placeholder Parameters of 0.5.11-0.5.12
  (never read by any kernel) are reported, not compared; on 0.5.11 the DeepSeek FP8 block layers SGLang prepared
  itself (the plugin watches them) are dequantized as 0.5.12 does, instead of through the asserting ue8m0 path;
* `_check_tensors` (AROUND): pairs of ours are compared by `checker.compare` under the layer's lock (expert / row /
  col in the message); the other pairs stream through SGLang's own function (on a host without CUDA, the same
  bitwise compare without its `.cuda()`); one "check tensor equality failed" error lists both.
"""

from __future__ import annotations

import contextvars

import torch

from .. import checker, hookimpl, layer_state
from ..compat import features
from ..targets import HookTarget
from ._prepare import kw
from .checker_hooks import (
    WC,
    PluginQuantizedSet,
    WeightRef,
    managed_layers,
    managed_state,
    model_of,
    side_of,
    weight_names,
)

LEGACY = features.WEIGHT_CHECKER_LEGACY_COMPARE.releases


#: the model whose weights `WeightChecker._compare` is comparing right now (the module functions never get it)
_COMPARING: contextvars.ContextVar[torch.nn.Module | None] = contextvars.ContextVar(
    "sglang_trtllm_moe_checker_model", default=None
)
#: 0.5.11-0.5.12 NVFP4 trtllm layers: placeholder Parameters no kernel reads (features.NVFP4_BLOCKSCALE_SWIZZLED_...)
_PLACEHOLDERS = ("w13_blockscale_swizzled", "w2_blockscale_swizzled")
_FAILED = "check tensor equality failed:\n"


def legacy_compare(original, self, *args, **kwargs):
    token = _COMPARING.set(model_of(self))
    try:
        return original(self, *args, **kwargs)
    finally:
        _COMPARING.reset(token)


def _float_block_scales(model, raw) -> dict[str, str]:
    """features.WEIGHT_CHECKER_UE8M0_SCALES_ONLY: weight -> scale names (full) of layers SGLang prepared itself and
    the plugin watches (compat/defer.py), whose block scales are float (SGLang's dequant there asserts on them)."""
    out = {}
    for mname, m in model.named_modules():
        fmt = layer_state.observed(m)
        if fmt is None or layer_state.state_of(m) is not None:
            continue
        prefix = f"{mname}." if mname else ""
        for w in weight_names(fmt):
            s = fmt.scale_of(w)
            if s is not None and prefix + s in raw and raw[prefix + s].is_floating_point():
                out[prefix + w] = prefix + s
    return out


def _dequant_as_sglang_0_5_12(weight, scale):
    """What SGLang 0.5.12+ compares for a float-scaled 128x128 block weight (its own block_quant_dequant)."""
    from sglang.srt.layers.quantization.fp8_utils import block_quant_dequant

    return block_quant_dequant(weight, scale, block_size=[128, 128], dtype=torch.bfloat16)


def legacy_postprocess_tensors(original, raw, *args, **kwargs):
    model = _COMPARING.get()
    managed = managed_layers(model) if model is not None else []
    blocks = (
        _float_block_scales(model, raw)
        if (model is not None and features.WEIGHT_CHECKER_UE8M0_SCALES_ONLY.present())
        else {}
    )
    if not managed and not blocks:  # a checksum, a model without plugin layers: SGLang's own
        yield from original(raw, *args, **kwargs)
        return
    skip = set(kw(args, kwargs, 0, "skip_compare_names") if (args or "skip_compare_names" in kwargs) else ())
    refs, placeholders = {}, []
    for mname, layer in managed:
        prefix = f"{mname}." if mname else ""
        for name in weight_names(managed_state(layer).fmt):
            refs[prefix + name] = WeightRef(layer, prefix, name)
        if features.NVFP4_BLOCKSCALE_SWIZZLED_PARAMETERS.present():
            placeholders += [prefix + n for n in _PLACEHOLDERS if prefix + n in raw]
    qs = PluginQuantizedSet()
    qs.trtllm_moe = refs
    ours = set(refs) | qs.consumed() | set(placeholders) | set(blocks) | set(blocks.values())
    yield from original({n: t for n, t in raw.items() if n not in ours}, *args, **kwargs)
    for n in placeholders:
        yield n, False, raw[n]
    for w, sc in blocks.items():
        yield w, w not in skip, _dequant_as_sglang_0_5_12(raw[w], raw[sc])
        yield w, False, raw[w]
        yield sc, False, raw[sc]
    for full, ref in refs.items():
        yield full, full not in skip, checker.TrtllmMoeComparable(side_of(ref, raw), full)


def _bitwise_here(name, should_compare, expect, actual, errors, infos) -> None:
    """SGLang's per-pair compare without its .cuda() (a host without CUDA)."""
    if bool(torch.all(expect == actual.to(expect.device))):
        return
    d = (actual.float().to(expect.device) - expect.float()).abs()
    (errors if should_compare else infos).append(f"name={name} max_abs_err={d.max()} mean_abs_err={d.mean()}")


def _sglang_can_compare() -> bool:
    """SGLang's own _check_tensors moves every tensor with .cuda()."""
    return torch.cuda.is_available()


def legacy_check_tensors(original, expect_tensors, actual_tensors, *args, **kwargs):
    errors: list[str] = []
    infos: list[str] = []
    pending: list = []  # the actual side of the pair whose expect side was just handed to SGLang (zip alternates)

    def theirs():
        for e, a in zip(expect_tensors, actual_tensors, strict=True):
            (ename, should, exp), (aname, _, act) = e, a
            if not isinstance(exp, checker.TrtllmMoeComparable):
                yield e, a
                continue
            assert ename == aname, f"{ename=} {aname=}"
            with layer_state.locked(act.side.layer):
                rep = checker.compare_comparables(exp, act)
            if not rep.equal:
                (errors if should else infos).append(f"name={ename} {rep.summary()}")

    if _sglang_can_compare():

        def expect_side():
            for e, a in theirs():
                pending.append(a)
                yield e

        def actual_side():
            while pending:
                yield pending.pop()

        try:
            original(expect_side(), actual_side(), *args, **kwargs)
        except Exception as e:  # noqa: BLE001 - SGLang's own failures are merged with ours below
            if not str(e).startswith(_FAILED):
                raise
            errors.insert(0, str(e)[len(_FAILED) :])
    else:
        for (name, should, exp), (_, _, act) in theirs():
            _bitwise_here(name, should, exp, act, errors, infos)
    if infos:
        import logging

        logging.getLogger("sglang_trtllm_moe").info("[check_tensors] info: %s", infos)
    if errors:
        raise Exception(_FAILED + "\n".join(errors))


@hookimpl
def register_sglang_hooks(register, release):
    legacy_why = "weight checker before 0.5.15: plugin-laid-out MoE weights compared raw or layout-aware, located"
    register(
        HookTarget(
            f"{WC}.WeightChecker._compare",
            legacy_compare,
            "around",
            releases=LEGACY,
            capability="weight-check",
            why=legacy_why + " (which model is being compared)",
        )
    )
    register(
        HookTarget(
            f"{WC}._postprocess_tensors",
            legacy_postprocess_tensors,
            "around",
            releases=LEGACY,
            capability="weight-check",
            why=legacy_why + " (our comparable per laid-out weight)",
        )
    )
    register(
        HookTarget(
            f"{WC}._check_tensors",
            legacy_check_tensors,
            "around",
            releases=LEGACY,
            capability="weight-check",
            why=legacy_why + " (our compare, with expert/row/col)",
        )
    )
