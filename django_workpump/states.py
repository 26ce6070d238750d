"""The words the pump uses for states and outcomes, as types.

Each is a ``StrEnum``: a member is the very string the SQL functions return or store,
so rows read from the database compare equal to the members, and a member can be
passed wherever the SQL expects text. ``tests/sql/test_states.py`` checks that the SQL
produces exactly these words.
"""

from __future__ import annotations

from enum import StrEnum


class WorkState(StrEnum):
    """A work row's state, as ``workpump.state_of`` derives it at the database clock."""

    PENDING = "pending"  # claimable now
    SCHEDULED = "scheduled"  # waiting for a retry or a deferral
    LEASED = "leased"  # held by an instance under an unexpired lease
    ORPHANED = "orphaned"  # its lease expired, or its holder was evicted mid-attempt
    DONE = "done"  # completed
    DEAD = "dead"  # parked after its last attempt, or by an operator
    CANCELLED = "cancelled"  # ended by workpump.cancel; never runs (again)
    DISCARDED = "discarded"  # ended by its handler raising workpump.Discard


# The states of rows that ended: their stream has moved on and they never run again.
ENDED_STATES = (WorkState.DONE, WorkState.CANCELLED, WorkState.DISCARDED)


# The states whose rows wait for a claimer: their oldest row is the pump's backlog age.
WAITING_STATES = (WorkState.PENDING, WorkState.ORPHANED)


class OutcomeStatus(StrEnum):
    """What ``complete_work``, ``fail_work`` and ``release_work`` did with one row."""

    DONE = "done"  # completed
    RETRY = "retry"  # failed; scheduled for another attempt
    DEAD = "dead"  # failed on its last attempt (or parked): dead-lettered
    RELEASED = "released"  # lease given back unrun
    SNOOZED = "snoozed"  # given back to run later, its attempt not spent (snooze_work)
    DISCARDED = "discarded"  # ended by its handler as discarded (discard_work)
    RENEWED = "renewed"  # lease extended (renew_leases)
    CANCELLED = "cancelled"  # the attempt was cancelled (renew_leases)
    LOST = "lost"  # fenced out: the caller no longer held the row under that token


class HandlerOutcome(StrEnum):
    """How one run of a handler ended, before anything is written."""

    DONE = "done"  # returned: complete the row with its result
    DONE_COMMITTED = "done_committed"  # atomic: completed inside the handler's transaction
    FAIL = "fail"  # raised (or had no handler): fail the attempt
    SNOOZE = "snooze"  # raised workpump.Snooze: run again later, the attempt not spent
    DISCARD = "discard"  # raised workpump.Discard: end the row as discarded
    RELEASE = "release"  # raised workpump.Release: hand the row back unfinished
    LOST = "lost"  # the lease was lost before an atomic handler could commit


class JobState(StrEnum):
    """A dispatched row's state inside the dispatcher.

    queued -> running -> finished, or abandoned (still running at its lease deadline)
    or superseded (the row was claimed again while this attempt was live).
    """

    QUEUED = "queued"
    RUNNING = "running"
    FINISHED = "finished"
    ABANDONED = "abandoned"
    SUPERSEDED = "superseded"


class FailureReason(StrEnum):
    """Why an attempt failed or a row was parked: the ``failure_reason`` column.

    An operator's dead-lettering stores the reason the operator gave, which may be any
    text; ``OPERATOR`` is the one ``workpump.dead_letter`` stores when given none.
    """

    HANDLER_ERROR = "handler_error"  # the handler raised
    NO_HANDLER = "no_handler"  # no handler registered for the row's topic
    LEASE_EXPIRED = "lease_expired"  # the attempt's lease ran out without an outcome
    INSTANCE_EVICTED = "instance_evicted"  # its holder was evicted mid-attempt
    MAX_ATTEMPTS = "max_attempts"  # the attempts were used up
    UNDECODABLE_PAYLOAD = "undecodable_payload"  # Python cannot decode the payload
    UNSTORABLE_OUTCOME = "unstorable_outcome"  # the database refused the outcome
    OPERATOR_RELEASED = "operator_released"  # an operator released the lease
    SHUTDOWN = "shutdown"  # its handler still ran when a graceful stop timed out
    OPERATOR = "operator"  # dead-lettered by an operator who gave no reason
    NOT_RETRYABLE = "not_retryable"  # raised an exception its Retry(on=...) does not name
    TIMEOUT = "timeout"  # its handler still ran at the end of its own timeout
    MAX_SNOOZES = "max_snoozes"  # it snoozed MAX_SNOOZES times; the next snooze failed
    DISCARDED = "discarded"  # its handler raised workpump.Discard (the row ended)
    CANCELLED = "cancelled"  # an operator cancelled it (the row ended)
    RELEASED = "released"  # its handler raised workpump.Release outside a shutdown
    # a row it was sent after= ended dead, discarded or cancelled (the row was cancelled)
    DEPENDENCY_FAILED = "dependency_failed"


class CancelReason(StrEnum):
    """Why a local lease handle was cancelled (``work.cancelled`` turned true)."""

    DEADLINE = "deadline"  # its local deadline passed
    SHUTDOWN = "shutdown"  # the pump is stopping
    DISPOSED = "disposed"  # the dispatch let go of it
    LOST = "lost"  # the database refused a renewal (another holder, or evicted)
    CANCELLED = "cancelled"  # an operator cancelled the row (workpump.cancel)


class StopReason(StrEnum):
    """Why ``work.cancelled`` turned true, as ``work.cancel_reason`` says it."""

    SHUTDOWN = "shutdown"  # the pump is stopping: raise workpump.Release to hand the row back
    OPERATOR = "operator"  # an operator cancelled the row (workpump.cancel); it has ended
    DEADLINE = "deadline"  # the handler's timeout or its lease deadline passed
    LEASE_LOST = "lease_lost"  # the row is no longer this attempt's (claimed again, evicted)
