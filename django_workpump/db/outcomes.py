"""What a holder does with its leased rows: renew, complete, fail, snooze, discard,
release, and parking rows as dead; every write fenced by instance and lease token.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime

from django.db import DatabaseError

from django_workpump.db.errors import _refused
from django_workpump.db.queries import _column, _fetch
from django_workpump.db.rows import FromRow
from django_workpump.states import OutcomeStatus


@dataclass(frozen=True)
class Outcome(FromRow):
    """What ``complete_work``/``fail_work``/``release_work`` did with one id."""

    work_id: uuid.UUID
    status: OutcomeStatus
    scheduled_for: datetime | None = None

    def __post_init__(self) -> None:
        # The SQL returns plain text: hold the member (ValueError for an unknown word).
        # A dict lookup first: an enum call costs a microsecond, and every row has one.
        status = _STATUSES.get(self.status) or OutcomeStatus(self.status)
        object.__setattr__(self, "status", status)


_STATUSES: dict[object, OutcomeStatus] = {status.value: status for status in OutcomeStatus}


def log_param(logs: Sequence[str | None] | None) -> list[str | None] | None:
    """The ``p_logs`` array: None when no attempt logged anything (the outcome's statement
    then has no insert of logs at all)."""
    if logs is None or all(entry is None for entry in logs):
        return None
    return list(logs)


def renew_leases(
    *,
    category: str,
    ids: Sequence[uuid.UUID],
    lease_tokens: Sequence[uuid.UUID],
    lease_seconds: int,
    instance_id: uuid.UUID | None,
    now: datetime | None = None,
    using: str | None = None,
) -> dict[uuid.UUID, datetime | None]:
    """Renew; return ``{id: new lease_expiry}`` for the rows that were renewed, and
    ``{id: None}`` for the attempts an operator cancelled (the holder must stop them).

    Raise InstanceRefused when ``instance_id`` is evicted or not registered.
    """
    params = {
        "category": category,
        "ids": list(ids),
        "lease_tokens": list(lease_tokens),
        "lease_seconds": lease_seconds,
        "instance_id": instance_id,
        "now": now,
    }
    try:
        rows = _fetch("renew_leases", params, using)
    except DatabaseError as exc:
        raise (_refused(exc) or exc) from exc
    return {
        row["work_id"]: None if row["status"] == OutcomeStatus.CANCELLED else row["lease_expiry"]
        for row in rows
    }


def complete_work(
    *,
    instance_id: uuid.UUID,
    category: str,
    ids: Sequence[uuid.UUID],
    lease_tokens: Sequence[uuid.UUID],
    results: Sequence[str | None] | None = None,
    logs: Sequence[str | None] | None = None,
    now: datetime | None = None,
    using: str | None = None,
) -> list[Outcome]:
    """Complete; ``results`` are JSON texts (or None), one per id; ``logs`` the attempts'
    log records (JSON arrays, or None: attempt_logs.py), one per id."""
    params = {
        "instance_id": instance_id,
        "category": category,
        "ids": list(ids),
        "lease_tokens": list(lease_tokens),
        "results": list(results) if results else None,
        "logs": log_param(logs),
        "now": now,
    }
    return [Outcome.from_row(row) for row in _fetch("complete_work", params, using)]


def fail_work(
    *,
    instance_id: uuid.UUID,
    category: str,
    ids: Sequence[uuid.UUID],
    lease_tokens: Sequence[uuid.UUID],
    errors: Sequence[str],
    reasons: Sequence[str] | None = None,
    retry_base_seconds: int = 30,
    retry_max_seconds: int = 300,
    retry_delays: Sequence[float | None] | None = None,
    logs: Sequence[str | None] | None = None,
    now: datetime | None = None,
    using: str | None = None,
) -> list[Outcome]:
    """Fail attempts; ``retry_delays`` (one per id, None for the default backoff) are a
    handler's own retry delays in seconds; ``logs`` as ``complete_work``'s."""
    params = {
        "instance_id": instance_id,
        "category": category,
        "ids": list(ids),
        "lease_tokens": list(lease_tokens),
        "errors": list(errors),
        "reasons": list(reasons) if reasons else None,
        "retry_base_seconds": retry_base_seconds,
        "retry_max_seconds": retry_max_seconds,
        "retry_delays": None
        if retry_delays is None or all(d is None for d in retry_delays)
        else list(retry_delays),
        "logs": log_param(logs),
        "now": now,
    }
    return [Outcome.from_row(row) for row in _fetch("fail_work", params, using)]


def snooze_work(
    *,
    instance_id: uuid.UUID,
    category: str,
    ids: Sequence[uuid.UUID],
    lease_tokens: Sequence[uuid.UUID],
    seconds: Sequence[float],
    max_snoozes: int,
    now: datetime | None = None,
    using: str | None = None,
) -> list[Outcome]:
    """Give held rows back to run after ``seconds`` each, their attempts not spent."""
    params = {
        "instance_id": instance_id,
        "category": category,
        "ids": list(ids),
        "lease_tokens": list(lease_tokens),
        "seconds": list(seconds),
        "max_snoozes": max_snoozes,
        "now": now,
    }
    return [Outcome.from_row(row) for row in _fetch("snooze_work", params, using)]


def discard_work(
    *,
    instance_id: uuid.UUID,
    category: str,
    ids: Sequence[uuid.UUID],
    lease_tokens: Sequence[uuid.UUID],
    reasons: Sequence[str],
    logs: Sequence[str | None] | None = None,
    now: datetime | None = None,
    using: str | None = None,
) -> list[Outcome]:
    """End held rows as discarded, each with its reason; ``logs`` as ``complete_work``'s."""
    params = {
        "instance_id": instance_id,
        "category": category,
        "ids": list(ids),
        "lease_tokens": list(lease_tokens),
        "reasons": list(reasons),
        "logs": log_param(logs),
        "now": now,
    }
    return [Outcome.from_row(row) for row in _fetch("discard_work", params, using)]


def dead_letter(
    *,
    category: str,
    ids: Sequence[uuid.UUID],
    reason: str,
    now: datetime | None = None,
    using: str | None = None,
) -> list[uuid.UUID]:
    """Park undone rows as dead with ``reason``; return the ids that were parked."""
    params = {"category": category, "ids": list(ids), "reason": reason, "now": now}
    return _column(_fetch("dead_letter", params, using), "id")


def release_work(
    *,
    instance_id: uuid.UUID,
    category: str,
    ids: Sequence[uuid.UUID],
    lease_tokens: Sequence[uuid.UUID],
    now: datetime | None = None,
    using: str | None = None,
) -> list[Outcome]:
    params = {
        "instance_id": instance_id,
        "category": category,
        "ids": list(ids),
        "lease_tokens": list(lease_tokens),
        "now": now,
    }
    return [Outcome.from_row(row) for row in _fetch("release_work", params, using)]


def checkpoint_work(
    *,
    instance_id: uuid.UUID,
    category: str,
    id: uuid.UUID,
    lease_token: uuid.UUID,
    state: str | None,
    max_bytes: int,
    using: str | None = None,
) -> OutcomeStatus:
    """Store ``state`` (JSON text, or None to clear it) as the row's checkpoint, fenced
    by instance and lease token, in the caller's transaction: ``DONE`` when stored,
    ``LOST`` when the attempt no longer holds the row (nothing was written)."""
    params = {
        "instance_id": instance_id,
        "category": category,
        "id": id,
        "lease_token": lease_token,
        "state": state,
        "max_bytes": max_bytes,
    }
    (row,) = _fetch("checkpoint_work", params, using)
    return OutcomeStatus.DONE if row["status"] == "saved" else OutcomeStatus.LOST
