"""Dispatcher: runs claimed rows on ``CONCURRENCY`` threads under a lease each.

Outcomes go through two batch flushers to ``complete_work``/``fail_work``, each fenced
by the lease token of the claim it reports on.
A handler still running at its lease deadline is abandoned: its slot is freed (a
replacement thread starts), the attempt is failed with reason ``lease_expired``, and
whatever it reports later is dropped here and would be fenced out by the database.

The rows of one ordered stream that a claim leased together (a stream run: the head and
the rows after it), or of one chain (send(after=...)), run in order in one slot, on one
thread. A row that does not complete ends its run: the rows after it are released
unstarted (their attempt given back), so they wait for the row's retry and nothing runs
out of order (a chain's rows never join a batch handler's call). A batch handler gets
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

import contextlib
import itertools
import logging
import math
import threading
import uuid
from collections.abc import Callable, Sequence
from typing import Any

from django.db import connections

from django_workpump import attempt_logs, tracing
from django_workpump.clock import Clock, SystemClock
from django_workpump.db import ClaimedWork
from django_workpump.metrics import NullRecorder, recorder
from django_workpump.middleware import Middleware
from django_workpump.pump.coordinator import Coordinator
from django_workpump.pump.handler_connections import PERSISTENT, between_jobs
from django_workpump.pump.jobs import ClaimRuns, DispatchStats, Job, Run, RunQueue, queue_wait
from django_workpump.pump.lease import LeaseHandle, LeaseRegistry
from django_workpump.pump.naming import application_name, name_thread_connections
from django_workpump.pump.outcomes import (
    Committed,
    Completed,
    HandlerResult,
    Lost,
    OutcomeWriter,
    Released,
)
from django_workpump.pump.running import HandlerRunner
from django_workpump.registry import Handler, Registry
from django_workpump.states import CancelReason, FailureReason, JobState

logger = logging.getLogger("django_workpump.dispatch")


class Dispatcher:
    """Run claimed rows on ``concurrency`` handler threads; write their outcomes in batches.

    A pump service (``pump.service.Service``): its threads are the handler threads
    (``workpump-dispatch-<n>``) and the two outcome flushers. This class keeps the
    intake, the slots and the threads; ``runner`` (pump/running.py) calls the handlers
    and ``outcomes`` (pump/outcomes.py) writes what came of them.
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
        self.handler_connections = handler_connections  # handler_connections.MODES
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
        self.on_stream_ready = on_stream_ready
        self.stats = DispatchStats()
        # Runs for the handler threads (RunQueue: in C, with a front lane).
        self._queue = RunQueue()
        self._jobs: dict[tuple[str, uuid.UUID], Job] = {}
        self._in_flight = 0  # queued + running, not abandoned
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._accepting = True
        self._stopping = threading.Event()  # a graceful stop began: work.cancelled is true
        self._started = False
        self._stopped = False
        self._threads: list[threading.Thread] = []
        self._thread_ids = itertools.count(1)
        self.outcomes = OutcomeWriter(
            coordinator,
            self.stats,
            metrics=self.metrics,
            alias=alias,
            stopping=self._stopping,
            name_connections=self._name_connections,
            on_stream_ready=on_stream_ready,
        )
        self.completions = self.outcomes.completions
        self.failures = self.outcomes.failures
        self.runner = HandlerRunner(
            coordinator.complete,
            alias=alias,
            middleware=middleware,
            stopping=self._stopping,
            instance_id=lambda: coordinator.identity.instance_id,
        )

    @property
    def middleware(self) -> tuple[Middleware, ...]:
        return self.runner.middleware

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
        return self.outcomes.pending

    def submit(self, rows: list[ClaimedWork], front: bool = False) -> None:
        """Take claimed rows: one lease handle each, queued for the workers by run
        (``ClaimRuns``: a stream's or a chain's rows together, in the claim's order);
        ``front``: before the runs queued now (RunQueue)."""
        received_at = self.clock.monotonic()
        runs = ClaimRuns(self.handlers)
        # One look at the rows in flight here for the whole claim (each row is looked up
        # and entered once; a claim holds up to hundreds).
        with self._lock:
            previous_jobs = [self._jobs.get((row.category, row.work_id)) for row in rows]
        jobs: list[Job] = []
        held: dict[str, int] = {}
        for row, previous in zip(rows, previous_jobs, strict=True):
            run = runs.join(row)
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
            job = Job(row, handle, received_at=received_at, run=run)
            run.jobs.append(job)
            jobs.append(job)
            held[row.category] = held.get(row.category, 0) + 1
        with self._lock:
            for job in jobs:
                self._jobs[(job.row.category, job.row.work_id)] = job
            self._in_flight += len(runs)
        for category, count in held.items():
            self.metrics.held(category, count)
        for run in runs:
            if not run.unchained:
                self._queue.put(run, front)
                continue
            self._release_rest(run, 0)  # never run here: given back, to wait as before
            self._free_slot(run)

    # -- workers -------------------------------------------------------------------
    def start(self) -> None:
        """Start the outcome flushers and the handler threads (once; not after stop())."""
        with self._lock:
            if self._started or self._stopped:
                return
            self._started = True
        self.outcomes.start()
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
            self.runner.discard_loop()
            connections.close_all()

    def _execute(self, run: Run) -> bool:
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
        if run.ordered:
            self.completions.hurry()  # the stream's or chain's next row waits on these
        self._free_slot(run)
        if ran and run.jobs[-1].committed and self.on_stream_ready is not None:
            # The handler's transaction wrote the run's last completion: the stream's next
            # rows can be claimed now.
            self.on_stream_ready()
        return True

    def _ends_stream_run(self, job: Job) -> bool:
        """Whether ``job`` ends a run whose next row waits on it (a stream's, a chain's)."""
        return job.run is not None and job.run.jobs[-1] is job and job.run.ordered

    def _run(self, job: Job, tidy_before: bool = True, traced: bool | None = None) -> bool | None:
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
            self.metrics.handler_started(job.row, queue_wait(job, started_at))
        outcome: HandlerResult
        try:
            with attempt_logs.capturing() as captured:
                outcome = self.runner.run(handler, job, traced)
            job.logs = None if captured is None else captured.json()
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
                outcome.kind,
                extra={"action": "cancelled_outcome_dropped"},
            )
            self._finish(job)
            return False  # not completed here: the rows after it are released
        if isinstance(outcome, Completed):
            self.outcomes.complete(job, outcome.result, self._ends_stream_run(job))
        elif isinstance(outcome, Lost):
            self.outcomes.lost(job.row.category, outcome)
        elif isinstance(outcome, Committed):
            job.committed = True
            self.outcomes.committed([job])
        else:
            self.outcomes.setback(job, outcome)
        self._finish(job)
        return isinstance(outcome, Completed | Committed)

    def _execute_batch(self, run: Run, handler: Handler) -> bool:
        """Run a batch handler once on the rows of ``run`` that can start, in order.

        Done: every row completes (with ``atomic``, in the handler's transaction). A
        failure fails the first row (by the handler's ``Retry``) and releases the others
        unstarted. ``Snooze``/``Discard`` act on the row they name (the first without
        ``work=``): the rows before it complete (unless ``atomic``: its transaction rolled
        back, they are released), the rows after it are released (docs/control-flow.md).
        A lease lost before an atomic batch committed rolls it back and releases the rows
        still held.
        """
        started: list[Job] = []
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
                self.metrics.handler_started(job.row, queue_wait(job, started_at))
        works = [self.runner.work_for(job) for job in started]
        outcome: HandlerResult
        at = 0  # the index of the row the outcome concerns (a failure, snooze or discard)
        try:
            with attempt_logs.capturing() as captured:
                outcome, at = self.runner.run_batch(handler, started, works, run)
            # One call for the whole batch: its records go with the row its outcome
            # concerns (the failed, snoozed or discarded one; the first when it completed).
            started[at].logs = None if captured is None else captured.json()
        finally:
            if self.metrics.enabled:
                # One call ran them all: each row gets an even share of its duration, so
                # the handler time summed over rows is the time spent.
                share = (self.clock.monotonic() - started_at) / len(started)
                for job in started:
                    self.metrics.handler_finished(job.row, share)
            between_jobs(self.handler_connections)
        if isinstance(outcome, Lost):
            self.outcomes.lost(started[0].row.category, outcome)
        live: list[Job] = []  # rows this attempt still holds
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
        if isinstance(outcome, Released):
            # At a shutdown every row goes back with its attempt (as below for a lost
            # lease); otherwise the first row's attempt counts, as for a failure.
            failure = self.outcomes.release_failure(started[0])
            outcome = Lost("") if failure is None else failure
        if isinstance(outcome, Completed):
            self._complete_batch(live)
            self._release_rest(run, len(started))
        elif isinstance(outcome, Committed):
            self.outcomes.committed(live)
            for job in live:
                self._finish(job)
            self._release_rest(run, len(started))
        elif isinstance(outcome, Lost):
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
                self.outcomes.setback(target, outcome)
                self._finish(target)
            for job in live:
                with job.lock:
                    if job.state == JobState.FINISHED and not job.finished:
                        job.state = JobState.QUEUED  # not done here: released unstarted
            self._release_rest(run, 0)
        self._free_slot(run)
        return True

    def _complete_batch(self, jobs: list[Job]) -> None:
        """Queue the completion of each of a batch's ``jobs`` (their handler returned)."""
        for job in jobs:
            self.outcomes.complete(job)
            self._finish(job)
        if jobs and jobs[0].row.stream is not None:
            self.completions.hurry()  # the stream's next row waits on these completions

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

    # -- slots ---------------------------------------------------------------------
    def _supersede(self, job: Job, new_attempt: int) -> None:
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
        self.runner.cancel_task(job, whole_batch=False)  # the batch's other rows are still live
        job.handle.dispose()  # leaves the registry free for the new handle

    def _finish(self, job: Job) -> None:
        """Let go of one row (its handle, its entry); its run's slot is freed apart."""
        job.handle.dispose()
        with self._lock:
            key = job.key
            if self._jobs.get(key) is job:  # not the newer attempt that superseded it
                del self._jobs[key]
            first = not job.finished
            job.finished = True
        if first:
            self.metrics.held(job.row.category, -1)

    def _free_slot(self, run: Run) -> None:
        """The run is over here: free its slot (once)."""
        with run.lock:
            if run.slot_freed:
                return
            run.slot_freed = True
        with self._lock:
            self._in_flight -= 1
            idle = self._in_flight == 0
            self._idle.notify_all()
        if idle:
            # Nothing else runs or waits here, so no completion will join the buffered
            # ones within the window: write them now (a dependent, a waiter or a
            # stream's next row may be waiting on them).
            self.completions.hurry()
        if self.on_slot_free is not None:
            self.on_slot_free()

    def _release_rest(self, run: Run, start: int) -> None:
        """Release the rows of ``run`` from ``start`` on that never started, in one call;
        their attempts are given back."""
        unstarted: list[Job] = []
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
        self.outcomes.release_unstarted(unstarted)
        for job in unstarted:
            self._finish(job)

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
        self.runner.cancel_task(job)  # an async handler can be stopped: its thread comes back
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
        self.outcomes.fail(job.row, error, reason)
        self._finish(job)
        self._end_run_of(job)
        self._start_worker()  # the stuck thread keeps its handler; the slot gets a new one
        self._check_abandoned_limit()
        return True

    def _give_up_batch(self, job: Job, error: str, reason: str) -> None:
        """A batch is given up while its thread still runs it (``job``, one of its rows,
        is marked abandoned): fail its first row still held with ``error``, release every
        other row of its run at once (their attempts given back), let go of every handle
        and free the slot; whatever the handler reports later is dropped."""
        run = job.run
        assert run is not None and run.batch is not None
        held: list[Job] = []  # the batch's rows this attempt still holds, in stream order
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
            self.outcomes.fail(head.row, error, reason)
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

    def _end_run_of(self, job: Job) -> None:
        """``job`` was given up while its thread still runs it: release the rows of its
        run behind it and free the run's slot (that thread never comes back to them)."""
        run = job.run
        if run is None:
            return
        self._release_rest(run, run.jobs.index(job) + 1)
        self._free_slot(run)

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
        error = (
            f"the handler was still running when the pump stopped ({timeout} s shutdown "
            "timeout); the attempt is counted"
        )
        for job in jobs:
            with job.lock:
                if job.state != JobState.RUNNING:
                    continue  # queued ones are released by their worker
                job.state = JobState.ABANDONED
            self.runner.cancel_task(job)
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
            self.outcomes.fail(job.row, error, FailureReason.SHUTDOWN)
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
                self._queue.stop_one()
        self.outcomes.stop(timeout)

    def join(self, timeout: float | None = None) -> bool:
        """Wait for the outcome flushers; True when neither runs.

        Handler threads are not waited for: an abandoned one may never return, and the
        rows of any still running are released by deregistration.
        """
        return self.outcomes.join(timeout)
