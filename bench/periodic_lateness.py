"""How late periodic slots fire: N runworkpump processes, one schedule every second.

    DATABASE_URL=postgres://postgres@127.0.0.1:5432/workpump_bench_periodic \
        python -m bench.periodic_lateness --processes 3 --seconds 20

The database is dropped and created, migrated, and N ``runworkpump`` processes run the
schedule of bench/periodic_app for the given time; then every slot in the window is
checked for exactly one outbox row, and the delay from slot time to the row's
created_at (firing) and to its done_at (handled) is summarised.
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import threading
from datetime import timedelta
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import psycopg

ROOT = Path(__file__).resolve().parent.parent


def recreate(url: str) -> None:
    parts = urlsplit(url)
    name = parts.path.lstrip("/")
    admin = urlunsplit(parts._replace(path="/postgres"))
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        conn.execute(f'CREATE DATABASE "{name}"')


def percentile(values: list[float], p: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(p / 100 * (len(ordered) - 1)))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--processes", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=20)
    args = parser.parse_args()
    url = os.environ["DATABASE_URL"]
    recreate(url)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "WORKPUMP_JSON": "{}"}
    django = [sys.executable, "-m", "django"]
    settings = "--settings=bench.periodic_settings"
    subprocess.run([*django, "migrate", "-v0", settings], cwd=ROOT, env=env, check=True)
    workers = [
        subprocess.Popen(
            [*django, "runworkpump", settings, "--service-name", f"periodic-{n}"],
            cwd=ROOT,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        for n in range(args.processes)
    ]
    with psycopg.connect(url, autocommit=True) as conn:
        # every instance registered before the window opens
        wait = threading.Event()
        while conn.execute("SELECT count(*) FROM workpump_service_instance").fetchone()[0] < len(
            workers
        ):
            wait.wait(0.1)
        start = conn.execute("SELECT date_trunc('second', now()) + interval '1 second'").fetchone()[
            0
        ]
        wait.wait(args.seconds + 1)
        end = start + timedelta(seconds=args.seconds - 1)
        for worker in workers:
            worker.send_signal(signal.SIGTERM)
        for worker in workers:
            worker.wait(60)
        rows = conn.execute(
            "SELECT (payload->>'slot')::timestamptz AS slot, count(*),"
            " extract(epoch FROM min(created_at) - (payload->>'slot')::timestamptz),"
            " extract(epoch FROM min(done_at) - (payload->>'slot')::timestamptz)"
            " FROM workpump_outbox WHERE topic = 'bench.periodic'"
            " AND (payload->>'slot')::timestamptz BETWEEN %s AND %s"
            " GROUP BY 1 ORDER BY 1",
            (start, end),
        ).fetchall()
    expected = int(args.seconds)
    counts = [row[1] for row in rows]
    fired = [float(row[2]) * 1000 for row in rows]
    handled = [float(row[3]) * 1000 for row in rows if row[3] is not None]
    print(f"processes={args.processes} window={start.isoformat()} + {expected} slots")
    print(
        f"slots with a row: {len(rows)}/{expected}; rows per slot: min {min(counts)} "
        f"max {max(counts)}"
    )
    for label, values in (
        ("fired (created_at - slot)", fired),
        ("handled (done_at - slot)", handled),
    ):
        print(
            f"{label}: p50 {statistics.median(values):.1f} ms, p95 "
            f"{percentile(values, 95):.1f} ms, max {max(values):.1f} ms"
        )


if __name__ == "__main__":
    main()
