"""The way back for a tensor request the plugin could not check before it ran: a custom weight loader's.

`update_weights_from_tensor(..., load_format=<a loader of --custom-weight-loader>)` hands SGLang's model and the
request's tensors to the user's loader (verl 0.9.1's sparse delta loader: a manifest, packed positions and values,
densified into NaN-masked tensors per parameter and loaded with `model.load_weights` in chunks under a masking
`Tensor.copy_`). The request's tensors are not the model's, so nothing can be checked up front; each chunk reaching
`load_weights` is (bucket_validation.check_bucket), but a later chunk can still be refused, the loader can raise
(verl: "delta checksum mismatch", "delta state verification FAILED"), or SGLang's loader can fail on a tensor after
the earlier ones were written. Upstream the exception leaves the scheduler and kills the server.

While such a request runs (`guarded`), the first write into each MoE layer the plugin manages or watches — through
SGLang's FusedMoE loader (builtins/loader_hooks.py) — first copies that layer's parameter storages (weights,
scales, kernel scalars) and its per-expert layout state to host memory; if the request fails, every layer copied is
put back bit for bit, under its lock (`Guard.restore`), and the entry point answers (False, message). Copy-on-write
per layer: a request that writes nothing copies nothing; one that writes every expert copies the MoE layers once.
The copies are bounded by the host's available memory (psutil, `SNAPSHOT_MEMORY_SHARE`): a layer that does not fit
is not copied, and a failure then says which layers could not be put back.

Not covered, said in the answer: parameters outside those MoE layers (attention, routers, embeddings, norms) that
the loader wrote before it failed keep what it wrote, and a loader that writes parameters directly (not through
`load_weights`) bypasses the copy. Cost on every other request: one check of an empty tuple per loader write.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Iterator

import torch

from .. import layer_state

logger = logging.getLogger("sglang_trtllm_moe")

#: the share of the host's available memory the copies of one request (or a disk update's snapshot) may take
SNAPSHOT_MEMORY_SHARE = 0.8


def host_budget() -> int | None:
    """Bytes of host memory a snapshot may take (`SNAPSHOT_MEMORY_SHARE` of what psutil says is available); None
    when that cannot be told."""
    try:
        import psutil  # type: ignore[import-untyped]  # SGLang depends on it; no stubs in the env

        return int(SNAPSHOT_MEMORY_SHARE * psutil.virtual_memory().available)
    except Exception:  # noqa: BLE001 - no way to tell
        return None


def storages_of(tensors) -> list:
    """The distinct storages of `tensors` (the largest per device and address)."""
    seen: dict = {}
    for t in tensors:
        st = t.untyped_storage()
        key = (t.device, st.data_ptr())
        if key not in seen or seen[key].nbytes() < st.nbytes():
            seen[key] = st
    return list(seen.values())


class Guard:
    """The copies of one guarded request: {id(layer): (layer, [(storage, host copy)], masks, scalars_dirty)} of the
    MoE layers of `layers` it wrote into, taken before their first write, and (`save_rest`) one of every other
    parameter and buffer of `model`, taken before its first `load_weights` call."""

    def __init__(self, model, layers) -> None:
        self.model = model
        self.layers = {id(m): m for m in layers}
        self.saved: dict[int, tuple] = {}
        self.rest: list | None = None
        #: what did not fit the host's memory (named in the answer)
        self.missing: list[str] = []
        self.budget = host_budget()
        self.lock = threading.Lock()

    def _copy(self, storages: list, what: str) -> list | None:
        """Host copies of `storages` (None: over the budget; `what` named in the answer). Under `self.lock`."""
        need = sum(st.nbytes() for st in storages)
        if self.budget is not None and need > self.budget:
            self.missing.append(what)
            return None
        if self.budget is not None:
            self.budget -= need
        copies = []
        for st in storages:
            copy = torch.empty(st.nbytes(), dtype=torch.uint8, device="cpu").untyped_storage()
            copy.copy_(st)
            copies.append((st, copy))
        return copies

    def save(self, layer) -> None:
        """Copy `layer` before its first write in this request (a layer outside the guarded model: nothing). Under
        the layer's lock (a concurrent writer of it waits), then the guard's: always in that order."""
        key = id(layer)
        if key not in self.layers or key in self.saved:
            return
        with layer_state.locked(layer) as ls, self.lock:
            if key in self.saved:
                return
            own = storages_of((*layer.parameters(recurse=False), *layer.buffers(recurse=False)))
            copies = self._copy(own, layer_state.layer_name(layer))
            masks = {g: m.clone() for g, m in ls.prepared.items()} if ls is not None else None
            self.saved[key] = (layer, copies, masks, ls.scalars_dirty if ls is not None else None)

    def save_rest(self) -> None:
        """Copy every parameter and buffer of the model outside the MoE layers, once (the loader's first
        `load_weights` call: a request that fails before it copies nothing)."""
        if self.rest is not None:
            return
        with self.lock:
            if self.rest is not None:
                return
            mine = {id(t) for m in self.layers.values() for t in (*m.parameters(), *m.buffers())}
            other = [t for t in (*self.model.parameters(), *self.model.buffers()) if id(t) not in mine]
            moe = {st.data_ptr() for m in self.layers.values() for st in storages_of((*m.parameters(), *m.buffers()))}
            self.rest = self._copy([st for st in storages_of(other) if st.data_ptr() not in moe], "the other layers")
            self.rest = self.rest if self.rest is not None else []

    def restore(self) -> str:
        """Everything copied put back as it was before the request; returns what the answer says about it."""
        back = 0
        for st, copy in self.rest or ():
            st.copy_(copy)
        for layer, copies, masks, dirty in self.saved.values():
            if copies is None:
                continue
            with layer_state.locked(layer) as ls:
                for st, copy in copies:
                    st.copy_(copy)
                if ls is not None and masks is not None:
                    for g, m in masks.items():
                        ls.prepared[g].copy_(m)
                        if ls.views:
                            ls.fmt.on_layout(layer, g, all_prepared=ls.all_prepared(g))
                    ls.scalars_dirty = bool(dirty)
            back += 1
        if not self.missing:
            return (
                f"sglang-trtllm-moe: the served weights are as before the request, bit for bit ({back} MoE layer(s) "
                f"it wrote{' and the other parameters' if self.rest else ''} copied back from host memory)"
            )
        return (
            f"sglang-trtllm-moe: {back} MoE layer(s) it wrote were copied back from host memory; "
            f"{', '.join(self.missing[:4])} could not be copied first (host memory) and may keep what it wrote: load "
            "a good checkpoint"
        )


_GUARDS: list[tuple] = [()]
_LOCK = threading.Lock()


def before_write(layer) -> None:
    """Called by the loader hooks before SGLang writes into `layer` (cheap while no request is guarded)."""
    guards = _GUARDS[0]
    if guards:
        for g in guards:
            g.save(layer)


@contextlib.contextmanager
def guarded(model, layers, on: bool = True) -> Iterator[Guard | None]:
    """For the block, writes into `layers` (the MoE layers of `model`) are copied before their first write (`on`:
    else nothing, None)."""
    if not on:
        yield None
        return
    g = Guard(model, layers)
    with _LOCK:
        _GUARDS[0] = (*_GUARDS[0], g)
    try:
        yield g
    finally:
        with _LOCK:
            _GUARDS[0] = tuple(x for x in _GUARDS[0] if x is not g)


__all__ = ["Guard", "SNAPSHOT_MEMORY_SHARE", "before_write", "guarded", "host_budget", "storages_of"]
