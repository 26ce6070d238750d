"""The hot path and scale-out: bulk and single enqueue and latency against PgQueuer,
renewal statements per window, and many ``runworkpump`` processes on one PostgreSQL.

Runs on the bench's embedded PostgreSQL (its own server: ``max_connections`` is raised
for 32 instances, which the machine's shared server cannot give) with every system on
the same server in the same run, so the ratios compare like with like.

- enqueue: ``send_many`` in batches of 1,000 against PgQueuer's batch ``enqueue``, and
  one ``send`` per call in autocommit (its own transaction) against one PgQueuer
  ``enqueue`` per call (asyncpg, autocommit).
- latency: the latency section's measurement (an idle, listening worker; single
  enqueues at a fixed gap) for both systems, back to back.
- renewals: 1,000 leased rows of two categories, renewed by a real ``LeaseRenewalWorker``
  and ``DatabaseCoordinator``; the statements its flush sends are counted.
- instances: 1, 2, 4 and 8 processes at the default ``CONCURRENCY`` and 32 at
  ``CONCURRENCY`` 1 drain a backlog of no-op jobs, committed by one ``send_many``
  transaction once every instance is registered, so every instance sees all of it at
  once and no producer shares the cores with the drain. 1 x 4 and 32 x 1 run
  ``REPEATS`` times, interleaved, and their medians are compared: on two cores the rate
  of one drain of 32 processes moves by up to a half between drains of the same code.
  Reported: the aggregate rate over the
  middle of the drain (10% to 90% done), each instance's share (its ``done=`` count),
  commits per second on the server (``pg_stat_database.xact_commit``), the server's
  share of the machine's CPU, connections per instance, and, after the drain, the rows
  the idle instances write per minute (``pg_stat_user_tables`` of the workpump tables).
"""

from __future__ import annotations

import json
import os
import re
import threading
import time
from pathlib import Path
from typing import Any

import psutil

from bench import harness as h
from bench.writes import wrote, wrote_nothing

DATABASES = {"workpump": "wp_bench_scale", "pgqueuer": "wp_bench_scale_pgqueuer"}
MAX_CONNECTIONS = 600
ENQUEUE_MANY = 20_000
ENQUEUE_SINGLE = 2_000
LATENCY_N = 200
LATENCY_ROUNDS = 9
LATENCY_GAP_MS = 20.0
IDLE_WINDOW_SECONDS = 90.0
REPEATS = 3
_DONE = re.compile(r"claimed=(\d+) done=(\d+)")


def _raise_max_connections(server: h.Server) -> h.Server:
    """Restart the embedded server with room for 32 instances; return how to reach it."""
    from bench import embedded

    with server.connect() as conn:
        current = int(conn.execute("SHOW max_connections").fetchone()[0])
        if current >= MAX_CONNECTIONS:
            return server
        conn.execute(f"ALTER SYSTEM SET max_connections = {MAX_CONNECTIONS}")
    h.log(f"scale: embedded PostgreSQL max_connections {current} -> {MAX_CONNECTIONS}")
    pg = embedded._server
    embedded._pg_ctl(pg, ["-w", "-m", "fast", "restart"])
    info = type(pg.get_postmaster_info()).read_from_pgdata(pg.pgdata)
    pg._postmaster_info = info
    return h.Server(host=str(info.socket_dir), port=int(info.port))


def _postmaster(server: h.Server) -> psutil.Process:
    """The server's postmaster: the parent of a backend, read while that backend lives."""
    with server.connect() as conn:
        pid = conn.execute("SELECT pg_backend_pid()").fetchone()[0]
        parent = psutil.Process(pid).parent()
    if parent is None:
        raise RuntimeError("scale: the backend has no parent process")
    return parent


def _server_cpu(postmaster: psutil.Process) -> float:
    """CPU seconds of the server: the postmaster and every backend it has now."""
    total = 0.0
    for proc in [postmaster, *postmaster.children(recursive=True)]:
        try:
            times = proc.cpu_times()
            total += times.user + times.system
        except psutil.Error:
            pass
    return total


def _scalar(server: h.Server, database: str, sql: str) -> Any:
    with server.connect(database) as conn:
        return conn.execute(sql).fetchone()[0]


COMMITS_SQL = "SELECT xact_commit FROM pg_stat_database WHERE datname = current_database()"
WRITES_SQL = (
    "SELECT coalesce(sum(n_tup_ins + n_tup_upd + n_tup_del), 0)::bigint FROM pg_stat_user_tables"
    " WHERE relname LIKE 'workpump\\_%'"
)


def _write_statements(server: h.Server, database: str) -> tuple[list[tuple[int, int, str]], int]:
    """The write statements that wrote to ``database`` since the last reset (calls, rows
    and text, most called first), and how many calls of write statements wrote nothing
    (bench/writes.py says how the two are told apart)."""
    with server.connect() as conn:
        found = conn.execute(
            "SELECT s.calls, s.rows, s.wal_records, s.query FROM pg_stat_statements s"
            " JOIN pg_database d ON d.oid = s.dbid WHERE d.datname = %s",
            [database],
        ).fetchall()
    writes = [(int(n), int(r), " ".join(q.split())) for n, r, w, q in found if wrote(q, int(w))]
    noop = sum(int(n) for n, _, w, q in found if wrote_nothing(q, int(w)))
    return sorted(writes, key=lambda item: -item[0]), noop


def enqueue(server: h.Server) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for system, database in DATABASES.items():
        with server.connect(database) as conn:
            conn.execute(h.RESET_SQL[system])
    many = h.produce(
        "workpump",
        server,
        DATABASES["workpump"],
        ["bulk", "--n", str(ENQUEUE_MANY), "--batch", "1000", "--variant", "many"],
    )
    pgq_many = h.produce(
        "pgqueuer",
        server,
        DATABASES["pgqueuer"],
        ["bulk", "--n", str(ENQUEUE_MANY), "--batch", "1000"],
    )
    single = h.produce(
        "workpump",
        server,
        DATABASES["workpump"],
        ["bulk", "--n", str(ENQUEUE_SINGLE), "--batch", "1", "--variant", "single"],
    )
    pgq_single = h.produce(
        "pgqueuer",
        server,
        DATABASES["pgqueuer"],
        ["bulk", "--n", str(ENQUEUE_SINGLE), "--batch", "1"],
    )
    for name, result in (
        ("workpump_send_many", many),
        ("pgqueuer_batch", pgq_many),
        ("workpump_send", single),
        ("pgqueuer_single", pgq_single),
    ):
        out[name] = {"n": result["n"], "rate": result["n"] / result["seconds"]}
    out["many_ratio_vs_pgqueuer"] = (
        out["workpump_send_many"]["rate"] / out["pgqueuer_batch"]["rate"]
    )
    out["single_ratio_vs_pgqueuer"] = out["workpump_send"]["rate"] / out["pgqueuer_single"]["rate"]
    h.log(
        "scale: enqueue "
        + ", ".join(f"{k} {v['rate']:,.0f}/s" for k, v in out.items() if isinstance(v, dict))
    )
    return out


def latency(server: h.Server, workdir: Path, rounds: int) -> dict[str, Any]:
    """Both systems in ``rounds`` rounds, the order alternating; percentiles of the
    pooled samples. One round each measured one order once: its ratio moved from 1.08
    to 1.43 between two runs of the same code. Three rounds pooled still moved from 0.72
    to 1.01 between runs of one code (either system's p50 by 15%), so nine are run
    (about 80 s per three)."""
    from bench import latency as lat

    runs = []
    for i in range(rounds):
        order = list(DATABASES.items())
        for system, database in order if i % 2 == 0 else reversed(order):
            runs.append(lat.run(system, server, database, LATENCY_N, LATENCY_GAP_MS, workdir, i))
    summary = lat.summarize(runs)
    ours, peer = summary["workpump"], summary["pgqueuer"]
    keys = ("rounds", "samples", "p50", "p95", "p99", "max", "p50_by_round", "p99_by_round")
    out: dict[str, Any] = {
        system: {key: summary[system][key] for key in keys} for system in summary
    }
    out["p50_ratio_vs_pgqueuer"] = ours["p50"] / peer["p50"]
    out["p99_ratio_vs_pgqueuer"] = ours["p99"] / peer["p99"]
    out["p50_ratio_by_round"] = [
        a / b for a, b in zip(ours["p50_by_round"], peer["p50_by_round"], strict=True)
    ]
    h.log(
        f"scale: latency ({rounds} rounds) p50 {ours['p50']:.2f} vs {peer['p50']:.2f} ms, "
        f"p99 {ours['p99']:.2f} vs {peer['p99']:.2f} ms"
    )
    return out


def renewals(server: h.Server) -> dict[str, Any]:
    env = h.worker_env("workpump", server, DATABASES["workpump"], None)
    env["WORKPUMP_JSON"] = "{}"
    out = h.run_checked([h.PY, "-m", "bench.scale", "renewals"], env, "renewal count")
    result = json.loads(out.strip().splitlines()[-1])
    h.log(f"scale: renewals {result}")
    return result


def _renewal_round() -> dict[str, Any]:
    """In a worker process (bench.settings): 1,000 leased rows, one renewal round."""
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "bench.settings")
    import django

    django.setup()
    from django.db import connection

    import django_workpump as workpump
    from django_workpump.clock import FrozenClock
    from django_workpump.pump.coordinator import DatabaseCoordinator, InstanceIdentity
    from django_workpump.pump.lease import LeaseHandle, LeaseRegistry
    from django_workpump.pump.renewal import LeaseRenewalWorker

    workpump.perspective("bench_renewal", events=["bench.renewal"])(lambda work: None)
    workpump.send_many("bench.noop", [{"i": i} for i in range(600)])
    workpump.emit_many("bench.renewal", [{"i": i} for i in range(400)])
    coordinator = DatabaseCoordinator(
        InstanceIdentity(service_name="bench-renewals"), ["outbox", "perspective_event"]
    )
    coordinator.heartbeat({})
    claimed = coordinator.claim(1000) + coordinator.claim(1000)
    clock = FrozenClock(start=0.0)
    leases = LeaseRegistry()
    for row in claimed:
        leases.register(
            LeaseHandle(row.category, row.work_id, 50.0, 6, clock, lease_token=row.lease_token)
        )
    worker = LeaseRenewalWorker(
        coordinator, leases, lease_seconds=300, lease_grace_seconds=30, clock=clock
    )
    statements: list[str] = []

    def count(execute: Any, sql: str, params: Any, many: bool, context: Any) -> Any:
        statements.append(sql)
        return execute(sql, params, many, context)

    windows = 3
    for _ in range(windows):
        with connection.execute_wrapper(count):
            worker.run_once()
            while worker.flusher.flush_once():
                pass
        clock.advance(200)  # to the next renewal window of every handle
    coordinator.deregister()
    renew = sum("renew_leases" in sql for sql in statements)
    categories = len({row.category for row in claimed})
    return {
        "rows": len(claimed),
        "categories": categories,
        "windows": windows,
        "renewed": worker.renewed,
        "renew_statements": renew,
        "statements_per_category_per_window": renew / windows / categories,
    }


def _drain(
    server: h.Server, workdir: Path, processes: int, concurrency: int | None, jobs: int, idle: float
) -> dict[str, Any]:
    database = DATABASES["workpump"]
    with server.connect(database) as conn:
        conn.execute(h.RESET_SQL["workpump"])
    tag = f"p{processes}c{concurrency or 'd'}"
    workers = [
        h.start_worker(
            "workpump",
            server,
            database,
            concurrency=concurrency,
            log_path=workdir / f"scale-{tag}-{i}.log",
            extra=["--service-name", f"scale-{i}"],
            extra_env={"BENCH_CONN_MAX_AGE": "none"},
        )
        for i in range(processes)
    ]
    postmaster = _postmaster(server)
    try:
        registered = h.wait_for(
            lambda: (
                _scalar(server, database, "SELECT count(*) FROM workpump_service_instance")
                >= processes
            ),
            300,
            0.5,
        )
        if not registered:
            raise RuntimeError(f"scale {tag}: not every instance registered")
        time.sleep(2.0)
        connections = _scalar(
            server,
            database,
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
            " AND application_name LIKE 'workpump%'",
        )
        # Sampled on a thread of its own from before the enqueue: the drain starts while
        # the producer still runs.
        samples: list[tuple[float, int, int, float]] = []
        stop = threading.Event()

        def sample() -> None:
            with server.connect(database) as conn:
                while not stop.is_set():
                    done = conn.execute(h.DONE_COUNT_SQL["workpump"]).fetchone()[0]
                    commits = conn.execute(COMMITS_SQL).fetchone()[0]
                    samples.append((time.monotonic(), done, commits, _server_cpu(postmaster)))
                    if done >= jobs:
                        return
                    stop.wait(0.1)

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        # The whole backlog in one transaction. Produced in batches while the drain ran,
        # the producer got a thirty-third of two cores and was the bound: 20,000 rows
        # took it 7.6 s beside 32 draining instances, and 0.5 s in one transaction,
        # while no row can be claimed yet.
        produced = h.produce(
            "workpump",
            server,
            database,
            ["bulk", "--n", str(jobs), "--batch", str(jobs), "--variant", "many"],
        )
        sampler.join(600)
        stop.set()
        if not samples or samples[-1][1] < jobs:
            raise RuntimeError(f"scale {tag}: the drain did not finish")
        low = next(s for s in samples if s[1] >= jobs * 0.1)
        high = next(s for s in samples if s[1] >= jobs * 0.9)
        seconds = high[0] - low[0]
        result: dict[str, Any] = {
            "processes": processes,
            "concurrency": concurrency or 4,
            "jobs": jobs,
            "rate": (high[1] - low[1]) / seconds if seconds > 0 else None,
            "commits_per_s": (high[2] - low[2]) / seconds if seconds > 0 else None,
            "server_cpu_share": (high[3] - low[3]) / seconds / (os.cpu_count() or 1)
            if seconds > 0
            else None,
            "connections_per_instance": connections / processes,
            "produce_seconds": produced["seconds"],
        }
        if idle > 0:
            # Outcomes flushed, heartbeats back to their idle pace, and the drain's table
            # counters reported (a backend sends its counters at most every 10 s when idle).
            time.sleep(12.0)
            # The drain's dead row versions vacuumed first: a statement that reads a page
            # holding them prunes it and writes WAL for that, so the eviction check (a
            # DELETE that found nothing) counted as a write in one run.
            with server.connect(database) as conn:
                conn.execute("VACUUM")
            writes0 = _scalar(server, database, WRITES_SQL)
            commits0 = _scalar(server, database, COMMITS_SQL)
            with server.connect() as conn:  # the extension lives in the server's own database
                conn.execute("SELECT pg_stat_statements_reset()")
            time.sleep(idle)
            statements, noop = _write_statements(server, database)
            writes1 = _scalar(server, database, WRITES_SQL)
            commits1 = _scalar(server, database, COMMITS_SQL)
            minutes = idle / 60
            result["idle_row_writes_per_instance_per_min"] = (
                (writes1 - writes0) / processes / minutes
            )
            result["idle_commits_per_instance_per_min"] = (
                (commits1 - commits0) / processes / minutes
            )
            result["idle_write_statements_per_instance_per_min"] = (
                sum(calls for calls, _, _ in statements) / processes / minutes
            )
            result["idle_noop_write_statements_per_instance_per_min"] = noop / processes / minutes
            result["idle_write_statements"] = [
                {"calls": calls, "rows": rows, "query": query[:160]}
                for calls, rows, query in statements
            ]
    finally:
        for worker in workers:
            h.stop_worker(worker)
    shares = []
    for worker in workers:
        found = _DONE.findall(worker.output())
        shares.append(int(found[-1][1]) if found else 0)
    mean = sum(shares) / len(shares)
    result["shares"] = shares
    result["share_spread"] = max(abs(s - mean) for s in shares) / mean if mean else None
    h.log(
        f"scale {tag}: {result['rate'] or 0:,.0f} jobs/s, shares {shares}, "
        f"{result['commits_per_s'] or 0:,.0f} commits/s, "
        f"server CPU {result['server_cpu_share'] or 0:.0%}"
    )
    return result


def instances(server: h.Server, workdir: Path, quick: bool) -> dict[str, Any]:
    jobs = 10_000 if quick else 20_000
    repeats = 1 if quick else REPEATS
    # quick mode: 1 and 8 processes only; the 32 (and its idle writes) are a full run's
    # measurement (starting 32 processes on two cores takes longer than the drain)
    runs = [
        _drain(server, workdir, k, None, jobs, 0.0) for k in ((1, 8) if quick else (1, 2, 4, 8))
    ]
    if not quick:
        runs.append(_drain(server, workdir, 1, 1, jobs // 2, 0.0))
        runs.append(_drain(server, workdir, 32, 1, jobs, IDLE_WINDOW_SECONDS))
    for repeat in range(1, repeats):
        for processes, concurrency in ((1, None), (32, 1)):
            run = _drain(server, workdir, processes, concurrency, jobs, 0.0)
            run["repeat"] = repeat
            runs.append(run)

    def of(tag: str, key: str) -> list[Any]:
        return [r[key] for r in runs if f"p{r['processes']}c{r['concurrency']}" == tag]

    one = h.median(of("p1c4", "rate"))
    p32 = of("p32c1", "rate")  # none in quick mode
    idle = next((r for r in runs if "idle_write_statements" in r), {})
    return {
        "runs": runs,
        "repeats": repeats,
        "scale_8_vs_1_ratio": of("p8c4", "rate")[0] / one,
        "scale_32_vs_1_ratio": h.median(p32) / one if p32 else None,
        "scale_32_vs_1_ratio_by_repeat": (
            [a / b for a, b in zip(p32, of("p1c4", "rate"), strict=True)] if p32 else []
        ),
        "scale_32_share_spread": h.median(of("p32c1", "share_spread")) if p32 else None,
        "idle_row_writes_per_instance_per_min": idle.get("idle_row_writes_per_instance_per_min"),
        "idle_write_statements_per_instance_per_min": idle.get(
            "idle_write_statements_per_instance_per_min"
        ),
        "idle_noop_write_statements_per_instance_per_min": idle.get(
            "idle_noop_write_statements_per_instance_per_min"
        ),
    }


def run(server: h.Server, workdir: Path, quick: bool) -> dict[str, Any]:
    server = _raise_max_connections(server)
    for system, database in DATABASES.items():
        h.install_schema(system, server, database)
    out = {
        "server": f"embedded PostgreSQL {server.version()} (max_connections {MAX_CONNECTIONS})",
        "enqueue": enqueue(server),
        "latency": latency(server, workdir, 1 if quick else LATENCY_ROUNDS),
        "renewals": renewals(server),
        "instances": instances(server, workdir, quick),
    }
    for database in DATABASES.values():
        server.drop(database)
    return out


if __name__ == "__main__":
    import sys

    if sys.argv[1:] == ["renewals"]:
        print(json.dumps(_renewal_round()))
