"""The dispatcher's bookkeeping: a claimed row in flight (``Job``), the rows of one
stream that a claim leased together (``Run``), and the dispatcher's counters."""

from __future__ import annotations

import asyncio
import threading
import uuid
from dataclasses import dataclass, field
from typing import Any

from django_workpump.categories import category as category_meta
from django_workpump.db import ClaimedWork
from django_workpump.pump.lease import LeaseHandle
from django_workpump.states import CancelReason, JobState
from django_workpump.work import Lease, LeaseLost

__all__ = ["DispatchStats", "Job", "LeaseLost", "Run", "stream_run_key"]


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
    """Rows of one stream leased by one claim, in stream order (a lone row: a run of one).

    A run takes one dispatch slot, freed once when the run ends, is abandoned or is
    failed at shutdown.
    """

    jobs: list[Job]
    slot_freed: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock)
    # The rows a batch handler runs in one call: given up on together (give_up_batch).
    batch: list[Job] | None = None
    # An async batch handler's loop and task while it runs, so giving up can cancel it.
    task: tuple[asyncio.AbstractEventLoop, asyncio.Task[Any]] | None = None


def stream_run_key(row: ClaimedWork) -> tuple[str, str, str] | uuid.UUID:
    """The ordered stream a row belongs to (scope included), or its own id when unordered."""
    if row.stream is None:
        return row.work_id
    scoped = category_meta(row.category).topic_scopes_streams
    return (row.category, row.topic if scoped else "", row.stream)


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
