"""What happens to leased rows after the claim, and the maintenance and operator functions.

Covers renew_leases, complete_work, fail_work and release_work, the
maintenance purges and lock (§8), the operator actions (§10) and workpump.state_of (§2).
Rows are produced with workpump.send/receive/emit and leased with workpump.claim_work;
time is always passed as p_now.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import datetime, timedelta
from typing import Any

import pytest
from django.db import DataError, transaction

from tests import factories
from tests.helpers import T0, at, current_tokens, enroll, run_sql, scalar, seq_scans

pytestmark = pytest.mark.django_db

CATEGORIES = ["outbox", "inbox", "perspective_event", "receptor"]

# category -> (table, key column, done column)
TABLES = {
    "outbox": ("workpump_outbox", "work_id", "done_at"),
    "inbox": ("workpump_inbox", "work_id", "done_at"),
    "perspective_event": ("workpump_perspective_event", "work_id", "done_at"),
    "receptor": ("workpump_receptor_processing", "work_id", "done_at"),
}

# One event fans out to a perspective row and a receptor row.
BOTH_SUBSCRIBERS = json.dumps(
    [
        {"category": "perspective_event", "name": "totals"},
        {"category": "receptor", "name": "warehouse"},
    ]
)

FAR_FUTURE = at(10**8)


# --- producing and claiming -------------------------------------------------------------


def produce(
    category: str,
    *,
    stream: str | None = None,
    max_attempts: int = 10,
    scheduled_for: datetime | None = None,
) -> uuid.UUID:
    """Produce one row of ``category`` through the SQL producers; return its work id."""
    if category == "outbox":
        return scalar(
            "SELECT workpump.send('emails.welcome', '{}'::jsonb, p_stream => %s,"
            " p_scheduled_for => %s, p_max_attempts => %s)",
            [stream, scheduled_for, max_attempts],
        )
    if category == "inbox":
        message_id = uuid.uuid4()
        assert scalar(
            "SELECT workpump.receive(%s, 'stripe.webhook', '{}'::jsonb, p_stream => %s,"
            " p_scheduled_for => %s, p_max_attempts => %s)",
            [message_id, stream, scheduled_for, max_attempts],
        )
        return message_id
    assert scheduled_for is None, "emit has no deferral"
    name = "totals" if category == "perspective_event" else "warehouse"
    subscribers = json.dumps([{"category": category, "name": name, "max_attempts": max_attempts}])
    event_id = scalar(
        "SELECT workpump.emit('order.placed', '{}'::jsonb, p_stream => %s,"
        " p_subscribers => %s::jsonb)",
        [stream, subscribers],
    )
    table, key, _ = TABLES[category]
    return scalar(f"SELECT {key} FROM {table} WHERE event_id = %s", [event_id])


def claim(
    instance: uuid.UUID, now: datetime = T0, *, lease_seconds: int = 300
) -> list[dict[str, Any]]:
    enroll(instance, now)
    return run_sql(
        "SELECT * FROM workpump.claim_work(p_instance_id => %s, p_lease_seconds => %s,"
        " p_now => %s)",
        [instance, lease_seconds, now],
    )


def claimed_ids(instance: uuid.UUID, now: datetime = T0, **kwargs: Any) -> list[uuid.UUID]:
    return [r["work_id"] for r in claim(instance, now, **kwargs)]


def row(category: str, work_id: uuid.UUID) -> dict[str, Any]:
    table, key, done = TABLES[category]
    rows = run_sql(f"SELECT *, {done} AS done_at FROM {table} WHERE {key} = %s", [work_id])
    assert len(rows) == 1, rows
    return rows[0]


def exists(category: str, work_id: uuid.UUID) -> bool:
    table, key, _ = TABLES[category]
    return scalar(f"SELECT count(*) FROM {table} WHERE {key} = %s", [work_id]) == 1


def state(category: str, work_id: uuid.UUID, now: datetime) -> str:
    table, key, done = TABLES[category]
    return scalar(
        f"SELECT workpump.state_of({done}, dead_lettered_at, instance_id, lease_expiry,"
        f" claimed_at, scheduled_for, NULL, %s) FROM {table} WHERE {key} = %s",
        [now, work_id],
    )


def ledger(category: str, stream: str) -> dict[str, Any]:
    rows = run_sql(
        "SELECT * FROM workpump_active_stream WHERE category = %s AND stream = %s",
        [category, stream],
    )
    assert len(rows) == 1, rows
    return rows[0]


def register(instance: uuid.UUID, now: datetime = T0) -> None:
    assert scalar(
        "SELECT workpump.record_heartbeat(%s, 'tests', 'localhost', 1, p_now => %s)",
        [instance, now],
    )


def as_json(value: Any) -> Any:
    return json.loads(value) if isinstance(value, str) else value


# --- the functions under test -----------------------------------------------------------


def renew(
    category: str,
    ids: list[uuid.UUID | None] | None,
    *,
    seconds: int = 300,
    instance: uuid.UUID | None = None,
    now: datetime = T0,
    tokens: list[uuid.UUID] | None = None,
) -> list[dict[str, Any]]:
    if tokens is None and ids is not None and None not in ids:
        tokens = current_tokens(category, ids)
    return run_sql(
        "SELECT * FROM workpump.renew_leases(%s, %s::uuid[], %s::uuid[], %s, %s, %s)",
        [category, ids, tokens, seconds, instance, now],
    )


def complete(
    instance: uuid.UUID | None,
    category: str,
    ids: list[uuid.UUID],
    results: list[Any] | None = None,
    now: datetime = T0,
    tokens: list[uuid.UUID] | None = None,
) -> dict[uuid.UUID, str]:
    encoded = None if results is None else [json.dumps(r) for r in results]
    if tokens is None:
        tokens = current_tokens(category, ids)
    rows = run_sql(
        "SELECT * FROM workpump.complete_work(%s, %s, %s::uuid[], %s::uuid[],"
        " %s::text[]::jsonb[], p_now => %s)",
        [instance, category, ids, tokens, encoded, now],
    )
    return {r["work_id"]: r["status"] for r in rows}


def fail(
    instance: uuid.UUID,
    category: str,
    ids: list[uuid.UUID],
    errors: list[str] | None = None,
    reasons: list[str | None] | None = None,
    *,
    base: int = 30,
    cap: int = 300,
    now: datetime = T0,
    tokens: list[uuid.UUID] | None = None,
) -> dict[uuid.UUID, dict[str, Any]]:
    if errors is None:
        errors = ["boom"] * len(ids)
    if tokens is None:
        tokens = current_tokens(category, ids)
    rows = run_sql(
        "SELECT * FROM workpump.fail_work(%s, %s, %s::uuid[], %s::uuid[], %s::text[],"
        " %s::text[], %s, %s, NULL, p_now => %s)",
        [instance, category, ids, tokens, errors, reasons, base, cap, now],
    )
    return {r["work_id"]: r for r in rows}


def release(
    instance: uuid.UUID,
    category: str,
    ids: list[uuid.UUID],
    now: datetime = T0,
    tokens: list[uuid.UUID] | None = None,
) -> dict[uuid.UUID, str]:
    if tokens is None:
        tokens = current_tokens(category, ids)
    rows = run_sql(
        "SELECT * FROM workpump.release_work(%s, %s, %s::uuid[], %s::uuid[], %s)",
        [instance, category, ids, tokens, now],
    )
    return {r["work_id"]: r["status"] for r in rows}


def action(name: str, category: str, ids: list[uuid.UUID], **named: Any) -> list[uuid.UUID]:
    """Call an operator action (retry_now, release_leases, dead_letter, requeue_dead)."""
    extra = "".join(f", p_{key} => %s" for key in named)
    rows = run_sql(
        f"SELECT * FROM workpump.{name}(p_category => %s, p_ids => %s::uuid[]{extra}) AS id",
        [category, ids, *named.values()],
    )
    return [r["id"] for r in rows]


def reach_attempt(category: str, work_id: uuid.UUID, me: uuid.UUID, attempts: int) -> None:
    """Claim the row until it is leased to ``me`` on attempt number ``attempts``."""
    for _ in range(attempts - 1):
        assert claimed_ids(me) == [work_id]
        assert fail(me, category, [work_id], base=0)[work_id]["status"] == "retry"
    assert claimed_ids(me) == [work_id]
    assert row(category, work_id)["attempts"] == attempts


@contextmanager
def raises_invalid(match: str) -> Iterator[pytest.ExceptionInfo[DataError]]:
    """Expect an invalid_parameter_value error; the savepoint keeps the test usable."""
    with pytest.raises(DataError, match=match) as info, transaction.atomic():
        yield info


# --- renew_leases -----------------------------------------------------------------------


def test_renew_leases_exists_with_the_documented_parameters_and_defaults():
    arguments = scalar("SELECT pg_get_function_arguments('workpump.renew_leases'::regproc)")
    assert arguments == (
        "p_category text, p_ids uuid[], p_lease_tokens uuid[], p_lease_seconds integer DEFAULT 300,"
        " p_instance_id uuid DEFAULT NULL::uuid, p_now timestamp with time zone DEFAULT NULL::"
        "timestamp with time zone"
    )


@pytest.mark.parametrize("category", CATEGORIES)
def test_renewal_extends_the_lease_from_now_and_counts_it(category):
    me = uuid.uuid4()
    work_id = produce(category)
    assert claimed_ids(me) == [work_id]
    assert row(category, work_id)["lease_expiry"] == at(300)

    assert renew(category, [work_id], seconds=600, instance=me, now=at(100)) == [
        {"work_id": work_id, "lease_expiry": at(700), "status": "renewed"}
    ]
    after = row(category, work_id)
    assert (after["instance_id"], after["lease_expiry"], after["lease_renewals"]) == (
        me,
        at(700),
        1,
    )

    renew(category, [work_id], seconds=600, instance=me, now=at(200))
    after = row(category, work_id)
    assert (after["lease_expiry"], after["lease_renewals"]) == (at(800), 2)


def test_renewal_touches_only_the_table_of_the_named_category():
    me = uuid.uuid4()
    event_id = scalar(
        "SELECT workpump.emit('order.placed', '{}'::jsonb, p_stream => 'order-1',"
        " p_subscribers => %s::jsonb)",
        [BOTH_SUBSCRIBERS],
    )
    perspective_id = scalar(
        "SELECT work_id FROM workpump_perspective_event WHERE event_id = %s", [event_id]
    )
    receptor_id = scalar(
        "SELECT work_id FROM workpump_receptor_processing WHERE event_id = %s", [event_id]
    )
    assert sorted(claimed_ids(me)) == sorted([perspective_id, receptor_id])

    # a perspective id named as a receptor id matches no receptor row
    assert renew("receptor", [perspective_id], instance=me, now=at(50)) == []
    assert [r["work_id"] for r in renew("receptor", [receptor_id], instance=me, now=at(50))] == [
        receptor_id
    ]
    assert row("receptor", receptor_id)["lease_expiry"] == at(350)
    assert row("perspective_event", perspective_id)["lease_expiry"] == at(300)
    assert row("perspective_event", perspective_id)["lease_renewals"] == 0


def test_renewal_fenced_by_another_instance_renews_nothing():
    me, other = uuid.uuid4(), uuid.uuid4()
    work_id = produce("outbox")
    claim(me)
    enroll(other)
    before = row("outbox", work_id)

    assert renew("outbox", [work_id], seconds=900, instance=other, now=at(100)) == []
    assert row("outbox", work_id) == before


def test_renewal_skips_done_rows_and_rows_nobody_holds():
    me = uuid.uuid4()
    done_id = produce("outbox")
    claim(me)
    assert complete(me, "outbox", [done_id]) == {done_id: "done"}
    unleased_id = produce("outbox")

    assert renew("outbox", [done_id, unleased_id], now=at(10)) == []
    for work_id in (done_id, unleased_id):
        after = row("outbox", work_id)
        assert (after["instance_id"], after["lease_expiry"], after["lease_renewals"]) == (
            None,
            None,
            0,
        )


def test_renewal_of_an_unknown_category_names_the_valid_ones_in_its_hint():
    with raises_invalid("Unknown workpump category 'outboxes'") as info:
        renew("outboxes", [uuid.uuid4()])
    error = info.value.__cause__
    assert error.sqlstate == "22023"
    assert error.diag.message_hint == (
        "Valid categories: outbox, inbox, perspective_event, receptor."
    )


@pytest.mark.parametrize("seconds", [0, -30])
def test_renewal_refuses_a_lease_that_is_not_positive(seconds):
    with raises_invalid(r"renew_leases needs p_lease_seconds >= 1"):
        renew("outbox", [uuid.uuid4()], seconds=seconds)


@pytest.mark.parametrize("ids", [None, []], ids=["null", "empty"])
def test_renewal_of_no_ids_renews_nothing(ids):
    me = uuid.uuid4()
    work_id = produce("outbox")
    claim(me)
    assert renew("outbox", ids, now=at(10)) == []
    assert row("outbox", work_id)["lease_renewals"] == 0


def test_renewal_refuses_a_null_id():
    me = uuid.uuid4()
    work_id = produce("outbox")
    claim(me)
    with raises_invalid("renew_leases got a NULL work id"):
        renew("outbox", [work_id, None], instance=me)


@pytest.mark.parametrize("category", CATEGORIES)
def test_renewal_moves_the_stream_lease_with_the_row(category):
    me = uuid.uuid4()
    work_id = produce(category, stream="order-1")
    claim(me)
    before = ledger(category, "order-1")
    assert (before["owner_instance_id"], before["lease_expiry"]) == (me, at(300))

    renew(category, [work_id], seconds=600, instance=me, now=at(100))
    after = ledger(category, "order-1")
    assert (after["owner_instance_id"], after["lease_expiry"], after["last_activity_at"]) == (
        me,
        at(700),
        at(100),
    )


# --- complete_work ----------------------------------------------------------------------


@pytest.mark.parametrize("category", CATEGORIES)
def test_completion_marks_the_row_done_clears_the_lease_and_stores_the_result(category):
    me = uuid.uuid4()
    work_id = produce(category)
    claim(me)

    assert complete(me, category, [work_id], results=[{"total": 3}], now=at(60)) == {
        work_id: "done"
    }
    after = row(category, work_id)
    assert after["done_at"] == at(60)
    assert (after["instance_id"], after["lease_expiry"]) == (None, None)
    assert as_json(after["result"]) == {"total": 3}
    assert state(category, work_id, at(60)) == "done"


def test_completion_without_results_stores_no_result():
    me = uuid.uuid4()
    work_id = produce("inbox")
    claim(me)
    assert complete(me, "inbox", [work_id], now=at(5)) == {work_id: "done"}
    assert row("inbox", work_id)["result"] is None


def test_completion_reports_rows_the_caller_does_not_hold_as_lost():
    me, other = uuid.uuid4(), uuid.uuid4()
    mine = produce("outbox")
    already_done = produce("outbox")
    claim(me)
    complete(me, "outbox", [already_done], now=at(1))
    theirs = produce("outbox")
    claim(other, at(2))
    unknown = uuid.uuid4()

    assert complete(me, "outbox", [mine, theirs, already_done, unknown], now=at(10)) == {
        mine: "done",
        theirs: "lost",
        already_done: "lost",
        unknown: "lost",
    }
    assert row("outbox", already_done)["done_at"] == at(1)


def test_completion_by_another_instance_changes_nothing():
    me, other = uuid.uuid4(), uuid.uuid4()
    work_id = produce("receptor", stream="order-1")
    claim(me)
    before = row("receptor", work_id)

    assert complete(other, "receptor", [work_id], results=[{"x": 1}], now=at(10)) == {
        work_id: "lost"
    }
    assert row("receptor", work_id) == before
    assert ledger("receptor", "order-1")["owner_instance_id"] == me


def test_a_late_completion_after_the_row_was_claimed_again_changes_nothing():
    first, second = uuid.uuid4(), uuid.uuid4()
    work_id = produce("outbox")
    claim(first, lease_seconds=300)
    assert claimed_ids(second, at(400)) == [work_id]  # the first lease expired

    assert complete(first, "outbox", [work_id], now=at(450)) == {work_id: "lost"}
    after = row("outbox", work_id)
    assert (after["instance_id"], after["done_at"], after["attempts"]) == (second, None, 2)
    assert after["failure_reason"] == "lease_expired"

    assert complete(second, "outbox", [work_id], now=at(460)) == {work_id: "done"}


@pytest.mark.parametrize("category", CATEGORIES)
def test_completing_a_stream_head_hands_the_stream_to_its_next_row(category):
    me = uuid.uuid4()
    head = produce(category, stream="order-1")
    follower = produce(category, stream="order-1")
    assert row(category, follower)["stream_head"] is False
    assert claimed_ids(me) == [head]

    complete(me, category, [head], now=at(10))
    assert row(category, follower)["stream_head"] is True
    assert claimed_ids(me, at(10)) == [follower]


def test_completion_clears_the_stream_owner_in_the_ledger():
    me = uuid.uuid4()
    work_id = produce("inbox", stream="user-7")
    claim(me)
    assert ledger("inbox", "user-7")["owner_instance_id"] == me

    complete(me, "inbox", [work_id], now=at(10))
    after = ledger("inbox", "user-7")
    assert (after["owner_instance_id"], after["lease_expiry"]) == (None, None)


def test_completion_refuses_a_results_array_of_another_length():
    me = uuid.uuid4()
    work_id = produce("outbox")
    claim(me)
    with raises_invalid("complete_work got 1 ids but 2 results"):
        complete(me, "outbox", [work_id], results=[{}, {}])


def test_completion_without_an_instance_id_is_refused():
    with raises_invalid("complete_work needs p_instance_id"):
        complete(None, "outbox", [uuid.uuid4()])


def test_a_completion_planned_on_a_near_empty_table_still_ends_rows_by_their_key():
    """The ending statement's plan is kept for the session: one made while the table held
    a few rows must not scan the whole table once it has grown (until the next ANALYZE)."""
    run_sql("TRUNCATE workpump_outbox CASCADE")  # physically empty (rolled back after)
    me = uuid.uuid4()
    first = [produce("outbox") for _ in range(3)]
    claim(me)
    run_sql("DISCARD PLANS")  # whatever an earlier test left: planned here, on 3 rows
    assert set(complete(me, "outbox", first).values()) == {"done"}
    run_sql(
        "SELECT workpump.send_many('emails.welcome', array_agg(jsonb_build_object('n', g)))"
        " FROM generate_series(1, 2000) g"
    )
    grown = [r["work_id"] for r in claim(me)][:5]

    before = seq_scans("workpump_outbox")
    assert set(complete(me, "outbox", grown).values()) == {"done"}
    assert seq_scans("workpump_outbox") == before


@pytest.mark.django_db(transaction=True)
def test_promoting_a_new_stream_head_notifies_the_category_channel(raw_connect):
    worker, listener = raw_connect(), raw_connect()
    me = uuid.uuid4()

    def call(query: str, *params: Any) -> Any:
        return next(iter(worker.execute(query, params).fetchone().values()))

    single = call("SELECT workpump.send('emails.welcome', '{}'::jsonb)")
    head = call("SELECT workpump.send('emails.welcome', '{}'::jsonb, p_stream => 's')")
    call("SELECT workpump.send('emails.welcome', '{}'::jsonb, p_stream => 's')")
    call("SELECT workpump.record_heartbeat(%s, 'tests', 'localhost', 1, p_now => %s)", me, T0)
    claimed = worker.execute(
        "SELECT work_id, lease_token FROM workpump.claim_work(p_instance_id => %s, p_now => %s)",
        [me, T0],
    ).fetchall()
    assert sorted(r["work_id"] for r in claimed) == sorted([single, head])
    tokens = {r["work_id"]: r["lease_token"] for r in claimed}
    # listen only now: the inserts above notified before this session listened
    listener.execute("LISTEN workpump_outbox")

    def complete_one(work_id: uuid.UUID) -> None:
        status = worker.execute(
            "SELECT status FROM workpump.complete_work(%s, 'outbox', %s::uuid[], %s::uuid[],"
            " p_now => %s)",
            [me, [work_id], [tokens[work_id]], at(10)],
        ).fetchone()
        assert status == {"status": "done"}

    def next_payload() -> str:
        for notify in listener.notifies(timeout=5, stop_after=1):
            return notify.payload
        raise AssertionError("no notification within 5 s")

    # a row of no stream promotes nothing: the marker is the next thing on the channel
    complete_one(single)
    worker.execute("NOTIFY workpump_outbox, 'marker'")
    assert next_payload() == "marker"

    complete_one(head)
    assert next_payload() == "outbox"
    worker.execute("NOTIFY workpump_outbox, 'marker'")
    assert next_payload() == "marker"  # one promotion, one notification


# --- fail_work --------------------------------------------------------------------------


def test_failure_records_the_error_releases_the_lease_and_keeps_the_attempt_count():
    me = uuid.uuid4()
    work_id = produce("outbox", stream="user-7")
    claim(me)
    renew("outbox", [work_id], instance=me, now=at(5))

    outcome = fail(me, "outbox", [work_id], ["ValueError: bad"], base=30, now=at(10))[work_id]
    assert outcome["status"] == "retry"
    after = row("outbox", work_id)
    assert after["last_error"] == "ValueError: bad"
    assert after["failure_reason"] == "handler_error"
    assert (after["instance_id"], after["lease_expiry"], after["claimed_at"]) == (None, None, None)
    assert after["lease_renewals"] == 0
    assert after["attempts"] == 1
    assert after["scheduled_for"] == outcome["scheduled_for"]
    assert state("outbox", work_id, at(10)) == "scheduled"
    assert ledger("outbox", "user-7")["owner_instance_id"] is None


def test_failure_reasons_default_to_handler_error_per_row():
    me = uuid.uuid4()
    first, second = produce("inbox"), produce("inbox")
    claim(me)
    fail(me, "inbox", [first, second], ["e1", "e2"], [None, "lease_expired"], now=at(10))
    assert row("inbox", first)["failure_reason"] == "handler_error"
    assert row("inbox", second)["failure_reason"] == "lease_expired"
    assert row("inbox", second)["last_error"] == "e2"


@pytest.mark.parametrize("attempts", [1, 2, 3])
def test_the_retry_delay_doubles_with_each_attempt_plus_at_most_ten_percent(attempts):
    me = uuid.uuid4()
    work_id = produce("outbox")
    reach_attempt("outbox", work_id, me, attempts)

    scheduled = fail(me, "outbox", [work_id], base=10, cap=1000, now=at(50))[work_id][
        "scheduled_for"
    ]
    delay = (scheduled - at(50)).total_seconds()
    low = 10 * 2 ** (attempts - 1)
    assert low <= delay < low * 1.1
    expected = scalar(
        "SELECT workpump.retry_delay_seconds(%s, %s, 10, 1000)", [str(work_id), attempts]
    )
    assert delay == pytest.approx(expected, abs=1e-5)
    assert claimed_ids(me, scheduled - timedelta(microseconds=1)) == []
    assert claimed_ids(me, scheduled) == [work_id]


def test_the_retry_delay_is_capped_at_the_maximum():
    me = uuid.uuid4()
    work_id = produce("outbox")
    reach_attempt("outbox", work_id, me, 3)  # uncapped: 10 * 4 = 40 s

    scheduled = fail(me, "outbox", [work_id], base=10, cap=25, now=at(50))[work_id]["scheduled_for"]
    delay = (scheduled - at(50)).total_seconds()
    assert 25 <= delay < 27.5


def test_a_zero_retry_base_makes_the_row_claimable_at_once():
    me = uuid.uuid4()
    work_id = produce("perspective_event", stream="order-1")
    claim(me)

    outcome = fail(me, "perspective_event", [work_id], base=0, now=at(10))[work_id]
    assert (outcome["status"], outcome["scheduled_for"]) == ("retry", None)
    assert state("perspective_event", work_id, at(10)) == "pending"
    [again] = claim(me, at(10))
    assert (again["work_id"], again["attempts"]) == (work_id, 2)


@pytest.mark.parametrize("category", CATEGORIES)
def test_a_failure_on_the_last_attempt_parks_the_row_dead(category):
    me = uuid.uuid4()
    work_id = produce(category, max_attempts=2)
    reach_attempt(category, work_id, me, 2)

    outcome = fail(me, category, [work_id], ["still broken"], now=at(20))[work_id]
    assert (outcome["status"], outcome["scheduled_for"]) == ("dead", None)
    after = row(category, work_id)
    assert after["dead_lettered_at"] == at(20)
    assert after["failure_reason"] == "max_attempts"
    assert after["last_error"] == "still broken"
    assert after["instance_id"] is None
    assert state(category, work_id, at(20)) == "dead"
    assert claim(me, FAR_FUTURE) == []


@pytest.mark.parametrize(
    ("reason", "stored"),
    [
        ("timeout", "timeout"),
        ("not_retryable", "not_retryable"),
        ("undecodable_payload", "undecodable_payload"),
        ("handler_error", "max_attempts"),
        ("lease_expired", "max_attempts"),
        (None, "max_attempts"),
    ],
)
def test_the_last_attempts_reason_is_kept_when_it_says_why_the_row_is_dead(reason, stored):
    me = uuid.uuid4()
    work_id = produce("outbox", max_attempts=2)
    reach_attempt("outbox", work_id, me, 2)

    outcome = fail(me, "outbox", [work_id], ["too slow"], [reason], now=at(20))[work_id]

    assert outcome["status"] == "dead"
    after = row("outbox", work_id)
    assert (after["failure_reason"], after["dead_lettered_at"]) == (stored, at(20))


def test_a_failure_of_a_row_the_caller_does_not_hold_is_lost():
    me, other = uuid.uuid4(), uuid.uuid4()
    theirs = produce("outbox")
    claim(other)
    before = row("outbox", theirs)
    unknown = uuid.uuid4()

    outcomes = fail(me, "outbox", [theirs, unknown], now=at(10))
    assert {k: (v["status"], v["scheduled_for"]) for k, v in outcomes.items()} == {
        theirs: ("lost", None),
        unknown: ("lost", None),
    }
    assert row("outbox", theirs) == before


@pytest.mark.parametrize(
    ("errors", "reasons"),
    [(["only one"], None), (["e1", "e2"], ["only one"])],
    ids=["errors", "reasons"],
)
def test_a_failure_needs_one_error_and_reason_per_id(errors, reasons):
    ids = [uuid.uuid4(), uuid.uuid4()]
    with raises_invalid(r"one error \(and one reason and retry delay, when given\) per id"):
        fail(uuid.uuid4(), "outbox", ids, errors, reasons)


@pytest.mark.parametrize(("base", "cap"), [(-1, 300), (30, -1)])
def test_a_failure_refuses_negative_retry_seconds(base, cap):
    with raises_invalid("retry seconds >= 0"):
        fail(uuid.uuid4(), "outbox", [uuid.uuid4()], base=base, cap=cap)


# --- release_work -----------------------------------------------------------------------


def test_release_gives_the_attempt_back_and_makes_the_row_claimable_again():
    me, other = uuid.uuid4(), uuid.uuid4()
    work_id = produce("receptor")
    claim(me)
    assert release(other, "receptor", [work_id]) == {work_id: "lost"}
    assert row("receptor", work_id)["instance_id"] == me

    assert release(me, "receptor", [work_id], now=at(5)) == {work_id: "released"}
    after = row("receptor", work_id)
    assert (after["instance_id"], after["lease_expiry"], after["claimed_at"]) == (None, None, None)
    assert after["attempts"] == 0
    assert state("receptor", work_id, at(5)) == "pending"
    [again] = claim(other, at(5))
    assert (again["work_id"], again["attempts"]) == (work_id, 1)


@pytest.mark.parametrize("releaser", ["release_work", "release_leases"])
def test_releasing_a_row_clears_its_stream_owner_in_the_ledger(releaser):
    me = uuid.uuid4()
    work_id = produce("outbox", stream="user-7")
    claim(me)
    if releaser == "release_work":
        assert release(me, "outbox", [work_id]) == {work_id: "released"}
    else:
        assert action("release_leases", "outbox", [work_id], force=True) == [work_id]
    assert ledger("outbox", "user-7")["owner_instance_id"] is None


# --- maintenance ------------------------------------------------------------------------


def done_rows(category: str, done_at: list[datetime]) -> list[uuid.UUID]:
    """Rows of ``category`` claimed at T0 and completed at the given times, in order."""
    me = uuid.uuid4()
    ids = [produce(category) for _ in done_at]
    assert sorted(claimed_ids(me)) == sorted(ids)
    for work_id, when in zip(ids, done_at, strict=True):
        assert complete(me, category, [work_id], now=when) == {work_id: "done"}
    return ids


def test_purge_processed_deletes_only_rows_processed_before_the_cutoff():
    older, old, recent = done_rows("outbox", [at(10), at(20), at(30)])
    undone = produce("outbox")

    assert scalar("SELECT workpump.purge_processed('outbox', %s)", [at(25)]) == 2
    assert [exists("outbox", i) for i in (older, old, recent, undone)] == [
        False,
        False,
        True,
        True,
    ]


def test_purge_processed_deletes_at_most_one_batch_per_call():
    ids = done_rows("receptor", [at(50), at(10), at(40), at(20), at(30)])

    counts = [
        scalar("SELECT workpump.purge_processed('receptor', %s, p_batch => 2)", [at(100)])
        for _ in range(4)
    ]
    assert counts == [2, 2, 1, 0]
    assert not any(exists("receptor", i) for i in ids)


def test_purge_processed_deletes_the_oldest_batch_first():
    ids = done_rows("inbox", [at(30), at(10), at(20)])
    assert scalar("SELECT workpump.purge_processed('inbox', %s, p_batch => 2)", [at(100)]) == 2
    assert [exists("inbox", i) for i in ids] == [True, False, False]


def test_purge_processed_never_deletes_undone_rows_however_old():
    long_ago = T0 - timedelta(days=365)
    me = uuid.uuid4()
    pending = factories.OutboxFactory(created_at=long_ago).work_id
    leased = factories.OutboxFactory(created_at=long_ago).work_id
    dead = factories.OutboxFactory(created_at=long_ago).work_id
    scheduled = factories.OutboxFactory(created_at=long_ago, scheduled_for=at(3600)).work_id
    receptor = factories.ReceptorProcessingFactory(created_at=long_ago).work_id
    assert sorted(claimed_ids(me)) == sorted([pending, leased, dead, receptor])
    release(me, "outbox", [pending])
    fail(me, "outbox", [dead], now=at(1))
    action("dead_letter", "outbox", [dead], now=at(2))
    assert state("outbox", dead, at(2)) == "dead"

    for category in CATEGORIES:
        assert scalar("SELECT workpump.purge_processed(%s, 'infinity')", [category]) == 0
    assert all(exists("outbox", i) for i in (pending, leased, dead, scheduled))
    assert exists("receptor", receptor)


def test_purge_events_deletes_only_old_events_no_work_row_points_at():
    unreferenced = factories.EventFactory(created_at=at(-1000), stream="a")
    pending_work = factories.PerspectiveEventFactory(
        event=factories.EventFactory(created_at=at(-1000), stream="b")
    )
    done_work = factories.ReceptorProcessingFactory(
        event=factories.EventFactory(created_at=at(-1000), stream="c"), done_at=at(-500)
    )
    recent = factories.EventFactory(created_at=at(-10), stream="d")

    assert scalar("SELECT workpump.purge_events(%s)", [at(-100)]) == 1
    remaining = {r["event_id"] for r in run_sql("SELECT event_id FROM workpump_event")}
    assert remaining == {pending_work.event_id, done_work.event_id, recent.event_id}
    assert unreferenced.event_id not in remaining

    # once the processed receptor row is purged, its event goes too
    assert scalar("SELECT workpump.purge_processed('receptor', %s)", [at(0)]) == 1
    assert scalar("SELECT workpump.purge_events(%s)", [at(-100)]) == 1
    assert {r["event_id"] for r in run_sql("SELECT event_id FROM workpump_event")} == {
        pending_work.event_id,
        recent.event_id,
    }


def test_purge_evictions_deletes_only_tombstones_older_than_the_cutoff():
    factories.EvictionFactory(evicted_at=at(-100))
    factories.EvictionFactory(evicted_at=at(-10))
    kept = factories.EvictionFactory(evicted_at=at(0))

    assert scalar("SELECT workpump.purge_evictions(%s)", [at(-5)]) == 2
    assert [r["instance_id"] for r in run_sql("SELECT instance_id FROM workpump_eviction")] == [
        kept.instance_id
    ]


def test_purge_idle_streams_drops_only_unowned_streams_without_undone_rows():
    owner = uuid.uuid4()
    factories.ActiveStreamFactory(category="outbox", stream="idle")
    owned = factories.ActiveStreamFactory(
        category="outbox", stream="owned", owner_instance_id=owner
    )
    busy = factories.ActiveStreamFactory(category="outbox", stream="busy")
    factories.OutboxFactory(stream="busy")
    factories.ActiveStreamFactory(category="outbox", stream="finished")
    factories.OutboxFactory(stream="finished", done_at=at(1))
    scoped = factories.ActiveStreamFactory(
        category="perspective_event", scope="totals", stream="order-1"
    )
    factories.PerspectiveEventFactory(topic="totals", event__stream="order-1")
    # same stream, another perspective: its rows are not this ledger row's work
    factories.ActiveStreamFactory(category="perspective_event", scope="other", stream="order-1")

    assert scalar("SELECT workpump.purge_idle_streams()") == 3
    assert {r["id"] for r in run_sql("SELECT id FROM workpump_active_stream")} == {
        owned.id,
        busy.id,
        scoped.id,
    }


@pytest.mark.django_db(transaction=True)
def test_the_maintenance_lock_is_held_by_one_session_at_a_time(raw_connect):
    first, second = raw_connect(), raw_connect()

    def call(conn: Any, function: str) -> bool:
        return conn.execute(f"SELECT workpump.{function}() AS ok").fetchone()["ok"]

    assert call(first, "try_maintenance_lock") is True
    assert call(second, "try_maintenance_lock") is False
    assert call(first, "release_maintenance_lock") is True
    assert call(second, "try_maintenance_lock") is True
    assert call(first, "try_maintenance_lock") is False


# --- operator actions -------------------------------------------------------------------


def test_retry_now_makes_scheduled_rows_claimable_now():
    me = uuid.uuid4()
    retrying = produce("outbox")
    claim(me)
    fail(me, "outbox", [retrying], base=30, now=at(1))
    deferred = produce("outbox", scheduled_for=at(3600))
    ready = produce("outbox")
    assert claimed_ids(me, at(2)) == [ready]

    assert sorted(action("retry_now", "outbox", [retrying, deferred, ready], now=at(2))) == sorted(
        [retrying, deferred]
    )
    assert state("outbox", retrying, at(2)) == "pending"
    assert sorted(claimed_ids(me, at(2))) == sorted([retrying, deferred])


def test_release_leases_spares_a_live_holder_unless_forced():
    holder, other = uuid.uuid4(), uuid.uuid4()
    register(holder, T0)
    work_id = produce("outbox")
    claim(holder)

    assert action("release_leases", "outbox", [work_id], now=at(10)) == []
    assert row("outbox", work_id)["instance_id"] == holder

    assert action("release_leases", "outbox", [work_id], force=True, now=at(10)) == [work_id]
    after = row("outbox", work_id)
    assert (after["instance_id"], after["lease_expiry"]) == (None, None)
    assert after["failure_reason"] == "operator_released"
    assert "released by an operator" in after["last_error"]
    [again] = claim(other, at(10))
    assert (again["work_id"], again["attempts"]) == (work_id, 2)


@pytest.mark.parametrize("holder_state", ["stale", "unregistered"])
def test_release_leases_frees_rows_of_a_holder_that_is_not_live(holder_state):
    holder = uuid.uuid4()
    if holder_state == "stale":
        register(holder, T0)
    work_id = produce("perspective_event")
    claim(holder)

    # 100 s after the last heartbeat is past the default 30 s stale cutoff
    assert action("release_leases", "perspective_event", [work_id], now=at(100)) == [work_id]
    assert row("perspective_event", work_id)["instance_id"] is None
    assert claimed_ids(uuid.uuid4(), at(100)) == [work_id]


def test_dead_letter_parks_a_row_and_blocks_its_stream():
    me = uuid.uuid4()
    head = produce("outbox", stream="user-7")
    follower = produce("outbox", stream="user-7")
    claim(me)

    assert action("dead_letter", "outbox", [head], reason="poison", now=at(10)) == [head]
    after = row("outbox", head)
    assert (after["dead_lettered_at"], after["failure_reason"], after["instance_id"]) == (
        at(10),
        "poison",
        None,
    )
    assert state("outbox", head, at(10)) == "dead"
    assert claim(me, FAR_FUTURE) == []
    assert state("outbox", follower, FAR_FUTURE) == "pending"
    assert action("dead_letter", "outbox", [head], now=at(20)) == []


def test_requeue_dead_gives_fresh_attempts_and_keeps_the_last_error():
    me = uuid.uuid4()
    dead = produce("inbox", max_attempts=1)
    alive = produce("inbox")
    claim(me)
    fail(me, "inbox", [dead], ["the last straw"], now=at(10))
    release(me, "inbox", [alive])
    assert state("inbox", dead, at(10)) == "dead"

    assert action("requeue_dead", "inbox", [dead, alive], now=at(20)) == [dead]
    after = row("inbox", dead)
    assert (after["attempts"], after["dead_lettered_at"]) == (0, None)
    assert after["last_error"] == "the last straw"
    assert state("inbox", dead, at(20)) == "pending"
    assert sorted(claimed_ids(me, at(20))) == sorted([dead, alive])
    assert row("inbox", dead)["attempts"] == 1


@pytest.mark.parametrize(
    ("name", "columns", "named"),
    [
        ("retry_now", {"scheduled_for": at(100)}, {}),
        (
            "release_leases",
            {"instance_id": uuid.UUID(int=1), "lease_expiry": at(300)},
            {"force": True},
        ),
        ("dead_letter", {}, {}),
        ("requeue_dead", {"dead_lettered_at": T0}, {}),
    ],
)
def test_operator_actions_leave_done_rows_alone(name, columns, named):
    done = factories.OutboxFactory(done_at=T0, **columns)
    before = row("outbox", done.work_id)
    assert action(name, "outbox", [done.work_id], now=at(10), **named) == []
    assert row("outbox", done.work_id) == before


@pytest.mark.parametrize("name", ["retry_now", "release_leases", "dead_letter", "requeue_dead"])
def test_operator_actions_refuse_a_null_id(name):
    with raises_invalid(f"{name} got a NULL work id"):
        action(name, "outbox", [None])


# --- state_of ---------------------------------------------------------------------------


def _pending() -> tuple[uuid.UUID, datetime]:
    return produce("outbox"), T0


def _scheduled() -> tuple[uuid.UUID, datetime]:
    return produce("outbox", scheduled_for=at(60)), T0


def _leased() -> tuple[uuid.UUID, datetime]:
    work_id = produce("outbox")
    claim(uuid.uuid4(), lease_seconds=300)
    return work_id, at(299)


def _orphaned_by_expiry() -> tuple[uuid.UUID, datetime]:
    work_id = produce("outbox")
    claim(uuid.uuid4(), lease_seconds=300)
    return work_id, at(301)


def _orphaned_by_eviction() -> tuple[uuid.UUID, datetime]:
    holder = uuid.uuid4()
    register(holder, T0)
    work_id = produce("outbox")
    claim(holder, lease_seconds=300)
    evicted = run_sql(
        "SELECT * FROM workpump.cleanup_stale_instances(%s, p_now => %s)", [at(70), at(100)]
    )
    assert [r["instance_id"] for r in evicted] == [holder]
    after = row("outbox", work_id)
    assert after["instance_id"] is None
    assert after["claimed_at"] == T0
    return work_id, at(100)


def _done() -> tuple[uuid.UUID, datetime]:
    me = uuid.uuid4()
    work_id = produce("outbox")
    claim(me)
    complete(me, "outbox", [work_id], now=at(5))
    return work_id, at(5)


def _dead() -> tuple[uuid.UUID, datetime]:
    me = uuid.uuid4()
    work_id = produce("outbox", max_attempts=1)
    claim(me)
    fail(me, "outbox", [work_id], now=at(5))
    return work_id, at(5)


@pytest.mark.parametrize(
    ("make", "expected"),
    [
        (_pending, "pending"),
        (_scheduled, "scheduled"),
        (_leased, "leased"),
        (_orphaned_by_expiry, "orphaned"),
        (_orphaned_by_eviction, "orphaned"),
        (_done, "done"),
        (_dead, "dead"),
    ],
    ids=lambda v: v.__name__.strip("_") if callable(v) else None,
)
def test_state_of_names_the_state_of_a_real_row(
    make: Callable[[], tuple[uuid.UUID, datetime]], expected: str
):
    work_id, now = make()
    assert state("outbox", work_id, now) == expected


def test_state_of_agrees_with_the_claim_at_the_instant_a_lease_expires():
    work_id = produce("outbox")
    claim(uuid.uuid4(), lease_seconds=300)
    with transaction.atomic():
        assert claimed_ids(uuid.uuid4(), at(300)) == [work_id]  # the claim takes it over...
        transaction.set_rollback(True)
    assert state("outbox", work_id, at(300)) == "orphaned"  # ...so it is no longer leased
