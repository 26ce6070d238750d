"""Batches: opening, sealing and reading them (dependencies travel with ``send``)."""

from __future__ import annotations

import uuid
from typing import Any

from django_workpump.db.queries import _fetch, _scalar


def open_batch(
    *,
    on_complete_json: str | None,
    on_failure_json: str | None,
    parent_batch_id: uuid.UUID | None,
    using: str | None = None,
) -> uuid.UUID:
    """Store an unsealed batch; its id."""
    params = {
        "on_complete": on_complete_json,
        "on_failure": on_failure_json,
        "parent_batch_id": parent_batch_id,
    }
    return _scalar("open_batch", params, using)


def seal_batch(batch_id: uuid.UUID, *, using: str | None = None) -> None:
    """Let the batch finish (at once when nothing of it is pending)."""
    _fetch("seal_batch", {"batch_id": batch_id}, using)


def batch_status(batch_id: uuid.UUID, *, using: str | None = None) -> dict[str, Any] | None:
    """The batch's row as a dict, or None when there is none."""
    rows = _fetch("batch_status", {"batch_id": batch_id}, using)
    return rows[0] if rows else None


def batch_of(work_id: uuid.UUID, *, using: str | None = None) -> uuid.UUID | None:
    """The batch an outbox or inbox row belongs to, if any."""
    rows = _fetch("batch_of", {"work_id": work_id}, using)
    return next((row["batch_id"] for row in rows if row["batch_id"] is not None), None)


def join_batch(
    category: str, batch_id: uuid.UUID, ids: list[uuid.UUID], *, using: str | None = None
) -> int:
    """Make stored undone rows members of the open batch; how many joined."""
    return int(
        _scalar("join_batch", {"category": category, "batch_id": batch_id, "ids": ids}, using)
    )
