"""Every connection the pump opens names its instance and role in pg_stat_activity."""

from __future__ import annotations

import threading
from typing import Any

import pytest
from django.db import connection
from django.test import override_settings

import django_workpump as workpump
from django_workpump.pump.naming import application_name, name_thread_connections
from django_workpump.registry import registry
from tests.helpers import FAST_PUMP, drain, wait_until

pytestmark = pytest.mark.django_db(transaction=True)

ROLES = """
SELECT pid, application_name FROM pg_stat_activity
WHERE datname = current_database() AND application_name LIKE %s
"""


def sessions(raw: Any, instance_id: Any) -> dict[str, int]:
    """application_name -> backend pid, for the sessions of one instance."""
    rows = raw.execute(ROLES, [f"workpump:{instance_id.hex[:8]}:%"]).fetchall()
    return {row["application_name"]: row["pid"] for row in rows}


def test_application_name_is_short_and_within_the_postgres_limit():
    import uuid

    instance = uuid.UUID("0123456789abcdef0123456789abcdef")
    assert application_name(instance, "heartbeat") == "workpump:01234567:heartbeat"
    assert len(application_name(instance, "x" * 100)) == 63


@override_settings(WORKPUMP={**FAST_PUMP, "CONCURRENCY": 2})
def test_each_pump_thread_names_its_connection_after_the_instance_and_its_role(pump, raw_connect):
    release = threading.Event()
    running = threading.Event()

    def hold(work: Any) -> None:
        with connection.cursor() as cursor:  # a handler using the ORM's connection
            cursor.execute("SELECT 1")
        running.set()
        release.wait(10)

    workpump.outbox_handler("names.hold")(hold)
    try:
        workpump.send("names.hold", {})
        supervisor = pump(drain=True)
        raw = raw_connect()
        assert running.wait(10)
        name = f"workpump:{supervisor.identity.instance_id.hex[:8]}"
        expected = {f"{name}:heartbeat", f"{name}:claim"}
        assert wait_until(lambda: expected <= set(sessions(raw, supervisor.identity.instance_id)))
        names = set(sessions(raw, supervisor.identity.instance_id))
        assert {n for n in names if n.startswith(f"{name}:handler-")}, names
        release.set()
        # The completion is written by the completions flusher, on its own named session.
        assert wait_until(
            lambda: f"{name}:completions" in sessions(raw, supervisor.identity.instance_id)
        )
        # The listener keeps its full-id name, which workpump_status looks for.
        listener = raw.execute(
            "SELECT count(*) AS n FROM pg_stat_activity WHERE application_name = %s",
            [f"workpump-{supervisor.identity.instance_id}"],
        ).fetchone()
        assert listener["n"] == 1

        # A killed connection is replaced by one with the same name.
        before = sessions(raw, supervisor.identity.instance_id)[f"{name}:heartbeat"]
        raw.execute("SELECT pg_terminate_backend(%s)", [before])
        assert wait_until(
            lambda: (
                sessions(raw, supervisor.identity.instance_id).get(f"{name}:heartbeat")
                not in (None, before)
            )
        )
        assert drain(supervisor) == 0
    finally:
        release.set()
        registry.unregister("outbox", "names.hold")


def test_a_named_thread_names_a_connection_once_when_it_opens_not_per_query():
    calls: list[str] = []
    from django_workpump import db

    original = db.set_application_name

    def counting(*, name: str, using: str | None = None) -> None:
        calls.append(name)
        original(name=name, using=using)

    result: dict[str, Any] = {}

    def thread() -> None:
        db.set_application_name = counting  # type: ignore[assignment]
        try:
            name_thread_connections("workpump:test:named")
            with connection.cursor() as cursor:
                for _ in range(3):
                    cursor.execute("SHOW application_name")
                    result["name"] = cursor.fetchone()[0]
        finally:
            db.set_application_name = original  # type: ignore[assignment]
            connection.close()

    worker = threading.Thread(target=thread)
    worker.start()
    worker.join(10)

    assert result["name"] == "workpump:test:named"
    assert calls == ["workpump:test:named"]
