"""A missing alive-lock evicts a silent instance one grace after it is seen.

An instance whose process died drops its alive-lock at once; once a peer has seen the
lock missing and one grace (a fast heartbeat interval) has passed with no beat from the
instance, it is evicted however fresh its last heartbeat. A live instance that loses its
lock beats at once and keeps its work. Time comes from p_now.
"""

from __future__ import annotations

import uuid
from datetime import datetime
from typing import Any

import psycopg
import pytest
from django.db import DataError, transaction

from django_workpump import models
from tests.factories import ServiceInstanceFactory
from tests.helpers import T0, A, at, run_sql, scalar

pytestmark = pytest.mark.django_db(transaction=True)

H = uuid.UUID("00000000-0000-0000-0000-0000000000ff")  # the instance that probes or beats
GRACE = 10
STALE = 30
DEAD = 300


def instance(instance_id: uuid.UUID, heartbeat_at: datetime) -> models.ServiceInstance:
    return ServiceInstanceFactory(
        instance_id=instance_id, started_at=heartbeat_at, last_heartbeat_at=heartbeat_at
    )


def cleanup(now: datetime, *, grace: float = GRACE) -> list[uuid.UUID]:
    rows = run_sql(
        "SELECT instance_id FROM workpump.cleanup_stale_instances("
        " p_stale_cutoff => %s, p_definitive_dead_cutoff => %s, p_now => %s,"
        " p_lock_loss_grace_seconds => %s)",
        [now - (at(STALE) - T0), now - (at(DEAD) - T0), now, grace],
    )
    return [r["instance_id"] for r in rows]


def next_eviction_in(now: datetime, *, grace: float = GRACE) -> float | None:
    return scalar(
        "SELECT workpump.next_eviction_in(%s, %s, %s, %s, %s)", [H, STALE, DEAD, grace, now]
    )


def beat(instance_id: uuid.UUID, now: datetime, *, grace: float = GRACE) -> bool:
    return scalar(
        "SELECT workpump.record_heartbeat(%s, 'tests', 'host-1', 1, p_now => %s,"
        " p_lock_loss_grace_seconds => %s)",
        [instance_id, now, grace],
    )


def lost_at(instance_id: uuid.UUID) -> datetime | None:
    return models.ServiceInstance.objects.get(instance_id=instance_id).alive_lock_lost_at


def exists(instance_id: uuid.UUID) -> bool:
    return models.ServiceInstance.objects.filter(instance_id=instance_id).exists()


def take_lock(conn: psycopg.Connection[Any], instance_id: uuid.UUID) -> None:
    assert conn.execute("SELECT workpump.take_alive_lock(%s) AS ok", [instance_id]).fetchone()["ok"]


def drop_lock(holder: psycopg.Connection[Any], instance_id: uuid.UUID) -> None:
    key = models.ServiceInstance.objects.get(instance_id=instance_id).alive_lock_key
    holder.execute("SELECT pg_advisory_unlock(workpump.lock_namespace('alive'), %s)", [key])


@pytest.fixture
def locked_a(raw_connect):
    """Instance A with a fresh heartbeat at 100 s and its alive-lock held; the holder."""
    instance(A, at(100))
    holder = raw_connect()
    take_lock(holder, A)
    return holder


# --- the rule -------------------------------------------------------------------------------


def test_a_dead_instance_with_a_fresh_heartbeat_is_evicted_one_grace_after_its_lock_is_seen_missing(
    locked_a,
):
    assert next_eviction_in(at(101)) == DEAD - 1  # lock held: only the definitive cutoff
    drop_lock(locked_a, A)  # the process died: its session and its lock are gone

    assert next_eviction_in(at(102)) == GRACE  # first sighting, stamped
    assert lost_at(A) == at(102)
    assert cleanup(at(102 + GRACE - 1)) == []  # heartbeat 11 s old: fresh, but no matter
    assert next_eviction_in(at(102 + GRACE - 1)) == 1

    assert next_eviction_in(at(102 + GRACE)) == 0
    assert cleanup(at(102 + GRACE)) == [A]
    reason = models.Eviction.objects.get(instance_id=A).reason
    assert "alive-lock has been missing since" in reason
    assert "no heartbeat since" in reason


def test_a_live_instance_that_beats_after_its_lock_was_seen_missing_keeps_its_work(locked_a):
    drop_lock(locked_a, A)  # a listener blip
    assert cleanup(at(101)) == []  # stamped by a peer first
    assert beat(A, at(102)) is True  # the instance beats at once on losing its listener

    assert cleanup(at(101 + GRACE)) == []
    assert cleanup(at(102 + STALE - 1)) == []
    assert next_eviction_in(at(102 + STALE - 1)) == 1  # now only its heartbeat's age counts
    assert cleanup(at(102 + STALE + 1)) == [A]


def test_a_live_instance_that_beats_before_any_peer_sees_its_lock_missing_keeps_its_work(
    locked_a,
):
    drop_lock(locked_a, A)
    assert beat(A, at(101)) is True  # its own beat stamps the loss: lost at its beat
    assert lost_at(A) == at(101)
    assert cleanup(at(102)) == []  # a peer sees the lock missing after that beat
    assert lost_at(A) == at(101)  # the earlier stamp stands

    assert cleanup(at(101 + GRACE + 5)) == []
    assert exists(A)


def test_the_stamp_is_cleared_when_the_lock_is_taken_again(locked_a, raw_connect):
    drop_lock(locked_a, A)
    assert cleanup(at(101)) == []
    take_lock(raw_connect(), A)  # the listener reconnected

    assert cleanup(at(101 + GRACE)) == []
    assert lost_at(A) is None
    assert next_eviction_in(at(101 + GRACE)) == DEAD - 1 - GRACE


def test_a_beat_stamps_a_missing_lock_and_clears_a_held_one(raw_connect):
    assert beat(A, at(100)) is True  # a new registration: its lock is taken after the beat
    assert lost_at(A) == at(100)
    holder = raw_connect()
    take_lock(holder, A)
    assert beat(A, at(110)) is True
    assert lost_at(A) is None
    drop_lock(holder, A)
    assert beat(A, at(120)) is True
    assert lost_at(A) == at(120)


def test_an_instance_that_never_holds_its_lock_is_evicted_only_when_stale():
    # heartbeat-table mode: every beat is a beat without the lock
    assert beat(A, at(100)) is True
    assert cleanup(at(105)) == []
    assert beat(A, at(110)) is True
    assert cleanup(at(110 + GRACE + 1)) == []
    assert next_eviction_in(at(110 + GRACE + 1)) == STALE - GRACE - 1
    assert cleanup(at(110 + STALE + 1)) == [A]


def test_with_a_grace_of_zero_a_missing_lock_alone_evicts_no_one(locked_a):
    drop_lock(locked_a, A)
    assert cleanup(at(101), grace=0) == []
    assert cleanup(at(129), grace=0) == []  # heartbeat 29 s old: fresh; the old rule stands
    assert next_eviction_in(at(129), grace=0) == 1
    assert cleanup(at(131), grace=0) == [A]


def test_the_definitive_cutoff_still_evicts_an_instance_whose_lock_is_held(locked_a):
    assert cleanup(at(100 + DEAD - 1)) == []
    assert next_eviction_in(at(100 + DEAD - 1)) == 1
    assert cleanup(at(100 + DEAD + 1)) == [A]


def test_the_heartbeats_inline_reap_applies_the_fast_rule(locked_a):
    drop_lock(locked_a, A)
    assert next_eviction_in(at(101)) == GRACE  # H's probe stamps A
    assert beat(H, at(101 + GRACE - 1)) is True
    assert exists(A)
    assert beat(H, at(101 + GRACE)) is True  # heartbeat 11 s old: fresh, yet evicted
    assert not exists(A)


def test_the_probe_is_a_read_unless_a_lock_state_changed(locked_a, raw_connect):
    conn = raw_connect()

    def probe_writes(now: datetime) -> bool:
        with conn.transaction():
            conn.execute(
                "SELECT workpump.next_eviction_in(%s, %s, %s, %s, %s)",
                [H, STALE, DEAD, GRACE, now],
            )
            # An UPDATE (even of no rows) holds RowExclusiveLock until the transaction ends.
            return conn.execute(
                "SELECT EXISTS (SELECT 1 FROM pg_locks WHERE pid = pg_backend_pid()"
                " AND relation = 'workpump_service_instance'::regclass"
                " AND mode = 'RowExclusiveLock') AS wrote"
            ).fetchone()["wrote"]

    assert probe_writes(at(101)) is False  # lock held, heartbeat fresh
    drop_lock(locked_a, A)
    assert probe_writes(at(102)) is True  # the missing lock is stamped
    assert probe_writes(at(103)) is False


def test_the_probe_ignores_the_instance_that_asks():
    instance(H, T0)  # the probing instance itself looks long dead
    assert next_eviction_in(at(1000)) is None


@pytest.mark.parametrize(
    ("stale", "dead", "grace"), [(0, 300, 10), (30, 20, 10), (30, 300, -1), (None, 300, 10)]
)
def test_the_probe_refuses_bad_parameters_with_their_names(stale, dead, grace):
    with pytest.raises(DataError, match="next_eviction_in needs"), transaction.atomic():
        scalar("SELECT workpump.next_eviction_in(%s, %s, %s, %s)", [H, stale, dead, grace])
