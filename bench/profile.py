"""Where the pump's drain time goes: py-spy on the worker, per-statement database time
(pg_stat_statements on the embedded server), and a sweep of the claim batch knobs."""

from __future__ import annotations

import collections
import os
import subprocess
import time
from pathlib import Path
from typing import Any

from bench import harness as h
from bench.throughput import Case, run_case

SPY = Path(h.PY).parent / "py-spy"


def _spy_summary(raw: Path) -> dict[str, Any]:
    threads: collections.Counter[str] = collections.Counter()
    inclusive: collections.Counter[str] = collections.Counter()
    connects: collections.Counter[str] = collections.Counter()
    total = 0
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack:
            continue
        frames = stack.split(";")
        n = int(count)
        total += n
        thread = frames[0].split(": ", 1)[-1]
        threads[thread] += n
        for frame in set(frames[1:]):
            if "django_workpump" in frame or "psycopg" in frame or "get_new_connection" in frame:
                inclusive[frame.split(" (")[0] + " (" + frame.split("/")[-1]] += n
        if any("get_new_connection" in f for f in frames):
            connects[thread] += n
    return {
        "samples": total,
        "threads": threads.most_common(),
        "top_frames": inclusive.most_common(25),
        "connect_samples_by_thread": connects.most_common(),
    }


def spy(server: h.Server, database: str, jobs: int, workdir: Path) -> dict[str, Any]:
    """Drain ``jobs`` with defaults while py-spy samples the worker (all threads, on-CPU)."""
    with server.connect(database) as conn:
        conn.execute(h.RESET_SQL["workpump"])
    h.produce("workpump", server, database, ["bulk", "--n", str(jobs)])
    raw = workdir / "profile-pyspy.raw"
    worker = h.start_worker("workpump", server, database, log_path=workdir / "profile-pyspy.log")
    try:
        time.sleep(1.0)
        subprocess.run(
            [
                str(SPY),
                "record",
                "--pid",
                str(worker.pid),
                "--duration",
                "10",
                "--rate",
                "250",
                "--format",
                "raw",
                "-o",
                str(raw),
                "--threads",
                "--nonblocking",
            ],
            check=True,
            capture_output=True,
            timeout=60,
        )
    finally:
        h.stop_worker(worker)
    return _spy_summary(raw)


def statements(server: h.Server, jobs: int, workdir: Path) -> dict[str, Any]:
    """Per-statement time of a default drain, from pg_stat_statements (embedded server)."""
    database = "wv_profile"
    h.install_schema("workpump", server, database)
    with server.connect() as conn:
        conn.execute("SELECT pg_stat_statements_reset()")
    run = run_case(server, database, Case("workpump", 1, None, jobs, name="profile"), 0, workdir)
    with server.connect() as conn:
        rows = conn.execute(
            "SELECT s.toplevel, s.calls, s.rows, s.total_exec_time, s.mean_exec_time, s.query"
            " FROM pg_stat_statements s JOIN pg_database d ON d.oid = s.dbid"
            " WHERE d.datname = %s ORDER BY s.total_exec_time DESC LIMIT 14",
            [database],
        ).fetchall()
    return {
        "rate": run.get("rate"),
        "jobs": jobs,
        "statements": [
            {
                "toplevel": top,
                "calls": int(calls),
                "rows": int(nrows),
                "total_ms": float(total),
                "mean_ms": float(mean),
                "query": " ".join(query.split())[:150],
            }
            for top, calls, nrows, total, mean, query in rows
        ],
    }


def enqueue_variants(server: h.Server, database: str, jobs: int) -> list[dict[str, Any]]:
    """Per-row ``workpump.send()`` against one set-based INSERT per batch of 1,000 (what a
    ``send_many`` would run, through the same insert trigger)."""
    out = []
    for variant, label in (
        ("send", "workpump.send() per row, 1,000 per transaction"),
        ("set", "one INSERT ... SELECT per 1,000 rows (a send_many prototype)"),
    ):
        with server.connect(database) as conn:
            conn.execute(h.RESET_SQL["workpump"])
        got = h.produce(
            "workpump", server, database, ["bulk", "--n", str(jobs), "--variant", variant]
        )
        out.append({"label": label, "rate": jobs / got["seconds"]})
    return out


SWEEP = [
    ("CLAIM_PREFETCH=2 (default)", {}, None),
    ("CLAIM_PREFETCH=10", {"CLAIM_PREFETCH": 10}, None),
    ("CLAIM_PREFETCH=30", {"CLAIM_PREFETCH": 30}, None),
    ("CLAIM_PREFETCH=100", {"CLAIM_PREFETCH": 100}, None),
    ("CONN_MAX_AGE=None (persistent), prefetch 2", {}, "none"),
    ("CLAIM_PREFETCH=100 + CONN_MAX_AGE=None", {"CLAIM_PREFETCH": 100}, "none"),
]


def sweep(server: h.Server, database: str, jobs: int, workdir: Path) -> list[dict[str, Any]]:
    out = []
    for label, settings, conn_max_age in SWEEP:
        os.environ.pop("BENCH_CONN_MAX_AGE", None)
        if conn_max_age:
            os.environ["BENCH_CONN_MAX_AGE"] = conn_max_age
        try:
            run = run_case(
                server, database, Case("workpump", 1, None, jobs, settings, "sweep"), 0, workdir
            )
        finally:
            os.environ.pop("BENCH_CONN_MAX_AGE", None)
        out.append({"label": label, "rate": run.get("rate"), "error": run.get("error")})
        h.log(f"profile sweep: {label}: {run.get('rate') or 0:.0f} jobs/s")
    return out
