"""Advisory locks taken by a role that may only connect change neither failover nor purging.

Any session can take any advisory lock; these tests create a role with CONNECT alone (a
"squatter") and let it hold the alive-lock keys the pump hands out next, the key of an
instance that died, the maintenance lock, a stream's lock and a unique key's lock.
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Callable, Iterator
from datetime import datetime, timedelta
from typing import Any

import psycopg
import pytest
from django.db import OperationalError, connection, transaction
from django.utils import timezone
from psycopg.rows import dict_row

import django_workpump as workpump
from django_workpump import models
from django_workpump.pump.maintenance import MaintenanceWorker
from tests.factories import OutboxFactory
from tests.helpers import A, at, conninfo, run_sql, scalar, wait_until

pytestmark = pytest.mark.django_db(transaction=True)

H = uuid.UUID("00000000-0000-0000-0000-0000000000ff")  # the peer that probes
GRACE, STALE, DEAD = 10, 30, 300
ALIVE, STREAM, UNIQUE, MAINTENANCE = 1464877377, 1464877395, 1464877403, 1464877421


@pytest.fixture
def squatter() -> Iterator[Callable[[], psycopg.Connection[dict[str, Any]]]]:
    """Open sessions of a fresh role that has CONNECT on the test database and nothing else."""
    role = f"wp_squatter_{uuid.uuid4().hex[:8]}"
    database = connection.settings_dict["NAME"]
    with connection.cursor() as cursor:
        cursor.execute(f'CREATE ROLE "{role}" LOGIN')
        cursor.execute(f'GRANT CONNECT ON DATABASE "{database}" TO "{role}"')
    opened: list[psycopg.Connection[dict[str, Any]]] = []

    def connect() -> psycopg.Connection[dict[str, Any]]:
        conn = psycopg.connect(conninfo(), user=role, autocommit=True, row_factory=dict_row)
        opened.append(conn)
        return conn

    yield connect
    for conn in opened:
        conn.close()
    with connection.cursor() as cursor:
        cursor.execute(f'REVOKE ALL ON DATABASE "{database}" FROM "{role}"')
        cursor.execute(f'DROP ROLE "{role}"')


def beat(instance_id: uuid.UUID, now: datetime) -> bool:
    return scalar(
        "SELECT workpump.record_heartbeat(%s, 'tests', 'host-1', 1, p_now => %s,"
        " p_lock_loss_grace_seconds => %s)",
        [instance_id, now, GRACE],
    )


def next_eviction_in(now: datetime) -> float | None:
    return scalar(
        "SELECT workpump.next_eviction_in(%s, %s, %s, %s, %s)", [H, STALE, DEAD, GRACE, now]
    )


def cleanup(now: datetime) -> list[uuid.UUID]:
    rows = run_sql(
        "SELECT instance_id FROM workpump.cleanup_stale_instances(%s, %s, %s, %s)",
        [now - timedelta(seconds=STALE), now - timedelta(seconds=DEAD), GRACE, now],
    )
    return [r["instance_id"] for r in rows]


def held(instance_id: uuid.UUID) -> bool:
    return scalar("SELECT workpump.alive_lock_held(%s)", [instance_id])


def take(conn: psycopg.Connection[Any], instance_id: uuid.UUID) -> bool:
    return conn.execute("SELECT workpump.take_alive_lock(%s) AS ok", [instance_id]).fetchone()["ok"]


def test_a_squatter_on_the_next_alive_lock_keys_does_not_keep_an_instance_from_its_lock(
    squatter, raw_connect
):
    next_key = scalar(
        "SELECT CASE WHEN is_called THEN last_value + 1 ELSE last_value END"
        " FROM workpump.alive_lock_key_seq"
    )
    squat = squatter()
    for key in range(next_key, next_key + 200):
        assert squat.execute("SELECT pg_try_advisory_lock(%s, %s) AS ok", [ALIVE, key]).fetchone()[
            "ok"
        ]

    assert beat(A, at(100))
    drawn = models.ServiceInstance.objects.get(instance_id=A).alive_lock_key
    assert next_key <= drawn < next_key + 200  # registered with a squatted key
    gate = raw_connect()
    assert take(gate, A)

    row = models.ServiceInstance.objects.get(instance_id=A)
    assert row.alive_lock_key >= next_key + 200  # gave the squatted keys up
    assert row.alive_lock_pid == gate.info.backend_pid
    assert row.alive_lock_lost_at is None
    assert held(A)
    assert next_eviction_in(at(101)) == DEAD - 1  # protected as a live instance is


def test_a_squatter_on_the_key_of_an_instance_that_died_does_not_keep_it_alive(
    squatter, raw_connect
):
    assert beat(A, at(100))
    gate = raw_connect()
    assert take(gate, A)
    key = models.ServiceInstance.objects.get(instance_id=A).alive_lock_key
    squat = squatter()
    assert held(A)
    assert next_eviction_in(at(101)) == DEAD - 1

    gate.close()  # the instance dies; the squatter takes its key the moment it is free
    squat.execute("SET lock_timeout = '10s'")
    squat.execute("SELECT pg_advisory_lock(%s, %s)", [ALIVE, key])

    assert not held(A)
    assert next_eviction_in(at(102)) == GRACE  # the loss is seen, squatter or not
    assert cleanup(at(102 + GRACE - 1)) == []
    assert cleanup(at(102 + GRACE)) == [A]  # failover as fast as without the squatter


def test_a_squatter_on_the_maintenance_lock_delays_purging_by_a_few_passes_only(squatter):
    old = timezone.now() - timedelta(days=2)
    purged = [OutboxFactory(done_at=old).pk for _ in range(3)]
    squat = squatter()
    squat.execute("SELECT pg_advisory_lock(%s, 0)", [MAINTENANCE])
    worker = MaintenanceWorker(
        alias="default",
        interval_seconds=300,
        retention_seconds=24 * 3600,
        stale_after_seconds=30,
        definitively_dead_after_seconds=300,
        max_skipped_passes=3,
    )

    assert [worker.run_once().ran for _ in range(3)] == [False, False, False]
    assert models.Outbox.objects.filter(pk__in=purged).count() == 3

    result = worker.run_once()
    assert result.ran and not result.locked
    assert result.purged["outbox"] == 3
    assert not models.Outbox.objects.filter(pk__in=purged).exists()
    # the lock was never this worker's: the squatter still holds it, the count starts over
    assert run_sql(
        "SELECT pid FROM pg_locks WHERE locktype = 'advisory' AND granted AND classid = %s"
        " AND objid = 0 AND database = (SELECT oid FROM pg_database"
        " WHERE datname = current_database())",
        [MAINTENANCE],
    ) == [{"pid": squat.info.backend_pid}]
    assert worker.run_once().ran is False

    squat.execute("SELECT pg_advisory_unlock(%s, 0)", [MAINTENANCE])
    result = worker.run_once()
    assert result.ran and result.locked


def stream_key(stream: str, category: str = "outbox", scope: str = "") -> int:
    return scalar(
        "SELECT hashtext(%s || chr(31) || %s || chr(31) || %s)", [category, scope, stream]
    )


def test_a_squatter_on_a_stream_lock_fails_its_producers_within_the_bound_naming_the_stream(
    squatter,
):
    squat = squatter()
    squat.execute("SELECT pg_advisory_lock(%s, %s)", [STREAM, stream_key("order-7")])

    with pytest.raises(OperationalError) as refused, transaction.atomic():
        with connection.cursor() as cursor:
            cursor.execute("SET LOCAL lock_timeout = '200ms'")
        workpump.send("emails.welcome", {"n": 1}, stream="order-7")
    message = str(refused.value)
    assert "outbox stream 'order-7'" in message
    assert f"pid {squat.info.backend_pid} holds it" in message
    assert "200ms" in message

    # other streams, and unordered work, are not held up
    with transaction.atomic():
        workpump.send("emails.welcome", {"n": 2}, stream="order-8")
        workpump.send("emails.welcome", {"n": 3})
    assert models.Outbox.objects.count() == 2


def test_a_squatter_on_a_unique_key_lock_fails_its_producers_within_the_bound(squatter):
    squat = squatter()
    key = scalar(
        "SELECT hashtext('workpump_outbox' || chr(31) || 'emails.welcome' || chr(31) || 'k-1')"
    )
    squat.execute("SELECT pg_advisory_lock(%s, %s)", [UNIQUE, key])

    with pytest.raises(OperationalError, match="unique key 'k-1'"), transaction.atomic():
        with connection.cursor() as cursor:
            cursor.execute("SET LOCAL lock_timeout = '200ms'")
        workpump.send("emails.welcome", {"n": 1}, unique_key="k-1")


def test_a_producer_waits_for_a_stream_lock_released_within_the_bound(raw_connect):
    other = raw_connect()
    key = stream_key("order-9")
    other.execute("SELECT pg_advisory_lock(%s, %s)", [STREAM, key])
    release = threading.Timer(
        0.3, lambda: other.execute("SELECT pg_advisory_unlock(%s, %s)", [STREAM, key])
    )
    release.start()
    try:
        with transaction.atomic():
            with connection.cursor() as cursor:
                cursor.execute("SET LOCAL lock_timeout = '10s'")
            workpump.send("emails.welcome", {"n": 1}, stream="order-9")
            # the caller's lock_timeout is its own again after the wait
            assert scalar("SHOW lock_timeout") == "10s"
    finally:
        release.join()
    assert models.Outbox.objects.filter(stream="order-9").count() == 1


def test_without_a_lock_timeout_the_stream_lock_waits_at_most_thirty_seconds():
    config = scalar(
        "SELECT proconfig FROM pg_proc WHERE oid = 'workpump.wait_for_xact_lock'::regproc"
    )
    assert "lock_timeout=30s" in config
    assert wait_until(lambda: scalar("SHOW lock_timeout") == "0", timeout=1)
