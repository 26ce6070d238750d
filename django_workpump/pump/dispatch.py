"""Dispatcher: runs claimed rows on ``CONCURRENCY`` threads under a lease each.

Outcomes go through two batch flushers to ``complete_work``/``fail_work``, each fenced
by the lease token of the claim it reports on.
A handler still running at its lease deadline is abandoned: its slot is freed (a
replacement thread starts), the attempt is failed with reason ``lease_expired``, and
whatever it reports later is dropped here and would be fenced out by the database.

The rows of one ordered stream that a claim leased together (a stream run: the head and
the rows after it) run in order in one slot, on one thread. A row that does not complete
ends its run: the rows after it are released unstarted (their attempt given back), so
the stream waits for the row's retry and nothing runs out of order. A batch handler gets
the run in one call; its ``Snooze``/``Discard`` name the row they mean, and a batch given
up on (its deadline, or a shutdown) is given up whole: its first row failed, every other
row released at once (docs/control-flow.md, "Batch handlers").

A row can come back to this same instance while its previous attempt still runs here
(an operator force-released it, or its lease ran out): the database has given it a new
lease, so the old attempt is superseded: its handle is cancelled as ``lost``, its
outcome is dropped and an atomic handler's transaction rolls back.

A handler controls its row by raising ``workpump.Snooze`` (``snooze_work``: run again
later, the attempt not spent) or ``workpump.Discard`` (``discard_work``: the row ends
discarded); a handler's ``Retry`` policy picks the retry delay or fails a row at once
(docs/control-flow.md); ``workpump.Release`` hands its row back (``release_work``, the
attempt given back) when the pump is stopping or the lease is no longer the attempt's,
and otherwise fails the attempt (it counts). An operator's ``workpump.cancel`` reaches a
running attempt through ``cancel_running`` (the NOTIFY gate, or a renewal reporting it
cancelled): its ``work.cancelled`` turns true, an async handler's task is cancelled, and
its outcome is dropped (the database fences it out anyway).
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import itertools
import logging
import math
import queue
import threading
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any, NamedTuple, TypeVar

from django.db import connections, transaction

from django_workpump import tracing
from django_workpump.categories import category as category_meta
from django_workpump.clock import Clock, SystemClock
from django_workpump.control import MAX_DELAY_TEXT, Discard, Release, Snooze, named_index
from django_workpump.coroutines import HandlerLoop
from django_workpump.db import ClaimedWork, Outcome
from django_workpump.dead_letters import log_dead_lettered, stored_dead_reason
from django_workpump.metrics import NullRecorder, recorder
from django_workpump.middleware import Middleware
from django_workpump.middleware import wrap as wrap_in_middleware
from django_workpump.pump.coordinator import Coordinator
from django_workpump.pump.flusher import BatchFlusher
from django_workpump.pump.handler_connections import PERSISTENT, between_jobs
from django_workpump.pump.lease import LeaseHandle, LeaseRegistry
from django_workpump.pump.naming import application_name, name_thread_connections
from django_workpump.registry import TOPIC_NOUNS, Handler, Registry
from django_workpump.states import (
    CancelReason,
    FailureReason,
    HandlerOutcome,
    JobState,
    OutcomeStatus,
    StopReason,
)
from django_workpump.storable import (
    ascii_text,
    error_headline,
    error_text,
    is_transient,
    result_note,
    storable_result,
)
from django_workpump.work import Work, stop_reason

logger = logging.getLogger("django_workpump.dispatch")


class FailedAttempt(NamedTuple):
    """A failed attempt waiting to be written, with what its log line names."""

    category: str
    work_id: uuid.UUID
    lease_token: uuid.UUID
    error: str
    reason: str
    topic: str | None = None
    stream: str | None = None
    attempt: int | None = None
    max_attempts: int | None = None
    delay: float | None = None  # a handler's own retry delay (Retry backoff); None: default
    subject: str | None = None  # what the row runs, when its topic does not say it

    @classmethod
    def of(
        cls, row: ClaimedWork, error: str, reason: str, delay: float | None = None
    ) -> FailedAttempt:
        return cls(
            row.category,
            row.work_id,
            row.lease_token,
            error,
            reason,
            row.topic,
            row.stream,
            row.attempts,
            row.max_attempts,
            delay,
            next(filter(None, (name(row) for name in FAILURE_SUBJECTS)), None),
        )


# Callables naming what a row runs when its topic is shared (the tasks backend's queue
# topic runs every task): ``name(row)`` returns e.g. "task 'myapp.tasks.send'" or None.
FAILURE_SUBJECTS: list[Callable[[ClaimedWork], str | None]] = []


# The longest exception line a log line quotes (the row keeps the whole text).
LOGGED_ERROR_CHARS = 500


def log_failed_attempt(item: FailedAttempt, outcome: Any) -> None:
    """Log one written failure: a WARNING when it will be retried, an ERROR when dead.

    Called with ``fail_work``'s answer, so the retry time is the database's.
    """
    status = outcome.status
    if status not in (OutcomeStatus.RETRY, OutcomeStatus.DEAD):
        return  # lost: the fence refused it and _count logs that
    headline = error_headline(item.error)[:LOGGED_ERROR_CHARS] or item.reason
    retry_at = outcome.scheduled_for
    fields = {
        "action": "dead_lettered" if status == OutcomeStatus.DEAD else "attempt_failed",
        "workpump_category": item.category,
        "workpump_topic": item.topic,
        "workpump_id": str(item.work_id),
        "workpump_stream": item.stream,
        "workpump_attempt": item.attempt,
        "workpump_max_attempts": item.max_attempts,
        "workpump_reason": str(item.reason),
        "workpump_error": headline,
        "workpump_retry_at": None if retry_at is None else retry_at.isoformat(),
    }
    if item.subject is not None:
        fields["workpump_subject"] = item.subject
    where = (
        ("" if item.subject is None else f"{item.subject}, ")
        + f"topic {item.topic!r}"
        + ("" if item.stream is None else f", stream {item.stream!r}")
        + ("" if item.attempt is None else f", attempt {item.attempt}/{item.max_attempts}")
    )
    if status == OutcomeStatus.DEAD:
        log_dead_lettered(
            item.category,
            item.work_id,
            stored_dead_reason(item.reason),
            headline,
            topic=item.topic,
            subject=item.subject,
            stream=item.stream,
            attempt=item.attempt,
            max_attempts=item.max_attempts,
            workpump_retry_at=None,
        )
        return
    logger.warning(
        "%s %s failed (%s): %s; retry %s",
        item.category,
        item.work_id,
        where,
        headline,
        "now" if retry_at is None else f"at {retry_at.isoformat(timespec='seconds')}",
        extra=fields,
    )


class LeaseLost(Exception):
    """The row's lease was lost before an atomic handler could commit its completion.

    ``rows``: how many rows' leases were lost (an atomic batch may lose several).
    """

    def __init__(self, message: str, rows: int = 1) -> None:
        super().__init__(message)
        self.rows = rows


@dataclass(eq=False)
class _Job:
    row: ClaimedWork
    handle: LeaseHandle
    state: JobState = JobState.QUEUED
    lock: threading.Lock = field(default_factory=threading.Lock)
    received_at: float = 0.0  # monotonic, when the dispatcher took the row
    # An async handler's loop and task while it runs, so a cancel can reach the task.
    task: tuple[asyncio.AbstractEventLoop, asyncio.Task[Any]] | None = None
    run: _Run | None = None
    finished: bool = False  # let go of by _finish (a row can be let go of twice)
    committed: bool = False  # its completion committed with the handler's transaction


@dataclass(eq=False)
class _Run:
    """Rows of one stream leased by one claim, in stream order (a lone row: a run of one).

    A run takes one dispatch slot, freed once when the run ends, is abandoned or is
    failed at shutdown.
    """

    jobs: list[_Job]
    slot_freed: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock)
    # The rows a batch handler runs in one call: given up on together (_give_up_batch).
    batch: list[_Job] | None = None
    # An async batch handler's loop and task while it runs, so giving up can cancel it.
    task: tuple[asyncio.AbstractEventLoop, asyncio.Task[Any]] | None = None


def stream_run_key(row: ClaimedWork) -> tuple[str, str, str] | uuid.UUID:
    """The ordered stream a row belongs to (scope included), or its own id when unordered."""
    if row.stream is None:
        return row.work_id
    scoped = category_meta(row.category).scope_column is not None
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


_T = TypeVar("_T")
# A handler call's span when tracing is off.
_NOT_TRACED = contextlib.nullcontext()
# How long stop() waits for each outcome flusher's final flush when not told.
FINAL_FLUSH_SECONDS = 5.0
# A write from a dispatch thread (a release of a run's unstarted rows, a snooze, discard
# or dead-lettering) that failed transiently is retried after these delays (doubling).
WRITE_RETRY_FIRST_SECONDS = 0.05
WRITE_RETRY_MAX_SECONDS = 1.0


class Dispatcher:
    """Run claimed rows on ``concurrency`` handler threads; write their outcomes in batches.

    A pump service (``pump.service.Service``): its threads are the handler threads
    (``workpump-dispatch-<n>``) and the two outcome flushers.
    """

    name = "dispatch"

    def __init__(
        self,
        coordinator: Coordinator,
        handlers: Registry,
        leases: LeaseRegistry,
        *,
        concurrency: int = 4,
        lease_grace_seconds: float = 30,
        max_renewals: int = 6,
        abandoned_limit: int = 10,
        lease_seconds: float | None = None,
        alias: str = "default",
        clock: Clock | None = None,
        on_slot_free: Callable[[], Any] | None = None,
        on_fatal: Callable[[str], Any] | None = None,
        middleware: Sequence[Middleware] = (),
        metrics: NullRecorder | None = None,
        handler_connections: str = PERSISTENT,
        on_stream_ready: Callable[[], Any] | None = None,
    ) -> None:
        self.coordinator = coordinator
        self.metrics = recorder() if metrics is None else metrics
        # (category, work id) -> topic of an outcome waiting in a flusher, for the metrics
        # (filled only when they are recorded)
        self._outcome_topics: dict[tuple[str, uuid.UUID], str] = {}
        self.handler_connections = handler_connections  # handler_connections.MODES
        self.middleware = tuple(middleware)  # wraps every handler call, the first outermost
        self.handlers = handlers
        self.leases = leases
        self.concurrency = concurrency
        self.lease_grace_seconds = lease_grace_seconds
        self.max_renewals = max_renewals
        self.abandoned_limit = abandoned_limit
        # The length of a renewal (LEASE_SECONDS); None: each claim's own lease length.
        self.lease_seconds = lease_seconds
        self.alias = alias
        self.clock = clock or SystemClock()
        self.on_slot_free = on_slot_free
        self.on_fatal = on_fatal
        # Called once the completions of a stream run that ran to its end are written:
        # the stream's next rows can be claimed now (the claimer need not wait for a
        # poll or the NOTIFY of their promotion).
        self.on_stream_ready = on_stream_ready
        # (category, work id) of the last row of each such run, until its completion is
        # written (guarded by _lock).
        self._stream_run_ends: set[tuple[str, uuid.UUID]] = set()
        self.stats = DispatchStats()
        # Runs for the handler threads. SimpleQueue hands over in C: a woken pump's row
        # reaches its handler thread some microseconds sooner than through Queue's locks.
        self._queue: queue.SimpleQueue[_Run | None] = queue.SimpleQueue()
        self._jobs: dict[tuple[str, uuid.UUID], _Job] = {}
        self._in_flight = 0  # queued + running, not abandoned
        self._pending_outcomes = 0  # handed to a flusher, not yet written
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._accepting = True
        self._stopping = threading.Event()  # a graceful stop began: work.cancelled is true
        self._started = False
        self._stopped = False
        self._threads: list[threading.Thread] = []
        self._thread_ids = itertools.count(1)
        self._local = threading.local()
        # (category, work id, lease token, result JSON)
        self.completions: BatchFlusher[tuple[str, uuid.UUID, uuid.UUID, str | None]] = BatchFlusher(
            "workpump-completions",
            self._flush_completions,
            max_batch=500,
            coalesce_window=0.01,
            immediate_flush_at=250,
            capacity=10_000,
            on_thread_start=partial(self._name_connections, "completions"),
            on_thread_exit=connections.close_all,
            group_by=_category_of,
            on_rejected=self._completion_rejected,
        )
        self.failures: BatchFlusher[FailedAttempt] = BatchFlusher(
            "workpump-failures",
            self._flush_failures,
            max_batch=100,
            coalesce_window=0.05,
            immediate_flush_at=50,
            capacity=5_000,
            on_thread_start=partial(self._name_connections, "failures"),
            on_thread_exit=connections.close_all,
            group_by=_category_of,
            on_rejected=self._failure_rejected,
        )

    # -- capacity and intake -------------------------------------------------------
    def free_slots(self) -> int:
        with self._lock:
            return 0 if not self._accepting else max(self.concurrency - self._in_flight, 0)

    @property
    def in_flight(self) -> int:
        with self._lock:
            return self._in_flight

    @property
    def started_total(self) -> int:
        """Rows handed to a handler so far (the claimer sizes its batches by its rate)."""
        return self.stats.started

    @property
    def pending_outcomes(self) -> int:
        with self._lock:
            return self._pending_outcomes

    def _outcome_queued(self, count: int, row: ClaimedWork | None = None) -> None:
        with self._lock:
            self._pending_outcomes += count
        if row is not None and self.metrics.enabled:
            self._outcome_topics[(row.category, row.work_id)] = row.topic

    def submit(self, rows: list[ClaimedWork]) -> None:
        """Take claimed rows: one lease handle each, queued for the workers by run.

        The rows of one ordered stream (the claim returns them in stream order) form one
        run; every other row is a run of its own.
        """
        received_at = self.clock.monotonic()
        runs: dict[tuple[str, str, str] | uuid.UUID, _Run] = {}
        # One look at the rows in flight here for the whole claim (each row is looked up
        # and entered once; a claim holds up to hundreds).
        with self._lock:
            previous_jobs = [self._jobs.get((row.category, row.work_id)) for row in rows]
        jobs: list[_Job] = []
        held: dict[str, int] = {}
        for row, previous in zip(rows, previous_jobs, strict=True):
            run = runs.setdefault(stream_run_key(row), _Run([]))
            # Local deadline from the DB's own lease length, so clock skew cannot matter.
            lease_length = (row.lease_expiry - row.claimed_at).total_seconds()
            deadline = received_at + lease_length - self.lease_grace_seconds
            max_renewals, hard_deadline = self.max_renewals, None
            handler = self.handlers.get(row.category, row.topic)
            if handler is not None and handler.timeout is not None:
                # The handler's own timeout bounds the dispatch instead of the renewal
                # cap: as many renewals as reaching it takes, and never past it.
                # A renewal comes when a third of the local lease is left (renewal.py),
                # so each one moves the deadline by two thirds of a lease.
                # A row behind others of its run: from when it starts (start_charging).
                hard_deadline = None if run.jobs else received_at + handler.timeout
                per_renewal = (self.lease_seconds or lease_length) - self.lease_grace_seconds
                gain = max(per_renewal * 2 / 3, 1.0)
                short = handler.timeout - (lease_length - self.lease_grace_seconds)
                max_renewals = max(math.ceil(short / gain), 0) + (1 if run.jobs else 0)
            handle = LeaseHandle(
                row.category,
                row.work_id,
                deadline,
                max_renewals,
                self.clock,
                lease_token=row.lease_token,
                hard_deadline=hard_deadline,
                charged=not run.jobs,  # rows behind the first are charged once they start
                timeout=None if handler is None else handler.timeout,
            )
            if previous is not None:
                self._supersede(previous, row.attempts)
            self.leases.register(handle)
            job = _Job(row, handle, received_at=received_at, run=run)
            run.jobs.append(job)
            jobs.append(job)
            held[row.category] = held.get(row.category, 0) + 1
        with self._lock:
            for job in jobs:
                self._jobs[(job.row.category, job.row.work_id)] = job
            self._in_flight += len(runs)
        for category, count in held.items():
            self.metrics.held(category, count)
        for run in runs.values():
            self._queue.put(run)

    # -- workers -------------------------------------------------------------------
    def start(self) -> None:
        """Start the outcome flushers and the handler threads (once; not after stop())."""
        with self._lock:
            if self._started or self._stopped:
                return
            self._started = True
        self.completions.start()
        self.failures.start()
        for _ in range(self.concurrency):
            self._start_worker()

    def _start_worker(self) -> None:
        number = next(self._thread_ids)
        thread = threading.Thread(
            target=self._work_loop, args=(number,), name=f"workpump-dispatch-{number}", daemon=True
        )
        self._threads.append(thread)
        thread.start()

    def _name_connections(self, role: str) -> None:
        """Name the calling thread's connections after this instance and ``role``."""
        name_thread_connections(application_name(self.coordinator.identity.instance_id, role))

    def _work_loop(self, number: int) -> None:
        try:
            self._name_connections(f"handler-{number}")
            while True:
                run = self._queue.get()
                if run is None:
                    return
                if not self._execute(run):
                    return  # this thread was abandoned with its job; a replacement took over
        finally:
            self._discard_loop()
            connections.close_all()

    def _execute(self, run: _Run) -> bool:
        """Run a run's rows in order; False when this thread was abandoned with one."""
        first = run.jobs[0].row
        handler = self.handlers.get(first.category, first.topic)
        if handler is not None and handler.batch:
            return self._execute_batch(run, handler)
        ran: bool | None = True
        traced = tracing.enabled()  # looked up once a run: a tracer provider is set once
        for index, job in enumerate(run.jobs):
            # The connections were tidied after the previous row of the run, just now.
            ran = self._run(job, tidy_before=index == 0, traced=traced)
            if ran is None:
                return False  # abandon() released the rest and freed the slot
            if not ran:
                # Not completed: the rows after it must wait for its retry.
                self._release_rest(run, index)
                break
        if first.stream is not None:
            self.completions.hurry()  # the stream's next row waits on these completions
        self._free_slot(run)
        if ran and run.jobs[-1].committed and self.on_stream_ready is not None:
            # The handler's transaction wrote the run's last completion: the stream's next
            # rows can be claimed now.
            self.on_stream_ready()
        return True

    def _ends_stream_run(self, job: _Job) -> bool:
        """Whether ``job`` is the last row of an ordered stream's run."""
        return job.row.stream is not None and job.run is not None and job.run.jobs[-1] is job

    def _run(self, job: _Job, tidy_before: bool = True, traced: bool | None = None) -> bool | None:
        """Run one job: True when it completed (the next row of its run may start), False
        when it did not (or never started: it is still queued), None when it was abandoned
        while this thread ran it. ``tidy_before`` False: this thread's connections were
        tidied after the row before it, so they are not again. ``traced``: whether tracing
        is on (None: look it up)."""
        with job.lock:
            if job.state == JobState.SUPERSEDED:
                start = None  # the row has a newer lease here: nothing to run or release
            elif job.handle.cancelled.is_set() or self._stopping.is_set():
                start = False  # left queued: released unstarted with the rest of its run
            else:
                job.state = JobState.RUNNING
                start = True
        if start is None:
            self._finish(job)
            return False
        if not start:
            # It waited past its deadline, or shutdown began: it never started.
            return False
        job.handle.start_charging()
        if tidy_before:
            between_jobs(self.handler_connections)
        self.stats.started += 1
        handler = self.handlers.get(job.row.category, job.row.topic)
        measured = self.metrics.enabled and handler is not None
        if measured:
            started_at = self.clock.monotonic()
            self.metrics.handler_started(job.row, _queue_wait(job, started_at))
        # (DONE, result) | (DONE_COMMITTED, None) | (FAIL, (error, reason, delay))
        # | (SNOOZE, seconds) | (DISCARD, reason) | (LOST, text)
        outcome: tuple[HandlerOutcome, Any]
        try:
            if handler is None:
                noun = TOPIC_NOUNS[job.row.category]
                error = f"no handler registered for {noun} {job.row.topic!r}"
                outcome = (HandlerOutcome.FAIL, (error, FailureReason.NO_HANDLER, None))
            elif handler.atomic:
                self._call_atomic(handler, job, traced)
                outcome = (HandlerOutcome.DONE_COMMITTED, None)
            else:
                outcome = (HandlerOutcome.DONE, self._call(handler, job, traced))
        except LeaseLost as exc:
            outcome = (HandlerOutcome.LOST, str(exc))
        except Snooze as exc:
            outcome = (HandlerOutcome.SNOOZE, exc.seconds)
        except Discard as exc:
            outcome = (HandlerOutcome.DISCARD, exc.reason)
        except Release:
            outcome = (HandlerOutcome.RELEASE, None)
        except BaseException as exc:  # noqa: BLE001 (a handler's exit ends its attempt only)
            # SystemExit, KeyboardInterrupt and the like from a handler end its attempt,
            # not this thread: re-raised, they would leave the row leased by no one.
            if not isinstance(exc, Exception):
                self._discard_loop()
            outcome = (HandlerOutcome.FAIL, self._failure_of(handler, job, exc))
        finally:
            if measured:
                self.metrics.handler_finished(job.row, self.clock.monotonic() - started_at)
            between_jobs(self.handler_connections)
        with job.lock:
            if job.state == JobState.ABANDONED:
                logger.warning(
                    "abandoned %s %s finished late; its outcome is dropped (the row was failed)",
                    job.row.category,
                    job.row.work_id,
                    extra={"action": "late_outcome_dropped"},
                )
                return None
            if job.state == JobState.SUPERSEDED:
                logger.warning(
                    "%s %s attempt %d finished after the row was claimed again; its outcome "
                    "is dropped",
                    job.row.category,
                    job.row.work_id,
                    job.row.attempts,
                    extra={"action": "superseded_outcome_dropped"},
                )
                superseded = True
            else:
                job.state = JobState.FINISHED
                superseded = False
        if superseded:
            self._finish(job)
            return False
        if job.handle.cancel_reason == CancelReason.CANCELLED:
            # The row already ended cancelled; whatever the attempt reports is fenced out.
            self.stats.cancelled += 1
            logger.info(
                "%s %s was cancelled while its handler ran; its outcome (%s) is dropped",
                job.row.category,
                job.row.work_id,
                outcome[0],
                extra={"action": "cancelled_outcome_dropped"},
            )
            self._finish(job)
            return False  # not completed here: the rows after it are released
        kind: HandlerOutcome = outcome[0]
        value: Any = outcome[1]
        if kind == HandlerOutcome.DONE:
            self._outcome_queued(1, job.row)
            if self.on_stream_ready is not None and self._ends_stream_run(job):
                # Before the put: the flush that writes it may come at once.
                with self._lock:
                    self._stream_run_ends.add((job.row.category, job.row.work_id))
            item = (job.row.category, job.row.work_id, job.row.lease_token, value)
            if not self.completions.put(item):
                with self._lock:  # refused: the row's lease runs out and it runs again
                    self._stream_run_ends.discard((job.row.category, job.row.work_id))
        elif kind in (
            HandlerOutcome.FAIL,
            HandlerOutcome.SNOOZE,
            HandlerOutcome.DISCARD,
            HandlerOutcome.RELEASE,
        ):
            self._write_setback(job, kind, value)
        elif kind == HandlerOutcome.LOST:
            self.stats.lost_leases += 1
            self.metrics.lost(job.row.category)
            logger.warning("%s", value, extra={"action": "lease_lost"})
        else:
            self.stats.completed += 1  # committed with the handler's own transaction
            job.committed = True
            done = [Outcome(job.row.work_id, OutcomeStatus.DONE)]
            self.metrics.outcomes(job.row.category, done, lambda _: job.row.topic)
        self._finish(job)
        return kind in (HandlerOutcome.DONE, HandlerOutcome.DONE_COMMITTED)

    def _execute_batch(self, run: _Run, handler: Handler) -> bool:
        """Run a batch handler once on the rows of ``run`` that can start, in order.

        Done: every row completes (with ``atomic``, in the handler's transaction). A
        failure fails the first row (by the handler's ``Retry``) and releases the others
        unstarted. ``Snooze``/``Discard`` act on the row they name (the first without
        ``work=``): the rows before it complete (unless ``atomic``: its transaction rolled
        back, they are released), the rows after it are released (docs/control-flow.md).
        A lease lost before an atomic batch committed rolls it back and releases the rows
        still held.
        """
        started: list[_Job] = []
        with run.lock:
            run.batch = started  # abandon() and fail_running() give up on these together
        for job in run.jobs:
            with job.lock:
                superseded = job.state == JobState.SUPERSEDED
                startable = not superseded and not (
                    job.handle.cancelled.is_set() or self._stopping.is_set()
                )
                if startable:
                    job.state = JobState.RUNNING
                    started.append(job)
            if superseded:
                self._finish(job)
            if not startable:
                break
        if not started:
            self._release_rest(run, 0)
            self._free_slot(run)
            return True
        for job in started:
            job.handle.start_charging()
        self.stats.started += len(started)
        between_jobs(self.handler_connections)
        if self.metrics.enabled:
            started_at = self.clock.monotonic()
            for job in started:
                self.metrics.handler_started(job.row, _queue_wait(job, started_at))
        works = [self._work_for(job) for job in started]
        outcome: HandlerOutcome
        value: Any = None  # FAIL: (error, reason, delay); SNOOZE: seconds; DISCARD: reason
        at = 0  # the index of the row the outcome concerns (FAIL, SNOOZE, DISCARD)
        try:
            if handler.atomic:
                self._call_batch_atomic(handler, started, works)
                outcome = HandlerOutcome.DONE_COMMITTED
            else:
                self._call_batch(handler, works, run)
                outcome = HandlerOutcome.DONE
        except LeaseLost as exc:
            outcome = HandlerOutcome.LOST
            self.stats.lost_leases += exc.rows
            self.metrics.lost(started[0].row.category, exc.rows)
            logger.warning("%s", exc, extra={"action": "lease_lost"})
        except (Snooze, Discard) as exc:
            try:
                at = named_index(exc, works)
            except ValueError as error:  # it named no row of this batch: as run_pending
                outcome = HandlerOutcome.FAIL
                value = (_describe(error), FailureReason.HANDLER_ERROR, None)
            else:
                if isinstance(exc, Snooze):
                    outcome, value = HandlerOutcome.SNOOZE, exc.seconds
                else:
                    outcome, value = HandlerOutcome.DISCARD, exc.reason
        except Release:
            outcome = HandlerOutcome.RELEASE
        except BaseException as exc:  # noqa: BLE001 (a handler's exit ends its attempt only)
            if not isinstance(exc, Exception):
                self._discard_loop()
            outcome = HandlerOutcome.FAIL
            value = self._failure_of(handler, started[0], exc)
        finally:
            if self.metrics.enabled:
                # One call ran them all: each row gets an even share of its duration, so
                # the handler time summed over rows is the time spent.
                share = (self.clock.monotonic() - started_at) / len(started)
                for job in started:
                    self.metrics.handler_finished(job.row, share)
            between_jobs(self.handler_connections)
        live: list[_Job] = []  # rows this attempt still holds
        with run.lock:  # against _give_up_batch: the batch is finished or given up, whole
            for job in started:
                with job.lock:
                    if job.state == JobState.ABANDONED:
                        # abandon() or fail_running() gave the batch up and freed the slot;
                        # this thread ends
                        return False
            for job in started:
                with job.lock:
                    if job.state == JobState.RUNNING:
                        job.state = JobState.FINISHED
                        live.append(job)
        for job in started:
            if job not in live:
                self._finish(job)  # superseded: a newer attempt holds it
        if outcome == HandlerOutcome.RELEASE:
            # At a shutdown every row goes back with its attempt (as below for a lost
            # lease); otherwise the first row's attempt counts, as for a failure.
            value = self._release_failure(started[0])
            outcome = HandlerOutcome.LOST if value is None else HandlerOutcome.FAIL
        if outcome == HandlerOutcome.DONE:
            self._complete_batch(live)
            self._release_rest(run, len(started))
        elif outcome == HandlerOutcome.DONE_COMMITTED:
            self.stats.completed += len(live)
            if live:
                done = [Outcome(job.row.work_id, OutcomeStatus.DONE) for job in live]
                topics = {job.row.work_id: job.row.topic for job in live}
                self.metrics.outcomes(live[0].row.category, done, topics.__getitem__)
            for job in live:
                self._finish(job)
            self._release_rest(run, len(started))
        elif outcome == HandlerOutcome.LOST:
            for job in live:
                with job.lock:
                    job.state = JobState.QUEUED  # never committed: released unstarted
            self._release_rest(run, 0)
        else:
            # Rows before the named one are done, unless an atomic handler's transaction
            # rolled their work back; the named row gets the outcome; the rest are given
            # back unstarted, so the stream goes on from the first row not done.
            if not handler.atomic:
                self._complete_batch([job for job in started[:at] if job in live])
            target = started[at] if started[at] in live else None
            if target is not None:
                self._write_setback(target, outcome, value)
                self._finish(target)
            for job in live:
                with job.lock:
                    if job.state == JobState.FINISHED and not job.finished:
                        job.state = JobState.QUEUED  # not done here: released unstarted
            self._release_rest(run, 0)
        self._free_slot(run)
        return True

    def _complete_batch(self, jobs: list[_Job]) -> None:
        """Queue the completion of each of a batch's ``jobs`` (their handler returned)."""
        for job in jobs:
            self._outcome_queued(1, job.row)
            self.completions.put((job.row.category, job.row.work_id, job.row.lease_token, None))
            self._finish(job)
        if jobs and jobs[0].row.stream is not None:
            self.completions.hurry()  # the stream's next row waits on these completions

    def _write_setback(self, job: _Job, kind: HandlerOutcome, value: Any) -> None:
        """Queue or write a failure (FAIL), a snooze (SNOOZE), a discard (DISCARD) or a
        handler's release (RELEASE)."""
        if kind == HandlerOutcome.RELEASE:
            failure = self._release_failure(job)
            if failure is None:
                self._write_now(job, "release", self._release)
                return
            kind, value = HandlerOutcome.FAIL, failure
        if kind == HandlerOutcome.FAIL:
            error, reason, delay = value
            if reason == FailureReason.NOT_RETRYABLE:
                self._write_now(job, "dead-lettering", self._dead_letter, error, reason)
            else:
                self._outcome_queued(1, job.row)
                self.failures.put(FailedAttempt.of(job.row, error, reason, delay))
        elif kind == HandlerOutcome.SNOOZE:
            self._write_now(job, "snooze", self._snooze, value)
        else:
            self._write_now(job, "discard", self._discard, value)

    def _release_failure(self, job: _Job) -> tuple[str, str, float | None] | None:
        """What a handler's ``workpump.Release`` does to its row: None to give the row back
        with its attempt (a shutdown, or the lease is no longer this attempt's), else the
        failure that counts the attempt (error, reason, retry delay)."""
        why = stop_reason(job.handle, self._stopping)
        if why in (StopReason.SHUTDOWN, StopReason.LEASE_LOST):
            return None
        if why == StopReason.DEADLINE:
            timed_out = job.handle.timed_out
            return (
                "the handler released the row at "
                + ("the end of its timeout" if timed_out else "its lease deadline"),
                FailureReason.TIMEOUT if timed_out else FailureReason.LEASE_EXPIRED,
                None,
            )
        # Its own decision: the attempt counts (a handler that always releases ends
        # dead, not in a loop), and the row is claimable again at once.
        return "the handler released the row unfinished", FailureReason.RELEASED, 0.0

    def _failure_of(
        self, handler: Handler | None, job: _Job, exc: BaseException
    ) -> tuple[str, str, float | None]:
        """(error, reason, retry delay or None) of an exception, by the handler's Retry."""
        error = _describe(exc)
        retry = handler.retry if handler is not None else None
        if retry is None:
            return error, FailureReason.HANDLER_ERROR, None
        if not retry.retries(exc):
            return error, FailureReason.NOT_RETRYABLE, None

        def clamped(seconds: float) -> None:
            logger.warning(
                "the Retry backoff of %s %s returned %r s, over the longest wait (%s); "
                "%s %s retries after that longest wait",
                job.row.category,
                job.row.topic,
                seconds,
                MAX_DELAY_TEXT,
                job.row.category,
                job.row.work_id,
                extra={"action": "backoff_clamped"},
            )

        try:
            delay = retry.delay(job.row.attempts, exc, clamped)
        except Exception as backoff_error:  # noqa: BLE001 (any backoff bug: default backoff)
            logger.error(
                "the Retry backoff of %s %s failed (%s); the default backoff is used",
                job.row.category,
                job.row.topic,
                _first_line(backoff_error) or type(backoff_error).__name__,
                extra={"action": "backoff_failed"},
            )
            delay = None
        return error, FailureReason.HANDLER_ERROR, delay

    def _write_now(self, job: _Job, what: str, write: Callable[..., list[Any]], *args: Any) -> None:
        """Write a rare outcome from the handler thread, retried after transient errors
        while the lease lasts; when it cannot be written the lease runs out."""
        try:
            outcomes = self._retrying_transient([job], lambda: write(job, *args))
        except Exception:
            logger.exception(
                "the %s of %s %s could not be written; its lease runs out and it runs again",
                what,
                job.row.category,
                job.row.work_id,
                extra={"action": "outcome_write_failed"},
            )
            return
        if self.metrics.enabled:
            # A dead-lettering counts as a failed (and dead) row, a fenced-out write as lost.
            reason = args[-1] if what == "dead-lettering" else None
            self.metrics.outcomes(
                job.row.category, outcomes, lambda _: job.row.topic, lambda _: reason
            )
        for outcome in outcomes:
            if outcome.status == OutcomeStatus.LOST:
                self.stats.lost_leases += 1
                logger.warning(
                    "lease of %s was lost before its %s was recorded (fenced out)",
                    outcome.work_id,
                    what,
                    extra={"action": "lease_lost"},
                )
            elif outcome.status == OutcomeStatus.SNOOZED:
                self.stats.snoozed += 1
            elif outcome.status == OutcomeStatus.DISCARDED:
                self.stats.discarded += 1
            elif outcome.status == OutcomeStatus.RELEASED:
                self.stats.released += 1
            else:
                self.stats.failed += 1
            if outcome.status == OutcomeStatus.DEAD:
                if what == "dead-lettering":  # (error, reason)
                    error, reason = args[0], stored_dead_reason(args[1])
                else:  # a snooze over MAX_SNOOZES on the last attempt
                    error = "it snoozed more than MAX_SNOOZES times, on its last attempt"
                    reason = FailureReason.MAX_ATTEMPTS
                log_dead_lettered(
                    job.row.category,
                    job.row.work_id,
                    reason,
                    error_headline(error),
                    topic=job.row.topic,
                    stream=job.row.stream,
                    attempt=job.row.attempts,
                    max_attempts=job.row.max_attempts,
                )

    def _snooze(self, job: _Job, seconds: float) -> list[Any]:
        return self.coordinator.snooze(
            job.row.category, [job.row.work_id], [job.row.lease_token], [seconds]
        )

    def _discard(self, job: _Job, reason: str) -> list[Any]:
        return self.coordinator.discard(
            job.row.category, [job.row.work_id], [job.row.lease_token], [reason]
        )

    def _release(self, job: _Job) -> list[Any]:
        return self.coordinator.release(job.row.category, [job.row.work_id], [job.row.lease_token])

    def _dead_letter(self, job: _Job, error: str, reason: str) -> list[Any]:
        return self.coordinator.dead_letter(
            job.row.category, [job.row.work_id], [job.row.lease_token], [error], reason
        )

    def cancel_running(self, category: str, attempts: Sequence[tuple[uuid.UUID, uuid.UUID]]) -> int:
        """Stop attempts an operator cancelled: ``(work id, lease token)`` pairs the
        database showed cancelled (a renewal's answer, or a NOTIFY the gate confirmed).

        Each matching dispatch gets ``work.cancelled`` (reason ``cancelled``) and, for an
        async handler, its task cancelled; attempts not in flight here are ignored.
        Returns how many were told.
        """
        told = 0
        for work_id, token in attempts:
            with self._lock:
                job = self._jobs.get((category, work_id))
            if job is None or job.row.lease_token != token:
                continue
            job.handle.cancel(CancelReason.CANCELLED)
            told += 1
            running = job.task
            if running is not None:
                loop, task = running
                # A closed loop raises RuntimeError: the handler has returned already.
                with contextlib.suppress(RuntimeError):
                    loop.call_soon_threadsafe(task.cancel)
        if told:
            logger.info(
                "%d running %s attempt(s) cancelled by an operator",
                told,
                category,
                extra={"action": "cancel_running"},
            )
        return told

    def _call_batch(self, handler: Handler, works: list[Work], run: _Run | None = None) -> None:
        # One consumer span per batch call, current inside the handler, sync or async.
        with tracing.handling_batch(works):
            result = wrap_in_middleware(handler.func, self.middleware)(works)
            if inspect.isawaitable(result):
                self._await(result, run)

    def _call_batch_atomic(self, handler: Handler, jobs: list[_Job], works: list[Work]) -> None:
        """Run a batch handler and the fenced completion of every row in one transaction."""
        category = jobs[0].row.category
        with transaction.atomic(using=self.alias):
            self._call_batch(handler, works, jobs[0].run)
            gone = []
            for job in jobs:
                with job.lock:
                    if job.state in (JobState.ABANDONED, JobState.SUPERSEDED):
                        gone.append(job)
            if gone:
                more = f" (and {len(gone) - 1} more of its rows)" if len(gone) > 1 else ""
                raise LeaseLost(
                    f"{category} {gone[0].row.work_id}: attempt {gone[0].row.attempts} was "
                    f"{gone[0].state} before its batch committed{more}; the batch's "
                    "transaction was rolled back",
                    len(gone),
                )
            outcomes = self.coordinator.complete(
                category,
                [job.row.work_id for job in jobs],
                [job.row.lease_token for job in jobs],
                [None] * len(jobs),
            )
            lost = [o.work_id for o in outcomes if o.status != OutcomeStatus.DONE]
            if len(outcomes) != len(jobs) or lost:
                count = len(lost) or len(jobs)
                raise LeaseLost(
                    f"{category}: the lease of {count} of the batch's {len(jobs)} rows was "
                    "lost before the atomic batch committed; its transaction was rolled back",
                    count,
                )

    def _work_for(self, job: _Job) -> Work:
        row = job.row
        return Work(
            row.work_id,
            row.category,
            row.topic,
            row.payload,
            row.stream,
            row.attempts,
            row.max_attempts,
            row.event_id,
            row.event_type,
            row.priority,
            row.lease_expiry,
            job.handle,
            self.coordinator.identity.instance_id,
            row.lease_token,
            self._stopping,
            row.headers,
        )

    def _await(self, awaitable: Any, holder: _Job | _Run | None) -> Any:
        """Run an async handler's (or middleware's) awaitable to its end from this handler
        thread, on the thread's event loop; return its result.

        Through ``async_to_sync`` (coroutines.HandlerLoop): Django's async ORM and
        thread-sensitive ``sync_to_async`` calls run back on this thread, on its
        connection, inside an atomic handler's transaction. The task is kept on
        ``holder`` (the row, or a batch's run) while it runs, so an operator's cancel,
        the handler's timeout, its lease deadline or a shutdown can cancel it.
        """
        runner = getattr(self._local, "loop", None)
        if runner is None or not runner.alive:
            runner = self._local.loop = HandlerLoop(f"{threading.current_thread().name}-loop")

        def started(loop: asyncio.AbstractEventLoop, task: asyncio.Task[Any]) -> None:
            if holder is None:
                return
            with holder.lock:
                holder.task = (loop, task)
                doomed = _given_up(holder)
            if doomed:
                task.cancel()  # given up on before its task existed

        try:
            return runner.run(awaitable, started)
        finally:
            if holder is not None:
                with holder.lock:
                    holder.task = None

    @staticmethod
    def _cancel_task(job: _Job, whole_batch: bool = True) -> None:
        """Cancel the task of ``job``'s async handler, if one runs; ``whole_batch``: also
        the task of the batch it is part of (the batch is given up whole)."""
        holders: list[_Job | _Run] = [job]
        if whole_batch and job.run is not None and job.run.batch is not None:
            holders.append(job.run)
        for holder in holders:
            with holder.lock:
                running = holder.task
            if running is not None:
                loop, task = running
                # A closed loop raises RuntimeError: the handler has returned already.
                with contextlib.suppress(RuntimeError):
                    loop.call_soon_threadsafe(task.cancel)

    def _discard_loop(self) -> None:
        """Stop this thread's event loop: the thread ends, or a BaseException ended a call."""
        runner = getattr(self._local, "loop", None)
        if runner is None:
            return
        self._local.loop = None
        runner.close()

    def _call(self, handler: Handler, job: _Job, traced: bool | None = None) -> str | None:
        work = self._work_for(job)
        # One consumer span per run, middleware included, awaited to the end (an async
        # handler's task copies the context, so the span is current inside it).
        with tracing.handling(work) if traced is not False else _NOT_TRACED:
            result = wrap_in_middleware(handler.func, self.middleware)(work)
            if inspect.isawaitable(result):  # an async handler, or an async middleware
                result = self._await(result, job)

        def warn(change: str) -> None:
            logger.warning(
                "%s %s (%s): %s",
                job.row.category,
                job.row.work_id,
                job.row.topic,
                change,
                extra={"action": "result_made_storable"},
            )

        return storable_result(result, warn)

    def _call_atomic(self, handler: Handler, job: _Job, traced: bool | None = None) -> None:
        """Run the handler and its fenced completion in one transaction."""
        with transaction.atomic(using=self.alias):
            result = self._call(handler, job, traced)
            with job.lock:
                # Abandoned at its deadline, or claimed again: the lease token fences the
                # completion out anyway; rolling back here spares the round trip.
                if job.state in (JobState.ABANDONED, JobState.SUPERSEDED):
                    raise LeaseLost(
                        f"{job.row.category} {job.row.work_id}: attempt {job.row.attempts} "
                        f"was {job.state} before it committed; its transaction was rolled back"
                    )
            outcome = self.coordinator.complete(
                job.row.category, [job.row.work_id], [job.row.lease_token], [result]
            )
            if not outcome or outcome[0].status != OutcomeStatus.DONE:
                raise LeaseLost(
                    f"{job.row.category} {job.row.work_id}: lease lost before the atomic "
                    "handler committed; its transaction was rolled back"
                )

    def _supersede(self, job: _Job, new_attempt: int) -> None:
        """Give up on an older attempt of a row this instance has just claimed again."""
        with job.lock:
            live = job.state in (JobState.QUEUED, JobState.RUNNING)
            if live:
                job.state = JobState.SUPERSEDED
        if not live:
            # Finished or abandoned, its slot about to be freed: only its handle is in the way.
            job.handle.dispose()
            return
        self.stats.superseded += 1
        logger.warning(
            "%s %s was claimed again (attempt %d) while attempt %d still ran here; the "
            "older attempt is superseded",
            job.row.category,
            job.row.work_id,
            new_attempt,
            job.row.attempts,
            extra={"action": "superseded"},
        )
        job.handle.cancel(CancelReason.LOST)
        self._cancel_task(job, whole_batch=False)  # the batch's other rows are still live
        job.handle.dispose()  # leaves the registry free for the new handle

    def _finish(self, job: _Job) -> None:
        """Let go of one row (its handle, its entry); its run's slot is freed apart."""
        job.handle.dispose()
        with self._lock:
            key = (job.row.category, job.row.work_id)
            if self._jobs.get(key) is job:  # not the newer attempt that superseded it
                del self._jobs[key]
            first = not job.finished
            job.finished = True
        if first:
            self.metrics.held(job.row.category, -1)

    def _free_slot(self, run: _Run) -> None:
        """The run is over here: free its slot (once)."""
        with run.lock:
            if run.slot_freed:
                return
            run.slot_freed = True
        with self._lock:
            self._in_flight -= 1
            self._idle.notify_all()
        if self.on_slot_free is not None:
            self.on_slot_free()

    def _release_rest(self, run: _Run, start: int) -> None:
        """Release the rows of ``run`` from ``start`` on that never started, in one call;
        their attempts are given back."""
        unstarted: list[_Job] = []
        for job in run.jobs[start:]:
            with job.lock:
                if job.state == JobState.QUEUED:
                    job.state = JobState.FINISHED
                    unstarted.append(job)
                    continue
                superseded = job.state == JobState.SUPERSEDED
            if superseded:
                self._finish(job)  # a newer attempt holds the row: nothing to release
        if not unstarted:
            return
        try:
            self._retrying_transient(
                unstarted,
                lambda: self.coordinator.release(
                    unstarted[0].row.category,
                    [job.row.work_id for job in unstarted],
                    [job.row.lease_token for job in unstarted],
                ),
            )
            self.stats.released += len(unstarted)
        except Exception:
            # Their leases run out and the rows are claimed again.
            logger.exception(
                "release of %d unstarted rows failed",
                len(unstarted),
                extra={"action": "release_failed"},
            )
        for job in unstarted:
            self._finish(job)

    def _retrying_transient(self, jobs: Sequence[_Job], write: Callable[[], _T]) -> _T:
        """``write()``, retried after a transient error while the leases of ``jobs`` last.

        Transient: the connection was lost (the server restarting, say), or the server
        broke a deadlock by rolling this write back (the pump's own writes do not
        deadlock each other, but an operator's action or an application's transaction
        can hold the rows). Given up, the rows would wait for their
        leases to run out. Other errors, and the last one, are raised.
        """
        delay = WRITE_RETRY_FIRST_SECONDS
        while True:
            try:
                return write()
            except Exception as exc:
                left = min(job.handle.seconds_left() for job in jobs)
                if not is_transient(exc) or left <= delay or self._stopping.is_set():
                    raise
                connections[self.alias].close_if_unusable_or_obsolete()
                self._stopping.wait(delay)
                delay = min(delay * 2, WRITE_RETRY_MAX_SECONDS)

    # -- abandonment ---------------------------------------------------------------
    def abandon(self, handle: LeaseHandle) -> bool:
        """Give up on a running handler whose lease deadline passed; free its slot."""
        job = self._jobs.get((handle.category, handle.work_id))
        if job is None or job.handle is not handle:
            return False
        with job.lock:
            if job.state != JobState.RUNNING:
                return False  # queued jobs are released by their worker; finished ones are done
            job.state = JobState.ABANDONED
        self._cancel_task(job)  # an async handler can be stopped: its thread comes back
        self.stats.abandoned += 1
        self.metrics.abandoned(job.row.category, job.row.topic)
        if job.run is not None and job.run.batch is not None:
            # One handler call runs the whole batch: give it up whole, at once.
            what = "its timeout" if handle.timed_out else "its lease deadline"
            self._give_up_batch(
                job,
                f"the batch handler was still running at {what} and was abandoned",
                FailureReason.TIMEOUT if handle.timed_out else FailureReason.LEASE_EXPIRED,
            )
            self._start_worker()  # the stuck thread keeps its handler; the slot gets a new one
            self._check_abandoned_limit()
            return True
        if handle.cancel_reason == CancelReason.CANCELLED:
            # The row already ended cancelled: nothing to write, only the slot to free.
            logger.error(
                "handler of %s %s ignored its cancellation and still runs at its lease "
                "deadline: abandoned (%d so far)",
                handle.category,
                handle.work_id,
                self.stats.abandoned,
                extra={"action": "abandoned"},
            )
            self._finish(job)
            self._end_run_of(job)
            self._start_worker()
            self._check_abandoned_limit()
            return True
        self._outcome_queued(1, job.row)
        logger.error(
            "handler of %s %s still running at %s: abandoned (%d so far)",
            handle.category,
            handle.work_id,
            "the end of its timeout" if handle.timed_out else "its lease deadline",
            self.stats.abandoned,
            extra={"action": "abandoned"},
        )
        if handle.timed_out:
            handler = self.handlers.get(handle.category, job.row.topic)
            timeout = handler.timeout if handler is not None else None
            error = (
                f"the handler was still running at the end of its timeout ({timeout:g} s) "
                "and was abandoned"
            )
            reason = FailureReason.TIMEOUT
        else:
            error = "the handler was still running at its lease deadline and was abandoned"
            reason = FailureReason.LEASE_EXPIRED
        self.failures.put(FailedAttempt.of(job.row, error, reason))
        self._finish(job)
        self._end_run_of(job)
        self._start_worker()  # the stuck thread keeps its handler; the slot gets a new one
        self._check_abandoned_limit()
        return True

    def _give_up_batch(self, job: _Job, error: str, reason: str) -> None:
        """A batch is given up while its thread still runs it (``job``, one of its rows,
        is marked abandoned): fail its first row still held with ``error``, release every
        other row of its run at once (their attempts given back), let go of every handle
        and free the slot; whatever the handler reports later is dropped."""
        run = job.run
        assert run is not None and run.batch is not None
        held: list[_Job] = []  # the batch's rows this attempt still holds, in stream order
        with run.lock:  # the handler thread's own check takes it: one of the two wins
            for other in run.batch:
                with other.lock:
                    if other is job or other.state == JobState.RUNNING:
                        other.state = JobState.ABANDONED
                        held.append(other)
        head, rest = held[0], held[1:]
        logger.error(
            "batch handler of %s %s (%d rows) given up: %s; its first row is failed, the "
            "%d others released (%d abandoned so far)",
            head.row.category,
            head.row.topic,
            len(run.batch),
            error,
            len(rest),
            self.stats.abandoned,
            extra={"action": "abandoned"},
        )
        if head.handle.cancel_reason != CancelReason.CANCELLED:  # a cancelled row has ended
            self._outcome_queued(1, head.row)
            self.failures.put(FailedAttempt.of(head.row, error, reason))
        self._finish(head)
        for other in rest:
            with other.lock:
                other.state = JobState.QUEUED  # never committed: released unstarted
        self._release_rest(run, run.jobs.index(head) + 1)
        self._free_slot(run)

    def _check_abandoned_limit(self) -> None:
        if self.stats.abandoned > self.abandoned_limit and self.on_fatal is not None:
            self.on_fatal(
                f"{self.stats.abandoned} abandoned handlers (limit {self.abandoned_limit}): "
                "exiting so the supervisor restarts a clean process"
            )

    def _end_run_of(self, job: _Job) -> None:
        """``job`` was given up while its thread still runs it: release the rows of its
        run behind it and free the run's slot (that thread never comes back to them)."""
        run = job.run
        if run is None:
            return
        self._release_rest(run, run.jobs.index(job) + 1)
        self._free_slot(run)

    # -- outcomes ------------------------------------------------------------------
    # Each flush gets the items of one category (group_by): one SQL call each.
    def _flush_completions(self, batch: list[tuple[str, uuid.UUID, uuid.UUID, str | None]]) -> None:
        category = batch[0][0]
        outcomes = self.coordinator.complete(
            category,
            [work_id for _, work_id, _, _ in batch],
            [token for _, _, token, _ in batch],
            [result for _, _, _, result in batch],
        )
        self._count(outcomes, "completed", category)
        self._outcome_queued(-len(batch))
        self._streams_written(category, batch)

    def _streams_written(
        self, category: str, batch: list[tuple[str, uuid.UUID, uuid.UUID, str | None]]
    ) -> None:
        """Call ``on_stream_ready`` when ``batch`` ended a stream run (written or fenced
        out: either way the stream's rows are no longer this run's)."""
        if not self._stream_run_ends:
            return
        with self._lock:
            ended = [
                key
                for key in ((category, item[1]) for item in batch)
                if key in self._stream_run_ends
            ]
            self._stream_run_ends.difference_update(ended)
        if ended and self.on_stream_ready is not None:
            self.on_stream_ready()

    def _flush_failures(self, batch: list[FailedAttempt]) -> None:
        self._write_failures(batch)
        self._outcome_queued(-len(batch))

    def _write_failures(self, batch: list[FailedAttempt]) -> None:
        """Fail one category's attempts in one call; log each by what the database did."""
        outcomes = self.coordinator.fail(
            batch[0].category,
            [item.work_id for item in batch],
            [item.lease_token for item in batch],
            [item.error for item in batch],
            [item.reason for item in batch],
            [item.delay for item in batch],
        )
        by_id = {item.work_id: item for item in batch}
        reasons = {item.work_id: item.reason for item in batch}
        self._count(outcomes, "failed", batch[0].category, reasons)
        for outcome in outcomes:
            item = by_id.get(outcome.work_id)
            if item is not None:
                log_failed_attempt(item, outcome)

    def _completion_rejected(
        self, item: tuple[str, uuid.UUID, uuid.UUID, str | None], error: Exception
    ) -> None:
        """Complete a row whose result the database refused, with a note instead of it."""
        category, work_id, token, _ = item
        note = result_note(
            f"the database refused it ({type(error).__name__}: {_first_line(error)})"
        )
        try:
            self._settle(
                lambda: self.coordinator.complete(category, [work_id], [token], [note]),
                "completed",
                category,
            )
            self._streams_written(category, [item])
        except Exception as exc:
            if is_transient(exc):
                raise
            self._streams_written(category, [item])  # failed below: the stream moves on
            # Even the note was refused: fail the attempt with a plain ASCII error.
            failure = FailedAttempt(
                category,
                work_id,
                token,
                f"The handler finished but its outcome could not be stored "
                f"({type(error).__name__}: {_first_line(error)}).",
                FailureReason.UNSTORABLE_OUTCOME,
            )
            self._failure_rejected(failure, exc)

    def _failure_rejected(self, item: FailedAttempt, error: Exception) -> None:
        """Fail a row whose error text the database refused, with a plain ASCII one."""
        plain = item._replace(error=ascii_text(item.error)[-8000:])
        try:
            self._write_failures([plain])
            self._outcome_queued(-1)
        except Exception as exc:
            if is_transient(exc):
                raise
            self._outcome_queued(-1)
            self._outcome_topics.pop((item.category, item.work_id), None)
            raise  # the flusher drops and logs it; the lease runs out and the row re-runs

    def _settle(self, write: Callable[[], list[Any]], counter: str, category: str) -> None:
        """Write one item's outcome through a safe path and count it."""
        self._count(write(), counter, category)
        self._outcome_queued(-1)

    def _count(
        self,
        outcomes: list[Any],
        counter: str,
        category: str,
        reasons: Mapping[uuid.UUID, str] | None = None,
    ) -> None:
        if self.metrics.enabled:
            topics = {
                o.work_id: self._outcome_topics.pop((category, o.work_id), "") for o in outcomes
            }
            self.metrics.outcomes(
                category, outcomes, topics.__getitem__, None if reasons is None else reasons.get
            )
        for outcome in outcomes:
            if outcome.status == OutcomeStatus.LOST:
                self.stats.lost_leases += 1
                logger.warning(
                    "lease of %s was lost before its outcome was recorded (fenced out)",
                    outcome.work_id,
                    extra={"action": "lease_lost"},
                )
            else:
                setattr(self.stats, counter, getattr(self.stats, counter) + 1)

    # -- shutdown ------------------------------------------------------------------
    def stop_accepting(self) -> None:
        """Take no more rows; tell running handlers to finish early (``work.cancelled``).

        Leases stay live and renewed until each handler returns; rows still queued are
        released unstarted, their attempt given back.
        """
        with self._lock:
            self._accepting = False
        self._stopping.set()

    def fail_running(self, timeout: float) -> int:
        """Fail the attempts whose handlers still run at the shutdown timeout; return how many.

        Each keeps its attempt (a handler that always outlives a stop reaches
        ``max_attempts`` across restarts); what it reports later is dropped.
        """
        with self._lock:
            jobs = list(self._jobs.values())
        failed = 0
        for job in jobs:
            with job.lock:
                if job.state != JobState.RUNNING:
                    continue  # queued ones are released by their worker
                job.state = JobState.ABANDONED
            self._cancel_task(job)
            failed += 1
            if job.run is not None and job.run.batch is not None:
                self._give_up_batch(
                    job,
                    f"the batch handler was still running when the pump stopped ({timeout} s "
                    "shutdown timeout); the attempt is counted",
                    FailureReason.SHUTDOWN,
                )
                self._start_worker()
                continue
            self._outcome_queued(1, job.row)
            self.failures.put(
                FailedAttempt.of(
                    job.row,
                    f"the handler was still running when the pump stopped ({timeout} s "
                    "shutdown timeout); the attempt is counted",
                    FailureReason.SHUTDOWN,
                )
            )
            self._finish(job)
            self._end_run_of(job)
            self._start_worker()  # rows still queued behind it get released
        return failed

    def wait_idle(self, timeout: float) -> bool:
        """Wait until nothing is queued or running; False on timeout."""
        with self._idle:
            return self._idle.wait_for(lambda: self._in_flight == 0, timeout)

    def stop(self, timeout: float | None = None) -> None:
        """Stop workers (after ``wait_idle``) and flush every pending outcome.

        Each flusher's final flush is waited for up to ``timeout`` (5 s when None).
        Idempotent, and harmless before ``start()``.
        """
        with self._lock:
            first, self._stopped = not self._stopped, True
        self.leases.cancel_all(CancelReason.SHUTDOWN)
        if first:
            for _ in self._threads:
                self._queue.put(None)
        flush_timeout = FINAL_FLUSH_SECONDS if timeout is None else timeout
        self.completions.stop(flush_timeout)
        self.failures.stop(flush_timeout)

    def join(self, timeout: float | None = None) -> bool:
        """Wait for the outcome flushers; True when neither runs.

        Handler threads are not waited for: an abandoned one may never return, and the
        rows of any still running are released by deregistration.
        """
        completions = self.completions.join(timeout)
        return self.failures.join(timeout) and completions


def _queue_wait(job: _Job, started_at: float) -> float | None:
    """Seconds from when the row became claimable to its handler's start, or None.

    The database's clock up to the claim, this process's monotonic clock from there on:
    no clock skew between the two enters.
    """
    row = job.row
    if row.due_at is None:
        return None
    return (row.claimed_at - row.due_at).total_seconds() + (started_at - job.received_at)


def _given_up(holder: _Job | _Run) -> bool:
    """Whether the attempt of ``holder`` (a row, or a batch's run) was given up on or
    cancelled; called with its lock held."""
    if isinstance(holder, _Run):
        return any(job.state == JobState.ABANDONED for job in holder.batch or ())
    return (
        holder.state in (JobState.ABANDONED, JobState.SUPERSEDED)
        or holder.handle.cancel_reason == CancelReason.CANCELLED
    )


def _first_line(error: Exception) -> str:
    lines = str(error).strip().splitlines()
    return lines[0] if lines else ""


def _category_of(item: tuple[Any, ...]) -> str:
    return str(item[0])


def _describe(exc: BaseException) -> str:
    # The exception line first (every summary shows the first line), then the end of a
    # long trace, in a form the database takes.
    return error_text(exc)
