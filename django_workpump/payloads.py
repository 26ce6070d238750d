"""Payload limits and a guarded JSON decoder.

Producers refuse payloads nested deeper than ``MAX_DEPTH``; the SQL producers take the
same limit as ``p_max_payload_depth`` (at most ``DECODE_MAX_DEPTH``). The claim decodes
each row's payload with ``decode``, which refuses what Python's ``json`` cannot decode
safely (too deep for the recursion limit, integers past the int-string digit limit)
with ``UndecodablePayload`` instead of a RecursionError that would sink the whole batch.
"""

from __future__ import annotations

import json
import re
from array import array
from itertools import accumulate
from typing import Any

# Producers refuse payloads nested deeper (the payload object itself is level 1).
MAX_DEPTH = 100
# The claim decodes at most this deep: well inside Python's default recursion limit
# (1000), whichever thread decodes. The SQL producers accept no larger p_max_payload_depth.
DECODE_MAX_DEPTH = 512

# A JSON string literal (escapes included), matched without backtracking.
_STRING = re.compile(r'"(?:[^"\\]++|\\.)*+"', re.DOTALL)
_NOT_BRACKET = re.compile(r"[^\[\]{}]++")
# Openers become +1 and closers -1 as signed bytes, so the depth is a running sum in C.
_STEPS = str.maketrans({"[": "\x01", "{": "\x01", "]": "\xff", "}": "\xff"})


class UndecodablePayload(ValueError):
    """A stored payload Python cannot decode; the message says why."""


class StoredJSON(str):
    """The text of a stored JSON value Python cannot decode safely, as read; ``error``
    says why. Readers show it as stored rather than fail the page or batch it is in."""

    error: str = ""

    def __new__(cls, text: str, error: str) -> StoredJSON:
        value = super().__new__(cls, text)
        value.error = error
        return value


def decode_or_stored(text: str, max_depth: int = DECODE_MAX_DEPTH) -> Any:
    """Decode JSON ``text``, or give it back as a ``StoredJSON`` when it cannot be decoded."""
    try:
        return decode(text, max_depth)
    except UndecodablePayload as exc:
        return StoredJSON(text, str(exc))


def nesting_depth(text: str) -> int:
    """Return how deep objects and arrays nest in the JSON ``text`` (``{}`` is 1)."""
    brackets = _NOT_BRACKET.sub("", _STRING.sub("", text))
    steps = array("b", brackets.translate(_STEPS).encode("latin-1"))
    return max(accumulate(steps), default=0)


def decode(text: str, max_depth: int = DECODE_MAX_DEPTH) -> Any:
    """Decode JSON ``text``; raise ``UndecodablePayload`` instead of failing deep inside."""
    # Each level takes a bracket at least: a text this short cannot nest too deep.
    depth = nesting_depth(text) if len(text) > max_depth else 0
    if depth > max_depth:
        raise UndecodablePayload(
            f"it nests objects and arrays {depth} levels deep, more than the {max_depth} "
            "the pump decodes"
        )
    try:
        return json.loads(text)
    except (ValueError, RecursionError) as exc:  # ValueError: also int digits past the limit
        raise UndecodablePayload(str(exc)) from exc
