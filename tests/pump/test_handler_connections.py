"""Handler threads keep their database connections across jobs (HANDLER_CONNECTIONS).

Real pumps on real PostgreSQL: handlers read their backend's pid, so a connection kept,
replaced or reopened per job shows in the pids they saw.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import pytest
from django.core.checks import run_checks
from django.db import connection
from django.test import override_settings

import django_workpump as workpump
from django_workpump import models
from django_workpump.registry import registry
from tests.helpers import FAST_PUMP, wait_until

pytestmark = pytest.mark.django_db(transaction=True)

ONE_THREAD = {**FAST_PUMP, "CONCURRENCY": 1}


@pytest.fixture
def pid_handler() -> Iterator[list[tuple[int, int]]]:
    """Register ``conn.pid``: each job records (thread id, backend pid) it ran with."""
    seen: list[tuple[int, int]] = []

    def handle(work: Any) -> None:
        with connection.cursor() as cursor:
            cursor.execute("SELECT pg_backend_pid()")
            seen.append((threading.get_ident(), cursor.fetchone()[0]))

    workpump.outbox_handler("conn.pid")(handle)
    yield seen
    registry.unregister("outbox", "conn.pid")


def _run_one(seen: list[Any]) -> None:
    before = len(seen)
    workpump.send("conn.pid", {})
    assert wait_until(lambda: len(seen) > before and _all_processed())


def _all_processed() -> bool:
    return not models.Outbox.objects.filter(done_at__isnull=True).exists()


def _connections_named(raw: Any, suffix: str) -> int:
    row = raw.execute(
        "SELECT count(*) AS n FROM pg_stat_activity"
        " WHERE datname = current_database() AND application_name LIKE %s",
        [f"workpump:%:{suffix}"],
    ).fetchone()
    return int(row["n"])


@override_settings(WORKPUMP=ONE_THREAD)
def test_a_handler_thread_keeps_its_connection_across_jobs_under_conn_max_age_0(
    pid_handler, pump, raw_connect, settings
):
    assert settings.DATABASES["default"].get("CONN_MAX_AGE", 0) == 0
    pump()
    for _ in range(3):
        _run_one(pid_handler)
    threads = {thread for thread, _ in pid_handler}
    pids = {pid for _, pid in pid_handler}
    assert len(threads) == 1
    assert len(pids) == 1, f"one connection for every job of the thread, saw {pids}"
    # Still open between jobs, under the thread's name.
    assert _connections_named(raw_connect(), "handler-1") == 1


@override_settings(WORKPUMP={**ONE_THREAD, "HANDLER_CONNECTIONS": "per_job"})
def test_per_job_connections_open_a_new_connection_for_each_job(pid_handler, pump, raw_connect):
    pump()
    for _ in range(3):
        _run_one(pid_handler)
    assert len({thread for thread, _ in pid_handler}) == 1
    assert len({pid for _, pid in pid_handler}) == 3
    # Closed after each job (CONN_MAX_AGE = 0).
    assert wait_until(lambda: _connections_named(raw_connect(), "handler-1") == 0)


@override_settings(WORKPUMP=ONE_THREAD)
def test_a_kept_connection_the_server_dropped_is_replaced_and_the_next_job_succeeds(
    pid_handler, pump, raw_connect
):
    pump()
    _run_one(pid_handler)
    _, first_pid = pid_handler[0]
    admin = raw_connect()
    assert admin.execute("SELECT pg_terminate_backend(%s) AS ok", [first_pid]).fetchone()["ok"]
    assert wait_until(
        lambda: (
            not admin.execute(
                "SELECT 1 FROM pg_stat_activity WHERE pid = %s", [first_pid]
            ).fetchone()
        )
    )
    _run_one(pid_handler)
    _run_one(pid_handler)
    pids = [pid for _, pid in pid_handler]
    assert pids[1] != first_pid
    assert pids[2] == pids[1], "the replacement is kept in turn"
    # No job failed for the dropped connection: each ran once.
    assert list(models.Outbox.objects.values_list("attempts", flat=True)) == [1, 1, 1]
    assert all(row.last_error in (None, "") for row in models.Outbox.objects.all())


@override_settings(WORKPUMP=ONE_THREAD)
def test_a_handler_error_that_breaks_the_connection_gets_a_new_one_for_the_next_job(
    pump, raw_connect
):
    seen: list[int] = []

    def handle(work: Any) -> None:
        with connection.cursor() as cursor:
            cursor.execute("SELECT pg_backend_pid()")
            pid = cursor.fetchone()[0]
            seen.append(pid)
            if work.payload.get("break"):
                cursor.execute("SELECT pg_terminate_backend(pg_backend_pid())")

    workpump.outbox_handler("conn.break")(handle)
    try:
        pump()
        workpump.send("conn.break", {"break": True})
        assert wait_until(lambda: len(seen) == 1)
        assert wait_until(
            lambda: (
                models.Outbox.objects.filter(last_error__isnull=False).exists()
                or models.Outbox.objects.filter(attempts__gte=2).exists()
            )
        )
        workpump.send("conn.break", {}, stream="later")
        assert wait_until(
            lambda: models.Outbox.objects.filter(stream="later", done_at__isnull=False).exists()
        )
        assert seen[-1] != seen[0]
    finally:
        registry.unregister("outbox", "conn.break")


@override_settings(WORKPUMP={**ONE_THREAD, "HANDLER_CONNECTIONS": "pooled"})
def test_an_unknown_handler_connections_mode_is_a_check_error():
    errors = [m for m in run_checks() if m.id == "workpump.E016"]
    assert [m.msg for m in errors] == [
        "WORKPUMP['HANDLER_CONNECTIONS'] ('pooled') must be 'persistent' or 'per_job'."
    ]
