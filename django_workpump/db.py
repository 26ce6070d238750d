"""Typed wrappers around the workpump SQL functions: the only place that runs SQL.

Each wrapper runs one named query of ``sql/queries.sql`` on a Django connection (the
``WORKPUMP['DATABASE_ALIAS']`` one unless ``using`` says otherwise), so it joins the
caller's transaction. ``now`` is for tests only: production lets the database clock rule.
"""

from __future__ import annotations

import dataclasses
import json
import re
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime, timedelta
from functools import cache
from typing import Any, ClassVar, Self

import psycopg
from django.db import DatabaseError, ProgrammingError, connections, transaction
from psycopg.abc import Loader
from psycopg.pq import Format
from psycopg.types.string import TextLoader

from django_workpump.conf import setting
from django_workpump.dead_letters import log_parked_by_claim
from django_workpump.payloads import UndecodablePayload, decode
from django_workpump.prepared import PreparedQuery
from django_workpump.sql import named_queries
from django_workpump.states import OutcomeStatus, WorkState

Row = Mapping[str, Any]  # one result row, by column name


class FromRow:
    """Build a dataclass from a result row by column name, never by position."""

    # The query's column name -> the field's, where they differ.
    COLUMNS: ClassVar[Mapping[str, str]] = {}

    @classmethod
    def from_row(cls, row: Row) -> Self:
        """The instance of ``row``; raise ValueError naming any field no column fills."""
        columns = cls.COLUMNS
        values = (
            {columns.get(column, column): value for column, value in row.items()}
            if columns
            else row
        )
        names, required = _field_names(cls)
        missing = [name for name in required if name not in values]
        if missing:
            raise ValueError(
                f"A {cls.__name__} row has no column for {', '.join(missing)} (columns: "
                f"{', '.join(row)}); the query and the dataclass must name the same fields."
            )
        return cls(**{name: values[name] for name in names if name in values})


@cache
def _field_names(cls: type) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(every field, the fields without a default) of a FromRow dataclass; claims build
    one per row, and ``dataclasses.fields`` is not free."""
    fields = dataclasses.fields(cls)
    required = tuple(
        field.name
        for field in fields
        if field.default is dataclasses.MISSING and field.default_factory is dataclasses.MISSING
    )
    return tuple(field.name for field in fields), required


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


@dataclass(frozen=True)
class Outcome(FromRow):
    """What ``complete_work``/``fail_work``/``release_work`` did with one id."""

    work_id: uuid.UUID
    status: OutcomeStatus
    scheduled_for: datetime | None = None

    def __post_init__(self) -> None:
        # The SQL returns plain text: hold the member (ValueError for an unknown word).
        object.__setattr__(self, "status", OutcomeStatus(self.status))


# SQLSTATE of claim_work and renew_leases refusing an evicted or unregistered instance.
INSTANCE_REFUSED_SQLSTATE = "WP001"


class InstanceRefused(Exception):
    """The database refused this instance (evicted or not registered): it must stop."""


def _refused(exc: DatabaseError) -> InstanceRefused | None:
    """The InstanceRefused a database error stands for, or None for any other error."""
    if getattr(exc.__cause__, "sqlstate", None) != INSTANCE_REFUSED_SQLSTATE:
        return None
    diagnostic = getattr(exc.__cause__, "diag", None)
    message = getattr(diagnostic, "message_primary", None) or str(exc).strip()
    return InstanceRefused(message)


def _alias(using: str | None) -> str:
    return using or setting("DATABASE_ALIAS")


@cache
def _placeholders(name: str) -> frozenset[str]:
    return frozenset(re.findall(r"%\((\w+)\)s", named_queries()[name]))


def _fetch(
    name: str,
    params: dict[str, Any],
    using: str | None,
    *,
    set_loaders: Callable[[Any], None] | None = None,
) -> list[dict[str, Any]]:
    """Run named query ``name`` with exactly the parameters it names; rows as dicts.

    ``set_loaders`` gets the cursor's adapters before the query runs.
    """
    expected = _placeholders(name)
    if set(params) != expected:
        raise TypeError(
            f"Query {name!r} takes the parameters {sorted(expected)}, not {sorted(params)}."
        )
    with connections[_alias(using)].cursor() as cursor:
        if set_loaders is not None:
            set_loaders(cursor.cursor.adapters)
        cursor.execute(named_queries()[name], params)
        columns = [column.name for column in cursor.description]
        return [dict(zip(columns, row, strict=True)) for row in cursor.fetchall()]


def _claim_loaders(adapters: Any) -> None:
    """Set a claim cursor's loaders (``adapters`` is the cursor's own)."""
    # Raw JSON text, decoded row by row by the caller: one payload Python cannot decode
    # must not fail the fetch of its batch-mates.
    adapters.register_loader("jsonb", TextLoader)
    # A claim's rows share one claim time and one lease expiry.
    _parse_timestamps_once(adapters)


class StoredTime(str):
    """A stored time Python's datetime cannot hold ('infinity', past year 9999), as the
    text PostgreSQL gives for it. Readers show it as stored rather than fail the page,
    report or batch it is in."""


def _readable_times(adapters: Any) -> None:
    """Make a cursor's timestamptz loader (Django's, with the connection's time zone)
    give a ``StoredTime`` for a value Python cannot hold; ``adapters`` is the cursor's own."""
    oid = adapters.types["timestamptz"].oid
    base = adapters.get_loader(oid, Format.TEXT)
    if base is not None and not issubclass(base, _Tolerant):
        adapters.register_loader(oid, _tolerant_loader(base))


class _Tolerant:
    """Marks a loader made by ``_tolerant_loader``."""


@cache
def _tolerant_loader(base: type[Loader]) -> type[Loader]:
    class Tolerant(_Tolerant, base):  # type: ignore[valid-type,misc]
        def load(self, data: Any) -> Any:
            try:
                return super().load(data)
            except psycopg.DataError:  # too large or too small for a datetime
                return StoredTime(bytes(data).decode("utf-8", "replace"))

    return Tolerant


@contextmanager
def stored_times_readable(*, using: str | None = None) -> Iterator[None]:
    """Inside, every query on the connection reads a time Python cannot hold as a
    ``StoredTime`` instead of failing (the admin's pages: rows written through SQL)."""

    def wrapper(execute: Any, sql: Any, params: Any, many: bool, context: Any) -> Any:
        _readable_times(context["cursor"].cursor.adapters)
        return execute(sql, params, many, context)

    with connections[_alias(using)].execute_wrapper(wrapper):
        yield


def _parse_timestamps_once(adapters: Any) -> None:
    """Make a cursor's timestamptz loader (Django's, with the connection's time zone)
    parse each distinct value once per result; ``adapters`` is the cursor's own."""
    oid = adapters.types["timestamptz"].oid
    base = adapters.get_loader(oid, Format.TEXT)
    if base is not None:
        adapters.register_loader(oid, _once_loader(base))


# Distinct timestamps a ParsedOnce loader remembers at most (a claim's rows share two).
PARSED_ONCE_MAX = 256


@cache
def _once_loader(base: type[Loader]) -> type[Loader]:
    class ParsedOnce(base):  # type: ignore[valid-type,misc]
        """``base``, remembering what it parsed (a loader lives as long as its cursor's
        result, or its query on a kept cursor; datetimes are immutable, so rows may
        share one)."""

        def __init__(self, oid: int, context: Any = None) -> None:
            super().__init__(oid, context)
            self._parsed: dict[bytes, Any] = {}

        def load(self, data: Any) -> Any:
            key = bytes(data)
            value = self._parsed.get(key)
            if value is None:
                if len(self._parsed) >= PARSED_ONCE_MAX:
                    self._parsed.clear()  # a cursor kept for many results (claims)
                try:
                    value = self._parsed[key] = super().load(data)
                except psycopg.DataError:
                    # A time Python cannot hold ('infinity', past year 9999), written
                    # through SQL: unknown for its row (created_at, due_at), not an
                    # error for the batch.
                    return None
            return value

    return ParsedOnce


def _column(rows: list[dict[str, Any]], column: str) -> list[Any]:
    return [row[column] for row in rows]


@contextmanager
def without_jit(*, using: str | None = None) -> Iterator[None]:
    """A transaction whose queries PostgreSQL does not JIT-compile (``SET LOCAL jit = off``).

    For the admin's pages and the status report: short interactive queries that the
    planner may cost past ``jit_above_cost`` (the per-row liveness and stuck rules), where
    compiling takes longer than running. The setting ends with the transaction; inside
    a caller's transaction (ATOMIC_REQUESTS, a test) it lasts until that one ends, and
    no savepoint is made: an error inside is the caller's to handle, as without this.
    """
    connection = connections[_alias(using)]
    if connection.in_atomic_block:
        with connection.cursor() as cursor:
            cursor.execute("SET LOCAL jit = off")
        yield
        return
    with transaction.atomic(using=connection.alias):
        with connection.cursor() as cursor:
            cursor.execute("SET LOCAL jit = off")
        yield


def fetch_named(
    path: str, name: str, params: dict[str, Any] | None = None, *, using: str | None = None
) -> list[dict[str, Any]]:
    """Run query ``name`` of ``sql/<path>`` (a read-only report query); rows as dicts."""
    with connections[_alias(using)].cursor() as cursor:
        _readable_times(cursor.cursor.adapters)
        cursor.execute(named_queries(path)[name], params or {})
        columns = [column.name for column in cursor.description]
        return [dict(zip(columns, row, strict=True)) for row in cursor.fetchall()]


def explain_arms(
    path: str, name: str, params: dict[str, Any] | None = None, *, using: str | None = None
) -> list[int]:
    """The planner's row estimate of each arm of query ``name`` of ``sql/<path>``, a
    UNION ALL (EXPLAIN, not run): one number per arm, in the query's order; empty when
    the plan is not one Append of them. Planned without parallel workers, whose Parallel
    Append would reorder the arms (SET LOCAL: the caller's transaction, or one of its own)."""
    connection = connections[_alias(using)]
    with (
        transaction.atomic(using=connection.alias, savepoint=False),
        connection.cursor() as cursor,
    ):
        cursor.execute("SET LOCAL max_parallel_workers_per_gather = 0")
        cursor.execute("EXPLAIN (FORMAT JSON) " + named_queries(path)[name], params or {})
        (plan,) = cursor.fetchone()
    plan = json.loads(plan) if isinstance(plan, str) else plan
    top = plan[0]["Plan"]
    if top["Node Type"] != "Append":
        return []
    return [int(arm["Plan Rows"]) for arm in top["Plans"]]


def _scalar(name: str, params: dict[str, Any], using: str | None) -> Any:
    """The value of a query that returns one row of one column."""
    rows = _fetch(name, params, using)
    (value,) = rows[0].values()
    return value


def send(
    *,
    destination: str,
    payload_json: str,
    stream: str | None,
    priority: int,
    scheduled_for: datetime | None,
    max_attempts: int,
    message_id: uuid.UUID | None,
    partition_count: int,
    max_payload_bytes: int,
    max_payload_depth: int,
    unique_key: str | None = None,
    unique_for: timedelta | None = None,
    headers_json: str | None = None,
    using: str | None = None,
) -> uuid.UUID:
    """Store an outbox row; with ``unique_key``, the id of the row holding it if any."""
    params = {
        "destination": destination,
        "payload": payload_json,
        "stream": stream,
        "priority": priority,
        "scheduled_for": scheduled_for,
        "max_attempts": max_attempts,
        "message_id": message_id,
        "partition_count": partition_count,
        "max_payload_bytes": max_payload_bytes,
        "max_payload_depth": max_payload_depth,
        "unique_key": unique_key,
        "unique_for": unique_for,
        "headers": headers_json,
    }
    return _scalar("send", params, using)


def send_many(
    *,
    destination: str,
    payloads_json: Sequence[str],
    streams: Sequence[str | None] | None,
    priority: int,
    scheduled_for: datetime | None,
    max_attempts: int,
    message_ids: Sequence[uuid.UUID] | None,
    partition_count: int,
    max_payload_bytes: int,
    max_payload_depth: int,
    using: str | None = None,
) -> list[uuid.UUID]:
    """Store one outbox row per payload, in list order, in one statement; their ids."""
    params = {
        "destination": destination,
        "payloads": "[" + ",".join(payloads_json) + "]",
        "streams": None if streams is None else json.dumps(list(streams)),
        "priority": priority,
        "scheduled_for": scheduled_for,
        "max_attempts": max_attempts,
        "message_ids": None if message_ids is None else list(message_ids),
        "partition_count": partition_count,
        "max_payload_bytes": max_payload_bytes,
        "max_payload_depth": max_payload_depth,
    }
    return list(_scalar("send_many", params, using))


def emit_many(
    *,
    event_type: str,
    payloads_json: Sequence[str],
    streams: Sequence[str | None] | None,
    subscribers_json: str,
    event_ids: Sequence[uuid.UUID] | None,
    priority: int,
    partition_count: int,
    max_payload_bytes: int,
    max_payload_depth: int,
    using: str | None = None,
) -> list[uuid.UUID]:
    """Store one event per payload and its work, in list order, in one statement."""
    params = {
        "event_type": event_type,
        "payloads": "[" + ",".join(payloads_json) + "]",
        "streams": None if streams is None else json.dumps(list(streams)),
        "subscribers": subscribers_json,
        "event_ids": None if event_ids is None else list(event_ids),
        "priority": priority,
        "partition_count": partition_count,
        "max_payload_bytes": max_payload_bytes,
        "max_payload_depth": max_payload_depth,
    }
    return list(_scalar("emit_many", params, using))


@dataclass(frozen=True, slots=True)
class Received(FromRow):
    """What ``receive`` did: ``stored`` (False: a duplicate) and the row's ``created_at``."""

    stored: bool
    created_at: datetime


def receive(
    *,
    message_id: uuid.UUID,
    handler_name: str,
    payload_json: str,
    stream: str | None,
    priority: int,
    scheduled_for: datetime | None,
    max_attempts: int,
    partition_count: int,
    max_payload_bytes: int,
    max_payload_depth: int,
    deduplicate: bool = True,
    unique_key: str | None = None,
    unique_for: timedelta | None = None,
    headers_json: str | None = None,
    using: str | None = None,
) -> Received:
    params = {
        "message_id": message_id,
        "handler_name": handler_name,
        "payload": payload_json,
        "stream": stream,
        "priority": priority,
        "scheduled_for": scheduled_for,
        "max_attempts": max_attempts,
        "partition_count": partition_count,
        "max_payload_bytes": max_payload_bytes,
        "max_payload_depth": max_payload_depth,
        "deduplicate": deduplicate,
        "unique_key": unique_key,
        "unique_for": unique_for,
        "headers": headers_json,
    }
    return Received.from_row(_fetch("receive", params, using)[0])


def emit(
    *,
    event_type: str,
    payload_json: str,
    stream: str | None,
    subscribers_json: str,
    event_id: uuid.UUID | None,
    priority: int,
    partition_count: int,
    max_payload_bytes: int,
    max_payload_depth: int,
    unique_key: str | None = None,
    unique_for: timedelta | None = None,
    headers_json: str | None = None,
    using: str | None = None,
) -> uuid.UUID:
    """Store an event and its work; with ``unique_key``, the id of the event holding it."""
    params = {
        "event_type": event_type,
        "payload": payload_json,
        "stream": stream,
        "subscribers": subscribers_json,
        "event_id": event_id,
        "priority": priority,
        "partition_count": partition_count,
        "max_payload_bytes": max_payload_bytes,
        "max_payload_depth": max_payload_depth,
        "unique_key": unique_key,
        "unique_for": unique_for,
        "headers": headers_json,
    }
    return _scalar("emit", params, using)


def unique_key_holder(
    *,
    kind: str,
    topic: str,
    unique_key: str,
    unique_for: timedelta | None,
    using: str | None = None,
) -> uuid.UUID | None:
    """The id of the outbox row, inbox row or event (``kind``) holding the key, if any."""
    params = {"kind": kind, "topic": topic, "unique_key": unique_key, "unique_for": unique_for}
    return _scalar("unique_key_holder", params, using)


def sync_subscriptions(*, subscriptions_json: str, replace: bool, using: str | None = None) -> int:
    """Upsert the registry's subscriptions (``replace``: delete all others)."""
    params = {"subscriptions": subscriptions_json, "replace": replace}
    return int(_scalar("sync_subscriptions", params, using))


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
    if connection.queries_logged or connection.execute_wrappers:
        return _fetch("claim_work", params, using, set_loaders=_claim_loaders)
    connection.close_if_health_check_failed()
    connection.ensure_connection()
    connection.validate_thread_sharing()
    connection.validate_no_broken_transaction()
    with connection.wrap_database_errors:
        held = getattr(connection, "_workpump_claim_cursor", None)
        if held is None or held[0] is not connection.connection or held[1].closed:
            cursor = connection.create_cursor()  # Django's: its time zone, its binding
            _claim_loaders(cursor.adapters)
            held = connection._workpump_claim_cursor = (connection.connection, cursor, [])
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
        },
    )


def _in_transaction(using: str | None) -> bool:
    """True inside a transaction the caller opened (a statement then is not its own):
    ``atomic()`` turns autocommit off, and so may the caller."""
    return not connections[_alias(using)].get_autocommit()


def _claimed(row: Row) -> ClaimedWork:
    headers, headers_error = _headers(row.get("headers"))
    row = {**row, "headers": headers, "headers_error": headers_error}
    text: str = row["payload"]  # the payload's JSON text
    try:
        payload = decode(text)
    except UndecodablePayload as exc:
        return ClaimedWork.from_row({**row, "payload": {}, "payload_error": str(exc)})
    if not isinstance(payload, dict):  # the producers store objects only
        error = f"it is a JSON {type(payload).__name__}, not an object"
        return ClaimedWork.from_row({**row, "payload": {}, "payload_error": error})
    return ClaimedWork.from_row({**row, "payload": payload})


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
    now: datetime | None = None,
    using: str | None = None,
) -> list[Outcome]:
    """Complete; ``results`` are JSON texts (or None), one per id."""
    params = {
        "instance_id": instance_id,
        "category": category,
        "ids": list(ids),
        "lease_tokens": list(lease_tokens),
        "results": list(results) if results else None,
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
    now: datetime | None = None,
    using: str | None = None,
) -> list[Outcome]:
    """Fail attempts; ``retry_delays`` (one per id, None for the default backoff) are a
    handler's own retry delays in seconds."""
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
    now: datetime | None = None,
    using: str | None = None,
) -> list[Outcome]:
    """End held rows as discarded, each with its reason."""
    params = {
        "instance_id": instance_id,
        "category": category,
        "ids": list(ids),
        "lease_tokens": list(lease_tokens),
        "reasons": list(reasons),
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


def purge_evictions(*, retention_seconds: int, using: str | None = None) -> int:
    return int(_scalar("purge_evictions", {"retention_seconds": retention_seconds}, using))


def purge_idle_streams(*, batch: int, using: str | None = None) -> int:
    return int(_scalar("purge_idle_streams", {"batch": batch}, using))


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


# -- on the NOTIFY gate's own psycopg connection (not Django's) ------------------------


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


def evict_instance(
    *, instance_id: uuid.UUID, reason: str = "evicted by an operator", using: str | None = None
) -> int:
    """Evict one instance now (operator action); return the number of rows released."""
    params = {"instance_id": instance_id, "reason": reason}
    return int(_scalar("evict_instance", params, using))


# -- periodic schedules (their functions in sql/schema.sql) -------------------------------


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


# -- operator actions (django_workpump.actions) --------------------------------------


@dataclass(frozen=True)
class SelectedWork(FromRow):
    """A work row as an operator selects it."""

    COLUMNS = {"id": "work_id"}

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

    COLUMNS = {"id": "work_id"}

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

    COLUMNS = {"id": "work_id"}

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
