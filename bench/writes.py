"""Write volume of liveness, counted by pg_stat_statements on the bench's embedded server.

Every instance gets a database of its own on one embedded PostgreSQL whose
pg_stat_statements tracks nested statements too (``track = all``), so a heartbeat that
is ``SELECT workpump.record_heartbeat(...)`` counts as the UPDATE it runs, the same as
PgQueuer's top-level UPDATE. All instances run at once through the same window.

A write statement is an INSERT, UPDATE, DELETE or MERGE that wrote: its
pg_stat_statements entry recorded WAL (``SELECT ... FOR UPDATE`` and ``ON CONFLICT DO
UPDATE`` are not counted apart). One that found nothing to change (an idle poll's UPDATE,
a DELETE of nothing) writes no WAL, no row version and no commit record; those are
counted apart, as no-op write statements, for every system alike. pg_stat_statements
cannot tell which calls of one entry wrote, so an entry that wrote at all counts every
call. pg_stat_user_tables deltas (rows inserted + updated + deleted) are reported beside.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench import harness as h

WRITE = re.compile(
    r"\b(INSERT\s+INTO|DELETE\s+FROM|MERGE\s+INTO|UPDATE\s+\S+(\s+(AS\s+)?\w+)?\s+SET)\b", re.I
)


def wrote(query: str, wal_records: int) -> bool:
    """Whether a pg_stat_statements entry is a write statement that wrote."""
    return wal_records > 0 and bool(WRITE.search(query))


def wrote_nothing(query: str, wal_records: int) -> bool:
    """Whether it is a write statement none of whose calls found anything to write."""
    return wal_records == 0 and bool(WRITE.search(query))


# Shortened lease so several renewal rounds fit the window: local lease = 60 - 30 s
# grace; renewal when a third of it (10 s) is left, so one round every ~20 s.
INFLIGHT_SETTINGS = {"LEASE_SECONDS": 60, "MAX_RENEWALS_PER_WORK": 1000}


@dataclass
class Instance:
    name: str
    system: str
    database: str
    description: str
    workpump: dict[str, Any] = field(default_factory=dict)
    concurrency: int | None = None
    hold: int = 0  # in-flight long jobs to hold
    worker: h.Worker | None = None


def instances(inflight_batch: bool) -> list[Instance]:
    items = [
        Instance(
            "workpump-idle-lock",
            "workpump",
            "wv_wp_lock",
            "django-workpump, idle, alive-lock held (defaults: slow beat every 60 s)",
        ),
        Instance(
            "workpump-idle-table",
            "workpump",
            "wv_wp_table",
            "django-workpump, idle, LIVENESS_SOURCE_MODE=heartbeat_table_only (beat every 10 s)",
            workpump={"LIVENESS_SOURCE_MODE": "heartbeat_table_only"},
        ),
        Instance(
            "workpump-inflight-1000",
            "workpump",
            "wv_wp_inflight",
            "django-workpump, 1,000 long jobs in flight (--concurrency 1000, LEASE_SECONDS=60)",
            workpump=dict(INFLIGHT_SETTINGS),
            concurrency=1000,
            hold=1000,
        ),
        Instance("pgqueuer-idle", "pgqueuer", "wv_pgq_idle", "PgQueuer, idle (defaults)"),
        Instance(
            "procrastinate-idle",
            "procrastinate",
            "wv_proc_idle",
            "Procrastinate, idle (defaults)",
        ),
        Instance(
            "pgqueuer-inflight-1000",
            "pgqueuer",
            "wv_pgq_inflight",
            "PgQueuer, 1,000 long jobs in flight (defaults: heartbeat timeout 30 s)",
            hold=1000,
        ),
        Instance(
            "procrastinate-inflight-1000",
            "procrastinate",
            "wv_proc_inflight",
            "Procrastinate, 1,000 long jobs in flight (--concurrency 1000)",
            concurrency=1000,
            hold=1000,
        ),
    ]
    if inflight_batch:
        items.insert(
            3,
            Instance(
                "workpump-inflight-1000-batch1000",
                "workpump",
                "wv_wp_inflight_b",
                "as above with RENEWAL_MAX_BATCH=1000",
                workpump={**INFLIGHT_SETTINGS, "RENEWAL_MAX_BATCH": 1000},
                concurrency=1000,
                hold=1000,
            ),
        )
    return items


HELD_SQL = {
    "workpump": "SELECT count(*) FROM workpump_outbox WHERE instance_id IS NOT NULL",
    "pgqueuer": "SELECT count(*) FROM pgqueuer WHERE status = 'picked'",
    "procrastinate": "SELECT count(*) FROM procrastinate_jobs WHERE status = 'doing'",
}


def _table_writes(server: h.Server, database: str) -> dict[str, int]:
    with server.connect(database) as conn:
        rows, commits = conn.execute(
            "SELECT (SELECT coalesce(sum(n_tup_ins + n_tup_upd + n_tup_del), 0)"
            "        FROM pg_stat_user_tables),"
            "       (SELECT xact_commit FROM pg_stat_database WHERE datname = current_database())"
        ).fetchone()
    return {"rows": int(rows), "xact_commit": int(commits)}


def _statements(server: h.Server) -> dict[str, list[dict[str, Any]]]:
    with server.connect() as conn:
        found = conn.execute(
            "SELECT d.datname, s.toplevel, s.calls, s.rows, s.wal_bytes, s.wal_records, s.query"
            " FROM pg_stat_statements s JOIN pg_database d ON d.oid = s.dbid"
        ).fetchall()
    out: dict[str, list[dict[str, Any]]] = {}
    for datname, toplevel, calls, rows, wal, wal_records, query in found:
        out.setdefault(datname, []).append(
            {
                "toplevel": toplevel,
                "calls": int(calls),
                "rows": int(rows),
                "wal_bytes": int(wal),
                "query": " ".join(query.split()),
                "write": wrote(query, int(wal_records)),
                "noop_write": wrote_nothing(query, int(wal_records)),
            }
        )
    return out


def run(
    server: h.Server, window: float, warmup: float, workdir: Path, batch: bool
) -> dict[str, Any]:
    items = instances(batch)
    for item in items:
        h.install_schema(item.system, server, item.database)
        if item.hold:
            h.produce(
                item.system,
                server,
                item.database,
                ["bulk", "--n", str(item.hold), "--task", "hold"],
            )
    try:
        for item in items:
            item.worker = h.start_worker(
                item.system,
                server,
                item.database,
                concurrency=item.concurrency,
                workpump=item.workpump,
                log_path=workdir / f"wv-{item.name}.log",
            )
        started = time.monotonic()
        for item in items:
            if item.hold:
                with server.connect(item.database) as conn:
                    ok = h.wait_for(
                        lambda c=conn, i=item: (
                            c.execute(HELD_SQL[i.system]).fetchone()[0] >= i.hold
                        ),
                        120,
                        0.5,
                    )
                if not ok:
                    raise RuntimeError(f"{item.name}: jobs not all in flight")
        time.sleep(max(0.0, warmup - (time.monotonic() - started)))
        before = {i.name: _table_writes(server, i.database) for i in items}
        with server.connect() as conn:
            conn.execute("SELECT pg_stat_statements_reset()")
        t0 = time.monotonic()
        time.sleep(window)
        statements = _statements(server)
        elapsed = time.monotonic() - t0
        after = {i.name: _table_writes(server, i.database) for i in items}
        rss = {i.name: (i.worker.rss() if i.worker else 0) / 2**20 for i in items}
        alive = {i.name: i.worker.process.poll() is None for i in items if i.worker}
    finally:
        for item in items:
            if item.worker is not None:
                if item.hold:
                    h.kill_worker(item.worker)
                else:
                    h.stop_worker(item.worker)
    per_minute = 60.0 / elapsed
    results = {}
    for item in items:
        entries = statements.get(item.database, [])
        writes = [e for e in entries if e["write"]]
        tops = [e for e in entries if e["toplevel"]]
        renew = [e for e in writes if "lease_renewals" in e["query"]]
        result = {
            "description": item.description,
            "system": item.system,
            "alive_at_end": alive.get(item.name),
            "write_statements_per_min": sum(e["calls"] for e in writes) * per_minute,
            "noop_write_statements_per_min": sum(e["calls"] for e in entries if e["noop_write"])
            * per_minute,
            "rows_written_per_min": sum(e["rows"] for e in writes) * per_minute,
            "toplevel_statements_per_min": sum(e["calls"] for e in tops) * per_minute,
            "wal_bytes_per_min": sum(e["wal_bytes"] for e in tops) * per_minute,
            "table_rows_per_min": (after[item.name]["rows"] - before[item.name]["rows"])
            * per_minute,
            "commits_per_min": (after[item.name]["xact_commit"] - before[item.name]["xact_commit"])
            * per_minute,
            "rss_mb": rss[item.name],
            "writes": sorted(
                (
                    {"calls": e["calls"], "rows": e["rows"], "query": e["query"][:160]}
                    for e in writes
                ),
                key=lambda e: -e["calls"],
            ),
            "noop_writes": sorted(
                (
                    {"calls": e["calls"], "query": e["query"][:160]}
                    for e in entries
                    if e["noop_write"]
                ),
                key=lambda e: -e["calls"],
            ),
        }
        if renew:
            calls = sum(e["calls"] for e in renew)
            rows = sum(e["rows"] for e in renew)
            rounds = rows / item.hold if item.hold else 0
            result["renewal_statements"] = calls
            result["renewed_rows"] = rows
            result["renewal_rounds"] = rounds
            result["renewal_statements_per_round"] = calls / rounds if rounds else None
        results[item.name] = result
    return {"window_seconds": elapsed, "instances": results}


def maintenance_pass(server: h.Server, database: str) -> dict[str, Any]:
    """One maintenance pass of an idle instance (every MAINTENANCE_INTERVAL_SECONDS)."""
    with server.connect() as conn:
        conn.execute("SELECT pg_stat_statements_reset()")
    env = h.worker_env("workpump", server, database, None)
    h.run_checked(
        [
            h.PY,
            "-c",
            "import django, os; os.environ['DJANGO_SETTINGS_MODULE']='bench.settings';"
            " django.setup();"
            " from django_workpump.pump.maintenance import MaintenanceWorker;"
            " r = MaintenanceWorker(alias='default', interval_seconds=300,"
            " retention_seconds=604800, stale_after_seconds=30,"
            " definitively_dead_after_seconds=300).run_once(); print(r)",
        ],
        env,
        "maintenance pass",
    )
    entries = _statements(server).get(database, [])
    writes = [e for e in entries if e["write"]]
    return {
        "write_statements": sum(e["calls"] for e in writes),
        "noop_write_statements": sum(e["calls"] for e in entries if e["noop_write"]),
        "rows_written": sum(e["rows"] for e in writes),
        "wal_bytes": sum(e["wal_bytes"] for e in entries if e["toplevel"]),
    }
