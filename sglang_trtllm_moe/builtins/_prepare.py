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
A hook calls SGLang's original, unchanged, whenever `take_over` returns False (`sglang_prepares`).

A new instance loading from a running one (`--load-format remote_instance`: builtins/remote_instance.py) holds the
seed's bytes, already laid out: while it adopts them (`adopting`), `take_over` takes such a layer over as prepared
(`layer_state.adopt`: nothing laid out twice, its kernel scalars computed), and SGLang's own preparation is not run
(SGLang's remote loader never runs it there either; on laid-out bytes it would pack them twice).
"""

from __future__ import annotations

import logging
import threading

from .. import layer_state
from ..aside import check_layer
from ..compat import defer
from ..errors import TrtllmLayerError
from ..formats import BACKENDS, TRTLLM, TRTLLM_ROUTED

logger = logging.getLogger("sglang_trtllm_moe")

#: what reading an object that is not the layer the plugin expects raises
UNREADABLE = (AttributeError, TypeError, KeyError, IndexError)


#: what a remote-instance load asks of `take_over` (builtins/remote_instance.py): ADOPT (the bytes are the seed's
#: kernel layout), or a refusal's sentence (the bytes' layout cannot be known: start-up stops, naming the fix)
ADOPT = "adopt"
_ADOPTING = threading.local()


def adopting() -> str | None:
    return getattr(_ADOPTING, "mode", None)


def set_adopting(mode: str | None) -> None:
    _ADOPTING.mode = mode


def sglang_prepares(original, method, layer, *args, **kwargs):
    """SGLang's own process_weights_after_loading of a layer the plugin hands back — not while a remote-instance
    load adopts a seed's bytes (`adopting`): there SGLang never runs it (upstream's remote loader), and on bytes the
    seed laid out it would pack them twice."""
    if adopting() is not None:
        logger.debug(
            "sglang-trtllm-moe: %s: remote-instance bytes kept as the seed laid them out (SGLang's own layer)",
            layer_state.layer_name(layer),
        )
        return None
    return original(method, layer, *args, **kwargs)


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
    mode = adopting()
    if v is not None and v.upstream_correct and not (mode == ADOPT and same_layout_as_sglangs(fmt)):
        layer_state.observe(layer, fmt)
        if mode == ADOPT:
            raise TrtllmLayerError(
                f"{layer_state.layer_name(layer)}: SGLang prepares {fmt.name} layers itself on this release and "
                "its remote-instance loader never runs that preparation on the new instance, whose layer would be "
                "served half-prepared. Fix: load this model with --load-format auto"
            )
        return _hand_back(layer, fmt, f"upstream is right for {fmt.name} on this release ({v.evidence})")
    if mode is not None and mode != ADOPT:  # a remote instance's bytes of unknown layout: refused (the reason)
        raise TrtllmLayerError(f"{layer_state.layer_name(layer)}: {mode}")
    if mode == ADOPT:  # a remote instance's layer: the seed's kernel layout, taken over as prepared
        layer_state.adopt(layer, fmt)
        what = "adopted from the remote instance as laid out (nothing laid out again)"
    else:
        layer_state.attach(layer, fmt)
        what = f"prepared in place for flashinfer_trtllm ({layer_state.flush(layer)} expert groups)"
    logger.info("sglang-trtllm-moe: %s: %s %s", layer_state.layer_name(layer), fmt.name, what)
    if side_attrs is not None:
        side_attrs(method, layer)
    return True


def same_layout_as_sglangs(fmt) -> bool:
    """Whether a layer SGLang prepared itself holds exactly `fmt`'s kernel layout (its fused-MoE leaf reads it as
    this format: `sglang_leaf`; or the format lays nothing out: its loaded layout is the kernel's): a remote
    instance may then adopt a seed's bytes of such a layer as the plugin's."""
    return fmt.sglang_leaf is not None or not any(p.permute_rows or p.sf_swizzle or p.block_major_k for p in fmt.params)
