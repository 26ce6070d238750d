"""The one log line of a dead-lettered row: an ERROR naming its reason and the re-queue.

Every path that parks a row as dead calls ``log_dead_lettered`` once per row it parked:
a failed last attempt (``fail_work``), a ``Retry(on=...)`` that does not name the
exception, a snooze over ``MAX_SNOOZES`` on the last attempt, an undecodable payload, and
an operator (``workpump.dead_letter``, ``manage.py workpump_action dead-letter``, the
admin), and the claim itself, which parks a row whose attempts are used up instead of
leasing it (its last attempt ended without an outcome: the holder died, the lease
expired) and returns it to ``db.claim_work`` to be logged (``log_parked_by_claim``). Its
``extra`` keys are stable: ``action`` is ``dead_lettered``.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Iterable, Mapping
from typing import Any

from django.db import transaction

from django_workpump.states import FailureReason

logger = logging.getLogger("django_workpump.dead_letter")

# The longest exception line a log line quotes (the row keeps the whole text).
LOGGED_ERROR_CHARS = 500


# The reasons fail_work keeps when it parks a row on its last attempt; any other is
# stored as max_attempts.
KEPT_ON_LAST_ATTEMPT = frozenset(
    {FailureReason.TIMEOUT, FailureReason.NOT_RETRYABLE, FailureReason.UNDECODABLE_PAYLOAD}
)


def stored_dead_reason(reason: str) -> str:
    """The ``failure_reason`` fail_work stores for a row its failure parked as dead."""
    return reason if reason in KEPT_ON_LAST_ATTEMPT else FailureReason.MAX_ATTEMPTS


def requeue_command(work_id: uuid.UUID | str) -> str:
    """The command that gives a dead row a fresh set of attempts."""
    return f"manage.py workpump_action requeue {work_id}"


def log_dead_lettered(
    category: str,
    work_id: uuid.UUID | str,
    reason: str,
    error: str | None = None,
    *,
    topic: str | None = None,
    subject: str | None = None,
    stream: str | None = None,
    attempt: int | None = None,
    max_attempts: int | None = None,
    fix: str | None = None,
    by: str | None = None,
    **fields: Any,
) -> None:
    """Log that one row was dead-lettered, at ERROR, with its reason and the re-queue
    command. ``error`` is what went wrong (its first line is quoted), ``fix`` what to do
    before re-queueing it, ``by`` who parked it (an operator), ``subject`` what the row
    runs where its topic does not say it (a task's path), and ``fields`` more
    ``extra`` keys (e.g. ``workpump_retry_at``).
    """
    headline = (error or "").strip().splitlines()
    quoted = headline[0][:LOGGED_ERROR_CHARS] if headline else ""
    where = ", ".join(
        part
        for part in (
            subject,
            None if topic is None else f"topic {topic!r}",
            None if stream is None else f"stream {stream!r}",
            None if attempt is None else f"attempt {attempt}/{max_attempts}",
        )
        if part is not None
    )
    logger.error(
        "%s %s dead-lettered%s%s with reason %s%s. It is parked%s until an operator "
        "re-queues it%s: %s",
        category,
        work_id,
        f" ({where})" if where else "",
        f" by {by}" if by else "",
        reason,
        f": {quoted}" if quoted else "",
        "" if stream is None else " and blocks its stream",
        f" ({fix})" if fix else "",
        requeue_command(work_id),
        extra={
            "action": "dead_lettered",
            "workpump_category": category,
            "workpump_topic": topic,
            "workpump_id": str(work_id),
            "workpump_stream": stream,
            "workpump_attempt": attempt,
            "workpump_max_attempts": max_attempts,
            "workpump_reason": str(reason),
            "workpump_error": quoted,
            "workpump_by": by,
            **({} if subject is None else {"workpump_subject": subject}),
            **fields,
        },
    )


def log_parked_by_claim(rows: Iterable[Mapping[str, Any]]) -> None:
    """Log the rows a claim parked as dead instead of leasing them (``claim_work``'s rows
    without a lease token), with reason ``max_attempts`` and the ``last_error`` they were
    parked with."""
    for row in rows:
        log_dead_lettered(
            row["category"],
            row["work_id"],
            FailureReason.MAX_ATTEMPTS,
            row["last_error"],
            topic=row["topic"],
            stream=row["stream"],
            attempt=row["attempts"],
            max_attempts=row["max_attempts"],
        )


def log_when_committed(
    category: str,
    ids: Iterable[uuid.UUID],
    reason: str,
    *,
    by: str,
    using: str | None = None,
) -> None:
    """Log rows an operator dead-lettered once the caller's transaction commits (at once
    in autocommit): a rolled-back action (a dry run) parked nothing."""
    parked = list(ids)

    def log() -> None:
        for work_id in parked:
            log_dead_lettered(category, work_id, reason, by=by)

    if parked:
        transaction.on_commit(log, using=using)
