"""Maintenance: the schema check, the maintenance lock and retention purges."""

from __future__ import annotations

from collections.abc import Sequence

from django.db import ProgrammingError

from django_workpump.db.queries import _column, _fetch, _scalar


def schema_functions_present(functions: Sequence[str], *, using: str | None = None) -> bool:
    """Whether every named workpump function exists (the migrations were applied)."""
    try:
        return bool(_scalar("schema_functions_present", {"functions": list(functions)}, using))
    except ProgrammingError:
        return False


def try_maintenance_lock(*, using: str | None = None) -> bool:
    """Take the session's maintenance lock; False when another instance holds it."""
    return bool(_scalar("try_maintenance_lock", {}, using))


def release_maintenance_lock(*, using: str | None = None) -> bool:
    return bool(_scalar("release_maintenance_lock", {}, using))


def maintenance_lock_holders(*, using: str | None = None) -> list[int]:
    """Backend pids of the sessions holding the maintenance lock now."""
    return _column(_fetch("maintenance_lock_holders", {}, using), "pid")


def purge_processed(
    *, category: str, retention_seconds: int, batch: int, using: str | None = None
) -> int:
    params = {"category": category, "retention_seconds": retention_seconds, "batch": batch}
    return int(_scalar("purge_processed", params, using))


def purge_dead(
    *, category: str, retention_seconds: int, batch: int, using: str | None = None
) -> int:
    """Delete up to ``batch`` rows dead for longer than ``retention_seconds``."""
    params = {"category": category, "retention_seconds": retention_seconds, "batch": batch}
    return int(_scalar("purge_dead", params, using))


def purge_inbox_dedup(*, retention_seconds: int, batch: int, using: str | None = None) -> int:
    """Forget up to ``batch`` received message ids whose inbox rows were purged."""
    params = {"retention_seconds": retention_seconds, "batch": batch}
    return int(_scalar("purge_inbox_dedup", params, using))


def purge_task_attempts(*, retention_seconds: int, batch: int, using: str | None = None) -> int:
    """Delete up to ``batch`` attempts of task rows that retention purged."""
    params = {"retention_seconds": retention_seconds, "batch": batch}
    return int(_scalar("purge_task_attempts", params, using))


def purge_events(*, retention_seconds: int, batch: int, using: str | None = None) -> int:
    params = {"retention_seconds": retention_seconds, "batch": batch}
    return int(_scalar("purge_events", params, using))


def purge_batches(*, retention_seconds: int, batch: int, using: str | None = None) -> int:
    """Delete up to ``batch`` batches finished longer than ``retention_seconds`` ago."""
    params = {"retention_seconds": retention_seconds, "batch": batch}
    return int(_scalar("purge_batches", params, using))


def purge_evictions(*, retention_seconds: int, using: str | None = None) -> int:
    return int(_scalar("purge_evictions", {"retention_seconds": retention_seconds}, using))


def purge_idle_streams(*, batch: int, using: str | None = None) -> int:
    return int(_scalar("purge_idle_streams", {"batch": batch}, using))
