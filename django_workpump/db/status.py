"""Reads of the status report."""

from __future__ import annotations

import uuid
from dataclasses import dataclass

from django_workpump.db.queries import _fetch
from django_workpump.db.rows import FromRow


@dataclass(frozen=True)
class StuckRow(FromRow):
    category: str
    work_id: uuid.UUID
    topic: str
    attempts: int
    max_attempts: int
    last_error: str | None


def stuck_rows(*, limit: int = 50, using: str | None = None) -> list[StuckRow]:
    """Undone rows that used at least half their attempts (and more than one)."""
    return [StuckRow.from_row(row) for row in _fetch("stuck_rows", {"limit": limit}, using)]
