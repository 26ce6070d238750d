"""Claim latency: single-row ``claim_work`` round trips, on an empty outbox and on a backlog.

    DATABASE_URL=postgres://... python bench/claim_latency.py [--calls 2000] [--backlog 100000]
        [--topics all|named|prefix]

The database must be migrated first (``python -m django migrate --settings tests.settings``);
the script empties the work tables. Each timed call is the pump's own named query
``claim_work`` (all four categories, batch 1), committed, timed client-side. On the empty
table one row is sent before each call; on the backlog the rows are inserted up front with
set-based SQL and VACUUM ANALYZEd. Between calls (untimed) the claimed row is completed.
Fifty calls of warm-up are not counted. ``--topics`` chooses what the claimer names:
``all`` (NULL, every topic), ``named`` (its topics by name, as ``runworkpump`` passes
them: the outbox's ``bench.noop`` among a few others, the other categories a few names
each) or ``prefix`` (the same names but ``bench.noop``, which is claimed through the
prefix ``bench.`` instead, and a prefix per other category, as a pump with a
``django.tasks`` backend of empty QUEUES passes).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import uuid
from typing import Any

import psycopg

from django_workpump.sql import named_queries

WARMUP = 50
RESET_SQL = (
    "TRUNCATE workpump_outbox, workpump_inbox, workpump_perspective_event,"
    " workpump_receptor_processing, workpump_active_stream"
)
BACKLOG_SQL = """
INSERT INTO workpump_outbox (work_id, topic, payload, partition_number,
                             max_attempts, attempts, created_at)
SELECT gen_random_uuid(), 'bench.noop', jsonb_build_object('i', g), g %% 10000, 10, 0, now()
FROM generate_series(1, %s) g
"""
SEND_SQL = "SELECT workpump.send('bench.noop', '{}')"
COMPLETE_SQL = "SELECT count(*) FROM workpump.complete_work(%s, 'outbox', %s::uuid[], %s::uuid[])"
REGISTER_SQL = "SELECT workpump.record_heartbeat(%s, 'bench', 'localhost', 1)"


NAMED = {
    "outbox": ["bench.noop", "emails.welcome", "reports.daily"],
    "inbox": ["django.tasks:default:default", "stripe.webhook"],
    "perspective_event": ["order_totals"],
    "receptor": ["warehouse"],
}
PREFIXES = {"outbox": ["bench."], "inbox": ["django.tasks:open:"], "receptor": ["stock."]}


def choice(topics: str) -> tuple[str | None, str | None]:
    """The claim_work topics and topic prefixes (JSON) of a ``--topics`` choice."""
    if topics == "all":
        return None, None
    if topics == "named":
        return json.dumps(NAMED), None
    named = {**NAMED, "outbox": [t for t in NAMED["outbox"] if t != "bench.noop"]}
    return json.dumps(named), json.dumps(PREFIXES)


def measure(
    conn: psycopg.Connection[Any], calls: int, send_each: bool, topics: str = "all"
) -> dict[str, float]:
    """Time ``calls`` single-row claims (after the warm-up); return milliseconds."""
    instance = uuid.uuid4()
    named, prefixes = choice(topics)
    params = {
        "instance_id": instance,
        "max_rows": 1,
        "lease_seconds": 300,
        "partition_count": 10_000,
        "categories": None,
        "stale_after_seconds": 30,
        "definitively_dead_after_seconds": 300,
        "now": None,
        "topics": named,
        "topic_prefixes": prefixes,  # ignored by a schema before version 11's query
        "stream_run_max": 100,  # the default; ignored by a schema before version 15's query
        "underserved_only": False,  # the default; ignored by a query that does not name it
        "synchronous_commit": "off",  # as the pump claims (CLAIM_SYNCHRONOUS_COMMIT False)
    }
    query = named_queries()["claim_work"]
    conn.execute(REGISTER_SQL, [instance])  # claim_work refuses unregistered instances
    timings = []
    for i in range(WARMUP + calls):
        if send_each:
            conn.execute(SEND_SQL)
        started = time.perf_counter_ns()
        rows = conn.execute(query, params).fetchall()
        elapsed = (time.perf_counter_ns() - started) / 1e6
        if len(rows) != 1:
            raise RuntimeError(f"claim {i} returned {len(rows)} rows, not 1")
        conn.execute(COMPLETE_SQL, [instance, [rows[0][1]], [rows[0][12]]])
        if i >= WARMUP:
            timings.append(elapsed)
    cuts = statistics.quantiles(timings, n=100)
    return {
        "p50_ms": round(statistics.median(timings), 3),
        "p90_ms": round(cuts[89], 3),
        "p99_ms": round(cuts[98], 3),
        "mean_ms": round(statistics.fmean(timings), 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--backlog", type=int, default=100_000)
    parser.add_argument("--topics", choices=["all", "named", "prefix"], default="all")
    args = parser.parse_args()
    url = os.environ.get("DATABASE_URL")
    if not url:
        sys.exit("Set DATABASE_URL to a database migrated with `manage.py migrate`.")
    results = {}
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(RESET_SQL)
        results["empty"] = measure(conn, args.calls, send_each=True, topics=args.topics)
        conn.execute(RESET_SQL)
        conn.execute(BACKLOG_SQL, [args.backlog])
        conn.execute("VACUUM ANALYZE workpump_outbox")
        results[f"backlog_{args.backlog}"] = measure(
            conn, args.calls, send_each=False, topics=args.topics
        )
        conn.execute(RESET_SQL)
    print(json.dumps({"calls": args.calls, "topics": args.topics, **results}))


if __name__ == "__main__":
    main()
