"""Periodic schedules: their state, registration, firing, skipping and pausing (their
functions in sql/schema.sql).
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime

from django_workpump.db.loaders import _readable_times
from django_workpump.db.queries import _column, _fetch, _scalar
from django_workpump.db.rows import FromRow


@dataclass(frozen=True)
class PeriodicState(FromRow):
    """What the periodic worker reads of one schedule before firing its slots."""

    name: str
    paused: bool
    last_slot: datetime | None
    created_at: datetime


def periodic_states(
    *, now: datetime | None = None, using: str | None = None
) -> tuple[datetime, dict[str, PeriodicState]]:
    """The database clock (``now`` if given) and every schedule's state, by name.

    A stored time Python cannot hold (written through SQL) comes as a ``StoredTime``:
    the worker's pass of that schedule fails alone, not the pass of every schedule.
    """
    rows = _fetch("periodic_states", {"now": now}, using, set_loaders=_readable_times)
    # One row carries the clock even with no schedule: its schedule columns are NULL.
    states = {row["name"]: PeriodicState.from_row(row) for row in rows if row["name"] is not None}
    return rows[0]["now"], states


def upsert_periodic(
    *,
    name: str,
    cron: str | None,
    every_seconds: int | None,
    timezone: str,
    catch_up: str,
    payload_json: str,
    priority: int,
    max_attempts: int,
    next_fire_at: datetime | None,
    now: datetime | None = None,
    using: str | None = None,
) -> bool:
    """Register a schedule's definition; True when its row was created."""
    params = {
        "name": name,
        "cron": cron,
        "every_seconds": every_seconds,
        "timezone": timezone,
        "catch_up": catch_up,
        "payload": payload_json,
        "priority": priority,
        "max_attempts": max_attempts,
        "next_fire_at": next_fire_at,
        "now": now,
    }
    return bool(_scalar("upsert_periodic", params, using))


def fire_periodic(
    *,
    name: str,
    slot: datetime,
    next_fire_at: datetime | None,
    partition_count: int,
    max_payload_bytes: int,
    now: datetime | None = None,
    using: str | None = None,
) -> uuid.UUID | None:
    """Fire one slot; the outbox message id, or None when another caller had fired it."""
    params = {
        "name": name,
        "slot": slot,
        "next_fire_at": next_fire_at,
        "partition_count": partition_count,
        "max_payload_bytes": max_payload_bytes,
        "now": now,
    }
    result: uuid.UUID | None = _scalar("fire_periodic", params, using)
    return result


def skip_periodic(
    *,
    name: str,
    slot: datetime,
    next_fire_at: datetime | None,
    now: datetime | None = None,
    using: str | None = None,
) -> bool:
    """Mark one slot handled without firing it; True when last_slot moved."""
    params = {"name": name, "slot": slot, "next_fire_at": next_fire_at, "now": now}
    return bool(_scalar("skip_periodic", params, using))


def pause_periodic(
    *,
    names: Sequence[str],
    paused: bool,
    now: datetime | None = None,
    using: str | None = None,
) -> list[str]:
    """Pause or resume schedules; return the names whose flag changed."""
    params = {"names": list(names), "paused": paused, "now": now}
    return _column(_fetch("pause_periodic", params, using), "name")
