"""What one scheduler request that loads into several runners (a target and its speculative draft) has checked, for
each runner's model, so each runner's entry point checks only what the others' did not.

SGLang loads such a request into the runners one after another (compat/update_runners.py). Each runner's entry point
checks the request against every runner's layers before its own load (a refusal by a later runner would otherwise
come after an earlier one wrote): without a memory of the request, a tensor bucket would be checked once per runner
per runner, and a disk update would read every scale of the checkpoint from the files again in each runner's turn.
Here a runner's checks go into that runner's own record (checked_writes.Checked), which its own entry point then
uses as its record: what was checked is skipped (the same tensor objects), and the loader hooks find the writes
validated. A checkpoint checked for a runner is not checked again for it in the same request while its files are
unchanged (their fingerprint; a change in between is checked again, and the load's own fingerprint comparison
stays per runner).

Thread-safe (a lock per request); one object per scheduler request that reaches more than one runner, current while
the scheduler serves it (`serving`, builtins/runner_requests.py; read by the entry points: `current`), closed when
it ends.
"""

from __future__ import annotations

import contextlib
import contextvars
import threading

from . import bucket_validation
from .checked_writes import Checked


class RequestChecks:
    def __init__(self, models: tuple):
        #: the models of every runner the request loads into, the target's first
        self.models = models
        self._records: dict = {}  # id(model) -> Checked, until the model's own entry point ends
        self._over: set = set()  # ids of the models whose own entry point ended (loaded, or refused)
        self._checkpoints: dict = {}  # (id(model), checkpoint key) -> (fingerprint at the check, headers)
        self._lock = threading.Lock()

    def others(self, model) -> list:
        """The request's other runners' models whose load is still to come and that hold a layer of the plugin's:
        this runner's entry point checks the request against them too. One whose load is over is not checked again
        (a refusal now could not undo it; its own entry point checked it)."""
        with self._lock:
            over = set(self._over)
        return [m for m in self.models if m is not model and id(m) not in over and bucket_validation.managed_modules(m)]

    def record(self, model) -> Checked:
        """The record of what the request checked for `model` (created on first use): filled by the entry points of
        the runners that load before it, used by its own."""
        with self._lock:
            rec = self._records.get(id(model))
            if rec is None:
                rec = self._records[id(model)] = Checked()
            return rec

    def check_bucket(self, other, named) -> None:
        """`named` against a later runner's layers (bucket_validation.check_bucket; raises BucketRefused), skipping
        what the request already checked for it, into its record."""
        rec = self.record(other)
        bucket_validation.check_bucket(other, named, skip=rec.ids, record=rec)

    def release(self, model) -> None:
        """`model`'s own entry point is over, or failed: its record closed (nothing of it stays valid for a restore's
        writes or a later request)."""
        with self._lock:
            rec = self._records.pop(id(model), None)
            self._over.add(id(model))
        if rec is not None:
            rec.close()

    def checkpoint(self, model, key, fingerprint):
        """The headers of the checkpoint `key` checked for `model` in this request, if its files are as they were
        then (`fingerprint`); else None."""
        if key is None or fingerprint is None:
            return None
        with self._lock:
            seen = self._checkpoints.get((id(model), key))
        return seen[1] if seen is not None and seen[0] == fingerprint else None

    def checked_checkpoint(self, model, key, fingerprint, headers) -> None:
        if key is None or fingerprint is None:
            return
        with self._lock:
            self._checkpoints[(id(model), key)] = (fingerprint, headers)

    def close(self) -> None:
        with self._lock:
            records, self._records = list(self._records.values()), {}
            self._checkpoints.clear()
        for rec in records:
            rec.close()


def checkpoint_key(model_path, load_format, weight_name_filter):
    """What names one checkpoint read (None where it cannot be told apart: then it is checked again)."""
    key = (model_path, load_format, weight_name_filter)
    try:
        hash(key)
    except TypeError:
        return None
    return key


_CURRENT: contextvars.ContextVar[RequestChecks | None] = contextvars.ContextVar(
    "sglang_trtllm_moe_request_checks", default=None
)


def current() -> RequestChecks | None:
    """The scheduler request being served, where it loads into more than one runner."""
    return _CURRENT.get()


@contextlib.contextmanager
def serving(models: tuple):
    """While the scheduler serves one request that loads into `models` (one after another)."""
    req = RequestChecks(models) if len(models) > 1 else None
    token = _CURRENT.set(req)
    try:
        yield req
    finally:
        _CURRENT.reset(token)
        if req is not None:
            req.close()
