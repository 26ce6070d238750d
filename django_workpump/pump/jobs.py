"""The dispatcher's bookkeeping: a claimed row in flight (``Job``), the rows of one
stream or chain that a claim leased together (``Run``, grouped by ``ClaimRuns``), the
queue of runs for the handler threads (``RunQueue``), and the dispatcher's counters."""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import uuid
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from django_workpump.categories import category as category_meta
from django_workpump.db import ClaimedWork
from django_workpump.pump.lease import LeaseHandle
from django_workpump.registry import Registry
from django_workpump.states import CancelReason, JobState
from django_workpump.work import Lease, LeaseLost

__all__ = [
    "ClaimRuns",
    "DispatchStats",
    "Job",
    "LeaseLost",
    "Run",
    "RunKey",
    "RunQueue",
    "Unchained",
    "stream_run_key",
]

logger = logging.getLogger("django_workpump.dispatch")


@dataclass(eq=False)
class Job:
    row: ClaimedWork
    handle: LeaseHandle
    state: JobState = JobState.QUEUED
    lock: threading.Lock = field(default_factory=threading.Lock)
    received_at: float = 0.0  # monotonic, when the dispatcher took the row
    # An async handler's loop and task while it runs, so a cancel can reach the task.
    task: tuple[asyncio.AbstractEventLoop, asyncio.Task[Any]] | None = None
    run: Run | None = None
    finished: bool = False  # let go of by Dispatcher._finish (a row can be let go of twice)
    committed: bool = False  # its completion committed with the handler's transaction
    # The log records its handler emitted (attempt_logs.py: a JSON array, or None),
    # written with its outcome.
    logs: str | None = None

    @property
    def lease(self) -> Lease:
        """The claim this attempt holds: every write about it names this lease."""
        return Lease(self.row.category, self.row.work_id, self.row.lease_token)

    @property
    def key(self) -> tuple[str, uuid.UUID]:
        return (self.row.category, self.row.work_id)


@dataclass(eq=False)
class Run:
    """Rows of one stream, or of one chain (send(after=...)), leased by one claim, in
    their order (a lone row: a run of one).

    A run takes one dispatch slot, freed once when the run ends, is abandoned or is
    failed at shutdown.
    """

    jobs: list[Job]
    # Rows of a chain that may not run here (ClaimRuns.key): released unstarted.
    unchained: bool = False
    slot_freed: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock)
    # The rows a batch handler runs in one call: given up on together (give_up_batch).
    batch: list[Job] | None = None
    # An async batch handler's loop and task while it runs, so giving up can cancel it.
    task: tuple[asyncio.AbstractEventLoop, asyncio.Task[Any]] | None = None

    @property
    def ordered(self) -> bool:
        """Whether a row after its last waits on it: a stream's run, or a chain's."""
        return self.jobs[0].row.stream is not None or self.jobs[-1].row.after_id is not None


class RunQueue:
    """Runs for the handler threads, first in first out, with a front lane.

    A run put at the front (rows of underserved fairness groups, claimed with every slot
    busy: docs/flow-control.md) starts before every run queued behind it. The threads
    block on a SimpleQueue of tickets, one per run, which hands over in C: each run is in
    a lane before its ticket is put, so a ticket always finds one (not always its own).
    """

    def __init__(self) -> None:
        self._tickets: queue.SimpleQueue[bool] = queue.SimpleQueue()
        self._lanes: tuple[deque[Run], deque[Run]] = (deque(), deque())  # front, back

    def put(self, run: Run, front: bool = False) -> None:
        self._lanes[0 if front else 1].append(run)
        self._tickets.put(True)

    def stop_one(self) -> None:
        """Make one thread's get() return None (its signal to end)."""
        self._tickets.put(False)

    def get(self) -> Run | None:
        """The next run, front lane first; None for a thread told to end."""
        if not self._tickets.get():
            return None
        front, back = self._lanes
        try:  # deque pops are atomic: no lock
            return front.popleft()
        except IndexError:
            return back.popleft()


@dataclass(frozen=True)
class Unchained:
    """The key of a run of chain rows that may not run here (ClaimRuns.key)."""

    after_id: uuid.UUID


RunKey = tuple[str, str, str] | uuid.UUID | Unchained


def stream_run_key(row: ClaimedWork) -> tuple[str, str, str] | uuid.UUID:
    """The ordered stream a row belongs to (scope included), or its own id when unordered."""
    if row.stream is None:
        return row.work_id
    scoped = category_meta(row.category).topic_scopes_streams
    return (row.category, row.topic if scoped else "", row.stream)


class ClaimRuns:
    """The runs of one claim's rows (``join`` each in the order the claim returned them),
    iterated in the order they began."""

    def __init__(self, handlers: Registry) -> None:
        self.handlers = handlers
        self.runs: dict[RunKey, Run] = {}
        self.run_of: dict[uuid.UUID, RunKey] = {}  # the run each row joined

    def __iter__(self) -> Iterator[Run]:
        return iter(self.runs.values())

    def __len__(self) -> int:
        return len(self.runs)

    def join(self, row: ClaimedWork) -> Run:
        """The run ``row`` joins (before its job is added to it)."""
        key = self.run_of[row.work_id] = self.key(row)
        return self.runs.setdefault(key, Run([], unchained=isinstance(key, Unchained)))

    def key(self, row: ClaimedWork) -> RunKey:
        """Its stream's run, the run of the row it waits for (a chain), or its own.

        A chain's row must start after the row it waits for completed: it cannot join
        the one call of a batch handler, nor run without that row here. Such a row (and
        the rest of its chain) joins an unchained run instead, released unstarted.
        """
        if row.after_id is None:
            return stream_run_key(row)
        key = self.run_of.get(row.after_id)
        if key is None or self.runs[key].unchained:
            return key or Unchained(row.after_id)
        first = self.runs[key].jobs[0].row
        handlers = [self.handlers.get(r.category, r.topic) for r in (first, row)]
        if not any(handler is not None and handler.batch for handler in handlers):
            return key
        logger.info(
            "%s %s waits for %s; a batch handler cannot run the two in turn: released",
            row.category,
            row.work_id,
            row.after_id,
            extra={"action": "chain_released"},
        )
        return Unchained(row.after_id)


@dataclass
class DispatchStats:
    started: int = 0
    completed: int = 0
    failed: int = 0
    abandoned: int = 0
    released: int = 0
    lost_leases: int = 0
    superseded: int = 0
    snoozed: int = 0
    discarded: int = 0
    cancelled: int = 0  # running attempts an operator cancelled


def queue_wait(job: Job, started_at: float) -> float | None:
    """Seconds from when the row became claimable to its handler's start, or None.

    The database's clock up to the claim, this process's monotonic clock from there on:
    no clock skew between the two enters.
    """
    row = job.row
    if row.due_at is None:
        return None
    return (row.claimed_at - row.due_at).total_seconds() + (started_at - job.received_at)


def given_up(holder: Job | Run) -> bool:
    """Whether the attempt of ``holder`` (a row, or a batch's run) was given up on or
    cancelled; called with its lock held."""
    if isinstance(holder, Run):
        return any(job.state == JobState.ABANDONED for job in holder.batch or ())
    return (
        holder.state in (JobState.ABANDONED, JobState.SUPERSEDED)
        or holder.handle.cancel_reason == CancelReason.CANCELLED
    )
