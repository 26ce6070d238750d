"""Waiting for rows to end: ``workpump.wait`` and ``await workpump.await_work``.

The functions that end rows (complete, fail to dead, discard, cancel, dead-letter)
NOTIFY ``workpump_done`` with the ended ids; a waiter LISTENs on its own connection and
returns once every row it waits for has ended, with each row's outcome. The tests wait
with a poll interval far longer than they allow, so only the notification can wake the
waiter in time. Real PostgreSQL; rows are committed (the waiter reads on its own
connection).
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import psycopg
import pytest
from django.db import connection

import django_workpump as workpump
from django_workpump.states import WorkState
from tests.helpers import conninfo, enroll, new_id, run_sql, wait_until

pytestmark = pytest.mark.django_db(transaction=True)

HOLDER = uuid.UUID("00000000-0000-0000-0000-0000000000d1")
NEVER = 600.0  # a poll interval no test waits for: a timely return was a notification


def claim(conn: psycopg.Connection[Any], topic: str) -> dict[uuid.UUID, uuid.UUID]:
    """Lease every row of ``topic`` to HOLDER on ``conn``: {id: lease token}."""
    rows = conn.execute(
        "SELECT work_id, lease_token FROM workpump.claim_work(p_instance_id => %s,"
        " p_topics => %s::jsonb)",
        [HOLDER, json.dumps({"outbox": [topic]})],
    ).fetchall()
    return dict(rows)


def complete(conn: psycopg.Connection[Any], leases: dict[uuid.UUID, uuid.UUID], result: Any):
    conn.execute(
        "SELECT * FROM workpump.complete_work(%s, 'outbox', %s::uuid[], %s::uuid[],"
        " array_fill(%s::jsonb, ARRAY[%s]))",
        [HOLDER, list(leases), list(leases.values()), json.dumps(result), len(leases)],
    )


def waiter_listening() -> bool:
    """True once a session of this database sits idle after the waiter's read."""
    return bool(
        run_sql(
            "SELECT 1 FROM pg_stat_activity WHERE datname = current_database()"
            " AND state = 'idle' AND query LIKE '%%workpump.work_outcomes%%'"
        )
    )


@pytest.fixture
def holder() -> Iterator[psycopg.Connection[Any]]:
    """The connection of another process holding leases (HOLDER, registered)."""
    enroll(HOLDER)
    with psycopg.connect(conninfo(), autocommit=True) as conn:
        yield conn


def completer(holder: psycopg.Connection[Any], topic: str) -> tuple[threading.Thread, list[float]]:
    """A thread that completes ``topic``'s rows once the waiter listens; it records when
    its completion committed."""
    committed: list[float] = []

    def run() -> None:
        try:
            assert wait_until(waiter_listening, 20)
            leases = claim(holder, topic)
            complete(holder, leases, {"total": 42})
            committed.append(time.monotonic())
        finally:
            connection.close()  # this thread's own

    return threading.Thread(target=run), committed


def test_wait_returns_when_a_completion_on_another_connection_commits(holder):
    ids = [workpump.send("wait.sync", {"n": n}) for n in range(3)]
    thread, committed = completer(holder, "wait.sync")
    thread.start()

    outcomes = workpump.wait(ids, timeout=30, poll_seconds=NEVER)
    returned = time.monotonic()
    thread.join()

    assert list(outcomes) == ids
    assert all(o.state == WorkState.DONE and o.result == {"total": 42} for o in outcomes.values())
    assert all(o.succeeded and o.ended and o.ended_at is not None for o in outcomes.values())
    assert returned - committed[0] < 5  # woken by the NOTIFY, not by a poll


def test_await_work_returns_when_a_completion_on_another_connection_commits(holder):
    ids = [workpump.send("wait.async", {"n": n}) for n in range(2)]
    thread, committed = completer(holder, "wait.async")
    thread.start()

    outcomes = asyncio.run(workpump.await_work(ids, timeout=30, poll_seconds=NEVER))
    returned = time.monotonic()
    thread.join()

    assert [o.state for o in outcomes.values()] == [WorkState.DONE, WorkState.DONE]
    assert returned - committed[0] < 5


@pytest.mark.parametrize("waiter", ["sync", "async"])
def test_a_timeout_names_the_rows_still_pending(holder, waiter):
    done_id = workpump.send("wait.timeout", {"n": 1})
    complete(holder, claim(holder, "wait.timeout"), None)
    pending_id = workpump.send("wait.timeout", {"n": 2})

    started = time.monotonic()
    with pytest.raises(workpump.WaitTimeout, match=str(pending_id)) as raised:
        if waiter == "sync":
            workpump.wait([done_id, pending_id], timeout=0.3, poll_seconds=NEVER)
        else:
            asyncio.run(workpump.await_work([done_id, pending_id], timeout=0.3, poll_seconds=NEVER))
    assert 0.3 <= time.monotonic() - started < 10

    assert raised.value.pending == [pending_id]
    assert list(raised.value.outcomes) == [done_id]
    assert isinstance(raised.value, TimeoutError)


def test_every_way_of_ending_is_reported(holder):
    done, discarded, dead, cancelled, parked = (
        workpump.send(f"wait.{name}", {}, max_attempts=1)
        for name in ("done", "discarded", "dead", "cancelled", "parked")
    )
    complete(holder, claim(holder, "wait.done"), [1, 2])
    [(work_id, token)] = claim(holder, "wait.discarded").items()
    holder.execute(
        "SELECT * FROM workpump.discard_work(%s, 'outbox', %s::uuid[], %s::uuid[],"
        " ARRAY['not for us'])",
        [HOLDER, [work_id], [token]],
    )
    [(work_id, token)] = claim(holder, "wait.dead").items()
    holder.execute(
        "SELECT * FROM workpump.fail_work(%s, 'outbox', %s::uuid[], %s::uuid[], ARRAY['boom'])",
        [HOLDER, [work_id], [token]],
    )
    workpump.cancel([cancelled])
    workpump.dead_letter([parked], "poison")

    outcomes = workpump.wait([done, discarded, dead, cancelled, parked], timeout=5)

    got = {i: (o.state, o.result, o.last_error, o.failure_reason) for i, o in outcomes.items()}
    assert got == {
        done: (WorkState.DONE, [1, 2], None, None),
        discarded: (WorkState.DISCARDED, None, "not for us", "discarded"),
        dead: (WorkState.DEAD, None, "boom", "max_attempts"),
        cancelled: (WorkState.CANCELLED, None, None, "cancelled"),
        parked: (WorkState.DEAD, None, None, "poison"),
    }
    assert [o.succeeded for o in outcomes.values()] == [True, False, False, False, False]


@pytest.mark.parametrize("waiter", ["sync", "async"])
def test_unknown_ids_are_a_clear_error(waiter):
    known = workpump.send("wait.unknown", {})
    stranger = new_id()
    with pytest.raises(workpump.UnknownWork, match=f"No work row has the id {stranger}") as raised:
        if waiter == "sync":
            workpump.wait([known, stranger], timeout=1)
        else:
            asyncio.run(workpump.await_work([known, str(stranger)], timeout=1))
    assert raised.value.ids == [stranger]


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="wait\\(\\) takes work ids"):
        workpump.wait(["not-a-uuid"])
    with pytest.raises(ValueError, match="timeout >= 0"):
        workpump.wait([new_id()], timeout=-1)
    assert workpump.wait([]) == {}


def listen(channel: str) -> Callable[[], list[str]]:
    conn = psycopg.connect(conninfo(), autocommit=True)
    conn.execute(f"LISTEN {channel}")

    def payloads() -> list[str]:
        try:
            return [n.payload for n in conn.notifies(timeout=2, stop_after=1)]
        finally:
            conn.close()

    return payloads


def test_a_completion_notifies_its_ids_once_and_many_ids_as_a_star(holder):
    ids = [workpump.send("wait.notify", {"n": n}) for n in range(3)]
    heard = listen("workpump_done")
    complete(holder, claim(holder, "wait.notify"), None)
    [payload] = heard()
    assert sorted(payload.split(",")) == sorted(str(i) for i in ids)

    heard = listen("workpump_done")
    run_sql("SELECT workpump.notify_ended(%s::uuid[])", [[uuid.uuid4() for _ in range(201)]])
    assert heard() == ["*"]


def test_a_hostile_notification_only_makes_the_waiter_read_again(holder):
    work_id = workpump.send("wait.hostile", {})
    noise: Iterator[str] = iter(["not,ids", "*", "x" * 7000])

    def spoof_then_complete() -> None:
        try:
            assert wait_until(waiter_listening, 20)
            for payload in noise:
                run_sql("SELECT pg_notify('workpump_done', %s)", [payload])
            complete(holder, claim(holder, "wait.hostile"), "ok")
        finally:
            connection.close()  # this thread's own

    thread = threading.Thread(target=spoof_then_complete)
    thread.start()
    outcomes = workpump.wait([work_id], timeout=30, poll_seconds=NEVER)
    thread.join()
    assert outcomes[work_id].result == "ok"


def test_a_row_the_claim_parks_as_dead_wakes_its_waiter(holder):
    work_id = workpump.send("wait.parked", {}, max_attempts=1)
    # its only attempt's lease ran out an hour ago, without an outcome
    holder.execute(
        "SELECT * FROM workpump.claim_work(p_instance_id => %s, p_lease_seconds => 60,"
        " p_topics => %s::jsonb, p_now => now() - interval '1 hour')",
        [HOLDER, json.dumps({"outbox": ["wait.parked"]})],
    )

    def claim_parks_it() -> None:
        try:
            assert wait_until(waiter_listening, 20)
            assert claim(holder, "wait.parked") == {}  # parked, not leased
        finally:
            connection.close()  # this thread's own

    thread = threading.Thread(target=claim_parks_it)
    thread.start()
    outcomes = workpump.wait([work_id], timeout=30, poll_seconds=NEVER)
    thread.join()
    assert (outcomes[work_id].state, outcomes[work_id].failure_reason) == (
        WorkState.DEAD,
        "max_attempts",
    )
