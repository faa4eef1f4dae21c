"""What every quant-method hook shares: take a layer over for the TRT-LLM-Gen path, or hand it back to SGLang.

A quant method's `process_weights_after_loading` hook decides once per layer. The plugin prepares the layer in
place (formats/ + layouts + layer_state) when it can read everything it needs and the kernel can serve the layer;
otherwise SGLang's own code runs, with one log line saying why — except when the layer cannot be served by the
kernels at all and the user explicitly put it on flashinfer_trtllm: then a `TrtllmLayerError` names the layer, the
reason and the fix (the DESIGN rule: degradation allowed, silence not, and never an AttributeError).
"""

from __future__ import annotations

import logging

from .. import layer_state
from ..errors import TrtllmLayerError

logger = logging.getLogger("sglang_trtllm_moe")


class CannotRead(Exception):
    """The layer lacks something the plugin reads (a wrapper, a stand-in, another release's object)."""


def kw(args, kwargs, i: int, name: str):
    """Argument `name` of a hooked method, passed by position `i` (after self) or by keyword."""
    return kwargs[name] if name in kwargs else args[i]


def prepare_layer(fmt, method, layer, side_attrs=None) -> None:
    """Take `layer` over in `fmt` (first call) or prepare what changed since (every later call)."""
    st = layer_state.state_of(layer)
    if st is None:
        problem = fmt.check_layout(layer)
        if problem:
            raise TrtllmLayerError(
                f"{layer_state.layer_name(layer)}: --moe-runner-backend flashinfer_trtllm cannot serve this "
                f"{fmt.name} layer: {problem}. Fix: choose another --moe-runner-backend for this model "
                "(e.g. flashinfer_cutlass), or leave it on auto"
            )
        layer_state.attach(layer, fmt)
        n = layer_state.flush(layer)
        logger.info("sglang-trtllm-moe: %s: %s prepared in place for flashinfer_trtllm (%d expert groups)",
                    layer_state.layer_name(layer), fmt.name, n)
    else:
        layer_state.flush(layer)
    if side_attrs is not None:
        side_attrs(method, layer)
