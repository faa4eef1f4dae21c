"""One verdict for all ranks: the ranks SGLang updates together answer a request alike.

SGLang runs every update request on every rank of a model's tensor-parallel group (expert-parallel ranks are among
them), each loading what it holds. Each rank checks only the expert tensors it holds (updates/bucket_validation.py
`local_only`): a bad tensor of an expert only rank 1 holds is seen by rank 1 alone. Before any rank writes a byte,
the ranks exchange their findings over SGLang's own CPU (gloo) group of the TP group (`ranks`, found once per
request: parallel_state.get_tp_group().cpu_group, on every release 0.5.11 - 0.5.23): one collective of a few
integers per request when every rank found nothing (the common case), a second one with the refusals when one did.
Every rank then answers the same: the first bad tensors (in the request's order) with the messages of the rank that
found them, or that a rank could not check the request (it raised: its exception), or that not every rank answered
within `timeout_s()` seconds (SGLANG_TRTLLM_MOE_VERDICT_TIMEOUT_S, default 300).

The time-out: a rank records when it entered the exchange; a rank that waited `timeout_s() + MARGIN_S` refuses; a
rank whose exchange completes refuses when the ranks' entry times lie more than `timeout_s()` apart (the late rank
then learns the others gave up: gloo delivers a collective a rank gave up on when the last rank joins, and the ranks'
later collectives stay paired in order). Entry times are wall clocks: ranks on hosts whose clocks differ by more than
the margin may disagree about a late rank (never about a bad tensor).

Where this process is one rank of one (no distributed group, or a TP group of one), nothing is exchanged. Where the
group cannot be found while this process is one of several ranks (`ranks()` answers None), every rank checks every
tensor itself (each refuses alike, as before rank-local checks).
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import threading
import time

import torch

logger = logging.getLogger("sglang_trtllm_moe")

#: how long the ranks of a request wait for each other's verdict (seconds; 0 or less: the default)
TIMEOUT_ENV = "SGLANG_TRTLLM_MOE_VERDICT_TIMEOUT_S"
DEFAULT_TIMEOUT_S = 300.0
#: a rank waits this much longer than the time-out before it gives up (the others decide on entry times)
MARGIN_S = 2.0
#: at most this many refused tensors' indices and messages go into a rank's answer
MAX_REFUSALS = 64
MAX_MESSAGE = 2000

OK, REFUSED, RAISED = 0, 1, 2


def timeout_s() -> float:
    try:
        t = float(os.environ.get(TIMEOUT_ENV, "") or 0)
    except ValueError:
        t = 0.0
    return t if t > 0 else DEFAULT_TIMEOUT_S


class Ranks:
    """The ranks that answer one request together: SGLang's CPU group of the TP group (None: this process alone)."""

    __slots__ = ("group", "size", "rank")

    def __init__(self, group=None, size: int = 1, rank: int = 0):
        self.group, self.size, self.rank = group, size, rank

    @property
    def alone(self) -> bool:
        return self.size <= 1


#: this process alone
ALONE = Ranks()
_LOCK = threading.Lock()


def ranks() -> Ranks | None:
    """The ranks SGLang updates together with this process: its TP group's CPU group (ALONE where there is no other
    rank); None where this process is one of several ranks and the group cannot be found (then every rank checks
    every tensor)."""
    try:
        import torch.distributed as dist

        if not dist.is_available() or not dist.is_initialized():
            return ALONE
        world = dist.get_world_size()
    except Exception:  # noqa: BLE001 - a torch without distributed
        return ALONE
    try:
        from sglang.srt.distributed import parallel_state

        tp = parallel_state.get_tp_group()
        group, size, rank = tp.cpu_group, int(tp.world_size), int(tp.rank_in_group)
    except Exception:  # noqa: BLE001 - SGLang's model-parallel groups are not set up in this process
        return ALONE if world <= 1 else None
    if size <= 1:
        return ALONE
    return Ranks(group, size, rank)


class Verdict:
    """What every rank answers: `problems` ((index, message): the first refused tensors, from all ranks), `refused`
    (how many tensors were refused on all ranks), `failure` (a rank raised or did not answer: the text)."""

    __slots__ = ("problems", "refused", "failure")

    def __init__(self, problems: list, refused: int, failure: str | None = None):
        self.problems, self.refused, self.failure = problems, refused, failure

    @property
    def ok(self) -> bool:
        return not self.problems and self.failure is None


def agree(who: Ranks, problems: list[tuple[int, str]], raised: str | None = None) -> Verdict:
    """The verdict of all ranks of `who` on one request, given this rank's `problems` ((index in the request,
    message), in order) and, where its check raised, the exception's text. ALONE: this rank's own."""
    if who.alone:
        if raised is not None:
            return Verdict([], 0, f"the check raised ({raised})")
        return Verdict(list(problems), len(problems))
    status = RAISED if raised is not None else REFUSED if problems else OK
    payload = b""
    if status != OK:
        payload = json.dumps(
            {
                "p": [[i, m[:MAX_MESSAGE]] for i, m in problems[:MAX_REFUSALS]],
                "bad": sorted({i for i, _ in problems})[: MAX_REFUSALS * 16],
                "raised": (raised or "")[:MAX_MESSAGE],
            }
        ).encode()
    t = timeout_s()
    with _LOCK:
        try:
            head = _gather(who, torch.tensor([status, len(payload), time.time_ns() // 1000], dtype=torch.int64), t)
        except Exception as e:  # noqa: BLE001 - a time-out (or a broken group): nothing is written anywhere
            logger.warning("sglang-trtllm-moe: the ranks' verdict on an update was not exchanged: %s", e)
            return Verdict([], 0, _late(t))
        starts = head[:, 2]
        if int(starts.max() - starts.min()) > t * 1e6:
            return Verdict([], 0, _late(t))
        statuses = head[:, 0].tolist()
        if all(s == OK for s in statuses):
            return Verdict([], 0)
        width = max(1, int(head[:, 1].max()))
        mine = torch.zeros(width, dtype=torch.uint8)
        if payload:
            mine[: len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        try:
            blobs = _gather(who, mine, t)
        except Exception as e:  # noqa: BLE001 - the refusal holds; its text could not be exchanged
            logger.warning("sglang-trtllm-moe: the ranks' refusals of an update were not exchanged: %s", e)
            bad = [r for r, s in enumerate(statuses) if s != OK]
            return Verdict([], 0, f"rank(s) {bad} refused it (their reasons are in their logs)")
    answers = [
        json.loads(bytes(blobs[r, : int(head[r, 1])].tolist()).decode()) if statuses[r] != OK else None
        for r in range(who.size)
    ]
    return _merged(answers)


def _late(t: float) -> str:
    return f"not every rank answered its check within {t:g} s ({TIMEOUT_ENV})"


def _gather(who: Ranks, mine: torch.Tensor, t: float) -> torch.Tensor:
    import torch.distributed as dist

    out = torch.empty((who.size, *mine.shape), dtype=mine.dtype)
    work = dist.all_gather(list(out.unbind(0)), mine, group=who.group, async_op=True)
    work.wait(timeout=datetime.timedelta(seconds=t + MARGIN_S))
    return out


def _merged(answers: list) -> Verdict:
    """Every rank's answer (None: it found nothing) as one verdict: a rank that raised first (the lowest), else the
    refused tensors of all ranks by their index in the request, each with the messages of the lowest rank that
    refused it."""
    for r, a in enumerate(answers):
        if a is not None and a["raised"]:
            return Verdict([], 0, f"rank {r} could not check it ({a['raised']})")
    owner: dict[int, int] = {}  # index -> the rank whose messages name it
    problems: list[tuple[int, str]] = []
    bad: set[int] = set()
    for r, a in enumerate(answers):
        if a is None:
            continue
        bad.update(a["bad"])
        for i, m in a["p"]:
            if owner.setdefault(i, r) == r:
                problems.append((i, m))
    problems.sort(key=lambda p: p[0])
    return Verdict(problems, max(len(bad), len(problems)))
