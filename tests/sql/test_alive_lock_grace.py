"""The grace given to a stale instance whose alive-lock just went missing.

A listener blip drops an instance's alive-lock with its connection; a peer must not evict
the instance before it has had one fast heartbeat interval to beat. Time comes from p_now.
"""

from __future__ import annotations

import uuid
from datetime import datetime
from typing import Any

import psycopg
import pytest
from django.db import DataError, transaction
from django.test import override_settings

from django_workpump import models
from django_workpump.conf import lock_loss_grace_seconds
from django_workpump.pump.coordinator import DatabaseCoordinator, InstanceIdentity
from tests.factories import ServiceInstanceFactory
from tests.helpers import T0, A, B, at, run_sql, scalar

pytestmark = pytest.mark.django_db

H = uuid.UUID("00000000-0000-0000-0000-0000000000ff")  # the instance that probes or beats
GRACE = 10


def instance(instance_id: uuid.UUID, heartbeat_at: datetime) -> models.ServiceInstance:
    return ServiceInstanceFactory(
        instance_id=instance_id, started_at=heartbeat_at, last_heartbeat_at=heartbeat_at
    )


def cleanup(now: datetime, *, stale_after: int = 30, grace: float = GRACE) -> list[uuid.UUID]:
    rows = run_sql(
        "SELECT instance_id FROM workpump.cleanup_stale_instances("
        " p_stale_cutoff => %s, p_now => %s, p_lock_loss_grace_seconds => %s)",
        [now - (at(stale_after) - T0), now, grace],
    )
    return [r["instance_id"] for r in rows]


def lost_at(instance_id: uuid.UUID) -> datetime | None:
    return models.ServiceInstance.objects.get(instance_id=instance_id).alive_lock_lost_at


def probe(now: datetime) -> bool:
    return scalar("SELECT workpump.stale_peer_exists(%s, 30, %s)", [H, now])


def release_lock_of(holder: psycopg.Connection[Any], instance_id: uuid.UUID) -> None:
    key = models.ServiceInstance.objects.get(instance_id=instance_id).alive_lock_key
    holder.execute("SELECT pg_advisory_unlock(workpump.lock_namespace('alive'), %s)", [key])


def take_lock(conn: psycopg.Connection[Any], instance_id: uuid.UUID) -> None:
    assert conn.execute("SELECT workpump.take_alive_lock(%s) AS ok", [instance_id]).fetchone()["ok"]


@pytest.mark.django_db(transaction=True)
def test_a_lost_alive_lock_protects_for_the_grace_from_when_it_was_first_seen_missing(
    raw_connect,
):
    instance(A, T0)
    holder = raw_connect()
    take_lock(holder, A)
    assert cleanup(at(100)) == []  # stale, but its lock is held
    assert lost_at(A) is None

    release_lock_of(holder, A)  # the listener connection dropped
    assert cleanup(at(101)) == []
    assert lost_at(A) == at(101)
    assert cleanup(at(101 + GRACE - 1)) == []
    assert lost_at(A) == at(101)  # the first sighting counts, not the latest

    assert cleanup(at(101 + GRACE)) == [A]
    reason = models.Eviction.objects.get(instance_id=A).reason
    assert "alive-lock has been missing since" in reason


@pytest.mark.django_db(transaction=True)
def test_an_instance_that_beats_within_the_grace_is_not_evicted(raw_connect):
    instance(A, T0)
    holder = raw_connect()
    take_lock(holder, A)
    release_lock_of(holder, A)
    assert cleanup(at(100)) == []
    # The blipped instance beats at once on losing its listener: fresh again.
    beat = "SELECT workpump.record_heartbeat(%s, 'tests', 'host-1', 1, p_now => %s)"
    assert scalar(beat, [A, at(101)]) is True

    assert cleanup(at(100 + GRACE + 5)) == []
    assert models.ServiceInstance.objects.filter(instance_id=A).exists()


@pytest.mark.django_db(transaction=True)
def test_the_stamp_is_cleared_once_the_lock_is_held_again(raw_connect):
    instance(A, T0)
    run_sql("SELECT workpump.observe_alive_locks(%s)", [at(1)])
    assert lost_at(A) == at(1)

    take_lock(raw_connect(), A)  # the listener reconnected and took the lock back
    run_sql("SELECT workpump.observe_alive_locks(%s)", [at(2)])
    assert lost_at(A) is None


def test_an_instance_whose_lock_has_long_been_missing_is_evicted_the_moment_it_is_stale():
    instance(A, T0)  # heartbeat-table mode, or dead since its last beat: no lock at all
    assert probe(at(5)) is False  # nobody is stale yet; the probe notes the missing lock
    assert lost_at(A) == at(5)

    assert probe(at(31)) is True
    assert cleanup(at(31)) == [A]  # no grace left to wait for: failover is not slowed


def test_a_grace_of_zero_evicts_a_stale_unlocked_instance_at_once():
    instance(A, T0)
    instance(B, at(90))  # fresh
    assert cleanup(at(100), grace=0) == [A]


@pytest.mark.django_db(transaction=True)
def test_the_probe_is_a_read_unless_a_lock_state_changed(raw_connect):
    instance(A, T0)
    conn = raw_connect()

    def probe_takes_a_write_lock(now: datetime) -> bool:
        with conn.transaction():
            conn.execute("SELECT workpump.stale_peer_exists(%s, 30, %s)", [H, now])
            # An UPDATE (even of no rows) holds RowExclusiveLock until the transaction ends.
            return conn.execute(
                "SELECT EXISTS (SELECT 1 FROM pg_locks WHERE pid = pg_backend_pid()"
                " AND relation = 'workpump_service_instance'::regclass"
                " AND mode = 'RowExclusiveLock') AS wrote"
            ).fetchone()["wrote"]

    assert probe_takes_a_write_lock(at(5)) is True  # A's missing lock is stamped
    assert probe_takes_a_write_lock(at(6)) is False
    assert probe_takes_a_write_lock(at(7)) is False
    assert lost_at(A) == at(5)


def test_the_heartbeats_inline_reap_honours_the_grace():
    instance(A, T0)
    beat = (
        "SELECT workpump.record_heartbeat(%s, 'tests', 'host-1', 1, p_now => %s,"
        " p_lock_loss_grace_seconds => %s)"
    )
    assert scalar(beat, [H, at(100), GRACE]) is True
    assert models.ServiceInstance.objects.filter(instance_id=A).exists()  # first sighting
    assert scalar(beat, [H, at(100 + GRACE), GRACE]) is True
    assert not models.ServiceInstance.objects.filter(instance_id=A).exists()


@pytest.mark.parametrize("grace", [-1, None])
def test_a_negative_or_missing_grace_is_refused_with_its_name(grace):
    with pytest.raises(DataError, match="p_lock_loss_grace_seconds >= 0"), transaction.atomic():
        cleanup(at(100), grace=grace)
    with pytest.raises(DataError, match="p_lock_loss_grace_seconds >= 0"), transaction.atomic():
        scalar(
            "SELECT workpump.record_heartbeat(%s, 'tests', 'host-1', 1,"
            " p_lock_loss_grace_seconds => %s)",
            [H, grace],
        )


# --- the grace the pump passes ---------------------------------------------------------


def test_the_grace_is_one_fast_heartbeat_in_lock_mode_and_none_in_table_only_mode():
    base = {"HEARTBEAT_INTERVAL_SECONDS": 4, "LIVENESS_SOURCE_MODE": "advisory_lock_when_available"}
    assert lock_loss_grace_seconds(base) == 4.0
    assert lock_loss_grace_seconds({**base, "LIVENESS_SOURCE_MODE": "heartbeat_table_only"}) == 0


@pytest.mark.parametrize(
    ("mode", "evicted"), [("advisory_lock_when_available", False), ("heartbeat_table_only", True)]
)
def test_the_coordinators_reap_waits_out_the_grace_only_in_lock_mode(mode, evicted):
    run_sql(
        "INSERT INTO workpump_service_instance (instance_id, service_name, host_name,"
        " process_id, last_heartbeat_at, alive_lock_key, alive_lock_lost_at)"
        " VALUES (%s, 'blipped', 'h', 1, now() - interval '100 seconds',"
        " nextval('workpump.alive_lock_key_seq'), now())",
        [A],
    )
    # A 1 s stale cutoff: a server that started within the cutoff evicts nobody, and the
    # embedded one started with this test session.
    settings = {
        "HEARTBEAT_INTERVAL_SECONDS": 60,
        "STALE_AFTER_SECONDS": 1,
        "LIVENESS_SOURCE_MODE": mode,
    }
    with override_settings(WORKPUMP=settings):
        coordinator = DatabaseCoordinator(InstanceIdentity(service_name="reaper"))
        assert coordinator.reap_stale() == ([A] if evicted else [])
