"""Queries on the NOTIFY gate's own psycopg connection (not Django's): the alive-lock,
the NOTIFY self-test, keepalives and cancelled attempts.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from typing import Any

from django_workpump.sql import named_queries


def take_alive_lock(conn: Any, *, instance_id: uuid.UUID) -> bool:
    """Take this instance's alive-lock on ``conn``'s session; False if not registered/held."""
    row = conn.execute(named_queries()["take_alive_lock"], {"instance_id": instance_id}).fetchone()
    return bool(row and row[0])


def notify_probe(conn: Any, *, channel: str) -> None:
    """NOTIFY ``channel`` from ``conn`` (the gate's self-test)."""
    conn.execute(named_queries()["notify_probe"], {"channel": channel})


def keepalive(conn: Any) -> None:
    conn.execute(named_queries()["keepalive"])


def cancelled_attempts(
    conn: Any,
    *,
    category: str,
    ids: Sequence[uuid.UUID],
    lease_tokens: Sequence[uuid.UUID],
) -> set[uuid.UUID]:
    """The ids among ``(ids[i], lease_tokens[i])`` whose attempt an operator cancelled.

    Runs on ``conn`` (the NOTIFY gate's session): a cancel notification is only a hint.
    """
    params = {"category": category, "ids": list(ids), "lease_tokens": list(lease_tokens)}
    rows = conn.execute(named_queries()["cancelled_attempts"], params).fetchall()
    return {row[0] for row in rows}
