"""Producing work: ``send``, ``receive``, ``emit``.

Each call writes through the Django connection of ``WORKPUMP['DATABASE_ALIAS']`` (or
``using``), so it commits or rolls back with the caller's transaction. Bad input is
refused here, before anything is written, with an error that names the fix.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta
from typing import Any, TypeVar

from django.core.exceptions import ImproperlyConfigured
from django.db import ProgrammingError, transaction

from django_workpump import db, tracing
from django_workpump.conf import setting
from django_workpump.payloads import MAX_DEPTH
from django_workpump.registry import TOPIC_NOUNS, control_character, registry

# Longest stream key, in UTF-8 bytes: keys are indexed, and index rows have a size limit.
MAX_STREAM_BYTES = 512
# The last year a run_after may fall in (UTC): Python's datetime ends with it, and so do
# the SQL producers' p_scheduled_for.
MAX_YEAR = 9999
# The longest unique_for window: PostgreSQL computes now() minus it.
MAX_UNIQUE_FOR = timedelta(days=36_525)
_V = TypeVar("_V")
# Characters PostgreSQL text and jsonb cannot hold: NUL, and UTF-16 surrogates (a str
# holds them only after lossy decoding, e.g. errors="surrogateescape").
_UNSTORABLE = re.compile("[\x00\ud800-\udfff]")
# PostgreSQL's own rendering of jsonb (", " and ": ", UTF-8), so the size measured here
# is the one the SQL producers check against p_max_payload_bytes.
_ENCODER = json.JSONEncoder(allow_nan=False, ensure_ascii=False)

# Called after commit of produced work, with its category (the in-process pump wakes).
_on_commit_listeners: list[Callable[[str], None]] = []


class InvalidWork(ValueError):
    """Work that cannot be stored: a payload that is not JSON, a bad stream key, ..."""


class Duplicate(Exception):
    """Work refused because another row holds its unique key (``on_conflict="raise"``)."""

    def __init__(self, message: str, holder_id: uuid.UUID) -> None:
        super().__init__(message)
        self.holder_id = holder_id


# What a producer does when another row holds its unique key.
ON_CONFLICT = ("return", "raise")


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


def _unstorable(text: str) -> str | None:
    """Describe the first character of ``text`` that PostgreSQL cannot store, if any."""
    found = _UNSTORABLE.search(text)
    if found is None:
        return None
    if found.group() == "\x00":
        return "a NUL character (\\x00)"
    return f"a surrogate code point (U+{ord(found.group()):04X}, not valid Unicode)"


def _location(path: tuple[Any, ...]) -> str:
    return "payload" + "".join(f"[{step!r}]" for step in path)


def _check_payload_values(what: str, payload: Mapping[str, Any]) -> None:
    """Refuse nesting deeper than MAX_DEPTH and strings PostgreSQL cannot store.

    Iterative, so even a payload nested past the recursion limit is refused cleanly.
    """
    fix = (
        "Remove it, or encode binary data first (e.g. base64) and decode text with "
        "errors='replace' instead of 'surrogateescape'."
    )
    stack: list[tuple[Any, int, tuple[Any, ...]]] = [(payload, 1, ())]
    while stack:
        value, depth, path = stack.pop()
        if isinstance(value, str):
            if problem := _unstorable(value):
                where = _location(path)
                raise InvalidWork(f"The payload of {what} has {problem} in {where}. {fix}")
            continue
        if isinstance(value, Mapping):
            children: Any = value.items()
        elif isinstance(value, list | tuple):
            children = enumerate(value)
        else:
            continue
        if depth > MAX_DEPTH:
            raise InvalidWork(
                f"The payload of {what} nests dicts and lists more than {MAX_DEPTH} levels "
                f"deep under {_location(path[:1])}, or contains itself. Flatten it, e.g. "
                "into a list of records that name their parent."
            )
        is_mapping = isinstance(value, Mapping)
        for key, child in children:
            if is_mapping and isinstance(key, str) and (problem := _unstorable(key)):
                raise InvalidWork(
                    f"The payload of {what} has {problem} in a key of {_location(path)}. {fix}"
                )
            stack.append((child, depth + 1, (*path, key)))


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


def _payload_json(what: str, payload: Any, limit: int | None = None) -> str:
    if not isinstance(payload, Mapping):
        raise InvalidWork(
            f"The payload of {what} must be a dict of JSON values, not {type(payload).__name__}."
        )
    try:
        text = _ENCODER.encode(payload)
    except (TypeError, ValueError, RecursionError) as exc:
        # Too deep, self-containing or unstorable values explain the failure best.
        _check_payload_values(what, payload)
        raise InvalidWork(
            f"The payload of {what} is not JSON ({exc}). Pass only dicts, lists, strings, "
            "numbers, booleans and None; convert dates, UUIDs and Decimals to strings first."
        ) from exc
    # The walk over every value runs only when the text could hide a problem: a NUL
    # (rendered as \u0000), a surrogate, or more brackets than the nesting limit.
    plain = text.isascii()
    if (
        "\\u0000" in text
        or (not plain and _UNSTORABLE.search(text))
        or text.count("{") + text.count("[") > MAX_DEPTH
    ):
        _check_payload_values(what, payload)
    if limit is None:
        limit = setting("MAX_PAYLOAD_BYTES")
    size = len(text) if plain else len(text.encode())
    if size > limit:
        raise InvalidWork(
            f"The payload of {what} is {size} bytes of JSON, over "
            f"WORKPUMP['MAX_PAYLOAD_BYTES'] ({limit}). Store large data elsewhere and "
            "send a reference to it."
        )
    return text


def _each_checked(
    check: Callable[[str, Any], _V], what: Callable[[int], str], items: list[Any]
) -> list[_V]:
    """``check(what, item)`` of each item of a bulk call, in order; ``what(index)`` names
    the item in an error and is built only for an item that fails, by checking it again
    (a bulk call checks thousands of items, nearly always all good)."""
    checked = []
    for index, item in enumerate(items):
        try:
            checked.append(check("", item))
        except InvalidWork:
            check(what(index), item)
            raise
    return checked


def _payloads_json(what: Callable[[int], str], payloads: list[Any]) -> list[str]:
    """The JSON text of each payload of a bulk call, checked as ``_payload_json`` checks it."""
    limit = setting("MAX_PAYLOAD_BYTES")
    return _each_checked(lambda name, payload: _payload_json(name, payload, limit), what, payloads)


def _stream_key(what: str, stream: Any) -> str | None:
    if stream is None:
        return None
    if isinstance(stream, bool) or not isinstance(stream, str | int | uuid.UUID):
        raise InvalidWork(
            f"The stream of {what} must be a str, int or UUID (or None for no ordering), "
            f"not {type(stream).__name__}."
        )
    too_long = (
        f"The stream of {what} is {{}}, over the limit of {MAX_STREAM_BYTES} bytes. Use a "
        "shorter key, e.g. a hash of the long one."
    )
    try:
        key = str(stream)
    except ValueError as exc:  # an int past Python's int-string digit limit
        raise InvalidWork(too_long.format("an int of more than 4300 digits")) from exc
    size = len(key.encode("utf-8", "surrogatepass"))
    if size > MAX_STREAM_BYTES:
        raise InvalidWork(too_long.format(f"{size} bytes in UTF-8"))
    if problem := _unstorable(key):
        raise InvalidWork(
            f"The stream of {what} has {problem}. Use a key of printable text, e.g. a hash."
        )
    if not key.strip():
        raise InvalidWork(f"The stream of {what} is empty; pass None for no ordering.")
    return key


def _name(what: str, value: Any) -> str:
    if not isinstance(value, str) or not value.strip():
        raise InvalidWork(f"The {what} must be a non-empty string, not {value!r}.")
    if problem := _unstorable(value):
        raise InvalidWork(f"The {what} {value!r} has {problem}. Use printable text.")
    if problem := control_character(value):
        raise InvalidWork(
            f"The {what} {value!r} has {problem}; topic names must be printable text. "
            "Remove it from the name."
        )
    return value


# Most bytes of JSON a row's headers may take (the SQL producers check the same).
MAX_HEADERS_BYTES = 8192


def _headers(what: str, headers: Any) -> dict[str, str] | None:
    """Check headers: None, or a mapping of str to str of at most MAX_HEADERS_BYTES."""
    if headers is None:
        return None
    if not isinstance(headers, Mapping):
        raise InvalidWork(
            f"The headers of {what} must be a dict of str to str (or None), not "
            f"{type(headers).__name__}."
        )
    for key, value in headers.items():
        if not isinstance(key, str) or not isinstance(value, str):
            raise InvalidWork(
                f"The headers of {what} must map str to str; {key!r}: {value!r} does not. "
                "Convert the value to a string, e.g. str(value)."
            )
        for text in (key, value):
            if problem := _unstorable(text):
                raise InvalidWork(f"The headers of {what} have {problem} in {text!r}.")
    return dict(headers)


def _headers_json(what: str, headers: dict[str, str] | None) -> str | None:
    if not headers:
        return None
    text = json.dumps(headers, ensure_ascii=False)
    size = len(text.encode())
    if size > MAX_HEADERS_BYTES:
        raise InvalidWork(
            f"The headers of {what} are {size} bytes of JSON, over the limit of "
            f"{MAX_HEADERS_BYTES}. Headers carry small metadata such as a trace context; "
            "put data in the payload."
        )
    return text


def _priority(what: str, priority: Any) -> int:
    if isinstance(priority, bool) or not isinstance(priority, int):
        raise InvalidWork(f"The priority of {what} must be an int, not {priority!r}.")
    if not -32768 <= priority <= 32767:
        raise InvalidWork(f"The priority of {what} must be within -32768..32767, not {priority}.")
    return priority


def _max_attempts(category: str, topic: str, max_attempts: int | None) -> int:
    if max_attempts is None:
        handler = registry.get(category, topic)
        max_attempts = handler.max_attempts if handler and handler.max_attempts else None
    if max_attempts is None:
        max_attempts = setting("MAX_ATTEMPTS")
    if isinstance(max_attempts, bool) or not isinstance(max_attempts, int) or max_attempts < 1:
        raise InvalidWork(
            f"max_attempts of {TOPIC_NOUNS[category]} {topic!r} must be an int >= 1, "
            f"not {max_attempts!r}."
        )
    return max_attempts


def _when(what: str, run_after: datetime | None) -> datetime | None:
    if run_after is None:
        return None
    if not isinstance(run_after, datetime) or run_after.tzinfo is None:
        raise InvalidWork(
            f"run_after of {what} must be an aware datetime (USE_TZ), not {run_after!r}."
        )
    try:
        in_utc = run_after.astimezone(UTC)
    except OverflowError:  # past year 9999 (or before year 1) once in UTC
        in_utc = None
    if in_utc is None or in_utc.year > MAX_YEAR:
        raise InvalidWork(
            f"run_after of {what} ({run_after.isoformat()}) is past year {MAX_YEAR} in UTC, "
            "a time Python cannot read back and no pump would reach. Pass an earlier time, "
            "or do not send the work."
        )
    return run_after


def _unique(
    what: str, unique_key: Any, unique_for: Any, on_conflict: Any
) -> tuple[str | None, timedelta | None]:
    """Check a unique key, its window and the conflict policy; return key and window."""
    if on_conflict not in ON_CONFLICT:
        raise InvalidWork(
            f"on_conflict of {what} must be 'return' (the holder's id) or 'raise' "
            f"(workpump.Duplicate), not {on_conflict!r}."
        )
    if unique_key is None:
        if unique_for is not None:
            raise InvalidWork(
                f"unique_for of {what} needs a unique_key: the window applies to a key. "
                "Pass unique_key too, or leave unique_for out."
            )
        return None, None
    if not isinstance(unique_key, str) or not unique_key.strip():
        raise InvalidWork(
            f"unique_key of {what} must be a non-empty string (or None for none), "
            f"not {unique_key!r}."
        )
    size = len(unique_key.encode("utf-8", "surrogatepass"))
    if size > MAX_STREAM_BYTES:
        raise InvalidWork(
            f"unique_key of {what} is {size} bytes in UTF-8, over the limit of "
            f"{MAX_STREAM_BYTES} bytes. Use a shorter key, e.g. a hash of the long one."
        )
    if problem := _unstorable(unique_key):
        raise InvalidWork(
            f"unique_key of {what} has {problem}. Use a key of printable text, e.g. a hash."
        )
    if unique_for is not None:
        if not isinstance(unique_for, timedelta):
            raise InvalidWork(
                f"unique_for of {what} must be a timedelta (or None for no window), "
                f"not {unique_for!r}."
            )
        if unique_for < timedelta(0):
            raise InvalidWork(
                f"unique_for of {what} must not be negative, not {unique_for!r}. Pass a "
                "window such as timedelta(minutes=5), or None."
            )
        if unique_for > MAX_UNIQUE_FOR:
            raise InvalidWork(
                f"unique_for of {what} ({unique_for.days} days) is longer than the "
                f"{MAX_UNIQUE_FOR.days} days (100 years) a window may span. Pass a shorter "
                "window, or None for a key held while its row is not done."
            )
    return unique_key, unique_for


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
    using: str | None = None,
) -> uuid.UUID:
    """Store an outbox message for ``destination`` in the current transaction.

    With ``unique_key``, at most one unprocessed message per (destination, key) exists
    (with ``unique_for``, also none created within that window): a duplicate writes
    nothing and returns the holder's id, or raises ``Duplicate`` (``on_conflict="raise"``).
    ``headers`` (str to str) are stored with the row and given to its handler as
    ``work.headers``; with tracing on they carry the producer span's context.
    """
    destination = _name("outbox destination", destination)
    what = f"outbox message to {destination!r}"
    key, window = _unique(what, unique_key, unique_for, on_conflict)
    given = _headers(what, headers)
    stream_key = _stream_key(what, stream)
    if key is not None and message_id is None:
        message_id = uuid.uuid4()  # a returned id that differs names the holder
    alias = using or setting("DATABASE_ALIAS")
    with (
        tracing.producing("send", "outbox", destination, stream=stream_key, headers=given) as out,
        _schema_required(alias),
    ):
        result = db.send(
            destination=destination,
            payload_json=_payload_json(what, payload),
            stream=stream_key,
            priority=_priority(what, priority),
            scheduled_for=_when(what, run_after),
            max_attempts=_max_attempts("outbox", destination, max_attempts),
            message_id=message_id,
            partition_count=setting("PARTITION_COUNT"),
            max_payload_bytes=setting("MAX_PAYLOAD_BYTES"),
            max_payload_depth=MAX_DEPTH,
            unique_key=key,
            unique_for=window,
            headers_json=_headers_json(what, out.headers),
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
    using: str | None = None,
) -> db.Received:
    """``receive``, also returning the stored row's ``created_at`` from the same statement
    (``.stored`` is what ``receive`` returns; ``.created_at`` is meaningful when stored)."""
    handler_name = _name("inbox handler name", handler_name)
    what = f"inbox message for {handler_name!r}"
    key, window = _unique(what, unique_key, unique_for, on_conflict)
    given = _headers(what, headers)
    stream_key = _stream_key(what, stream)
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
            payload_json=_payload_json(what, payload),
            stream=stream_key,
            priority=_priority(what, priority),
            scheduled_for=_when(what, run_after),
            max_attempts=_max_attempts("inbox", handler_name, max_attempts),
            partition_count=setting("PARTITION_COUNT"),
            max_payload_bytes=setting("MAX_PAYLOAD_BYTES"),
            max_payload_depth=MAX_DEPTH,
            deduplicate=deduplicate,
            unique_key=key,
            unique_for=window,
            headers_json=_headers_json(what, out.headers),
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
            "max_attempts": _max_attempts(handler.category, handler.topic, None),
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
    using: str | None = None,
) -> uuid.UUID:
    """Store an event and one work row per perspective and receptor subscribed to it.

    With ``unique_key``, at most one event per (event type, key) has work not yet done
    (with ``unique_for``, also none created within that window): a duplicate writes
    nothing and returns the holder's id, or raises ``Duplicate`` (``on_conflict="raise"``).
    ``headers`` are stored with every subscriber's row, as for ``send``.
    """
    event_type = _name("event type", event_type)
    what = f"event {event_type!r}"
    key, window = _unique(what, unique_key, unique_for, on_conflict)
    given = _headers(what, headers)
    stream_key = _stream_key(what, stream)
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
            payload_json=_payload_json(what, payload),
            stream=stream_key,
            subscribers_json=json.dumps(subscribers),
            event_id=event_id,
            priority=_priority(what, priority),
            partition_count=setting("PARTITION_COUNT"),
            max_payload_bytes=setting("MAX_PAYLOAD_BYTES"),
            max_payload_depth=MAX_DEPTH,
            unique_key=key,
            unique_for=window,
            headers_json=_headers_json(what, out.headers),
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


def _bulk_lists(
    what: str, payloads: Any, streams: Any
) -> tuple[list[Mapping[str, Any]], list[Any] | None]:
    """Check the shape of a bulk call: a list of payloads and None or a parallel list."""
    if isinstance(payloads, Mapping | str | bytes) or not isinstance(payloads, Iterable):
        raise InvalidWork(
            f"The payloads of {what} must be a list of dicts, not {type(payloads).__name__}. "
            "For one payload call the single-row producer."
        )
    payloads = list(payloads)
    if streams is None:
        return payloads, None
    if isinstance(streams, str | bytes | Mapping) or not isinstance(streams, Iterable):
        raise InvalidWork(
            f"The streams of {what} must be None or a list parallel to the payloads, "
            f"not {type(streams).__name__}."
        )
    streams = list(streams)
    if len(streams) != len(payloads):
        raise InvalidWork(
            f"The streams of {what} must hold one key (or None) per payload: got "
            f"{len(payloads)} payloads and {len(streams)} streams."
        )
    return payloads, streams


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
    using: str | None = None,
) -> list[uuid.UUID]:
    """Store one outbox message for ``destination`` per payload, in the current transaction.

    One statement per chunk of ``BULK_CHUNK_ROWS`` rows. ``streams`` is None or a list
    parallel to ``payloads`` (None entries: no ordering); within a stream the messages
    keep list order after anything already sent. Every payload is checked as ``send``
    checks it, before anything is written: one bad payload refuses the whole call.
    Returns the message ids in list order.
    """
    destination = _name("outbox destination", destination)
    what = f"send_many to {destination!r}"
    payloads, streams = _bulk_lists(what, payloads, streams)

    def noun(index: int) -> str:
        return f"outbox message {index} to {destination!r}"

    texts = _payloads_json(noun, payloads)
    keys = None if streams is None else _each_checked(_stream_key, noun, streams)
    priority = _priority(what, priority)
    scheduled_for = _when(what, run_after)
    max_attempts = _max_attempts("outbox", destination, max_attempts)
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
    using: str | None = None,
) -> list[uuid.UUID]:
    """Store one event of ``event_type`` per payload and its work, in the current transaction.

    As ``emit`` for each payload, in list order, one statement per chunk of events whose
    work rows number at most ``BULK_CHUNK_ROWS``; ``streams`` as in ``send_many``.
    Returns the event ids in list order.
    """
    event_type = _name("event type", event_type)
    what = f"emit_many of event {event_type!r}"
    payloads, streams = _bulk_lists(what, payloads, streams)

    def noun(index: int) -> str:
        return f"event {index} of type {event_type!r}"

    texts = _payloads_json(noun, payloads)
    keys = None if streams is None else _each_checked(_stream_key, noun, streams)
    priority = _priority(what, priority)
    subscribers, categories = _subscribers(event_type)
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
                using=alias,
            )
    for category in categories:
        _announce(category, alias)
    if capture_listeners:
        for index, payload in enumerate(payloads):
            stream = None if streams is None else streams[index]
            _tell_capture("emit", event_type, payload, stream, ids[index])
    return ids
