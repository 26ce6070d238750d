"""Flow control in the claim (docs/flow-control.md), one session, time from p_now.

Covers: a topic cap and a key cap (across topics and categories) and a topic's per-key
cap, with capped rows waiting unclaimed and no attempt spent; the rate limit's token
bucket under an injected clock; round-robin across fairness keys (weighted) with priority
inside a key; a stream under a cap keeping FIFO; limits changed at runtime; pauses of a
topic, a key and a category, and the waiting reason; a new rule flagging rows stored
before it; declarations against operator overrides; refused input.
"""

from __future__ import annotations

import json
import uuid
from datetime import datetime
from typing import Any

import pytest
from django.db import DatabaseError, transaction

from tests.helpers import T0, at, enroll, run_sql, scalar, seq_scans

pytestmark = pytest.mark.django_db

A = uuid.UUID("00000000-0000-0000-0000-00000000000a")
TOPIC = "partner.call"


@pytest.fixture(autouse=True)
def instance() -> None:
    enroll(A)


def rule(
    kind: str, category: str, name: str, now: datetime = T0, declared: bool = False, **settings: Any
) -> None:
    """Set a rule as an operator does, or as runworkpump declares it (``declared``)."""
    run_sql(
        "SELECT workpump.set_flow_rule(%s, %s, %s, %s::jsonb, %s, p_now => %s)",
        [kind, category, name, json.dumps(settings), declared, now],
    )


def send(topic: str = TOPIC, n: int = 1, **kwargs: Any) -> list[uuid.UUID]:
    args = "".join(f", p_{key} => %s" for key in kwargs)
    return [
        scalar(f"SELECT workpump.send(%s, '{{}}'::jsonb{args})", [topic, *kwargs.values()])
        for _ in range(n)
    ]


def receive(topic: str, n: int = 1, **kwargs: Any) -> list[uuid.UUID]:
    args = "".join(f", p_{key} => %s" for key in kwargs)
    ids = [uuid.uuid4() for _ in range(n)]
    for message_id in ids:
        run_sql(
            f"SELECT workpump.receive(%s, %s, '{{}}'::jsonb{args})",
            [message_id, topic, *kwargs.values()],
        )
    return ids


def claim(
    max_rows: int = 100, now: datetime = T0, categories: list[str] | None = None, **kwargs: Any
) -> list[dict[str, Any]]:
    args = "".join(f", p_{key} => %s" for key in kwargs)
    return run_sql(
        "SELECT category, work_id, topic, priority, lease_token, attempts"
        " FROM workpump.claim_work(%s, %s, p_categories => %s" + args + ", p_now => %s)",
        [A, max_rows, categories, *kwargs.values(), now],
    )


def complete(rows: list[dict[str, Any]], now: datetime = T0) -> None:
    for row in rows:
        done = run_sql(
            "SELECT status FROM workpump.complete_work(%s, %s, %s::uuid[], %s::uuid[],"
            " p_now => %s)",
            [A, row["category"], [row["work_id"]], [row["lease_token"]], now],
        )
        assert [r["status"] for r in done] == ["done"]


def outbox(ids: list[uuid.UUID]) -> list[dict[str, Any]]:
    return run_sql(
        "SELECT work_id, attempts, instance_id, flow_controlled FROM workpump_outbox"
        " WHERE work_id = ANY (%s) ORDER BY seq",
        [ids],
    )


def reason(topic: str = TOPIC, ckey: str = "", fkey: str = "", now: datetime = T0) -> Any:
    return scalar("SELECT workpump.flow_reason('outbox', %s, %s, %s, %s)", [topic, ckey, fkey, now])


# --- caps ---------------------------------------------------------------------------------


def test_a_topic_cap_holds_rows_back_unclaimed_with_no_attempt_spent():
    rule("topic", "outbox", TOPIC, concurrency=2)
    ids = send(n=5)
    plain = send("other.topic", n=3)
    first = claim()
    assert sorted(r["topic"] for r in first) == ["other.topic"] * 3 + [TOPIC] * 2
    assert claim() == []
    rows = outbox(ids)
    assert [r["attempts"] for r in rows] == [1, 1, 0, 0, 0]  # FIFO; the capped spent none
    assert all(r["flow_controlled"] for r in rows)
    assert not any(r["flow_controlled"] for r in outbox(plain))
    assert reason() == f"waiting: concurrency cap {TOPIC} 2/2"

    complete([r for r in first if r["topic"] == TOPIC][:1])
    again = claim()
    assert [r["work_id"] for r in again] == [ids[2]]
    assert reason() == f"waiting: concurrency cap {TOPIC} 2/2"


def test_an_expired_lease_no_longer_counts_against_the_cap():
    rule("topic", "outbox", TOPIC, concurrency=1)
    ids = send(n=2)
    assert [r["work_id"] for r in claim(lease_seconds=10)] == [ids[0]]
    assert claim(now=at(5)) == []
    # the holder is gone: its row is claimable again, and counts once
    again = claim(now=at(11), lease_seconds=10)
    assert [r["work_id"] for r in again] == [ids[0]]
    assert [r["attempts"] for r in outbox(ids)] == [2, 0]


def index_reads(index: str) -> int:
    """Index entries of ``index`` read in this transaction so far."""
    return scalar("SELECT pg_stat_get_xact_tuples_returned(%s::regclass)", [index])


def test_a_flow_head_whose_lease_expired_is_taken_over_first_by_a_claim_that_reads_no_table():
    """A leased flow-controlled head is kept out of _flow (in _flowtimer): its group is
    found, and its row taken over first, in its place, once its lease expired, also when
    it is all its group has; and no claim or probe reads the table for it."""
    lone = send("other.topic", fairness_key="t2")
    ids = send(n=3, fairness_key="t1")
    assert {r["work_id"] for r in claim(max_rows=2, lease_seconds=10)} == {lone[0], ids[0]}
    ready = "SELECT workpump.claimable_outbox(%s, %s, true, %s)"
    assert scalar(ready, [["other.topic"], None, at(5)]) is False
    assert [r["work_id"] for r in claim(now=at(5), max_rows=1)] == [ids[1]]

    # a scan it could avoid is counted below (a table of a few rows, its statistics fresh,
    # costs less to scan than an index: the planner's choice there would say nothing)
    run_sql("SET LOCAL enable_seqscan = off")
    before = seq_scans("workpump_outbox")
    timer_reads = index_reads("wp_outbox_flowtimer")
    assert scalar(ready, [["other.topic"], None, at(11)]) is True
    again = claim(now=at(11), lease_seconds=10)
    taken = [r["work_id"] for r in again]
    # the expired heads, each a new attempt, and in t1's turn before its newer row
    assert sorted(taken) == sorted([lone[0], ids[0], ids[2]])
    assert taken.index(ids[0]) < taken.index(ids[2])
    assert [r["attempts"] for r in again if r["work_id"] in (lone[0], ids[0])] == [2, 2]
    assert seq_scans("workpump_outbox") == before
    assert index_reads("wp_outbox_flowtimer") > timer_reads  # found through _flowtimer
    reasons = run_sql(
        "SELECT failure_reason FROM workpump_outbox WHERE work_id = ANY (%s)", [[lone[0], ids[0]]]
    )
    assert [r["failure_reason"] for r in reasons] == ["lease_expired", "lease_expired"]


def test_a_concurrency_key_is_capped_across_topics_and_categories():
    rule("key", "", "partner:acme", concurrency=3)
    acme_out = send("a.topic", n=3, concurrency_key="partner:acme")
    acme_in = receive("b.handler", n=3, concurrency_key="partner:acme")
    other = send("a.topic", n=2, concurrency_key="partner:other")
    rows = claim()
    taken = {r["work_id"] for r in rows}
    assert len(taken & (set(acme_out) | set(acme_in))) == 3
    assert set(other) <= taken
    assert claim() == []
    assert reason("a.topic", "partner:acme") == "waiting: concurrency cap partner:acme 3/3"


def test_key_concurrency_caps_each_key_of_a_topic():
    rule("topic", "outbox", TOPIC, key_concurrency=1)
    k1 = send(n=3, concurrency_key="k1")
    k2 = send(n=3, concurrency_key="k2")
    assert {r["work_id"] for r in claim()} == {k1[0], k2[0]}
    assert claim() == []


# --- rates --------------------------------------------------------------------------------


def test_the_rate_limit_starts_rate_per_second_after_a_burst_under_an_injected_clock():
    rule("topic", "outbox", TOPIC, rate=10, burst=5)
    send(n=200)
    assert len(claim()) == 5  # a full bucket: the burst
    assert claim() == []
    assert reason() == f"waiting: rate limit {TOPIC} 10/s"
    assert len(claim(now=at(0.5))) == 5
    assert claim(now=at(0.55)) == []
    # claims every 100 ms for 10 s: 10 a second, the burst at most in any one second
    starts: dict[int, int] = {}
    for tick in range(6, 106):
        starts[tick // 10] = starts.get(tick // 10, 0) + len(claim(now=at(tick / 10)))
    assert sum(starts.values()) == 100
    assert max(starts.values()) <= 10 + 5
    # an idle minute refills the bucket to its burst, no more
    assert len(claim(now=at(70))) == 5


def test_a_key_rate_limits_the_key_in_every_topic():
    rule("key", "", "partner:acme", rate=2, burst=2)
    send("a.topic", n=5, concurrency_key="partner:acme")
    send("b.topic", n=5, concurrency_key="partner:acme")
    assert len(claim()) == 2
    assert len(claim(now=at(1))) == 2
    assert claim(now=at(1.2)) == []


# --- kept plans ---------------------------------------------------------------------------


@pytest.mark.parametrize("fairness_key", [None, "tenant:a"], ids=["fast", "flow"])
def test_a_claim_planned_on_a_near_empty_table_leases_rows_without_scanning_it(fairness_key):
    """The claim's plans are kept for the session: ones made while the table held a few
    rows must not scan the whole table once it has grown (until the next ANALYZE)."""
    run_sql("TRUNCATE workpump_outbox CASCADE")  # physically empty (rolled back after)
    flow = {"fairness_key": fairness_key} if fairness_key else {}
    send(n=3, **flow)
    run_sql("DISCARD PLANS")  # whatever an earlier test left: planned here, on 3 rows
    complete(claim(max_rows=3))
    run_sql(
        "SELECT workpump.send_many(%s, array_agg(jsonb_build_object('n', g)),"
        " p_fairness_key => %s) FROM generate_series(1, 2000) g",
        [TOPIC, fairness_key],
    )

    before = seq_scans("workpump_outbox")
    assert len(claim(max_rows=5)) == 5
    assert seq_scans("workpump_outbox") == before


# --- fairness -----------------------------------------------------------------------------


def test_a_claimer_of_other_topics_does_not_read_a_flow_controlled_backlog():
    rule("topic", "outbox", TOPIC, concurrency=100_000)
    run_sql(
        "SELECT workpump.send_many(%s, array_agg(jsonb_build_object('n', g)))"
        " FROM generate_series(1, 2000) g",
        [TOPIC],
    )
    # every row is flow-controlled: claim_work's probe answers by the _flow index alone
    ready = "SELECT workpump.claimable_outbox(%s, %s, true, %s)"
    before = index_reads("wp_outbox_flow")
    assert scalar(ready, [["other.a", "other.b"], None, T0]) is False
    # each named topic is one descent of the index, not a walk past the backlog
    assert index_reads("wp_outbox_flow") - before <= 4
    assert scalar(ready, [["other.a", TOPIC], None, T0]) is True
    assert scalar(ready, [None, None, T0]) is True
    assert scalar(ready, [[], [TOPIC[:3]], T0]) is True
    assert scalar(ready, [[], ["other."], T0]) is False


def test_the_flow_probe_reads_from_the_newest_end_past_a_drained_oldest_end():
    """A group drains from its oldest rows, and their index entries stay until VACUUM:
    a probe from that end would step over every one of them, in every claim."""
    run_sql(
        "SELECT workpump.send_many(%s, array_agg(jsonb_build_object('n', g)),"
        " p_fairness_key => 'tenant:a') FROM generate_series(1, 600) g",
        [TOPIC],
    )
    rows = claim(max_rows=500)
    assert len(rows) == 500
    done = run_sql(
        "SELECT status FROM workpump.complete_work(%s, 'outbox', %s::uuid[], %s::uuid[],"
        " p_now => %s)",
        [A, [r["work_id"] for r in rows], [r["lease_token"] for r in rows], T0],
    )
    assert {r["status"] for r in done} == {"done"}

    ready = "SELECT workpump.claimable_outbox(%s, %s, true, %s)"
    before = index_reads("wp_outbox_flow")
    assert scalar(ready, [None, None, T0]) is True
    assert scalar(ready, [[TOPIC], None, T0]) is True
    assert scalar(ready, [[], [TOPIC[:3]], T0]) is True
    # 1,000 entries of ended versions lie at the oldest end (each row's first and its
    # leased one): each probe reads its answer at the other end
    assert index_reads("wp_outbox_flow") - before <= 6


def test_the_claim_takes_fairness_keys_round_robin_with_priority_inside_a_key():
    noisy = send(n=50, fairness_key="tenant:noisy")
    quiet_low = send(fairness_key="tenant:quiet")
    quiet_high = send(fairness_key="tenant:quiet", priority=5)
    rows = claim(4)
    assert [r["work_id"] for r in rows] == [quiet_high[0], noisy[0], noisy[1], quiet_low[0]]


def test_a_fairness_weight_is_its_rows_per_round():
    rule("key", "", "tenant:big", weight=3)
    big = send(n=10, fairness_key="tenant:big")
    small = send(n=10, fairness_key="tenant:small")
    rows = [r["work_id"] for r in claim(8)]
    assert rows == [big[0], big[1], big[2], small[0], big[3], big[4], big[5], small[1]]


def test_a_key_that_holds_rows_takes_its_turn_after_one_that_holds_none():
    """A claim smaller than the number of keys: the flooding key's head is the oldest, yet
    the key with nothing held (on any instance) comes first; a turn counts held rows."""
    b = uuid.UUID("00000000-0000-0000-0000-00000000000b")
    enroll(b)
    noisy = send(n=10, fairness_key="tenant:noisy")
    held = run_sql(
        "SELECT work_id FROM workpump.claim_work(%s, 3, p_categories => %s, p_now => %s)",
        [b, ["outbox"], T0],
    )
    assert [r["work_id"] for r in held] == noisy[:3]
    quiet = send(n=2, fairness_key="tenant:quiet")
    assert [r["work_id"] for r in claim(1)] == [quiet[0]]
    # quiet holds 1 now, noisy 3: quiet's second row, then the two keys in turn
    assert [r["work_id"] for r in claim(4)] == [quiet[1], noisy[3], noisy[4], noisy[5]]


def test_an_underserved_only_claim_takes_a_round_of_each_group_holding_fewer_than_most():
    b = uuid.UUID("00000000-0000-0000-0000-00000000000b")
    enroll(b)
    rule("key", "", "tenant:big", weight=2)
    noisy = send(n=10, fairness_key="tenant:noisy")
    run_sql("SELECT 1 FROM workpump.claim_work(%s, 3, p_now => %s)", [b, T0])
    quiet = send(n=3, fairness_key="tenant:quiet")
    big = send(n=3, fairness_key="tenant:big")
    send("plain.topic", n=5)
    # noisy holds 3: one round of quiet and of big (its weight: 2), no plain row
    rows = claim(10, underserved_only=True)
    assert [r["work_id"] for r in rows] == [quiet[0], big[0], big[1]]
    # quiet holds 1, big 2: one more round each; then both hold 3, as many as noisy
    assert [r["work_id"] for r in claim(10, underserved_only=True)] == [quiet[1], big[2]]
    assert [r["work_id"] for r in claim(10, underserved_only=True)] == [quiet[2]]
    assert claim(10, underserved_only=True) == []
    # a plain claim goes on from there: noisy's next row among them
    assert noisy[3] in {r["work_id"] for r in claim(10)}


def test_an_underserved_only_claim_takes_nothing_when_no_group_holds_a_row():
    send(n=3, fairness_key="tenant:a")
    send(n=3, fairness_key="tenant:b")
    assert claim(10, underserved_only=True) == []
    assert len(claim(10)) == 6


def test_fairness_rows_and_plain_rows_share_the_budget():
    send(n=20, fairness_key="tenant:a")
    plain = send("plain.topic", n=20)
    rows = claim(10)
    assert len(rows) == 10
    assert len([r for r in rows if r["work_id"] in set(plain)]) == 5


# --- streams ------------------------------------------------------------------------------


def test_a_stream_under_a_cap_keeps_fifo_and_runs_one_row_at_a_time():
    rule("topic", "outbox", TOPIC, concurrency=5)
    s1 = send(n=3, stream="s1")
    s2 = send(n=2, stream="s2")
    rows = claim(stream_run_max=10)
    assert {r["work_id"] for r in rows} == {s1[0], s2[0]}  # heads only, no runs
    assert claim(stream_run_max=10) == []
    complete([r for r in rows if r["work_id"] == s1[0]])
    assert [r["work_id"] for r in claim(stream_run_max=10)] == [s1[1]]


def test_a_capped_stream_head_blocks_its_stream():
    rule("topic", "outbox", TOPIC, concurrency=1)
    other = send()
    s1 = send(n=2, stream="s1")
    assert [r["work_id"] for r in claim()] == other
    assert claim() == []
    assert [r["attempts"] for r in outbox(s1)] == [0, 0]


# --- runtime changes, pauses --------------------------------------------------------------


def test_limits_changed_at_runtime_take_effect_at_the_next_claim():
    rule("topic", "outbox", TOPIC, concurrency=1)
    send(n=6)
    assert len(claim()) == 1
    rule("topic", "outbox", TOPIC, concurrency=3)
    assert len(claim()) == 2
    rule("topic", "outbox", TOPIC, concurrency=1)
    assert claim() == []
    rule("topic", "outbox", TOPIC, concurrency=None)  # the override cleared: no cap
    assert len(claim()) == 3


def test_a_paused_topic_keeps_its_rows_attempts_and_order_until_resumed():
    ids = send(n=3)
    rule("topic", "outbox", TOPIC, paused=True)  # a pause alone flags nothing
    assert not any(r["flow_controlled"] for r in outbox(ids))
    assert claim() == []  # claim_work leaves the topic out, every topic claimed or not
    assert reason() == f"waiting: topic {TOPIC} paused"
    assert [r["attempts"] for r in outbox(ids)] == [0, 0, 0]
    rule("topic", "outbox", TOPIC, paused=False)
    assert [r["work_id"] for r in claim()] == ids


def test_a_topics_first_limit_flags_its_rows_and_the_maintenance_pass_the_rest():
    ids = send(n=3)
    rule("topic", "outbox", TOPIC, paused=True)
    assert scalar("SELECT workpump.flag_flow_stragglers(2)") == 2  # in batches
    assert scalar("SELECT workpump.flag_flow_stragglers(2)") == 1
    assert scalar("SELECT workpump.flag_flow_stragglers(2)") == 0
    more = send("other.topic", n=2)
    held = send("other.topic", stream="s")  # a stream row goes through the trigger
    rule("topic", "outbox", "other.topic", concurrency=1)
    assert all(r["flow_controlled"] for r in outbox([*ids, *more, *held]))


def test_a_paused_key_and_a_paused_category():
    rule("key", "", "tenant:a", paused=True)
    held = send(fairness_key="tenant:a")
    free = send(fairness_key="tenant:b")
    assert [r["work_id"] for r in claim()] == free
    assert reason(fkey="tenant:a") == "waiting: key tenant:a paused"
    rule("key", "", "tenant:a", paused=False)
    assert [r["work_id"] for r in claim()] == held

    rule("category", "outbox", "", paused=True)
    plain = send("plain.topic")
    inbox = receive("some.handler")
    assert [r["work_id"] for r in claim()] == inbox  # the outbox is paused, even fast rows
    rule("category", "outbox", "", paused=False)
    assert [r["work_id"] for r in claim()] == plain


def wakes(listener: Any) -> list[str]:
    """The payloads of the NOTIFYs on workpump_outbox delivered to ``listener`` so far."""
    listener.execute("SELECT 1")  # a round trip: notifications sent before it are in
    return [n.payload for n in listener.notifies(timeout=0.2) if n.channel == "workpump_outbox"]


@pytest.mark.django_db(transaction=True)
def test_pausing_and_resuming_notifies_the_claimers(raw_connect):
    rule("topic", "outbox", TOPIC, paused=True)
    listener = raw_connect()
    listener.execute("LISTEN workpump_outbox")
    rule("topic", "outbox", TOPIC, paused=False)
    assert wakes(listener) == ["outbox"]
    rule("topic", "outbox", TOPIC, weight=2)  # not a change of paused: no wake
    assert wakes(listener) == []


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize(
    ("rules", "keys", "wakes_claimers"),
    [
        ([], {"fairness_key": "tenant:a"}, False),
        ([("topic", "outbox", TOPIC, {"rate": 10})], {}, False),
        ([("key", "", "tenant:a", {"weight": 3})], {"fairness_key": "tenant:a"}, False),
        ([("key", "", "acme", {"rate": 10})], {"concurrency_key": "acme"}, False),
        ([("topic", "outbox", TOPIC, {"concurrency": 5})], {}, True),
        ([("topic", "outbox", TOPIC, {"key_concurrency": 3})], {"concurrency_key": "k1"}, True),
        ([("key", "", "acme", {"concurrency": 5})], {"concurrency_key": "acme"}, True),
        # declared by the code (runworkpump's start), no operator override
        ([("topic", "outbox", TOPIC, {"concurrency": 5, "declared": True})], {}, True),
        (
            [("topic", "outbox", TOPIC, {"key_concurrency": 3, "declared": True})],
            {"concurrency_key": "k1"},
            True,
        ),
        (
            [("key", "", "acme", {"concurrency": 5, "declared": True})],
            {"concurrency_key": "acme"},
            True,
        ),
        ([("topic", "outbox", TOPIC, {"rate": 10, "declared": True})], {}, False),
    ],
    ids=[
        "fairness",
        "topic-rate",
        "weight",
        "key-rate",
        "topic-cap",
        "key-per-topic",
        "key-cap",
        "declared-topic-cap",
        "declared-key-per-topic",
        "declared-key-cap",
        "declared-topic-rate",
    ],
)
def test_only_the_end_of_a_row_under_a_concurrency_cap_wakes_the_claimers(
    raw_connect, rules, keys, wakes_claimers
):
    # Its end may let a capped row start on another instance. The end of a row limited
    # by a rate or a fairness key alone frees nothing a claim waits for: a wake at each
    # completion flush of a flood turned every claimer's loop for nothing.
    for kind, category, name, settings in rules:
        rule(kind, category, name, **settings)
    send(n=3, **keys)
    rows = claim()
    assert len(rows) == 3
    listener = raw_connect()
    listener.execute("LISTEN workpump_outbox")
    complete(rows[:1])
    run_sql(
        "SELECT workpump.discard_work(%s, 'outbox', %s::uuid[], %s::uuid[], %s::text[],"
        " p_now => %s)",
        [A, [rows[1]["work_id"]], [rows[1]["lease_token"]], ["no longer wanted"], T0],
    )
    # a failure retried later leaves the cap too
    run_sql(
        "SELECT workpump.fail_work(%s, 'outbox', %s::uuid[], %s::uuid[], %s::text[], p_now => %s)",
        [A, [rows[2]["work_id"]], [rows[2]["lease_token"]], ["partner down"], T0],
    )
    assert scalar(
        "SELECT scheduled_for > %s FROM workpump_outbox WHERE work_id = %s",
        [T0, rows[2]["work_id"]],
    )
    assert wakes(listener) == (["ended"] * 3 if wakes_claimers else [])


def test_declarations_and_overrides():
    run_sql(
        "SELECT workpump.sync_flow_rules(%s::jsonb, %s)",
        [
            json.dumps([{"kind": "topic", "category": "outbox", "name": TOPIC, "concurrency": 2}]),
            T0,
        ],
    )
    send(n=5)
    assert len(claim()) == 2
    rule("topic", "outbox", TOPIC, concurrency=3)  # the operator's value wins
    assert len(claim()) == 1
    # the code no longer declares it: the declaration goes, the override stays
    run_sql("SELECT workpump.sync_flow_rules('[]'::jsonb, %s)", [T0])
    row = run_sql(
        "SELECT declared_concurrency, override_concurrency FROM workpump_flow_rule"
        " WHERE kind = 'topic' AND name = %s",
        [TOPIC],
    )
    assert row == [{"declared_concurrency": None, "override_concurrency": 3}]


# --- input --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (
            "SELECT workpump.send('t', '{}'::jsonb, p_concurrency_key => repeat('k', 201))",
            "The concurrency_key of outbox destination 't' must be at most 200 characters",
        ),
        (
            "SELECT workpump.send('t', '{}'::jsonb, p_fairness_key => E'a\\nb')",
            "The fairness_key of outbox destination 't' must be at most 200 characters",
        ),
        (
            "SELECT workpump.set_flow_rule('topic', 'outbox', 't', '{\"concurrency\": -1}')",
            "Bad flow rule setting 'concurrency'",
        ),
        (
            "SELECT workpump.set_flow_rule('topic', 'outbox', 't', '{\"rate\": 0}')",
            "Bad flow rule setting 'rate'",
        ),
        (
            "SELECT workpump.set_flow_rule('topic', 'outbox', 't', '{\"speed\": 1}')",
            "A flow rule has no setting 'speed'",
        ),
        (
            "SELECT workpump.set_flow_rule('lane', 'outbox', 't', '{}')",
            "A flow rule is of a topic, a key or a category, not 'lane'",
        ),
        (
            "SELECT workpump.set_flow_rule('category', 'outbox', '', '{\"concurrency\": 1}')",
            "A category can only be paused or resumed",
        ),
    ],
)
def test_bad_keys_and_rules_are_refused_with_a_clear_error(call, message):
    with pytest.raises(DatabaseError, match=message.replace("(", r"\(")), transaction.atomic():
        run_sql(call)


def test_hostile_rule_values_affect_their_rule_alone():
    rule("topic", "outbox", TOPIC, concurrency=1)
    run_sql(
        "UPDATE workpump_flow_rule SET override_concurrency = -5, weight = -3,"
        " override_burst = -1, tokens = 'NaN' WHERE name = %s",
        [TOPIC],
    )
    send(n=2)
    plain = send("plain.topic")
    assert [r["work_id"] for r in claim()] == plain  # a negative cap is 0


def test_a_claim_held_back_by_a_rate_says_when_to_claim_again():
    from django_workpump import db

    rule("topic", "outbox", TOPIC, rate=10, burst=1)
    send(n=3)

    def claim_now(now: datetime) -> int:
        rows = db.claim_work(
            instance_id=A, max_rows=10, lease_seconds=60, partition_count=10000, now=now
        )
        return len(rows)

    assert claim_now(T0) == 1
    assert db.flow_wait_ms() == 100  # one token every 100 ms
    assert claim_now(at(0.06)) == 0
    assert db.flow_wait_ms() == 40
    send("plain.topic")
    assert claim_now(at(0.07)) == 1
    assert db.flow_wait_ms() == 30


def test_a_claim_that_reaches_rows_of_fairness_keys_says_so():
    from django_workpump import db

    def claim_now() -> int:
        rows = db.claim_work(instance_id=A, max_rows=10, lease_seconds=60, partition_count=10000)
        return len(rows)

    send(concurrency_key="partner:acme")
    assert claim_now() == 1
    assert db.flow_fair() is False  # flow-controlled, but by a concurrency key only
    send(fairness_key="tenant:1")
    assert claim_now() == 1
    assert db.flow_fair() is True
    send("plain.topic")
    assert claim_now() == 1
    assert db.flow_fair() is False  # said of the last claim only


def test_a_paused_topic_leaves_the_claimers_topic_list_even_for_a_row_stored_by_hand():
    rule("topic", "outbox", TOPIC, paused=True)
    # an INSERT that names a partition and no stream skips the trigger: not flagged
    run_sql(
        "INSERT INTO workpump_outbox (work_id, topic, payload, partition_number)"
        " VALUES (gen_random_uuid(), %s, '{}', 1)",
        [TOPIC],
    )
    named = json.dumps({"outbox": [TOPIC, "plain.topic"]})
    assert claim(topics=named) == []
    rule("topic", "outbox", TOPIC, paused=False)
    assert len(claim(topics=named)) == 1
