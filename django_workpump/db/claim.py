"""The claim: leasing rows to an instance through ``claim_work``, on a cursor kept per
connection, and decoding each claimed row.
"""

from __future__ import annotations

import json
import logging
import threading
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from functools import cache
from typing import Any

from django.db import DatabaseError, connections
from psycopg.types.string import TextLoader

from django_workpump.conf import setting
from django_workpump.db.errors import _refused
from django_workpump.db.loaders import _parse_timestamps_once
from django_workpump.db.queries import _alias, _fetch, _in_transaction
from django_workpump.db.rows import FromRow, Row
from django_workpump.dead_letters import log_parked_by_claim
from django_workpump.payloads import UndecodablePayload, decode
from django_workpump.prepared import PreparedQuery
from django_workpump.sql import named_queries

logger = logging.getLogger("django_workpump.claim")


@dataclass(frozen=True)
class ClaimedWork(FromRow):
    """One row leased to the caller by ``claim_work``."""

    category: str
    work_id: uuid.UUID
    topic: str
    payload: dict[str, Any]
    stream: str | None
    attempts: int
    max_attempts: int
    lease_expiry: datetime
    event_id: uuid.UUID | None
    event_type: str | None
    priority: int
    claimed_at: datetime
    lease_token: uuid.UUID  # this claim's token: every later write about the row names it
    has_more: bool
    # What the producer stored with the row (e.g. a W3C trace context); None when nothing.
    headers: dict[str, str] | None = None
    # Why the payload could not be decoded (then ``payload`` is empty): the row must be
    # dead-lettered, not run.
    payload_error: str | None = None
    # Why the stored headers could not be read (then ``headers`` is None): the row runs
    # without them, and the claimer logs a warning.
    headers_error: str | None = None
    # When the row was created, and when it became claimable: the expiry of the lease the
    # claim took over, else when its retry or deferral fell due, else created_at (database
    # clock). None only from a caller that builds rows without them.
    created_at: datetime | None = None
    due_at: datetime | None = None
    # The checkpoint the row's last attempt stored (work.checkpoint): None when none.
    checkpoint: Any = None
    # In a chain's run (send(after=...)): the row of this claim it waits for, which must
    # complete here before it starts; None on every other row.
    after_id: uuid.UUID | None = None


def claim_work(
    *,
    instance_id: uuid.UUID,
    max_rows: int,
    lease_seconds: int,
    partition_count: int,
    categories: Sequence[str] | None = None,
    topics: Mapping[str, Sequence[str]] | None = None,
    stale_after_seconds: int = 30,
    definitively_dead_after_seconds: int = 300,
    now: datetime | None = None,
    using: str | None = None,
    topic_prefixes: Mapping[str, Sequence[str]] | None = None,
    stream_run_max: int = 1,
    synchronous_commit: bool = True,
    underserved_only: bool = False,
) -> list[ClaimedWork]:
    """Lease rows of ``topics`` (``{category: [topic, ...]}``; None: every topic) and of
    the topics starting with one of ``topic_prefixes`` (same shape; None: none).

    With ``stream_run_max`` > 1 a stream head comes with a run: up to that many rows of
    its stream in all, consecutive and in stream order, right after the head.

    ``synchronous_commit=False``: when the claim is its own transaction (the connection
    is in autocommit), it commits without waiting for its WAL flush. A claim lost in a
    server crash leaves its rows unclaimed, to be claimed again, as a crash re-delivers
    work anyway. Inside a transaction of the caller's the caller's setting stands.

    Raise InstanceRefused when this instance is evicted or not registered. A row whose
    payload cannot be decoded comes back with ``payload_error``, one whose headers cannot
    be read with ``headers_error`` (and no headers). Each row says when it was
    created and when it became claimable (``due_at``, for the queue-wait metric).

    A row whose attempts are used up (its last attempt ended without an outcome) is parked
    as dead by the claim instead of leased: it is not returned, and is logged here, once,
    as every dead-lettered row is (``dead_letters.log_dead_lettered``). The log comes when
    the claim returns, also inside a caller's transaction (``run_pending`` in a test).

    ``underserved_only``: lease only flow-controlled rows of the groups (topic, concurrency
    key, fairness key) that hold fewer rows now than the group that holds the most, one
    round of each: the claim of a pump whose slots are full when new work was stored
    (docs/flow-control.md).
    """
    params = {
        "instance_id": instance_id,
        "max_rows": max_rows,
        "lease_seconds": lease_seconds,
        "partition_count": partition_count,
        "categories": list(categories) if categories else None,
        "topics": None if topics is None else json.dumps({c: list(t) for c, t in topics.items()}),
        "topic_prefixes": (
            None
            if topic_prefixes is None
            else json.dumps({c: list(t) for c, t in topic_prefixes.items()})
        ),
        "stale_after_seconds": stale_after_seconds,
        "definitively_dead_after_seconds": definitively_dead_after_seconds,
        "now": now,
        "stream_run_max": stream_run_max,
        "underserved_only": underserved_only,
        "synchronous_commit": None if synchronous_commit or _in_transaction(using) else "off",
    }
    try:
        rows = _claim_rows(params, using)
    except DatabaseError as exc:
        raise (_refused(exc) or exc) from exc
    claimed = [_claimed(row) for row in rows if row["lease_token"] is not None]
    if len(claimed) < len(rows):  # the claim parked rows as dead: each is logged here, once
        log_parked_by_claim(row for row in rows if row["lease_token"] is None)
    return claimed


# Flow control: the claim says, in NOTICEs, when a group a rate held back has a token
# again, and that it took rows of fairness keys. Kept per thread: each claimer thread has
# its own connection.
FLOW_WAIT_NOTICE = "workpump.flow_wait_ms="
FLOW_FAIR_NOTICE = "workpump.flow_fair"
_flow_wait = threading.local()


def flow_wait_ms() -> int | None:
    """Milliseconds until a rate-limited group of the last claim of this thread may start
    a row again (docs/flow-control.md); None when no rate held one back."""
    return getattr(_flow_wait, "ms", None)


def flow_fair() -> bool:
    """Whether the last claim of this thread reached rows of fairness keys: then the
    claimer takes no more than its free slots (docs/flow-control.md)."""
    return getattr(_flow_wait, "fair", False)


def _note_flow_wait(diagnostic: Any) -> None:
    text = diagnostic.message_primary or ""
    if text == FLOW_FAIR_NOTICE:
        _flow_wait.fair = True
    elif text.startswith(FLOW_WAIT_NOTICE):
        try:
            ms = int(text[len(FLOW_WAIT_NOTICE) :])
        except ValueError:
            return
        known = getattr(_flow_wait, "ms", None)
        _flow_wait.ms = ms if known is None else min(known, ms)


def _claim_rows(params: dict[str, Any], using: str | None) -> list[dict[str, Any]]:
    """Run the claim_work query; rows as dicts.

    The claim runs on every wake-up, and cold, the Python around it cost as much as its
    round trip: a new cursor per call copied the adapter maps to set the two loaders
    below. So each connection keeps one cursor for claims, its loaders set once, and
    the claim is a statement prepared once per session (``PREPARED_STATEMENTS``).
    Errors come out as Django's, as from a Django cursor. While Django logs queries
    (``DEBUG``, ``CaptureQueriesContext``) or an execute wrapper is installed (tracing,
    query counting), the claim goes through a Django cursor, as text, so they see it.
    """
    connection = connections[_alias(using)]
    _flow_wait.ms = None
    _flow_wait.fair = False
    if connection.queries_logged or connection.execute_wrappers:
        return _fetch("claim_work", params, using, set_loaders=_claim_loaders)
    connection.close_if_health_check_failed()
    connection.ensure_connection()
    connection.validate_thread_sharing()
    connection.validate_no_broken_transaction()
    with connection.wrap_database_errors:
        held: tuple[Any, Any, list[str]] | None = getattr(
            connection, "_workpump_claim_cursor", None
        )
        if held is None or held[0] is not connection.connection or held[1].closed:
            cursor = connection.create_cursor()  # Django's: its time zone, its binding
            _claim_loaders(cursor.adapters)
            connection.connection.add_notice_handler(_note_flow_wait)
            held = (connection.connection, cursor, [])
            connection._workpump_claim_cursor = held  # type: ignore[attr-defined]
        cursor, columns = held[1], held[2]
        if setting("PREPARED_STATEMENTS"):
            _claim_statement().execute(cursor, params, own_transaction=connection.get_autocommit())
        else:
            cursor.execute(named_queries()["claim_work"], params)
        if not columns:  # the query's columns, read once per cursor
            columns.extend(column.name for column in cursor.description)
        return [dict(zip(columns, row, strict=True)) for row in cursor.fetchall()]


@cache
def _claim_statement() -> PreparedQuery:
    """claim_work's named query as a prepared statement (one per process)."""
    return PreparedQuery(
        "claim_work",
        named_queries()["claim_work"],
        {
            "synchronous_commit": "text",
            "instance_id": "uuid",
            "max_rows": "integer",
            "lease_seconds": "integer",
            "partition_count": "integer",
            "categories": "text[]",
            "stale_after_seconds": "integer",
            "definitively_dead_after_seconds": "integer",
            "now": "timestamptz",
            "topics": "jsonb",
            "topic_prefixes": "jsonb",
            "stream_run_max": "integer",
            "underserved_only": "boolean",
        },
    )


def _claimed(row: Row) -> ClaimedWork:
    # one copy of the row, its JSON texts replaced by what they decode to (a claim
    # builds one per row)
    values = dict(row)
    values["headers"], values["headers_error"] = _headers(row.get("headers"))
    values["checkpoint"] = _checkpoint(row)
    values.pop("last_error", None)  # why a parked row was parked: not a field of work
    text: str = row["payload"]  # the payload's JSON text
    try:
        payload = decode(text)
    except UndecodablePayload as exc:
        payload, values["payload_error"] = {}, str(exc)
    else:
        if not isinstance(payload, dict):  # the producers store objects only
            values["payload_error"] = f"it is a JSON {type(payload).__name__}, not an object"
            payload = {}
    values["payload"] = payload
    return ClaimedWork.from_row(values)


def _checkpoint(row: Row) -> Any:
    """A row's checkpoint from its JSON text. One Python cannot decode (written through
    SQL: ``checkpoint`` stores what ``json`` made) is dropped with a warning: a checkpoint
    only saves work, so the attempt starts from the beginning rather than not at all."""
    text = row.get("checkpoint")
    if text is None:
        return None
    try:
        return decode(text)
    except UndecodablePayload as exc:
        logger.warning(
            "%s %s: its checkpoint cannot be decoded (%s); the attempt starts without it",
            row["category"],
            row["work_id"],
            exc,
            extra={"action": "checkpoint_unreadable"},
        )
        return None


def _headers(text: str | None) -> tuple[dict[str, str] | None, str | None]:
    """A row's headers from their JSON text, and why they could not be read (None when
    they could): the producers store objects of strings, so anything else was written
    through SQL. Headers are metadata (a trace context): the row runs without them."""
    if text is None:
        return None, None
    try:
        headers = decode(text)
    except UndecodablePayload as exc:
        return None, str(exc)
    if not isinstance(headers, dict):
        return None, f"they are a JSON {type(headers).__name__}, not an object"
    return headers, None


def _claim_loaders(adapters: Any) -> None:
    """Set a claim cursor's loaders (``adapters`` is the cursor's own)."""
    # Raw JSON text, decoded row by row by the caller: one payload Python cannot decode
    # must not fail the fetch of its batch-mates.
    adapters.register_loader("jsonb", TextLoader)
    # A claim's rows share one claim time and one lease expiry.
    _parse_timestamps_once(adapters)
