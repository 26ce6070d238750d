"""Counting a work changelist without counting the whole table (docs/admin.md).

A count of every row of a table with millions of done rows costs a scan of them all,
on every page view. The paginator counts exactly up to ``EXACT_COUNT_LIMIT`` rows (a
count that stops there, cheap whatever the table holds) and, past it, takes the
planner's estimate of the filtered query, which the page shows as "about N".
"""

from __future__ import annotations

import json
from functools import cached_property
from typing import Any, cast

from django.core.paginator import Paginator
from django.db import connections
from django.db.models import QuerySet

from django_workpump.admin.expressions import ADMIN_QUERIES, bounding_fragment
from django_workpump.sql import named_queries

# Counted exactly up to here; past it the page says "about N" from the planner.
EXACT_COUNT_LIMIT = 10_000


class EstimatingPaginator(Paginator):
    """A paginator whose count is exact up to ``EXACT_COUNT_LIMIT``, estimated above."""

    estimated = False  # True once the count is the planner's estimate

    @cached_property
    def count(self) -> int:
        queryset = cast("QuerySet[Any]", self.object_list)
        rows = queryset.order_by().values("pk")
        capped = filtered_seqs_count(queryset, EXACT_COUNT_LIMIT + 1)
        if capped is None:
            capped = rows[: EXACT_COUNT_LIMIT + 1].count()
        if capped <= EXACT_COUNT_LIMIT:
            return capped
        self.estimated = True
        return max(planner_estimate(rows), capped)


def filtered_seqs_count(queryset: QuerySet[Any], limit: int) -> int | None:
    """The rows of ``queryset``, counted no further than ``limit``, when its one condition
    is a ``seq IN (FilteredSeqs)`` (the stuck, not-live, leased and orphaned filters): the
    fragment's rows are counted as they are read, without looking each up in the table.
    None for any other queryset."""
    query = filtered_seqs_count_sql(queryset, limit)
    if query is None:
        return None
    with connections[queryset.db].cursor() as cursor:
        cursor.execute(*query)
        (count,) = cursor.fetchone()
    return int(count)


def filtered_seqs_count_sql(queryset: QuerySet[Any], limit: int) -> tuple[str, list[Any]] | None:
    """The SQL of ``filtered_seqs_count`` and its parameters, or None."""
    fragment = bounding_fragment(queryset.query)
    if fragment is None:
        return None
    sql, params = fragment.select(connections[queryset.db], limit, ordered=False)
    return named_queries(ADMIN_QUERIES)["count_rows"].format(rows=sql), params


def planner_estimate(queryset: QuerySet[Any]) -> int:
    """The planner's estimate of the rows ``queryset`` returns (EXPLAIN, not run)."""
    plan = json.loads(queryset.explain(format="json"))
    return int(plan[0]["Plan"]["Plan Rows"])
