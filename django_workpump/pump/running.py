"""Running a handler: sync or async (on the thread's event loop, coroutines.py), alone
or in its own transaction (``atomic``), one row or a batch, inside the middleware and
the tracing span; what it did comes back as one outcome value (pump/outcomes.py)."""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import threading
import uuid
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

from django.db import transaction

from django_workpump import attempt_logs, db, tracing
from django_workpump.conf import setting
from django_workpump.control import MAX_DELAY_TEXT, Discard, Release, Snooze, named_index
from django_workpump.coroutines import HandlerLoop
from django_workpump.db import Outcome
from django_workpump.middleware import Middleware
from django_workpump.middleware import wrap as wrap_in_middleware
from django_workpump.pump.jobs import Job, LeaseLost, Run, given_up
from django_workpump.pump.outcomes import (
    Committed,
    Completed,
    Discarded,
    Failed,
    HandlerResult,
    Lost,
    Released,
    Snoozed,
    with_logs,
)
from django_workpump.registry import TOPIC_NOUNS, Handler
from django_workpump.states import FailureReason, JobState, OutcomeStatus
from django_workpump.storable import error_text, storable_result
from django_workpump.work import LeaseView, Work, checkpoint_text

logger = logging.getLogger("django_workpump.dispatch")

# A handler call's span when tracing is off.
_NOT_TRACED = contextlib.nullcontext()


class HandlerRunner:
    """Call handlers for the dispatcher, on its handler threads; say what came of it.

    ``complete(leases, results)`` writes completions inside an atomic handler's
    transaction (the coordinator's fenced ``complete``).
    """

    def __init__(
        self,
        complete: Callable[..., list[Outcome]],
        *,
        alias: str,
        middleware: Sequence[Middleware],
        stopping: threading.Event,
        instance_id: Callable[[], Any],
    ) -> None:
        self._complete = complete
        self.alias = alias
        self.middleware = tuple(middleware)  # wraps every handler call, the first outermost
        self._stopping = stopping
        self._instance_id = instance_id
        self._local = threading.local()
        self._checkpointer = partial(store_checkpoint, alias)  # one for every Work

    # -- one row, one batch --------------------------------------------------------
    def run(self, handler: Handler | None, job: Job, traced: bool | None = None) -> HandlerResult:
        """Run ``handler`` on ``job``'s row; return what came of it (never raises)."""
        try:
            if handler is None:
                noun = TOPIC_NOUNS[job.row.category]
                error = f"no handler registered for {noun} {job.row.topic!r}"
                return Failed(error, FailureReason.NO_HANDLER)
            if handler.atomic:
                self.call_atomic(handler, job, traced)
                return Committed()
            return Completed(self.call(handler, job, traced))
        except LeaseLost as exc:
            return Lost(str(exc))
        except Snooze as exc:
            return Snoozed(exc.seconds)
        except Discard as exc:
            return Discarded(exc.reason)
        except Release:
            return Released()
        except BaseException as exc:  # noqa: BLE001 (a handler's exit ends its attempt only)
            # SystemExit, KeyboardInterrupt and the like from a handler end its attempt,
            # not this thread: re-raised, they would leave the row leased by no one.
            if not isinstance(exc, Exception):
                self.discard_loop()
            return self.failure_of(handler, job, exc)

    def run_batch(
        self, handler: Handler, jobs: list[Job], works: list[Work], run: Run
    ) -> tuple[HandlerResult, int]:
        """Run a batch handler once on ``jobs``; return what came of it and the index of
        the row it concerns (a failure, a snooze or a discard; 0 otherwise)."""
        try:
            if handler.atomic:
                self.call_batch_atomic(handler, jobs, works)
                return Committed(), 0
            self.call_batch(handler, works, run)
            return Completed(), 0
        except LeaseLost as exc:
            return Lost(str(exc), exc.rows), 0
        except (Snooze, Discard) as exc:
            try:
                at = named_index(exc, works)
            except ValueError as error:  # it named no row of this batch: as run_pending
                return Failed(describe(error), FailureReason.HANDLER_ERROR), 0
            if isinstance(exc, Snooze):
                return Snoozed(exc.seconds), at
            return Discarded(exc.reason), at
        except Release:
            return Released(), 0
        except BaseException as exc:  # noqa: BLE001 (a handler's exit ends its attempt only)
            if not isinstance(exc, Exception):
                self.discard_loop()
            return self.failure_of(handler, jobs[0], exc), 0

    def failure_of(self, handler: Handler | None, job: Job, exc: BaseException) -> Failed:
        """The failure an exception makes, by the handler's Retry."""
        error = describe(exc)
        retry = handler.retry if handler is not None else None
        if retry is None:
            return Failed(error, FailureReason.HANDLER_ERROR)
        if not retry.retries(exc):
            return Failed(error, FailureReason.NOT_RETRYABLE)

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
                first_line(backoff_error) or type(backoff_error).__name__,
                extra={"action": "backoff_failed"},
            )
            delay = None
        return Failed(error, FailureReason.HANDLER_ERROR, delay)

    # -- calls ---------------------------------------------------------------------
    def work_for(self, job: Job) -> Work:
        return claimed_work(
            job.row,
            job.handle,
            self._instance_id(),
            stopping=self._stopping,
            checkpointer=self._checkpointer,
        )

    def call(self, handler: Handler, job: Job, traced: bool | None = None) -> str | None:
        work = self.work_for(job)
        # One consumer span per run, middleware included, awaited to the end (an async
        # handler's task copies the context, so the span is current inside it).
        with tracing.handling(work) if traced is not False else _NOT_TRACED:
            result = wrap_in_middleware(handler.func, self.middleware)(work)
            if inspect.isawaitable(result):  # an async handler, or an async middleware
                result = self.await_(result, job)

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

    def call_atomic(self, handler: Handler, job: Job, traced: bool | None = None) -> None:
        """Run the handler and its fenced completion in one transaction."""
        with transaction.atomic(using=self.alias):
            result = self.call(handler, job, traced)
            with job.lock:
                # Abandoned at its deadline, or claimed again: the lease token fences the
                # completion out anyway; rolling back here spares the round trip.
                if job.state in (JobState.ABANDONED, JobState.SUPERSEDED):
                    raise LeaseLost(
                        f"{job.row.category} {job.row.work_id}: attempt {job.row.attempts} "
                        f"was {job.state} before it committed; its transaction was rolled back"
                    )
            outcome = self._complete(
                [job.lease], [result], **with_logs([attempt_logs.current_json()])
            )
            if not outcome or outcome[0].status != OutcomeStatus.DONE:
                raise LeaseLost(
                    f"{job.row.category} {job.row.work_id}: lease lost before the atomic "
                    "handler committed; its transaction was rolled back"
                )

    def call_batch(self, handler: Handler, works: list[Work], run: Run | None = None) -> None:
        # One consumer span per batch call, current inside the handler, sync or async.
        with tracing.handling_batch(works):
            result = wrap_in_middleware(handler.func, self.middleware)(works)
            if inspect.isawaitable(result):
                self.await_(result, run)

    def call_batch_atomic(self, handler: Handler, jobs: list[Job], works: list[Work]) -> None:
        """Run a batch handler and the fenced completion of every row in one transaction."""
        category = jobs[0].row.category
        with transaction.atomic(using=self.alias):
            self.call_batch(handler, works, jobs[0].run)
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
            outcomes = self._complete([job.lease for job in jobs], [None] * len(jobs))
            lost = [o.work_id for o in outcomes if o.status != OutcomeStatus.DONE]
            if len(outcomes) != len(jobs) or lost:
                count = len(lost) or len(jobs)
                raise LeaseLost(
                    f"{category}: the lease of {count} of the batch's {len(jobs)} rows was "
                    "lost before the atomic batch committed; its transaction was rolled back",
                    count,
                )

    # -- async handlers ------------------------------------------------------------
    def await_(self, awaitable: Any, holder: Job | Run | None) -> Any:
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
                doomed = given_up(holder)
            if doomed:
                task.cancel()  # given up on before its task existed

        try:
            return runner.run(awaitable, started)
        finally:
            if holder is not None:
                with holder.lock:
                    holder.task = None

    @staticmethod
    def cancel_task(job: Job, whole_batch: bool = True) -> None:
        """Cancel the task of ``job``'s async handler, if one runs; ``whole_batch``: also
        the task of the batch it is part of (the batch is given up whole)."""
        holders: list[Job | Run] = [job]
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

    def discard_loop(self) -> None:
        """Stop this thread's event loop: the thread ends, or a BaseException ended a call."""
        runner = getattr(self._local, "loop", None)
        if runner is None:
            return
        self._local.loop = None
        runner.close()


def claimed_work(
    row: db.ClaimedWork,
    lease: LeaseView,
    instance_id: uuid.UUID | None,
    *,
    stopping: threading.Event | None = None,
    checkpointer: Callable[[Work, Any], None] | None = None,
) -> Work:
    """The ``Work`` a handler receives for ``row``, claimed by ``instance_id``."""
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
        lease,
        instance_id,
        row.lease_token,
        stopping,
        row.headers,
        row.checkpoint,
        checkpointer,
    )


def store_checkpoint(alias: str, work: Work, state: Any) -> None:
    """``work.checkpoint(state)``: written on this thread's connection to ``alias``, so in
    the handler's transaction when it has one, fenced by the attempt's lease token."""
    what = f"{work.category} {work.id}"
    max_bytes = setting("MAX_CHECKPOINT_BYTES")
    text = checkpoint_text(state, max_bytes, what)
    if work.instance_id is None or work.lease_token is None:
        raise LeaseLost(f"{what}: this attempt holds no lease, so it cannot checkpoint")
    status = db.checkpoint_work(
        instance_id=work.instance_id,
        category=work.category,
        id=work.id,
        lease_token=work.lease_token,
        state=text,
        max_bytes=max_bytes,
        using=alias,
    )
    if status != OutcomeStatus.DONE:
        raise LeaseLost(
            f"{what}: attempt {work.attempts} no longer holds the row (it was claimed "
            "again, cancelled, or ended), so its checkpoint was refused"
        )


def first_line(error: Exception) -> str:
    lines = str(error).strip().splitlines()
    return lines[0] if lines else ""


def describe(exc: BaseException) -> str:
    # The exception line first (every summary shows the first line), then the end of a
    # long trace, in a form the database takes.
    return error_text(exc)
