"""The work changelists' search box: ids (whole or a prefix), topic and stream words, a
time window, and payload content (docs/admin.md, "Search").

Terms, separated by spaces (a JSON object is one term, and must come last):

- ``<uuid>``: that row; ``id:<hex prefix>`` (4 hex digits or more): the rows whose work id
  starts so (a range of the unique index on ``work_id``);
- ``after:<time>`` / ``before:<time>`` (ISO 8601, e.g. ``2026-12-03T10:00``): created in
  that window;
- ``key=value`` (``user.id=7`` for nested keys; the value as JSON when it parses, else
  text) or ``{"user_id": 7}``: the payload contains it (``@>``);
- any other word: part of the topic or the stream.

A payload term runs over the whole table only through the opt-in payload index
(``manage.py workpump_payload_index``); without it, it reads the newest
``PAYLOAD_SCAN_ROWS`` rows of the table (a range of its primary key), so a search over
10M rows answers in milliseconds, not in a scan of the table that takes seconds.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from django.db.models import Q
from django.utils import timezone
from django.utils.dateparse import parse_datetime

PAYLOAD_SCAN_ROWS = 100_000  # the newest rows a payload search reads without the index
_HEX = re.compile(r"[0-9a-f]{4,32}")
_KEY = re.compile(r"[A-Za-z_][\w.-]*")


class SearchError(ValueError):
    """A search term that means nothing: the message names it and the fix."""


@dataclass
class Search:
    ids: list[uuid.UUID] = field(default_factory=list)
    id_ranges: list[tuple[uuid.UUID, uuid.UUID]] = field(default_factory=list)
    after: datetime | None = None
    before: datetime | None = None
    payload: dict[str, Any] | None = None
    words: list[str] = field(default_factory=list)


def _time(term: str, value: str) -> datetime:
    try:
        parsed = parse_datetime(value) or parse_datetime(f"{value}T00:00")
    except ValueError:
        parsed = None
    if parsed is None:
        raise SearchError(
            f"{term!r}: not a time. Write it as ISO 8601, e.g. {term.split(':')[0]}:"
            "2026-12-03T10:00 (in the current time zone unless it says its own)."
        )
    return timezone.make_aware(parsed) if timezone.is_naive(parsed) else parsed


def _merge(into: dict[str, Any], key: str, value: Any) -> None:
    *path, last = key.split(".")
    node = into
    for part in path:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise SearchError(f"{key!r}: a key is searched both as a value and as an object.")
    node[last] = value


def parse(text: str) -> Search:
    """The search of ``text``; SearchError for a term that cannot be searched."""
    search = Search()
    text = text.strip()
    brace = text.find("{")
    if brace >= 0:
        try:
            document = json.loads(text[brace:])
        except ValueError as exc:
            raise SearchError(
                f"The payload search {text[brace:]!r} is not valid JSON ({exc}). Write an "
                'object such as {"user_id": 7}, or key=value.'
            ) from None
        if not isinstance(document, dict):
            raise SearchError('A payload search must be a JSON object, such as {"user_id": 7}.')
        search.payload = document
        text = text[:brace]
    for term in text.split():
        lowered = term.lower()
        if lowered.startswith("id:"):
            prefix = lowered[3:].replace("-", "")
            if not _HEX.fullmatch(prefix):
                raise SearchError(
                    f"{term!r}: an id prefix is 4 to 32 hex digits (dashes allowed), "
                    "e.g. id:3f2a9c."
                )
            low = uuid.UUID(prefix.ljust(32, "0"))
            high = uuid.UUID(prefix.ljust(32, "f"))
            search.id_ranges.append((low, high))
        elif lowered.startswith(("after:", "before:")):
            name, _, value = term.partition(":")
            setattr(search, name.lower(), _time(term, value))
        elif "=" in term:
            key, _, raw = term.partition("=")
            if not _KEY.fullmatch(key) or not raw:
                raise SearchError(
                    f"{term!r}: a payload term is key=value, e.g. user_id=7 or "
                    "customer.email=a@b.example."
                )
            try:
                wanted: Any = json.loads(raw)
            except ValueError:
                wanted = raw
            search.payload = search.payload or {}
            _merge(search.payload, key, wanted)
        else:
            try:
                search.ids.append(uuid.UUID(term))
            except ValueError:
                search.words.append(term)
    if search.after and search.before and search.after >= search.before:
        raise SearchError("after: must be earlier than before:.")
    return search


def condition(
    search: Search, *, payload_field: str, newest_seq: int | None
) -> tuple[Q, str | None]:
    """The filter of ``search``, and a note for the operator when a payload search was
    narrowed. ``newest_seq``: the table's newest ``seq`` when a payload term must be
    narrowed to the newest ``PAYLOAD_SCAN_ROWS`` rows (no payload index), else None."""
    q = Q()
    note = None
    for work_id in search.ids:
        q &= Q(work_id=work_id)
    for low, high in search.id_ranges:
        q &= Q(work_id__gte=low, work_id__lte=high)
    if search.payload is not None:
        q &= Q(**{f"{payload_field}__contains": search.payload})
        if newest_seq is not None and newest_seq > PAYLOAD_SCAN_ROWS:
            q &= Q(seq__gt=newest_seq - PAYLOAD_SCAN_ROWS)
            note = (
                f"The payload search read the newest {PAYLOAD_SCAN_ROWS:,} rows only: "
                "`manage.py workpump_payload_index` creates the index that lets it search "
                "the whole table (docs/admin.md, 'Search')."
            )
    if search.after is not None:
        q &= Q(created_at__gte=search.after)
    if search.before is not None:
        q &= Q(created_at__lt=search.before)
    for word in search.words:
        q &= Q(topic__icontains=word) | Q(stream__icontains=word)
    return q, note
