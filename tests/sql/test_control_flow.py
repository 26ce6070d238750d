"""Snooze, Discard, a handler's own retry delays and cancellation in SQL.

snooze_work, discard_work, fail_work's p_retry_delays, cancel_work and renew_leases'
'cancelled' answer, on real rows produced and claimed through the SQL API, with the
clock pinned by p_now.
"""

from __future__ import annotations

import json
import uuid
from datetime import datetime
from typing import Any

import psycopg
import pytest
from django.db import DataError, transaction

from tests.helpers import T0, at, conninfo, run_sql, scalar
from tests.sql.test_outcomes import CATEGORIES, TABLES, claim, claimed_ids, produce, row

pytestmark = pytest.mark.django_db


def token_of(category: str, work_id: uuid.UUID) -> uuid.UUID:
    return row(category, work_id)["lease_token"]  # type: ignore[no-any-return]


def snooze(
    category: str,
    work_id: uuid.UUID,
    instance: uuid.UUID,
    seconds: float,
    *,
    now: datetime,
    max_snoozes: int = 25,
    token: uuid.UUID | None = None,
) -> dict[str, Any]:
    (result,) = run_sql(
        "SELECT * FROM workpump.snooze_work(%s, %s, %s::uuid[], %s::uuid[],"
        " %s::double precision[], %s, %s)",
        [
            instance,
            category,
            [work_id],
            [token or token_of(category, work_id)],
            [seconds],
            max_snoozes,
            now,
        ],
    )
    return result


def discard(
    category: str,
    work_id: uuid.UUID,
    instance: uuid.UUID,
    reason: str,
    *,
    now: datetime,
    token: uuid.UUID | None = None,
) -> str:
    return scalar(  # type: ignore[no-any-return]
        "SELECT status FROM workpump.discard_work(%s, %s, %s::uuid[], %s::uuid[], %s::text[],"
        " p_now => %s)",
        [instance, category, [work_id], [token or token_of(category, work_id)], [reason], now],
    )


def complete(category: str, work_id: uuid.UUID, instance: uuid.UUID, token: uuid.UUID) -> str:
    return scalar(  # type: ignore[no-any-return]
        "SELECT status FROM workpump.complete_work(%s, %s, %s::uuid[], %s::uuid[],"
        " ARRAY['{\"late\": true}'::jsonb])",
        [instance, category, [work_id], [token]],
    )


def fail(
    category: str,
    work_id: uuid.UUID,
    instance: uuid.UUID,
    token: uuid.UUID,
    *,
    now: datetime = T0,
    delay: float | None = None,
) -> dict[str, Any]:
    (result,) = run_sql(
        "SELECT * FROM workpump.fail_work(%s, %s, %s::uuid[], %s::uuid[], ARRAY['boom'],"
        " p_now => %s, p_retry_delays => %s::double precision[])",
        [instance, category, [work_id], [token], now, None if delay is None else [delay]],
    )
    return result


def cancel(category: str, ids: list[uuid.UUID], now: datetime = T0) -> list[dict[str, Any]]:
    return run_sql("SELECT * FROM workpump.cancel_work(%s, %s::uuid[], %s)", [category, ids, now])


def state(category: str, work_id: uuid.UUID, now: datetime) -> str:
    table, key, done = TABLES[category]
    return scalar(  # type: ignore[no-any-return]
        f"SELECT workpump.state_of({done}, dead_lettered_at, instance_id, lease_expiry,"
        f" claimed_at, scheduled_for, end_state, %s) FROM {table} WHERE {key} = %s",
        [now, work_id],
    )


# --- Snooze ----------------------------------------------------------------------------


@pytest.mark.parametrize("category", CATEGORIES)
def test_a_snooze_spends_no_attempt_and_keeps_the_stream_waiting(category):
    me = uuid.uuid4()
    first = produce(category, stream="s-1")
    second = produce(category, stream="s-1")
    assert claimed_ids(me) == [first]
    assert row(category, first)["attempts"] == 1

    result = snooze(category, first, me, 60, now=at(10))

    assert (result["status"], result["scheduled_for"]) == ("snoozed", at(70))
    after = row(category, first)
    assert (after["attempts"], after["snoozes"], after["stream_head"]) == (0, 1, True)
    assert (after["instance_id"], after["lease_token"], after["done_at"]) == (None, None, None)
    assert state(category, first, at(11)) == "scheduled"
    # the stream waits for its snoozed head: nothing is claimable before it is due
    assert claimed_ids(me, at(20)) == []
    # due again: the same head, with the attempt it never spent
    assert [r["work_id"] for r in claim(me, at(71))] == [first]
    assert row(category, first)["attempts"] == 1
    assert complete(category, first, me, token_of(category, first)) == "done"
    assert claimed_ids(me, at(72)) == [second]


def test_a_snooze_of_zero_seconds_is_claimable_at_once():
    me = uuid.uuid4()
    work_id = produce("outbox")
    claimed_ids(me)

    result = snooze("outbox", work_id, me, 0, now=at(5))

    assert (result["status"], result["scheduled_for"]) == ("snoozed", None)
    assert claimed_ids(me, at(5)) == [work_id]


def test_the_snooze_after_the_maximum_counts_as_a_failed_attempt():
    me = uuid.uuid4()
    work_id = produce("outbox", max_attempts=10)
    now = T0
    for _ in range(2):
        assert claimed_ids(me, now) == [work_id]
        assert snooze("outbox", work_id, me, 1, now=now, max_snoozes=2)["status"] == "snoozed"
        now = at((now - T0).total_seconds() + 2)
    assert claimed_ids(me, now) == [work_id]

    result = snooze("outbox", work_id, me, 30, now=now, max_snoozes=2)

    assert result["status"] == "retry"
    after = row("outbox", work_id)
    assert (after["attempts"], after["snoozes"], after["failure_reason"]) == (1, 2, "max_snoozes")
    assert "snoozed 2 times, the maximum (MAX_SNOOZES)" in after["last_error"]
    assert after["scheduled_for"] == result["scheduled_for"]


def test_over_the_maximum_on_the_last_attempt_the_row_is_dead():
    me = uuid.uuid4()
    work_id = produce("outbox", max_attempts=1)
    claimed_ids(me)

    result = snooze("outbox", work_id, me, 30, now=at(1), max_snoozes=0)

    assert result["status"] == "dead"
    after = row("outbox", work_id)
    assert (after["failure_reason"], after["dead_lettered_at"]) == ("max_attempts", at(1))


def test_a_snooze_is_fenced_by_instance_and_lease_token():
    me, other = uuid.uuid4(), uuid.uuid4()
    work_id = produce("outbox")
    claimed_ids(me)
    token = token_of("outbox", work_id)

    assert snooze("outbox", work_id, other, 10, now=at(1), token=token)["status"] == "lost"
    assert snooze("outbox", work_id, me, 10, now=at(1), token=uuid.uuid4())["status"] == "lost"
    assert row("outbox", work_id)["instance_id"] == me
    assert row("outbox", work_id)["snoozes"] == 0


@pytest.mark.parametrize("seconds", [-1.0, float("inf"), float("nan")])
def test_a_negative_or_infinite_snooze_is_refused(seconds):
    me = uuid.uuid4()
    work_id = produce("outbox")
    claimed_ids(me)

    with pytest.raises(DataError, match="p_seconds of finite seconds >= 0"), transaction.atomic():
        snooze("outbox", work_id, me, seconds, now=at(1))


# --- Discard ---------------------------------------------------------------------------


@pytest.mark.parametrize("category", CATEGORIES)
def test_a_discard_ends_the_row_and_unblocks_its_stream(category):
    me = uuid.uuid4()
    first = produce(category, stream="s-2")
    second = produce(category, stream="s-2")
    assert claimed_ids(me) == [first]

    assert discard(category, first, me, "customer closed the account", now=at(3)) == "discarded"

    after = row(category, first)
    assert (after["done_at"], after["end_state"]) == (at(3), "discarded")
    assert (after["failure_reason"], after["last_error"]) == (
        "discarded",
        "customer closed the account",
    )
    assert (after["instance_id"], after["lease_token"]) == (None, None)
    assert state(category, first, at(4)) == "discarded"
    assert claimed_ids(me, at(4)) == [second]


def test_a_discard_is_fenced_by_instance_and_lease_token():
    me, other = uuid.uuid4(), uuid.uuid4()
    work_id = produce("outbox")
    claimed_ids(me)
    token = token_of("outbox", work_id)

    assert discard("outbox", work_id, other, "no", now=at(1), token=token) == "lost"
    assert discard("outbox", work_id, me, "no", now=at(1), token=uuid.uuid4()) == "lost"
    assert row("outbox", work_id)["end_state"] is None


def test_a_discarded_row_frees_its_unique_key():
    me = uuid.uuid4()
    first = scalar("SELECT workpump.send('reports.daily', '{}'::jsonb, p_unique_key => 'k')")
    claimed_ids(me)
    discard("outbox", first, me, "not needed", now=at(1))

    second = scalar("SELECT workpump.send('reports.daily', '{}'::jsonb, p_unique_key => 'k')")

    assert second != first


# --- a handler's own retry delay -----------------------------------------------------------


def test_fail_work_schedules_the_retry_after_the_given_delay():
    me = uuid.uuid4()
    work_id = produce("outbox")
    claimed_ids(me)

    result = fail("outbox", work_id, me, token_of("outbox", work_id), now=at(1), delay=7.5)

    assert (result["status"], result["scheduled_for"]) == ("retry", at(8.5))


def test_a_delay_of_zero_retries_at_once_and_none_keeps_the_default_backoff():
    me = uuid.uuid4()
    now_id, default_id = produce("outbox"), produce("outbox")
    claimed_ids(me)

    assert fail("outbox", now_id, me, token_of("outbox", now_id), delay=0)["scheduled_for"] is None
    default = fail("outbox", default_id, me, token_of("outbox", default_id), now=T0)
    # attempt 1 at the default base of 30 s, plus up to 10 % jitter
    assert at(30) <= default["scheduled_for"] <= at(33)


def test_a_negative_retry_delay_is_refused():
    me = uuid.uuid4()
    work_id = produce("outbox")
    claimed_ids(me)

    with pytest.raises(DataError, match="p_retry_delays of finite seconds"), transaction.atomic():
        fail("outbox", work_id, me, token_of("outbox", work_id), delay=-3)


# --- cancel_work -----------------------------------------------------------------------


@pytest.mark.parametrize("category", ["outbox", "inbox"])
def test_cancelled_pending_and_scheduled_rows_never_run(category):
    me = uuid.uuid4()
    pending = produce(category)
    scheduled = produce(category, scheduled_for=at(60))

    cancelled = cancel(category, [pending, scheduled], now=at(1))

    assert {(r["work_id"], r["holder"]) for r in cancelled} == {
        (pending, None),
        (scheduled, None),
    }
    for work_id in (pending, scheduled):
        after = row(category, work_id)
        assert (after["done_at"], after["end_state"]) == (at(1), "cancelled")
        assert state(category, work_id, at(2)) == "cancelled"
    assert claimed_ids(me, at(3600)) == []


@pytest.mark.parametrize("category", CATEGORIES)
def test_a_cancelled_running_attempt_is_fenced_and_its_stream_moves_on(category):
    me, peer = uuid.uuid4(), uuid.uuid4()
    first = produce(category, stream="s-3")
    second = produce(category, stream="s-3")
    assert claimed_ids(me) == [first]
    token = token_of(category, first)

    assert cancel(category, [first], now=at(5)) == [{"work_id": first, "holder": me}]

    # the attempt's late outcomes change nothing
    assert complete(category, first, me, token) == "lost"
    assert fail(category, first, me, token, now=at(6))["status"] == "lost"
    after = row(category, first)
    assert (after["end_state"], after["done_at"], after["result"]) == ("cancelled", at(5), None)
    assert after["lease_token"] == token  # kept: it names the cancelled attempt
    # its renewal says so, with no new expiry
    renewed = run_sql(
        "SELECT * FROM workpump.renew_leases(%s, %s::uuid[], %s::uuid[], 300, %s, %s)",
        [category, [first], [token], me, at(7)],
    )
    assert renewed == [{"work_id": first, "lease_expiry": None, "status": "cancelled"}]
    # another attempt's token is not told anything
    assert (
        run_sql(
            "SELECT * FROM workpump.renew_leases(%s, %s::uuid[], %s::uuid[], 300, %s, %s)",
            [category, [first], [uuid.uuid4()], me, at(7)],
        )
        == []
    )
    # the stream moves on, to any instance
    assert claimed_ids(peer, at(8)) == [second]


def test_cancel_leaves_ended_rows_and_unknown_ids_alone():
    me = uuid.uuid4()
    done = produce("outbox")
    claimed_ids(me)
    complete("outbox", done, me, token_of("outbox", done))
    dead = produce("outbox", max_attempts=1)
    run_sql(
        "SELECT workpump.dead_letter('outbox', %s::uuid[], 'parked')",
        [[dead]],
    )

    cancelled = cancel("outbox", [done, dead, uuid.uuid4()], now=at(2))

    # a dead row can be cancelled (ending it unblocks its stream); a done one cannot
    assert cancelled == [{"work_id": dead, "holder": None}]
    assert row("outbox", done)["end_state"] is None
    assert cancel("outbox", [dead], now=at(3)) == []  # once


def test_cancel_refuses_a_bad_category():
    with pytest.raises(DataError, match="Unknown workpump category"), transaction.atomic():
        cancel("mailbox", [uuid.uuid4()])


@pytest.mark.django_db(transaction=True)
def test_cancel_notifies_the_holder_on_commit():
    me = uuid.uuid4()
    with psycopg.connect(conninfo(), autocommit=True) as listener:
        listener.execute("LISTEN workpump_cancel")
        with transaction.atomic():
            work_ids = [produce("outbox") for _ in range(3)]
            claimed_ids(me)
        tokens = {work_id: token_of("outbox", work_id) for work_id in work_ids}
        with transaction.atomic():
            cancel("outbox", work_ids[:2])
            assert list(listener.notifies(timeout=0.2)) == []  # not before the commit

        (notify,) = list(listener.notifies(timeout=5, stop_after=1))

    message = json.loads(notify.payload)
    assert (message["instance"], message["category"]) == (str(me), "outbox")
    assert sorted(message["work"]) == sorted(
        [str(work_id), str(tokens[work_id])] for work_id in work_ids[:2]
    )
