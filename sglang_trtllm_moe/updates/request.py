"""One update request as SGLang serves it, the object every step of the update path reads.

Built where SGLang starts serving it — the scheduler's entry point for a request that may load into several runners
(a target and its speculative draft: builtins/runner_requests.py `serving`), else the runner's own entry point
(builtins/weight_updates.py `for_model`) — and closed when that ends. It holds:

* the runners' models the request loads into, one after another, and what was checked for each (its
  `checked_writes.Checked` record: each tensor is checked once per request, for the runner whose layer it targets;
  a checkpoint's values are read once per runner);
* the ranks that answer it together (verdicts.ranks(): SGLang's TP group; the draft's runners are in the same
  processes), and so whether a rank checks only the experts it holds (`local_only`);
* each model's name index, checked current once per request (name_index.py);
* whether its expert tensors are written batched or each through SGLang's loader (`writes_batched`: the one place
  that decides it).

Data flows one way: `check` (every runner still to load: bucket_validation's checks, then the values, then one
verdict of all ranks: verdicts.agree) → `load` (the checked list: another rank's experts dropped, this rank's written
batched, the rest to the model's own `load_weights`); for a disk update `check_checkpoint` → `stream`. A refusal
raises BucketRefused with the same message on every rank before any rank writes a byte.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import threading

import torch

from . import batched_writes, bucket_validation, checkpoint_checks, checkpoint_headers, verdicts
from .bucket_validation import BucketRefused
from .checked_writes import Checked
from .name_index import Index, index_of, managed_modules

logger = logging.getLogger("sglang_trtllm_moe")


class UpdateRequest:
    """One request (see the module docstring). Thread-safe: its tables change under a lock."""

    def __init__(self, models: tuple, ranks: verdicts.Ranks | None):
        #: the models of every runner the request loads into, the target's first
        self.models = models
        #: the ranks that answer it together (None: this process is one of several ranks whose group is not known:
        #: each rank checks every tensor itself)
        self.ranks = ranks
        #: a rank checks only the expert tensors it holds (the others' are checked by their ranks, and refused by all)
        self.local_only = ranks is not None
        self._records: dict = {}  # id(model) -> Checked, until the model's own entry point ends
        self._over: set = set()  # ids of the models whose own entry point ended (loaded, or refused)
        self._checkpoints: dict = {}  # (id(model), checkpoint key) -> (fingerprint at the check, headers)
        self._files: dict = {}  # id(model) -> {checkpoint name: (dtype, shape)} validated from the files
        self._indexes: dict = {}  # id(model) -> its name index, current for this request
        self._depth: dict = {}  # id(model) -> how many of its entry points are serving the request now
        self._covered: dict = {}  # id(model) -> (names, checked) of the list its entry point checked whole
        self._kept: dict = {}  # id(model) -> {checkpoint name: the values its pre-check read from the files}
        self._closed = False
        self._lock = threading.Lock()

    # ---- the runners ----------------------------------------------------------------------------------------------

    def concerns(self, model) -> bool:
        """Does the request hold anything of the plugin's for `model`'s entry point: a layer it manages or watches
        there, or in a runner still to load? (The same on every rank.)"""
        return bool(managed_modules(model) or self.others(model))

    def others(self, model) -> list:
        """The request's other runners' models whose load is still to come and that hold a layer of the plugin's:
        this runner's entry point checks the request against them too. One whose load is over is not checked again
        (a refusal now could not undo it; its own entry point checked it)."""
        with self._lock:
            over = set(self._over)
        return [m for m in self.models if m is not model and id(m) not in over and managed_modules(m)]

    def record(self, model) -> Checked:
        """What the request checked for `model` (created on first use): filled by the entry points of the runners
        that load before it, used by its own, and by the loader hooks while it runs."""
        with self._lock:
            rec = self._records.get(id(model))
            if rec is None:
                rec = Checked()
                if self._closed or (id(model) in self._over and not self._depth.get(id(model))):
                    rec.close()  # a late call after the model's entry point ended: nothing recorded, nothing kept
                else:
                    self._records[id(model)] = rec
            return rec

    def index(self, model) -> Index:
        """`model`'s name index, its expert placement checked once in this request."""
        idx = self._indexes.get(id(model))
        if idx is None:
            idx = index_of(model)
            with self._lock:
                self._indexes[id(model)] = idx
        return idx

    @contextlib.contextmanager
    def entered(self, model):
        """While an entry point of `model` serves the request; yields True for the outermost one (an entry point
        that calls another: a direct write inside update_weights_from_tensor)."""
        with self._lock:
            depth = self._depth.get(id(model), 0)
            self._depth[id(model)] = depth + 1
        try:
            yield depth == 0
        finally:
            with self._lock:
                self._depth[id(model)] = depth

    def release(self, model) -> None:
        """`model`'s own entry point is over, or failed: its record closed (nothing of it stays valid for a
        restore's writes or a later request)."""
        with self._lock:
            rec = self._records.pop(id(model), None)
            self._over.add(id(model))
            self._files.pop(id(model), None)
            self._kept.pop(id(model), None)
        if rec is not None:
            rec.close()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            records, self._records = list(self._records.values()), {}
            self._checkpoints.clear()
            self._files.clear()
            self._kept.clear()
        for rec in records:
            rec.close()

    # ---- checks ---------------------------------------------------------------------------------------------------

    def check(
        self, model, named, direct: bool = False, what: str = "weight-update bucket", always: bool = False
    ) -> bucket_validation.Findings:
        """`named` (a list of (name, tensor)) against `model`'s layers and, unless `direct` (whole-parameter writes,
        load_format="direct"), every runner still to load, but what the request checked for each already; then the
        verdict of all ranks. Raises BucketRefused; what was checked goes into each runner's record. Returns
        `model`'s findings (its direct writes: `writes`).

        The ranks exchange their verdicts where the list holds a name of the plugin's not checked yet (the same on
        every rank where each rank got the same list), or `always` (a list SGLang made from one this rank already
        took its own experts out of: only the call is the same on every rank)."""
        runs, raised, resolved = self._findings(model, named, direct)
        self._conclude(named, runs, raised, resolved or always, what)
        return runs[0][1] if runs else bucket_validation.Findings()

    def _findings(self, model, named, direct: bool) -> tuple[list, str | None, int]:
        """([(runner's record, its Findings)], what the check raised, how many names resolved to the plugin's)."""
        runs: list = []
        raised = None
        resolved = 0
        try:
            for m in (model,) if direct else (model, *self.others(model)):
                rec = self.record(m)
                found = bucket_validation.check_items(
                    m, named, direct, rec.ids, local_only=self.local_only, index=self.index(m)
                )
                runs.append((rec, found))
                resolved += len(found.resolved)
        except Exception as e:  # noqa: BLE001 - the check itself failed: every rank refuses the request
            logger.exception("sglang-trtllm-moe: checking an update request raised")
            raised = f"{type(e).__name__}: {e}"
        return runs, raised, resolved

    def _conclude(self, named, runs: list, raised: str | None, exchange, what: str) -> None:
        """The values of what was found, the verdict (exchanged with the other ranks where `exchange` or the check
        raised), then each runner's record."""
        if raised is not None or exchange:
            try:
                for _, found in runs:
                    bucket_validation.check_values(found)
            except Exception as e:  # noqa: BLE001 - as above
                logger.exception("sglang-trtllm-moe: checking an update request's values raised")
                raised = raised or f"{type(e).__name__}: {e}"
            problems = sorted((p for _, f in runs for p in f.problems), key=lambda p: p[0])
            self._verdict(problems, raised, what, len(named))
        for rec, found in runs:
            rec.add_checked(named, found.checked, found.resolved)

    def entry(self, model, named: list) -> list:
        """The list an update entry point got (load_format None): checked whole before SGLang touches it where every
        item is a (name, tensor) pair (SGLang moves each to its device first, which fails raw for a meta tensor;
        a serialized tensor is checked once SGLang unwrapped it, in `load`); then without the expert tensors
        another rank holds (SGLang's loader would write nothing of them here; dropped before SGLang unwraps each:
        a serialized tensor is deserialized per rank, a CUDA IPC handle opened). Returns the list to hand SGLang.
        Raises BucketRefused."""
        runs, raised, resolved = self._findings(model, named, False)
        found = runs[0][1] if runs else None
        whole = found.whole if found is not None else all(isinstance(it[1], torch.Tensor) for it in named)
        if whole:  # (every rank got the same list: the same answer everywhere)
            self._conclude(named, runs, raised, resolved, "weight-update bucket")
        if found is not None:
            mine, kept = batched_writes.dropped(named, found.elsewhere, self.writes_batched())
        else:
            mine, kept = batched_writes.without_others(named, self.index(model), self.writes_batched())
        if whole and found is not None:
            # what `load` finds again in the list SGLang makes of `mine` (the same names in the same order: its own
            # tensors, or new ones moved to its device): checked, nothing to exchange again
            checked = found.checked
            if kept is not None:
                where = {i: k for k, i in enumerate(kept)}
                checked = [(where[i], t) for i, t in checked if i in where]
            with self._lock:
                self._covered[id(model)] = ([it[0] for it in mine], checked)
        return mine

    def _covers(self, model, weights) -> list | None:
        """The checked (index, Target) of `weights` where the entry point's check covered it (the list SGLang made
        of the one `entry` returned), else None."""
        with self._lock:
            covered = self._covered.pop(id(model), None)
        if covered is None or len(covered[0]) != len(weights):
            return None
        names = covered[0]
        for k, it in enumerate(weights):
            if not isinstance(it, (list, tuple)) or len(it) != 2 or it[0] != names[k]:
                return None
        return covered[1]

    def check_checkpoint(self, model, files, read: tuple, fingerprint):
        """The checkpoint `read` (model_path, load_format, weight_name_filter) against `model`'s layers, then every
        runner still to load (one already checked in this request, files unchanged since, is not read again); then
        the verdict of all ranks. Raises BucketRefused; returns `model`'s headers (None: no local safetensors)."""
        model_path, _, keep = read
        key = checkpoint_key(*read)
        runs: list = []
        headers = None
        raised = None
        try:
            if files:
                for m in (model, *self.others(model)):
                    if self._checkpoint(m, key, fingerprint) is not None:
                        continue  # checked for it in this request, files unchanged since
                    if headers is None:
                        headers = checkpoint_headers.read_headers(files, keep)
                    kept = checkpoint_checks.KeptValues(KEEP_BYTES)
                    found = checkpoint_checks.checkpoint_findings(m, files, keep, self.local_only, headers, kept)[1]
                    runs.append((m, found, kept))
                if headers is None:
                    headers = self._checkpoint(model, key, fingerprint)
        except Exception as e:  # noqa: BLE001 - the check itself failed: every rank refuses the request
            logger.exception("sglang-trtllm-moe: checking a checkpoint raised")
            raised = f"{type(e).__name__}: {e}"
        problems = sorted((p for _, f, _ in runs for p in f.problems), key=lambda p: p[0])
        self._verdict(problems, raised, f"checkpoint {model_path}", len(headers.tensors) if headers else 0)
        for m, found, kept in runs:
            assert headers is not None  # (runs come from its headers)
            self.record(m).add_from_files(headers.tensors, found.checked)
            names = headers.tensors
            table = {names[i][0]: (names[i][1].dtype, names[i][1].shape) for i, _ in found.checked}
            with self._lock:
                self._files.setdefault(id(m), {}).update(table)
                self._kept.setdefault(id(m), {}).update(kept)
                if key is not None and fingerprint is not None:
                    self._checkpoints[(id(m), key)] = (fingerprint, headers)
        return headers

    def _checkpoint(self, model, key, fingerprint):
        if key is None or fingerprint is None:
            return None
        with self._lock:
            seen = self._checkpoints.get((id(model), key))
        return seen[1] if seen is not None and seen[0] == fingerprint else None

    def _verdict(self, problems: list, raised: str | None, what: str, n: int) -> None:
        who = self.ranks if self.ranks is not None else verdicts.ALONE
        v = verdicts.agree(who, problems, raised)
        if v.failure is not None:
            raise BucketRefused(f"refused the whole {what} ({n} tensors): {v.failure}; nothing of it was written")
        if v.problems or v.refused:
            raise BucketRefused(bucket_validation.refusal_text(v.problems, what, n, v.refused))

    # ---- writes ---------------------------------------------------------------------------------------------------

    def writes_batched(self) -> bool:
        """Are this request's expert tensors written batched (batched_writes.py), or each through SGLang's own
        loader? The one place that decides it, at each load of the request."""
        return batched_writes.enabled() and not batched_writes.copy_replaced()

    def load(self, model, real, weights, refused: list, *args, batched: bool = True, **kwargs):
        """What the model's `load_weights` does while the request's entry point runs: a list is checked whole (what
        this request did not check already; nothing where the entry point's check covered it), then another rank's
        experts are dropped, this rank's written batched (or left to SGLang's loader: `writes_batched`), and the rest
        goes to the model's own loader in order. An iterator (which may reuse its buffers) is left to the per-shard
        checks. `batched` False (a custom loader's request): this rank's experts too go to SGLang's loader."""
        if isinstance(weights, (list, tuple)):
            checked = self._covers(model, weights)
            if checked is not None:
                self.record(model).add_checked(weights, checked)  # (new objects where SGLang moved them)
            else:
                try:
                    self.check(model, weights, always=True)
                except BucketRefused as e:
                    refused.append(e)
                    raise
            if batched_writes.copy_replaced():  # the whole list to SGLang's loader, through the replacement
                batched_writes.count_stepped_aside(len(weights))
            else:
                weights = batched_writes.write(list(weights), self.index(model), batched and self.writes_batched())
        return real(weights, *args, **kwargs)

    def load_from_files(self, model, real, weights, *args, **kwargs):
        """What the model's `load_weights` does while a disk update whose checkpoint passed the check loads: the
        expert tensors SGLang's iterator yields that the pre-check validated from the files are written batched
        (batched_writes.stream); another rank's are dropped; everything else goes to the model's own loader."""
        table = self._files.get(id(model))
        if isinstance(weights, (list, tuple)) or not table or not self.writes_batched():
            return real(weights, *args, **kwargs)
        kept = self._kept.get(id(model), {})

        def validated(name, tensor, target):
            v = table.get(name)
            ok = v is not None and tensor.__class__ is torch.Tensor and tensor.is_cpu
            if not ok or tensor.dtype is not v[0] or tensor.shape != v[1]:
                return None
            # the values the pre-check read and checked, where it kept them: SGLang's tensor (a view of the mapped
            # file) is then never read (unchanged since: the entry point compares the files' fingerprints after)
            return kept.get(name, tensor)

        return real(batched_writes.stream(weights, self.index(model), validated), *args, **kwargs)


#: a disk update keeps at most this many bytes of the values its pre-check read (per runner), and writes those instead
#: of SGLang's tensors of them (views of the mapped files, never read then): each scale read from the files once
KEEP_BYTES = 1 << 30


def checkpoint_key(model_path, load_format, weight_name_filter):
    """What names one checkpoint read (None where it cannot be told apart: then it is checked again)."""
    key = (model_path, load_format, weight_name_filter)
    try:
        hash(key)
    except TypeError:
        return None
    return key


_CURRENT: contextvars.ContextVar[UpdateRequest | None] = contextvars.ContextVar(
    "sglang_trtllm_moe_update_request", default=None
)


def current() -> UpdateRequest | None:
    """The request the scheduler is serving (where its runners are known)."""
    return _CURRENT.get()


@contextlib.contextmanager
def serving(models: tuple):
    """While the scheduler serves one request that loads into `models` (one after another; () where not known:
    each runner's entry point then serves it as its own request)."""
    req = UpdateRequest(models, verdicts.ranks()) if models else None
    token = _CURRENT.set(req)
    try:
        yield req
    finally:
        _CURRENT.reset(token)
        if req is not None:
            req.close()


@contextlib.contextmanager
def for_model(model):
    """The request `model`'s entry point serves: the scheduler's, or one of its own for the entry point (current while
    it runs). When the outermost entry point of `model` ends, its record is released (and its own request closed)."""
    req = current()
    token = None
    if req is None:
        req = UpdateRequest((model,), verdicts.ranks())
        token = _CURRENT.set(req)
    with req.entered(model) as outermost:
        try:
            yield req
        finally:
            if token is not None:
                _CURRENT.reset(token)
            if outermost:
                if token is not None:
                    req.close()
                else:
                    req.release(model)
