"""What the update path already validated, so a write is checked once: the records of the requests now running
(`Checked`, read by the loader hooks of every thread: `checked_write`) and the thread-local handshake between
SGLang's `FusedMoE.weight_loader` and the `_weight_loader_impl` it calls (`mark_validated` / `validated`)."""

from __future__ import annotations

import threading

import torch

#: per thread, what weight_loader validated for the _weight_loader_impl call SGLang makes inside it (param, tensor,
#: parameter name, local expert count); the loader hooks set and read it through mark_validated / restore_validated /
#: validated / was_validated
_HANDSHAKE = threading.local()

#: the records of the requests now running (checked_writes.Checked), read by the loader hooks of every thread
_ACTIVE: list = []
#: the disk updates now running: their records of (id(param), shard id, expert id) whose values were read from the
#: checkpoint's files and checked
_FROM_FILES: list = []
_CHECKED_LOCK = threading.Lock()


class Checked:
    """What one update request's entry-point check validated, for the loader hooks while the request runs.

    Thread-safe: SGLang's loaders write from thread pools (DeepSeek), so the record is visible process-wide while
    the request runs (and only then: `close()`, the entry point's end in a finally), keyed by the objects themselves
    (held, so no id is reused meanwhile). A write matches only when it is the same tensor object written into the
    same parameter with the same shard and expert id as checked — a tensor the model's loader re-creates or
    re-routes is checked again in the hook; a tensor is never re-checked for being re-sent.

    What a check hands over is kept as it came (the request's items and what was checked of them) and turned into
    the look-up tables only when a loader hook first asks (`checked_write`): the expert tensors a request writes
    batched never reach a hook, and cost no entry here."""

    def __init__(self):
        #: (id(tensor), id(param), shard id, expert id) -> (tensor, param, (parameter name, its "."-prefixed form,
        #: local expert count)) of writes validated whole
        self.tensors: dict = {}
        #: ids of the tensors the request's checks resolved (checked here, or another rank's: what later checks of
        #: the same request skip)
        self.ids: set = set()
        #: (id(param), shard id, expert id) -> (param, dtype, shape, (parameter name, "." + name, local expert count))
        #: of checkpoint tensors the disk pre-check validated: header, and values read from the files
        self.from_files: dict = {}
        self._pending: list = []  # (items, [(index, Target)], files?) not turned into tables yet
        self._lock = threading.Lock()
        self._on = False
        #: closed by its request's end: a late call through the request's load_weights wrapper (another thread
        #: that looked it up while the request ran) records nothing, and its writes are checked in the hooks
        self._closed = False

    def add_checked(self, items, checked, resolved=()) -> None:
        """`checked`: (index, name_index.Target) of the items (name, tensor) validated whole; `resolved`: indices of
        every item whose name resolved to a layer of the plugin's (what later checks of the request skip)."""
        if self._closed:
            return
        if resolved:
            self.ids.update(id(items[i][1]) for i in resolved)
        if checked:
            with self._lock:
                self._pending.append((items, checked, False))
            self._activate(_ACTIVE)

    def add_from_files(self, header_tensors, checked) -> None:
        """`checked`: (index, name_index.Target) of the checkpoint's header tensors (name, meta tensor) the disk
        pre-check validated from their headers and whose values (where their kind has a value rule) it read from
        the files and checked."""
        if self._closed or not checked:
            return
        with self._lock:
            self._pending.append((header_tensors, checked, True))
        self._activate(_FROM_FILES)

    def tables(self) -> Checked:
        """The look-up tables, current (what was handed over since turned into entries)."""
        if self._pending:
            with self._lock:
                pending, self._pending = self._pending, []
                for items, checked, files in pending:
                    for i, target in checked:
                        ps = target.ps
                        param, plan = ps.param, ps.plan
                        if param is None or plan is None:
                            continue
                        t = items[i][1]
                        if files:
                            self.from_files[(id(param), ps.shard, target.expert)] = (param, t.dtype, t.shape, plan.hit)
                        else:
                            self.tensors[(id(t), id(param), ps.shard, target.expert)] = (t, param, plan.hit)
        return self

    def _activate(self, table: list) -> None:
        with _CHECKED_LOCK:
            if not self._closed and not any(r is self for r in table):
                table.append(self)
                self._on = True

    def close(self) -> None:
        self._closed = True
        if not self._on:
            return
        with _CHECKED_LOCK:
            for table in (_ACTIVE, _FROM_FILES):
                table[:] = [r for r in table if r is not self]
            self._on = False
        with self._lock:
            self._pending.clear()
        self.tensors.clear()
        self.ids.clear()
        self.from_files.clear()

    def __len__(self) -> int:
        t = self.tables()
        return len(t.tensors) + len(t.from_files)


def checked_write(param, loaded, weight_name, shard_id, expert_id) -> tuple[str, str, int] | None:
    """(parameter name, "." + name, local expert count) when a running request's entry-point check already
    validated this write whole, else None:

    * tensor buckets: the same tensor object, into the same parameter, shard and expert id;
    * a disk update: SGLang's CPU tensor for a (parameter, shard, expert id) whose checkpoint tensor the pre-check
      validated from its header — the same dtype and shape — and whose values it read from the file (unchanged
      since: the entry point compares the files' fingerprints after the load). Every check of the write depends on
      nothing else but the name SGLang passes (checked here) and the device (the CPU), so it would answer the same.
    The name SGLang passes must end in the parameter's."""
    if type(shard_id) is not str or type(expert_id) is not int:
        return None
    hit = None
    if _ACTIVE:
        key = (id(loaded), id(param), shard_id, expert_id)
        for rec in _ACTIVE:
            v = rec.tables().tensors.get(key)
            if v is not None:
                hit = v[2]
                break
    if hit is None and _FROM_FILES:
        hit = _file_hit(param, loaded, shard_id, expert_id)
    if hit is not None and type(weight_name) is str and (weight_name.endswith(hit[1]) or weight_name == hit[0]):
        return hit
    return None


def _file_hit(param, loaded, shard_id, expert_id) -> tuple[str, str, int] | None:
    """(parameter name, "." + name, local expert count) when `loaded` is SGLang's CPU tensor of the checkpoint tensor
    a running disk update's pre-check validated for this (parameter, shard, expert id): the same dtype and shape as
    its header (the first record that knows the slot decides)."""
    slot = (id(param), shard_id, expert_id)
    for rec in _FROM_FILES:
        v = rec.tables().from_files.get(slot)
        if v is not None:
            cpu = loaded.__class__ is torch.Tensor and loaded.is_cpu
            if cpu and v[0] is param and loaded.dtype is v[1] and loaded.shape == v[2]:
                return v[3]
            return None
    return None


def read_from_files(param, loaded, shard_id, expert_id) -> bool:
    """Is `loaded` (SGLang's CPU tensor of a disk update) the checkpoint tensor a running disk update's pre-check
    validated for this (parameter, shard, expert id) — header, dtype, shape, and values where its kind has a value
    rule — so it may be written without another check (the files' fingerprints are compared after the load)?"""
    return bool(_FROM_FILES) and _file_hit(param, loaded, shard_id, expert_id) is not None


def values_from_files(param, shard_id, expert_id) -> bool:
    """Did a running disk update's pre-check read this (parameter, shard, expert id)'s values from the files?"""
    if not _FROM_FILES:
        return False
    key = (id(param), shard_id, expert_id)
    return any(key in rec.tables().from_files for rec in _FROM_FILES)


def mark_validated(param, loaded, name: str | None = None, local_experts: int = 0):
    """`FusedMoE.weight_loader` validated this (param, tensor) as parameter `name` (of `local_experts` local experts,
    0: not known): `_weight_loader_impl` only checks the local id. Returns what to restore."""
    prev = getattr(_HANDSHAKE, "validated", None)
    _HANDSHAKE.validated = (param, loaded, name, local_experts)
    return prev


def restore_validated(prev) -> None:
    _HANDSHAKE.validated = prev


def was_validated(param, loaded) -> bool:
    v = getattr(_HANDSHAKE, "validated", None)
    return v is not None and v[0] is param and v[1] is loaded


def validated(param, loaded) -> tuple | None:
    """(param, tensor, parameter name, local expert count or 0) when `weight_loader` validated this write in this
    thread; None if it did not."""
    v = getattr(_HANDSHAKE, "validated", None)
    if v is not None and v[0] is param and v[1] is loaded:
        return v
    return None
