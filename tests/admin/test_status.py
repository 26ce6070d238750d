"""The status report (django_workpump.status) and ``manage.py workpump_status``.

Covers counts per category x state (workpump.state_of), the oldest waiting age, blocked
streams, dead rows, instances (heartbeat age, alive-lock, liveness, LISTEN session, rows
held), tombstones, the --json and text output, an empty system, the missing-migrations
error, and that the report costs a fixed number of queries. Times are passed as ``now``.
"""

from __future__ import annotations

import io
import json
import re
import uuid
from datetime import UTC, datetime
from typing import Any

import pytest
from django.core.management import CommandError, call_command

from django_workpump import db, status
from django_workpump.pump.supervisor import MISSING_MIGRATIONS
from tests import factories
from tests.helpers import T0, at, run_sql, scalar

pytestmark = pytest.mark.django_db

CATEGORIES = ["outbox", "inbox", "perspective_event", "receptor"]
STATES = [
    "pending",
    "scheduled",
    "leased",
    "orphaned",
    "done",
    "dead",
    "cancelled",
    "discarded",
]
FACTORIES = {
    "outbox": factories.OutboxFactory,
    "inbox": factories.InboxFactory,
    "perspective_event": factories.PerspectiveEventFactory,
    "receptor": factories.ReceptorProcessingFactory,
}
DONE_COLUMN = {
    "outbox": "done_at",
    "inbox": "done_at",
    "perspective_event": "done_at",
    "receptor": "done_at",
}
FAR_FUTURE = datetime(2100, 1, 1, tzinfo=UTC)  # later than any real clock in these tests
NOW = at(60)
HOLDER = uuid.UUID("00000000-0000-0000-0000-00000000a001")


def make(category: str, **fields: Any) -> Any:
    """One work row of ``category``; its own singleton stream unless ``stream`` is given."""
    fields.setdefault("stream", None)
    if category in ("perspective_event", "receptor") and fields["stream"] is not None:
        fields.setdefault("event__stream", fields["stream"])
    return FACTORIES[category](**fields)


def one_row_in_each_state(category: str, *, holder: uuid.UUID = HOLDER, offset: int = 0) -> None:
    """Six rows of ``category``, one per state at NOW and at the real clock.

    The orphaned row is the oldest waiting one (created ``200 + offset`` s before T0); the
    scheduled, leased, done and dead rows are older still but do not wait for a claimer.
    """
    old = at(-1000)
    make(category, created_at=at(-90))  # pending
    make(category, created_at=old, scheduled_for=FAR_FUTURE, attempts=1)  # scheduled
    make(
        category,
        created_at=old,
        instance_id=holder,
        lease_expiry=FAR_FUTURE,
        claimed_at=T0,
        attempts=1,
    )  # leased
    make(
        category,
        created_at=at(-200 - offset),
        instance_id=holder,
        lease_expiry=at(30),
        claimed_at=T0,
        attempts=1,
    )  # orphaned: the lease ran out before NOW
    make(category, created_at=old, attempts=1, **{DONE_COLUMN[category]: T0})  # done
    for end_state in ("cancelled", "discarded"):
        make(
            category,
            created_at=old,
            attempts=1,
            end_state=end_state,
            failure_reason=end_state,
            **{DONE_COLUMN[category]: T0},
        )
    make(
        category,
        created_at=old,
        attempts=3,
        max_attempts=3,
        dead_lettered_at=at(10),
        failure_reason="max_attempts",
        last_error=f"{category} failed\nTraceback (most recent call last):",
    )  # dead


@pytest.fixture
def every_state() -> None:
    for offset, category in enumerate(CATEGORIES):
        one_row_in_each_state(category, offset=offset)


# --- counts and ages ---------------------------------------------------------------------


def test_counts_have_one_row_per_category_and_state(every_state):
    counts = status.state_counts(now=NOW)

    assert counts.taken_at == NOW
    assert [c.category for c in counts.categories] == CATEGORIES
    for c in counts.categories:
        assert c.counts == dict.fromkeys(STATES, 1), c.category
        assert c.total == 8


def test_counts_follow_the_clock_they_are_given(every_state):
    # Before T0 + 30 s the orphaned rows' leases have not run out yet.
    outbox = status.state_counts(now=at(20)).by_category()["outbox"]
    assert outbox.counts["leased"] == 2
    assert outbox.counts["orphaned"] == 0


def test_oldest_pending_age_is_the_oldest_pending_or_orphaned_row(every_state):
    by_category = status.state_counts(now=NOW).by_category()
    # The orphaned row was created 200 + offset seconds before T0; NOW is T0 + 60.
    assert by_category["outbox"].oldest_pending_age_seconds == 260.0
    assert by_category["inbox"].oldest_pending_age_seconds == 261.0
    assert by_category["perspective_event"].oldest_pending_age_seconds == 262.0
    assert by_category["receptor"].oldest_pending_age_seconds == 263.0


def test_oldest_pending_age_ignores_rows_that_do_not_wait_for_a_claimer():
    make("outbox", created_at=at(-5000), dead_lettered_at=T0)
    make("outbox", created_at=at(-5000), scheduled_for=FAR_FUTURE)
    make("outbox", created_at=at(-5000), instance_id=HOLDER, lease_expiry=FAR_FUTURE)
    make("outbox", created_at=at(-12.5))
    outbox = status.state_counts(now=NOW).by_category()
    assert outbox["outbox"].oldest_pending_age_seconds == 72.5
    assert outbox["inbox"].oldest_pending_age_seconds is None


# --- blocked streams ---------------------------------------------------------------------


def test_a_stream_whose_head_died_in_fail_work_is_blocked_with_its_waiting_rows():
    assert db.record_heartbeat(
        instance_id=HOLDER, service_name="tests", host_name="localhost", process_id=1, now=T0
    )
    ids = [
        scalar(
            "SELECT workpump.send('emails.welcome', '{}'::jsonb, p_stream => 'user-7',"
            " p_max_attempts => 1)"
        )
        for _ in range(3)
    ]
    claimed = db.claim_work(
        instance_id=HOLDER, max_rows=1, lease_seconds=300, partition_count=10_000, now=T0
    )
    assert [c.work_id for c in claimed] == ids[:1]
    outcome = db.fail_work(
        instance_id=HOLDER,
        category="outbox",
        ids=ids[:1],
        lease_tokens=[claimed[0].lease_token],
        errors=["ValueError: bad address\n  File 'x.py', line 1"],
        now=at(5),
    )
    assert outcome[0].status == "dead"

    blocked = status.blocked_streams(now=NOW)

    assert blocked.total == 1
    (stream,) = blocked.streams
    assert (stream.category, stream.scope, stream.stream) == ("outbox", "", "user-7")
    assert stream.head_id == ids[0]
    assert stream.head_state == "dead"
    assert stream.waiting == 2
    assert stream.last_error == "ValueError: bad address"
    assert stream.failure_reason == "max_attempts"
    assert stream.dead_lettered_at == at(5)


def test_blocked_streams_are_dead_heads_and_retry_waits_but_not_leased_or_deferred_heads():
    # A dead outbox head with two rows behind it.
    make("outbox", stream="dead-1", attempts=1, dead_lettered_at=T0, last_error="boom\nmore")
    make("outbox", stream="dead-1")
    make("outbox", stream="dead-1")
    # A perspective head waiting for its retry, one row behind it.
    make(
        "perspective_event",
        stream="retry-1",
        topic="totals",
        attempts=2,
        scheduled_for=at(300),
    )
    make("perspective_event", stream="retry-1", topic="totals")
    # A leased head: the stream is busy, not blocked.
    make("outbox", stream="busy-1", instance_id=HOLDER, lease_expiry=FAR_FUTURE, claimed_at=T0)
    make("outbox", stream="busy-1")
    # A first attempt deferred by its producer: waiting by design, not blocked.
    make("inbox", stream="later-1", scheduled_for=at(300))
    make("inbox", stream="later-1")
    # A retry that is already due is pending again: not blocked.
    make("receptor", stream="due-1", attempts=1, scheduled_for=at(30))
    make("receptor", stream="due-1")

    blocked = status.blocked_streams(now=NOW)

    summary = [(b.category, b.scope, b.stream, b.head_state, b.waiting) for b in blocked.streams]
    assert summary == [
        ("outbox", "", "dead-1", "dead", 2),
        ("perspective_event", "totals", "retry-1", "scheduled", 1),
    ]
    assert blocked.total == 2
    assert blocked.streams[0].last_error == "boom"
    assert blocked.streams[1].retry_at == at(300)


def test_blocked_streams_are_limited_but_the_total_counts_them_all():
    for n in range(4):
        make("inbox", stream=f"s-{n}", dead_lettered_at=T0)
        for _ in range(n):
            make("inbox", stream=f"s-{n}")
    blocked = status.blocked_streams(now=NOW, limit=2)
    assert [(b.stream, b.waiting) for b in blocked.streams] == [("s-3", 3), ("s-2", 2)]
    assert blocked.total == 4


# --- dead rows -------------------------------------------------------------------------------


def test_dead_rows_are_counted_per_category_and_the_newest_twenty_listed():
    for n in range(25):
        make(
            "outbox",
            topic="emails.welcome",
            attempts=3,
            max_attempts=3,
            dead_lettered_at=at(n),
            failure_reason="max_attempts",
            last_error=f"error {n}\nsecond line",
        )
    receptor = make(
        "receptor",
        topic="warehouse",
        attempts=1,
        max_attempts=5,
        dead_lettered_at=at(100),
        failure_reason="dead_lettered_by_operator",
    )
    make("inbox", last_error="not dead yet", scheduled_for=at(600), attempts=1)

    report = status.collect(now=NOW)

    assert report.dead_counts == {"outbox": 25, "inbox": 0, "perspective_event": 0, "receptor": 1}
    rows = report.dead_rows
    assert len(rows) == 20
    assert [r.dead_lettered_at for r in rows] == [at(100), *(at(n) for n in range(24, 5, -1))]
    first, second = rows[0], rows[1]
    assert (first.category, first.work_id, first.topic) == (
        "receptor",
        receptor.work_id,
        "warehouse",
    )
    assert (first.attempts, first.max_attempts, first.last_error) == (1, 5, None)
    assert first.failure_reason == "dead_lettered_by_operator"
    assert (second.category, second.topic, second.attempts) == ("outbox", "emails.welcome", 3)
    assert second.failure_reason == "max_attempts"
    assert second.last_error == "error 24"


# --- instances and tombstones ------------------------------------------------------------


@pytest.fixture
def two_instances() -> tuple[Any, Any]:
    fresh = factories.ServiceInstanceFactory(
        service_name="web", host_name="a", process_id=11, last_heartbeat_at=at(50)
    )
    stale = factories.ServiceInstanceFactory(
        service_name="web",
        host_name="b",
        process_id=12,
        started_at=at(1),
        last_heartbeat_at=at(-100),
    )
    for _ in range(2):
        make("outbox", instance_id=fresh.instance_id, lease_expiry=FAR_FUTURE, claimed_at=T0)
    make("receptor", instance_id=fresh.instance_id, lease_expiry=FAR_FUTURE, claimed_at=T0)
    make("inbox", instance_id=stale.instance_id, lease_expiry=at(30), claimed_at=T0)
    make("inbox")  # unowned
    return fresh, stale


def test_instances_show_heartbeat_age_rows_held_and_liveness(two_instances):
    fresh, stale = two_instances

    listed = status.instances(now=NOW)

    assert [i.instance_id for i in listed] == [fresh.instance_id, stale.instance_id]
    a, b = listed
    assert (a.service_name, a.host_name, a.process_id, a.started_at) == ("web", "a", 11, T0)
    assert a.last_heartbeat_at == at(50)
    assert a.heartbeat_age_seconds == 10.0
    assert b.heartbeat_age_seconds == 160.0
    assert a.rows_held == {"outbox": 2, "inbox": 0, "perspective_event": 0, "receptor": 1}
    assert b.rows_held == {"outbox": 0, "inbox": 1, "perspective_event": 0, "receptor": 0}
    assert (a.total_held, b.total_held) == (3, 1)
    # Default STALE_AFTER_SECONDS is 30: 10 s is fresh, 160 s is stale, and no lock helps.
    assert (a.live, b.live) == (True, False)
    assert (a.alive_lock_held, b.alive_lock_held) == (False, False)
    assert (a.listening, b.listening) == (False, False)


def test_liveness_uses_the_configured_stale_cutoff(two_instances, settings):
    settings.WORKPUMP = {"STALE_AFTER_SECONDS": 200, "DEFINITIVELY_DEAD_AFTER_SECONDS": 600}
    assert [i.live for i in status.instances(now=NOW)] == [True, True]
    settings.WORKPUMP = {"STALE_AFTER_SECONDS": 5, "DEFINITIVELY_DEAD_AFTER_SECONDS": 600}
    assert [i.live for i in status.instances(now=NOW)] == [False, False]


def test_tombstones_are_listed_newest_first_with_their_age():
    older = factories.EvictionFactory(evicted_at=at(-30), reason="web@b pid 12: stale")
    newer = factories.EvictionFactory(evicted_at=at(45), reason="web@c pid 13: stale")

    listed = status.tombstones(now=NOW)

    assert [(t.instance_id, t.age_seconds) for t in listed] == [
        (newer.instance_id, 15.0),
        (older.instance_id, 90.0),
    ]
    assert listed[0].reason == "web@c pid 13: stale"
    assert len(status.tombstones(now=NOW, limit=1)) == 1


@pytest.mark.django_db(transaction=True)
def test_an_alive_lock_held_by_another_session_shows_and_keeps_a_stale_instance_live(
    raw_connect,
):
    instance_id = uuid.uuid4()
    assert db.record_heartbeat(
        instance_id=instance_id, service_name="pump", host_name="h", process_id=7, now=T0
    )
    gate = raw_connect(application_name=f"workpump-{instance_id}")
    assert gate.execute("SELECT workpump.take_alive_lock(%s)", (instance_id,)).fetchone() == {
        "take_alive_lock": True
    }

    (stale_but_locked,) = status.instances(now=at(100))
    assert stale_but_locked.instance_id == instance_id
    assert stale_but_locked.heartbeat_age_seconds == 100.0
    assert stale_but_locked.alive_lock_held is True
    assert stale_but_locked.listening is True
    assert stale_but_locked.live is True  # stale, but the lock proves it alive

    (definitively_dead,) = status.instances(now=at(301))
    assert definitively_dead.alive_lock_held is True
    assert definitively_dead.live is False  # past DEFINITIVELY_DEAD_AFTER_SECONDS (300)


# --- the whole report and its cost -------------------------------------------------------


def populate(count: int) -> None:
    """``count`` of everything a report lists: rows, blocked streams, instances, tombstones."""
    for n in range(count):
        instance = factories.ServiceInstanceFactory(last_heartbeat_at=at(n))
        category = CATEGORIES[n % 4]
        make(category, instance_id=instance.instance_id, lease_expiry=FAR_FUTURE, claimed_at=T0)
        make(category, stream=f"blocked-{n}", dead_lettered_at=at(n), last_error="x")
        make(category, stream=f"blocked-{n}")
        factories.EvictionFactory(evicted_at=at(n))


@pytest.mark.parametrize("count", [5, 50])
def test_the_report_runs_nine_queries_whatever_the_row_count(count, django_assert_num_queries):
    populate(count)
    with django_assert_num_queries(10):  # SET LOCAL jit = off, then the report's nine
        report = status.collect(now=NOW)
    assert len(report.instances) == count
    assert report.blocked_streams_total == count
    assert len(report.dead_rows) == min(count, 20)
    assert len(report.tombstones) == min(count, 20)
    assert sum(c.total for c in report.categories) == 3 * count


def test_an_empty_system_reports_zeros_and_empty_lists():
    report = status.collect(now=NOW)

    assert report.taken_at == NOW
    for c in report.categories:
        assert c.counts == dict.fromkeys(STATES, 0)
        assert c.oldest_pending_age_seconds is None
    assert report.dead_counts == dict.fromkeys(CATEGORIES, 0)
    assert report.blocked_streams == []
    assert report.blocked_streams_total == 0
    assert report.dead_rows == report.instances == report.tombstones == report.periodic == []

    data = json.loads(run_command("--json"))
    assert data["categories"]["receptor"] == {
        "counts": dict.fromkeys(STATES, 0),
        "total": 0,
        "oldest_pending_age_seconds": None,
        "estimated": [],
    }
    assert data["blocked_streams"] == {"total": 0, "streams": []}
    assert data["dead_rows"] == data["instances"] == data["tombstones"] == data["periodic"] == []
    text = run_command()
    sections = ("blocked streams: 0", "dead rows: 0", "instances: 0", "tombstones: 0")
    for section in (*sections, "periodic schedules: 0"):
        assert section in text


# --- the command --------------------------------------------------------------------------


def run_command(*args: str) -> str:
    out = io.StringIO()
    call_command("workpump_status", *args, stdout=out)
    return out.getvalue()


def db_now() -> datetime:
    # The test runs in one transaction, so now() is the clock the command read as well.
    return scalar("SELECT now()")


def test_json_output_carries_the_numbers(every_state, two_instances):
    factories.EvictionFactory(evicted_at=T0, reason="gone")

    data = json.loads(run_command("--json"))

    now = db_now()
    assert datetime.fromisoformat(data["taken_at"]) == now
    assert data["settings"] == {"stale_after_seconds": 30, "definitively_dead_after_seconds": 300}
    outbox = data["categories"]["outbox"]
    # two_instances added two leased outbox rows; every_state one row per state
    assert outbox["counts"] == {**dict.fromkeys(STATES, 1), "leased": 3}
    assert outbox["total"] == 10
    assert outbox["oldest_pending_age_seconds"] == pytest.approx(
        (now - at(-200)).total_seconds(), abs=1e-6
    )
    assert data["categories"]["perspective_event"]["counts"] == dict.fromkeys(STATES, 1)
    assert data["dead_counts"] == dict.fromkeys(CATEGORIES, 1)
    assert len(data["dead_rows"]) == 4
    assert {r["category"] for r in data["dead_rows"]} == set(CATEGORIES)
    assert data["dead_rows"][0]["last_error"].endswith(" failed")
    fresh, stale = two_instances
    first = data["instances"][0]
    assert first["instance_id"] == str(fresh.instance_id)
    assert first["rows_held"] == {"outbox": 2, "inbox": 0, "perspective_event": 0, "receptor": 1}
    assert first["total_held"] == 3
    assert first["heartbeat_age_seconds"] == pytest.approx((now - at(50)).total_seconds(), abs=1e-6)
    assert datetime.fromisoformat(first["last_heartbeat_at"]) == at(50)
    assert first["alive_lock_held"] is False
    assert data["instances"][1]["instance_id"] == str(stale.instance_id)
    assert data["instances"][1]["rows_held"]["inbox"] == 1
    assert data["tombstones"][0]["reason"] == "gone"
    assert isinstance(outbox["counts"]["pending"], int)
    assert isinstance(first["heartbeat_age_seconds"], float)


def test_text_output_is_a_table_of_categories_and_states(every_state, two_instances):
    make("outbox", stream="stuck-1", dead_lettered_at=T0, last_error="SMTP down\ntrace")
    make("outbox", stream="stuck-1")
    factories.EvictionFactory(evicted_at=T0, reason="gone")

    text = run_command()

    lines = text.splitlines()
    start = next(n for n, line in enumerate(lines) if line.split()[:1] == ["category"])
    end = lines.index("", start)  # the counts table ends at the first blank line
    header, *table = (line.split() for line in lines[start:end])
    assert header[1:10] == [
        "pending",
        "sched",
        "leased",
        "orphan",
        "done",
        "dead",
        "cancelled",
        "discarded",
        "total",
    ]
    rows = {cells[0]: cells[1:10] for cells in table}
    assert list(rows) == [*CATEGORIES, "total"]
    # outbox: every_state + two leased rows + the blocked stream's dead head and its follower;
    # inbox: every_state + an orphaned and an unowned row; receptor: + one leased row
    assert rows["outbox"] == ["2", "1", "3", "1", "1", "2", "1", "1", "12"]
    assert rows["inbox"] == ["2", "1", "1", "2", "1", "1", "1", "1", "10"]
    assert rows["perspective_event"] == ["1", "1", "1", "1", "1", "1", "1", "1", "8"]
    assert rows["receptor"] == ["1", "1", "2", "1", "1", "1", "1", "1", "9"]
    assert rows["total"] == ["6", "4", "7", "5", "4", "5", "4", "4", "39"]
    assert "blocked streams: 1" in text
    assert re.search(r"outbox\s+-\s+stuck-1\s+dead\s+0/10\s+1\s+-\s+SMTP down", text)
    assert "dead rows: 5 (outbox 2, inbox 1, perspective_event 1, receptor 1)" in text
    assert "instances: 2" in text
    # The real clock is months past T0: the instance is stale, holds no lock, no listener.
    assert re.search(r"web\s+a\s+11\s+.*ago\s+no\s+no\s+no\s+ok\s+outbox=2 receptor=1", text)
    assert "tombstones: 1" in text


def test_the_command_refuses_to_run_without_the_migrations():
    # DDL is transactional: the schema comes back when the test's transaction rolls back.
    run_sql("DROP SCHEMA workpump CASCADE")
    with pytest.raises(CommandError, match=re.escape(MISSING_MIGRATIONS)):
        run_command("--json")


# --- rows no live instance can run ----------------------------------------------------------


def advertising(topics: dict[str, list[str]] | None, *, heartbeat_at: datetime = NOW) -> None:
    """A live instance whose heartbeat metadata says what it claims (None: an older
    version that names only its categories)."""
    metadata: dict[str, Any] = {"categories": ["outbox", "inbox"]}
    if topics is not None:
        metadata["topics"] = topics
    factories.ServiceInstanceFactory(last_heartbeat_at=heartbeat_at, metadata=metadata)


def test_waiting_rows_whose_topic_no_live_instance_advertises_are_listed_by_topic():
    advertising({"outbox": ["emails.welcome"], "inbox": []})
    make("outbox", topic="emails.welcome", created_at=at(-10))
    make("outbox", topic="emails.new", created_at=at(-30))
    make("outbox", topic="emails.new", created_at=at(-20))
    make("inbox", topic="stripe.webhook", created_at=at(-5))
    make("outbox", topic="emails.gone", done_at=T0)  # done: not waiting
    make("outbox", topic="emails.held", instance_id=HOLDER, lease_expiry=FAR_FUTURE)

    unhandled = status.unhandled_topics(now=NOW)

    assert [(u.category, u.topic, u.rows, u.oldest_age_seconds) for u in unhandled] == [
        ("outbox", "emails.new", 2, 90.0),
        ("inbox", "stripe.webhook", 1, 65.0),
    ]


def test_flow_controlled_rows_no_live_instance_runs_are_listed_unless_a_lease_holds_them():
    """Flow-controlled heads are read from two indexes: the unleased (_flow) and the
    leased ones whose lease expired (_flowtimer); one an unexpired lease holds is not
    waiting."""
    advertising({"outbox": []})
    flow = {"flow_controlled": True, "fairness_key": "tenant"}
    make("outbox", topic="partner.call", created_at=at(-40), **flow)
    make(
        "outbox",
        topic="partner.call",
        created_at=at(-50),
        instance_id=HOLDER,
        lease_expiry=at(30),  # expired at NOW
        **flow,
    )
    make("outbox", topic="partner.held", instance_id=HOLDER, lease_expiry=FAR_FUTURE, **flow)

    unhandled = status.unhandled_topics(now=NOW)

    assert [(u.topic, u.rows, u.oldest_age_seconds) for u in unhandled] == [
        ("partner.call", 2, 110.0)
    ]


def test_an_instance_that_advertises_no_topics_runs_every_topic_of_its_categories():
    advertising(None)
    make("outbox", topic="emails.new")
    make("perspective_event", topic="totals")

    assert [(u.category, u.topic) for u in status.unhandled_topics(now=NOW)] == [
        ("perspective_event", "totals")
    ]


def test_a_stale_instances_topics_do_not_count():
    advertising({"outbox": ["emails.new"]}, heartbeat_at=at(-600))
    make("outbox", topic="emails.new")

    assert [(u.topic, u.rows) for u in status.unhandled_topics(now=NOW)] == [("emails.new", 1)]


def test_the_text_report_shows_the_rows_with_no_live_handler():
    advertising({"outbox": ["emails.welcome"]})
    make("outbox", topic="emails.new", created_at=at(-60))
    out = io.StringIO()

    call_command("workpump_status", stdout=out)

    text = out.getvalue()
    assert "no live handler: 1 rows" in text
    assert re.search(r"outbox\s+\|?\s*emails\.new", text), text


# --- workpump_status --check: a health check an orchestrator can call ----------------------


def check(*args: str) -> tuple[int, str]:
    out = io.StringIO()
    try:
        call_command("workpump_status", "--check", *args, stdout=out)
    except SystemExit as exc:
        return int(exc.code), out.getvalue().strip()
    return 0, out.getvalue().strip()


def fresh_instance(**fields: Any) -> Any:
    from django.utils import timezone

    return factories.ServiceInstanceFactory(last_heartbeat_at=timezone.now(), **fields)


@pytest.mark.django_db
def test_check_passes_with_a_live_instance_and_nothing_old():
    fresh_instance()
    assert check() == (0, "OK: 1 live instance")


@pytest.mark.django_db
def test_check_fails_with_no_live_instance():
    factories.ServiceInstanceFactory()  # last beat at T0: long stale
    assert check() == (1, "UNHEALTHY: No live workpump instance is registered.")


@pytest.mark.django_db
def test_check_of_this_host_fails_when_its_instance_is_missing_or_stale():
    import socket

    host = socket.gethostname()
    fresh_instance(host_name="another-host")
    code, line = check("--instance-of-this-host")
    assert (code, line) == (1, f"UNHEALTHY: No workpump instance of host {host} is registered.")

    stale = factories.ServiceInstanceFactory(host_name=host)
    code, line = check("--instance-of-this-host")
    assert code == 1
    assert line.startswith(f"UNHEALTHY: The workpump instance {stale.instance_id} of host")
    assert "is stale: its last heartbeat is" in line

    fresh_instance(host_name=host)
    assert check("--instance-of-this-host")[0] == 0


@pytest.mark.django_db
def test_check_fails_when_a_listener_has_been_down_too_long():
    down = fresh_instance(metadata={"listener": False, "listener_down_seconds": 90})
    code, line = check()
    assert code == 1
    assert line.startswith(f"UNHEALTHY: The NOTIFY listener of instance {down.instance_id}")
    assert "(bound 60 s)" in line
    assert check("--max-listener-down", "300")[0] == 0


@pytest.mark.django_db
def test_check_fails_when_the_oldest_pending_row_is_older_than_max_age():
    from datetime import timedelta

    from django.utils import timezone

    fresh_instance()
    factories.OutboxFactory(created_at=timezone.now() - timedelta(seconds=600))
    assert check()[0] == 0  # no bound given
    code, line = check("--max-age", "60")
    assert code == 1
    assert re.fullmatch(
        r"UNHEALTHY: The oldest pending outbox row is \d+ s old \(bound 60 s\)\.", line
    )


# --- workpump_status --database: one report per database shard -----------------------------


@pytest.mark.django_db(transaction=True, databases=["default", "second"])
def test_database_reports_on_another_database_alias():
    from django_workpump import models

    models.Outbox.objects.using("second").create(
        work_id=uuid.uuid4(), topic="shard.only", payload={}, created_at=T0
    )
    models.Outbox.objects.using("second").create(
        work_id=uuid.uuid4(), topic="shard.only", payload={}, created_at=T0,
        dead_lettered_at=T0, attempts=3,
    )  # fmt: skip
    make("outbox", topic="default.only")

    second = json.loads(run_command("--json", "--database", "second"))
    default = json.loads(run_command("--json"))

    assert second["categories"]["outbox"]["counts"]["pending"] == 1
    assert second["categories"]["outbox"]["counts"]["dead"] == 1
    assert default["categories"]["outbox"]["counts"]["pending"] == 1
    assert default["categories"]["outbox"]["counts"]["dead"] == 0
    text = run_command("--database", "second")
    assert "dead rows: 1 (outbox 1)" in text
    assert "shard.only" in text
    assert "default.only" not in text
    assert check("--database", "second")[0] == 1  # no instance there


def test_database_must_name_a_django_database():
    with pytest.raises(CommandError, match=r"--database 'shard9' is not a Django database; "):
        run_command("--database", "shard9")
