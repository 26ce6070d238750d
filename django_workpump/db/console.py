"""The console's time series: the maintenance worker's sample and purge, and the reads
of the admin's console pages (named queries of ``sql/console.sql``).

The counters are written by the work tables' statement trigger (sql/schema.sql, "The
console's time series"), so nothing here is on the pump's hot path.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any
from uuid import UUID

from django_workpump.db.queries import fetch_named

QUERIES = "console.sql"


def _one(name: str, params: dict[str, Any], using: str | None) -> Any:
    (row,) = fetch_named(QUERIES, name, params, using=using)
    (value,) = row.values()
    return value


def console_sample(*, now: datetime | None = None, using: str | None = None) -> bool:
    """Sample the current minute's backlog and instances, unless a peer already did."""
    return bool(_one("console_sample", {"now": now}, using))


def purge_console(*, retention_seconds: int, batch: int, using: str | None = None) -> int:
    """Delete up to ``batch`` rows of each console table older than the retention."""
    params = {"retention_seconds": retention_seconds, "batch": batch}
    return int(_one("purge_console", params, using))


def console_counting(on: bool, *, using: str | None = None) -> bool:
    """Enable or disable the counting triggers (the tables' owner only)."""
    return bool(_one("console_counting", {"on": on}, using))


def console_clock(*, now: datetime | None = None, using: str | None = None) -> dict[str, Any]:
    """``minute``: the minute a window ends at; ``bounds``: latency bucket bounds (s)."""
    (row,) = fetch_named(QUERIES, "console_clock", {"now": now}, using=using)
    return row


def _window(
    since: datetime,
    until: datetime,
    category: str | None = None,
    topic: str | None = None,
    instance_id: UUID | None = None,
) -> dict[str, Any]:
    return {
        "since": since,
        "until": until,
        "category": category,
        "topic": topic,
        "instance_id": instance_id,
    }


def console_outcomes(
    since: datetime, until: datetime, *, using: str | None = None, **filters: Any
) -> list[dict[str, Any]]:
    """Rows (minute, outcome, n); filters: category, topic, instance_id."""
    return fetch_named(QUERIES, "console_outcomes", _window(since, until, **filters), using=using)


def console_latency(
    since: datetime, until: datetime, *, using: str | None = None, **filters: Any
) -> list[dict[str, Any]]:
    """Rows (minute, bucket, n) of claims; filters: category, topic, instance_id."""
    return fetch_named(QUERIES, "console_latency", _window(since, until, **filters), using=using)


def console_backlog(
    since: datetime,
    until: datetime,
    *,
    category: str | None = None,
    topic: str | None = None,
    using: str | None = None,
) -> list[dict[str, Any]]:
    params = {"since": since, "until": until, "category": category, "topic": topic}
    return fetch_named(QUERIES, "console_backlog", params, using=using)


def console_instances(
    since: datetime,
    until: datetime,
    *,
    instance_id: UUID | None = None,
    using: str | None = None,
) -> list[dict[str, Any]]:
    params = {"since": since, "until": until, "instance_id": instance_id}
    return fetch_named(QUERIES, "console_instances", params, using=using)


def console_topics(
    since: datetime, until: datetime, *, limit: int = 50, using: str | None = None
) -> list[dict[str, Any]]:
    params = {"since": since, "until": until, "limit": limit}
    return fetch_named(QUERIES, "console_topics", params, using=using)


def console_topic_outcomes(
    since: datetime,
    until: datetime,
    topics: list[tuple[str, str]],
    *,
    using: str | None = None,
) -> list[dict[str, Any]]:
    params = {
        "since": since,
        "until": until,
        "categories": [category for category, _ in topics],
        "topics": [topic for _, topic in topics],
    }
    return fetch_named(QUERIES, "console_topic_outcomes", params, using=using)


def console_failures(
    category: str, topic: str, *, scan: int = 10_000, using: str | None = None
) -> list[dict[str, Any]]:
    params = {"category": category, "topic": topic, "scan": scan}
    return fetch_named(QUERIES, "console_failures", params, using=using)


def console_in_flight(
    instance_id: UUID, *, limit: int = 100, now: datetime | None = None, using: str | None = None
) -> list[dict[str, Any]]:
    params = {"instance_id": instance_id, "limit": limit, "now": now}
    return fetch_named(QUERIES, "console_in_flight", params, using=using)
