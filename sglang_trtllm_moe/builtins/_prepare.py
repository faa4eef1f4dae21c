"""What every quant-method hook shares: take a layer over for the TRT-LLM-Gen path, or hand it back to SGLang.

A quant method's `process_weights_after_loading` hook asks `take_over` once per call:

* the plugin already manages the layer: prepare what changed since (a flush) — served;
* the plugin stepped aside for the format in this process (a target of its capability group did not land:
  capabilities.py): handed back — or, on an explicit flashinfer_trtllm where only the plugin can serve the format,
  a `TrtllmLayerError` with the reason and the fix (aside.check_layer);
* the plugin cannot read the layer (a wrapper, a stand-in, another release's object): handed back, one log line;
* the kernels cannot serve the layer (activation, shape): if the user explicitly put it on flashinfer_trtllm, a
  `TrtllmLayerError` names the layer, the reason and the fix; otherwise handed back with one log line — the
  DESIGN rule: degradation allowed, silence not, never an AttributeError out of the plugin;
* an explicit flashinfer_trtllm with --enable-return-routed-experts on a flashinfer whose kernel does not report the
  experts it routed for this layer's routing method: a `TrtllmLayerError` (never zeros);
* SGLang's own preparation of this format is right on this release (compat/defer.py): SGLang prepares, the plugin
  only watches (validation of later writes, the emulator) — handed back;
* else the plugin attaches its per-expert layout state and prepares in place — served.
A hook calls SGLang's original, unchanged, whenever `take_over` returns False.
"""

from __future__ import annotations

import logging

from .. import layer_state
from ..aside import check_layer
from ..compat import defer
from ..errors import TrtllmLayerError
from ..formats import BACKENDS, TRTLLM, TRTLLM_ROUTED

logger = logging.getLogger("sglang_trtllm_moe")

#: what reading an object that is not the layer the plugin expects raises
UNREADABLE = (AttributeError, TypeError, KeyError, IndexError)


def kw(args, kwargs, i: int, name: str):
    """Argument `name` of a hooked method, passed by position `i` (after self) or by keyword."""
    return kwargs[name] if name in kwargs else args[i]


def _forced() -> bool:
    from ..compat.platform import backend_requested

    return backend_requested() in BACKENDS


def _check_replay(layer) -> None:
    """An explicit flashinfer_trtllm with --enable-return-routed-experts on a kernel that cannot report the experts
    it routed for this layer's routing method: a clear error at start-up, never zeros (on auto, the selection picks
    flashinfer_trtllm_routed there, and the runner routes such a layer with SGLang's own top-k)."""
    from ..compat.platform import backend_requested
    from ..runner import replay_problem

    if backend_requested() != TRTLLM:
        return
    why = replay_problem(layer)
    if why:
        raise TrtllmLayerError(
            f"{layer_state.layer_name(layer)}: --moe-runner-backend {TRTLLM} cannot serve this layer: {why}. Fix: "
            f"--moe-runner-backend {TRTLLM_ROUTED} (SGLang routes and captures, the kernel computes), or auto, or "
            "flashinfer-python >= the version named"
        )


def _hand_back(layer, fmt, why: str) -> bool:
    logger.info(
        "sglang-trtllm-moe: %s: %s left to SGLang's own preparation: %s", layer_state.layer_name(layer), fmt.name, why
    )
    return False


def take_over(fmt, method, layer, side_attrs=None) -> bool:
    """True when the plugin prepared `layer` in `fmt`; False when SGLang's original must run (see the module doc)."""
    st = layer_state.state_of(layer)
    if st is not None:
        layer_state.flush(layer)
        if side_attrs is not None:
            side_attrs(method, layer)
        return True
    aside = check_layer(layer, fmt)  # raises where the user asked for flashinfer_trtllm and only the plugin can serve
    if aside is not None:
        return _hand_back(layer, fmt, f"the plugin stepped aside for {fmt.name} in this process ({aside})")
    try:
        problem = fmt.check_layout(layer)
    except UNREADABLE as e:
        return _hand_back(layer, fmt, f"the plugin cannot read this layer ({type(e).__name__}: {e})")
    if problem:
        if _forced():
            raise TrtllmLayerError(
                f"{layer_state.layer_name(layer)}: --moe-runner-backend flashinfer_trtllm cannot serve this "
                f"{fmt.name} layer: {problem}. Fix: choose another --moe-runner-backend for this model "
                "(e.g. flashinfer_cutlass), or leave it on auto"
            )
        return _hand_back(layer, fmt, problem)
    _check_replay(layer)
    v = defer.verdict(fmt)
    if v is not None and v.upstream_correct:
        layer_state.observe(layer, fmt)
        return _hand_back(layer, fmt, f"upstream is right for {fmt.name} on this release ({v.evidence})")
    layer_state.attach(layer, fmt)
    n = layer_state.flush(layer)
    logger.info(
        "sglang-trtllm-moe: %s: %s prepared in place for flashinfer_trtllm (%d expert groups)",
        layer_state.layer_name(layer),
        fmt.name,
        n,
    )
    if side_attrs is not None:
        side_attrs(method, layer)
    return True
