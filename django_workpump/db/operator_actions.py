"""Operator actions (``django_workpump.actions`` and the admin): selecting, locking,
cancelling, retrying, re-queueing and releasing work, and evicting instances.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime

from django_workpump.db.loaders import _readable_times
from django_workpump.db.queries import _column, _fetch, _scalar
from django_workpump.db.rows import FromRow
from django_workpump.states import WorkState


@dataclass(frozen=True)
class SelectedWork(FromRow):
    """A work row as an operator selects it."""

    category: str
    work_id: uuid.UUID
    topic: str
    state: WorkState
    created_at: datetime

    def __post_init__(self) -> None:
        object.__setattr__(self, "state", WorkState(self.state))


@dataclass(frozen=True)
class CancelledWork(FromRow):
    """A row ``cancel_work`` ended, and the instance that held it (None: not leased)."""

    work_id: uuid.UUID
    holder: uuid.UUID | None


def cancel_work(
    *,
    category: str,
    ids: Sequence[uuid.UUID],
    now: datetime | None = None,
    using: str | None = None,
) -> list[CancelledWork]:
    """End undone rows as cancelled; their holders are told by NOTIFY on commit."""
    params = {"category": category, "ids": list(ids), "now": now}
    return [CancelledWork.from_row(row) for row in _fetch("cancel_work", params, using)]


def select_work(
    *,
    ids: Sequence[uuid.UUID] | None = None,
    category: str | None = None,
    topic: str | None = None,
    state: str | None = None,
    older_than_seconds: float | None = None,
    limit: int | None = None,
    now: datetime | None = None,
    using: str | None = None,
) -> list[SelectedWork]:
    """Work rows by id and/or filters (None matches everything), oldest first, at most
    ``limit`` (None: all)."""
    params = {
        "ids": None if ids is None else list(ids),
        "category": category,
        "topic": topic,
        "state": state,
        "older_than_seconds": older_than_seconds,
        "limit": limit,
        "now": now,
    }
    # A created_at Python cannot hold (written through SQL) must not fail the selection.
    rows = _fetch("select_work", params, using, set_loaders=_readable_times)
    return [SelectedWork.from_row(row) for row in rows]


def lock_work(
    *,
    ids: Sequence[uuid.UUID],
    category: str | None = None,
    topic: str | None = None,
    state: str | None = None,
    older_than_seconds: float | None = None,
    now: datetime | None = None,
    using: str | None = None,
) -> list[SelectedWork]:
    """Lock the rows of ``ids`` until the transaction ends; return those that still match
    the filters, oldest first."""
    params = {
        "ids": list(ids),
        "category": category,
        "topic": topic,
        "state": state,
        "older_than_seconds": older_than_seconds,
        "now": now,
    }
    # As select_work: a created_at Python cannot hold must not fail the selection.
    rows = _fetch("lock_work", params, using, set_loaders=_readable_times)
    return [SelectedWork.from_row(row) for row in rows]


@dataclass(frozen=True)
class InstanceStanding(FromRow):
    """What an eviction must know of one instance id."""

    instance_id: uuid.UUID
    registered: bool  # its row exists (and is locked until the transaction ends)
    live: bool  # by the liveness rule
    evicted_at: datetime | None  # tombstoned then; None: not tombstoned
    evicted_reason: str | None
    running: int  # rows it leases whose lease has not expired
    held: int  # rows it leases, expired or not

    @property
    def known(self) -> bool:
        """Whether anything in the database has this id."""
        return self.registered or self.evicted_at is not None or self.held > 0

    @property
    def busy(self) -> bool:
        """Whether it may still be running work: live, or leasing rows not yet expired."""
        return self.live or self.running > 0


def instance_standing(
    *,
    ids: Sequence[uuid.UUID],
    stale_after_seconds: int,
    definitively_dead_after_seconds: int,
    now: datetime | None = None,
    using: str | None = None,
) -> list[InstanceStanding]:
    """Each instance id's standing, its registration row locked until the transaction ends."""
    params = {
        "ids": list(ids),
        "stale_after_seconds": stale_after_seconds,
        "definitively_dead_after_seconds": definitively_dead_after_seconds,
        "now": now,
    }
    return [InstanceStanding.from_row(row) for row in _fetch("instance_standing", params, using)]


@dataclass(frozen=True)
class RunningWork(FromRow):
    """A row an instance leases under a lease not yet expired."""

    instance_id: uuid.UUID
    category: str
    work_id: uuid.UUID
    topic: str


def running_work(
    *, ids: Sequence[uuid.UUID], limit: int, now: datetime | None = None, using: str | None = None
) -> list[RunningWork]:
    """Rows the instances ``ids`` hold under unexpired leases, at most ``limit``."""
    params = {"ids": list(ids), "limit": limit, "now": now}
    return [RunningWork.from_row(row) for row in _fetch("running_work", params, using)]


def retry_now(
    *,
    category: str,
    ids: Sequence[uuid.UUID],
    now: datetime | None = None,
    using: str | None = None,
) -> list[uuid.UUID]:
    """Make scheduled rows claimable now; return the ids that changed."""
    params = {"category": category, "ids": list(ids), "now": now}
    return _column(_fetch("retry_now", params, using), "id")


def requeue_dead(
    *,
    category: str,
    ids: Sequence[uuid.UUID],
    now: datetime | None = None,
    using: str | None = None,
) -> list[uuid.UUID]:
    """Give dead rows a fresh set of attempts; return the ids that changed."""
    params = {"category": category, "ids": list(ids), "now": now}
    return _column(_fetch("requeue_dead", params, using), "id")


def release_leases(
    *,
    category: str,
    ids: Sequence[uuid.UUID],
    force: bool,
    stale_after_seconds: int,
    definitively_dead_after_seconds: int,
    now: datetime | None = None,
    using: str | None = None,
) -> list[uuid.UUID]:
    """Release leases (of live holders only if ``force``); return the released ids."""
    params = {
        "category": category,
        "ids": list(ids),
        "force": force,
        "stale_after_seconds": stale_after_seconds,
        "definitively_dead_after_seconds": definitively_dead_after_seconds,
        "now": now,
    }
    return _column(_fetch("release_leases", params, using), "id")


def evict_instance(
    *, instance_id: uuid.UUID, reason: str = "evicted by an operator", using: str | None = None
) -> int:
    """Evict one instance now (operator action); return the number of rows released."""
    params = {"instance_id": instance_id, "reason": reason}
    return int(_scalar("evict_instance", params, using))
