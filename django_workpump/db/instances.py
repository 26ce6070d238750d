"""Liveness: heartbeats, eviction of stale instances, deregistration, and the
session's name.
"""

from __future__ import annotations

import uuid
from datetime import datetime

from django_workpump.db.queries import _column, _fetch, _scalar


def record_heartbeat(
    *,
    instance_id: uuid.UUID,
    service_name: str,
    host_name: str,
    process_id: int,
    metadata_json: str = "{}",
    stale_after_seconds: int = 30,
    definitively_dead_after_seconds: int = 300,
    lock_loss_grace_seconds: float = 0,
    now: datetime | None = None,
    using: str | None = None,
) -> bool:
    """Beat; False means this instance was evicted and must stop."""
    params = {
        "instance_id": instance_id,
        "service_name": service_name,
        "host_name": host_name,
        "process_id": process_id,
        "metadata": metadata_json,
        "stale_after_seconds": stale_after_seconds,
        "definitively_dead_after_seconds": definitively_dead_after_seconds,
        "lock_loss_grace_seconds": lock_loss_grace_seconds,
        "now": now,
    }
    return bool(_scalar("record_heartbeat", params, using))


def cleanup_stale_instances(
    *,
    stale_cutoff: datetime,
    definitive_dead_cutoff: datetime | None,
    lock_loss_grace_seconds: float = 0,
    now: datetime | None = None,
    using: str | None = None,
) -> list[uuid.UUID]:
    params = {
        "stale_cutoff": stale_cutoff,
        "definitive_dead_cutoff": definitive_dead_cutoff,
        "lock_loss_grace_seconds": lock_loss_grace_seconds,
        "now": now,
    }
    return _column(_fetch("cleanup_stale_instances", params, using), "instance_id")


def next_eviction_in(
    *,
    instance_id: uuid.UUID,
    stale_after_seconds: int,
    definitively_dead_after_seconds: int,
    lock_loss_grace_seconds: float,
    now: datetime | None = None,
    using: str | None = None,
) -> float | None:
    """Seconds until a peer becomes evictable: 0 for now, None when none is on its way."""
    params = {
        "instance_id": instance_id,
        "stale_after_seconds": stale_after_seconds,
        "definitively_dead_after_seconds": definitively_dead_after_seconds,
        "lock_loss_grace_seconds": lock_loss_grace_seconds,
        "now": now,
    }
    due_in = _scalar("next_eviction_in", params, using)
    return None if due_in is None else float(due_in)


def deregister_instance(
    *, instance_id: uuid.UUID, now: datetime | None = None, using: str | None = None
) -> int:
    params = {"instance_id": instance_id, "now": now}
    return int(_scalar("deregister_instance", params, using))


def alive_lock_held(*, instance_id: uuid.UUID, using: str | None = None) -> bool:
    return bool(_scalar("alive_lock_held", {"instance_id": instance_id}, using))


def reap_stale_instances(
    *,
    stale_after_seconds: int,
    definitively_dead_after_seconds: int,
    lock_loss_grace_seconds: float = 0,
    using: str | None = None,
) -> list[uuid.UUID]:
    """Evict stale instances by the database clock; return the evicted ids."""
    params = {
        "stale_after_seconds": stale_after_seconds,
        "definitively_dead_after_seconds": definitively_dead_after_seconds,
        "lock_loss_grace_seconds": lock_loss_grace_seconds,
    }
    return _column(_fetch("reap_stale_instances", params, using), "instance_id")


def set_application_name(*, name: str, using: str | None = None) -> None:
    """Name the session of this thread's connection (``pg_stat_activity.application_name``)."""
    _fetch("set_application_name", {"name": name}, using)
