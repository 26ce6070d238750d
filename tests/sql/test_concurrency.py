"""Concurrent sessions against the claim (claim_work, complete_work).

Each worker is a thread with its own psycopg connection; a threading.Barrier releases the
workers together so their statements overlap. Covers: no row leased twice by racing
claimers, every row claimed exactly once, one head per stream under racing claimers and
under a producer racing a completer, per-stream claim order, and SKIP LOCKED (a claimer
never waits on a peer's open claim). Time comes from p_now (T0), never from sleeping.
"""

from __future__ import annotations

import json
import threading
import uuid
from collections import defaultdict
from collections.abc import Callable, Sequence
from typing import Any

import psycopg
import pytest

from tests.helpers import T0

pytestmark = pytest.mark.django_db(transaction=True)

# Only reached when a worker is stuck or died: a broken barrier then fails the test.
BARRIER_TIMEOUT_SECONDS = 30
JOIN_TIMEOUT_SECONDS = 60

Conn = psycopg.Connection[dict[str, Any]]


def register(conn: Conn, instance_id: uuid.UUID, pid: int) -> None:
    row = conn.execute(
        "SELECT workpump.record_heartbeat(%s, 'tests', 'localhost', %s, p_now => %s) AS ok",
        (instance_id, pid, T0),
    ).fetchone()
    assert row is not None and row["ok"] is True


def claim(conn: Conn, instance_id: uuid.UUID, max_rows: int) -> list[dict[str, Any]]:
    return conn.execute(
        "SELECT work_id, stream FROM workpump.claim_work("
        "p_instance_id => %s, p_max_rows => %s, p_categories => ARRAY['outbox'], p_now => %s)",
        (instance_id, max_rows, T0),
    ).fetchall()


def complete(conn: Conn, instance_id: uuid.UUID, ids: Sequence[uuid.UUID]) -> None:
    """Complete rows this session's instance holds, under the tokens of their claims."""
    held = conn.execute(
        "SELECT work_id, lease_token FROM workpump_outbox WHERE work_id = ANY (%s)",
        (list(ids),),
    ).fetchall()
    tokens = {row["work_id"]: row["lease_token"] for row in held}
    rows = conn.execute(
        "SELECT work_id, status FROM workpump.complete_work(%s, 'outbox', %s::uuid[],"
        " %s::uuid[], p_now => %s)",
        (instance_id, list(ids), [tokens[i] for i in ids], T0),
    ).fetchall()
    assert {row["work_id"]: row["status"] for row in rows} == dict.fromkeys(ids, "done")


def send(conn: Conn, n: int, stream: str | None = None) -> uuid.UUID:
    row = conn.execute(
        "SELECT workpump.send('emails.welcome', %s::jsonb, p_stream => %s) AS id",
        (json.dumps({"n": n}), stream),
    ).fetchone()
    assert row is not None
    return row["id"]  # type: ignore[no-any-return]


def outbox_rows(conn: Conn) -> list[dict[str, Any]]:
    return conn.execute(
        "SELECT work_id, seq, stream, instance_id, attempts, done_at "
        "FROM workpump_outbox ORDER BY seq"
    ).fetchall()


def run_together(workers: Sequence[Callable[[], None]], *barriers: threading.Barrier) -> None:
    """Run each worker in a thread; re-raise the first failure (a failing worker breaks
    the barriers so the others stop waiting)."""
    errors: list[Exception] = []

    def guarded(worker: Callable[[], None]) -> None:
        try:
            worker()
        except Exception as exc:  # noqa: BLE001 - re-raised in the test thread below
            errors.append(exc)
            for barrier in barriers:
                barrier.abort()

    threads = [threading.Thread(target=guarded, args=(worker,)) for worker in workers]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(JOIN_TIMEOUT_SECONDS)
    assert not any(thread.is_alive() for thread in threads), "a worker is stuck"
    # A worker broken by another's failure reports BrokenBarrierError: show the cause.
    errors.sort(key=lambda exc: isinstance(exc, threading.BrokenBarrierError))
    if errors:
        raise errors[0]


@pytest.mark.parametrize("claimers", [2, 4])
def test_racing_claimers_never_share_a_row_and_claim_every_row_once(raw_connect, claimers):
    rounds, per_round, max_rows = 30, 40, 7
    producer = raw_connect()
    conns = [raw_connect() for _ in range(claimers)]
    instances = [uuid.uuid4() for _ in range(claimers)]
    for pid, (conn, instance) in enumerate(zip(conns, instances, strict=True)):
        register(conn, instance, pid)
    claimed: list[list[uuid.UUID]] = [[] for _ in range(claimers)]
    batch_sizes: list[int] = []
    state = {"round": 0, "seen": 0, "done": False, "stalled": False}

    def between_ticks() -> None:
        # Runs in one thread while every claimer is parked at the barrier.
        total = sum(len(ids) for ids in claimed)
        if total == state["round"] * per_round:
            if state["round"] == rounds:
                state["done"] = True
                return
            producer.execute(
                "SELECT workpump.send('emails.welcome', jsonb_build_object('n', g)) "
                "FROM generate_series(1, %s) g",
                (per_round,),
            )
            state["round"] += 1
        elif total == state["seen"]:
            # Rows are left, yet a whole tick of claims got none of them.
            state["stalled"] = state["done"] = True
        state["seen"] = total

    barrier = threading.Barrier(claimers, action=between_ticks, timeout=BARRIER_TIMEOUT_SECONDS)

    def claimer(i: int) -> Callable[[], None]:
        def work() -> None:
            while True:
                barrier.wait()
                if state["done"]:
                    return
                rows = claim(conns[i], instances[i], max_rows)
                batch_sizes.append(len(rows))
                claimed[i].extend(row["work_id"] for row in rows)

        return work

    run_together([claimer(i) for i in range(claimers)], barrier)

    assert not state["stalled"]
    everything = [work_id for ids in claimed for work_id in ids]
    assert len(everything) == len(set(everything)) == rounds * per_round
    assert max(batch_sizes) <= max_rows
    assert all(claimed), "every claimer should have won some rows"
    holder = {work_id: instances[i] for i, ids in enumerate(claimed) for work_id in ids}
    rows = outbox_rows(producer)
    assert {row["work_id"] for row in rows} == set(everything)
    # The database agrees on who holds each row, and each row was leased once.
    assert all(row["instance_id"] == holder[row["work_id"]] for row in rows)
    assert {row["attempts"] for row in rows} == {1}


def test_racing_claimers_hold_one_row_per_stream_and_take_each_stream_in_order(raw_connect):
    claimers, max_rows = 3, 4
    streams = [f"s{i}" for i in range(6)]
    producer = raw_connect()
    with producer.transaction():
        for n in range(72):
            # six interleaved streams; every twelfth row has no stream
            send(producer, n, None if n % 12 == 11 else streams[n % 6])
    conns = [raw_connect() for _ in range(claimers)]
    instances = [uuid.uuid4() for _ in range(claimers)]
    for pid, (conn, instance) in enumerate(zip(conns, instances, strict=True)):
        register(conn, instance, pid)

    # Each claimer keeps the rows of one tick through the next tick's claims, so peers
    # claim while heads are held; it completes them after that claim.
    held: list[dict[uuid.UUID, str | None]] = [{} for _ in range(claimers)]
    fresh: list[dict[uuid.UUID, str | None]] = [{} for _ in range(claimers)]
    claim_log: list[tuple[int, uuid.UUID, str | None]] = []
    state = {"phase": 0, "activity": 1, "done": False, "checks": 0}
    lock = threading.Lock()

    def at_barrier() -> None:
        # Everyone is parked: what they hold now, they hold at the same time.
        holding = [s for rows in (*held, *fresh) for s in rows.values() if s is not None]
        assert len(holding) == len(set(holding)), f"two rows of one stream held: {holding}"
        doubled = producer.execute(
            "SELECT stream FROM workpump_outbox WHERE done_at IS NULL "
            "AND instance_id IS NOT NULL AND stream IS NOT NULL "
            "GROUP BY stream HAVING count(*) > 1"
        ).fetchall()
        assert doubled == []
        state["checks"] += 1
        if state["phase"] % 2 == 0:  # start of a tick
            if state["activity"] == 0:
                state["done"] = True
            state["activity"] = 0
        state["phase"] += 1

    barrier = threading.Barrier(claimers, action=at_barrier, timeout=BARRIER_TIMEOUT_SECONDS)

    def claimer(i: int) -> Callable[[], None]:
        def work() -> None:
            tick = 0
            while True:
                barrier.wait()
                if state["done"]:
                    return
                rows = claim(conns[i], instances[i], max_rows)
                fresh[i] = {row["work_id"]: row["stream"] for row in rows}
                claim_log.extend((tick, row["work_id"], row["stream"]) for row in rows)
                barrier.wait()  # checked while old and new rows are both held
                if held[i]:
                    complete(conns[i], instances[i], list(held[i]))
                with lock:
                    state["activity"] += len(rows) + len(held[i])
                held[i], fresh[i] = fresh[i], {}
                tick += 1

        return work

    run_together([claimer(i) for i in range(claimers)], barrier)

    rows = outbox_rows(producer)
    assert all(row["done_at"] is not None for row in rows)
    claimed_ids = [work_id for _, work_id, _ in claim_log]
    assert sorted(claimed_ids) == sorted(row["work_id"] for row in rows)
    assert len(set(claimed_ids)) == len(claimed_ids)
    seq_of = {row["work_id"]: row["seq"] for row in rows}
    order: dict[str, list[tuple[int, int]]] = defaultdict(list)
    for tick, work_id, stream in claim_log:
        if stream is not None:
            order[stream].append((tick, seq_of[work_id]))
    assert set(order) == set(streams)
    for stream, claims in order.items():
        ticks = [tick for tick, _ in claims]
        assert len(ticks) == len(set(ticks)), f"{stream}: two rows claimed in one tick"
        seqs = [seq for _, seq in sorted(claims)]
        assert seqs == sorted(seqs), f"{stream} claimed out of order: {seqs}"
    assert state["checks"] > 20


def test_a_producer_racing_a_completer_keeps_one_head_and_the_insertion_order(raw_connect):
    n_rows = 120
    producer, worker, observer = raw_connect(), raw_connect(), raw_connect()
    instance = uuid.uuid4()
    register(worker, instance, 1)
    start = threading.Barrier(3, timeout=BARRIER_TIMEOUT_SECONDS)
    produced: list[uuid.UUID] = []
    processed: list[uuid.UUID] = []
    batch_sizes: list[int] = []
    head_counts: list[int] = []
    producing_done, draining_done = threading.Event(), threading.Event()
    heads_query = (
        "SELECT count(*) AS n FROM workpump_outbox "
        "WHERE stream = 's' AND done_at IS NULL AND stream_head"
    )

    def produce() -> None:
        try:
            start.wait()
            for n in range(n_rows):
                produced.append(send(producer, n, "s"))  # autocommit: one row per transaction
        finally:
            producing_done.set()

    def drain() -> None:
        try:
            start.wait()
            while True:
                finished = producing_done.is_set()  # read before the claim
                rows = claim(worker, instance, 5)
                batch_sizes.append(len(rows))
                if rows:
                    ids = [row["work_id"] for row in rows]
                    complete(worker, instance, ids)
                    processed.extend(ids)
                elif finished:
                    return  # every row was committed before this claim found nothing
        finally:
            draining_done.set()

    def observe() -> None:
        start.wait()
        while not draining_done.is_set():
            head_counts.append(observer.execute(heads_query).fetchone()["n"])  # type: ignore[index]

    run_together([produce, drain, observe], start)

    assert len(produced) == n_rows
    assert processed == produced
    assert max(batch_sizes) <= 1, "only the stream's head is ever claimable"
    assert len(head_counts) >= 10
    assert max(head_counts) <= 1
    rows = outbox_rows(observer)
    assert len(rows) == n_rows
    assert all(row["done_at"] is not None for row in rows)


@pytest.mark.parametrize("streamed", [False, True], ids=["no-streams", "one-row-streams"])
def test_a_claimer_skips_rows_an_open_claim_holds_instead_of_waiting(raw_connect, streamed):
    holder, other, producer = raw_connect(), raw_connect(), raw_connect()
    holder_id, other_id = uuid.uuid4(), uuid.uuid4()
    register(holder, holder_id, 1)
    register(other, other_id, 2)
    everything = {send(producer, n, f"s{n}" if streamed else None) for n in range(10)}
    other.execute("SET statement_timeout = '2s'")  # a claim that waits fails, not hangs

    with holder.transaction():
        held = {row["work_id"] for row in claim(holder, holder_id, 3)}
        assert len(held) == 3
        # The holder's transaction is still open: its rows are locked, not yet leased.
        taken = {row["work_id"] for row in claim(other, other_id, 100)}

    assert taken.isdisjoint(held)
    assert taken | held == everything
    owners = {row["work_id"]: row["instance_id"] for row in outbox_rows(producer)}
    assert {owners[work_id] for work_id in held} == {holder_id}
    assert {owners[work_id] for work_id in taken} == {other_id}
