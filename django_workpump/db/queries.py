"""Running the named queries on a Django connection: the parameter check, rows as
dicts, report queries, and the per-transaction settings the admin's reads use.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import cache
from typing import Any

from django.db import connections, transaction

from django_workpump.conf import setting
from django_workpump.db.loaders import _readable_times
from django_workpump.sql import named_queries


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


def _scalar(name: str, params: dict[str, Any], using: str | None) -> Any:
    """The value of a query that returns one row of one column."""
    rows = _fetch(name, params, using)
    (value,) = rows[0].values()
    return value


def _column(rows: list[dict[str, Any]], column: str) -> list[Any]:
    return [row[column] for row in rows]


def _in_transaction(using: str | None) -> bool:
    """True inside a transaction the caller opened (a statement then is not its own):
    ``atomic()`` turns autocommit off, and so may the caller."""
    return not connections[_alias(using)].get_autocommit()


@contextmanager
def stored_times_readable(*, using: str | None = None) -> Iterator[None]:
    """Inside, every query on the connection reads a time Python cannot hold as a
    ``StoredTime`` instead of failing (the admin's pages: rows written through SQL)."""

    def wrapper(execute: Any, sql: Any, params: Any, many: bool, context: Any) -> Any:
        _readable_times(context["cursor"].cursor.adapters)
        return execute(sql, params, many, context)

    with connections[_alias(using)].execute_wrapper(wrapper):
        yield


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
    return fetch_sql(named_queries(path)[name], params, using=using)


def fetch_sql(
    sql: str,
    params: dict[str, Any] | None = None,
    *,
    using: str | None = None,
    readable_times: bool = True,
) -> list[dict[str, Any]]:
    """Run ``sql`` (a named query, or one put together from named parts); rows as dicts.

    A time Python cannot hold reads as a ``StoredTime``; ``readable_times=False`` skips
    that slower loader, for a query whose times are all finite by its own filters.
    """
    with connections[_alias(using)].cursor() as cursor:
        if readable_times:
            _readable_times(cursor.cursor.adapters)
        cursor.execute(sql, params or {})
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
