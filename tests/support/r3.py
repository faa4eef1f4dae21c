"""Routed experts (R3) as a whole SGLang model reports them, and SGLang's own top-k as the oracle.

`routed_generation(m, prompts, new_tokens)` runs greedy generation through the sandbox's ModelRunner (sandbox.models:
SGLang's bench_one_batch extend / decode) with `--enable-return-routed-experts` on, and after every forward reads
SGLang's own capturer buffer (what a server copies to the host and returns in `meta_info["routed_experts"]`) and,
for every MoE layer, what SGLang's own `select_experts` picks from the router logits that layer's TopK saw in that
forward (a forward hook records them; SGLang's torch-native path, capture off). Per request it assembles what a
server answers: `[prompt_len + new_tokens - 1, num_hidden_layers, top_k]`.

`disagreements(captured, sglang, logits, bias)` compares them as sets per token (SGLang's top-k and the kernel list
the k experts in different orders); an expert tied with the one it replaced (same logit, same correction bias) is a
tie, not a disagreement: the kernel keeps the lower index, torch.topk promises none.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
from typing import Any

import torch


class Recorder:
    """SGLang's global routed-experts capturer, as a sink for layer-level tests (its real buffer needs a model's
    layer count and the scheduler's batch sizes): every `capture(layer_id, ids)` call, ids copied. SGLang's capture
    site — the per-router opt-out, the call — stays SGLang's own."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, torch.Tensor]] = []

    def capture(self, layer_id, topk_ids=None, topk_indices=None):
        ids = topk_ids if topk_ids is not None else topk_indices
        self.calls.append((layer_id, ids.detach().clone()))


def capturer_module():
    """The module of this release's global routed-experts capturer (getter and setter)."""
    for name in ("sglang.srt.state_capturer.routed_experts", "sglang.srt.layers.moe.routed_experts_capturer"):
        with contextlib.suppress(ImportError):
            return importlib.import_module(name)
    raise AssertionError("no routed-experts capturer module in this SGLang")


@contextlib.contextmanager
def recording():
    """A Recorder as SGLang's global capturer (set with SGLang's own setter), put back afterwards."""
    mod = capturer_module()
    before = mod.get_global_experts_capturer()
    rec = Recorder()
    mod.set_global_experts_capturer(rec)
    try:
        yield rec
    finally:
        mod.set_global_experts_capturer(before)


def topk_ids(x: torch.Tensor, logits: torch.Tensor, topk_config) -> torch.Tensor:
    """SGLang's own select_experts on these logits (torch-native), with no capturer active."""
    from sglang.srt.layers.moe.topk import select_experts

    cfg = dataclasses.replace(topk_config, torch_native=True)
    if hasattr(cfg, "allow_routed_experts_capture"):
        cfg = dataclasses.replace(cfg, allow_routed_experts_capture=False)
    mod = capturer_module()
    before = mod.get_global_experts_capturer()
    if not hasattr(mod, "_RoutedExpertsCapturerNoop"):  # 0.5.11 keeps its no-op object; later ones take None
        mod.set_global_experts_capturer(None)
    try:
        return select_experts(x, logits, cfg).topk_ids
    finally:
        mod.set_global_experts_capturer(before)


def as_sets(ids: torch.Tensor) -> list[set]:
    return [set(r) for r in ids.tolist()]


@contextlib.contextmanager
def recorded_topk(model):
    """Every TopK forward of `model` while inside: (module, hidden, router_logits, kwargs)."""
    from sglang.srt.layers.moe.topk import TopK

    seen: list = []
    hooks = [
        mod.register_forward_hook(
            lambda mod, args, kwargs, out: seen.append((mod, args[0], args[1], kwargs)), with_kwargs=True
        )
        for mod in model.modules()
        if isinstance(mod, TopK)
    ]
    try:
        yield seen
    finally:
        for h in hooks:
            h.remove()


def sglang_ids(mod, hidden, logits, kwargs) -> torch.Tensor:
    """SGLang's own select_experts for one recorded TopK forward (torch-native, capture off)."""
    from sglang.srt.layers.moe.topk import select_experts

    cfg = dataclasses.replace(mod.topk_config, torch_native=True)
    if hasattr(cfg, "allow_routed_experts_capture"):
        cfg = dataclasses.replace(cfg, allow_routed_experts_capture=False)
    return select_experts(hidden, logits, cfg, num_token_non_padded=kwargs.get("num_token_non_padded")).topk_ids


def tied(a: set, b: set, logits: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Do the experts of `a` not in `b` each tie (same logit, same bias) with one of `b` not in `a`?"""
    extra, missing = a - b, b - a
    if len(extra) != len(missing):
        return False
    n = logits.shape[-1]
    return all(
        0 <= x < n
        and any(0 <= y < n and logits[x] == logits[y] and (bias is None or bias[x] == bias[y]) for y in missing)
        for x in extra
    )


def disagreements(captured: torch.Tensor, seen: list, tokens: int) -> dict:
    """`captured` ([>= tokens, layers, >= k] ids, SGLang's capturer buffer after one forward) against SGLang's own
    top-k of every recorded TopK forward, per token as sets."""
    rows, bad, ties = 0, [], 0
    for mod, hidden, logits, kwargs in seen:
        ref = sglang_ids(mod, hidden, logits, kwargs)
        k = ref.shape[1]
        got = captured[:tokens, mod.layer_id, :k]
        bias = getattr(mod.topk_config, "correction_bias", None)
        for t in range(tokens):
            a, b = set(got[t].tolist()), set(ref[t].tolist())
            rows += 1
            if a == b:
                continue
            if tied(a, b, logits[t], bias):
                ties += 1
            else:
                bad.append({"layer": mod.layer_id, "token": t, "kernel": sorted(a), "sglang": sorted(b)})
    return {"rows": rows, "mismatches": bad[:6], "n_mismatches": len(bad), "ties": ties}


@torch.no_grad()
def routed_generation(m, prompts: list[list[int]], new_tokens: int, model=None) -> dict[str, Any]:
    """Greedy generation on `m` (a sandbox.models.TinyModel built with ROUTED_EXPERTS_ARGS) — or on `model` (e.g.
    `m.fresh(dir)`) with `m`'s pools — reading SGLang's capturer after every forward and comparing it with SGLang's
    own top-k of the logits each MoE layer saw there.

    Returns {"tokens": per prompt, "routed": per prompt [prompt_len + new_tokens - 1][layers][k] (what a server
    returns), "checks": [disagreements per forward]}."""
    checks: list = []
    with recorded_topk(model if model is not None else m.model) as seen:

        def after_forward(buffer, rows: int) -> None:
            checks.append(disagreements(buffer, seen, rows))
            seen.clear()

        tokens, routed = m.generate_routed(prompts, new_tokens, model=model, after_forward=after_forward)
    return {"tokens": tokens, "routed": routed, "checks": checks}
