"""The console's time series: the maintenance worker's sample and purge, and the reads
of the admin's console pages (named queries of ``sql/console.sql``).

The counters are written by the work tables' statement trigger (sql/schema.sql, "The
console's time series"), so nothing here is on the pump's hot path.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any
from uuid import UUID

from django_workpump.db.queries import fetch_named, fetch_sql
from django_workpump.sql import named_queries

QUERIES = "console.sql"


def counts_sql(name: str, step: int) -> str:
    """Query ``name`` with its ``{counts}`` read a minute at a time (a step of 1) or in
    bins of ``step`` minutes (the rollup where it is folded)."""
    queries = named_queries(QUERIES)
    part = queries["counts_by_minute" if step == 1 else "counts_binned"]
    return queries[name].replace("{counts}", part)


def _counts(name: str, params: dict[str, Any], using: str | None) -> list[dict[str, Any]]:
    """Rows of query ``name`` (counts_sql). Its minutes are finite by its own filters, so
    no slow loader for the rare time Python cannot hold."""
    sql = counts_sql(name, params["step"])
    return fetch_sql(sql, params, using=using, readable_times=False)


def _one(name: str, params: dict[str, Any], using: str | None) -> Any:
    (row,) = fetch_named(QUERIES, name, params, using=using)
    (value,) = row.values()
    return value


def console_sample(
    *,
    stale_after_seconds: int,
    definitively_dead_after_seconds: int,
    now: datetime | None = None,
    using: str | None = None,
) -> bool:
    """Sample the current minute's backlog and instances (alive by the liveness rule at
    these cutoffs), unless a peer already did."""
    params = {
        "stale_after_seconds": stale_after_seconds,
        "definitively_dead_after_seconds": definitively_dead_after_seconds,
        "now": now,
    }
    return bool(_one("console_sample", params, using))


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


def _series(
    name: str,
    since: datetime,
    until: datetime,
    step: int,
    using: str | None,
    filters: dict[str, Any],
) -> list[dict[str, Any]]:
    """Query ``console_total_<name>`` (a few rows a minute, not one per topic; by
    instance too) without a topic, else ``console_<name>`` of that one topic."""
    params = _window(since, until, **filters)
    category, topic, instance_id = params["category"], params["topic"], params["instance_id"]
    if category is None and topic is None:
        total = {"since": since, "until": until, "step": step, "instance_id": instance_id}
        query = named_queries(QUERIES)[f"console_total_{name}"]
        return fetch_sql(query, total, using=using, readable_times=False)
    if category is None or topic is None or instance_id is not None:
        raise ValueError(
            f"console_{name} reads one topic (a category and a topic) or every topic (by"
            f" instance too), not category={category!r}, topic={topic!r},"
            f" instance_id={instance_id!r}."
        )
    one = {"since": since, "until": until, "step": step, "category": category, "topic": topic}
    return _counts(f"console_{name}", one, using)


def console_outcomes(
    since: datetime, until: datetime, *, step: int = 1, using: str | None = None, **filters: Any
) -> list[dict[str, Any]]:
    """Rows (minute, outcome, n) per bin of ``step`` minutes (its first minute); filters:
    category and topic, or instance_id."""
    return _series("outcomes", since, until, step, using, filters)


def console_latency(
    since: datetime, until: datetime, *, step: int = 1, using: str | None = None, **filters: Any
) -> list[dict[str, Any]]:
    """Rows (minute, bucket, n) of claims per bin of ``step`` minutes; filters: category
    and topic, or instance_id."""
    return _series("latency", since, until, step, using, filters)


def console_backlog(
    since: datetime,
    until: datetime,
    *,
    step: int = 1,
    category: str | None = None,
    topic: str | None = None,
    using: str | None = None,
) -> list[dict[str, Any]]:
    """Rows (minute, pending, scheduled, leased, oldest_pending_seconds): per bin of
    ``step`` minutes its last sampled minute, summed over the topics (of ``category`` and
    ``topic`` when given)."""
    params = {
        "since": since,
        "until": until,
        "step": step,
        "category": category,
        "topic": topic,
    }
    # finite minutes by its own filter: no slow loader
    return fetch_sql(
        named_queries(QUERIES)["console_backlog"], params, using=using, readable_times=False
    )


def console_instances(
    since: datetime,
    until: datetime,
    *,
    step: int = 1,
    instance_id: UUID | None = None,
    using: str | None = None,
) -> list[dict[str, Any]]:
    """Instance samples (minute, instance, heartbeat age, rows in flight): each
    instance's last sample in each bin of ``step`` minutes."""
    params = {"since": since, "until": until, "step": step, "instance_id": instance_id}
    # finite minutes by its own filter: no slow loader
    return fetch_sql(
        named_queries(QUERIES)["console_instances"], params, using=using, readable_times=False
    )


def console_topics(
    since: datetime,
    until: datetime,
    *,
    step: int = 1,
    limit: int = 50,
    using: str | None = None,
) -> list[dict[str, Any]]:
    """The busiest topics (a ``step`` of 10 minutes or more reads the rollup)."""
    params = {"since": since, "until": until, "step": step, "limit": limit}
    return _counts("console_topics", params, using)


def console_topic_outcomes(
    since: datetime,
    until: datetime,
    topics: list[tuple[str, str]],
    *,
    step: int = 1,
    using: str | None = None,
) -> list[dict[str, Any]]:
    params = {
        "since": since,
        "until": until,
        "step": step,
        "categories": [category for category, _ in topics],
        "topics": [topic for _, topic in topics],
    }
    return _counts("console_topic_outcomes", params, using)


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
