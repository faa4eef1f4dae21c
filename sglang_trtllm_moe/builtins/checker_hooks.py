"""SGLang's weight checker (`POST /weights_checker`; slime's `--check-weight-update-equal`) on every layer the plugin
lays out.

How SGLang 0.5.16+ compares (utils/weight_checker.py): `_build_quantized_set(model)` asks
`select_comparable_weight(quant_method)` per module (only the quant method: it cannot see the layer, so a hook
there cannot tell a plugin-prepared layer from another), `_build_check_entries(raw, ...)` turns each side's tensors
into comparables, `compare_weights(expect, actual)` compares pairs. Our hooks, one concern each:

* `_build_quantized_set` (AROUND): modules the plugin manages are hidden from SGLang's selection (before 0.5.17 it
  raises NotImplementedError on trtllm NVFP4; it never knows FP8 per-tensor / BF16 trtllm layouts) and their
  laid-out weights are listed for us, on the dict SGLang passes on to `_build_check_entries`;
* `_build_check_entries` (AROUND): those weights get a `TrtllmMoeComparable` (weight + block scales as one entry,
  and the layout state of the side that holds them);
* `compare_weights` (AROUND): two of ours are compared by `checker.compare` (raw or layout-aware, locating the
  first mismatches in checkpoint coordinates); anything else goes to SGLang;
* `WeightChecker._snapshot` (AROUND): remembers which experts each snapshot tensor held prepared, so a snapshot
  taken in another layout (before the plugin prepared the layer, or mid-update) is undone correctly; the copy and
  the record happen with every managed layer's lock held, so no concurrent writer changes a layout in between;
* `RawComparable.iter_chunks`, `Fp8BlockComparable.iter_chunks` (AROUND): SGLang moves every chunk with `.cuda()`;
  on a host without CUDA (the emulator, CPU tests) SGLang's own code runs on a copy of the comparable whose tensors
  stay on the weights' device (`HostTensor` views: their `.cuda()` is the identity; torch itself is never patched).
  With CUDA it is SGLang's own code on SGLang's own comparable.

0.5.15 has the same comparator module (the model read as `model_runner.model`); before 0.5.15 the checker compares
through module functions, hooked in checker_legacy_hooks.py.
"""

from __future__ import annotations

import copy

import torch

from .. import checker, hookimpl, layer_attrs, layer_state
from ..compat import features
from ..targets import HookTarget

WC = "sglang.srt.utils.weight_checker"
CMP = "sglang.srt.utils.weight_checker_comparator"
RELEASES = features.WEIGHT_CHECKER_COMPARATOR.releases

#: attribute of a snapshot tensor: bool[E] prepared mask of its layer's group when the snapshot was taken (on the
#: tensor itself, so it lives exactly as long as the snapshot; tensors cannot be weak-dict keys, they compare by value)
SNAPSHOT_STATE_ATTR = layer_attrs.SNAPSHOT_PREPARED


class WeightRef:
    """A laid-out weight of a managed layer, by its full name in the model."""

    __slots__ = ("layer", "prefix", "name")

    def __init__(self, layer, prefix: str, name: str):
        self.layer, self.prefix, self.name = layer, prefix, name

    def full(self, name: str) -> str:
        return self.prefix + name


class PluginQuantizedSet(dict):
    """SGLang's quantized set plus the plugin's entries (full weight name -> WeightRef); SGLang reads it as a dict."""

    trtllm_moe: dict

    def consumed(self) -> set[str]:
        """Names compared inside a plugin entry (the rest of each weight's group), not on their own."""
        out = set()
        for ref in self.trtllm_moe.values():
            fmt = managed_state(ref.layer).fmt
            scale = fmt.scale_of(ref.name)
            if scale is not None:
                out.add(ref.full(scale))
        return out


def managed_layers(model) -> list[tuple[str, object]]:
    return [(name, m) for name, m in model.named_modules() if layer_state.state_of(m) is not None]


def managed_state(layer: object) -> layer_state.LayerState:
    """The layout state of a layer `managed_layers` listed (a managed layer keeps its state for life)."""
    st = layer_state.state_of(layer)
    assert st is not None, f"{layer_state.layer_name(layer)} is not managed by sglang-trtllm-moe"
    return st


class _WithoutManaged:
    """The model as SGLang's selection sees it: without the modules whose layout the plugin owns."""

    def __init__(self, model, skip: set[int]):
        self._model, self._skip = model, skip

    def named_modules(self, *args, **kwargs):
        for name, m in self._model.named_modules(*args, **kwargs):
            if id(m) not in self._skip:
                yield name, m


def weight_names(fmt) -> list[str]:
    """Laid-out parameters that are not some other parameter's block scales."""
    scales = {fmt.scale_of(p.name) for p in fmt.params}
    return [p.name for p in fmt.params if p.name not in scales]


def build_quantized_set(original, model, *args, **kwargs):
    managed = managed_layers(model)
    if not managed:
        return original(model, *args, **kwargs)
    out = PluginQuantizedSet(original(_WithoutManaged(model, {id(m) for _, m in managed}), *args, **kwargs))
    out.trtllm_moe = {}
    for mname, layer in managed:
        prefix = f"{mname}." if mname else ""
        for name in weight_names(managed_state(layer).fmt):
            out.trtllm_moe[prefix + name] = WeightRef(layer, prefix, name)
    return out


def side_of(ref: WeightRef, raw: dict) -> checker.ParamSide:
    live = checker.live_side(ref.layer, ref.name)
    tensors = {n: raw[ref.full(n)] for n in live.tensors}
    t = tensors[ref.name]
    if t.data_ptr() == live.tensors[ref.name].data_ptr():
        return live
    # A snapshot: its recorded state; none recorded means it was taken before the plugin managed the layer,
    # i.e. in checkpoint layout (the plugin changes a layout only after attaching to the layer).
    prepared = getattr(t, SNAPSHOT_STATE_ATTR, None)
    return checker.snapshot_side(ref.layer, ref.name, tensors, prepared=prepared, checkpoint=prepared is None)


def build_check_entries(original, raw, skip_compare_names, quantized_set=None, *args, **kwargs):
    entries = original(raw, skip_compare_names, quantized_set, *args, **kwargs)
    refs = getattr(quantized_set, "trtllm_moe", None)
    if not refs:
        return entries
    return _substitute(entries, raw, refs, quantized_set.consumed())


def _substitute(entries, raw, refs, consumed):
    for entry in entries:
        if entry.name in consumed:
            continue
        ref = refs.get(entry.name)
        if ref is None:
            yield entry
        else:
            yield entry._replace(comparable=checker.TrtllmMoeComparable(side_of(ref, raw), entry.name))


def compare_weights(original, expect, actual, *args, **kwargs):
    if not (isinstance(expect, checker.TrtllmMoeComparable) and isinstance(actual, checker.TrtllmMoeComparable)):
        return original(expect, actual, *args, **kwargs)
    from sglang.srt.utils.weight_checker_comparator import CompareResult

    with layer_state.locked(actual.side.layer):  # the live side is read chunk by chunk: no writer in between
        rep = checker.compare_comparables(expect, actual)
    return CompareResult(rep.equal, rep.max_abs_err, rep.mean_abs_err, rep.num_exceed)


def record_snapshot_state(original, self, *args, **kwargs):
    import contextlib

    managed = managed_layers(model_of(self))
    with contextlib.ExitStack() as held:
        # every layer's lock, in one global order (writers hold one lock at a time: no deadlock)
        for _, layer in sorted(managed, key=lambda m: id(m[1])):
            held.enter_context(managed_state(layer).lock)
        result = original(self, *args, **kwargs)
        snap = getattr(self, "_snapshot_tensors", None) or {}
        for mname, layer in managed:
            st = managed_state(layer)
            prefix = f"{mname}." if mname else ""
            for p in st.fmt.params:
                t = snap.get(prefix + p.name)
                if t is not None:
                    setattr(t, SNAPSHOT_STATE_ATTR, st.prepared[p.group].clone())
    return result


class HostTensor(torch.Tensor):
    """A view of a comparable's tensor (same storage) that stays on the weights' device: `.cuda()` returns it.
    Slices, reshapes and results of torch ops on it are HostTensors too (torch's default subclass propagation), so
    every chunk SGLang's `iter_chunks` derives from it stays where the weights are."""

    def cuda(self, *args, **kwargs):
        return self


def on_this_host(comparable):
    """A shallow copy of SGLang's `comparable` whose tensor attributes are HostTensor views of the same storage."""
    out = copy.copy(comparable)
    for name, value in vars(comparable).items():
        if isinstance(value, torch.Tensor):
            setattr(out, name, value.as_subclass(HostTensor))
    return out


def chunks_on_this_host(original, self, *args, **kwargs):
    """SGLang's comparables move every chunk with `.cuda()`; on a host without CUDA (the emulator, CPU tests) that
    can only raise, so there SGLang's own code compares the same chunks where the weights are, on `on_this_host`'s
    copy of the comparable (no global state: torch is not patched, other threads see nothing). With CUDA it is
    SGLang's own code on its own comparable, untouched."""
    if torch.cuda.is_available():
        yield from original(self, *args, **kwargs)
        return
    yield from original(on_this_host(self), *args, **kwargs)


def model_of(weight_checker):
    if features.WEIGHT_CHECKER_OF_MODEL_RUNNER.present():
        return weight_checker._model_runner.model
    return weight_checker._get_model()


@hookimpl
def register_sglang_hooks(register, release):
    why = "weight checker: plugin-laid-out MoE weights compared raw or layout-aware, mismatches located"
    register(
        HookTarget(
            f"{WC}._build_quantized_set",
            build_quantized_set,
            "around",
            releases=RELEASES,
            capability="weight-check",
            why=why + " (hide managed layers from SGLang's selection)",
        )
    )
    register(
        HookTarget(
            f"{WC}._build_check_entries",
            build_check_entries,
            "around",
            releases=RELEASES,
            capability="weight-check",
            why=why + " (our comparable per laid-out weight)",
        )
    )
    register(
        HookTarget(
            f"{CMP}.compare_weights",
            compare_weights,
            "around",
            releases=RELEASES,
            capability="weight-check",
            why=why + " (our compare, with expert/row/col)",
        )
    )
    register(
        HookTarget(
            f"{WC}.WeightChecker._snapshot",
            record_snapshot_state,
            "around",
            capability="weight-check",
            why="remember the layout each snapshot tensor was taken in",
        )
    )
    for comparable in ("RawComparable", "Fp8BlockComparable"):
        register(
            HookTarget(
                f"{CMP}.{comparable}.iter_chunks",
                chunks_on_this_host,
                "around",
                releases=RELEASES,
                capability="weight-check",
                why=f"SGLang's {comparable} calls .cuda(); on a host without CUDA the chunks stay where they are",
            )
        )
