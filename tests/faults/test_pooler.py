"""Scenario 5: a transaction pooler (Debian's pgbouncer) in front of the test database.

The pump runs in ``heartbeat_table_only`` mode with its Django connections through
pgbouncer in transaction mode and ``LISTEN_DSN`` pointing straight at PostgreSQL. While
it works, the pooler is reloaded and its server connections are killed over and over.
No instance may be evicted, and everything is processed, in order, nothing lost.
"""

from __future__ import annotations

import os
import pwd
import shutil
import signal
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest

from tests.faults import harness
from tests.faults.harness import Backlog, Database, Stopwatch, free_port, wait_for

pytestmark = pytest.mark.faults

PGBOUNCER = shutil.which("pgbouncer") or (
    "/usr/sbin/pgbouncer" if Path("/usr/sbin/pgbouncer").exists() else None
)
CHURN_SECONDS = 180 if harness.FULL else 30


class PgBouncer:
    """pgbouncer in transaction mode for one database of the suite's own server."""

    def __init__(self, cluster: harness.EmbeddedCluster, db: Database, workdir: Path) -> None:
        assert PGBOUNCER is not None
        self.db = db
        self.port = free_port()
        self.dir = workdir
        self.dir.mkdir(exist_ok=True)
        (self.dir / "users.txt").write_text('"postgres" ""\n')
        self.ini = self.dir / "pgbouncer.ini"
        self.ini.write_text(
            "[databases]\n"
            f"{db.name} = host={cluster.socket_dir} port={cluster.params['port']} "
            f"dbname={db.name} user=postgres\n"
            "[pgbouncer]\n"
            "listen_addr = 127.0.0.1\n"
            f"listen_port = {self.port}\n"
            "unix_socket_dir =\n"
            "auth_type = trust\n"
            f"auth_file = {self.dir / 'users.txt'}\n"
            "pool_mode = transaction\n"
            "max_client_conn = 500\n"
            "default_pool_size = 20\n"
            "admin_users = postgres\n"
            "ignore_startup_parameters = extra_float_digits,options\n"
            f"logfile = {self.dir / 'pgbouncer.log'}\n"
        )
        # pgbouncer refuses to run as root: run it as the embedded server's user.
        self.user = cluster.system_user
        if self.user is not None:
            entry = pwd.getpwnam(self.user)
            for path in (self.dir, *self.dir.iterdir()):
                os.chown(path, entry.pw_uid, entry.pw_gid)
        self.process = subprocess.Popen(
            [PGBOUNCER, str(self.ini)],
            user=self.user,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.STDOUT,
        )
        wait_for(self._ready, 30, "pgbouncer to accept connections")

    @property
    def url(self) -> str:
        return f"postgres://postgres@127.0.0.1:{self.port}/{self.db.name}"

    def _ready(self) -> bool:
        try:
            with psycopg.connect(self.url, connect_timeout=2) as conn:
                conn.execute("SELECT 1")
        except psycopg.OperationalError:
            return False
        return True

    def reload(self) -> None:
        self.process.send_signal(signal.SIGHUP)

    def server_backends(self) -> list[int]:
        """Backends pgbouncer opened (they carry no application name of ours)."""
        rows = self.db.sql(
            "SELECT pid FROM pg_stat_activity WHERE datname = current_database()"
            " AND backend_type = 'client backend' AND pid <> pg_backend_pid()"
            " AND application_name NOT IN ('fx-test', 'fx-log')"
            " AND application_name NOT LIKE 'workpump-%%'"
        )
        return [row["pid"] for row in rows]

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
        self.process.wait(30)


@pytest.fixture
def pooler(own_cluster, own_db) -> Iterator[PgBouncer]:
    if PGBOUNCER is None:
        pytest.skip("pgbouncer is not installed (apt-get install pgbouncer)")
    # Under the server's own folder: pgbouncer's user must reach it (pytest's is private).
    workdir = Path(tempfile.mkdtemp(prefix="pgbouncer-", dir=own_cluster.base))
    bouncer = PgBouncer(own_cluster, own_db, workdir)
    try:
        yield bouncer
    finally:
        bouncer.close()


POOLED = {
    **harness.FAST,
    "LIVENESS_SOURCE_MODE": "heartbeat_table_only",
    "MAINTENANCE_INTERVAL_SECONDS": 2,
}


@pytest.mark.timeout(CHURN_SECONDS + 240)
def test_behind_pgbouncer_churn_evicts_no_one_and_everything_is_processed(
    own_db, pooler, make_fleet
):
    db = own_db
    fleet = make_fleet(
        db,
        {**POOLED, "LISTEN_DSN": db.conninfo},
        database_url=pooler.url,
        env={"FAULTS_LOG_DSN": db.conninfo},
    )
    backlog = Backlog(db, streams=8, seconds=0.05)
    backlog.produce(10)
    pumps = fleet.start(3, "--concurrency", "3")
    churn = Stopwatch()
    reloads = kills = 0
    while churn.seconds() < CHURN_SECONDS:
        if db.undone() < 150:
            backlog.produce(5)
        done = db.scalar("SELECT count(*) FROM fx_execution WHERE outcome = 'done'")
        # Pace the faults by progress: at least 20 more executions between two of them.
        wait_for(
            lambda done=done: (
                db.scalar("SELECT count(*) FROM fx_execution WHERE outcome = 'done'") >= done + 20
            ),
            15,
            "work to go on under churn",
        )
        if (reloads + kills) % 2 == 0:
            pooler.reload()
            reloads += 1
        else:
            for pid in pooler.server_backends()[::2]:  # every other server connection
                db.sql("SELECT pg_terminate_backend(%s)", [pid])
                kills += 1
        assert db.evicted() == {}, f"churn evicted a live instance\n{fleet.outputs()}"

    wait_for(lambda: db.undone() == 0, 120, "the backlog to drain")
    assert all(p.alive() for p in pumps), fleet.outputs()
    assert db.evicted() == {}, "churn evicted a live instance"
    codes = fleet.stop_all()
    assert set(codes.values()) == {0}, fleet.outputs()
    verdict = harness.check_invariants(db, expected=backlog.expected)
    harness.assert_invariants(verdict, fleet)
    harness.report(
        "pgbouncer-churn",
        seconds=churn.seconds(),
        reloads=reloads,
        server_kills=kills,
        evictions=0,
        rows=verdict.rows,
        reruns=len(verdict.rerun_rows),
        lost=0,
    )
