"""Flow control under concurrent sessions: each worker a thread with its own connection.

Covers: a key cap and a rate limit held exactly by claimers racing on separate
connections (each claim sees the others' committed leases: the rules are locked before
counting), and a topic rule created while a producer's transaction is open (the row ends
up flagged whichever commits first). Time comes from p_now, never from sleeping.
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Callable
from typing import Any

import psycopg
import pytest

from tests.helpers import T0, at, wait_until
from tests.sql.test_concurrency import BARRIER_TIMEOUT_SECONDS, register, run_together

pytestmark = pytest.mark.django_db(transaction=True)

Conn = psycopg.Connection[dict[str, Any]]


def claim(conn: Conn, instance: uuid.UUID, max_rows: int, now: Any = T0) -> list[dict[str, Any]]:
    return conn.execute(
        "SELECT category, work_id, lease_token FROM workpump.claim_work("
        "p_instance_id => %s, p_max_rows => %s, p_now => %s)",
        (instance, max_rows, now),
    ).fetchall()


def complete(conn: Conn, instance: uuid.UUID, rows: list[dict[str, Any]], now: Any) -> None:
    for row in rows:
        conn.execute(
            "SELECT * FROM workpump.complete_work(%s, %s, %s::uuid[], %s::uuid[], p_now => %s)",
            (instance, row["category"], [row["work_id"]], [row["lease_token"]], now),
        )


HELD = """
SELECT (SELECT count(*) FROM workpump_outbox WHERE concurrency_key = 'partner:acme'
          AND instance_id IS NOT NULL AND lease_expiry > %(now)s)
     + (SELECT count(*) FROM workpump_inbox WHERE concurrency_key = 'partner:acme'
          AND instance_id IS NOT NULL AND lease_expiry > %(now)s) AS held
"""


def test_racing_claimers_never_hold_more_of_a_key_than_its_cap(raw_connect):
    claimers, cap, rounds = 4, 5, 25
    producer = raw_connect()
    producer.execute(
        "SELECT workpump.set_flow_rule('key', '', 'partner:acme', '{\"concurrency\": 5}')"
    )
    producer.execute(
        "SELECT workpump.send('api.call', '{}'::jsonb, p_concurrency_key => 'partner:acme')"
        " FROM generate_series(1, 60)"
    )
    producer.execute(
        "SELECT workpump.receive(gen_random_uuid(), 'api.hook', '{}'::jsonb,"
        " p_concurrency_key => 'partner:acme') FROM generate_series(1, 60)"
    )
    conns = [raw_connect() for _ in range(claimers)]
    instances = [uuid.uuid4() for _ in range(claimers)]
    for pid, (conn, instance) in enumerate(zip(conns, instances, strict=True)):
        register(conn, instance, pid)
    held_now: list[int] = []
    started: list[int] = []

    def at_barrier() -> None:
        held_now.append(producer.execute(HELD, {"now": T0}).fetchone()["held"])  # type: ignore[index]

    barrier = threading.Barrier(claimers, action=at_barrier, timeout=BARRIER_TIMEOUT_SECONDS)

    def claimer(i: int) -> Callable[[], None]:
        def work() -> None:
            mine: list[dict[str, Any]] = []
            for tick in range(rounds):
                barrier.wait()
                rows = claim(conns[i], instances[i], 3)
                started.append(len(rows))
                mine.extend(rows)
                barrier.wait()
                # each claimer finishes its oldest row every other tick
                if tick % 2 == 1 and mine:
                    complete(conns[i], instances[i], [mine.pop(0)], T0)

        return work

    run_together([claimer(i) for i in range(claimers)], barrier)
    assert max(held_now) == cap  # the cap was reached, and never passed
    assert sum(started) > cap  # rows were started again as others finished


def test_racing_claimers_start_no_more_than_the_rate_allows(raw_connect):
    claimers = 4
    producer = raw_connect()
    producer.execute(
        "SELECT workpump.set_flow_rule('topic', 'outbox', 'api.call',"
        ' \'{"rate": 20, "burst": 5}\', p_now => %s)',
        (T0,),
    )
    producer.execute("SELECT workpump.send('api.call', '{}'::jsonb) FROM generate_series(1, 400)")
    conns = [raw_connect() for _ in range(claimers)]
    instances = [uuid.uuid4() for _ in range(claimers)]
    for pid, (conn, instance) in enumerate(zip(conns, instances, strict=True)):
        register(conn, instance, pid)
    starts: list[int] = []
    barrier = threading.Barrier(claimers, timeout=BARRIER_TIMEOUT_SECONDS)

    def claimer(i: int) -> Callable[[], None]:
        def work() -> None:
            for tick in range(50):  # 5 s of claims every 100 ms, all at the same instant
                barrier.wait()
                starts.append(len(claim(conns[i], instances[i], 10, at(tick / 10))))

        return work

    run_together([claimer(i) for i in range(claimers)], barrier)
    # the burst, then 20 a second for 4.9 s: exactly, though four claimed each time
    assert sum(starts) == 5 + 98


@pytest.mark.parametrize("first", ["producer", "rule"])
def test_a_row_stored_while_its_topics_rule_is_created_is_flagged(raw_connect, first):
    producer, operator, observer = raw_connect(), raw_connect(), raw_connect()
    sent: dict[str, Any] = {}

    def waiting(pid: int) -> bool:
        row = observer.execute(
            "SELECT count(*) AS n FROM pg_locks WHERE pid = %s AND NOT granted"
            " AND database = (SELECT oid FROM pg_database WHERE datname = current_database())",
            (pid,),
        ).fetchone()
        return bool(row and row["n"])

    def produce() -> None:
        with producer.transaction():
            sent["id"] = producer.execute(
                "SELECT workpump.send('api.call', '{}'::jsonb) AS id"
            ).fetchone()["id"]  # type: ignore[index]
            if first == "producer":
                assert wait_until(lambda: waiting(operator.info.backend_pid))

    def pause() -> None:
        with operator.transaction():
            operator.execute(
                "SELECT workpump.set_flow_rule('topic', 'outbox', 'api.call',"
                " '{\"concurrency\": 1}')"
            )
            if first == "rule":
                assert wait_until(lambda: waiting(producer.info.backend_pid))

    def pause_once_sent() -> None:
        assert wait_until(lambda: "id" in sent)
        pause()

    def produce_once_locked() -> None:
        assert wait_until(lambda: rule_lock_held(observer))
        produce()

    run_together(
        [produce, pause_once_sent] if first == "producer" else [pause, produce_once_locked]
    )
    flagged = observer.execute(
        "SELECT flow_controlled FROM workpump_outbox WHERE work_id = %s", (sent["id"],)
    ).fetchone()
    assert flagged == {"flow_controlled": True}


def rule_lock_held(observer: Conn) -> bool:
    """Whether the rule's exclusive flow lock is held (the operator went first)."""
    row = observer.execute(
        "SELECT count(*) AS n FROM pg_locks WHERE locktype = 'advisory' AND granted"
        " AND classid = workpump.lock_namespace('flow')::oid"
        " AND mode = 'ExclusiveLock'"
        " AND database = (SELECT oid FROM pg_database WHERE datname = current_database())"
    ).fetchone()
    return bool(row and row["n"])
