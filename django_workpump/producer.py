"""Producing work: ``send``, ``receive``, ``emit``.

Each call writes through the Django connection of ``WORKPUMP['DATABASE_ALIAS']`` (or
``using``), so it commits or rolls back with the caller's transaction. Bad input is
refused here, before anything is written, with an error that names the fix.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from datetime import datetime, timedelta
from typing import Any

from django.core.exceptions import ImproperlyConfigured
from django.db import ProgrammingError, transaction

from django_workpump import db, tracing
from django_workpump.conf import setting
from django_workpump.payloads import MAX_DEPTH
from django_workpump.producer_validation import (
    InvalidWork,
    checked_bulk_lists,
    checked_flow_key,
    checked_headers,
    checked_max_attempts,
    checked_name,
    checked_priority,
    checked_run_after,
    checked_stream_key,
    checked_unique,
    each_checked,
    headers_json,
    payload_json,
    payloads_json,
)
from django_workpump.registry import registry
from django_workpump.workflows import Batch, batch_id_for

# Called after commit of produced work, with its category (the in-process pump wakes).
_on_commit_listeners: list[Callable[[str], None]] = []


class Duplicate(Exception):
    """Work refused because another row holds its unique key (``on_conflict="raise"``)."""

    def __init__(self, message: str, holder_id: uuid.UUID) -> None:
        super().__init__(message)
        self.holder_id = holder_id


def add_produced_listener(listener: Callable[[str], None]) -> None:
    """Call ``listener(category)`` after each commit that produced work of this process."""
    _on_commit_listeners.append(listener)


def remove_produced_listener(listener: Callable[[str], None]) -> None:
    if listener in _on_commit_listeners:
        _on_commit_listeners.remove(listener)


# Listeners of django_workpump.testing.captured(): told of every send, receive and emit.
capture_listeners: list[Callable[..., None]] = []


def _tell_capture(kind: str, topic: str, payload: Any, stream: Any, id: Any) -> None:
    for listener in list(capture_listeners):
        listener(
            kind=kind,
            topic=topic,
            payload=payload,
            stream=None if stream is None else str(stream),
            id=id,
        )


def _announce(category: str, using: str) -> None:
    if not _on_commit_listeners:
        return

    def fire() -> None:
        for listener in list(_on_commit_listeners):
            listener(category)

    transaction.on_commit(fire, using=using)


# SQLSTATEs of a database the workpump migrations have not reached: no schema workpump,
# or not its current functions.
_SCHEMA_MISSING = {"3F000", "42883"}


@contextmanager
def _schema_required(alias: str) -> Iterator[None]:
    """Turn "schema workpump does not exist" into a sentence that says what to run."""
    try:
        yield
    except ProgrammingError as exc:
        if getattr(exc.__cause__, "sqlstate", None) not in _SCHEMA_MISSING:
            raise
        raise ImproperlyConfigured(
            f"The database {alias!r} lacks the workpump schema (or its current version): run "
            "`python manage.py migrate` before producing work."
        ) from exc


def _duplicate(holder: str, key: str, holder_id: uuid.UUID, on_conflict: str) -> uuid.UUID:
    """The holder's id, or Duplicate when the caller asked for it."""
    if on_conflict == "raise":
        raise Duplicate(
            f"{holder} already holds unique_key {key!r} in {holder_id}; nothing was written. "
            "Pass on_conflict='return' to get the holder's id instead.",
            holder_id,
        )
    return holder_id


# What holds a unique key, by the producer that takes it.
UNIQUE_KINDS = ("outbox", "inbox", "event")


def unique_key_holder(
    kind: str,
    topic: str,
    unique_key: str,
    unique_for: timedelta | None = None,
    *,
    using: str | None = None,
) -> uuid.UUID | None:
    """The id of the outbox row, inbox row or event (``kind``) holding ``unique_key`` now."""
    if kind not in UNIQUE_KINDS:
        raise ValueError(f"kind must be one of {', '.join(UNIQUE_KINDS)}, not {kind!r}.")
    alias = using or setting("DATABASE_ALIAS")
    with _schema_required(alias):
        return db.unique_key_holder(
            kind=kind, topic=topic, unique_key=unique_key, unique_for=unique_for, using=alias
        )


def send(
    destination: str,
    payload: Mapping[str, Any],
    *,
    stream: str | int | uuid.UUID | None = None,
    priority: int = 0,
    run_after: datetime | None = None,
    max_attempts: int | None = None,
    message_id: uuid.UUID | None = None,
    unique_key: str | None = None,
    unique_for: timedelta | None = None,
    on_conflict: str = "return",
    headers: Mapping[str, str] | None = None,
    batch: Batch | uuid.UUID | None = None,
    after: Iterable[uuid.UUID | str] | None = None,
    after_policy: str = "cancel",
    concurrency_key: str | None = None,
    fairness_key: str | None = None,
    using: str | None = None,
) -> uuid.UUID:
    """Store an outbox message for ``destination`` in the current transaction.

    ``batch`` (default: the open ``with workpump.batch()``) makes it a member of that
    batch. ``after`` (ids of outbox rows) keeps it unclaimable until every one of them is
    done; one that ends dead, discarded or cancelled cancels it (``after_policy="cancel"``)
    or not (``"run"``). See docs/workflows.md.

    With ``unique_key``, at most one unprocessed message per (destination, key) exists
    (with ``unique_for``, also none created within that window): a duplicate writes
    nothing and returns the holder's id, or raises ``Duplicate`` (``on_conflict="raise"``).
    ``headers`` (str to str) are stored with the row and given to its handler as
    ``work.headers``; with tracing on they carry the producer span's context.
    ``concurrency_key`` (e.g. ``"partner:acme"``) and ``fairness_key`` (e.g. the tenant)
    put the row under flow control (docs/flow-control.md).
    """
    destination = checked_name("outbox destination", destination)
    what = f"outbox message to {destination!r}"
    key, window = checked_unique(what, unique_key, unique_for, on_conflict)
    given = checked_headers(what, headers)
    stream_key = checked_stream_key(what, stream)
    if key is not None and message_id is None:
        message_id = uuid.uuid4()  # a returned id that differs names the holder
    alias = using or setting("DATABASE_ALIAS")
    with (
        tracing.producing("send", "outbox", destination, stream=stream_key, headers=given) as out,
        _schema_required(alias),
    ):
        result = db.send(
            destination=destination,
            payload_json=payload_json(what, payload),
            stream=stream_key,
            priority=checked_priority(what, priority),
            scheduled_for=checked_run_after(what, run_after),
            max_attempts=checked_max_attempts("outbox", destination, max_attempts),
            message_id=message_id,
            partition_count=setting("PARTITION_COUNT"),
            max_payload_bytes=setting("MAX_PAYLOAD_BYTES"),
            max_payload_depth=MAX_DEPTH,
            unique_key=key,
            unique_for=window,
            headers_json=headers_json(what, out.headers),
            batch_id=batch_id_for(batch, alias),
            after=_after_ids(what, after),
            after_policy=after_policy,
            concurrency_key=checked_flow_key(what, "concurrency_key", concurrency_key),
            fairness_key=checked_flow_key(what, "fairness_key", fairness_key),
            using=alias,
        )
        out.stored(result)
        if key is not None and result != message_id:  # Duplicate fails the span too
            return _duplicate(f"Outbox destination {destination!r}", key, result, on_conflict)
    _announce("outbox", alias)
    _tell_capture("send", destination, payload, stream, result)
    return result


def receive(
    message_id: uuid.UUID | str,
    handler_name: str,
    payload: Mapping[str, Any],
    *,
    stream: str | int | uuid.UUID | None = None,
    priority: int = 0,
    run_after: datetime | None = None,
    max_attempts: int | None = None,
    deduplicate: bool = True,
    unique_key: str | None = None,
    unique_for: timedelta | None = None,
    on_conflict: str = "return",
    headers: Mapping[str, str] | None = None,
    concurrency_key: str | None = None,
    fairness_key: str | None = None,
    using: str | None = None,
) -> bool:
    """Store an inbox message once per ``message_id``; False if it was received before.

    Ids are remembered for ``INBOX_DEDUP_RETENTION_SECONDS`` after their row is purged.
    ``deduplicate=False`` writes no de-duplication record, for ids that are fresh UUIDs
    (a repeated id then raises ``IntegrityError``). With ``unique_key``, also False while
    another unprocessed message for ``handler_name`` holds the key (with ``unique_for``,
    also one created within that window), or ``Duplicate`` with ``on_conflict="raise"``.
    ``headers`` are stored with the row, as for ``send``.
    """
    return receive_stamped(
        message_id,
        handler_name,
        payload,
        stream=stream,
        priority=priority,
        run_after=run_after,
        max_attempts=max_attempts,
        deduplicate=deduplicate,
        unique_key=unique_key,
        unique_for=unique_for,
        on_conflict=on_conflict,
        headers=headers,
        concurrency_key=concurrency_key,
        fairness_key=fairness_key,
        using=using,
    ).stored


def receive_stamped(
    message_id: uuid.UUID | str,
    handler_name: str,
    payload: Mapping[str, Any],
    *,
    stream: str | int | uuid.UUID | None = None,
    priority: int = 0,
    run_after: datetime | None = None,
    max_attempts: int | None = None,
    deduplicate: bool = True,
    unique_key: str | None = None,
    unique_for: timedelta | None = None,
    on_conflict: str = "return",
    headers: Mapping[str, str] | None = None,
    concurrency_key: str | None = None,
    fairness_key: str | None = None,
    using: str | None = None,
) -> db.Received:
    """``receive``, also returning the stored row's ``created_at`` from the same statement
    (``.stored`` is what ``receive`` returns; ``.created_at`` is meaningful when stored)."""
    handler_name = checked_name("inbox handler name", handler_name)
    what = f"inbox message for {handler_name!r}"
    key, window = checked_unique(what, unique_key, unique_for, on_conflict)
    given = checked_headers(what, headers)
    stream_key = checked_stream_key(what, stream)
    try:
        message_uuid = message_id if isinstance(message_id, uuid.UUID) else uuid.UUID(message_id)
    except (TypeError, ValueError, AttributeError) as exc:
        raise InvalidWork(
            f"The message id of {what} must be a UUID (or its string), not {message_id!r}."
        ) from exc
    alias = using or setting("DATABASE_ALIAS")
    with (
        tracing.producing(
            "receive", "inbox", handler_name, stream=stream_key, headers=given
        ) as out,
        _schema_required(alias),
    ):
        out.stored(message_uuid)
        received = db.receive(
            message_id=message_uuid,
            handler_name=handler_name,
            payload_json=payload_json(what, payload),
            stream=stream_key,
            priority=checked_priority(what, priority),
            scheduled_for=checked_run_after(what, run_after),
            max_attempts=checked_max_attempts("inbox", handler_name, max_attempts),
            partition_count=setting("PARTITION_COUNT"),
            max_payload_bytes=setting("MAX_PAYLOAD_BYTES"),
            max_payload_depth=MAX_DEPTH,
            deduplicate=deduplicate,
            unique_key=key,
            unique_for=window,
            headers_json=headers_json(what, out.headers),
            concurrency_key=checked_flow_key(what, "concurrency_key", concurrency_key),
            fairness_key=checked_flow_key(what, "fairness_key", fairness_key),
            using=alias,
        )
    if not received.stored and key is not None and on_conflict == "raise":
        holder = unique_key_holder("inbox", handler_name, key, window, using=alias)
        if holder is not None and holder != message_uuid:
            _duplicate(f"Inbox handler {handler_name!r}", key, holder, on_conflict)
    if received.stored:
        _announce("inbox", alias)
        _tell_capture("receive", handler_name, payload, stream, message_uuid)
    return received


def _subscribers(event_type: str) -> tuple[list[dict[str, Any]], list[str]]:
    """The registered subscribers of ``event_type`` as the SQL emit takes them, and the
    categories their work lands in (each told once the event commits)."""
    handlers = registry.subscribers(event_type)
    rows = [
        {
            "category": handler.category,
            "name": handler.topic,
            "max_attempts": checked_max_attempts(handler.category, handler.topic, None),
        }
        for handler in handlers
    ]
    return rows, sorted({handler.category for handler in handlers})


def emit(
    event_type: str,
    payload: Mapping[str, Any],
    *,
    stream: str | int | uuid.UUID | None = None,
    priority: int = 0,
    event_id: uuid.UUID | None = None,
    unique_key: str | None = None,
    unique_for: timedelta | None = None,
    on_conflict: str = "return",
    headers: Mapping[str, str] | None = None,
    concurrency_key: str | None = None,
    fairness_key: str | None = None,
    using: str | None = None,
) -> uuid.UUID:
    """Store an event and one work row per perspective and receptor subscribed to it.

    With ``unique_key``, at most one event per (event type, key) has work not yet done
    (with ``unique_for``, also none created within that window): a duplicate writes
    nothing and returns the holder's id, or raises ``Duplicate`` (``on_conflict="raise"``).
    ``headers`` are stored with every subscriber's row, as for ``send``.
    """
    event_type = checked_name("event type", event_type)
    what = f"event {event_type!r}"
    key, window = checked_unique(what, unique_key, unique_for, on_conflict)
    given = checked_headers(what, headers)
    stream_key = checked_stream_key(what, stream)
    if key is not None and event_id is None:
        event_id = uuid.uuid4()  # a returned id that differs names the holder
    subscribers, categories = _subscribers(event_type)
    alias = using or setting("DATABASE_ALIAS")
    with (
        tracing.producing("emit", "event", event_type, stream=stream_key, headers=given) as out,
        _schema_required(alias),
    ):
        result = db.emit(
            event_type=event_type,
            payload_json=payload_json(what, payload),
            stream=stream_key,
            subscribers_json=json.dumps(subscribers),
            event_id=event_id,
            priority=checked_priority(what, priority),
            partition_count=setting("PARTITION_COUNT"),
            max_payload_bytes=setting("MAX_PAYLOAD_BYTES"),
            max_payload_depth=MAX_DEPTH,
            unique_key=key,
            unique_for=window,
            headers_json=headers_json(what, out.headers),
            concurrency_key=checked_flow_key(what, "concurrency_key", concurrency_key),
            fairness_key=checked_flow_key(what, "fairness_key", fairness_key),
            using=alias,
        )
        out.stored(result)
        if key is not None and result != event_id:  # Duplicate fails the span too
            return _duplicate(f"Event type {event_type!r}", key, result, on_conflict)
    for category in categories:
        _announce(category, alias)
    _tell_capture("emit", event_type, payload, stream, result)
    return result


# Rows per statement of send_many and emit_many: one round trip per chunk, each chunk
# small enough that its arrays stay a few megabytes at typical payload sizes.
BULK_CHUNK_ROWS = 5000


def _after_ids(what: str, after: Iterable[uuid.UUID | str] | None) -> list[uuid.UUID] | None:
    if after is None:
        return None
    if isinstance(after, (str, uuid.UUID)):
        raise TypeError(f"after= of the {what} takes a list of ids, not one id.")
    try:
        return [uuid.UUID(str(item)) for item in after]
    except ValueError as error:
        raise ValueError(f"after= of the {what} takes work ids (UUIDs): {error}") from None


def _chunks(count: int, size: int) -> Iterator[slice]:
    for start in range(0, count, size):
        yield slice(start, start + size)


def send_many(
    destination: str,
    payloads: Iterable[Mapping[str, Any]],
    *,
    streams: Iterable[str | int | uuid.UUID | None] | None = None,
    priority: int = 0,
    run_after: datetime | None = None,
    max_attempts: int | None = None,
    batch: Batch | uuid.UUID | None = None,
    concurrency_key: str | None = None,
    fairness_key: str | None = None,
    using: str | None = None,
) -> list[uuid.UUID]:
    """Store one outbox message for ``destination`` per payload, in the current transaction.

    ``batch`` (default: the open ``with workpump.batch()``) makes each a member of it.

    One statement per chunk of ``BULK_CHUNK_ROWS`` rows. ``streams`` is None or a list
    parallel to ``payloads`` (None entries: no ordering); within a stream the messages
    keep list order after anything already sent. Every payload is checked as ``send``
    checks it, before anything is written: one bad payload refuses the whole call.
    Returns the message ids in list order.
    """
    destination = checked_name("outbox destination", destination)
    what = f"send_many to {destination!r}"
    payloads, streams = checked_bulk_lists(what, payloads, streams)

    def noun(index: int) -> str:
        return f"outbox message {index} to {destination!r}"

    texts = payloads_json(noun, payloads)
    keys = None if streams is None else each_checked(checked_stream_key, noun, streams)
    priority = checked_priority(what, priority)
    scheduled_for = checked_run_after(what, run_after)
    max_attempts = checked_max_attempts("outbox", destination, max_attempts)
    ckey = checked_flow_key(what, "concurrency_key", concurrency_key)
    fkey = checked_flow_key(what, "fairness_key", fairness_key)
    if not texts:
        return []
    alias = using or setting("DATABASE_ALIAS")
    ids: list[uuid.UUID] = []
    with _schema_required(alias), transaction.atomic(using=alias):
        for part in _chunks(len(texts), BULK_CHUNK_ROWS):
            ids += db.send_many(
                destination=destination,
                payloads_json=texts[part],
                streams=None if keys is None else keys[part],
                priority=priority,
                scheduled_for=scheduled_for,
                max_attempts=max_attempts,
                message_ids=None,
                partition_count=setting("PARTITION_COUNT"),
                max_payload_bytes=setting("MAX_PAYLOAD_BYTES"),
                max_payload_depth=MAX_DEPTH,
                batch_id=batch_id_for(batch, alias),
                concurrency_key=ckey,
                fairness_key=fkey,
                using=alias,
            )
    _announce("outbox", alias)
    if capture_listeners:
        for index, payload in enumerate(payloads):
            stream = None if streams is None else streams[index]
            _tell_capture("send", destination, payload, stream, ids[index])
    return ids


def emit_many(
    event_type: str,
    payloads: Iterable[Mapping[str, Any]],
    *,
    streams: Iterable[str | int | uuid.UUID | None] | None = None,
    priority: int = 0,
    concurrency_key: str | None = None,
    fairness_key: str | None = None,
    using: str | None = None,
) -> list[uuid.UUID]:
    """Store one event of ``event_type`` per payload and its work, in the current transaction.

    As ``emit`` for each payload, in list order, one statement per chunk of events whose
    work rows number at most ``BULK_CHUNK_ROWS``; ``streams`` as in ``send_many``.
    Returns the event ids in list order.
    """
    event_type = checked_name("event type", event_type)
    what = f"emit_many of event {event_type!r}"
    payloads, streams = checked_bulk_lists(what, payloads, streams)

    def noun(index: int) -> str:
        return f"event {index} of type {event_type!r}"

    texts = payloads_json(noun, payloads)
    keys = None if streams is None else each_checked(checked_stream_key, noun, streams)
    priority = checked_priority(what, priority)
    subscribers, categories = _subscribers(event_type)
    ckey = checked_flow_key(what, "concurrency_key", concurrency_key)
    fkey = checked_flow_key(what, "fairness_key", fairness_key)
    if not texts:
        return []
    alias = using or setting("DATABASE_ALIAS")
    per_chunk = max(1, BULK_CHUNK_ROWS // max(1, len(subscribers)))
    ids: list[uuid.UUID] = []
    with _schema_required(alias), transaction.atomic(using=alias):
        for part in _chunks(len(texts), per_chunk):
            ids += db.emit_many(
                event_type=event_type,
                payloads_json=texts[part],
                streams=None if keys is None else keys[part],
                subscribers_json=json.dumps(subscribers),
                event_ids=None,
                priority=priority,
                partition_count=setting("PARTITION_COUNT"),
                max_payload_bytes=setting("MAX_PAYLOAD_BYTES"),
                max_payload_depth=MAX_DEPTH,
                concurrency_key=ckey,
                fairness_key=fkey,
                using=alias,
            )
    for category in categories:
        _announce(category, alias)
    if capture_listeners:
        for index, payload in enumerate(payloads):
            stream = None if streams is None else streams[index]
            _tell_capture("emit", event_type, payload, stream, ids[index])
    return ids
