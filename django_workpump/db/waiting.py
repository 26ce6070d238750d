"""Reading the outcomes of rows that someone waits for (``workpump.wait``), on the
waiter's own psycopg connection (the one that LISTENs on ``workpump_done``)."""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from datetime import datetime
from typing import Any

from django_workpump.sql import named_queries

# The channel complete_work, fail_work, discard_work, cancel_work, ... notify when rows end.
DONE_CHANNEL = "workpump_done"


def outcomes_params(
    ids: Sequence[uuid.UUID], categories: Sequence[str] | None, now: datetime | None = None
) -> tuple[str, dict[str, Any]]:
    """The work_outcomes query and its parameters, for a sync or an async cursor."""
    params = {"ids": list(ids), "categories": list(categories) if categories else None, "now": now}
    return named_queries()["work_outcomes"], params


def work_outcomes(
    conn: Any, *, ids: Sequence[uuid.UUID], categories: Sequence[str] | None = None
) -> list[dict[str, Any]]:
    """The rows ``ids`` name (in ``categories``; all when None), as dicts: work_id,
    category, state, result (its JSON text), last_error, failure_reason, ended_at."""
    query, params = outcomes_params(ids, categories)
    cursor = conn.execute(query, params)
    columns = [column.name for column in cursor.description]
    return [dict(zip(columns, row, strict=True)) for row in cursor.fetchall()]
