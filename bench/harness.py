"""Shared plumbing of the benchmark: databases, worker processes, marks and statistics."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
import psycopg

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "bench"
RESULTS = BENCH / "results"
PY = sys.executable
SYSTEMS = ("workpump", "pgqueuer", "procrastinate")
LABELS = {"workpump": "django-workpump", "pgqueuer": "PgQueuer", "procrastinate": "Procrastinate"}


def log(message: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {message}", flush=True)


# -- databases ---------------------------------------------------------------------
@dataclass(frozen=True)
class Server:
    """A PostgreSQL server reached as user postgres over TCP or a Unix socket."""

    host: str = "127.0.0.1"
    port: int = 5432
    user: str = "postgres"

    def url(self, database: str) -> str:
        if self.host.startswith("/"):  # a Unix socket directory
            return f"postgres://{self.user}@/{database}?host={self.host}&port={self.port}"
        return f"postgres://{self.user}@{self.host}:{self.port}/{database}"

    def conninfo(self, database: str) -> str:
        return f"host={self.host} port={self.port} user={self.user} dbname={database}"

    def connect(self, database: str = "postgres", **kwargs: Any) -> psycopg.Connection[Any]:
        return psycopg.connect(self.conninfo(database), autocommit=True, **kwargs)

    def recreate(self, database: str) -> None:
        with self.connect() as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{database}" WITH (FORCE)')
            conn.execute(f'CREATE DATABASE "{database}"')

    def drop(self, database: str) -> None:
        with self.connect() as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{database}" WITH (FORCE)')

    def exists(self, database: str) -> bool:
        with self.connect() as conn:
            row = conn.execute(
                "SELECT 1 FROM pg_database WHERE datname = %s", [database]
            ).fetchone()
            return row is not None

    def version(self) -> str:
        with self.connect() as conn:
            return str(conn.execute("SHOW server_version").fetchone()[0])


def system_server() -> Server:
    """The machine's PostgreSQL (BENCH_PG_HOST/BENCH_PG_PORT override 127.0.0.1:5432)."""
    return Server(
        host=os.environ.get("BENCH_PG_HOST", "127.0.0.1"),
        port=int(os.environ.get("BENCH_PG_PORT", "5432")),
    )


def worker_env(system: str, server: Server, database: str, marks: Path | None) -> dict[str, str]:
    dsn = f"postgresql://{server.user}@/{database}?host={server.host}&port={server.port}"
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "DATABASE_URL": server.url(database),
        "BENCH_PG_DSN": dsn,
        "PGDSN": dsn,  # pgq install reads it
    }
    if marks is not None:
        env["BENCH_MARKS"] = str(marks)
    else:
        env.pop("BENCH_MARKS", None)
    return env


def run_checked(cmd: Sequence[str], env: dict[str, str], what: str, timeout: float = 300) -> str:
    done = subprocess.run(
        cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout, check=False
    )
    if done.returncode != 0:
        raise RuntimeError(f"{what} failed ({done.returncode}):\n{done.stdout}\n{done.stderr}")
    return done.stdout


def install_schema(system: str, server: Server, database: str) -> None:
    """Create ``database`` afresh and install the system's schema with its own tool."""
    server.recreate(database)
    env = worker_env(system, server, database, None)
    if system == "workpump":
        cmd = [PY, "-m", "django", "migrate", "--settings=bench.settings", "-v", "0"]
    elif system == "pgqueuer":
        cmd = [PY, "-m", "pgqueuer", "install"]
    else:
        cmd = [PY, "-m", "procrastinate", "--app=bench.peers.proc_app.app", "schema", "--apply"]
    run_checked(cmd, env, f"schema install of {system} into {database}")


# Each case starts from the same tables: the console's counters and the workflow tables
# too (a drain that upserted into the minute's counter pages before it left the next
# drain of the round 10% slower, whichever case it was).
RESET_SQL = {
    "workpump": "TRUNCATE workpump_outbox, workpump_inbox, workpump_perspective_event,"
    " workpump_receptor_processing, workpump_event, workpump_inbox_dedup,"
    " workpump_active_stream, workpump_service_instance, workpump_eviction,"
    " workpump_dependency, workpump_batch, workpump_attempt_log, workpump_task_attempt,"
    " workpump_console_count, workpump_console_rollup, workpump_console_total,"
    " workpump_console_sample, workpump_console_backlog, workpump_console_instance,"
    " benchapp_benchrecord",
    "pgqueuer": "TRUNCATE pgqueuer, pgqueuer_log, pgqueuer_statistics",
    "procrastinate": "TRUNCATE procrastinate_jobs, procrastinate_events, procrastinate_workers"
    " CASCADE",
}
ANALYZE_SQL = {
    "workpump": "ANALYZE workpump_outbox",
    "pgqueuer": "ANALYZE pgqueuer",
    "procrastinate": "ANALYZE procrastinate_jobs",
}
# True while any job is not finished (cheap: answered from indexes or small scans).
LEFT_SQL = {  # each probe ordered by its partial index's key, so no probe is a seq scan
    "workpump": "SELECT EXISTS (SELECT 1 FROM workpump_outbox WHERE done_at IS NULL"
    " AND dead_lettered_at IS NULL AND stream_head AND instance_id IS NULL"
    " AND scheduled_for IS NULL AND NOT flow_controlled ORDER BY priority DESC, seq LIMIT 1)"
    # unleased flow-controlled rows (docs/flow-control.md): the _flow index (leased ones
    # are in _held, below), read from its newest end as the claim's probe reads it; not an
    # EXISTS, whose ORDER BY the planner drops: it scanned the table, stepping over every
    # row done so far, in each probe of a drain of such rows
    " OR (SELECT 1 FROM workpump_outbox WHERE done_at IS NULL"
    " AND dead_lettered_at IS NULL AND stream_head AND flow_controlled AND instance_id IS NULL"
    " ORDER BY topic DESC, concurrency_key DESC, fairness_key DESC LIMIT 1) IS NOT NULL"
    " OR EXISTS (SELECT 1 FROM workpump_outbox WHERE instance_id IS NOT NULL"
    " ORDER BY instance_id LIMIT 1)",
    "pgqueuer": "SELECT EXISTS (SELECT 1 FROM pgqueuer WHERE status = 'queued'"
    " ORDER BY priority, id DESC LIMIT 1)"
    " OR EXISTS (SELECT 1 FROM pgqueuer WHERE status = 'picked' ORDER BY updated LIMIT 1)",
    "procrastinate": "SELECT EXISTS (SELECT 1 FROM procrastinate_jobs"
    " WHERE status IN ('todo', 'doing') ORDER BY id LIMIT 1)",
}
DONE_COUNT_SQL = {
    "workpump": "SELECT count(*) FROM workpump_outbox WHERE done_at IS NOT NULL",
    "pgqueuer": "SELECT count(*) FROM pgqueuer_log WHERE status = 'successful'",
    "procrastinate": "SELECT count(*) FROM procrastinate_jobs WHERE status = 'succeeded'",
}


# -- worker processes --------------------------------------------------------------
def worker_cmd(system: str, concurrency: int | None, extra: Iterable[str] = ()) -> list[str]:
    """The worker command line; ``concurrency`` None = the system's default."""
    if system == "workpump":
        cmd = [PY, "-m", "django", "runworkpump", "--settings=bench.settings"]
        if concurrency is not None:
            cmd += ["--concurrency", str(concurrency)]
    elif system == "pgqueuer":
        cmd = [PY, "-m", "bench.peers.pgq_worker", "bench.peers.pgq_app:create"]
        if concurrency is not None:
            # a hard cap of picked jobs; PgQueuer wants it >= 2 x batch size
            batch = max(1, concurrency // 2)
            cmd += ["--batch-size", str(batch), "--max-concurrent-tasks", str(concurrency)]
    else:
        cmd = [PY, "-m", "procrastinate", "--app=bench.peers.proc_app.app", "worker"]
        if concurrency is not None:
            cmd += ["--concurrency", str(concurrency)]
    return [*cmd, *extra]


@dataclass
class Worker:
    system: str
    process: subprocess.Popen[bytes]
    log_path: Path
    rss_samples: list[int] = field(default_factory=list)

    @property
    def pid(self) -> int:
        return self.process.pid

    def rss(self) -> int:
        """Resident set size of the worker process and its children, in bytes."""
        try:
            proc = psutil.Process(self.pid)
            total = proc.memory_info().rss
            for child in proc.children(recursive=True):
                total += child.memory_info().rss
            return total
        except psutil.Error:
            return 0

    def sample(self) -> None:
        value = self.rss()
        if value:
            self.rss_samples.append(value)

    def output(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""


def start_worker(
    system: str,
    server: Server,
    database: str,
    *,
    concurrency: int | None = None,
    workpump: dict[str, Any] | None = None,
    marks: Path | None = None,
    log_path: Path,
    extra: Iterable[str] = (),
    prefix: Sequence[str] = (),
    extra_env: dict[str, str] | None = None,
) -> Worker:
    env = worker_env(system, server, database, marks)
    env["WORKPUMP_JSON"] = json.dumps(workpump or {})
    env.update(extra_env or {})
    log_path.parent.mkdir(parents=True, exist_ok=True)
    out = log_path.open("wb")
    process = subprocess.Popen(
        [*prefix, *worker_cmd(system, concurrency, extra)],
        cwd=ROOT,
        env=env,
        stdout=out,
        stderr=subprocess.STDOUT,
    )
    out.close()
    return Worker(system, process, log_path)


def stop_worker(worker: Worker, timeout: float = 20.0) -> int | None:
    """SIGTERM, then SIGKILL after ``timeout``; returns the exit code."""
    process = worker.process
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(10)
    return process.returncode


def kill_worker(worker: Worker) -> None:
    if worker.process.poll() is None:
        worker.process.kill()
        worker.process.wait(10)


class RssSampler:
    """Sample the RSS of some workers every ``interval`` seconds in a thread."""

    def __init__(self, workers: Sequence[Worker], interval: float = 0.25) -> None:
        self.workers = workers
        self.interval = interval
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            for worker in self.workers:
                worker.sample()

    def __enter__(self) -> RssSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def wait_for(predicate: Any, timeout: float, interval: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return bool(predicate())


def produce(
    system: str, server: Server, database: str, args: Sequence[str], timeout: float = 600
) -> dict[str, Any]:
    """Run ``python -m bench.produce`` and return its JSON line."""
    env = worker_env(system, server, database, None)
    out = run_checked(
        [PY, "-m", "bench.produce", system, *args], env, f"producer {system}", timeout
    )
    return json.loads(out.strip().splitlines()[-1])


def read_marks(path: Path) -> list[list[str]]:
    try:
        return [line.split() for line in path.read_text().splitlines() if line.strip()]
    except FileNotFoundError:
        return []


# -- statistics --------------------------------------------------------------------
def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile, q in [0, 100]."""
    if not values:
        return math.nan
    ordered = sorted(values)
    if len(ordered) == 1:
        return float(ordered[0])
    rank = (len(ordered) - 1) * q / 100
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return float(ordered[low] + (ordered[high] - ordered[low]) * (rank - low))


def median(values: Sequence[float]) -> float:
    return percentile(values, 50)


def save_json(name: str, data: Any) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps(data, indent=2, default=str))
    return path
