"""Helpers the tests import: SQL on the test transaction, fixed times, pump timings.

Fixtures live in tests/conftest.py, which pytest loads for every directory below it;
what a test module imports by name lives here, so no module imports a conftest.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import uuid
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any
from urllib.parse import quote

import psycopg
from django.db import connection

from django_workpump.pump.maintenance import MaintenanceWorker

# The tests package and the repository root: subprocess tests run from ROOT, and files
# read by tests are found from these rather than from each module's own place.
TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent

# Fixed instance ids: rank among live instances, and "returned in id order", follow their
# uuid order (A before B).
A = uuid.UUID("00000000-0000-0000-0000-00000000000a")
B = uuid.UUID("00000000-0000-0000-0000-00000000000b")

# A fixed point in time; SQL tests pass it (and offsets of it) as p_now.
T0 = datetime(2026, 1, 1, 12, 0, 0, tzinfo=UTC)


# Short pump timings for tests that run the pump: in-process (Supervisor) and in
# runworkpump subprocesses (passed as WORKPUMP_JSON). Files override single keys.
FAST_PUMP = {
    "HEARTBEAT_INTERVAL_SECONDS": 1,
    "STALE_AFTER_SECONDS": 3,
    "DEFINITIVELY_DEAD_AFTER_SECONDS": 10,
    "HEARTBEAT_SLOW_INTERVAL_SECONDS": 5,
    "STALE_PEER_PROBE_INTERVAL_SECONDS": 1,
    "POLLING_INTERVAL_MS": 50,
    "POLLING_MAX_INTERVAL_MS": 200,
    "NOTIFY_HEALTHY_POLLING_INTERVAL_MS": 200,
    "RETRY_BACKOFF_BASE_SECONDS": 0,
    "RETRY_BACKOFF_MAX_SECONDS": 0,
    "SHUTDOWN_TIMEOUT_SECONDS": 5,
}


FAST_PROCESS = {
    "HEARTBEAT_INTERVAL_SECONDS": 1,
    "HEARTBEAT_SLOW_INTERVAL_SECONDS": 2,
    "STALE_AFTER_SECONDS": 2,
    "DEFINITIVELY_DEAD_AFTER_SECONDS": 10,
    "STALE_PEER_PROBE_INTERVAL_SECONDS": 1,
    "POLLING_INTERVAL_MS": 100,
    "POLLING_MAX_INTERVAL_MS": 500,
    "NOTIFY_HEALTHY_POLLING_INTERVAL_MS": 500,
    "RETRY_BACKOFF_BASE_SECONDS": 0,
    "RETRY_BACKOFF_MAX_SECONDS": 0,
    "SHUTDOWN_TIMEOUT_SECONDS": 15,
    "STATUS_INTERVAL_SECONDS": 1,
}


def at(seconds: float) -> datetime:
    """T0 plus ``seconds``."""
    return T0 + timedelta(seconds=seconds)


def run_sql(
    query: str, params: dict[str, Any] | tuple[Any, ...] | None = None
) -> list[dict[str, Any]]:
    """Run SQL on Django's connection (inside the test's transaction); rows as dicts."""
    with connection.cursor() as cursor:
        cursor.execute(query, params)
        if cursor.description is None:
            return []
        names = [col.name for col in cursor.description]
        return [dict(zip(names, row, strict=True)) for row in cursor.fetchall()]


# Done rows per work table that give the planner a table worth reading by index.
PLAN_STATISTICS_ROWS = 2_000


PLAN_STATISTICS_SQL = [
    "INSERT INTO workpump_outbox (work_id, topic, payload, attempts, done_at)"
    " SELECT gen_random_uuid(), 'plan.done', '{}'::jsonb, 1, now() FROM generate_series(1, %(n)s)",
    "INSERT INTO workpump_inbox (work_id, topic, payload, attempts, done_at)"
    " SELECT gen_random_uuid(), 'plan.done', '{}'::jsonb, 1, now() FROM generate_series(1, %(n)s)",
    "INSERT INTO workpump_event (event_id, event_type, payload)"
    " SELECT gen_random_uuid(), 'plan.done', '{}'::jsonb FROM generate_series(1, %(n)s)",
    "INSERT INTO workpump_perspective_event (work_id, topic, event_id,"
    " attempts, done_at) SELECT gen_random_uuid(), 'plan.done', e.event_id, 1, now()"
    " FROM workpump_event e WHERE e.event_type = 'plan.done'",
    "INSERT INTO workpump_receptor_processing (work_id, topic, event_id, attempts,"
    " done_at) SELECT gen_random_uuid(), 'plan.done', e.event_id, 1, now()"
    " FROM workpump_event e WHERE e.event_type = 'plan.done'",
    "ANALYZE workpump_outbox, workpump_inbox, workpump_event, workpump_perspective_event,"
    " workpump_receptor_processing",
]


def give_the_planner_statistics(conn: psycopg.Connection[Any]) -> None:
    """Fill the work tables with done rows and ANALYZE them, in ``conn``'s transaction
    (the caller rolls it back).

    A plan test must not depend on what earlier tests or autovacuum left in the
    statistics (an ANALYZE inside a rolled-back test keeps its row counts): with its own
    statistics of a table mostly done, the planner makes the choice it makes in
    production, where the work tables hold far more done rows than undone ones.
    """
    for sql in PLAN_STATISTICS_SQL:
        conn.execute(sql, {"n": PLAN_STATISTICS_ROWS})


def explaining_connection(
    raw_connect: Callable[..., psycopg.Connection[Any]],
) -> tuple[psycopg.Connection[Any], list[str]]:
    """A raw connection that reports the plan of every (nested) statement as a NOTICE."""
    conn = raw_connect()
    plans: list[str] = []
    conn.add_notice_handler(lambda diag: plans.append(diag.message_primary or ""))
    conn.execute("LOAD 'auto_explain'")
    conn.execute("SET auto_explain.log_min_duration = 0")
    conn.execute("SET auto_explain.log_nested_statements = on")
    conn.execute("SET auto_explain.log_level = 'notice'")
    conn.execute("SET auto_explain.log_analyze = off")
    # The plan must not hinge on what earlier tests left in pg_class: an ANALYZE inside a
    # rolled-back test keeps its reltuples (an in-place update), and a never-analysed
    # table is sized by a heuristic. With sequential scans priced out, the planner still
    # picks among the indexes, and a claim predicate that no longer matches a partial
    # index's shows up here as another index or a Seq Scan.
    conn.execute("SET enable_seqscan = off")
    return conn, plans


def scalar(query: str, params: dict[str, Any] | tuple[Any, ...] | None = None) -> Any:
    rows = run_sql(query, params)
    assert len(rows) == 1, rows
    return next(iter(rows[0].values()))


def seq_scans(table: str) -> int:
    """Sequential scans of ``table`` in this transaction so far (the test's statements
    share one): how a test sees that a kept plan reached its rows through an index."""
    return scalar("SELECT seq_scan FROM pg_stat_xact_user_tables WHERE relname = %s", [table])


# category -> (table, key column) of the four work tables
WORK_TABLES = {
    "outbox": ("workpump_outbox", "work_id"),
    "inbox": ("workpump_inbox", "work_id"),
    "perspective_event": ("workpump_perspective_event", "work_id"),
    "receptor": ("workpump_receptor_processing", "work_id"),
}


def enroll(instance: uuid.UUID | None, now: datetime = T0) -> None:
    """Register ``instance`` (heartbeat at ``now``) unless it is registered or tombstoned.

    claim_work refuses unregistered instances. Unlike record_heartbeat this reaps nobody,
    so tests that set up stale peers keep them.
    """
    if instance is None:
        return
    run_sql(
        "INSERT INTO workpump_service_instance (instance_id, service_name, host_name,"
        " process_id, started_at, last_heartbeat_at, alive_lock_key)"
        " SELECT %(id)s, 'tests', 'localhost', 1, %(now)s, %(now)s,"
        "        nextval('workpump.alive_lock_key_seq')"
        " WHERE NOT EXISTS (SELECT 1 FROM workpump_eviction WHERE instance_id = %(id)s)"
        " ON CONFLICT (instance_id) DO NOTHING",
        {"id": instance, "now": now},
    )


def current_tokens(category: str, ids: Any) -> list[uuid.UUID] | None:
    """The lease tokens the rows hold now, parallel to ``ids`` (a random one where none).

    Tests of other fences pass these: the current attempt's token.
    """
    if ids is None:
        return None
    table, key = WORK_TABLES.get(category, WORK_TABLES["outbox"])
    rows = run_sql(f"SELECT {key} AS id, lease_token FROM {table} WHERE {key} = ANY (%s)", [ids])
    held = {r["id"]: r["lease_token"] for r in rows}
    return [held.get(i) or uuid.uuid4() for i in ids]


def conninfo() -> str:
    """A libpq conninfo string for the database Django's connection uses now."""
    params = connection.get_connection_params()
    params.pop("cursor_factory", None)
    params.pop("context", None)
    params.pop("prepare_threshold", None)
    params.pop("server_side_binding", None)
    return psycopg.conninfo.make_conninfo(**{k: v for k, v in params.items() if v is not None})


def new_id() -> uuid.UUID:
    return uuid.uuid4()


def wait_until(predicate: Callable[[], Any], timeout: float = 20.0) -> bool:
    """Poll ``predicate`` until it holds or ``timeout`` passes (waits on an Event)."""
    tick = threading.Event()
    for _ in range(int(timeout / 0.02)):
        if predicate():
            return True
        tick.wait(0.02)
    return bool(predicate())


def database_url() -> str:
    """A URL for the test database Django uses now (TCP, or a Unix socket as ?host=)."""
    params = connection.get_connection_params()
    host = str(params.get("host") or "localhost")
    port = params.get("port") or 5432
    user = params.get("user") or "postgres"
    if host.startswith("/"):  # a socket directory (the embedded server)
        return f"postgres://{user}@/{params['dbname']}?host={quote(host)}&port={port}"
    return f"postgres://{user}@{host}:{port}/{params['dbname']}"


class ScratchDatabase:
    """A database of its own on the test server, migrated by ``manage.py migrate``."""

    def __init__(self, url: str) -> None:
        self.url = url

    def migrate(self, *target: str) -> None:
        """Run ``migrate [app] [migration]`` on it in a subprocess (forward or back)."""
        env = {**os.environ, "DATABASE_URL": self.url, "WORKPUMP_JSON": json.dumps({})}
        command = [sys.executable, "-m", "django", "migrate", "-v0", "--settings"]
        subprocess.run(
            [*command, "tests.settings", *target], cwd=ROOT, env=env, check=True, timeout=120
        )

    def connect(self) -> psycopg.Connection[Any]:
        return psycopg.connect(self.url)


def drain(supervisor: Any, timeout: float = 30.0) -> int:
    """Wait for a --drain pump to finish and shut it down; return its exit code."""
    assert supervisor.wait(timeout), "the pump did not drain in time"
    return int(supervisor.shutdown())


def maintenance_worker(**overrides: Any) -> MaintenanceWorker:
    """A MaintenanceWorker on the default database that keeps ended rows a day and
    purges them two at a time (so a test sees the batches); ``overrides`` its options."""
    options: dict[str, Any] = {
        "alias": "default",
        "interval_seconds": 300,
        "retention_seconds": 24 * 3600,
        "stale_after_seconds": 30,
        "definitively_dead_after_seconds": 300,
        "batch": 2,
    }
    return MaintenanceWorker(**{**options, **overrides})


def unfinished_runs(pid: int) -> int:
    """Handler runs of process ``pid`` that mp_execution shows started and not finished."""
    return scalar("SELECT count(*) FROM mp_execution WHERE pid = %s AND finished_at IS NULL", [pid])


def got_going(pid: int, runs: int) -> bool:
    """Whether process ``pid`` is running a handler and has started ``runs`` or more."""
    return (
        unfinished_runs(pid) > 0
        and scalar("SELECT count(*) FROM mp_execution WHERE pid = %s", [pid]) >= runs
    )
