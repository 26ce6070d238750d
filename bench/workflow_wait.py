"""Waiting for results: how soon ``workpump.wait`` returns after the last completion.

In one run, two measurements on the bench's own database:

- pickup latency, as the latency section measures it (an idle, listening runworkpump
  worker; single sends at a fixed gap; send commit -> handler start);
- wait latency: a row is leased to a holder (another connection of this process), a
  waiter thread calls ``workpump.wait([id])`` with a poll interval far longer than the
  run (so only the NOTIFY can wake it), and once the waiter is blocked the holder
  completes the row; completion commit (after COMMIT returned) -> ``wait`` returned.

``workflow_wait_vs_pickup_ratio`` is the wait p50 over the pickup p50 (target <= 2).
Run alone: ``python -m bench.workflow_wait --n 200`` (DATABASE_URL names an empty
database it may migrate; prints one JSON object), or as the ``workflow`` section of
``bench/run.py``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import uuid
from pathlib import Path
from typing import Any

HOLDER = uuid.UUID("00000000-0000-0000-0000-0000000000b7")
NEVER = 3600.0  # the waiter's poll interval: only a notification wakes it in time


def measure_waits(n: int) -> list[float]:
    """Milliseconds from each completion's commit to its waiter's return."""
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "bench.settings")
    import django

    django.setup()
    import psycopg

    import django_workpump as workpump
    from bench.marks import now_ns
    from django_workpump.pump.supervisor import listen_conninfo

    conninfo = listen_conninfo({"LISTEN_DSN": None, "DATABASE_ALIAS": "default"})
    holder = psycopg.connect(conninfo, autocommit=True)
    probe = psycopg.connect(conninfo, autocommit=True)
    holder.execute(
        "SELECT workpump.record_heartbeat(p_instance_id => %s, p_service_name => 'bench',"
        " p_host_name => 'bench', p_process_id => 0)",
        [HOLDER],
    )
    waits: list[float] = []
    for i in range(n):
        work_id = workpump.send("bench.waited", {"i": i})
        [(token,)] = holder.execute(
            "SELECT lease_token FROM workpump.claim_work(p_instance_id => %s,"
            ' p_topics => \'{"outbox": ["bench.waited"]}\'::jsonb)',
            [HOLDER],
        ).fetchall()
        returned: list[int] = []

        def waiter(work_id: uuid.UUID = work_id, returned: list[int] = returned) -> None:
            workpump.wait([work_id], timeout=60, poll_seconds=NEVER)
            returned.append(now_ns())

        thread = threading.Thread(target=waiter)
        thread.start()
        # the waiter is blocked on its socket once its session idles after its read
        while not probe.execute(
            "SELECT EXISTS (SELECT 1 FROM pg_stat_activity WHERE datname = current_database()"
            " AND state = 'idle' AND query LIKE '%%workpump.work_outcomes%%')"
        ).fetchone()[0]:
            threading.Event().wait(0.001)
        holder.execute(
            "SELECT * FROM workpump.complete_work(%s, 'outbox', ARRAY[%s]::uuid[],"
            " ARRAY[%s]::uuid[])",
            [HOLDER, work_id, token],
        )
        committed = now_ns()
        thread.join(60)
        waits.append((returned[0] - committed) / 1e6)
    holder.close()
    probe.close()
    return waits


def run(server: Any, database: str, n: int, gap_ms: float, workdir: Path) -> dict[str, Any]:
    """Both measurements on ``database`` (installed afresh); the section's data."""
    from bench import harness as h
    from bench import latency

    h.install_schema("workpump", server, database)
    pickup = latency.run("workpump", server, database, n, gap_ms, workdir, 0)
    env = h.worker_env("workpump", server, database, None)
    out = h.run_checked(
        [h.PY, "-m", "bench.workflow_wait", "--waits-only", "--n", str(n)],
        env,
        "workflow wait measurement",
        timeout=600,
    )
    waits = json.loads(out.strip().splitlines()[-1])["wait_ms"]
    return summarize(pickup["lat_ms"], waits)


def summarize(pickup_ms: list[float], wait_ms: list[float]) -> dict[str, Any]:
    from bench import harness as h

    pickup_p50, wait_p50 = h.percentile(pickup_ms, 50), h.percentile(wait_ms, 50)
    return {
        "n": len(wait_ms),
        "pickup_p50_ms": pickup_p50,
        "pickup_p99_ms": h.percentile(pickup_ms, 99),
        "wait_p50_ms": wait_p50,
        "wait_p99_ms": h.percentile(wait_ms, 99),
        "wait_max_ms": max(wait_ms),
        "workflow_wait_vs_pickup_ratio": wait_p50 / pickup_p50,
        "wait_ms": wait_ms,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--n", type=int, default=200)
    parser.add_argument("--gap-ms", type=float, default=50)
    parser.add_argument("--waits-only", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    if args.waits_only:
        print(json.dumps({"wait_ms": measure_waits(args.n)}), flush=True)
        return
    import tempfile
    from urllib.parse import urlsplit

    from bench import harness as h

    url = urlsplit(os.environ["DATABASE_URL"])
    server = h.Server(host=url.hostname or "127.0.0.1", port=url.port or 5432)
    data = run(server, url.path.lstrip("/"), args.n, args.gap_ms, Path(tempfile.mkdtemp()))
    data.pop("wait_ms")
    print(json.dumps(data), flush=True)


if __name__ == "__main__":
    main()
