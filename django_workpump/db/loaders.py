"""Cursor loaders: times Python cannot hold read as ``StoredTime``, and a claim's
shared timestamps parsed once per result.
"""

from __future__ import annotations

from functools import cache
from typing import Any

import psycopg
from psycopg.abc import Loader
from psycopg.pq import Format


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
