"""Writing outcomes: what a handler's attempt came to, written fenced by its lease.

Completions and failures go through two batch flushers (``complete_work``/``fail_work``,
one SQL call per category and flush); the rare ones (a snooze, a discard, a release, a
dead-lettering, the release of a run's unstarted rows) are written at once from the
handler thread, retried after a transient error while the lease lasts. Every write names
the attempt's ``Lease``: the database refuses one that is no longer the attempt's.
"""

from __future__ import annotations

import logging
import threading
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any, ClassVar, NamedTuple, TypeVar

from django.db import connections

from django_workpump.db import ClaimedWork, Outcome
from django_workpump.dead_letters import log_dead_lettered, stored_dead_reason
from django_workpump.metrics import NullRecorder
from django_workpump.pump.coordinator import Coordinator
from django_workpump.pump.flusher import BatchFlusher
from django_workpump.pump.jobs import DispatchStats, Job
from django_workpump.registry import FAILURE_SUBJECTS
from django_workpump.states import FailureReason, HandlerOutcome, OutcomeStatus, StopReason
from django_workpump.storable import ascii_text, error_headline, is_transient, result_note
from django_workpump.work import Lease, stop_reason

logger = logging.getLogger("django_workpump.dispatch")

_T = TypeVar("_T")
# How long stop() waits for each outcome flusher's final flush when not told.
FINAL_FLUSH_SECONDS = 5.0
# A write from a dispatch thread (a release of a run's unstarted rows, a snooze, discard
# or dead-lettering) that failed transiently is retried after these delays (doubling).
WRITE_RETRY_FIRST_SECONDS = 0.05
WRITE_RETRY_MAX_SECONDS = 1.0
# The longest exception line a log line quotes (the row keeps the whole text).
LOGGED_ERROR_CHARS = 500


# -- what a handler's attempt came to ---------------------------------------------------
@dataclass(frozen=True)
class Completed:
    """The handler returned: the row completes with ``result`` (storable JSON text)."""

    kind: ClassVar[HandlerOutcome] = HandlerOutcome.DONE

    result: str | None = None


@dataclass(frozen=True)
class Committed:
    """An atomic handler's transaction committed the row's completion with its work."""

    kind: ClassVar[HandlerOutcome] = HandlerOutcome.DONE_COMMITTED


@dataclass(frozen=True)
class Failed:
    """The attempt failed; ``backoff``: the handler's own retry delay (None: default)."""

    kind: ClassVar[HandlerOutcome] = HandlerOutcome.FAIL

    error: str
    reason: str
    backoff: float | None = None


@dataclass(frozen=True)
class Snoozed:
    """``workpump.Snooze``: run again in ``seconds``, the attempt not spent."""

    kind: ClassVar[HandlerOutcome] = HandlerOutcome.SNOOZE

    seconds: float


@dataclass(frozen=True)
class Discarded:
    """``workpump.Discard``: the row ends discarded."""

    kind: ClassVar[HandlerOutcome] = HandlerOutcome.DISCARD

    reason: str


@dataclass(frozen=True)
class Released:
    """``workpump.Release``: the row goes back (what that costs: ``release_failure``)."""

    kind: ClassVar[HandlerOutcome] = HandlerOutcome.RELEASE


@dataclass(frozen=True)
class Lost:
    """The lease was lost before an atomic handler committed: nothing to write."""

    kind: ClassVar[HandlerOutcome] = HandlerOutcome.LOST

    message: str
    rows: int = 1


HandlerResult = Completed | Committed | Failed | Snoozed | Discarded | Released | Lost


# -- what the flushers carry ------------------------------------------------------------
class Completion(NamedTuple):
    """A completion waiting to be written."""

    lease: Lease
    result: str | None = None
    logs: str | None = None  # the attempt's log records (attempt_logs.py)


class FailedAttempt(NamedTuple):
    """A failed attempt waiting to be written, with what its log line names."""

    lease: Lease
    error: str
    reason: str
    topic: str | None = None
    stream: str | None = None
    attempt: int | None = None
    max_attempts: int | None = None
    delay: float | None = None  # a handler's own retry delay (Retry backoff); None: default
    subject: str | None = None  # what the row runs, when its topic does not say it
    logs: str | None = None  # the attempt's log records (attempt_logs.py)

    @property
    def category(self) -> str:
        return self.lease.category

    @property
    def work_id(self) -> uuid.UUID:
        return self.lease.id

    @classmethod
    def of(
        cls,
        row: ClaimedWork,
        error: str,
        reason: str,
        delay: float | None = None,
        logs: str | None = None,
    ) -> FailedAttempt:
        return cls(
            Lease(row.category, row.work_id, row.lease_token),
            error,
            reason,
            row.topic,
            row.stream,
            row.attempts,
            row.max_attempts,
            delay,
            next(filter(None, (name(row) for name in FAILURE_SUBJECTS)), None),
            logs,
        )


def log_failed_attempt(item: FailedAttempt, outcome: Any) -> None:
    """Log one written failure: a WARNING when it will be retried, an ERROR when dead.

    Called with ``fail_work``'s answer, so the retry time is the database's.
    """
    status = outcome.status
    if status not in (OutcomeStatus.RETRY, OutcomeStatus.DEAD):
        return  # lost: the fence refused it and OutcomeWriter.count logs that
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


def with_logs(logs: Sequence[str | None]) -> dict[str, Any]:
    """The coordinator's ``logs`` argument, given only when an attempt logged something
    (the outcome's statement then stores them)."""
    return {"logs": list(logs)} if any(entry is not None for entry in logs) else {}


def _category_of(item: Completion | FailedAttempt) -> str:
    return item.lease.category


def _first_line(error: Exception) -> str:
    lines = str(error).strip().splitlines()
    return lines[0] if lines else ""


class OutcomeWriter:
    """Write the dispatcher's outcomes: the two flushers, and the rare writes at once.

    Counts what the database did in ``stats`` and the metrics; ``pending`` is how many
    outcomes a flusher holds unwritten (the supervisor waits for none at a stop).
    """

    def __init__(
        self,
        coordinator: Coordinator,
        stats: DispatchStats,
        *,
        metrics: NullRecorder,
        alias: str,
        stopping: threading.Event,
        name_connections: Callable[[str], None],
        on_stream_ready: Callable[[], Any] | None = None,
    ) -> None:
        self.coordinator = coordinator
        self.stats = stats
        self.metrics = metrics
        self.alias = alias
        self._stopping = stopping
        # Called once the completions of a stream run that ran to its end are written:
        # the stream's next rows can be claimed now (the claimer need not wait for a
        # poll or the NOTIFY of their promotion).
        self.on_stream_ready = on_stream_ready
        self._lock = threading.Lock()
        self._pending = 0  # handed to a flusher, not yet written
        # (category, work id) -> topic of an outcome waiting in a flusher, for the metrics
        # (filled only when they are recorded)
        self.topics: dict[tuple[str, uuid.UUID], str] = {}
        # (category, work id) of the last row of each such run, until its completion is
        # written (guarded by _lock).
        self._stream_run_ends: set[tuple[str, uuid.UUID]] = set()
        self.completions: BatchFlusher[Completion] = BatchFlusher(
            "workpump-completions",
            self._flush_completions,
            max_batch=500,
            coalesce_window=0.01,
            immediate_flush_at=250,
            capacity=10_000,
            on_thread_start=partial(name_connections, "completions"),
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
            on_thread_start=partial(name_connections, "failures"),
            on_thread_exit=connections.close_all,
            group_by=_category_of,
            on_rejected=self._failure_rejected,
        )

    # -- lifecycle -----------------------------------------------------------------
    def start(self) -> None:
        self.completions.start()
        self.failures.start()

    def stop(self, timeout: float | None = None) -> None:
        """Stop both flushers, each after a final flush waited for up to ``timeout``."""
        flush_timeout = FINAL_FLUSH_SECONDS if timeout is None else timeout
        self.completions.stop(flush_timeout)
        self.failures.stop(flush_timeout)

    def join(self, timeout: float | None = None) -> bool:
        completions = self.completions.join(timeout)
        return self.failures.join(timeout) and completions

    @property
    def pending(self) -> int:
        with self._lock:
            return self._pending

    def queued(self, count: int, row: ClaimedWork | None = None) -> None:
        with self._lock:
            self._pending += count
        if row is not None and self.metrics.enabled:
            self.topics[(row.category, row.work_id)] = row.topic

    # -- what the dispatcher hands over ---------------------------------------------
    def complete(self, job: Job, result: str | None = None, ends_stream_run: bool = False) -> None:
        """Queue ``job``'s completion; ``ends_stream_run``: once it is written, the
        stream's next rows can be claimed (``on_stream_ready``)."""
        self.queued(1, job.row)
        if ends_stream_run and self.on_stream_ready is not None:
            # Before the put: the flush that writes it may come at once.
            with self._lock:
                self._stream_run_ends.add(job.key)
        if not self.completions.put(Completion(job.lease, result, job.logs)) and ends_stream_run:
            with self._lock:  # refused: the row's lease runs out and it runs again
                self._stream_run_ends.discard(job.key)

    def committed(self, jobs: Sequence[Job]) -> None:
        """Count completions an atomic handler's transaction committed."""
        self.stats.completed += len(jobs)
        if jobs:
            done = [Outcome(job.row.work_id, OutcomeStatus.DONE) for job in jobs]
            topics = {job.row.work_id: job.row.topic for job in jobs}
            self.metrics.outcomes(jobs[0].row.category, done, topics.__getitem__)

    def lost(self, category: str, lost: Lost) -> None:
        """Count and log leases lost before an atomic handler committed."""
        self.stats.lost_leases += lost.rows
        self.metrics.lost(category, lost.rows)
        logger.warning("%s", lost.message, extra={"action": "lease_lost"})

    def fail(self, row: ClaimedWork, error: str, reason: str) -> None:
        """Queue the failure of an attempt given up on (its deadline, a shutdown)."""
        self.queued(1, row)
        self.failures.put(FailedAttempt.of(row, error, reason))

    def setback(self, job: Job, outcome: Failed | Snoozed | Discarded | Released) -> None:
        """Queue or write a failure, a snooze, a discard or a handler's release."""
        if isinstance(outcome, Released):
            failure = self.release_failure(job)
            if failure is None:
                self._write_now(job, "release", self._release)
                return
            outcome = failure
        if isinstance(outcome, Failed):
            if outcome.reason == FailureReason.NOT_RETRYABLE:
                self._write_now(
                    job,
                    "dead-lettering",
                    self._dead_letter,
                    outcome.error,
                    job.logs,
                    outcome.reason,
                )
            else:
                self.queued(1, job.row)
                self.failures.put(
                    FailedAttempt.of(
                        job.row, outcome.error, outcome.reason, outcome.backoff, job.logs
                    )
                )
        elif isinstance(outcome, Snoozed):
            self._write_now(job, "snooze", self._snooze, outcome.seconds)
        else:
            self._write_now(job, "discard", self._discard, outcome.reason, job.logs)

    def release_failure(self, job: Job) -> Failed | None:
        """What a handler's ``workpump.Release`` does to its row: None to give the row back
        with its attempt (a shutdown, or the lease is no longer this attempt's), else the
        failure that counts the attempt."""
        why = stop_reason(job.handle, self._stopping)
        if why in (StopReason.SHUTDOWN, StopReason.LEASE_LOST):
            return None
        if why == StopReason.DEADLINE:
            timed_out = job.handle.timed_out
            return Failed(
                "the handler released the row at "
                + ("the end of its timeout" if timed_out else "its lease deadline"),
                FailureReason.TIMEOUT if timed_out else FailureReason.LEASE_EXPIRED,
            )
        # Its own decision: the attempt counts (a handler that always releases ends
        # dead, not in a loop), and the row is claimable again at once.
        return Failed("the handler released the row unfinished", FailureReason.RELEASED, 0.0)

    def release_unstarted(self, jobs: Sequence[Job]) -> None:
        """Release rows of one run that never started, in one call (attempts given back);
        when that cannot be written, their leases run out."""
        leases = [job.lease for job in jobs]
        try:
            self.retrying_transient(
                jobs,
                lambda: self.coordinator.release(leases),
            )
            self.stats.released += len(jobs)
        except Exception:
            # Their leases run out and the rows are claimed again.
            logger.exception(
                "release of %d unstarted rows failed",
                len(jobs),
                extra={"action": "release_failed"},
            )

    # -- writes from the handler thread ----------------------------------------------
    def retrying_transient(self, jobs: Sequence[Job], write: Callable[[], _T]) -> _T:
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

    def _write_now(self, job: Job, what: str, write: Callable[..., list[Any]], *args: Any) -> None:
        """Write a rare outcome from the handler thread, retried after transient errors
        while the lease lasts; when it cannot be written the lease runs out."""
        try:
            outcomes = self.retrying_transient([job], lambda: write(job.lease, *args))
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
                if what == "dead-lettering":  # (error, logs, reason)
                    error, reason = args[0], stored_dead_reason(args[-1])
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

    def _snooze(self, lease: Lease, seconds: float) -> list[Any]:
        return self.coordinator.snooze([lease], [seconds])

    def _discard(self, lease: Lease, reason: str, logs: str | None) -> list[Any]:
        return self.coordinator.discard([lease], [reason], **with_logs([logs]))

    def _release(self, lease: Lease) -> list[Any]:
        return self.coordinator.release([lease])

    def _dead_letter(self, lease: Lease, error: str, logs: str | None, reason: str) -> list[Any]:
        return self.coordinator.dead_letter([lease], [error], reason, **with_logs([logs]))

    # -- the flushers' callbacks -----------------------------------------------------
    # Each flush gets the items of one category (group_by): one SQL call each.
    def _flush_completions(self, batch: list[Completion]) -> None:
        category = batch[0].lease.category
        outcomes = self.coordinator.complete(
            [item.lease for item in batch],
            [item.result for item in batch],
            **with_logs([item.logs for item in batch]),
        )
        self.count(outcomes, "completed", category)
        self.queued(-len(batch))
        self._streams_written(category, batch)

    def _streams_written(self, category: str, batch: list[Completion]) -> None:
        """Call ``on_stream_ready`` when ``batch`` ended a stream run (written or fenced
        out: either way the stream's rows are no longer this run's)."""
        if not self._stream_run_ends:
            return
        with self._lock:
            ended = [
                key
                for key in ((category, item.lease.id) for item in batch)
                if key in self._stream_run_ends
            ]
            self._stream_run_ends.difference_update(ended)
        if ended and self.on_stream_ready is not None:
            self.on_stream_ready()

    def _flush_failures(self, batch: list[FailedAttempt]) -> None:
        self._write_failures(batch)
        self.queued(-len(batch))

    def _write_failures(self, batch: list[FailedAttempt]) -> None:
        """Fail one category's attempts in one call; log each by what the database did."""
        outcomes = self.coordinator.fail(
            [item.lease for item in batch],
            [item.error for item in batch],
            [item.reason for item in batch],
            [item.delay for item in batch],
            **with_logs([item.logs for item in batch]),
        )
        by_id = {item.work_id: item for item in batch}
        reasons = {item.work_id: item.reason for item in batch}
        self.count(outcomes, "failed", batch[0].category, reasons)
        for outcome in outcomes:
            item = by_id.get(outcome.work_id)
            if item is not None:
                log_failed_attempt(item, outcome)

    def _completion_rejected(self, item: Completion, error: Exception) -> None:
        """Complete a row whose result the database refused, with a note instead of it."""
        lease = item.lease
        note = result_note(
            f"the database refused it ({type(error).__name__}: {_first_line(error)})"
        )
        try:
            self._settle(
                lambda: self.coordinator.complete([lease], [note]),
                "completed",
                lease.category,
            )
            self._streams_written(lease.category, [item])
        except Exception as exc:
            if is_transient(exc):
                raise
            self._streams_written(lease.category, [item])  # failed below: the stream moves on
            # Even the note was refused: fail the attempt with a plain ASCII error.
            failure = FailedAttempt(
                lease,
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
            self.queued(-1)
        except Exception as exc:
            if is_transient(exc):
                raise
            self.queued(-1)
            self.topics.pop((item.category, item.work_id), None)
            raise  # the flusher drops and logs it; the lease runs out and the row re-runs

    def _settle(self, write: Callable[[], list[Any]], counter: str, category: str) -> None:
        """Write one item's outcome through a safe path and count it."""
        self.count(write(), counter, category)
        self.queued(-1)

    def count(
        self,
        outcomes: list[Any],
        counter: str,
        category: str,
        reasons: Mapping[uuid.UUID, str] | None = None,
    ) -> None:
        if self.metrics.enabled:
            topics = {o.work_id: self.topics.pop((category, o.work_id), "") for o in outcomes}
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
