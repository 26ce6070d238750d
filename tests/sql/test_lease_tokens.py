"""Lease tokens fence every outcome; claims refused to evicted instances, claims by topic.

Every claim issues a fresh lease token per row, and renew_leases, complete_work,
fail_work and release_work change a row only under the token of its current attempt, so
an older attempt's late outcome is 'lost' even when the same instance made both attempts.
claim_work and renew_leases refuse an instance that is tombstoned or not registered
(SQLSTATE WP001). claim_work leases only the topics the claimer names, and a stream whose
head it cannot run is not claimed by it. Time comes from p_now; each test runs in a
rolled-back transaction.
"""

from __future__ import annotations

import json
import uuid
from datetime import datetime
from typing import Any

import pytest
from django.db import DatabaseError, DataError, transaction
from django.test import override_settings

from django_workpump import db
from django_workpump.conf import tombstone_retention_seconds
from django_workpump.db import InstanceRefused
from django_workpump.pump.maintenance import MaintenanceWorker
from tests.helpers import (
    T0,
    WORK_TABLES,
    A,
    B,
    at,
    enroll,
    explaining_connection,
    give_the_planner_statistics,
    run_sql,
    scalar,
)

pytestmark = pytest.mark.django_db

CATEGORIES = sorted(WORK_TABLES)
SUBSCRIBERS = json.dumps(
    [
        {"category": "perspective_event", "name": "totals"},
        {"category": "receptor", "name": "warehouse"},
    ]
)


def produce(category: str, topic: str | None = None, *, stream: str | None = None) -> uuid.UUID:
    """One row of ``category`` (topic: destination, handler, perspective or receptor name)."""
    if category == "outbox":
        return scalar(
            "SELECT workpump.send(%s, '{}'::jsonb, p_stream => %s)",
            [topic or "emails.welcome", stream],
        )
    if category == "inbox":
        message_id = uuid.uuid4()
        run_sql(
            "SELECT workpump.receive(%s, %s, '{}'::jsonb, p_stream => %s)",
            [message_id, topic or "stripe.webhook", stream],
        )
        return message_id
    name = topic or ("totals" if category == "perspective_event" else "warehouse")
    event_id = scalar(
        "SELECT workpump.emit('order.placed', '{}'::jsonb, p_stream => %s,"
        " p_subscribers => %s::jsonb)",
        [stream, json.dumps([{"category": category, "name": name}])],
    )
    table, key = WORK_TABLES[category]
    return scalar(f"SELECT {key} FROM {table} WHERE event_id = %s", [event_id])


def claim(
    instance: uuid.UUID, now: datetime = T0, *, topics: Any = None, lease_seconds: int = 300
) -> list[dict[str, Any]]:
    return run_sql(
        "SELECT * FROM workpump.claim_work(p_instance_id => %s, p_lease_seconds => %s,"
        " p_now => %s, p_topics => %s::jsonb)",
        [instance, lease_seconds, now, None if topics is None else json.dumps(topics)],
    )


def row(category: str, work_id: uuid.UUID) -> dict[str, Any]:
    table, key = WORK_TABLES[category]
    [found] = run_sql(f"SELECT * FROM {table} WHERE {key} = %s", [work_id])
    return found


def renew(category: str, work_id: uuid.UUID, token: uuid.UUID, now: datetime) -> list[Any]:
    return run_sql(
        "SELECT work_id FROM workpump.renew_leases(%s, %s::uuid[], %s::uuid[], 300, %s, %s)",
        [category, [work_id], [token], A, now],
    )


def complete(
    category: str, ids: list[uuid.UUID], tokens: list[uuid.UUID], now: datetime
) -> list[tuple[uuid.UUID, str]]:
    rows = run_sql(
        "SELECT work_id, status FROM workpump.complete_work(%s, %s, %s::uuid[], %s::uuid[],"
        " p_now => %s)",
        [A, category, ids, tokens, now],
    )
    return [(r["work_id"], r["status"]) for r in rows]


def fail(category: str, work_id: uuid.UUID, token: uuid.UUID, now: datetime) -> str:
    return scalar(
        "SELECT status FROM workpump.fail_work(%s, %s, %s::uuid[], %s::uuid[], ARRAY['late'],"
        " p_retry_base_seconds => 0, p_now => %s)",
        [A, category, [work_id], [token], now],
    )


def release(category: str, work_id: uuid.UUID, token: uuid.UUID, now: datetime) -> str:
    return scalar(
        "SELECT status FROM workpump.release_work(%s, %s, %s::uuid[], %s::uuid[], %s)",
        [A, category, [work_id], [token], now],
    )


def two_attempts_by_one_instance(category: str) -> tuple[uuid.UUID, uuid.UUID, uuid.UUID]:
    """A row A claimed, whose lease ran out, and that A claimed again: (id, old, new token)."""
    enroll(A)
    work_id = produce(category)
    [first] = claim(A, T0, lease_seconds=60)
    [second] = claim(A, at(61), lease_seconds=300)  # the first attempt's lease expired
    assert first["work_id"] == second["work_id"] == work_id
    assert (first["attempts"], second["attempts"]) == (1, 2)
    assert first["lease_token"] != second["lease_token"]
    assert row(category, work_id)["lease_token"] == second["lease_token"]
    return work_id, first["lease_token"], second["lease_token"]


# --- 4. lease tokens ------------------------------------------------------------------------


def test_every_claim_issues_a_fresh_token_per_row_and_stores_it():
    enroll(A)
    made = [produce("outbox") for _ in range(3)]
    claimed = claim(A)
    tokens = {r["work_id"]: r["lease_token"] for r in claimed}
    assert sorted(tokens) == sorted(made)
    assert None not in tokens.values() and len(set(tokens.values())) == 3
    for work_id, token in tokens.items():
        assert row("outbox", work_id)["lease_token"] == token


@pytest.mark.parametrize("category", CATEGORIES)
def test_an_older_attempts_completion_by_the_same_instance_is_lost_and_changes_nothing(
    category,
):
    work_id, old, new = two_attempts_by_one_instance(category)
    before = row(category, work_id)

    assert complete(category, [work_id], [old], at(100)) == [(work_id, "lost")]

    assert row(category, work_id) == before
    assert complete(category, [work_id], [new], at(101)) == [(work_id, "done")]


@pytest.mark.parametrize("category", CATEGORIES)
def test_an_older_attempts_failure_by_the_same_instance_is_lost_and_changes_nothing(category):
    work_id, old, _ = two_attempts_by_one_instance(category)
    before = row(category, work_id)

    assert fail(category, work_id, old, at(100)) == "lost"

    assert row(category, work_id) == before


@pytest.mark.parametrize("category", CATEGORIES)
def test_an_older_attempts_release_by_the_same_instance_is_lost_and_changes_nothing(category):
    work_id, old, _ = two_attempts_by_one_instance(category)
    before = row(category, work_id)

    assert release(category, work_id, old, at(100)) == "lost"

    assert row(category, work_id) == before
    assert before["attempts"] == 2  # the newer attempt was not given back


@pytest.mark.parametrize("category", CATEGORIES)
def test_an_older_attempts_renewal_by_the_same_instance_renews_nothing(category):
    work_id, old, new = two_attempts_by_one_instance(category)
    before = row(category, work_id)

    assert renew(category, work_id, old, at(100)) == []

    assert row(category, work_id) == before
    assert renew(category, work_id, new, at(101)) == [{"work_id": work_id}]


def test_in_one_batch_only_the_current_attempts_outcome_counts():
    work_id, old, new = two_attempts_by_one_instance("outbox")

    statuses = complete("outbox", [work_id, work_id], [old, new], at(100))

    assert statuses == [(work_id, "lost"), (work_id, "done")]
    assert row("outbox", work_id)["done_at"] == at(100)


def test_an_outcome_clears_the_token_so_a_replay_is_lost():
    enroll(A)
    work_id = produce("outbox")
    [got] = claim(A)
    assert complete("outbox", [work_id], [got["lease_token"]], at(1)) == [(work_id, "done")]
    assert row("outbox", work_id)["lease_token"] is None
    assert complete("outbox", [work_id], [got["lease_token"]], at(2)) == [(work_id, "lost")]


@pytest.mark.parametrize(
    ("call", "message"),
    [
        ("complete_work(%(a)s, 'outbox', ARRAY[%(id)s]::uuid[], NULL)", "one lease token per id"),
        ("fail_work(%(a)s, 'outbox', ARRAY[%(id)s]::uuid[], '{}', ARRAY['e'])", "one lease token"),
        ("release_work(%(a)s, 'outbox', ARRAY[%(id)s]::uuid[], ARRAY[NULL]::uuid[])", "NULL lease"),
        ("renew_leases('outbox', ARRAY[%(id)s]::uuid[], NULL)", "one lease token per id"),
    ],
)
def test_the_tokens_are_required_one_per_id(call, message):
    with pytest.raises(DataError, match=message), transaction.atomic():
        run_sql(f"SELECT * FROM workpump.{call}", {"a": A, "id": uuid.uuid4()})


def test_spending_a_tasks_attempts_is_fenced_by_the_token_too():
    work_id, old, new = two_attempts_by_one_instance("inbox")

    def spend(token: uuid.UUID) -> int:
        rows = db.fetch_named(
            "tasks.sql",
            "spend_attempts",
            {"work_id": work_id, "instance_id": A, "lease_token": token},
        )
        return len(rows)

    assert spend(old) == 0
    assert row("inbox", work_id)["max_attempts"] == 10
    assert spend(new) == 1
    assert row("inbox", work_id)["max_attempts"] == 2


# --- 5. evicted and unregistered instances ------------------------------------------------


def evict(instance: uuid.UUID, now: datetime) -> None:
    run_sql("SELECT workpump.evict_instance(%s, 'by the test', %s)", [instance, now])


def refused(query: str, params: list[Any]) -> str:
    """The message of the WP001 error ``query`` raises."""
    with pytest.raises(DatabaseError) as raised, transaction.atomic():
        run_sql(query, params)
    assert getattr(raised.value.__cause__, "sqlstate", None) == "WP001", raised.value
    return str(raised.value)


def test_a_tombstoned_instance_is_refused_a_claim_and_nothing_is_leased():
    enroll(A)
    work_id = produce("outbox")
    evict(A, at(1))

    message = refused("SELECT * FROM workpump.claim_work(%s, p_now => %s)", [A, at(2)])

    assert f"claim_work refused instance {A}: it was evicted at" in message
    assert "by the test" in message
    assert row("outbox", work_id)["instance_id"] is None
    assert row("outbox", work_id)["attempts"] == 0


def test_an_unregistered_instance_is_refused_a_claim():
    produce("outbox")
    message = refused("SELECT * FROM workpump.claim_work(%s, p_now => %s)", [B, T0])
    assert f"claim_work refused instance {B}: it is not registered." in message


def test_an_instance_evicted_while_it_holds_a_row_is_refused_its_renewal():
    enroll(A)
    work_id = produce("inbox")
    [got] = claim(A)
    evict(A, at(10))

    message = refused(
        "SELECT * FROM workpump.renew_leases('inbox', %s::uuid[], %s::uuid[], 300, %s, %s)",
        [[work_id], [got["lease_token"]], A, at(11)],
    )

    assert f"renew_leases refused instance {A}: it was evicted at" in message
    assert row("inbox", work_id)["lease_renewals"] == 0


def test_an_unregistered_instance_is_refused_a_renewal():
    message = refused(
        "SELECT * FROM workpump.renew_leases('outbox', %s::uuid[], %s::uuid[], 300, %s)",
        [[uuid.uuid4()], [uuid.uuid4()], B],
    )
    assert "it is not registered" in message


def test_the_python_wrapper_raises_instance_refused():
    expected = f"claim_work refused instance {B}"
    with pytest.raises(InstanceRefused, match=expected), transaction.atomic():
        db.claim_work(instance_id=B, max_rows=1, lease_seconds=60, partition_count=10)


def test_tombstones_outlive_the_longest_lease_plus_the_dead_cutoff():
    defaults = {
        "LEASE_SECONDS": 300,
        "MAX_RENEWALS_PER_WORK": 6,
        "STALE_AFTER_SECONDS": 30,
        "DEFINITIVELY_DEAD_AFTER_SECONDS": 300,
    }
    assert tombstone_retention_seconds(defaults) == 24 * 3600  # a day covers 2,400 s
    long_leases = {**defaults, "LEASE_SECONDS": 4 * 3600, "MAX_RENEWALS_PER_WORK": 6}
    assert tombstone_retention_seconds(long_leases) == 7 * 4 * 3600 + 300
    worker = MaintenanceWorker(
        alias="default",
        interval_seconds=60,
        retention_seconds=60,
        stale_after_seconds=30,
        definitively_dead_after_seconds=300,
        tombstone_retention_seconds=60,  # never below the day
    )
    assert worker.tombstone_retention_seconds == 24 * 3600


@override_settings(WORKPUMP={"LEASE_SECONDS": 4 * 3600, "LEASE_GRACE_SECONDS": 60})
def test_the_pump_purges_tombstones_only_past_the_clamped_retention():
    from django_workpump.pump.supervisor import Supervisor

    supervisor = Supervisor()
    assert supervisor.maintenance.tombstone_retention_seconds == 7 * 4 * 3600 + 300


# --- 3. claims by topic -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("category", "mine", "other"),
    [
        ("outbox", "emails.welcome", "emails.new"),
        ("inbox", "stripe.webhook", "paypal.webhook"),
        ("perspective_event", "totals", "totals.v2"),
        ("receptor", "warehouse", "warehouse.v2"),
    ],
)
def test_claim_with_topics_leases_only_those_topics(category, mine, other):
    enroll(A)
    wanted = produce(category, mine)
    unwanted = produce(category, other)

    got = claim(A, topics={category: [mine]})

    assert [r["work_id"] for r in got] == [wanted]
    untouched = row(category, unwanted)
    assert (untouched["attempts"], untouched["instance_id"], untouched["lease_token"]) == (
        0,
        None,
        None,
    )


def test_a_stream_whose_head_has_an_unhandled_topic_is_not_claimed_and_keeps_its_attempts():
    enroll(A)
    head = produce("outbox", "emails.new", stream="user-7")  # nobody here runs it
    behind = produce("outbox", "emails.welcome", stream="user-7")
    other = produce("outbox", "emails.welcome", stream="user-8")

    got = claim(A, topics={"outbox": ["emails.welcome"]})

    assert [r["work_id"] for r in got] == [other]
    for work_id in (head, behind):
        waiting = row("outbox", work_id)
        assert (waiting["attempts"], waiting["instance_id"]) == (0, None)
    assert row("outbox", head)["stream_head"] is True
    assert scalar("SELECT count(*) FROM workpump_active_stream WHERE stream = 'user-7'") == 0
    # An instance that runs the head's topic takes the stream, in order.
    enroll(B)
    assert [r["work_id"] for r in claim(B, at(1))] == [head]


def test_a_category_the_topics_leave_out_is_not_claimed():
    enroll(A)
    produce("outbox")
    inbox = produce("inbox")
    got = claim(A, topics={"inbox": ["stripe.webhook"], "outbox": []})
    assert [r["work_id"] for r in got] == [inbox]


def test_expired_leases_and_due_retries_of_unhandled_topics_are_left_alone():
    enroll(A)
    enroll(B)
    work_id = produce("outbox", "emails.new")
    [got] = claim(B, T0, lease_seconds=60)  # B runs it; then its lease runs out
    assert got["work_id"] == work_id

    assert claim(A, at(61), topics={"outbox": ["emails.welcome"]}) == []
    held = row("outbox", work_id)
    assert (held["instance_id"], held["attempts"], held["failure_reason"]) == (B, 1, None)


def test_a_row_out_of_attempts_is_not_dead_lettered_by_a_claimer_that_cannot_run_it():
    enroll(A)
    work_id = scalar("SELECT workpump.send('emails.new', '{}'::jsonb, p_max_attempts => 1)")
    run_sql("UPDATE workpump_outbox SET attempts = 1 WHERE work_id = %s", [work_id])

    assert claim(A, topics={"outbox": ["emails.welcome"]}) == []
    assert row("outbox", work_id)["dead_lettered_at"] is None


@pytest.mark.parametrize(
    "topics",
    ['["emails.welcome"]', '{"outbx": ["a"]}', '{"outbox": "a"}', '{"outbox": [1]}'],
)
def test_malformed_topics_are_refused_with_the_expected_shape(topics):
    enroll(A)
    expected = r"p_topics as an object of category: \[topic, ...\]"
    with pytest.raises(DataError, match=expected), transaction.atomic():
        run_sql("SELECT * FROM workpump.claim_work(%s, p_topics => %s::jsonb)", [A, topics])


@pytest.mark.django_db(transaction=True)
def test_the_guard_probes_use_the_partial_indexes_with_topics_too(raw_connect):
    conn, plans = explaining_connection(raw_connect)
    with conn.transaction(force_rollback=True):  # the rows and registration go after
        give_the_planner_statistics(conn)
        conn.execute("SELECT workpump.record_heartbeat(%s, 'tests', 'localhost', 1)", [A])
        plans.clear()
        topics = {c: ["some.topic"] for c in CATEGORIES}

        conn.execute(
            "SELECT * FROM workpump.claim_work(%s, p_topics => %s)", [A, json.dumps(topics)]
        )

    text = "\n".join(plans)
    for prefix in ("wp_outbox", "wp_inbox", "wp_persp", "wp_receptor"):
        for kind in ("ready", "timer"):
            assert f"using {prefix}_{kind} on" in text, (prefix, kind)
