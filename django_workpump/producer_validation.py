"""Checks of what a producer is given: names, payloads, stream keys, headers, priority,
attempts, run_after and unique keys, each refused with an error that names the fix.

Every check runs before anything is written, and measures what the SQL producers
measure, so the database refuses nothing this module lets through.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable, Iterable, Mapping
from datetime import UTC, datetime, timedelta
from typing import Any, TypeVar

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


class InvalidWork(ValueError):
    """Work that cannot be stored: a payload that is not JSON, a bad stream key, ..."""


# What a producer does when another row holds its unique key.
ON_CONFLICT = ("return", "raise")


def unstorable_character(text: str) -> str | None:
    """Describe the first character of ``text`` that PostgreSQL cannot store, if any."""
    found = _UNSTORABLE.search(text)
    if found is None:
        return None
    if found.group() == "\x00":
        return "a NUL character (\\x00)"
    return f"a surrogate code point (U+{ord(found.group()):04X}, not valid Unicode)"


def payload_location(path: tuple[Any, ...]) -> str:
    return "payload" + "".join(f"[{step!r}]" for step in path)


def check_payload_values(what: str, payload: Mapping[str, Any]) -> None:
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
            if problem := unstorable_character(value):
                where = payload_location(path)
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
                f"deep under {payload_location(path[:1])}, or contains itself. Flatten it, e.g. "
                "into a list of records that name their parent."
            )
        is_mapping = isinstance(value, Mapping)
        for key, child in children:
            if is_mapping and isinstance(key, str) and (problem := unstorable_character(key)):
                raise InvalidWork(
                    f"The payload of {what} has {problem} in a key of "
                    f"{payload_location(path)}. {fix}"
                )
            stack.append((child, depth + 1, (*path, key)))


def payload_json(what: str, payload: Any, limit: int | None = None) -> str:
    if not isinstance(payload, Mapping):
        raise InvalidWork(
            f"The payload of {what} must be a dict of JSON values, not {type(payload).__name__}."
        )
    try:
        text = _ENCODER.encode(payload)
    except (TypeError, ValueError, RecursionError) as exc:
        # Too deep, self-containing or unstorable values explain the failure best.
        check_payload_values(what, payload)
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
        check_payload_values(what, payload)
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


def each_checked(
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


def payloads_json(what: Callable[[int], str], payloads: list[Any]) -> list[str]:
    """The JSON text of each payload of a bulk call, checked as ``payload_json`` checks it."""
    limit = setting("MAX_PAYLOAD_BYTES")
    return each_checked(lambda name, payload: payload_json(name, payload, limit), what, payloads)


def checked_stream_key(what: str, stream: Any) -> str | None:
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
    if problem := unstorable_character(key):
        raise InvalidWork(
            f"The stream of {what} has {problem}. Use a key of printable text, e.g. a hash."
        )
    if not key.strip():
        raise InvalidWork(f"The stream of {what} is empty; pass None for no ordering.")
    return key


# Characters of a concurrency or fairness key (docs/flow-control.md); SQL checks the same.
MAX_FLOW_KEY_CHARS = 200


def checked_flow_key(what: str, kind: str, key: Any) -> str | None:
    """A ``concurrency_key`` or ``fairness_key`` (``kind``) of new work: None or text."""
    if key is None or key == "":
        return None
    if not isinstance(key, str):
        raise InvalidWork(
            f"The {kind} of {what} must be a str (or None), not {type(key).__name__}."
        )
    if len(key) > MAX_FLOW_KEY_CHARS:
        raise InvalidWork(
            f"The {kind} of {what} has {len(key)} characters, over the limit of "
            f"{MAX_FLOW_KEY_CHARS}. Use a short name such as 'partner:acme' or 'tenant:42'."
        )
    if problem := unstorable_character(key) or (
        "a control character" if any(ord(c) < 32 or ord(c) == 127 for c in key) else None
    ):
        raise InvalidWork(f"The {kind} of {what} has {problem}. Use printable text.")
    return key


def checked_name(what: str, value: Any) -> str:
    if not isinstance(value, str) or not value.strip():
        raise InvalidWork(f"The {what} must be a non-empty string, not {value!r}.")
    if problem := unstorable_character(value):
        raise InvalidWork(f"The {what} {value!r} has {problem}. Use printable text.")
    if problem := control_character(value):
        raise InvalidWork(
            f"The {what} {value!r} has {problem}; topic names must be printable text. "
            "Remove it from the name."
        )
    return value


# Most bytes of JSON a row's headers may take (the SQL producers check the same).
MAX_HEADERS_BYTES = 8192


def checked_headers(what: str, headers: Any) -> dict[str, str] | None:
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
            if problem := unstorable_character(text):
                raise InvalidWork(f"The headers of {what} have {problem} in {text!r}.")
    return dict(headers)


def headers_json(what: str, headers: dict[str, str] | None) -> str | None:
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


def checked_priority(what: str, priority: Any) -> int:
    if isinstance(priority, bool) or not isinstance(priority, int):
        raise InvalidWork(f"The priority of {what} must be an int, not {priority!r}.")
    if not -32768 <= priority <= 32767:
        raise InvalidWork(f"The priority of {what} must be within -32768..32767, not {priority}.")
    return priority


def checked_max_attempts(category: str, topic: str, max_attempts: int | None) -> int:
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


def checked_run_after(what: str, run_after: datetime | None) -> datetime | None:
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


def checked_unique(
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
    if problem := unstorable_character(unique_key):
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


def checked_bulk_lists(
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
