"""Custom weight loaders for the tests (SGLang's `--custom-weight-loader`: `update_weights_from_tensor` with
`load_format` naming one of these calls it with the model and the request's tensors), built on verl 0.9.1's own
masking code (tests/support/verl_delta.py puts its site on sys.path).

* `masked_load`: the request's tensors through `model.load_weights` under verl's `delta_loader._masked_copy()` — the
  patched `torch.Tensor.copy_` that keeps the destination wherever the source is NaN — as verl's `apply_delta` loads
  an `indices` flush, without its wire format (so any dtype can be sent: FP8 weights, scales);
* `load_then_raise`: the request's tensors loaded, then an exception (a loader that fails after writing).
"""

from __future__ import annotations

MASKED = "tests.support.custom_loaders.masked_load"
RAISES = "tests.support.custom_loaders.load_then_raise"
MESSAGE = "the custom loader failed after writing"


def masked_load(model, named_tensors) -> None:
    from verl.workers.rollout.sglang_rollout.delta_loader import _masked_copy

    with _masked_copy():
        model.load_weights(list(named_tensors))


def load_then_raise(model, named_tensors) -> None:
    model.load_weights(list(named_tensors))
    raise RuntimeError(MESSAGE)
