"""Fixtures of the fault-injection suite: servers, databases and pump fleets.

The suite is opt-in: it runs real processes for minutes, so a plain ``pytest`` skips it.
``WORKPUMP_FAULTS=1`` runs the CI mode (fast timing preset, few rounds);
``WORKPUMP_FAULTS_FULL=1`` runs the full mode (more rounds, minutes of pooler churn, and
the failover measurement at the default timing settings).

Scenarios that only kill or stop pump processes use a database of their own on the server
of ``DATABASE_URL`` (or on the suite's embedded server when it is unset). Scenarios that
restart PostgreSQL or put a pooler in front of it always use the suite's own embedded
server.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.faults import harness


def _enabled() -> bool:
    return harness.FULL or os.environ.get("WORKPUMP_FAULTS", "") not in ("", "0")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "faults: fault-injection scenarios with real runworkpump processes "
        "(opt-in: WORKPUMP_FAULTS=1, or WORKPUMP_FAULTS_FULL=1 for the full mode)",
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if _enabled():
        return
    skip = pytest.mark.skip(reason="fault-injection suite: set WORKPUMP_FAULTS=1 to run it")
    for item in items:
        if item.get_closest_marker("faults") is not None:
            item.add_marker(skip)


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if not harness.FIGURES:
        return
    terminalreporter.section("fault-injection figures")
    for scenario, figures in harness.FIGURES:
        line = " ".join(f"{k}={harness._fmt(v)}" for k, v in figures.items())
        terminalreporter.write_line(f"{scenario}: {line}")


@pytest.fixture(scope="session")
def own_cluster() -> Iterator[harness.EmbeddedCluster]:
    """The suite's own PostgreSQL server (embedded): restarts and poolers happen here."""
    cluster = harness.EmbeddedCluster()
    try:
        yield cluster
    finally:
        cluster.close()


@pytest.fixture(scope="session")
def shared_cluster(request: pytest.FixtureRequest) -> Iterator[harness.Cluster]:
    """The server of DATABASE_URL (others use it too: only databases of our own), else ours."""
    url = os.environ.get("DATABASE_URL")
    if not url:
        yield request.getfixturevalue("own_cluster")
        return
    cluster = harness.Cluster.from_url(url)
    try:
        yield cluster
    finally:
        cluster.close()


@pytest.fixture
def db(shared_cluster: harness.Cluster) -> Iterator[harness.Database]:
    """A fresh migrated database for one scenario, dropped afterwards."""
    database = shared_cluster.create_database()
    try:
        yield database
    finally:
        database.close()
        shared_cluster.drop_database(database.name)


@pytest.fixture
def own_db(own_cluster: harness.EmbeddedCluster) -> Iterator[harness.Database]:
    """A fresh migrated database on the suite's own server."""
    database = own_cluster.create_database()
    try:
        yield database
    finally:
        database.close()
        if not own_cluster.running():
            own_cluster.start()
        own_cluster.drop_database(database.name)


@pytest.fixture
def make_fleet(tmp_path: Path) -> Iterator[Callable[..., harness.Fleet]]:
    """Build fleets of runworkpump processes; every process left is killed afterwards."""
    fleets: list[harness.Fleet] = []

    def make(db: harness.Database, settings: dict[str, Any], **kwargs: Any) -> harness.Fleet:
        workdir = tmp_path / f"fleet-{len(fleets) + 1}"
        workdir.mkdir()
        fleet = harness.Fleet(db, workdir, settings, **kwargs)
        fleets.append(fleet)
        return fleet

    yield make
    for fleet in fleets:
        # Captured output is shown only when the test failed: the pumps' own account.
        print(fleet.outputs())
        fleet.close()
