"""Liveness SQL: record_heartbeat, cleanup_stale_instances, the alive-lock,
live_instances, eviction fencing, orphan NOTIFY and deregister_instance.

Time comes from p_now; tests that need other sessions (held alive-locks, row locks, NOTIFY
on commit, a heartbeat racing an eviction) run with transaction=True and raw connections.
"""

from __future__ import annotations

import json
import queue
import threading
import time
import uuid
from datetime import datetime
from typing import Any

import psycopg
import pytest
from django.db import DatabaseError, DataError, IntegrityError, transaction

from django_workpump import models
from tests.factories import EvictionFactory, OutboxFactory, ServiceInstanceFactory
from tests.helpers import (
    T0,
    WORK_TABLES,
    A,
    B,
    at,
    current_tokens,
    enroll,
    run_sql,
    scalar,
    wait_until,
)

pytestmark = pytest.mark.django_db

C = uuid.UUID("00000000-0000-0000-0000-00000000000c")
H = uuid.UUID("00000000-0000-0000-0000-0000000000ff")  # the instance that beats

SUBSCRIBERS = json.dumps(
    [
        {"category": "perspective_event", "name": "order_totals"},
        {"category": "receptor", "name": "warehouse"},
    ]
)
HEARTBEAT = (
    "SELECT workpump.record_heartbeat(%s, 'tests', 'host-1', 4242, p_metadata => %s::jsonb,"
    " p_stale_after_seconds => %s, p_definitively_dead_after_seconds => %s, p_now => %s) AS ok"
)


def beat(
    instance_id: uuid.UUID | None,
    now: datetime,
    *,
    stale: int | None = 30,
    dead: int | None = 300,
    metadata: dict[str, Any] | None = None,
) -> bool:
    return scalar(HEARTBEAT, [instance_id, json.dumps(metadata or {}), stale, dead, now])


def raw_beat(conn: psycopg.Connection[Any], instance_id: uuid.UUID, now: datetime) -> bool:
    return conn.execute(HEARTBEAT, [instance_id, "{}", 30, 300, now]).fetchone()["ok"]


def cleanup(
    stale_cutoff: datetime | None, dead_cutoff: datetime | None = None, now: datetime = T0
) -> list[uuid.UUID]:
    rows = run_sql(
        "SELECT instance_id FROM workpump.cleanup_stale_instances(%s, %s, 0, %s)",
        [stale_cutoff, dead_cutoff, now],
    )
    return [r["instance_id"] for r in rows]


def registered() -> set[uuid.UUID]:
    return set(models.ServiceInstance.objects.values_list("instance_id", flat=True))


def tombstoned() -> set[uuid.UUID]:
    return set(models.Eviction.objects.values_list("instance_id", flat=True))


def instance(instance_id: uuid.UUID, heartbeat_at: datetime) -> models.ServiceInstance:
    return ServiceInstanceFactory(
        instance_id=instance_id, started_at=heartbeat_at, last_heartbeat_at=heartbeat_at
    )


def lease_one_of_each(instance_id: uuid.UUID, now: datetime) -> dict[str, uuid.UUID]:
    """Produce one ordered row per category and claim all four for ``instance_id``."""
    tag = instance_id.hex[-4:]
    run_sql("SELECT workpump.send('emails.welcome', '{}', %s)", [f"user-{tag}"])
    run_sql(
        "SELECT workpump.receive(%s, 'stripe.webhook', '{}', %s)", [uuid.uuid4(), f"acct-{tag}"]
    )
    run_sql(
        "SELECT workpump.emit('order.placed', '{}', %s, %s::jsonb)", [f"order-{tag}", SUBSCRIBERS]
    )
    rows = run_sql(
        "SELECT category, work_id FROM workpump.claim_work(%s, p_max_rows => 10, p_now => %s)",
        [instance_id, now],
    )
    claimed = {r["category"]: r["work_id"] for r in rows}
    assert sorted(claimed) == sorted(WORK_TABLES)
    return claimed


def work_row(category: str, work_id: uuid.UUID, now: datetime = T0) -> dict[str, Any]:
    table, key = WORK_TABLES[category]
    rows = run_sql(
        f"SELECT t.*, workpump.state_of(t.done_at, t.dead_lettered_at, t.instance_id,"
        f" t.lease_expiry, t.claimed_at, t.scheduled_for, NULL, %s) AS state"
        f" FROM {table} t WHERE t.{key} = %s",
        [now, work_id],
    )
    assert len(rows) == 1
    return rows[0]


def streams_of(instance_id: uuid.UUID) -> list[dict[str, Any]]:
    return run_sql(
        "SELECT category, stream, lease_expiry FROM workpump_active_stream"
        " WHERE owner_instance_id = %s ORDER BY category",
        [instance_id],
    )


def drain(conn: psycopg.Connection[Any], timeout: float) -> list[psycopg.Notify]:
    return list(conn.notifies(timeout=timeout))


# --- record_heartbeat ------------------------------------------------------------------


def test_record_heartbeat_needs_four_arguments_and_defaults_the_rest():
    proc = run_sql(
        "SELECT p.proargnames, p.pronargs, p.pronargdefaults, p.prorettype::regtype::text AS ret"
        " FROM pg_proc p WHERE p.pronamespace = 'workpump'::regnamespace"
        " AND p.proname = 'record_heartbeat'"
    )
    assert len(proc) == 1
    assert proc[0]["proargnames"][:4] == [
        "p_instance_id",
        "p_service_name",
        "p_host_name",
        "p_process_id",
    ]
    assert proc[0]["proargnames"][-2:] == ["p_lock_loss_grace_seconds", "p_now"]
    assert proc[0]["pronargdefaults"] == proc[0]["pronargs"] - 4
    assert proc[0]["ret"] == "boolean"
    # An operator can call it by hand with the four required arguments.
    assert scalar("SELECT workpump.record_heartbeat(%s, 'ops', 'box', 1)", [A]) is True
    assert registered() == {A}


def test_first_heartbeat_registers_the_instance_at_p_now():
    assert beat(A, T0, metadata={"version": "1.2"}) is True

    row = models.ServiceInstance.objects.get(instance_id=A)
    assert (row.service_name, row.host_name, row.process_id) == ("tests", "host-1", 4242)
    assert row.started_at == T0
    assert row.last_heartbeat_at == T0
    assert row.metadata == {"version": "1.2"}
    assert row.alive_lock_key is not None


def test_later_heartbeat_advances_the_beat_and_keeps_start_and_lock_key():
    beat(A, T0, metadata={"version": "1"})
    first = models.ServiceInstance.objects.get(instance_id=A)

    assert beat(A, at(10), metadata={"version": "2"}) is True

    row = models.ServiceInstance.objects.get(instance_id=A)
    assert row.last_heartbeat_at == at(10)
    assert row.started_at == T0
    assert row.alive_lock_key == first.alive_lock_key
    assert row.metadata == {"version": "2"}


def test_each_instance_draws_its_own_alive_lock_key():
    beat(A, T0)
    beat(B, T0)
    keys = dict(models.ServiceInstance.objects.values_list("instance_id", "alive_lock_key"))
    assert keys[A] != keys[B]


def test_tombstoned_instance_heartbeat_is_refused_and_registers_nothing():
    EvictionFactory(instance_id=A)

    assert beat(A, at(10)) is False
    assert registered() == set()


def test_tombstoned_instance_heartbeat_touches_neither_its_row_nor_stale_peers():
    instance(A, T0)
    instance(B, T0)  # stale by at(100)
    EvictionFactory(instance_id=A)

    assert beat(A, at(100)) is False

    assert models.ServiceInstance.objects.get(instance_id=A).last_heartbeat_at == T0
    assert registered() == {A, B}
    assert tombstoned() == {A}


def test_heartbeat_evicts_peers_older_than_the_stale_cutoff():
    instance(A, T0)  # 60 s old: stale
    instance(B, at(50))  # fresh
    instance(C, at(30))  # exactly at the cutoff: not older, so kept
    stale_row = OutboxFactory(instance_id=A, lease_expiry=at(300), claimed_at=T0, attempts=1)

    assert beat(H, at(60)) is True

    assert registered() == {B, C, H}
    assert tombstoned() == {A}
    stale_row.refresh_from_db()
    assert (stale_row.instance_id, stale_row.lease_expiry) == (None, None)
    assert stale_row.failure_reason == "instance_evicted"
    assert models.ServiceInstance.objects.get(instance_id=B).last_heartbeat_at == at(50)


def test_heartbeat_uses_its_stale_threshold_for_the_reap():
    instance(A, at(45))  # 15 s old at at(60)

    beat(H, at(60))
    assert registered() == {A, H}

    beat(H, at(61), stale=10, dead=100)
    assert registered() == {H}
    assert tombstoned() == {A}


def test_heartbeat_leaves_the_callers_lock_timeout_alone():
    instance(A, T0)
    before = scalar("SHOW lock_timeout")

    beat(H, at(60))  # reaps A under its own short lock timeout

    assert tombstoned() == {A}
    assert scalar("SHOW lock_timeout") == before


@pytest.mark.django_db(transaction=True)
def test_heartbeat_reap_gives_up_on_a_locked_row_instead_of_waiting(raw_connect):
    instance(A, T0)
    locked = OutboxFactory(instance_id=A, lease_expiry=at(300), claimed_at=T0, attempts=1)
    locker = raw_connect()
    caller = raw_connect()
    caller.execute("SET statement_timeout = '5s'")

    with locker.transaction():
        locker.execute(
            "SELECT 1 FROM workpump_outbox WHERE work_id = %s FOR UPDATE", [locked.work_id]
        )
        started = time.monotonic()
        ok = raw_beat(caller, H, at(60))  # raises QueryCanceled if it waited 5 s
        elapsed = time.monotonic() - started

        assert ok is True
        assert elapsed < 2.5
        # the reap rolled back as a whole: A lives on, its lease untouched
        assert registered() == {A, H}
        assert tombstoned() == set()
        locked.refresh_from_db()
        assert locked.instance_id == A

    assert raw_beat(caller, H, at(61)) is True
    assert registered() == {H}
    assert tombstoned() == {A}
    locked.refresh_from_db()
    assert locked.instance_id is None


@pytest.mark.django_db(transaction=True)
def test_heartbeat_reap_spares_a_locked_alive_instance_until_definitively_dead(raw_connect):
    instance(A, T0)
    holder = raw_connect()
    assert holder.execute("SELECT workpump.take_alive_lock(%s) AS ok", [A]).fetchone()["ok"]

    beat(H, at(300))  # A is stale, but its lock is held and it is 300 s old, not older
    assert registered() == {A, H}

    beat(H, at(301))
    assert registered() == {H}
    assert tombstoned() == {A}


@pytest.mark.django_db(transaction=True)
def test_heartbeat_racing_an_eviction_does_not_resurrect_the_instance(raw_connect):
    instance(A, T0)
    evictor = raw_connect()
    beater = raw_connect()
    beater.execute("SET statement_timeout = '10s'")
    results: queue.Queue[Any] = queue.Queue()

    def heartbeat() -> None:
        try:
            results.put(raw_beat(beater, A, at(61)))
        except Exception as exc:  # noqa: BLE001 - surfaced by the assertion below
            results.put(exc)

    with evictor.transaction():
        evicted = evictor.execute(
            "SELECT instance_id FROM workpump.cleanup_stale_instances(%s, NULL, 0, %s)",
            [at(30), at(60)],
        ).fetchall()
        assert [r["instance_id"] for r in evicted] == [A]
        thread = threading.Thread(target=heartbeat)
        thread.start()
        # Wait until the beat is blocked on the instance row the eviction deleted.
        deadline = time.monotonic() + 5
        while not scalar("SELECT cardinality(pg_blocking_pids(%s)) > 0", [beater.info.backend_pid]):
            assert results.empty(), "the heartbeat finished before the eviction committed"
            assert time.monotonic() < deadline, "the heartbeat never waited on the eviction"

    assert results.get(timeout=10) is False
    thread.join(timeout=5)
    assert registered() == set()
    assert tombstoned() == {A}


# --- cleanup_stale_instances -----------------------------------------------------------


def test_cleanup_evicts_stale_instances_and_returns_their_ids_in_order():
    instance(B, T0)
    instance(A, at(10))
    instance(C, at(50))  # fresh

    assert cleanup(at(30), now=at(60)) == [A, B]

    assert registered() == {C}
    tombstones = {t.instance_id: t for t in models.Eviction.objects.all()}
    assert set(tombstones) == {A, B}
    assert tombstones[A].evicted_at == at(60)
    assert "stale cutoff" in tombstones[A].reason
    assert "tests@localhost" in tombstones[A].reason


def test_cleanup_with_nothing_stale_evicts_nothing():
    instance(A, at(30))
    instance(B, at(60))

    assert cleanup(at(30), at(-240), now=at(60)) == []
    assert registered() == {A, B}
    assert tombstoned() == set()


def test_cleanup_past_the_dead_cutoff_evicts_an_unlocked_instance_too():
    instance(A, T0)

    assert cleanup(at(70), at(10), now=at(100)) == [A]


def test_cleanup_needs_a_stale_cutoff():
    instance(A, T0)
    with pytest.raises(DataError, match="needs p_stale_cutoff"):
        cleanup(None, now=at(60))


@pytest.mark.django_db(transaction=True)
def test_a_held_alive_lock_protects_a_stale_instance_until_the_dead_cutoff(raw_connect):
    instance(A, T0)
    instance(B, T0)  # stale, no lock: evicted
    holder = raw_connect()
    assert holder.execute("SELECT workpump.take_alive_lock(%s) AS ok", [A]).fetchone()["ok"]

    assert cleanup(at(70), at(-200), now=at(100)) == [B]
    assert registered() == {A}

    assert cleanup(at(70), at(10), now=at(100)) == [A]
    assert registered() == set()
    assert tombstoned() == {A, B}


@pytest.mark.django_db(transaction=True)
def test_a_held_alive_lock_always_protects_when_the_dead_cutoff_is_null(raw_connect):
    instance(A, T0)
    holder = raw_connect()
    assert holder.execute("SELECT workpump.take_alive_lock(%s) AS ok", [A]).fetchone()["ok"]

    assert cleanup(at(100_000), None, now=at(100_000)) == []
    assert registered() == {A}
    assert tombstoned() == set()


# --- what an eviction does to the work ---------------------------------------------------


def test_eviction_releases_every_lease_of_the_instance_as_orphaned():
    beat(A, T0)
    leased = lease_one_of_each(A, T0)

    assert cleanup(at(30), now=at(60)) == [A]

    for category, work_id in leased.items():
        row = work_row(category, work_id, now=at(60))
        assert (row["instance_id"], row["lease_expiry"]) == (None, None), category
        assert row["lease_renewals"] == 0
        assert row["failure_reason"] == "instance_evicted"
        assert str(A) in row["last_error"]
        assert "evicted" in row["last_error"]
        assert row["claimed_at"] == T0  # the attempt stays open...
        assert row["state"] == "orphaned"  # ...so it reads as orphaned
        assert row["attempts"] == 1  # the next claim counts the next attempt


def test_eviction_releases_the_instances_streams_only():
    beat(A, T0)
    instance(B, at(50))  # registered without a beat, which would reap A already
    lease_one_of_each(A, T0)
    lease_one_of_each(B, at(50))
    assert len(streams_of(A)) == 4

    cleanup(at(30), now=at(60))

    assert streams_of(A) == []
    orphaned = run_sql(
        "SELECT count(*) AS n FROM workpump_active_stream"
        " WHERE owner_instance_id IS NULL AND lease_expiry IS NULL"
    )
    assert orphaned[0]["n"] == 4
    assert len(streams_of(B)) == 4


def test_eviction_leaves_other_instances_leases_alone():
    beat(A, T0)
    instance(B, at(50))  # registered without a beat, which would reap A already
    lease_one_of_each(A, T0)
    theirs = lease_one_of_each(B, at(50))

    cleanup(at(30), now=at(60))

    for category, work_id in theirs.items():
        row = work_row(category, work_id, now=at(60))
        assert row["instance_id"] == B, category
        assert row["lease_expiry"] == at(350)
        assert row["failure_reason"] is None
        assert row["state"] == "leased"


def test_rows_released_by_eviction_are_claimable_at_once_by_a_peer():
    beat(A, T0)
    leased = lease_one_of_each(A, T0)
    cleanup(at(30), now=at(60))
    enroll(B, at(61))

    rows = run_sql(
        "SELECT category, work_id, attempts FROM workpump.claim_work(%s, p_max_rows => 10,"
        " p_now => %s)",
        [B, at(61)],
    )

    assert {r["category"]: r["work_id"] for r in rows} == leased
    assert {r["attempts"] for r in rows} == {2}
    for category, work_id in leased.items():
        row = work_row(category, work_id, now=at(61))
        assert row["instance_id"] == B
        assert row["state"] == "leased"
    assert len(streams_of(B)) == 4


# --- fencing of the evicted instance ------------------------------------------------------


def late_outcomes(
    category: str, work_id: uuid.UUID, token: uuid.UUID, now: datetime
) -> dict[str, Any]:
    """What the evicted instance A gets back for a late renew, complete, fail and release
    of the attempt it was running (lease token ``token``)."""
    try:
        with transaction.atomic():
            renewed: Any = run_sql(
                "SELECT * FROM workpump.renew_leases(%s, %s, %s, 300, %s, %s)",
                [category, [work_id], [token], A, now],
            )
    except DatabaseError as exc:
        renewed = "refused" if "it was evicted" in str(exc) else str(exc)
    return {
        "renew": renewed,
        "complete": run_sql(
            "SELECT status FROM workpump.complete_work(%s, %s, %s, %s, p_now => %s)",
            [A, category, [work_id], [token], now],
        ),
        "fail": run_sql(
            "SELECT status FROM workpump.fail_work(%s, %s, %s, %s, %s, p_now => %s)",
            [A, category, [work_id], [token], ["boom"], now],
        ),
        "release": run_sql(
            "SELECT status FROM workpump.release_work(%s, %s, %s, %s, %s)",
            [A, category, [work_id], [token], now],
        ),
    }


LOST = {
    "renew": "refused",  # an evicted instance may not renew at all
    "complete": [{"status": "lost"}],
    "fail": [{"status": "lost"}],
    "release": [{"status": "lost"}],
}


@pytest.mark.parametrize("category", sorted(WORK_TABLES))
def test_evicted_instance_cannot_renew_complete_or_fail_its_released_rows(category):
    beat(A, T0)
    work_id = lease_one_of_each(A, T0)[category]
    [token] = current_tokens(category, [work_id])
    cleanup(at(30), now=at(60))
    before = work_row(category, work_id, now=at(61))

    assert late_outcomes(category, work_id, token, at(61)) == LOST

    assert work_row(category, work_id, now=at(61)) == before


@pytest.mark.parametrize("category", sorted(WORK_TABLES))
def test_evicted_instance_cannot_touch_rows_a_peer_reclaimed(category):
    beat(A, T0)
    work_id = lease_one_of_each(A, T0)[category]
    [token] = current_tokens(category, [work_id])
    cleanup(at(30), now=at(60))
    enroll(B, at(61))
    run_sql("SELECT * FROM workpump.claim_work(%s, p_max_rows => 10, p_now => %s)", [B, at(61)])
    before = work_row(category, work_id, now=at(62))
    assert before["instance_id"] == B

    assert late_outcomes(category, work_id, token, at(62)) == LOST

    after = work_row(category, work_id, now=at(62))
    assert after == before
    assert after["state"] == "leased"


def test_evicted_instance_heartbeat_is_refused_and_does_not_come_back():
    beat(A, T0)
    leased = lease_one_of_each(A, T0)
    assert cleanup(at(30), now=at(60)) == [A]

    assert beat(A, at(61)) is False
    assert beat(A, at(71)) is False

    assert registered() == set()
    for category, work_id in leased.items():
        assert work_row(category, work_id, now=at(71))["instance_id"] is None


# --- orphan NOTIFY ---------------------------------------------------------------------


@pytest.mark.django_db(transaction=True)
def test_eviction_notifies_the_orphan_channel_once_when_it_commits(raw_connect):
    instance(A, T0)
    instance(B, T0)
    listener = raw_connect()
    listener.execute("LISTEN workpump_orphan")
    evictor = raw_connect()

    with evictor.transaction():
        evictor.execute(
            "SELECT * FROM workpump.cleanup_stale_instances(%s, NULL, 0, %s)", [at(30), at(60)]
        )
        assert drain(listener, 0.3) == []  # nothing before the commit

    got = list(listener.notifies(timeout=5, stop_after=1))
    assert [(n.channel, n.payload) for n in got] == [("workpump_orphan", "evicted")]
    assert drain(listener, 0.5) == []  # one notification for both instances
    assert tombstoned() == {A, B}


@pytest.mark.django_db(transaction=True)
def test_heartbeat_reap_notifies_the_orphan_channel(raw_connect):
    instance(A, T0)
    listener = raw_connect()
    listener.execute("LISTEN workpump_orphan")

    beat(H, at(60))

    got = list(listener.notifies(timeout=5, stop_after=1))
    assert [n.channel for n in got] == ["workpump_orphan"]


@pytest.mark.django_db(transaction=True)
def test_no_orphan_notification_when_nothing_is_evicted(raw_connect):
    instance(A, at(50))
    listener = raw_connect()
    listener.execute("LISTEN workpump_orphan")

    assert cleanup(at(30), now=at(60)) == []
    beat(H, at(60))

    assert drain(listener, 0.5) == []


# --- the liveness rule -----------------------------------------------------------------


def live(stale_cutoff: datetime, dead_cutoff: datetime | None) -> set[uuid.UUID]:
    rows = run_sql("SELECT workpump.live_instances(%s, %s) AS id", [stale_cutoff, dead_cutoff])
    return {r["id"] for r in rows}


def test_live_instances_are_the_fresh_ones():
    instance(A, at(50))
    instance(B, at(30))  # at the cutoff: still fresh
    instance(C, at(29))

    assert live(at(30), at(-240)) == {A, B}
    assert live(at(30), None) == {A, B}


@pytest.mark.django_db(transaction=True)
def test_live_instances_counts_a_locked_stale_instance_until_the_dead_cutoff(raw_connect):
    instance(A, T0)  # stale, alive-lock held
    instance(B, T0)  # stale, no lock
    instance(C, at(90))  # fresh
    holder = raw_connect()
    assert holder.execute("SELECT workpump.take_alive_lock(%s) AS ok", [A]).fetchone()["ok"]

    assert live(at(70), at(-200)) == {A, C}
    assert live(at(70), None) == {A, C}
    assert live(at(70), at(10)) == {C}


# --- the alive-lock --------------------------------------------------------------------


def test_an_unregistered_instance_has_no_alive_lock_to_take():
    assert scalar("SELECT workpump.take_alive_lock(%s)", [A]) is False
    assert scalar("SELECT workpump.alive_lock_held(%s)", [A]) is False
    assert scalar("SELECT count(*) FROM workpump.held_alive_lock_keys()") == 0


def test_a_registered_instance_nobody_locked_is_not_held():
    beat(A, T0)
    assert scalar("SELECT workpump.alive_lock_held(%s)", [A]) is False


def test_alive_lock_keys_are_unique():
    beat(A, T0)
    key = models.ServiceInstance.objects.get(instance_id=A).alive_lock_key

    with pytest.raises(IntegrityError), transaction.atomic():
        ServiceInstanceFactory(instance_id=B, alive_lock_key=key)
    assert registered() == {A}


@pytest.mark.django_db(transaction=True)
def test_only_the_session_that_took_an_instances_alive_lock_last_proves_it_alive(raw_connect):
    beat(A, T0)
    first = raw_connect()
    second = raw_connect()

    assert first.execute("SELECT workpump.take_alive_lock(%s) AS ok", [A]).fetchone()["ok"]
    first_key = models.ServiceInstance.objects.get(instance_id=A).alive_lock_key
    # A reconnected listener whose old session has not ended yet: it draws a free key.
    assert second.execute("SELECT workpump.take_alive_lock(%s) AS ok", [A]).fetchone()["ok"]
    row = models.ServiceInstance.objects.get(instance_id=A)
    assert row.alive_lock_key != first_key
    assert row.alive_lock_pid == second.info.backend_pid
    assert scalar("SELECT workpump.alive_lock_held(%s)", [A]) is True

    second.close()  # the old session still holds the old key: it proves nothing now
    assert wait_until(lambda: scalar("SELECT workpump.alive_lock_held(%s)", [A]) is False)


@pytest.mark.django_db(transaction=True)
def test_alive_locks_of_different_instances_do_not_collide(raw_connect):
    beat(A, T0)
    beat(B, T0)
    beat(C, T0)
    first = raw_connect()
    second = raw_connect()

    assert first.execute("SELECT workpump.take_alive_lock(%s) AS ok", [A]).fetchone()["ok"]
    assert second.execute("SELECT workpump.take_alive_lock(%s) AS ok", [B]).fetchone()["ok"]

    held = run_sql(
        "SELECT instance_id, workpump.alive_lock_held(instance_id) AS held"
        " FROM workpump_service_instance"
    )
    assert {r["instance_id"]: r["held"] for r in held} == {A: True, B: True, C: False}


@pytest.mark.django_db(transaction=True)
def test_an_alive_lock_is_released_when_its_session_closes(raw_connect):
    beat(A, T0)
    holder = raw_connect()
    assert holder.execute("SELECT workpump.take_alive_lock(%s) AS ok", [A]).fetchone()["ok"]
    key = models.ServiceInstance.objects.get(instance_id=A).alive_lock_key

    holder.close()
    # The server ends the closed session asynchronously: wait (bounded) for its lock.
    waiter = raw_connect()
    waiter.execute("SET lock_timeout = '5s'")
    waiter.execute("SELECT pg_advisory_lock(workpump.lock_namespace('alive'), %s)", [key])
    waiter.execute("SELECT pg_advisory_unlock(workpump.lock_namespace('alive'), %s)", [key])

    assert scalar("SELECT workpump.alive_lock_held(%s)", [A]) is False
    restarted = raw_connect()
    assert restarted.execute("SELECT workpump.take_alive_lock(%s) AS ok", [A]).fetchone()["ok"]


# --- deregister_instance ---------------------------------------------------------------


def test_deregister_gives_back_every_undone_lease_and_removes_the_instance():
    beat(A, T0)
    leased = lease_one_of_each(A, T0)

    assert scalar("SELECT workpump.deregister_instance(%s, %s)", [A, at(10)]) == 4

    for category, work_id in leased.items():
        row = work_row(category, work_id, now=at(10))
        assert (row["instance_id"], row["lease_expiry"], row["claimed_at"]) == (None, None, None)
        assert row["attempts"] == 0  # the attempt never started
        assert row["state"] == "pending"
    assert streams_of(A) == []
    assert registered() == set()
    assert tombstoned() == set()


def test_deregister_counts_only_its_own_undone_rows():
    beat(A, T0)
    beat(B, T0)
    mine = OutboxFactory(instance_id=A, lease_expiry=at(300), claimed_at=T0, attempts=2)
    done = OutboxFactory(
        instance_id=A, lease_expiry=at(300), claimed_at=T0, attempts=1, done_at=at(5)
    )
    theirs = OutboxFactory(instance_id=B, lease_expiry=at(300), claimed_at=T0, attempts=1)

    assert scalar("SELECT workpump.deregister_instance(%s, %s)", [A, at(10)]) == 1

    mine.refresh_from_db()
    done.refresh_from_db()
    theirs.refresh_from_db()
    assert (mine.instance_id, mine.attempts) == (None, 1)
    assert (done.instance_id, done.attempts) == (A, 1)
    assert (theirs.instance_id, theirs.attempts) == (B, 1)
    assert registered() == {B}


def test_deregistered_instance_may_register_again():
    beat(A, T0)
    scalar("SELECT workpump.deregister_instance(%s, %s)", [A, at(10)])

    assert beat(A, at(20)) is True
    assert registered() == {A}


@pytest.mark.django_db(transaction=True)
def test_deregister_notifies_the_orphan_channel_only_when_it_released_work(raw_connect):
    beat(A, T0)
    beat(B, T0)
    OutboxFactory(instance_id=A, lease_expiry=at(300), claimed_at=T0, attempts=1)
    listener = raw_connect()
    listener.execute("LISTEN workpump_orphan")

    assert scalar("SELECT workpump.deregister_instance(%s, %s)", [B, at(10)]) == 0
    assert drain(listener, 0.5) == []

    assert scalar("SELECT workpump.deregister_instance(%s, %s)", [A, at(10)]) == 1
    got = list(listener.notifies(timeout=5, stop_after=1))
    assert [(n.channel, n.payload) for n in got] == [("workpump_orphan", "released")]


# --- bad input -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("instance_id", "stale", "dead", "message"),
    [
        (None, 30, 300, "needs p_instance_id"),
        (A, 0, 300, r"0 < p_stale_after_seconds \(0\)"),
        (A, -5, 300, r"0 < p_stale_after_seconds \(-5\)"),
        (A, None, 300, "p_stale_after_seconds"),
        (A, 30, 20, r"\(30\) <= p_definitively_dead_after_seconds \(20\)"),
        (A, 30, None, "p_definitively_dead_after_seconds"),
    ],
)
def test_record_heartbeat_refuses_bad_arguments(instance_id, stale, dead, message):
    with pytest.raises(DataError, match=message), transaction.atomic():
        beat(instance_id, T0, stale=stale, dead=dead)
    assert registered() == set()
