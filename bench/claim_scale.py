"""Claim scaling: ``claim_work`` latency with a small backlog versus a large backlog
plus many processed rows, in steady state.

Datasets are written with set-based SQL straight into workpump_outbox (stream NULL, so
the insert trigger only marks each row its own stream head), then VACUUM ANALYZE. Each
measured call is the pump's own named query ``claim_work`` (all four categories, batch
100), committed; between calls (not timed) the claimed rows are completed and 100 new
pending rows are inserted, so the backlog stays the same size throughout.
"""

from __future__ import annotations

import hashlib
import time
import uuid
from typing import Any

from bench import harness as h
from django_workpump.sql import named_queries

INSERT_SQL = """
INSERT INTO workpump_outbox (work_id, topic, payload, partition_number,
                             max_attempts, attempts, done_at, claimed_at, created_at)
SELECT gen_random_uuid(), 'bench.noop', jsonb_build_object('i', g), g %% 10000, 10,
       %(attempts)s::integer, %(done_at)s::timestamptz, %(done_at)s::timestamptz, now()
FROM generate_series(%(lo)s::bigint, %(hi)s::bigint) g
"""
COMPLETE_SQL = "SELECT count(*) FROM workpump.complete_work(%s, 'outbox', %s::uuid[], %s::uuid[])"
REGISTER_SQL = "SELECT workpump.record_heartbeat(%s, 'bench', 'localhost', 1)"
CHUNK = 500_000


def _fingerprint() -> str:
    """Changes when the workpump SQL or migrations change (then the data is rebuilt)."""
    digest = hashlib.sha256()
    root = h.ROOT / "django_workpump"
    for path in sorted([*root.glob("sql/**/*.sql"), *root.glob("migrations/*.py")]):
        digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def _insert(conn: Any, count: int, processed: bool) -> None:
    lo = 0
    while lo < count:
        hi = min(lo + CHUNK, count) - 1
        conn.execute(
            INSERT_SQL,
            {
                "lo": lo,
                "hi": hi,
                "attempts": 1 if processed else 0,
                "done_at": "2000-01-01T00:00:00Z" if processed else None,
            },
        )
        lo = hi + 1


def build(server: h.Server, database: str, pending: int, processed: int) -> dict[str, Any]:
    """Create the dataset unless an identical one (same SQL, same sizes) exists."""
    meta = f"{_fingerprint()}:{pending}:{processed}"
    # Measuring changes a dataset (it completes rows), so only the big one, costly to
    # build, is reused across runs (each run adds 2% to its processed rows).
    if pending + processed >= 1_000_000 and server.exists(database):
        try:
            with server.connect(database) as conn:
                found = conn.execute("SELECT meta FROM bench_meta").fetchone()
            if found and found[0] == meta:
                return {"reused": True, "build_seconds": 0.0}
        except Exception:  # noqa: BLE001 - anything odd: rebuild
            pass
    started = time.monotonic()
    h.install_schema("workpump", server, database)
    with server.connect(database) as conn:
        _insert(conn, processed, processed=True)  # older rows first: the done history
        _insert(conn, pending, processed=False)
        conn.execute("VACUUM ANALYZE workpump_outbox")
        conn.execute("CREATE TABLE bench_meta (meta text)")
        conn.execute("INSERT INTO bench_meta VALUES (%s)", [meta])
    return {"reused": False, "build_seconds": time.monotonic() - started}


def claim_params(instance: uuid.UUID, batch: int) -> dict[str, Any]:
    """The pump's claim_work parameters, as runworkpump's defaults pass them (every topic)."""
    return {
        "instance_id": instance,
        "max_rows": batch,
        "lease_seconds": 300,
        "partition_count": 10_000,
        "categories": None,
        "stale_after_seconds": 30,
        "definitively_dead_after_seconds": 300,
        "now": None,
        "topics": None,
        "topic_prefixes": None,
        "stream_run_max": 100,
        "underserved_only": False,
        "synchronous_commit": "off",  # as the pump claims (CLAIM_SYNCHRONOUS_COMMIT False)
    }


def measure(server: h.Server, database: str, calls: int, batch: int = 100) -> dict[str, Any]:
    query = named_queries()["claim_work"]
    instance = uuid.uuid4()
    params = claim_params(instance, batch)
    timings: list[float] = []
    claimed = 0
    with server.connect(database) as conn:
        conn.execute(REGISTER_SQL, [instance])  # claim_work refuses unregistered instances
        for i in range(calls):
            t0 = time.perf_counter_ns()
            rows = conn.execute(query, params).fetchall()
            timings.append((time.perf_counter_ns() - t0) / 1e6)
            ids = [row[1] for row in rows]
            tokens = [row[12] for row in rows]  # lease_token, as the named query orders it
            claimed += len(ids)
            if ids:
                conn.execute(COMPLETE_SQL, [instance, ids, tokens])
            conn.execute(
                INSERT_SQL,
                {
                    "lo": 10**9 + i * batch,
                    "hi": 10**9 + (i + 1) * batch - 1,
                    "attempts": 0,
                    "done_at": None,
                },
            )
        sizes = conn.execute(
            "SELECT count(*) FILTER (WHERE done_at IS NULL),"
            " count(*) FILTER (WHERE done_at IS NOT NULL) FROM workpump_outbox"
        ).fetchone()
    return {
        "calls": calls,
        "batch": batch,
        "rows_per_call": claimed / calls,
        "p50_ms": h.percentile(timings, 50),
        "p95_ms": h.percentile(timings, 95),
        "p99_ms": h.percentile(timings, 99),
        "mean_ms": sum(timings) / len(timings),
        "pending_after": sizes[0],
        "processed_after": sizes[1],
    }


def explain(server: h.Server, database: str, batch: int = 100) -> list[str]:
    """The plans of the statements one claim runs (auto_explain, nested), rolled back."""
    notices: list[str] = []
    query = named_queries()["claim_work"]
    with server.connect(database) as conn:
        conn.add_notice_handler(lambda diag: notices.append(diag.message_primary or ""))
        for setting in (
            "LOAD 'auto_explain'",
            "SET auto_explain.log_min_duration = 0",
            "SET auto_explain.log_nested_statements = on",
            "SET auto_explain.log_analyze = on",
            "SET auto_explain.log_buffers = on",
            "SET auto_explain.log_level = 'notice'",
            "SET client_min_messages = 'notice'",
        ):
            conn.execute(setting)
        conn.execute("BEGIN")
        instance = uuid.uuid4()
        conn.execute(REGISTER_SQL, [instance])
        conn.execute(query, claim_params(instance, batch)).fetchall()
        conn.execute("ROLLBACK")
    plans = [n for n in notices if n.startswith("duration:")]
    return [p for p in plans if "workpump_outbox" in p]


def run(server: h.Server, sizes: list[tuple[str, str, int, int]], calls: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for label, database, pending, processed in sizes:
        h.log(f"claim scaling: dataset {label} ({pending:,} pending + {processed:,} processed)")
        built = build(server, database, pending, processed)
        h.log(
            f"claim scaling: {label} ready ({'reused' if built['reused'] else 'built'}"
            f" in {built['build_seconds']:.0f} s); {calls} claims"
        )
        plans = explain(server, database)
        result = measure(server, database, calls)
        out[label] = {
            "database": database,
            "pending": pending,
            "processed": processed,
            **built,
            **result,
            "plans": plans,
        }
    return out
