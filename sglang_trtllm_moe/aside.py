"""What stepping aside does (capabilities.py decides it): the layers of a format whose capability group is incomplete
are never half-owned by the plugin — they stay SGLang's own, or the start-up stops with the reason and the fix.

* `check_layer(layer, fmt)` — a quant-method hook (`_prepare.take_over`), before anything of the layer is touched:
  why the plugin leaves it to SGLang (SGLang's own preparation is right for the format on this release:
  compat/defer.py), or None; raises `TrtllmLayerError` where only the plugin keeps the format exact across weight
  updates (`must_serve`): SGLang's own path there is the silent garbage issue #50 measured, and the plugin could not
  promise that every update of such a layer still passes a hook of its own that refuses it (the hook that moved may
  be that update's entry point). On auto as on an explicit backend: the fix it names is another backend, or a
  tested SGLang release.
* `check_built(layer)` — FusedMoE's constructor hook: the same stop for a layer whose format's own hook is the one
  that is missing (take_over would never run), when every format its quant method can hold must be served.
* `at_update(model)` — every update entry point, before it writes: why the update must be refused (a layer of the
  model on SGLang's own path for a format only the plugin keeps exact; a scheduler request whose runners cannot be
  told), or None; also tells the batched writer whether its slot trace still finds SGLang's write.
"""

from __future__ import annotations

import sys

from . import capabilities, layer_state
from .capabilities import STEPPED_ASIDE
from .errors import TrtllmLayerError

PWAL = "process_weights_after_loading"


def must_serve(fmt) -> bool:
    """True where SGLang's own preparation of `fmt` does not keep it exact across weight updates on this release
    (compat/defer.py): only the plugin can serve such layers on flashinfer_trtllm."""
    from .compat import defer

    return not defer.upstream_prepares(fmt)


def format_aside(fmt, load: bool = True) -> str | None:
    """Why the plugin does not take `fmt`'s layers over in this process (its group stepped aside), or None."""
    d = capabilities.decide(fmt.name, load=load)
    return "; ".join(d.why) if d.status == STEPPED_ASIDE else None


def _release() -> str:
    from .compat.releases import installed_version

    return str(installed_version())


def _backend(layer) -> str | None:
    """The MoE runner backend `layer` runs on (its own from 0.5.23, else the process's), None when unknown."""
    backend = getattr(layer, "runner_backend", None)
    if backend is None:
        try:
            from sglang.srt.layers.moe.utils import get_moe_runner_backend

            backend = get_moe_runner_backend()
        except Exception:  # noqa: BLE001 - no MoE config in this process (a bare layer in a script)
            return None
    return str(getattr(backend, "value", backend))


def _refusal(layer, fmt, why: str) -> TrtllmLayerError:
    return TrtllmLayerError(
        f"{layer_state.layer_name(layer)}: this {fmt.name} layer on --moe-runner-backend {_backend(layer) or 'auto'} "
        f"needs sglang-trtllm-moe to prepare it (SGLang {_release()}'s own preparation does not keep {fmt.name} exact "
        f"across weight updates), and the plugin stepped aside for {fmt.name} in this process: {why}. Fix: run "
        "sglang-trtllm-moe with an SGLang release it was tested on (`sglang-trtllm-moe doctor` names them) or a "
        "sglang-trtllm-moe that supports this one, or choose another --moe-runner-backend for this model (e.g. "
        "flashinfer_cutlass)"
    )


def check_layer(layer, fmt) -> str | None:
    """Why `layer` (of `fmt`) stays on SGLang's own path because the plugin stepped aside for `fmt`, or None.
    Raises TrtllmLayerError where SGLang's own path cannot stand in for the plugin's (`must_serve`)."""
    why = format_aside(fmt)
    if why is None:
        return None
    if must_serve(fmt):
        raise _refusal(layer, fmt, why)
    return why


def _owner_classes(fmt) -> list[type | str]:
    """The SGLang quant-method (or compressed-tensors scheme) classes whose post-load step takes `fmt`'s layers
    over: those of its group's process_weights_after_loading targets — the class itself where its module is
    imported, else its name (a module that moved keeps its classes' names; its layers are still this format's)."""
    import pkgutil

    from .plugin import state

    group = next(g for g in capabilities.all_groups() if g.fmt == fmt.name)
    out: list[type | str] = []
    for t in capabilities.members(group, state().targets):
        owner, _, attr = t.target.rpartition(".")
        if attr != PWAL:
            continue
        if t.module not in sys.modules:
            out.append(owner.rpartition(".")[2])
            continue
        try:
            cls = pkgutil.resolve_name(owner)
        except Exception:  # noqa: BLE001 - a class that moved out of its module: known by its name
            out.append(owner.rpartition(".")[2])
            continue
        if isinstance(cls, type):
            out.append(cls)
    return out


def _holds(held: type, owner: type | str) -> bool:
    if isinstance(owner, str):
        return any(k.__name__ == owner for k in held.__mro__)
    return issubclass(held, owner)


def owners(layer) -> list:
    """The registered formats whose post-load step would take `layer` over: by its quant method's (or scheme's)
    class; where that class serves several formats, the hook module that registered its post-load target says which
    one this layer holds (its optional `held_format(method, layer)`: the format, or None for a layer it would not
    take), else all of them."""
    from .formats import FORMATS
    from .plugin import state

    method = getattr(layer, "quant_method", None)
    if method is None:
        return []
    held = [type(method), type(getattr(method, "scheme", None)), type(getattr(layer, "scheme", None))]
    found = [f for f in FORMATS if any(_holds(h, c) for c in _owner_classes(f) for h in held)]
    if len(found) < 2:
        return found
    names = {f.name for f in found}
    sources = {t.source for t in state().targets if t.target.endswith("." + PWAL) and names & set(t.formats)}
    for src in sorted(sources):
        pick = getattr(sys.modules.get(src), "held_format", None)
        if callable(pick):
            try:
                fmt = pick(method, layer)
            except Exception:  # noqa: BLE001 - not a layer it can read: every candidate
                return found
            return [fmt] if fmt is not None and fmt.name in names else []
    return found


def check_built(layer) -> None:
    """A MoE layer just built: if every format its quant method can hold on its backend must be served by the plugin
    and the plugin stepped aside for each, stop now with the reason (its format's own hook may be the missing
    target, so nothing later would)."""
    fmts = [f for f in owners(layer) if _on_backend_of(layer, f)]
    if not fmts or not all(must_serve(f) for f in fmts):
        return
    whys = [format_aside(f) for f in fmts]
    if all(whys):
        raise _refusal(layer, fmts[0], str(whys[0]))


def _on_backend_of(layer, fmt) -> bool:
    from .formats import prepared_on

    backend = _backend(layer)
    return backend is None or backend in prepared_on(fmt)


def _batched() -> None:
    from .updates import batched_writes

    d = capabilities.decide("batched-writes")
    batched_writes.step_aside("; ".join(d.why) if d.status == STEPPED_ASIDE else None)


def at_update(model) -> str | None:
    """Why an update of `model` must be refused before anything is written, or None (the entry points' first step)."""
    refusal = capabilities.REQUEST_REFUSAL.get()
    if refusal:
        return refusal
    _batched()
    from .formats import FORMATS

    aside = {f.name: why for f in FORMATS if must_serve(f) and (why := format_aside(f, load=False))}
    if not aside or model is None or not hasattr(model, "modules"):
        return None
    for layer in model.modules():
        if layer_state.state_of(layer) is not None or layer_state.observed(layer) is not None:
            continue
        for fmt in owners(layer):
            if fmt.name in aside and _on_backend_of(layer, fmt):
                return (
                    f"sglang-trtllm-moe refused this weight update before writing anything: "
                    f"{layer_state.layer_name(layer)} is on SGLang's own {fmt.name} preparation because the plugin "
                    f"stepped aside for {fmt.name} ({aside[fmt.name]}), and SGLang {_release()}'s own path does not "
                    f"keep a weight update of {fmt.name} exact. Fix: run sglang-trtllm-moe with an SGLang release it "
                    "was tested on (`sglang-trtllm-moe doctor`), or serve this model on another "
                    "--moe-runner-backend for RL"
                )
    return None


__all__ = ["at_update", "check_built", "check_layer", "format_aside", "must_serve", "owners"]
