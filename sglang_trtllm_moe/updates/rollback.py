"""A disk update that fails after SGLang touched the model leaves the served weights as they were, bit for bit.

SGLang's `update_weights_from_disk` records the new path (`model_config.model_path`) before it loads, and on a
failure "rolls back" by loading that same path again (every release 0.5.11 - 0.5.23): the bad checkpoint a second
time — which fails again, the exception leaves the scheduler and the server is killed — or, for a shard deleted in
the meantime, whatever is left of it: half old, half new, answered "Rolling back to original weights". The
plugin's pre-check (checkpoint_checks.check_checkpoint) refuses everything it can see before SGLang touches the
model; this is the net for what it cannot: a shard deleted or cut after the check, an I/O error mid-read, a bug.
Upstream would need: roll back to the *previous* source, or keep what it overwrites (see `Net`).

Before SGLang touches the model the plugin makes sure it can put the served weights back, the cheapest way that is
exact (`prepare`):

* replay: the served weights are what loading a list of checkpoint directories in order gives — the checkpoint the
  server loaded the model from (SGLang's DefaultModelLoader, recorded by `remember_load`), then every disk update
  since, partial ones included — and every file of them is unchanged since (size, mtime, inode). Nothing is copied
  up front; on a failure those directories are loaded again through SGLang's own update_weights_from_disk. Any
  update that does not come from disk (tensors, distributed, IPC, direct writes, sessions: `forget`) ends the list:
  from then on the served weights are not reproducible from disk, until a disk update that writes every tensor the
  server's checkpoint held starts a new one.
* snapshot: otherwise every parameter and buffer storage of the model, and the plugin's per-expert layout state,
  are copied to host memory first and copied back on a failure — when the host has the memory (psutil); when it has
  not, the update runs without a net and a warning says so.

Either way the update answers (False, message) — HTTP 400 — and the scheduler lives.
"""

from __future__ import annotations

import glob
import logging
import os
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from .. import layer_state
from . import checkpoint_headers
from .undo import host_budget, storages_of

logger = logging.getLogger("sglang_trtllm_moe")

#: SGLang's answer when a disk update failed after it started writing (every release 0.5.11 - 0.5.23)
SGLANG_ROLLED_BACK = "Rolling back to original weights"


def fingerprint(path: str) -> frozenset:
    """What tells a checkpoint directory's files apart from a rewrite: (name, size, mtime, inode) of each."""
    out = []
    for f in sorted(glob.glob(os.path.join(path, "*.safetensors"))):
        try:
            st = os.stat(f)
        except OSError:
            continue
        out.append((f, st.st_size, st.st_mtime_ns, st.st_ino))
    return frozenset(out)


@dataclass
class Load:
    """One disk load of the served weights: what SGLang's update_weights_from_disk is called with to redo it."""

    path: str
    load_format: str | None
    weight_name_filter: Callable[[str], bool] | None
    files: frozenset
    #: the tensor names it wrote (None: not read yet — the server's own checkpoint, read when first needed)
    names: frozenset | None = None

    def unchanged(self) -> bool:
        return fingerprint(self.path) == self.files

    def tensor_names(self) -> frozenset:
        if self.names is None:
            files = [f for f, *_ in sorted(self.files)]
            headers = checkpoint_headers.read_headers(files, self.weight_name_filter)
            self.names = frozenset(n for n, _ in headers.tensors)
        return self.names


@dataclass
class Record:
    """How the served weights of one model came to be, as far as disk loads tell."""

    #: the disk loads that reproduce the served weights, in order (None: not reproducible from disk)
    loads: list[Load] | None
    #: the server's own load: a disk update writing every name it held replaces every earlier load
    first: Load | None = None

    def full(self) -> frozenset | None:
        return None if self.first is None else self.first.tensor_names()

    def replayable(self, names: frozenset | None) -> bool:
        """The loads are still on disk unchanged and cover every name the next update writes."""
        if names is None or not self.loads or not all(load.unchanged() for load in self.loads):
            return False
        full = self.full()
        return full is not None and names <= full


_RECORDS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_LOCK = threading.Lock()


def remember_load(model, model_path, load_format) -> None:
    """SGLang's DefaultModelLoader loaded `model` from `model_path`: the first load of the list."""
    if not checkpoint_headers.files_of(model_path, load_format):
        return  # a hub id, another format: not reproducible from local safetensors
    first = Load(model_path, load_format, None, fingerprint(model_path))
    first.tensor_names()  # now, while the files are the ones just loaded
    with _LOCK:
        _RECORDS[model] = Record([first], first)


def forget(model) -> None:
    """An update that does not come from disk: the served weights are no longer reproducible from disk loads."""
    if model is None:
        return
    with _LOCK:
        rec = _RECORDS.get(model)
        if rec is not None:
            rec.loads = None


def record_of(model) -> Record | None:
    with _LOCK:
        return _RECORDS.get(model)


@dataclass
class Net:
    """What puts the served weights back if the update fails: a replay of disk loads, or a host snapshot."""

    model: torch.nn.Module
    loads: list[Load] = field(default_factory=list)
    #: (storage, host copy) per distinct storage of the model's parameters and buffers
    saved: list = field(default_factory=list)
    #: layer -> (prepared masks, scalars_dirty) of every layer the plugin prepares in the model
    states: dict = field(default_factory=dict)
    #: why there is no net (the update still runs)
    missing: str = ""

    @property
    def how(self) -> str:
        if self.loads:
            paths = ", ".join(repr(load.path) for load in self.loads)
            return f"reloaded {paths} (unchanged since they were loaded)"
        if self.saved:
            return "copied back from the host snapshot taken before the update"
        return ""

    def restore(self, original, owner) -> str:
        """Put the served weights back; returns what was done (raises when it could not)."""
        if self.loads:
            for load in self.loads:
                ok, msg = original(owner, load.path, load.load_format, load.weight_name_filter)[:2]
                if not ok:
                    raise RuntimeError(f"reloading {load.path!r} failed: {msg}")
        elif self.saved:
            for storage, copy in self.saved:
                storage.copy_(copy)
            for layer, (masks, dirty) in self.states.items():
                st = layer_state.state_of(layer)
                if st is not None:
                    with st.lock:
                        for g, m in masks.items():
                            st.prepared[g].copy_(m)
                        st.scalars_dirty = dirty
        else:
            raise RuntimeError(self.missing or "no way to restore was prepared")
        return self.how


def _snapshot(net: Net) -> None:
    storages = storages_of((*net.model.parameters(), *net.model.buffers()))
    need = sum(st.nbytes() for st in storages)
    budget = host_budget()  # None: no way to tell, assume it fits
    if budget is not None and need > budget:
        net.missing = (
            f"the served weights are not reproducible from disk (an update that did not come from disk, or files "
            f"changed since) and a host snapshot of the model ({need / 2**30:.1f} GiB) does not fit the host's "
            f"available memory (a share of it: {budget / 2**30:.1f} GiB)"
        )
        return
    for st in storages:
        copy = torch.empty(st.nbytes(), dtype=torch.uint8, device="cpu").untyped_storage()
        copy.copy_(st)
        net.saved.append((st, copy))
    for layer in layer_state.managed_layers():
        st_ = layer_state.state_of(layer)
        if st_ is not None:
            with st_.lock:
                net.states[layer] = ({g: m.clone() for g, m in st_.prepared.items()}, st_.scalars_dirty)


def prepare(model, names: frozenset | None) -> Net:
    """The cheapest exact way back for an update writing `names` (None: not known, e.g. not local safetensors; see
    the module doc)."""
    net = Net(model)
    rec = record_of(model)
    if rec is not None and rec.replayable(names):
        net.loads = list(rec.loads or ())
        return net
    _snapshot(net)
    if net.missing:
        logger.warning("sglang-trtllm-moe: update_weights_from_disk runs without a way back: %s", net.missing)
    return net


def succeeded(model, path, load_format, weight_name_filter, names: frozenset) -> None:
    """A disk update succeeded: add it to the loads that reproduce the served weights (or start them anew)."""
    load = Load(path, load_format, weight_name_filter, fingerprint(path), names)
    with _LOCK:
        rec = _RECORDS.get(model)
        if rec is None:
            return  # not loaded by SGLang's default loader from local safetensors: never reproducible from disk
        full = rec.full()
        if weight_name_filter is None and full is not None and names >= full:
            rec.loads = [load]
        elif rec.loads is not None:
            rec.loads.append(load)


__all__ = ["Net", "Record", "forget", "prepare", "record_of", "remember_load", "succeeded"]
