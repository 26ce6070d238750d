"""workpump.claim_work.

Covers the signature, what a claim returns and stamps on each of the four categories, the
batch budget and drain signal, claim order (priority, timers first), SKIP LOCKED between
concurrent claimers, the orphan predicate, attempt counting, dead-lettering at the
cap, per-stream FIFO, the per-category guards (no writes and no claim on an empty system, the
partial indexes used by the probes), the partition share with stealing, the liveness rule in
the rank, the stream ownership ledger and refused input.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

import psycopg
import pytest
from django.db import DatabaseError, connection, transaction

from tests.helpers import (
    T0,
    A,
    B,
    at,
    current_tokens,
    enroll,
    explaining_connection,
    give_the_planner_statistics,
    run_sql,
    scalar,
)

pytestmark = pytest.mark.django_db

CATEGORIES = ["outbox", "inbox", "perspective_event", "receptor"]
# category: (table, key column, ordering-scope column or "")
TABLES = {
    "outbox": ("workpump_outbox", "work_id", ""),
    "inbox": ("workpump_inbox", "work_id", ""),
    "perspective_event": ("workpump_perspective_event", "work_id", "topic"),
    "receptor": ("workpump_receptor_processing", "work_id", "topic"),
}
TOPICS = {
    "outbox": "emails.welcome",
    "inbox": "stripe.webhook",
    "perspective_event": "order_totals",
    "receptor": "warehouse",
}


# --- helpers ------------------------------------------------------------------------------


def make(
    category: str,
    stream: str | None = None,
    payload: dict[str, Any] | None = None,
    *,
    topic: str | None = None,
    max_attempts: int = 10,
    scheduled_for: Any = None,
) -> uuid.UUID:
    """Produce one row of ``category`` through the SQL producers; return its work id."""
    payload_json = json.dumps(payload if payload is not None else {"n": 1})
    topic = topic or TOPICS[category]
    if category == "outbox":
        return scalar(
            "SELECT workpump.send(%s, %s::jsonb, %s, p_scheduled_for => %s, p_max_attempts => %s)",
            [topic, payload_json, stream, scheduled_for, max_attempts],
        )
    if category == "inbox":
        message_id = uuid.uuid4()
        assert scalar(
            "SELECT workpump.receive(%s, %s, %s::jsonb, %s, p_scheduled_for => %s,"
            " p_max_attempts => %s)",
            [message_id, topic, payload_json, stream, scheduled_for, max_attempts],
        )
        return message_id
    assert scheduled_for is None, "events have no deferral"
    subscribers = json.dumps([{"category": category, "name": topic, "max_attempts": max_attempts}])
    event_id = emit("order.placed", payload_json, stream, subscribers)
    table, key, scope = TABLES[category]
    return scalar(
        f"SELECT {key} FROM {table} WHERE event_id = %s AND {scope} = %s",
        [event_id, topic],
    )


def emit(event_type: str, payload_json: str, stream: str | None, subscribers_json: str) -> Any:
    return scalar(
        "SELECT workpump.emit(%s, %s::jsonb, %s, %s::jsonb)",
        [event_type, payload_json, stream, subscribers_json],
    )


def claim(instance: uuid.UUID | None = A, now: Any = T0, **params: Any) -> list[dict[str, Any]]:
    """Call claim_work with named parameters; return its rows."""
    enroll(instance, now)
    named = "".join(f", {name} => %({name})s" for name in params)
    rows = run_sql(
        "SELECT * FROM workpump.claim_work("
        f"p_instance_id => %(instance)s, p_now => %(now)s{named})",
        {"instance": instance, "now": now, **params},
    )
    # Django's cursor leaves jsonb as text (a parked row has no payload)
    return [r | {"payload": r["payload"] and json.loads(r["payload"])} for r in rows]


def row(category: str, work_id: uuid.UUID) -> dict[str, Any]:
    table, key, _ = TABLES[category]
    rows = run_sql(f"SELECT * FROM {table} WHERE {key} = %s", [work_id])
    assert len(rows) == 1, rows
    return rows[0]


def complete(instance: uuid.UUID, category: str, ids: list[uuid.UUID], now: Any) -> list[str]:
    rows = run_sql(
        "SELECT * FROM workpump.complete_work(%s, %s, %s::uuid[], %s::uuid[], p_now => %s)",
        [instance, category, ids, current_tokens(category, ids), now],
    )
    return [r["status"] for r in rows]


def fail(
    instance: uuid.UUID, category: str, ids: list[uuid.UUID], now: Any, retry_base: int
) -> list[str]:
    rows = run_sql(
        "SELECT * FROM workpump.fail_work(%s, %s, %s::uuid[], %s::uuid[], %s::text[],"
        " p_retry_base_seconds => %s, p_now => %s)",
        [
            instance,
            category,
            ids,
            current_tokens(category, ids),
            ["boom"] * len(ids),
            retry_base,
            now,
        ],
    )
    return [r["status"] for r in rows]


def heartbeat(instance: uuid.UUID, now: Any) -> None:
    assert scalar(
        "SELECT workpump.record_heartbeat(%s, 'tests', 'localhost', 1, p_now => %s)",
        [instance, now],
    )


def ids(rows: list[dict[str, Any]]) -> list[uuid.UUID]:
    return [r["work_id"] for r in rows]


def streams_in_share(rank: int, count: int, live_count: int = 2) -> list[str]:
    """Stream keys whose stored partition falls in ``rank``'s share of ``live_count``."""
    return [
        r["s"]
        for r in run_sql(
            "SELECT s FROM (SELECT 'key-' || g AS s, g FROM generate_series(1, 200) g) k"
            " WHERE workpump.partition_of(s) %% %s = %s ORDER BY g LIMIT %s",
            [live_count, rank, count],
        )
    ]


@contextmanager
def notices() -> Iterator[list[str]]:
    """Collect the NOTICE messages Django's connection receives inside the block."""
    received: list[str] = []
    connection.ensure_connection()
    pg = connection.connection

    def handler(diag: Any) -> None:
        received.append(diag.message_primary)

    pg.add_notice_handler(handler)
    try:
        yield received
    finally:
        pg.remove_notice_handler(handler)


def table_writes() -> dict[str, int]:
    """Tuples written to each workpump table, as counted by this backend so far; not the
    console's counters, which its trigger writes on every change (tests/sql/test_console.py)."""
    return {
        r["relname"]: r["n"]
        for r in run_sql(
            "SELECT relname, n_tup_ins + n_tup_upd + n_tup_del AS n"
            " FROM pg_stat_xact_user_tables WHERE relname LIKE 'workpump\\_%%'"
            " AND relname NOT LIKE 'workpump\\_console\\_%%'"
        )
    }


def function_calls() -> dict[str, int]:
    """Calls of each workpump function, as counted by this backend so far (not the
    console's counting trigger)."""
    return {
        r["funcname"]: r["calls"]
        for r in run_sql(
            "SELECT funcname, calls FROM pg_stat_xact_user_functions WHERE schemaname = 'workpump'"
            " AND funcname NOT LIKE 'console\\_%%'"
        )
    }


@contextmanager
def counted() -> Iterator[dict[str, dict[str, int]]]:
    """Count table writes and function calls made inside the block.

    PostgreSQL 15 shows not-yet-flushed counts of earlier transactions in the pg_stat_xact
    views too, so the block's own counts are the difference of two snapshots (nothing is
    flushed while the test's transaction is open).
    """
    run_sql("SET LOCAL track_functions = 'all'")
    writes, calls = table_writes(), function_calls()
    delta: dict[str, dict[str, int]] = {}
    yield delta
    writes_after, calls_after = table_writes(), function_calls()
    delta["writes"] = {
        t: n - writes.get(t, 0) for t, n in writes_after.items() if n != writes.get(t, 0)
    }
    delta["calls"] = {
        f: n - calls.get(f, 0) for f, n in calls_after.items() if n != calls.get(f, 0)
    }


def category_claims(delta: dict[str, dict[str, int]]) -> dict[str, int]:
    """Calls of the per-category claim functions (claim_outbox, ...) among ``delta``'s."""
    names = {f"claim_{category}" for category in CATEGORIES}
    return {name: n for name, n in delta["calls"].items() if name in names}


# --- 1. signature ---------------------------------------------------------------------------


def test_claim_work_has_the_documented_parameters_all_defaulted_but_the_instance():
    rows = run_sql(
        "SELECT pg_get_function_arguments(p.oid) AS args, p.pronargs, p.pronargdefaults"
        " FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace"
        " WHERE n.nspname = 'workpump' AND p.proname = 'claim_work'"
    )
    assert len(rows) == 1
    args = [a.strip() for a in rows[0]["args"].split(",")]
    names = [a.split()[0] for a in args]
    for name in [
        "p_instance_id",
        "p_max_rows",
        "p_lease_seconds",
        "p_partition_count",
        "p_categories",
        "p_now",
    ]:
        assert name in names
    assert names[0] == "p_instance_id"
    # p_now goes last, as in every function of the schema
    assert names[-6:] == [
        "p_topics",
        "p_topic_prefixes",
        "p_stream_run_max",
        "p_return_dead_lettered",
        "p_underserved_only",
        "p_now",
    ]
    assert args[0] == "p_instance_id uuid"
    assert all(" DEFAULT " in a for a in args[1:]), args
    assert rows[0]["pronargdefaults"] == rows[0]["pronargs"] - 1


def test_claim_work_can_be_called_with_only_the_instance_id():
    work_id = make("outbox")
    enroll(A)
    rows = run_sql("SELECT * FROM workpump.claim_work(p_instance_id => %s)", [A])
    assert ids(rows) == [work_id]
    assert row("outbox", work_id)["instance_id"] == A


# --- 2. what a claim returns and stamps --------------------------------------------------------


@pytest.mark.parametrize("category", ["outbox", "inbox"])
def test_a_pending_message_is_returned_and_leased_to_the_caller(category):
    work_id = make(category, "user-7", {"user_id": 7})

    [got] = claim(A, T0, p_lease_seconds=120)

    assert got["category"] == category
    assert got["work_id"] == work_id
    assert got["topic"] == TOPICS[category]
    assert got["payload"] == {"user_id": 7}
    assert got["stream"] == "user-7"
    assert got["attempts"] == 1
    assert got["max_attempts"] == 10
    assert got["lease_expiry"] == at(120)
    assert got["claimed_at"] == T0
    assert got["event_id"] is None
    assert got["event_type"] is None
    stored = row(category, work_id)
    assert stored["instance_id"] == A
    assert stored["lease_expiry"] == at(120)
    assert stored["claimed_at"] == T0
    assert stored["attempts"] == 1
    assert stored["lease_renewals"] == 0


@pytest.mark.parametrize("category", ["perspective_event", "receptor"])
def test_a_pending_event_row_is_returned_with_the_events_payload_and_type(category):
    work_id = make(category, "order-42", {"order_id": 42})
    event_id = row(category, work_id)["event_id"]

    [got] = claim(A, T0, p_lease_seconds=60)

    assert got["category"] == category
    assert got["work_id"] == work_id
    assert got["topic"] == TOPICS[category]
    assert got["payload"] == {"order_id": 42}
    assert got["event_id"] == event_id
    assert got["event_type"] == "order.placed"
    assert got["stream"] == "order-42"
    assert got["attempts"] == 1
    assert got["lease_expiry"] == at(60)
    stored = row(category, work_id)
    assert (stored["instance_id"], stored["lease_expiry"], stored["claimed_at"]) == (
        A,
        at(60),
        T0,
    )


def test_reclaiming_resets_the_renewals_of_the_previous_lease():
    work_id = make("outbox")
    claim(A, T0, p_lease_seconds=10)
    run_sql(
        "SELECT * FROM workpump.renew_leases('outbox', %s::uuid[], %s::uuid[], 10, %s, %s)",
        [[work_id], current_tokens("outbox", [work_id]), A, at(5)],
    )
    assert row("outbox", work_id)["lease_renewals"] == 1

    [got] = claim(B, at(100), p_lease_seconds=10)

    assert got["work_id"] == work_id
    stored = row("outbox", work_id)
    assert (stored["instance_id"], stored["lease_renewals"], stored["claimed_at"]) == (
        B,
        0,
        at(100),
    )


def test_a_claimed_row_is_not_returned_to_another_claimer_while_leased():
    make("outbox")
    assert len(claim(A, T0)) == 1
    assert claim(B, at(1)) == []


# --- 3. budget and drain signal ----------------------------------------------------------------


def test_max_rows_caps_the_batch():
    for _ in range(10):
        make("outbox")
    rows = claim(A, T0, p_max_rows=3)
    assert len(rows) == 3
    assert scalar("SELECT count(*) FROM workpump_outbox WHERE instance_id IS NOT NULL") == 3


def test_the_budget_is_shared_among_the_categories_with_work():
    for _ in range(10):
        make("outbox")
        make("inbox")

    rows = claim(A, T0, p_max_rows=4)

    assert sorted(r["category"] for r in rows) == ["inbox", "inbox", "outbox", "outbox"]
    assert all(r["has_more"] for r in rows)


def test_budget_a_category_leaves_unused_goes_to_the_others():
    make("outbox")
    for _ in range(10):
        make("inbox")

    rows = claim(A, T0, p_max_rows=4)

    assert sorted(r["category"] for r in rows) == ["inbox", "inbox", "inbox", "outbox"]


def test_a_full_batch_raises_the_has_more_notice():
    for _ in range(5):
        make("outbox")
    with notices() as received:
        rows = claim(A, T0, p_max_rows=3)
    assert len(rows) == 3
    assert all(r["has_more"] for r in rows)
    assert "workpump.has_more=true" in received


def test_a_partial_batch_raises_no_has_more_notice():
    for _ in range(3):
        make("outbox")
    with notices() as received:
        rows = claim(A, T0, p_max_rows=10)
    assert len(rows) == 3
    assert not any(r["has_more"] for r in rows)
    assert not any("has_more" in message for message in received)


def test_has_more_is_false_for_a_category_that_did_not_fill_its_share():
    make("outbox")
    for _ in range(10):
        make("inbox")

    rows = claim(A, T0, p_max_rows=4)

    assert {r["category"]: r["has_more"] for r in rows} == {"outbox": False, "inbox": True}


def test_a_small_budget_does_not_starve_a_category_while_others_are_busy():
    for category in CATEGORIES:
        for _ in range(5):
            make(category)

    served: set[str] = set()
    for turn in range(4):
        # the ClaimWorker asks for free slots + prefetch: 1 + 2
        rows = claim(A, at(turn), p_max_rows=3)
        served |= {r["category"] for r in rows}
        for category in {r["category"] for r in rows}:
            done = [r["work_id"] for r in rows if r["category"] == category]
            complete(A, category, done, at(turn))

    assert served == set(CATEGORIES)


def test_higher_priority_rows_are_claimed_first():
    low = make("outbox")
    high = scalar("SELECT workpump.send('emails.welcome', '{}', p_priority => 5)")
    assert ids(claim(A, T0, p_max_rows=1)) == [high]
    assert ids(claim(A, T0, p_max_rows=1)) == [low]


def test_expired_leases_are_claimed_before_ready_rows():
    orphan = make("outbox")
    claim(B, T0, p_lease_seconds=10)
    make("outbox")
    assert ids(claim(A, at(20), p_max_rows=1)) == [orphan]


@pytest.mark.django_db(transaction=True)
def test_concurrent_claimers_skip_each_others_rows_without_waiting(raw_connect):
    made = {make("outbox") for _ in range(4)}
    first, second = raw_connect(), raw_connect()
    second.execute("SET lock_timeout = '2s'")
    register_on(first, A, B)
    query = "SELECT work_id FROM workpump.claim_work(%s, p_max_rows => %s, p_now => %s)"

    with first.transaction():
        got_first = {r["work_id"] for r in first.execute(query, [A, 2, T0]).fetchall()}
        # the first claimer's transaction is still open: its rows stay locked
        got_second = {r["work_id"] for r in second.execute(query, [B, 10, T0]).fetchall()}

    assert len(got_first) == 2
    assert got_first | got_second == made
    assert not got_first & got_second


# --- 4. orphan predicate ------------------------------------------------------------------------


def test_a_row_leased_by_another_instance_is_not_claimed_before_its_lease_expires():
    work_id = make("outbox")
    claim(B, T0, p_lease_seconds=60)
    assert claim(A, at(59)) == []
    assert row("outbox", work_id)["instance_id"] == B


def test_an_expired_lease_is_reclaimed_and_stamped_as_an_attempt_without_outcome():
    work_id = make("outbox")
    claim(B, T0, p_lease_seconds=60)

    [got] = claim(A, at(61), p_lease_seconds=60)

    assert (got["work_id"], got["attempts"]) == (work_id, 2)
    stored = row("outbox", work_id)
    assert stored["instance_id"] == A
    assert stored["lease_expiry"] == at(121)
    assert stored["failure_reason"] == "lease_expired"
    assert "ended without a reported outcome" in stored["last_error"]
    assert str(B) in stored["last_error"]


def test_a_deferred_row_is_claimable_only_once_its_time_has_come():
    work_id = make("outbox", scheduled_for=at(30))
    assert claim(A, at(29)) == []
    assert ids(claim(A, at(30))) == [work_id]
    assert row("outbox", work_id)["scheduled_for"] is None


@pytest.mark.parametrize("category", CATEGORIES)
def test_done_rows_are_never_claimed(category):
    work_id = make(category)
    claim(A, T0)
    assert complete(A, category, [work_id], at(1)) == ["done"]
    assert claim(B, at(10_000)) == []


def test_a_dead_row_is_never_claimed():
    work_id = make("outbox", max_attempts=1)
    claim(A, T0)
    assert fail(A, "outbox", [work_id], at(1), retry_base=0) == ["dead"]
    assert claim(A, at(2)) == []
    assert claim(B, at(10_000)) == []
    assert row("outbox", work_id)["attempts"] == 1


# --- 5. attempts -------------------------------------------------------------------------------


def test_attempts_count_claims_by_any_instance():
    work_id = make("inbox")
    assert row("inbox", work_id)["attempts"] == 0
    assert claim(A, T0, p_lease_seconds=10)[0]["attempts"] == 1
    assert claim(B, at(11), p_lease_seconds=10)[0]["attempts"] == 2
    assert claim(B, at(22), p_lease_seconds=10)[0]["attempts"] == 3
    assert claim(A, at(33), p_lease_seconds=10)[0]["attempts"] == 4
    assert row("inbox", work_id)["attempts"] == 4


def test_an_unclaimed_row_keeps_zero_attempts():
    work_id = make("outbox")
    claim(A, T0, p_categories=["inbox"])
    assert row("outbox", work_id)["attempts"] == 0


@pytest.mark.parametrize("category", CATEGORIES)
def test_a_failure_does_not_count_as_an_extra_attempt(category):
    work_id = make(category)
    claim(A, T0)
    assert fail(A, category, [work_id], at(1), retry_base=0) == ["retry"]
    assert row(category, work_id)["attempts"] == 1

    [got] = claim(A, at(2))

    assert (got["work_id"], got["attempts"]) == (work_id, 2)


# --- 6. dead letter inside the claim --------------------------------------------------------------


@pytest.mark.parametrize("category", CATEGORIES)
def test_an_expired_row_at_its_attempt_cap_is_parked_instead_of_leased(category):
    work_id = make(category, "s-1", max_attempts=2)
    claim(A, T0, p_lease_seconds=10)
    claim(A, at(11), p_lease_seconds=10)
    assert row(category, work_id)["attempts"] == 2

    assert claim(B, at(22)) == []

    stored = row(category, work_id)
    assert stored["dead_lettered_at"] == at(22)
    assert stored["failure_reason"] == "max_attempts"
    assert stored["instance_id"] is None
    assert stored["lease_expiry"] is None
    assert stored["attempts"] == 2
    assert claim(B, at(10_000)) == []
    assert row(category, work_id)["dead_lettered_at"] == at(22)


def test_parking_a_row_does_not_use_up_the_batch():
    dead = make("outbox", max_attempts=1)
    claim(A, T0, p_lease_seconds=10)
    ready = make("outbox")

    rows = claim(B, at(20), p_max_rows=1)

    assert ids(rows) == [ready]
    assert row("outbox", dead)["dead_lettered_at"] == at(20)


@pytest.mark.parametrize("category", CATEGORIES)
def test_a_caller_that_asks_gets_the_rows_the_claim_parked_without_a_token(category):
    parked = make(category, "s-1", max_attempts=1)
    claim(A, T0, p_lease_seconds=10)
    ready = make(category, "s-2")

    rows = claim(B, at(20), p_max_rows=2, p_return_dead_lettered=True)

    assert ids(rows) == [parked, ready]  # a category's parked rows come first
    dead, leased = rows
    stored = row(category, parked)
    assert stored["last_error"] == (
        f"attempt 1 ended without a reported outcome: the lease of instance {A} expired at "
        f"{T0 + timedelta(seconds=10):%Y-%m-%d %H:%M:%S}+00"
    )
    assert dead["last_error"] == stored["last_error"]
    assert (dead["category"], dead["topic"], dead["stream"]) == (category, TOPICS[category], "s-1")
    assert (dead["attempts"], dead["max_attempts"]) == (1, 1)
    assert dead["lease_token"] is None and dead["lease_expiry"] is None
    assert dead["payload"] is None
    assert leased["lease_token"] is not None and leased["last_error"] is None
    # the parked row is not counted as leased: the category did not fill its share
    assert leased["has_more"] is False
    assert claim(B, at(30), p_return_dead_lettered=True) == []  # returned once


def test_a_row_whose_holder_was_evicted_on_its_last_attempt_is_returned_parked():
    parked = make("outbox", max_attempts=1)
    claim(A, T0, p_lease_seconds=300)
    enroll(B, at(100))
    run_sql("SELECT * FROM workpump.cleanup_stale_instances(%s, p_now => %s)", [at(90), at(100)])

    [dead] = claim(B, at(100), p_return_dead_lettered=True)

    assert (dead["work_id"], dead["lease_token"]) == (parked, None)
    assert dead["last_error"].startswith(
        f"attempt 1 ended without a reported outcome: instance {A} was evicted at "
    )
    assert row("outbox", parked)["failure_reason"] == "max_attempts"


def test_a_claim_that_parks_nothing_returns_what_it_did_before():
    make("outbox", "s-1", max_attempts=2)
    claim(A, T0, p_lease_seconds=10)

    [taken_over] = claim(B, at(20), p_return_dead_lettered=True)

    assert taken_over["lease_token"] is not None and taken_over["last_error"] is None


# --- 7. per-stream FIFO -------------------------------------------------------------------------


@pytest.mark.parametrize("category", CATEGORIES)
def test_only_the_head_of_a_stream_is_claimable_until_it_completes(category):
    first = make(category, "s-1")
    second = make(category, "s-1")

    assert ids(claim(A, T0)) == [first]
    assert claim(B, at(1)) == []
    assert complete(A, category, [first], at(2)) == ["done"]
    assert ids(claim(B, at(3))) == [second]


@pytest.mark.parametrize("category", CATEGORIES)
def test_a_head_waiting_for_its_retry_blocks_the_rest_of_its_stream(category):
    first = make(category, "s-1")
    second = make(category, "s-1")
    claim(A, T0)
    assert fail(A, category, [first], at(1), retry_base=30) == ["retry"]

    assert claim(B, at(2)) == []
    assert ids(claim(B, at(60))) == [first]
    assert claim(A, at(61)) == []
    assert complete(B, category, [first], at(62)) == ["done"]
    assert ids(claim(A, at(63))) == [second]


@pytest.mark.parametrize("category", CATEGORIES)
def test_a_dead_head_blocks_the_rest_of_its_stream(category):
    first = make(category, "s-1", max_attempts=1)
    make(category, "s-1")
    claim(A, T0)
    assert fail(A, category, [first], at(1), retry_base=0) == ["dead"]

    assert claim(B, at(2)) == []
    assert claim(B, at(10_000)) == []


@pytest.mark.parametrize("category", CATEGORIES)
def test_streams_are_independent_of_each_other(category):
    first = make(category, "s-1")
    make(category, "s-1")
    other = make(category, "s-2")
    assert sorted(ids(claim(A, T0))) == sorted([first, other])


@pytest.mark.parametrize("category", CATEGORIES)
def test_rows_without_a_stream_are_all_claimable_at_once(category):
    made = [make(category) for _ in range(3)]
    assert sorted(ids(claim(A, T0))) == sorted(made)


@pytest.mark.parametrize("category", ["perspective_event", "receptor"])
def test_a_slow_subscriber_does_not_hold_back_another_on_the_same_stream(category):
    subscribers = json.dumps(
        [{"category": category, "name": "slow"}, {"category": category, "name": "fast"}]
    )
    for n in (1, 2):
        emit("order.placed", json.dumps({"n": n}), "order-1", subscribers)
    table, key, scope = TABLES[category]
    order = {
        (r["name"], r["n"]): r["id"]
        for r in run_sql(
            f"SELECT {scope} AS name, (e.payload->>'n')::int AS n, t.{key} AS id"
            f" FROM {table} t JOIN workpump_event e USING (event_id)"
        )
    }

    first = claim(A, T0)
    assert {(r["topic"], r["payload"]["n"]) for r in first} == {("slow", 1), ("fast", 1)}
    assert complete(A, category, [order["fast", 1]], at(1)) == ["done"]

    assert ids(claim(B, at(2))) == [order["fast", 2]]
    assert row(category, order["slow", 1])["instance_id"] == A
    assert row(category, order["slow", 2])["attempts"] == 0


# --- 8. per-category guards ------------------------------------------------------------------


def test_an_empty_system_costs_no_writes_and_no_category_claim():
    enroll(A)
    with counted() as delta:
        assert claim(A, T0) == []

    assert delta["calls"].get("claim_work") == 1
    assert category_claims(delta) == {}
    assert delta["writes"] == {}


def test_only_a_category_with_work_is_claimed_from():
    made = [make("outbox") for _ in range(2)]
    enroll(A)

    with counted() as delta:
        assert sorted(ids(claim(A, T0))) == sorted(made)

    assert category_claims(delta) == {"claim_outbox": 1}
    assert delta["writes"] == {"workpump_outbox": 2}


def test_a_leased_row_that_has_not_expired_does_not_trigger_a_category_claim():
    make("inbox", "s-1")
    claim(A, T0, p_lease_seconds=60)
    enroll(B)

    with counted() as delta:
        assert claim(B, at(30)) == []

    assert category_claims(delta) == {}
    assert delta["writes"] == {}


def register_on(conn: Any, *instances: uuid.UUID) -> None:
    """Register instances through a raw connection (claim_work refuses unregistered ones)."""
    for instance in instances:
        conn.execute(
            "SELECT workpump.record_heartbeat(%s, 'tests', 'localhost', 1, p_now => %s)",
            [instance, T0],
        )


def test_the_guard_probes_use_the_partial_indexes(raw_connect):
    conn, plans = explaining_connection(raw_connect)
    with conn.transaction(force_rollback=True):  # the registration must not outlive the test
        give_the_planner_statistics(conn)
        register_on(conn, A)
        plans.clear()

        rows = conn.execute(
            "SELECT * FROM workpump.claim_work(%s, p_now => %s)", [A, T0]
        ).fetchall()

    assert rows == []
    text = "\n".join(plans)
    for index in [
        "wp_outbox_ready",
        "wp_outbox_timer",
        "wp_inbox_ready",
        "wp_inbox_timer",
        "wp_persp_ready",
        "wp_persp_timer",
        "wp_receptor_ready",
        "wp_receptor_timer",
    ]:
        assert f"using {index} on" in text, index


def test_the_claim_scans_the_ready_and_timer_indexes(raw_connect):
    conn, plans = explaining_connection(raw_connect)
    with conn.transaction(force_rollback=True):
        give_the_planner_statistics(conn)
        conn.execute("SELECT workpump.send('emails.welcome', '{}', 's-1')")
        register_on(conn, A)
        plans.clear()

        rows = conn.execute(
            "SELECT * FROM workpump.claim_work(%s, p_categories => '{outbox}', p_now => %s)",
            [A, T0],
        ).fetchall()

    assert len(rows) == 1
    candidates = [p for p in plans if "FOR UPDATE OF t SKIP LOCKED" in p and "UPDATE" in p]
    assert candidates
    text = "\n".join(candidates)
    assert "using wp_outbox_timer on" in text
    assert "using wp_outbox_ready on" in text
    assert "Seq Scan on workpump_outbox" not in text


# --- 10. partition share and stealing --------------------------------------------------------


@pytest.fixture
def two_live_instances():
    heartbeat(A, T0)
    heartbeat(B, T0)


def test_each_live_instance_gets_its_partition_share_first(two_live_instances):
    [b_stream] = streams_in_share(rank=1, count=1)
    [a_stream] = streams_in_share(rank=0, count=1)
    b_row = make("outbox", b_stream)  # earlier, so it would come first without shares
    a_row = make("outbox", a_stream)

    assert ids(claim(A, T0, p_max_rows=1)) == [a_row]
    assert ids(claim(B, T0, p_max_rows=1)) == [b_row]


def test_an_instance_whose_share_is_empty_takes_the_other_share(two_live_instances):
    b_rows = [make("outbox", s) for s in streams_in_share(rank=1, count=3)]

    assert sorted(ids(claim(A, T0, p_max_rows=10))) == sorted(b_rows)


def test_a_share_is_filled_before_stealing_within_one_batch(two_live_instances):
    b_streams = streams_in_share(rank=1, count=2)
    a_streams = streams_in_share(rank=0, count=2)
    b_rows = [make("outbox", s) for s in b_streams]
    a_rows = [make("outbox", s) for s in a_streams]

    got = ids(claim(A, T0, p_max_rows=3))

    assert sorted(got) == sorted([*a_rows, b_rows[0]])


# --- 11. liveness rule in the rank -------------------------------------------------------------


def rank_probe_rows() -> tuple[uuid.UUID, uuid.UUID]:
    """An earlier row in B's share and a later one in A's share (A ranks 0 of 2)."""
    [b_stream] = streams_in_share(rank=1, count=1)
    [a_stream] = streams_in_share(rank=0, count=1)
    return make("outbox", b_stream), make("outbox", a_stream)


def test_a_stale_peer_does_not_count_as_live():
    heartbeat(B, at(-60))
    earliest, _ = rank_probe_rows()
    # alone: no share, so the earliest row comes first
    assert ids(claim(A, T0, p_max_rows=1, p_stale_after_seconds=30)) == [earliest]


def test_a_fresh_peer_counts_as_live():
    heartbeat(B, at(-10))
    _, mine = rank_probe_rows()
    assert ids(claim(A, T0, p_max_rows=1, p_stale_after_seconds=30)) == [mine]


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize(
    ("beat_seconds_ago", "live"),
    [(60, True), (400, False)],
    ids=["stale-peer-still-live", "past-the-definitive-dead-cutoff"],
)
def test_an_alive_lock_keeps_a_stale_peer_live_until_the_definitive_dead_cutoff(
    raw_connect, beat_seconds_ago, live
):
    heartbeat(B, at(-beat_seconds_ago))
    assert raw_connect().execute("SELECT workpump.take_alive_lock(%s) AS ok", [B]).fetchone()["ok"]
    earliest, mine = rank_probe_rows()

    got = claim(
        A, T0, p_max_rows=1, p_stale_after_seconds=30, p_definitively_dead_after_seconds=300
    )

    # with B live, A claims only from its own share; with B dead, the earliest row first
    assert ids(got) == [mine if live else earliest]


def give_back(rows: list[uuid.UUID]) -> None:
    """A releases the outbox rows it claimed (their attempts given back)."""
    run_sql(
        "SELECT * FROM workpump.release_work(%s, 'outbox', %s::uuid[], %s::uuid[], %s)",
        [A, rows, current_tokens("outbox", rows), T0],
    )


@pytest.mark.django_db(transaction=True)
def test_a_peer_that_lost_its_lock_counts_until_the_probe_sees_it_and_no_lock_table_is_read(
    raw_connect,
):
    heartbeat(B, at(-60))  # past the stale cutoff: only its alive-lock keeps it live
    peer = raw_connect()
    assert peer.execute("SELECT workpump.take_alive_lock(%s) AS ok", [B]).fetchone()["ok"]
    earliest, mine = rank_probe_rows()
    with transaction.atomic(), counted() as delta:
        got = claim(A, T0, p_max_rows=1, p_stale_after_seconds=30)
    assert "claim_work" in delta["calls"]
    assert "held_alive_lock_keys" not in delta["calls"]
    assert ids(got) == [mine]  # B live, by the last probe's view
    give_back(ids(got))

    peer.close()  # B's session ends: its lock with it, unseen until a probe
    got = claim(A, T0, p_max_rows=1, p_stale_after_seconds=30)
    assert ids(got) == [mine]
    give_back(ids(got))
    run_sql("SELECT workpump.observe_alive_locks(%s)", [T0])
    assert ids(claim(A, T0, p_max_rows=1, p_stale_after_seconds=30)) == [earliest]


# --- 12. stream ownership ledger ------------------------------------------------------------


def ledger() -> list[dict[str, Any]]:
    return run_sql(
        "SELECT category, scope, stream, owner_instance_id, lease_expiry, last_activity_at"
        " FROM workpump_active_stream ORDER BY category, scope, stream"
    )


@pytest.mark.parametrize("category", CATEGORIES)
def test_claiming_a_streamed_row_records_the_caller_as_the_streams_owner(category):
    make(category, "s-1")
    claim(A, T0, p_lease_seconds=90)
    scope = "" if category in ("outbox", "inbox") else TOPICS[category]
    assert ledger() == [
        {
            "category": category,
            "scope": scope,
            "stream": "s-1",
            "owner_instance_id": A,
            "lease_expiry": at(90),
            "last_activity_at": T0,
        }
    ]


def test_rows_without_a_stream_leave_no_ledger_row():
    make("outbox")
    make("perspective_event")
    assert len(claim(A, T0)) == 2
    assert ledger() == []


def test_a_takeover_of_an_expired_lease_rebinds_the_stream_to_the_new_claimer():
    make("outbox", "s-1")
    claim(A, T0, p_lease_seconds=10)
    claim(B, at(20), p_lease_seconds=10)
    [entry] = ledger()
    assert (entry["owner_instance_id"], entry["lease_expiry"], entry["last_activity_at"]) == (
        B,
        at(30),
        at(20),
    )


def test_a_released_stream_is_rebound_by_the_next_claim():
    first = make("outbox", "s-1")
    make("outbox", "s-1")
    claim(A, T0)
    complete(A, "outbox", [first], at(1))
    assert ledger()[0]["owner_instance_id"] is None

    claim(B, at(2), p_lease_seconds=10)

    [entry] = ledger()
    assert (entry["owner_instance_id"], entry["lease_expiry"]) == (B, at(12))


# --- 13. refused input --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("instance", "params", "message"),
    [
        (None, {}, "claim_work needs p_instance_id."),
        (A, {"p_max_rows": 0}, "claim_work needs p_max_rows >= 1, not 0."),
        (A, {"p_lease_seconds": -1}, "claim_work needs p_lease_seconds >= 1, not -1."),
        (A, {"p_categories": ["outbox", "bogus"]}, "Unknown workpump category 'bogus'."),
    ],
)
def test_bad_input_is_refused_with_a_clear_error_and_changes_nothing(instance, params, message):
    work_id = make("outbox", "s-1")

    with pytest.raises(DatabaseError) as excinfo, transaction.atomic():
        claim(instance, T0, **params)

    assert message in str(excinfo.value)
    stored = row("outbox", work_id)
    assert (stored["instance_id"], stored["attempts"], stored["claimed_at"]) == (None, 0, None)
    assert ledger() == []


def test_an_unknown_category_error_lists_the_valid_ones():
    with pytest.raises(DatabaseError) as excinfo, transaction.atomic():
        claim(A, T0, p_categories=["outboxes"])
    assert excinfo.value.__cause__.diag.message_hint == (
        "Valid categories: outbox, inbox, perspective_event, receptor."
    )


def test_claiming_only_the_named_categories():
    outbox = make("outbox")
    inbox = make("inbox")
    assert ids(claim(A, T0, p_categories=["outbox"])) == [outbox]
    assert row("inbox", inbox)["instance_id"] is None


# --- claims on a connection of their own ---------------------------------------------------
# Each on a scratch database migrated for it (a session's plans start empty): slow tests.


@pytest.mark.slow  # a database of its own, built and dropped: 10 s
@pytest.mark.django_db(transaction=True)
def test_the_claims_are_planned_once_per_session_and_claim_every_shape(scratch_database):
    claims = ["claim_inbox", "claim_outbox", "claim_perspective_event", "claim_receptor"]

    def settings() -> dict[str, list[str]]:
        with scratch_database.connect() as conn:
            rows = conn.execute(
                "SELECT proname, proconfig[2:] FROM pg_proc"
                " WHERE pronamespace = 'workpump'::regnamespace AND proname = ANY(%s)",
                [claims],
            ).fetchall()
        return dict(rows)

    def claims_in_one_session() -> list[list[tuple[str, str | None]]]:
        """Claims of different shapes, one after another on one connection (one plan)."""
        rounds = []
        with scratch_database.connect() as conn:
            conn.execute("SELECT workpump.record_heartbeat(%s, 'tests', 'localhost', 1)", [A])
            for n in range(6):
                conn.execute("SELECT workpump.send('emails.welcome', %s, NULL)", [f'{{"n": {n}}}'])
            conn.execute("SELECT workpump.send('billing.charge', '{}', 'acct-1')")
            conn.execute("SELECT workpump.send('billing.charge', '{}', 'acct-1')")
            claim = (
                "SELECT topic, stream FROM workpump.claim_work(%s, p_max_rows => %s,"
                " p_topics => %s::jsonb, p_stream_run_max => %s)"
            )
            # every topic, one live instance; then a peer joins (this instance's share
            # first); then a topic filter; then a stream run of two
            emails, billing = '{"outbox": ["emails.welcome"]}', '{"outbox": ["billing.charge"]}'
            rounds.append(conn.execute(claim, [A, 2, emails, 1]).fetchall())
            conn.execute("SELECT workpump.record_heartbeat(%s, 'tests', 'localhost', 1)", [B])
            rounds.append(conn.execute(claim, [A, 2, emails, 1]).fetchall())
            rounds.append(conn.execute(claim, [A, 5, billing, 2]).fetchall())
            rounds.append(conn.execute(claim, [A, 5, None, 1]).fetchall())
            conn.execute(
                "TRUNCATE workpump_outbox, workpump_active_stream, workpump_service_instance"
            )
        return rounds

    expected = [
        [("emails.welcome", None)] * 2,
        [("emails.welcome", None)] * 2,
        [("billing.charge", "acct-1")] * 2,
        [("emails.welcome", None)] * 2,
    ]
    once_per_session = {
        name: ["plan_cache_mode=force_generic_plan", "jit=off", "enable_seqscan=off"]
        for name in claims
    }
    scratch_database.migrate()
    assert settings() == once_per_session
    assert claims_in_one_session() == expected


@pytest.mark.slow  # a database of its own, built and dropped: 10 s
@pytest.mark.django_db(transaction=True)
def test_claim_work_claims_and_refuses_in_order_of_calls(scratch_database):
    """The claims, has_more and refusals of a sequence of calls on the same rows, with the
    category rotation fixed."""
    C = uuid.UUID("00000000-0000-0000-0000-00000000000c")
    emails = json.dumps({"outbox": ["emails.welcome"]})
    both = json.dumps({"outbox": ["emails.welcome"], "inbox": ["stripe.webhook"]})
    stripe = json.dumps({"inbox": ["stripe."]})
    calls: list[tuple[str, dict[str, Any]]] = [
        ("one category fills its budget", {"p_max_rows": 2, "p_topics": emails}),
        ("two share the budget", {"p_max_rows": 3, "p_topics": both}),
        ("a prefix", {"p_max_rows": 1, "p_topics": "{}", "p_topic_prefixes": stripe}),
        ("every topic", {"p_max_rows": 10, "p_topics": None}),
        ("nothing chosen", {"p_topics": '{"outbox": []}'}),
        ("unknown category", {"p_categories": ["outbox", "mailbox"]}),
        ("null category", {"p_categories": ["outbox", None]}),
        ("malformed topics", {"p_topics": '{"outbox": "emails.welcome"}'}),
        ("empty prefix", {"p_topic_prefixes": '{"inbox": [""]}'}),
        ("evicted", {"instance": B}),
        ("unregistered", {"instance": C}),
    ]

    def outcomes() -> dict[str, Any]:
        seen: dict[str, Any] = {}
        with scratch_database.connect() as conn:
            for instance in (A, B):
                conn.execute(
                    "SELECT workpump.record_heartbeat(%s, 'tests', 'localhost', 1)", [instance]
                )
            conn.execute("SELECT workpump.evict_instance(%s)", [B])
            for n in range(4):
                conn.execute("SELECT workpump.send('emails.welcome', %s)", [f'{{"n": {n}}}'])
                conn.execute(
                    "SELECT workpump.receive(gen_random_uuid(), 'stripe.webhook', %s::jsonb)",
                    [f'{{"n": {n}}}'],
                )
            conn.execute("SELECT workpump.send('reports.daily', '{}')")
            for label, arguments in calls:
                arguments = dict(arguments)
                instance = arguments.pop("instance", A)
                names = "".join(f", {name} => %({name})s" for name in arguments)
                # a fixed rotation, so which category comes first is known
                conn.execute("SELECT setval('workpump.claim_rotation_seq', 2, false)")
                try:
                    with conn.transaction():
                        rows = conn.execute(
                            f"SELECT category, topic, has_more FROM workpump.claim_work("
                            f"%(instance)s{names})",
                            {"instance": instance, **arguments},
                        ).fetchall()
                    seen[label] = sorted(rows)
                except psycopg.Error as exc:
                    seen[label] = (exc.sqlstate, str(exc).split("\n")[0])
            conn.execute(
                "TRUNCATE workpump_outbox, workpump_inbox, workpump_active_stream,"
                " workpump_service_instance, workpump_eviction"
            )
        return seen

    expected = {
        "one category fills its budget": [("outbox", "emails.welcome", True)] * 2,
        "two share the budget": [("inbox", "stripe.webhook", True)]
        + [("outbox", "emails.welcome", True)] * 2,
        "a prefix": [("inbox", "stripe.webhook", True)],
        "every topic": [("inbox", "stripe.webhook", False)] * 2
        + [("outbox", "reports.daily", False)],
        "nothing chosen": [],
        "unknown category": ("22023", "Unknown workpump category 'mailbox'."),
        "null category": ("22023", "Unknown workpump category NULL."),
        "malformed topics": (
            "22023",
            "claim_work needs p_topics as an object of category: [topic, ...], not"
            ' {"outbox": "emails.welcome"}.',
        ),
        "empty prefix": (
            "22023",
            "claim_work needs p_topic_prefixes as an object of category:"
            ' [non-empty prefix, ...], not {"inbox": [""]}.',
        ),
        "unregistered": ("WP001", f"claim_work refused instance {C}: it is not registered."),
    }
    scratch_database.migrate()
    seen = outcomes()
    evicted = seen.pop("evicted")
    assert seen == expected
    assert evicted[0] == "WP001"
    assert evicted[1].startswith(f"claim_work refused instance {B}: it was evicted at ")


@pytest.mark.slow  # a database of its own, built and dropped: 10 s
@pytest.mark.django_db(transaction=True)
def test_claim_work_leases_heads_and_runs_in_order_across_calls(scratch_database):
    """Plain rows, stream runs, dead heads, expired leases and peers over a sequence of
    claims: the rows leased, their order, the parked rows and the owned streams; the same
    again on a second run."""
    claims = [
        # (instance, max rows, stream run max, topics)
        (A, 3, 100, None),  # plain rows and a stream run, the budget cut inside the run
        (A, 10, 100, None),  # what is left: runs, a dead head, a retry that fell due
        (A, 10, 1, None),  # nothing new; an expired lease of B's is taken over
        (B, 4, 2, ["orders.paid"]),  # a peer's share, runs of two
        (A, 50, 100, None),
    ]

    def outcomes() -> list[Any]:
        seen: list[Any] = []
        with scratch_database.connect() as conn:
            for instance in (A, B):
                conn.execute(
                    "SELECT workpump.record_heartbeat(%s, 'tests', 'localhost', 1)", [instance]
                )
            for n in range(4):
                conn.execute("SELECT workpump.send('emails.welcome', %s)", [f'{{"n": {n}}}'])
            for n in range(5):
                conn.execute(
                    "SELECT workpump.send('orders.paid', %s, %s)",
                    [f'{{"n": {n}}}', f"order-{n % 2}"],
                )
            conn.execute("SELECT workpump.send('emails.once', '{}', p_max_attempts => 1)")
            conn.execute("UPDATE workpump_outbox SET attempts = 1 WHERE topic = 'emails.once'")
            conn.execute(
                "SELECT workpump.send('emails.later', '{}', p_scheduled_for => now() - interval"
                " '1 s', p_priority => 3)"
            )
            # A row without a stream is partitioned by its random id: number the
            # partitions in sending order, so each run sees the same shares
            conn.execute(
                "UPDATE workpump_outbox SET partition_number ="
                " seq - (SELECT min(seq) FROM workpump_outbox) WHERE stream IS NULL"
            )
            for instance, max_rows, run_max, topics in claims:
                rows = conn.execute(
                    "SELECT topic, payload, stream, attempts, has_more FROM workpump.claim_work("
                    "%s, p_max_rows => %s, p_stream_run_max => %s, p_topics => %s::jsonb)",
                    [instance, max_rows, run_max, topics and json.dumps({"outbox": topics})],
                ).fetchall()
                if instance == A and max_rows == 10 and run_max == 100:
                    # B's lease on one row runs out: the next claim takes it over
                    conn.execute(
                        "UPDATE workpump_outbox SET instance_id = %s, lease_token ="
                        " gen_random_uuid(), lease_expiry = now() - interval '1 s'"
                        " WHERE seq = (SELECT min(seq) FROM workpump_outbox"
                        " WHERE instance_id = %s)",
                        [B, A],
                    )
                seen.append(rows)
            seen.append(
                conn.execute(
                    "SELECT topic, payload, stream, attempts, instance_id,"
                    " dead_lettered_at IS NOT NULL, failure_reason FROM workpump_outbox"
                    " ORDER BY seq"
                ).fetchall()
            )
            seen.append(
                conn.execute(
                    "SELECT stream, owner_instance_id FROM workpump_active_stream ORDER BY stream"
                ).fetchall()
            )
            conn.execute(
                "TRUNCATE workpump_outbox, workpump_active_stream, workpump_service_instance"
            )
        return seen

    scratch_database.migrate()
    seen = outcomes()
    first = seen[0]
    # the retry that fell due first (a timer), then this instance's share, in the budget
    assert len(first) == 3
    assert first[0][0] == "emails.later"
    assert any(row[2] == "order-0" for claim in seen[:5] for row in claim)
    assert ("emails.once", {}, None, 1, None, True, "max_attempts") in seen[5]
    assert {stream for stream, _ in seen[6]} == {"order-0", "order-1"}
    assert outcomes() == seen


# --- one template -------------------------------------------------------------------------


def claim_bodies() -> dict[str, str]:
    rows = run_sql(
        "SELECT proname, prosrc FROM pg_proc WHERE pronamespace = 'workpump'::regnamespace"
        " AND proname = ANY(%s)",
        [[f"claim_{category}" for category in CATEGORIES]],
    )
    return {row["proname"]: row["prosrc"] for row in rows}


def test_each_categorys_claim_is_built_from_the_one_template_and_can_be_rebuilt():
    built = claim_bodies()
    assert sorted(built) == sorted(f"claim_{category}" for category in CATEGORIES)
    for category in CATEGORIES:
        run_sql("SELECT workpump.define_claim(%s)", [category])
    assert claim_bodies() == built
    # every body names its own table and no other category's
    for category, (table, _, _) in TABLES.items():
        body = built[f"claim_{category}"]
        assert f"UPDATE {table} t SET" in body
        others = [t for c, (t, _, _) in TABLES.items() if c != category]
        assert not any(f"{other} " in body for other in others), category
    # the event's fan-outs take payload and type from the event; the others from the row
    assert "JOIN workpump_event e" in built["claim_receptor"]
    assert "JOIN workpump_event e" not in built["claim_outbox"]


def test_define_claim_refuses_an_unknown_category():
    with pytest.raises(DatabaseError, match="nbox_typo"):
        run_sql("SELECT workpump.define_claim('inbox_typo')")
