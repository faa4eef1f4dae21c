"""SGLang's capture of routed experts (rollout routing replay, R3: `--enable-return-routed-experts`), per release.

Why the plugin needs it: SGLang captures the experts a token was routed to in one place, the post-processing of its
own `select_experts`. A layer on the fused `flashinfer_trtllm` runner routes inside the kernel, so that place is
never reached and SGLang answers zeros for it (vLLM had the same bug, vllm#44116). The plugin's runner asks the
kernel for the ids it routed (`routing_replay_out`) and hands them to SGLang's own capture site, so SGLang pads,
gathers and copies them to the host exactly as it does for its own routing. What differs between releases is where
that site is and how "off" looks (compat/features.py: ROUTED_EXPERTS_CAPTURE_SITE, ROUTED_EXPERTS_NOOP_CAPTURER).

Nothing here reads a tensor: it is safe on a forward path inside a CUDA graph (the capture is SGLang's device copy).
"""

from __future__ import annotations

from typing import Any

from . import features

TopKConfig = Any


def _topk_module():
    from sglang.srt.layers.moe import topk

    return topk


def capturer() -> Any:
    """SGLang's global routed-experts capturer when `--enable-return-routed-experts` is on in this process (it is
    created with the memory pools), else None."""
    topk = _topk_module()
    get = getattr(topk, "get_global_experts_capturer", None)
    cap = None if get is None else get()
    if cap is None:
        return None
    if features.ROUTED_EXPERTS_NOOP_CAPTURER.present():
        from sglang.srt.layers.moe import routed_experts_capturer as rec

        if isinstance(cap, rec._RoutedExpertsCapturerNoop):
            return None
    return cap


def allowed(topk_config: TopKConfig) -> bool:
    """Would SGLang capture for a router of this config? Draft (MTP / NextN / EAGLE) routers opt out from 0.5.15
    (`allow_routed_experts_capture=False`); before, every router captures, as SGLang's own path does there."""
    return bool(getattr(topk_config, "allow_routed_experts_capture", True))


def wanted(topk_config: TopKConfig) -> bool:
    """Is a capture wanted for a forward of a router of `topk_config` now?"""
    return allowed(topk_config) and capturer() is not None


def capture(topk_config: TopKConfig, layer_id: int, topk_ids: Any) -> None:
    """Hand the routed expert ids `[tokens, top_k]` of layer `layer_id` to SGLang's own capture site (it casts to
    its buffer's dtype and pads fused-shared-expert columns with -1)."""
    topk = _topk_module()
    if features.ROUTED_EXPERTS_CAPTURE_SITE.present():
        topk.capture_routed_experts_if_allowed(topk_config, layer_id, topk_ids)
        return
    cap = capturer()
    if cap is not None:
        cap.capture(layer_id, topk_ids)  # (layer_id, topk_ids) on 0.5.11, (layer_id, topk_indices) on 0.5.12-0.5.14


__all__ = ["allowed", "capture", "capturer", "wanted"]
