"""Hostile values written through SQL, as anyone with access to the tables could: each
affects its own row only. A JSON column Python cannot decode (headers, result, metadata,
a schedule's payload) or a time Python cannot hold ('infinity', past year 9999) fails
no claim, no batch-mate, no admin page and no status report; the admin and the report
show such a value as stored.
"""

from __future__ import annotations

import io
import json
import threading
import uuid
from collections.abc import Iterator
from contextlib import nullcontext
from datetime import datetime, timedelta, timezone
from typing import Any

import psycopg
import pytest
from django.contrib.auth.models import User
from django.core.exceptions import ImproperlyConfigured
from django.core.management import call_command
from django.db import DataError, connection, transaction
from django.test import Client, override_settings
from django.test.utils import CaptureQueriesContext

import django_workpump as workpump
from django_workpump import db, models, status, testing
from django_workpump.payloads import StoredJSON
from django_workpump.periodic import InvalidSchedule, ScheduleRegistry, build_schedule, schedules
from django_workpump.producer import InvalidWork
from django_workpump.pump.claim import ClaimPolicy, ClaimWorker
from django_workpump.pump.coordinator import DatabaseCoordinator, InstanceIdentity
from django_workpump.pump.periodic import PeriodicWorker
from django_workpump.pump.supervisor import EXIT_OK
from django_workpump.registry import registry
from tests.fakes import FakeSink
from tests.helpers import FAST_PUMP, T0, drain, run_sql, scalar

# Past Python's recursion limit for json.loads (3.11/3.12 fail near 1,000 levels).
LEVELS = 3000
DEEP_OBJECT = '{"a": ' * LEVELS + "1" + "}" * LEVELS
OUTBOX_URL = "/admin/workpump/outbox/"


def write(column: str, value: str, message_id: uuid.UUID, cast: str = "jsonb") -> None:
    """Overwrite one column of an outbox row through SQL, past every producer check."""
    run_sql(
        f"UPDATE workpump_outbox SET {column} = %s::{cast} WHERE work_id = %s",
        [value, message_id],
    )


@pytest.fixture
def admin_client() -> Client:
    user = User.objects.create_superuser("root", password="pw")
    client = Client(raise_request_exception=True)
    client.force_login(user)
    return client


@pytest.fixture
def recorded() -> Iterator[list[tuple[Any, Any]]]:
    """A handler for hv.good that records (payload, headers) of each run."""
    seen: list[tuple[Any, Any]] = []
    lock = threading.Lock()

    def handle(work: Any) -> None:
        with lock:
            seen.append((work.payload, work.headers))

    workpump.outbox_handler("hv.good")(handle)
    yield seen
    registry.unregister("outbox", "hv.good")


# -- JSON columns --------------------------------------------------------------------------


@pytest.mark.django_db
def test_a_claim_reads_deep_headers_as_none_for_their_row_alone():
    good = [workpump.send("hv.good", {"n": n}, headers={"k": "v"}) for n in range(3)]
    deep = workpump.send("hv.good", {"n": 9})
    write("headers", DEEP_OBJECT, deep)
    instance_id = uuid.uuid4()
    scalar("SELECT workpump.record_heartbeat(%s, 'tests', 'host', 1)", [instance_id])

    rows = db.claim_work(instance_id=instance_id, max_rows=10, lease_seconds=300,
                         partition_count=10_000)  # fmt: skip

    by_id = {row.work_id: row for row in rows}
    assert set(by_id) == {*good, deep}
    assert [by_id[i].headers for i in good] == [{"k": "v"}] * 3
    assert all(by_id[i].headers_error is None for i in good)
    assert by_id[deep].headers is None
    assert by_id[deep].payload == {"n": 9}  # the work itself is intact
    assert f"{LEVELS} levels deep" in str(by_id[deep].headers_error)


@pytest.mark.django_db
def test_the_claim_worker_runs_a_row_with_deep_headers_without_them_and_warns(caplog):
    good = [workpump.send("hv.good", {"n": n}) for n in range(3)]
    deep = workpump.send("hv.good", {"n": 9})
    write("headers", DEEP_OBJECT, deep)
    sink = FakeSink(free=10)
    coordinator = DatabaseCoordinator(InstanceIdentity())
    coordinator.heartbeat({})

    with caplog.at_level("WARNING", logger="django_workpump.claim"):
        result = ClaimWorker(coordinator, sink, ClaimPolicy()).run_once()

    assert result.error is None and result.claimed == 4
    (batch,) = sink.batches
    assert {row.work_id for row in batch} == {*good, deep}
    warnings = [r for r in caplog.records if getattr(r, "action", "") == "unreadable_headers"]
    assert [r.workpump_id for r in warnings] == [str(deep)]
    assert "runs without its headers" in warnings[0].getMessage()


@pytest.mark.django_db(transaction=True)
@override_settings(WORKPUMP={**FAST_PUMP, "CONCURRENCY": 4})
def test_a_pump_completes_the_clean_batch_mates_of_a_deep_headers_row(recorded, pump):
    good = [workpump.send("hv.good", {"n": n}, stream=f"s-{n % 2}") for n in range(6)]
    deep = workpump.send("hv.good", {"n": 9}, stream="s-0")
    write("headers", DEEP_OBJECT, deep)

    assert drain(pump(drain=True)) == EXIT_OK

    done = models.Outbox.objects.filter(done_at__isnull=False, dead_lettered_at=None)
    assert set(done.values_list("work_id", flat=True)) == {*good, deep}
    assert set(done.values_list("attempts", flat=True)) == {1}
    assert sorted(payload["n"] for payload, _ in recorded) == [0, 1, 2, 3, 4, 5, 9]
    assert [headers for payload, headers in recorded if payload["n"] == 9] == [None]


@pytest.mark.django_db
def test_run_pending_runs_the_rows_around_deep_headers_and_parks_an_undecodable_payload(
    recorded,
):
    good = [workpump.send("hv.good", {"n": n}) for n in range(3)]
    deep_headers = workpump.send("hv.good", {"n": 9})
    write("headers", DEEP_OBJECT, deep_headers)
    deep_payload = workpump.send("hv.good", {"n": 10})
    write("payload", DEEP_OBJECT, deep_payload)

    assert testing.run_pending() == 4

    assert sorted(payload["n"] for payload, _ in recorded) == [0, 1, 2, 9]
    parked = models.Outbox.objects.get(work_id=deep_payload)
    assert (parked.failure_reason, parked.attempts) == ("undecodable_payload", 1)
    assert parked.dead_lettered_at is not None
    done = models.Outbox.objects.filter(done_at__isnull=False)
    assert set(done.values_list("work_id", flat=True)) == {*good, deep_headers}


@pytest.mark.django_db
@pytest.mark.parametrize("column", ["headers", "result"])
def test_the_admin_pages_of_a_row_with_a_deep_json_column_answer_and_show_it_as_stored(
    admin_client, column
):
    clean = workpump.send("hv.good", {"n": 1})
    hostile = workpump.send("hv.good", {"n": 2})
    write(column, DEEP_OBJECT, hostile)

    for url in [OUTBOX_URL, f"{OUTBOX_URL}?state=pending"]:
        listing = admin_client.get(url)
        assert listing.status_code == 200
        assert {str(clean), str(hostile)} <= set(listing.content.decode().split('"'))
    pk = models.Outbox.objects.only("seq").get(work_id=hostile).pk
    page = admin_client.get(f"{OUTBOX_URL}{pk}/change/")
    assert page.status_code == 200
    if column == "result":
        html = page.content.decode()
        assert "Shown as stored: this value cannot be decoded" in html
        assert "Its first 10,000 characters:" in html
        assert DEEP_OBJECT[:200].replace('"', "&quot;") in html


@pytest.mark.django_db
def test_a_model_reads_an_undecodable_json_column_as_its_stored_text():
    message_id = workpump.send("hv.good", {"n": 1})
    write("result", DEEP_OBJECT, message_id)
    huge = '{"big": ' + "9" * 5000 + "}"  # past the int-string digit limit
    write("headers", huge, message_id)

    row = models.Outbox.objects.get(work_id=message_id)

    assert isinstance(row.result, StoredJSON) and row.result == DEEP_OBJECT
    assert f"{LEVELS} levels deep" in row.result.error
    assert isinstance(row.headers, StoredJSON) and row.headers == huge
    assert row.payload == {"n": 1}


@pytest.mark.django_db
def test_the_admin_and_status_answer_with_deep_instance_metadata_and_schedule_payload(
    admin_client,
):
    instance_id = uuid.uuid4()
    scalar("SELECT workpump.record_heartbeat(%s, 'tests', 'host', 1)", [instance_id])
    run_sql(
        "UPDATE workpump_service_instance SET metadata = %s::jsonb WHERE instance_id = %s",
        ['{"stalled_flushers": ' + DEEP_OBJECT + "}", instance_id],
    )
    run_sql(
        "INSERT INTO workpump_periodic_schedule (name, every_seconds, timezone, catch_up,"
        " payload, priority, max_attempts) VALUES ('hv.deep', 60, 'UTC', 'latest', %s::jsonb,"
        " 0, 3)",
        [DEEP_OBJECT],
    )

    assert admin_client.get("/admin/workpump/serviceinstance/").status_code == 200
    assert admin_client.get("/admin/workpump/serviceinstance/summary/").status_code == 200
    assert admin_client.get("/admin/workpump/periodicschedule/").status_code == 200
    page = admin_client.get("/admin/workpump/periodicschedule/hv.deep/change/")
    assert page.status_code == 200
    assert "this value cannot be decoded" in page.content.decode()
    (mine,) = [i for i in status.collect().instances if i.instance_id == instance_id]
    assert list(mine.stalled_flushers) == ["unreadable"]
    assert f"{LEVELS} levels deep" in mine.stalled_flushers["unreadable"]["last_error"]


# -- times past year 9999 ------------------------------------------------------------------

LAST_DAY_WEST = datetime.max.replace(tzinfo=timezone(timedelta(hours=-14)))  # 10000 in UTC


def producer_calls() -> list[Any]:
    return [
        lambda when: workpump.send("hv.good", {"n": 1}, run_after=when),
        lambda when: workpump.receive(uuid.uuid4(), "hv.in", {"n": 1}, run_after=when),
        lambda when: workpump.send_many("hv.good", [{"n": 1}], run_after=when),
    ]


@pytest.mark.django_db
@pytest.mark.parametrize("call", producer_calls(), ids=["send", "receive", "send_many"])
def test_producers_refuse_a_run_after_past_year_9999_in_utc(call):
    with pytest.raises(InvalidWork, match=r"past year 9999 in UTC"):
        call(LAST_DAY_WEST)
    call(datetime(9999, 12, 31, 9, 0, tzinfo=timezone(timedelta(hours=-14))))  # 23:00 UTC
    assert models.Outbox.objects.count() + models.Inbox.objects.count() == 1


SQL_SENDS = {
    "send": "SELECT workpump.send('hv.good', '{}'::jsonb, p_scheduled_for => %s)",
    "receive": "SELECT workpump.receive(gen_random_uuid(), 'hv.in', '{}'::jsonb,"
    " p_scheduled_for => %s)",
    "send_many": "SELECT workpump.send_many('hv.good', ARRAY['{}'::jsonb], p_scheduled_for => %s)",
}


@pytest.mark.django_db
@pytest.mark.parametrize("function", list(SQL_SENDS))
@pytest.mark.parametrize(
    "when", ["infinity", "-infinity", "10000-01-01 00:00:00+00", "0001-12-31 23:00:00+00 BC"]
)
def test_the_sql_producers_refuse_a_scheduled_for_outside_years_1_to_9999(function, when):
    with pytest.raises(DataError) as raised, transaction.atomic():
        run_sql(SQL_SENDS[function], [when])
    error = raised.value.__cause__
    assert isinstance(error, psycopg.Error)
    assert error.sqlstate == "22023"  # invalid_parameter_value
    assert "outside years 1 to 9999 (UTC)" in str(error)
    run_sql(SQL_SENDS[function], ["9999-12-31 23:59:59+00"])  # the last second is fine


@pytest.mark.django_db
@pytest.mark.parametrize("logged", [False, True], ids=["kept-cursor", "django-cursor"])
def test_a_claim_reads_a_created_at_past_year_9999_as_unknown_for_its_row_alone(logged):
    good = [workpump.send("hv.good", {"n": n}) for n in range(3)]
    hostile = workpump.send("hv.good", {"n": 9})
    write("created_at", "infinity", hostile, cast="timestamptz")
    instance_id = uuid.uuid4()
    scalar("SELECT workpump.record_heartbeat(%s, 'tests', 'host', 1)", [instance_id])

    with CaptureQueriesContext(connection) if logged else nullcontext():
        rows = db.claim_work(instance_id=instance_id, max_rows=10, lease_seconds=300,
                             partition_count=10_000)  # fmt: skip

    by_id = {row.work_id: row for row in rows}
    assert set(by_id) == {*good, hostile}
    assert (by_id[hostile].created_at, by_id[hostile].due_at) == (None, None)
    assert all(isinstance(by_id[i].created_at, datetime) for i in good)


@pytest.mark.django_db
def test_unique_for_past_a_century_is_refused_with_a_clear_error():
    with pytest.raises(InvalidWork, match=r"longer than the 36525 days \(100 years\)"):
        workpump.send("hv.good", {"n": 1}, unique_key="k", unique_for=timedelta.max)
    workpump.send("hv.good", {"n": 1}, unique_key="k", unique_for=timedelta(days=36_525))


def test_a_periodic_every_past_ten_years_is_refused_at_registration():
    with pytest.raises(InvalidSchedule, match=r"must be at most 3650 days"):
        workpump.periodic("hv.rare", every=timedelta(days=999_999_999))
    assert schedules.get("hv.rare") is None


@pytest.mark.django_db
@pytest.mark.parametrize("when", ["infinity", "10000-01-01 00:00:00+00"])
def test_the_admin_and_status_show_a_stored_time_past_year_9999_as_stored(admin_client, when):
    clean = workpump.send("hv.good", {"n": 1}, stream="s")
    hostile = workpump.send("hv.good", {"n": 2}, stream="t")
    write("scheduled_for", when, hostile, cast="timestamptz")
    run_sql("UPDATE workpump_outbox SET attempts = 1 WHERE work_id = %s", [hostile])
    shown = scalar("SELECT %s::timestamptz::text", [when])

    for url in [OUTBOX_URL, f"{OUTBOX_URL}?state=scheduled", f"{OUTBOX_URL}?state=pending"]:
        assert admin_client.get(url).status_code == 200
    listing = admin_client.get(f"{OUTBOX_URL}?state=scheduled").content.decode()
    assert str(hostile) in listing and str(clean) not in listing
    assert shown in listing
    pk = models.Outbox.objects.only("seq").get(work_id=hostile).pk
    page = admin_client.get(f"{OUTBOX_URL}{pk}/change/")
    assert page.status_code == 200 and shown in page.content.decode()
    assert admin_client.get("/admin/workpump/serviceinstance/summary/").status_code == 200

    report = status.collect()
    (blocked,) = report.blocked_streams
    assert blocked.retry_at == shown
    out = io.StringIO()
    call_command("workpump_status", stdout=out)
    assert shown in out.getvalue()


@pytest.mark.django_db
def test_the_schedule_pages_show_a_stored_time_past_year_9999_as_stored(admin_client):
    run_sql(
        "INSERT INTO workpump_periodic_schedule (name, every_seconds, timezone, catch_up,"
        " payload, priority, max_attempts, next_fire_at, last_slot) VALUES ('hv.late', 60,"
        " 'UTC', 'latest', '{}', 0, 3, 'infinity', '10000-06-01 00:00:00+00')"
    )

    listing = admin_client.get("/admin/workpump/periodicschedule/")
    assert listing.status_code == 200 and "infinity" in listing.content.decode()
    page = admin_client.get("/admin/workpump/periodicschedule/hv.late/change/")
    assert page.status_code == 200
    (schedule,) = status.collect().periodic
    assert schedule.next_fire_at == "infinity"
    out = io.StringIO()
    call_command("workpump_status", stdout=out)
    assert "infinity" in out.getvalue()


@pytest.mark.django_db
def test_a_schedule_with_a_stored_time_past_year_9999_fails_its_own_pass_alone():
    found = ScheduleRegistry()
    for name in ("hv.every", "hv.late"):
        found.register(
            build_schedule(name, cron=None, every=timedelta(seconds=60), tz=None, payload=None,
                           catch_up="latest", priority=0, max_attempts=None)
        )  # fmt: skip
    worker = PeriodicWorker(
        alias="default",
        partition_count=10_000,
        max_payload_bytes=1_048_576,
        default_max_attempts=10,
        registry=found,
    )
    worker.register(now=T0)
    run_sql(
        "UPDATE workpump_periodic_schedule SET last_slot = 'infinity',"
        " created_at = '10000-01-01 00:00:00+00' WHERE name = 'hv.late'"
    )

    result = worker.run_once(now=T0 + timedelta(minutes=5))

    assert result.failed == ["hv.late"]
    assert models.Outbox.objects.filter(topic="hv.every").count() == 1
    assert models.Outbox.objects.filter(topic="hv.late").count() == 0


def strict_json(text: str) -> Any:
    """``text`` decoded as strict JSON: Infinity and NaN are no JSON numbers."""

    def refuse(constant: str) -> None:
        raise ValueError(f"{constant} is not JSON")

    return json.loads(text, parse_constant=refuse)


@pytest.mark.django_db
def test_workpump_status_json_stays_strict_json_beside_an_infinite_created_at():
    hostile = workpump.send("hv.good", {"n": 1})
    write("created_at", "-infinity", hostile, cast="timestamptz")

    out = io.StringIO()
    call_command("workpump_status", "--json", stdout=out)

    report = strict_json(out.getvalue())
    assert report["categories"]["outbox"]["counts"]["pending"] == 1
    assert report["categories"]["outbox"]["oldest_pending_age_seconds"] is None
    (unhandled,) = report["no_live_handler"]
    assert unhandled["oldest_age_seconds"] is None
    text = io.StringIO()
    call_command("workpump_status", stdout=text)
    assert "forever" in text.getvalue()


# -- control characters in topics -------------------------------------------------------------

FORGED = "x\n\x1b[32mHEALTHY\x1b[0m"


@pytest.mark.parametrize(
    "register",
    [
        lambda: workpump.outbox_handler(FORGED)(lambda work: None),
        lambda: workpump.inbox_handler("a\u202eb")(lambda work: None),
        lambda: workpump.perspective("hv.totals", events=["e\rvent"])(lambda work: None),
    ],
    ids=["outbox", "bidi-override", "event"],
)
def test_registration_refuses_topics_with_control_characters(register):
    with pytest.raises(ImproperlyConfigured, match=r"has a control character \(U\+[0-9A-F]{4}\)"):
        register()
    assert registry.get("outbox", FORGED) is None


@pytest.mark.django_db
@pytest.mark.parametrize(
    "call",
    [
        lambda: workpump.send(FORGED, {"n": 1}),
        lambda: workpump.receive(uuid.uuid4(), "in\tbox", {"n": 1}),
        lambda: workpump.emit("ev\x1b", {"n": 1}),
        lambda: workpump.send_many("a\x85b", [{"n": 1}]),
    ],
    ids=["send", "receive", "emit", "send_many"],
)
def test_producers_refuse_topics_with_control_characters(call):
    with pytest.raises(InvalidWork, match=r"has a control character .* printable text"):
        call()
    assert models.Outbox.objects.count() == 0


@pytest.mark.django_db
def test_workpump_status_escapes_a_hostile_topic_written_through_sql():
    message_id = workpump.send("hv.good", {"n": 1})
    run_sql(
        "UPDATE workpump_outbox SET topic = %s, dead_lettered_at = now(), attempts = 1,"
        " last_error = %s WHERE work_id = %s",
        [FORGED, "boom\x1b[2J", message_id],
    )

    out = io.StringIO()
    call_command("workpump_status", stdout=out)
    text = out.getvalue()

    assert "\x1b" not in text and "\\x1b[32mHEALTHY\\x1b[0m" in text
    assert "x\\n\\x1b" in text  # the newline is escaped: no line of its own
    assert not any(line.lstrip().startswith("HEALTHY") for line in text.splitlines())
    out = io.StringIO()
    call_command("workpump_status", "--json", stdout=out)
    assert "\x1b" not in out.getvalue() and "\n" not in out.getvalue().strip()


def test_printable_escapes_control_and_format_characters_only():
    assert status.printable("ok é ✓") == "ok é ✓"
    assert status.printable("a\nb\x1b[0m\u202ec\x00") == "a\\nb\\x1b[0m\\u202ec\\x00"


@pytest.mark.django_db
def test_workpump_action_selects_rows_beside_a_hostile_one_and_escapes_its_topic():
    clean = workpump.send("hv.good", {"n": 1})
    hostile = workpump.send("hv.good", {"n": 2})
    run_sql(
        "UPDATE workpump_outbox SET topic = %s, created_at = 'infinity',"
        " scheduled_for = now() + interval '1 hour' WHERE work_id = %s",
        [FORGED, hostile],
    )
    run_sql(
        "UPDATE workpump_outbox SET scheduled_for = now() + interval '1 hour' WHERE work_id = %s",
        [clean],
    )

    out = io.StringIO()
    call_command("workpump_action", "retry", str(clean), str(hostile), stdout=out)

    text = out.getvalue()
    assert "\x1b" not in text and "x\\n\\x1b[32mHEALTHY" in text
    assert models.Outbox.objects.filter(scheduled_for__isnull=True).count() == 2
