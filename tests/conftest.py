"""Shared fixtures: SQL helpers on the Django connection, raw psycopg connections.

What tests import by name (run_sql, T0, FAST_PUMP, ...) lives in tests/helpers.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import psycopg
import pytest
from django.db import connections
from psycopg.rows import dict_row

from tests.helpers import (
    FAST_PROCESS,
    ROOT,
    ScratchDatabase,
    conninfo,
    database_url,
    run_sql,
)


@pytest.fixture
def sql() -> Callable[..., list[dict[str, Any]]]:
    return run_sql


@pytest.fixture
def raw_connect() -> Iterator[Callable[..., psycopg.Connection[dict[str, Any]]]]:
    """Open extra autocommit psycopg connections to the test database (closed after)."""
    opened: list[psycopg.Connection[dict[str, Any]]] = []

    def connect(**kwargs: Any) -> psycopg.Connection[dict[str, Any]]:
        conn = psycopg.connect(conninfo(), autocommit=True, row_factory=dict_row, **kwargs)
        opened.append(conn)
        return conn

    yield connect
    for conn in opened:
        conn.close()


@pytest.fixture
def scratch_database(raw_connect: Callable[..., Any]) -> Iterator[ScratchDatabase]:
    """An empty database beside the test database, dropped afterwards (migration tests)."""
    name = f"wp_migrate_{uuid.uuid4().hex[:12]}"
    admin = raw_connect()
    admin.execute(f'CREATE DATABASE "{name}"')
    address, separator, query = database_url().partition("?")  # ?host= may hold slashes
    try:
        yield ScratchDatabase(f"{address.rpartition('/')[0]}/{name}{separator}{query}")
    finally:
        admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture
def pump() -> Iterator[Callable[..., Any]]:
    """Start in-process pumps (Supervisor); every one still running is shut down after."""
    from django_workpump.pump.supervisor import PumpOptions, Supervisor

    started: list[Supervisor] = []

    def start(**options: Any) -> Supervisor:
        supervisor = Supervisor(PumpOptions(**options))
        supervisor.start()
        started.append(supervisor)
        return supervisor

    yield start
    for supervisor in started:
        supervisor.shutdown()


@pytest.fixture
def pump_process() -> Iterator[Callable[..., subprocess.Popen[str]]]:
    """Start ``runworkpump`` subprocesses on the test database; any left running are killed."""
    processes: list[subprocess.Popen[str]] = []

    def start(
        *args: str,
        settings_module: str = "tests.settings",
        timings: dict[str, Any] | None = None,
        extra_env: dict[str, str] | None = None,
    ) -> subprocess.Popen[str]:
        env = {
            **os.environ,
            "DATABASE_URL": database_url(),
            "WORKPUMP_JSON": json.dumps(FAST_PROCESS if timings is None else timings),
            "PYTHONPATH": str(ROOT),
            **(extra_env or {}),
        }
        command = ["runworkpump", f"--settings={settings_module}", *args]
        process = subprocess.Popen(
            [sys.executable, "-m", "django", *command],
            cwd=ROOT,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        processes.append(process)
        return process

    yield start
    for process in processes:
        if process.poll() is None:
            process.kill()
        process.wait(10)


@pytest.fixture(autouse=True)
def _second_database_closed() -> None:
    """Close this thread's connection to the "second" alias before each test.

    A test that uses it leaves it open (Django flushes it after the test), and a later
    test that may not query it would then trip on it where the pump names every open
    connection of the thread.
    """
    for wrapper in connections.all(initialized_only=True):
        if wrapper.alias == "second" and wrapper.connection is not None:
            wrapper.close()


def _utf8(text: str) -> str:
    """``text`` with lone surrogates escaped (``\\ud800``), so it encodes as UTF-8."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
    """Under pytest -n a report travels to the main process as UTF-8: escape the lone
    surrogates that tests of text PostgreSQL cannot store leave in captured logs (the
    worker would otherwise crash sending the report)."""
    report = yield
    if os.environ.get("PYTEST_XDIST_WORKER"):
        report.sections = [(title, _utf8(content)) for title, content in report.sections]
        if report.longrepr is not None:
            text = str(report.longrepr)
            if _utf8(text) != text:
                report.longrepr = _utf8(text)
    return report
