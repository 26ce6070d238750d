"""The example project: ``manage.py check`` passes and ``demo --run`` builds correct read models.

The shop app is not installed in the test settings, so ``example_project/manage.py`` runs
as a subprocess against a database of its own, created and dropped here on the server
the test suite uses.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Iterator
from urllib.parse import urlsplit, urlunsplit

import psycopg
import pytest
from django.conf import settings
from psycopg import sql

from tests.helpers import ROOT

REPO_ROOT = ROOT
MANAGE = REPO_ROOT / "example_project" / "manage.py"
# The server the suite runs on (DATABASE_URL, or the suite's embedded server).
SERVER_URL = urlsplit(settings.DATABASE_URL)
# One per pytest -n worker (gw0, gw1, ...): the workers share the server.
WORKER = os.environ.get("PYTEST_XDIST_WORKER", "")
DEMO_DATABASE = "_".join([SERVER_URL.path.lstrip("/") or "postgres", "demo", WORKER]).rstrip("_")

pytestmark = pytest.mark.slow


def _url(dbname: str) -> str:
    return urlunsplit(SERVER_URL._replace(path=f"/{dbname}"))


def _drop(connection: psycopg.Connection) -> None:
    connection.execute(
        sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(DEMO_DATABASE))
    )


@pytest.fixture
def demo_database_url() -> Iterator[str]:
    """An empty database for the demo; dropped afterwards even if the test fails."""
    with psycopg.connect(_url("postgres"), autocommit=True) as admin:
        _drop(admin)
        admin.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(DEMO_DATABASE)))
        try:
            yield _url(DEMO_DATABASE)
        finally:
            _drop(admin)


def _manage(database_url: str, *args: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    env.pop("DJANGO_SETTINGS_MODULE", None)  # pytest's tests.settings; manage.py picks its own
    env["DATABASE_URL"] = database_url
    env["EMAIL_BACKEND"] = "django.core.mail.backends.locmem.EmailBackend"
    return subprocess.run(
        [sys.executable, str(MANAGE), *args],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def _line(output: str, label: str) -> str:
    found = re.search(rf"^\s*{label}\s{{2,}}(.*)$", output, re.MULTILINE)
    assert found, f"no {label!r} line in:\n{output}"
    return found.group(1).strip()


def test_check_reports_no_issues() -> None:
    # The database need not exist: check only loads settings, apps and handlers.
    result = _manage(_url(DEMO_DATABASE), "check")

    assert result.returncode == 0, result.stderr
    assert "System check identified no issues" in result.stdout


@pytest.mark.timeout(180)
def test_demo_run_builds_read_models_that_match_the_orders(demo_database_url: str) -> None:
    result = _manage(demo_database_url, "demo", "--orders", "30", "--customers", "5", "--run")

    out = result.stdout
    assert result.returncode == 0, f"{out}\n{result.stderr}"
    assert "[##############################] 30/30" in out  # the progress bar finished
    assert _line(out, "orders") == "30"
    assert _line(out, "inbox rows") == "30 (payments.webhook; 3 duplicate webhooks ignored)"
    # the project's LOGGING sends the pump's lines, its stop line included, to stderr
    assert "drained: nothing left to claim (exit 0)" in result.stderr
    assert _line(out, "work processed").startswith("120 rows in ")  # 30 orders x 4 categories
    assert _line(out, "work left undone") == "0  OK"
    assert _line(out, "orders paid") == "30/30  OK"
    assert _line(out, "shipment requests") == "30/30  OK"
    assert _line(out, "customer totals") == "5 customers match their orders  OK"
    assert _line(out, "emails sent") == "30 (by this process)"
    assert "MISMATCH" not in out
