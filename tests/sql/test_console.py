"""The console's time series on real PostgreSQL: the counting trigger counts what the
claim and outcome functions did, per instance, once; the sampler takes a minute once;
the purge removes old minutes.

Each test runs in its own transaction (rolled back), so the counters it reads are its own.
"""

from __future__ import annotations

import uuid
from collections import Counter
from datetime import datetime, timedelta
from typing import Any

import pytest
from django.db import transaction

from django_workpump.db import console as series
from django_workpump.sql import named_queries
from tests.factories import OutboxFactory, ServiceInstanceFactory
from tests.helpers import T0, current_tokens, enroll, run_sql, scalar

pytestmark = pytest.mark.django_db

TOPIC = "console.mail"
A = uuid.UUID("00000000-0000-0000-0000-00000000000a")
B = uuid.UUID("00000000-0000-0000-0000-00000000000b")
C = uuid.UUID("00000000-0000-0000-0000-00000000000c")


def claim(instance: uuid.UUID, now, limit: int = 50) -> list[uuid.UUID]:
    enroll(instance, now)
    rows = run_sql(
        "SELECT * FROM workpump.claim_work(p_instance_id => %s, p_max_rows => %s, p_now => %s)",
        [instance, limit, now],
    )
    return [r["work_id"] for r in rows if r["lease_token"] is not None]


def complete(instance: uuid.UUID, ids: list[uuid.UUID], now) -> None:
    run_sql(
        "SELECT * FROM workpump.complete_work(%s, 'outbox', %s::uuid[], %s::uuid[], NULL,"
        " p_now => %s)",
        [instance, ids, current_tokens("outbox", ids), now],
    )


def fail(instance: uuid.UUID, ids: list[uuid.UUID], now) -> list[str]:
    rows = run_sql(
        "SELECT * FROM workpump.fail_work(%s, 'outbox', %s::uuid[], %s::uuid[], %s::text[],"
        " NULL, 0, 0, NULL, p_now => %s)",
        [instance, ids, current_tokens("outbox", ids), ["boom"] * len(ids), now],
    )
    return [r["status"] for r in rows]


def counts(**where: Any) -> dict[str, int]:
    """Counter totals per outcome for TOPIC (optionally one instance or minute)."""
    clauses = ["topic = %(topic)s"] + [f"{k} = %({k})s" for k in where]
    rows = run_sql(
        "SELECT outcome, sum(n)::bigint AS n FROM workpump_console_count"
        f" WHERE {' AND '.join(clauses)} GROUP BY outcome",
        {"topic": TOPIC, **where},
    )
    return {r["outcome"]: r["n"] for r in rows}


def make(n: int, **fields: Any) -> list[uuid.UUID]:
    fields = {"topic": TOPIC, "created_at": T0 - timedelta(seconds=10), **fields}
    return [OutboxFactory(**fields).work_id for _ in range(n)]


def test_counters_equal_what_the_claims_and_outcomes_did_per_instance():
    ids = make(5, max_attempts=2)
    first = claim(A, T0)
    assert sorted(first) == sorted(ids)
    complete(A, first[:2], T0 + timedelta(seconds=1))
    assert fail(A, first[2:], T0 + timedelta(seconds=1)) == ["retry"] * 3

    again = claim(B, T0 + timedelta(seconds=61))
    assert sorted(again) == sorted(first[2:])
    assert fail(B, again[:1], T0 + timedelta(seconds=62)) == ["dead"]
    complete(B, again[1:2], T0 + timedelta(seconds=62))
    run_sql(
        "SELECT * FROM workpump.release_work(%s, 'outbox', %s::uuid[], %s::uuid[], %s)",
        [B, again[2:], current_tokens("outbox", again[2:]), T0 + timedelta(seconds=62)],
    )

    assert counts() == {"claimed": 8, "done": 3, "failed": 3, "dead": 1, "released": 1}
    assert counts(instance_id=A) == {"claimed": 5, "done": 2, "failed": 3}
    assert counts(instance_id=B) == {"claimed": 3, "done": 1, "dead": 1, "released": 1}
    # completions count at the row's own time (p_now here), failures and releases at
    # now(); a claim counts when its attempt ends, at claimed_at, unless the attempt
    # ended in a later 10-minute bucket (now() is long after T0): then at that bucket
    assert counts(minute=T0) == {"claimed": 2, "done": 2}
    assert counts(minute=T0 + timedelta(minutes=1)) == {"claimed": 2, "done": 1, "dead": 1}
    # the first claims waited 10 s from creation; bucket i holds [bounds[i-1], bounds[i])
    bounds = scalar("SELECT workpump.console_latency_bounds()")
    (histogram,) = [
        r["latency"]
        for r in run_sql(
            "SELECT latency FROM workpump_console_count"
            " WHERE topic = %s AND outcome = 'claimed' AND minute = %s",
            [TOPIC, T0],
        )
    ]
    assert len(histogram) == len(bounds) + 1
    assert histogram[bounds.index(10) + 1] == 2 and sum(histogram) == 2  # [10, 30)


def test_a_claim_counts_when_its_attempt_ends_with_its_holder_and_pickup_latency():
    make(2)  # due 10 s before the claim
    claimed = claim(A, T0)
    # the claim statement itself counts nothing: the pickup path pays no counting
    assert scalar("SELECT count(*) FROM workpump_console_count") == 0
    complete(A, claimed[:1], T0 + timedelta(seconds=3))
    assert counts() == {"claimed": 1, "done": 1}
    (histogram,) = [
        r["latency"]
        for r in run_sql(
            "SELECT latency FROM workpump_console_count WHERE outcome = 'claimed' AND minute = %s",
            [T0],
        )
    ]
    bounds = scalar("SELECT workpump.console_latency_bounds()")
    assert histogram[bounds.index(10) + 1] == 1 and sum(histogram) == 1  # waited [10, 30) s
    # the row keeps when its last claim's wait began, beside claimed_at
    (row,) = run_sql(
        "SELECT claimed_at, claim_due_at FROM workpump_outbox WHERE work_id = %s", [claimed[1]]
    )
    assert row["claimed_at"] - row["claim_due_at"] == timedelta(seconds=10)


def test_a_lease_taken_over_counts_the_old_attempts_claim_with_its_expiry():
    make(1)
    claim(A, T0)
    assert claim(B, T0 + timedelta(hours=1))  # A's 300 s lease ran out long ago
    assert counts(instance_id=A) == {"claimed": 1, "expired": 1}
    assert counts(instance_id=B) == {}  # B's attempt is still running


def test_an_attempt_ending_in_a_later_bucket_counts_its_claim_in_that_bucket():
    make(2)
    claimed = claim(A, T0 + timedelta(minutes=9))
    complete(A, claimed[:1], T0 + timedelta(minutes=9, seconds=10))
    # the sampler folds 12:00-12:10 while the second attempt still runs
    assert scalar("SELECT workpump.console_sample(p_now => %s)", [T0 + timedelta(minutes=12)])
    assert scalar("SELECT folded_until FROM workpump_console_sample") == T0 + timedelta(minutes=10)
    complete(A, claimed[1:], T0 + timedelta(minutes=13))
    claims = {
        r["minute"]: r["n"]
        for r in run_sql(
            "SELECT minute, n FROM workpump_console_count WHERE outcome = 'claimed' ORDER BY 1"
        )
    }
    # the first claim at its own minute (folded), the second at the first unfolded one
    assert claims == {T0 + timedelta(minutes=9): 1, T0 + timedelta(minutes=10): 1}
    by_bucket = binned(10, T0, T0 + timedelta(minutes=19))
    assert by_bucket[T0, TOPIC, "claimed"] == 1
    assert by_bucket[T0 + timedelta(minutes=10), TOPIC, "claimed"] == 1


def test_counting_a_flush_calls_no_function_per_row():
    # console_finite is inlined where it is given a column; given an expression it was
    # called once per row, which cost 1.7 ms of a 100-row completion
    make(20)
    claimed = claim(A, T0)
    run_sql("SET LOCAL track_functions = 'all'")

    def console_calls() -> dict[str, int]:
        rows = run_sql(
            "SELECT funcname, calls FROM pg_stat_xact_user_functions"
            " WHERE schemaname = 'workpump' AND funcname LIKE 'console%%'"
        )
        return {r["funcname"]: r["calls"] for r in rows}

    # PostgreSQL 15 shows earlier transactions' unflushed counts here too: the difference
    before = console_calls()
    complete(A, claimed, T0 + timedelta(seconds=1))
    calls = {f: n - before.get(f, 0) for f, n in console_calls().items()}
    assert counts() == {"claimed": 20, "done": 20}
    # the trigger once for the statement; the bounds, a constant, once per plan
    assert calls.get("console_count_changes") == 1
    assert calls.get("console_finite", 0) == 0
    assert calls.get("console_latency_bounds", 0) <= 1


def summed(rows: list[dict[str, Any]]) -> dict[tuple[Any, ...], dict[str, Any]]:
    """Counter rows summed per (minute, outcome, instance), histograms bucket by bucket."""
    sums: dict[tuple[Any, ...], dict[str, Any]] = {}
    for row in rows:
        key = (row["minute"], row["outcome"], row["instance_id"])
        one = sums.setdefault(key, {"n": 0, "latency": None})
        one["n"] += row["n"]
        if row["latency"] is not None:
            before = one["latency"] or [0] * len(row["latency"])
            one["latency"] = [a + b for a, b in zip(before, row["latency"], strict=True)]
    return sums


def stored_counts() -> list[dict[str, Any]]:
    return run_sql("SELECT minute, outcome, instance_id, n, latency FROM workpump_console_count")


def test_the_totals_are_the_counts_summed_over_topics_histograms_too():
    make(3)
    make(2, topic="console.sms")
    make(1, topic="console.sms", created_at=T0 - timedelta(seconds=200))  # a slower pickup
    claimed = claim(A, T0)
    complete(A, claimed[:4], T0 + timedelta(seconds=1))
    fail(A, claimed[4:], T0 + timedelta(seconds=1))
    complete(B, claim(B, T0 + timedelta(seconds=61)), T0 + timedelta(seconds=62))
    per_topic = summed(stored_counts())

    def totals() -> dict[tuple[Any, ...], dict[str, Any]]:
        return summed(run_sql("SELECT * FROM workpump.console_totals('-infinity', 'infinity')"))

    # before a fold the totals are read from the counters; the fold stores those of whole
    # buckets (12:00 to 12:10 here: failures count at the database's own minute, later)
    assert totals() == per_topic
    assert scalar("SELECT count(*) FROM workpump_console_total") == 0
    assert scalar("SELECT workpump.console_sample(p_now => %s)", [T0 + timedelta(minutes=20)])
    stored = run_sql("SELECT minute, outcome, instance_id, n, latency FROM workpump_console_total")
    folded = {k: v for k, v in per_topic.items() if k[0] < T0 + timedelta(minutes=10)}
    assert summed(stored) == folded and len(stored) == len(folded) == 4
    assert totals() == per_topic  # the folded totals, and the counters after them
    # over every minute (the claims of A's failed attempts count at their failure's bucket)
    overall = summed([{**r, "minute": None} for r in stored_counts()])
    assert {(k[1], k[2]): v["n"] for k, v in overall.items()} == {
        ("claimed", A): 6,
        ("done", A): 4,
        ("failed", A): 2,
        ("claimed", B): 2,
        ("done", B): 2,
    }
    (claims_of_a,) = [v["latency"] for k, v in overall.items() if k[1:] == ("claimed", A)]
    assert sum(claims_of_a) == 6 and claims_of_a[-2] == 1  # one waited [60, 300) s
    # an instance's totals alone
    mine = run_sql("SELECT * FROM workpump.console_totals('-infinity', 'infinity', %s)", [B])
    assert {(r["outcome"], r["n"]) for r in mine} == {("claimed", 2), ("done", 2)}


def test_counts_add_up_across_statements_of_the_same_minute():
    ids = make(4)
    claimed = claim(A, T0)
    for one in claimed:
        complete(A, [one], T0 + timedelta(seconds=2))
    assert counts(instance_id=A) == {"claimed": 4, "done": 4}
    assert (
        scalar(
            "SELECT count(*) FROM workpump_console_count WHERE topic = %s AND outcome = 'done'",
            [TOPIC],
        )
        == 1
    )
    assert len(ids) == 4


def test_a_rolled_back_outcome_counts_nothing_and_a_lost_one_is_not_counted():
    ids = make(2)
    claimed = claim(A, T0)
    tokens = current_tokens("outbox", claimed)
    with pytest.raises(RuntimeError), transaction.atomic():
        complete(A, claimed, T0 + timedelta(seconds=1))
        assert counts()["done"] == 2
        raise RuntimeError("roll back")
    assert "done" not in counts()
    complete(A, claimed, T0 + timedelta(seconds=1))
    # a late second outcome of the same attempt is lost: it changes no row, counts nothing
    run_sql(
        "SELECT * FROM workpump.complete_work(%s, 'outbox', %s::uuid[], %s::uuid[], NULL,"
        " p_now => %s)",
        [A, claimed, tokens, T0 + timedelta(seconds=2)],
    )
    assert counts()["done"] == 2 == len(ids)


def test_an_evicted_holders_attempts_count_as_orphaned_and_renewals_count():
    make(3)
    claimed = claim(A, T0)
    run_sql(
        "SELECT * FROM workpump.renew_leases('outbox', %s::uuid[], %s::uuid[], 300, %s, %s)",
        [claimed, current_tokens("outbox", claimed), A, T0 + timedelta(seconds=5)],
    )
    run_sql("SELECT workpump.evict_instance(%s, 'test', %s)", [A, T0 + timedelta(seconds=6)])
    assert counts(instance_id=A) == {"claimed": 3, "renewed": 3, "orphaned": 3}


def test_counting_can_be_switched_off_and_on():
    make(2)
    claimed = claim(A, T0)
    assert scalar("SELECT workpump.console_counting(false)") is False
    complete(A, claimed[:1], T0)
    assert "done" not in counts()
    assert scalar("SELECT workpump.console_counting(true)") is True
    complete(A, claimed[1:], T0)
    assert counts()["done"] == 1


def test_the_sampler_takes_each_minute_once_with_backlog_and_instances():
    make(3)  # pending since T0 - 10 s
    make(2, scheduled_for=T0 + timedelta(hours=1))
    enroll(A, T0 - timedelta(seconds=4))
    leased = claim(A, T0 - timedelta(seconds=4), limit=1)
    assert len(leased) == 1
    now = T0 + timedelta(seconds=20)
    assert scalar("SELECT workpump.console_sample(p_now => %s)", [now]) is True
    assert (
        scalar("SELECT workpump.console_sample(p_now => %s)", [now + timedelta(seconds=30)])
        is False
    )
    (backlog,) = run_sql(
        "SELECT * FROM workpump_console_backlog WHERE topic = %s AND minute = %s", [TOPIC, T0]
    )
    assert (backlog["pending"], backlog["scheduled"], backlog["leased"]) == (2, 2, 1)
    assert backlog["oldest_pending_seconds"] == pytest.approx(30)
    (instance,) = run_sql(
        "SELECT * FROM workpump_console_instance WHERE instance_id = %s AND minute = %s",
        [A, T0],
    )
    assert instance["in_flight"] == 1
    assert instance["heartbeat_age_seconds"] == pytest.approx(24)
    assert (
        scalar("SELECT workpump.console_sample(p_now => %s)", [now + timedelta(seconds=60)]) is True
    )


def test_the_sampler_counts_each_undone_row_once_without_reading_the_done_ones():
    # a table keeps its done rows for days: the backlog is read from the partial indexes
    # of its undone rows (a ready, a scheduled, a leased, a flow-controlled row, a stream's
    # head and the rows behind it), never by reading every row of the table
    enroll(A, T0)
    make(1, topic="console.held")
    assert len(claim(A, T0, limit=1)) == 1
    make(2, topic="console.plain")
    make(1, topic="console.plain", done_at=T0 - timedelta(seconds=5))
    make(1, topic="console.plain", dead_lettered_at=T0 - timedelta(seconds=5))
    make(1, topic="console.later", scheduled_for=T0 + timedelta(hours=1))
    make(2, topic="console.fair", fairness_key="tenant:1")
    make(3, topic="console.ordered", stream="order-7")
    tables = (
        "workpump_outbox",
        "workpump_inbox",
        "workpump_perspective_event",
        "workpump_receptor_processing",
    )

    def seq_scans() -> int:
        return scalar(
            "SELECT sum(seq_scan) FROM pg_stat_xact_user_tables WHERE relname = ANY (%s)",
            [list(tables)],
        )

    run_sql("SET LOCAL enable_seqscan = off")  # a scan it could avoid is counted below
    before = seq_scans()
    assert scalar("SELECT workpump.console_sample(p_now => %s)", [T0 + timedelta(seconds=1)])
    assert seq_scans() == before
    backlog = {
        r["topic"]: (r["pending"], r["scheduled"], r["leased"])
        for r in run_sql("SELECT * FROM workpump_console_backlog WHERE minute = %s", [T0])
    }
    assert backlog == {
        "console.held": (0, 0, 1),
        "console.plain": (2, 0, 0),
        "console.later": (0, 1, 0),
        "console.fair": (2, 0, 0),
        "console.ordered": (3, 0, 0),
    }


def test_an_idle_pump_samples_nothing_until_something_changes():
    def sample(minutes: int, beating: bool = True) -> bool:
        at = T0 + timedelta(minutes=minutes)
        if beating:  # the instances beat 5 s before
            run_sql(
                "UPDATE workpump_service_instance SET last_heartbeat_at = %s",
                [at - timedelta(seconds=5)],
            )
        return scalar("SELECT workpump.console_sample(p_now => %s)", [at])

    def written() -> int:
        return scalar(
            "SELECT (SELECT count(*) FROM workpump_console_sample)"
            " + (SELECT count(*) FROM workpump_console_instance)"
            " + (SELECT count(*) FROM workpump_console_backlog)"
        )

    ServiceInstanceFactory(instance_id=A, last_heartbeat_at=T0)
    assert sample(0)  # the first sample
    before = written()
    # an hour on: no row undone, nothing counted, the same instance alive: no write
    assert not sample(60)
    assert written() == before

    # each change is sampled: a new instance, a row waiting, then its backlog gone
    ServiceInstanceFactory(instance_id=B, last_heartbeat_at=T0)
    assert sample(61)
    assert not sample(62)
    (row,) = make(1, created_at=T0 + timedelta(minutes=62))
    assert sample(63)
    run_sql("UPDATE workpump_outbox SET done_at = %s WHERE work_id = %s", [T0, row])
    assert sample(64)  # its last sample had a backlog
    assert not sample(65)
    # the instances stopped beating: no longer alive, sampled once
    assert sample(66, beating=False)
    alive = run_sql(
        "SELECT instance_id, alive FROM workpump_console_instance WHERE minute = %s",
        [T0 + timedelta(minutes=66)],
    )
    assert {r["instance_id"]: r["alive"] for r in alive} == {A: False, B: False}
    assert not sample(67, beating=False)
    # counters not folded yet: sampled (the fold must run) until they are
    counter(T0 + timedelta(minutes=67), "done", A, 1)
    assert sample(68)
    assert sample(79)  # folds 12:60-12:70
    assert not sample(80)


@pytest.mark.django_db(transaction=True)
def test_the_sampler_counts_a_slow_beater_holding_its_alive_lock_as_alive(raw_connect):
    # A beat 90 s ago but holds its alive-lock (it beats only every slow interval), B beat
    # 90 s ago with no lock, C beat 5 s ago: by the liveness rule A and C are alive
    now = T0 + timedelta(minutes=1)
    ServiceInstanceFactory(instance_id=A, last_heartbeat_at=now - timedelta(seconds=90))
    ServiceInstanceFactory(instance_id=B, last_heartbeat_at=now - timedelta(seconds=90))
    ServiceInstanceFactory(instance_id=C, last_heartbeat_at=now - timedelta(seconds=5))
    holder = raw_connect()
    assert holder.execute("SELECT workpump.take_alive_lock(%s) AS ok", [A]).fetchone()["ok"]

    assert scalar(
        "SELECT workpump.console_sample(p_stale_after_seconds => 30,"
        " p_definitively_dead_after_seconds => 300, p_now => %s)",
        [now],
    )
    sampled = run_sql("SELECT instance_id, alive FROM workpump_console_instance")
    assert {r["instance_id"]: r["alive"] for r in sampled} == {A: True, B: False, C: True}
    # past the definitive cutoff a held lock no longer keeps it alive
    later = now + timedelta(minutes=5)
    run_sql("UPDATE workpump_service_instance SET last_heartbeat_at = %s WHERE instance_id = %s",
            [later - timedelta(seconds=5), C])  # fmt: skip
    assert scalar(
        "SELECT workpump.console_sample(p_stale_after_seconds => 30,"
        " p_definitively_dead_after_seconds => 300, p_now => %s)",
        [later],
    )
    sampled = run_sql(
        "SELECT instance_id, alive FROM workpump_console_instance WHERE minute = %s",
        [date_trunc_minute(later)],
    )
    assert {r["instance_id"]: r["alive"] for r in sampled} == {A: False, B: False, C: True}


def date_trunc_minute(at: datetime) -> datetime:
    return at.replace(second=0, microsecond=0)


def counter(minute, outcome: str, instance: uuid.UUID, n: int, topic: str = TOPIC) -> None:
    latency = [n, 0, 0, 0, 0, 0, 0, 0, 0, 0] if outcome == "claimed" else None
    run_sql(
        "INSERT INTO workpump_console_count VALUES (%s, 'outbox', %s, %s, %s, %s, %s)",
        [minute, topic, outcome, instance, n, latency],
    )


def binned(step: int, since, until) -> dict[tuple[Any, str, str], int]:
    """console_counts' sums per (bin, topic, outcome)."""
    rows = run_sql(
        "SELECT minute, topic, outcome, sum(n)::bigint AS n"
        " FROM workpump.console_counts(%s, %s, %s) GROUP BY 1, 2, 3",
        [since, until, step],
    )
    return {(r["minute"], r["topic"], r["outcome"]): r["n"] for r in rows}


def test_the_sample_folds_whole_buckets_into_the_rollup_and_the_reads_join_it_to_the_rest():
    # T0 is 12:00; counters from 12:03 to 12:25, of two instances and two topics
    for minutes, outcome, instance, n in [
        (3, "done", A, 2), (3, "done", B, 3), (9, "claimed", A, 4), (12, "done", A, 1),
        (19, "failed", B, 5), (21, "done", A, 7), (25, "done", B, 1),
    ]:  # fmt: skip
        counter(T0 + timedelta(minutes=minutes), outcome, instance, n)
    counter(T0 + timedelta(minutes=4), "done", A, 6, topic="console.sms")
    before = binned(10, T0, T0 + timedelta(minutes=30))

    # at 12:21 the bucket 12:10 ended only a minute ago (a grace of 2): 12:00 is folded
    assert scalar("SELECT workpump.console_sample(p_now => %s)", [T0 + timedelta(minutes=21)])
    folded = scalar("SELECT folded_until FROM workpump_console_sample")
    assert folded == T0 + timedelta(minutes=10)
    rollup = run_sql(
        "SELECT minute, topic, outcome, n, latency FROM workpump_console_rollup ORDER BY 2, 3"
    )
    assert [(r["minute"], r["topic"], r["outcome"], r["n"]) for r in rollup] == [
        (T0, TOPIC, "claimed", 4),
        (T0, TOPIC, "done", 5),  # summed over instances
        (T0, "console.sms", "done", 6),
    ]
    assert rollup[0]["latency"][0] == 4
    # read by buckets: the rollup before 12:10, the counters after; the same sums
    assert binned(10, T0, T0 + timedelta(minutes=30)) == before
    assert before[T0 + timedelta(minutes=10), TOPIC, "done"] == 1
    assert before[T0 + timedelta(minutes=20), TOPIC, "done"] == 8

    # a minute later no bucket more is whole; at 12:23 the 12:10 bucket is folded too
    assert scalar("SELECT workpump.console_sample(p_now => %s)", [T0 + timedelta(minutes=22)])
    assert scalar("SELECT workpump.console_sample(p_now => %s)", [T0 + timedelta(minutes=23)])
    assert scalar(
        "SELECT folded_until FROM workpump_console_sample ORDER BY minute DESC LIMIT 1"
    ) == T0 + timedelta(minutes=20)
    assert scalar("SELECT count(*) FROM workpump_console_rollup") == 5
    assert binned(10, T0, T0 + timedelta(minutes=30)) == before
    # a step of one minute reads the counters alone
    assert binned(1, T0, T0 + timedelta(minutes=30))[T0 + timedelta(minutes=3), TOPIC, "done"] == 5


def test_the_backlog_of_each_bin_is_its_last_sampled_minute_summed_over_topics():
    def sample(minutes: int, topic: str, pending: int, oldest: float) -> None:
        run_sql(
            "INSERT INTO workpump_console_backlog VALUES (%s, 'outbox', %s, %s, 1, 0, %s)",
            [T0 + timedelta(minutes=minutes), topic, pending, oldest],
        )

    # T0 is 12:00: bin 12:00 sampled at :03 and :07, bin 12:10 not at all, bin 12:20 at :21
    for minutes, topic, pending, oldest in [
        (3, TOPIC, 5, 9.0), (3, "console.sms", 50, 2.0), (7, TOPIC, 6, 4.0),
        (7, "console.sms", 60, 8.0), (21, TOPIC, 7, 1.0),
    ]:  # fmt: skip
        sample(minutes, topic, pending, oldest)
    until = T0 + timedelta(minutes=29)

    binned = series.console_backlog(T0, until, step=10)
    assert [
        (r["minute"], r["pending"], r["scheduled"], r["oldest_pending_seconds"]) for r in binned
    ] == [
        (T0 + timedelta(minutes=7), 66, 2, 8.0),  # the bin's last sample, both topics
        (T0 + timedelta(minutes=21), 7, 1, 1.0),
    ]
    one = series.console_backlog(T0, until, step=10, category="outbox", topic="console.sms")
    assert [(r["minute"], r["pending"]) for r in one] == [(T0 + timedelta(minutes=7), 60)]
    # a minute at a time: every sampled minute
    assert [r["pending"] for r in series.console_backlog(T0, until)] == [55, 66, 7]


def test_a_long_gap_is_folded_a_few_hours_a_sample_and_a_stored_infinity_is_skipped():
    counter(T0, "done", A, 1)
    counter(T0 + timedelta(hours=10), "done", A, 2)
    run_sql(
        "INSERT INTO workpump_console_count VALUES ('infinity', 'outbox', %s, 'done', %s, 9, NULL)",
        [TOPIC, A],
    )
    later = T0 + timedelta(hours=11)
    assert scalar("SELECT workpump.console_sample(p_now => %s)", [later])
    assert scalar("SELECT folded_until FROM workpump_console_sample") == T0 + timedelta(hours=6)
    assert scalar("SELECT workpump.console_sample(p_now => %s)", [later + timedelta(minutes=1)])
    assert scalar(
        "SELECT folded_until FROM workpump_console_sample ORDER BY minute DESC LIMIT 1"
    ) == T0 + timedelta(hours=10, minutes=50)
    assert scalar("SELECT sum(n) FROM workpump_console_rollup") == 3
    assert sum(binned(10, T0, later).values()) == 3


def test_the_purge_removes_minutes_before_the_cutoff_in_batches():
    old, kept = T0 - timedelta(days=8), T0 - timedelta(days=6)
    for minute in (old, old + timedelta(minutes=1), kept):
        run_sql(
            "INSERT INTO workpump_console_count VALUES (%s, 'outbox', %s, 'done', %s, 1, NULL)",
            [minute, TOPIC, A],
        )
        run_sql("INSERT INTO workpump_console_total VALUES (%s, 'done', %s, 1, NULL)", [minute, A])
        run_sql(
            "INSERT INTO workpump_console_rollup VALUES (%s, 'outbox', %s, 'done', 1, NULL)",
            [minute, TOPIC],
        )
        run_sql("SELECT workpump.console_sample(p_now => %s)", [minute])
    cutoff = T0 - timedelta(days=7)
    assert scalar("SELECT workpump.purge_console(%s, 1)", [cutoff]) >= 2
    while scalar("SELECT workpump.purge_console(%s, 1)", [cutoff]):
        pass
    assert [
        r["minute"] for r in run_sql("SELECT minute FROM workpump_console_count ORDER BY 1")
    ] == [kept]
    assert [r["minute"] for r in run_sql("SELECT minute FROM workpump_console_total")] == [kept]
    assert [r["minute"] for r in run_sql("SELECT minute FROM workpump_console_rollup")] == [kept]
    assert scalar("SELECT count(*) FROM workpump_console_sample WHERE minute < %s", [cutoff]) == 0
    assert scalar("SELECT count(*) FROM workpump_console_sample WHERE minute = %s", [kept]) == 1


def test_a_topics_failure_reasons_are_read_by_the_failing_rows_index():
    # many undone rows without an error, of another topic: the failing index leaves
    # them out, where a scan by seq would read them all
    run_sql(
        "INSERT INTO workpump_outbox (work_id, topic, payload, attempts)"
        " SELECT gen_random_uuid(), 'console.noise', '{}'::jsonb, 1"
        " FROM generate_series(1, 20000)"
    )
    for n in range(3):
        make(1, attempts=1, failure_reason="handler_error", last_error=f"E{n}: boom")
    make(1, attempts=1, done_at=T0, last_error="E9: done rows are not failing")
    run_sql("ANALYZE workpump_outbox")

    (plan,) = scalar(
        "EXPLAIN (FORMAT JSON) SELECT t.seq FROM workpump_outbox t"
        " WHERE t.topic = %s AND t.done_at IS NULL AND t.last_error IS NOT NULL"
        " ORDER BY t.seq DESC LIMIT 10000",
        [TOPIC],
    )
    assert "wp_outbox_failing" in str(plan), plan
    rows = run_sql("SELECT * FROM workpump.console_failures('outbox', %s)", [TOPIC])
    assert [(r["failure_reason"], r["n"], r["last_error"]) for r in rows] == [
        ("handler_error", 3, "E2: boom")
    ]


def folded_days(days: int, n: str) -> Any:
    """Fold ``days`` days of 10-minute buckets from T0 for 60 topics (console.t1 to t60,
    claimed, done and failed, each ``n``: an SQL expression of the topic number t), and
    mark them folded; returns where the fold stopped."""
    run_sql(
        "INSERT INTO workpump_console_rollup (minute, category, topic, outcome, n)"
        " SELECT %s + make_interval(mins => 10 * b), 'outbox', 'console.t' || t, o, "
        + n
        + " FROM generate_series(0, %s) b, generate_series(1, 60) t,"
        " unnest(ARRAY['claimed', 'done', 'failed']) o",
        [T0, days * 144 - 1],
    )
    until = T0 + timedelta(days=days)
    run_sql(
        "INSERT INTO workpump_console_sample (minute, taken_at, folded_until) VALUES (%s, %s, %s)",
        [until, until, until],
    )
    run_sql("ANALYZE workpump_console_rollup")
    return until


def test_a_topics_lines_read_its_own_buckets_by_the_topic_index():
    # a day of folded buckets for 60 topics: each topic's line probes its own key
    until = folded_days(1, "t + 1")
    asked = [("outbox", "console.t7"), ("outbox", "console.t42")]
    params = {
        "since": T0,
        "until": until - timedelta(minutes=1),
        "step": 10,
        "categories": [c for c, _ in asked],
        "topics": [t for _, t in asked],
    }
    sql = series.counts_sql("console_topic_outcomes", 10)
    with transaction.atomic():
        run_sql("SET LOCAL max_parallel_workers_per_gather = 0")
        (plan,) = scalar("EXPLAIN (FORMAT JSON) " + sql, params)
    assert "wp_console_rollup_topic" in str(plan), plan

    rows = series.console_topic_outcomes(params["since"], params["until"], asked, step=10)
    got: Counter[tuple[str, str]] = Counter()
    for r in rows:
        got[(r["topic"], r["outcome"])] += r["n"]
    # claimed is not a line: done and failed, 144 buckets each of t + 1
    assert got == {
        ("console.t7", "done"): 144 * 8,
        ("console.t7", "failed"): 144 * 8,
        ("console.t42", "done"): 144 * 43,
        ("console.t42", "failed"): 144 * 43,
    }


def test_a_days_busiest_topics_and_backlog_are_summed_from_covering_indexes():
    # two days of folded buckets and sampled minutes for 60 topics: the overview's sums
    # read the indexes alone, not a heap page per topic and minute
    run_sql(
        "INSERT INTO workpump_console_backlog"
        " SELECT %s + make_interval(mins => m), 'outbox', 'console.t' || t, t, 0, 1, 2.0"
        " FROM generate_series(0, 2879) m, generate_series(1, 60) t",
        [T0],
    )
    run_sql("ANALYZE workpump_console_backlog")
    until = folded_days(2, "t")
    day = {"since": until - timedelta(days=1), "until": until - timedelta(minutes=1), "step": 10}
    queries = {
        "wp_console_rollup_sums": (series.counts_sql("console_topics", 10), {**day, "limit": 50}),
        "wp_console_backlog_sums": (
            named_queries(series.QUERIES)["console_backlog"],
            {**day, "category": None, "topic": None},
        ),
    }
    for index, (sql, params) in queries.items():
        with transaction.atomic():
            run_sql("SET LOCAL max_parallel_workers_per_gather = 0")
            (plan,) = scalar("EXPLAIN (FORMAT JSON) " + sql, params)
        assert f"'Index Name': '{index}'" in str(plan), plan

    busiest = series.console_topics(day["since"], day["until"], step=10, limit=2)
    assert [(r["topic"], r["done"]) for r in busiest] == [
        ("console.t60", 144 * 60),
        ("console.t59", 144 * 59),
    ]
    backlog = series.console_backlog(day["since"], day["until"], step=10)
    assert len(backlog) == 144 and {r["pending"] for r in backlog} == {sum(range(1, 61))}


def test_instances_in_bins_are_each_instances_last_sample_of_the_bin():
    # A sampled at 12:00-12:19, B at 12:00-12:05 only (it stopped)
    for minute, instance in [(m, A) for m in range(20)] + [(m, B) for m in range(6)]:
        run_sql(
            "INSERT INTO workpump_console_instance (minute, instance_id, service_name,"
            " host_name, process_id, heartbeat_age_seconds, in_flight)"
            " VALUES (%s, %s, 's', 'h', 1, %s, %s)",
            [T0 + timedelta(minutes=minute), instance, float(minute), minute],
        )
    until = T0 + timedelta(minutes=19)
    binned = series.console_instances(T0, until, step=10)
    assert [(r["minute"], r["instance_id"], r["in_flight"]) for r in binned] == [
        (T0 + timedelta(minutes=5), B, 5),
        (T0 + timedelta(minutes=9), A, 9),
        (T0 + timedelta(minutes=19), A, 19),
    ]
    assert len(series.console_instances(T0, until)) == 26  # a minute at a time: all


def test_instances_start_at_the_last_sample_before_the_window_with_each_ones_last_beat():
    # an idle pump sampled last at 11:40 (console_sample writes nothing while idle)
    ServiceInstanceFactory(instance_id=A, last_heartbeat_at=T0 + timedelta(minutes=30))
    for minute, instance in [(-30, A), (-20, A), (-20, B)]:
        run_sql(
            "INSERT INTO workpump_console_sample (minute, taken_at) VALUES (%s, %s)"
            " ON CONFLICT DO NOTHING",
            [T0 + timedelta(minutes=minute)] * 2,
        )
        run_sql(
            "INSERT INTO workpump_console_instance (minute, instance_id, service_name,"
            " host_name, process_id, heartbeat_age_seconds, alive, in_flight)"
            " VALUES (%s, %s, 's', 'h', 1, 2, true, 0)",
            [T0 + timedelta(minutes=minute), instance],
        )
    rows = series.console_instances(T0, T0 + timedelta(minutes=59))
    assert [(r["minute"], r["instance_id"], r["beat_until"]) for r in rows] == [
        (T0 - timedelta(minutes=20), A, T0 + timedelta(minutes=30)),
        (T0 - timedelta(minutes=20), B, None),  # gone from the table
    ]
