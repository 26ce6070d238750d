"""Make handler outcomes storable before they are written: results, errors, tracebacks.

PostgreSQL refuses NUL in ``text`` and ``\\u0000`` in ``jsonb``, and psycopg cannot
encode a lone surrogate at all. One such character in one outcome used to fail the whole
batch of outcomes it was written with, again and again. Here those characters become
U+FFFD (and error texts say so in a short note); a result that is still not storable
becomes a note, so the row is completed all the same.
"""

from __future__ import annotations

import json
import re
import traceback
from collections.abc import Callable
from typing import Any

import psycopg
from django.db import InterfaceError, OperationalError

REPLACEMENT = "\ufffd"
# NUL, and surrogate code points: a Python str never holds a valid pair as two of them.
_UNSTORABLE = re.compile("[\x00\ud800-\udfff]")
# What json.dumps writes for those characters (and for any non-BMP one, as a pair).
_ESCAPES = ("\\u0000", "\\ud")
NOTE_KEY = "workpump_note"


def replacement_note(count: int) -> str:
    """The note appended to a text whose unstorable characters were replaced."""
    return (
        f" [workpump: {count} character{'s' if count != 1 else ''} PostgreSQL cannot store "
        "(NUL or lone surrogate) replaced with U+FFFD]"
    )


def clean_text(text: str) -> tuple[str, int]:
    """Return ``text`` with NUL and surrogates replaced by U+FFFD, and how many there were."""
    cleaned, count = _UNSTORABLE.subn(REPLACEMENT, text)
    return cleaned, count


def storable_text(text: str) -> str:
    """Return ``text`` safe for a ``text`` column, with a note if anything was replaced."""
    cleaned, count = clean_text(text)
    return cleaned + replacement_note(count) if count else cleaned


def ascii_text(text: str) -> str:
    """Return plain printable ASCII: the last-resort form of an error the database refused."""
    cleaned = _UNSTORABLE.sub("?", text)
    return cleaned.encode("ascii", "backslashreplace").decode("ascii")


def _clean_value(value: Any, counter: list[int]) -> Any:
    if isinstance(value, str):
        cleaned, count = clean_text(value)
        counter[0] += count
        return cleaned
    if isinstance(value, dict):
        return {_clean_value(k, counter): _clean_value(v, counter) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_clean_value(v, counter) for v in value]
    return value


def result_note(reason: str) -> str:
    """The JSON stored instead of a result that cannot be stored."""
    note = (
        f"The handler's result was not stored: {ascii_text(reason)}. Return JSON values "
        "only (dicts with string keys, lists, strings, finite numbers, booleans, None)."
    )
    return json.dumps({NOTE_KEY: note})


def storable_result(result: Any, warn: Callable[[str], object] | None = None) -> str | None:
    """Return a handler's result as JSON ``jsonb`` accepts: NUL and surrogates inside
    strings become U+FFFD, and a value that is not JSON becomes a note (``result_note``).

    ``warn`` is called with a sentence when the result was changed.
    """
    if result is None:
        return None
    try:
        text = json.dumps(result, allow_nan=False)
    except (TypeError, ValueError, RecursionError) as exc:
        reason = f"it is not JSON ({type(exc).__name__}: {exc})"
        if warn is not None:
            warn(f"its result was not stored: {ascii_text(reason)}")
        return result_note(reason)
    if not any(escape in text for escape in _ESCAPES):
        return text  # the common case: nothing to walk
    counter = [0]
    cleaned = _clean_value(result, counter)
    if not counter[0]:
        return text  # only valid non-BMP characters (or an escaped backslash)
    if warn is not None:
        warn(
            f"{counter[0]} character{'s' if counter[0] != 1 else ''} of its result "
            "PostgreSQL cannot store (NUL or lone surrogate) replaced with U+FFFD"
        )
    return json.dumps(cleaned, allow_nan=False)


def is_transient(exc: BaseException) -> bool:
    """Whether a write failed for the connection's sake (retry it), not for its data's.

    Only connection and server-state errors are worth the same write again; a data error
    (DataError, IntegrityError, ProgrammingError, UnicodeEncodeError, ...) fails the same
    way every time.
    """
    return isinstance(
        exc, OperationalError | InterfaceError | psycopg.OperationalError | psycopg.InterfaceError
    )


_TRACEBACK_HEAD = "Traceback (most recent call last):"


def error_text(exc: BaseException, limit: int = 8000) -> str:
    """The stored text of a failed attempt: the exception line first (what every summary
    shows: status, admin lists, logs), then the end of the traceback, storable."""
    headline = "".join(traceback.format_exception_only(exc)).strip().splitlines()
    trace = "".join(traceback.format_exception(exc))[-limit:]
    return storable_text(f"{headline[0] if headline else type(exc).__name__}\n\n{trace}")


def error_headline(text: str | None) -> str:
    """The line that says what went wrong: the first line, or for a bare traceback (rows
    stored before the exception line came first) the exception line after its frames."""
    lines = (text or "").strip().splitlines()
    if not lines:
        return ""
    if lines[0] != _TRACEBACK_HEAD:
        return lines[0]
    frames = [i for i, line in enumerate(lines) if line.startswith(" ")]
    after = frames[-1] + 1 if frames else 1
    return lines[after] if after < len(lines) else lines[-1]
