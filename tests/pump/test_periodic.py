"""Periodic work (docs/periodic.md): slot arithmetic, the SQL race, the worker's catch-up
rules, pausing, DST, and three workers over the same slots.

SQL and worker passes run with a pinned ``p_now`` (``run_once(now=...)``); the threaded
test runs three workers on their own connections against the same schedule rows.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from zoneinfo import ZoneInfo

import pytest
from django.core.management import call_command
from django.db import connections

import django_workpump as workpump
from django_workpump import db, models
from django_workpump.periodic import (
    InvalidSchedule,
    Schedule,
    ScheduleRegistry,
    build_schedule,
    schedules,
    slot_text,
)
from django_workpump.pump.periodic import SLOT_MARGIN_SECONDS, PeriodicWorker
from django_workpump.registry import registry
from tests.helpers import T0, at, run_sql, scalar

BERLIN = ZoneInfo("Europe/Berlin")


def schedule(name: str = "reports.tick", **options: object) -> Schedule:
    defaults: dict[str, object] = {
        "cron": None,
        "every": None,
        "tz": None,
        "payload": None,
        "catch_up": "latest",
        "priority": 0,
        "max_attempts": None,
    }
    return build_schedule(name, **(defaults | options))  # type: ignore[arg-type]


def worker(*defined: Schedule, batch: int = 100) -> PeriodicWorker:
    found = ScheduleRegistry()
    for s in defined:
        found.register(s)
    return PeriodicWorker(
        alias="default",
        partition_count=10_000,
        max_payload_bytes=1_048_576,
        default_max_attempts=10,
        registry=found,
        catch_up_batch=batch,
    )


def rows(name: str = "reports.tick") -> list[models.Outbox]:
    return list(models.Outbox.objects.filter(topic=name).order_by("seq"))


def slots_of(name: str = "reports.tick") -> list[str]:
    return [row.payload["slot"] for row in rows(name)]


def iso(seconds: float) -> str:
    return slot_text(at(seconds))


# --- slot arithmetic ------------------------------------------------------------------


def test_every_slots_are_aligned_to_the_epoch():
    s = schedule(every=timedelta(seconds=90))
    after = datetime(2026, 1, 1, 0, 0, 10, tzinfo=UTC)
    # 2026-01-01T00:00:00Z is 1767225600 s after the epoch, a multiple of 90 s
    assert s.next_after(after) == datetime(2026, 1, 1, 0, 1, 30, tzinfo=UTC)
    assert s.latest_at_or_before(after) == datetime(2026, 1, 1, tzinfo=UTC)
    assert s.latest_at_or_before(datetime(2026, 1, 1, tzinfo=UTC)) == datetime(
        2026, 1, 1, tzinfo=UTC
    )
    assert s.next_after(datetime(2026, 1, 1, tzinfo=UTC)) == datetime(
        2026, 1, 1, 0, 1, 30, tzinfo=UTC
    )


def test_cron_slots_are_inclusive_at_now_and_exclusive_after():
    s = schedule(cron="0 12 * * *")
    assert s.latest_at_or_before(T0) == T0
    assert s.latest_at_or_before(at(-1)) == T0 - timedelta(days=1)
    assert s.next_after(T0) == T0 + timedelta(days=1)


def test_cron_in_berlin_across_spring_forward_and_fall_back():
    s = schedule(cron="30 2 * * *", tz="Europe/Berlin")
    # 2026-03-29: 02:00 CET jumps to 03:00 CEST; 02:30 does not exist and fires at 03:00
    spring = [slot_text(x) for x in _take(s, datetime(2026, 3, 27, 12, tzinfo=UTC), 4)]
    assert spring == [
        "2026-03-28T01:30:00Z",  # 02:30 CET
        "2026-03-29T01:00:00Z",  # 03:00 CEST, the first minute after the gap
        "2026-03-30T00:30:00Z",  # 02:30 CEST
        "2026-03-31T00:30:00Z",
    ]
    # 2026-10-25: 03:00 CEST falls back to 02:00 CET; 02:30 happens twice, fires once
    autumn = [slot_text(x) for x in _take(s, datetime(2026, 10, 23, 12, tzinfo=UTC), 4)]
    assert autumn == [
        "2026-10-24T00:30:00Z",  # 02:30 CEST
        "2026-10-25T00:30:00Z",  # the first 02:30 (CEST) only
        "2026-10-26T01:30:00Z",  # 02:30 CET
        "2026-10-27T01:30:00Z",
    ]


def _take(s: Schedule, after: datetime, count: int) -> list[datetime]:
    found = []
    for slot in s.slots_after(after):
        found.append(slot)
        if len(found) == count:
            return found
    raise AssertionError("endless iterator ended")


BAD_SCHEDULES = [
    ({}, "needs exactly one of cron= and every=, got neither"),
    (
        {"cron": "* * * * *", "every": timedelta(minutes=1)},
        "exactly one of cron= and every=, not both",
    ),
    ({"cron": "61 * * * *"}, r"cron= \('61 \* \* \* \*'\) is not a valid cron expression"),
    ({"cron": "* * * *"}, "is not a 5-field cron expression. Use five fields"),
    ({"cron": "0 * * * * *"}, "is not a 5-field cron expression"),
    (
        {"every": timedelta(milliseconds=500)},
        r"every= \(0:00:00.500000\) must be at least one second",
    ),
    ({"every": timedelta(seconds=1.5)}, "must be a whole number of seconds"),
    ({"every": 60}, "every= must be a datetime.timedelta, not 60"),
    ({"every": timedelta(minutes=1), "tz": "UTC"}, "tz= applies to cron= only"),
    ({"cron": "0 3 * * *", "tz": "Mars/Olympus"}, r"tz= \('Mars/Olympus'\) is not a known IANA"),
    ({"cron": "0 3 * * *", "catch_up": "some"}, r"catch_up= \('some'\) must be one of 'latest'"),
    ({"cron": "0 3 * * *", "payload": {"slot": 1}}, "may not have a 'slot' key"),
    ({"cron": "0 3 * * *", "payload": {"when": datetime.now()}}, "payload= is not JSON"),
    ({"cron": "0 3 * * *", "max_attempts": 0}, "max_attempts= must be a whole number >= 1"),
]


@pytest.mark.parametrize(("options", "message"), BAD_SCHEDULES)
def test_bad_schedules_are_refused_at_decoration_with_the_fix(options, message):
    with pytest.raises(InvalidSchedule, match=message) as raised:
        workpump.periodic("bad.schedule", **options)
    assert isinstance(raised.value, ValueError)
    assert str(raised.value).startswith("Periodic schedule 'bad.schedule'")
    assert registry.get("outbox", "bad.schedule") is None


def test_the_decorator_registers_an_outbox_handler_and_a_schedule():
    try:

        @workpump.periodic("reports.nightly", cron="0 3 * * *", tz="Europe/Berlin", max_attempts=3)
        async def nightly(work):
            return work.payload["slot"]

        handler = registry.get("outbox", "reports.nightly")
        assert handler is not None and handler.func is nightly and handler.is_async
        assert handler.max_attempts == 3
        found = schedules.get("reports.nightly")
        assert found is not None and found.describe() == "cron 0 3 * * * (Europe/Berlin)"
    finally:
        registry.unregister("outbox", "reports.nightly")
        schedules.unregister("reports.nightly")


# --- the SQL functions ------------------------------------------------------------------


def upsert(name: str = "reports.tick", *, now=T0, **fields: object) -> bool:
    values: dict[str, object] = {
        "cron": None,
        "every_seconds": 60,
        "timezone": "UTC",
        "catch_up": "latest",
        "payload_json": '{"report": "daily"}',
        "priority": 5,
        "max_attempts": 3,
        "next_fire_at": None,
    }
    return db.upsert_periodic(name=name, now=now, **(values | fields))  # type: ignore[arg-type]


def fire(slot: datetime, *, now: datetime, name: str = "reports.tick"):
    return db.fire_periodic(
        name=name,
        slot=slot,
        next_fire_at=None,
        partition_count=10_000,
        max_payload_bytes=1_048_576,
        now=now,
    )


@pytest.mark.django_db
def test_fire_periodic_sends_each_slot_once_through_send():
    assert upsert() is True
    assert upsert(now=at(1)) is False  # a second registration keeps the row
    message_id = fire(at(60), now=at(61))
    assert message_id is not None
    assert fire(at(60), now=at(62)) is None, "the same slot twice"
    assert fire(at(0), now=at(62)) is None, "an earlier slot"
    assert fire(at(180), now=at(62)) is None, "a slot in the future"
    (row,) = rows()
    assert row.work_id == message_id
    assert row.payload == {"report": "daily", "slot": "2026-01-01T12:01:00Z"}
    assert (row.priority, row.max_attempts, row.stream, row.stream_head) == (5, 3, None, True)
    state = models.PeriodicSchedule.objects.get(name="reports.tick")
    assert (state.last_slot, state.last_fired_at, state.last_message_id) == (
        at(60),
        at(61),
        message_id,
    )
    assert fire(at(120), now=at(125)) is not None
    assert slots_of() == [iso(60), iso(120)]


@pytest.mark.django_db
def test_a_paused_schedule_fires_nothing_and_skip_moves_its_last_slot():
    upsert()
    assert db.pause_periodic(names=["reports.tick", "unknown"], paused=True, now=at(1)) == [
        "reports.tick"
    ]
    assert db.pause_periodic(names=["reports.tick"], paused=True) == []  # already paused
    assert fire(at(60), now=at(61)) is None
    assert db.skip_periodic(name="reports.tick", slot=at(60), next_fire_at=at(120), now=at(61))
    assert not db.skip_periodic(name="reports.tick", slot=at(60), next_fire_at=None, now=at(61))
    assert rows() == []
    db.pause_periodic(names=["reports.tick"], paused=False)
    assert fire(at(120), now=at(121)) is not None
    assert slots_of() == [iso(120)]


@pytest.mark.django_db
def test_a_registration_updates_the_definition_but_keeps_the_race_state():
    upsert()
    fire(at(60), now=at(61))
    db.pause_periodic(names=["reports.tick"], paused=True)
    upsert(now=at(100), every_seconds=None, cron="*/5 * * * *", payload_json="{}")
    state = models.PeriodicSchedule.objects.get(name="reports.tick")
    assert (state.cron, state.every_seconds, state.payload) == ("*/5 * * * *", None, {})
    assert (state.last_slot, state.paused, state.created_at) == (at(60), True, T0)
    assert (state.registered_at, state.updated_at) == (at(100), at(100))


@pytest.mark.django_db
def test_fire_periodic_can_be_called_by_hand_with_defaults():
    upsert()
    message_id = scalar(
        "SELECT workpump.fire_periodic('reports.tick', %s, p_now => %s)", (at(60), at(60))
    )
    assert rows()[0].work_id == message_id


# --- the worker's passes ------------------------------------------------------------------


@pytest.mark.django_db
def test_a_new_schedule_fires_from_its_first_slot_after_registration():
    w = worker(schedule(every=timedelta(minutes=1)))
    assert w.register(now=at(30)) == ["reports.tick"]
    result = w.run_once(now=at(59))
    assert result.fired == {} and result.next_due == at(60)
    assert w.wait_seconds(result) == pytest.approx(1 + SLOT_MARGIN_SECONDS)
    assert w.run_once(now=at(60)).fired == {"reports.tick": [at(60)]}
    assert w.run_once(now=at(61)).fired == {}
    assert slots_of() == [iso(60)]


@pytest.mark.django_db
def test_a_schedule_registered_while_the_pump_runs_is_picked_up():
    w = worker(schedule(every=timedelta(minutes=1)))
    assert w.run_once(now=at(30)).next_due == at(60)  # upserted on the way
    assert w.run_once(now=at(60)).fired == {"reports.tick": [at(60)]}


@pytest.mark.django_db
def test_catch_up_latest_fires_the_most_recent_missed_slot_once():
    w = worker(schedule(every=timedelta(minutes=1), catch_up="latest"))
    w.register(now=T0)
    w.run_once(now=at(60))
    # down from 01:05 until 10:05: nine slots missed
    result = w.run_once(now=at(605))
    assert result.fired == {"reports.tick": [at(600)]}
    assert result.next_due == at(660)
    assert slots_of() == [iso(60), iso(600)]


@pytest.mark.django_db
def test_catch_up_none_skips_missed_slots_but_fires_one_due_now():
    w = worker(schedule(every=timedelta(minutes=1), catch_up="none"))
    w.register(now=T0)
    result = w.run_once(now=at(630))  # 10:00 is 30 s old: missed
    assert result.fired == {} and result.skipped == {"reports.tick": [at(600)]}
    assert w.run_once(now=at(662)).fired == {"reports.tick": [at(660)]}  # 2 s late: due now
    assert slots_of() == [iso(660)]
    assert models.PeriodicSchedule.objects.get().last_slot == at(660)


@pytest.mark.django_db
def test_catch_up_all_fires_every_missed_slot_in_order():
    w = worker(schedule(every=timedelta(minutes=1), catch_up="all"))
    w.register(now=T0)
    result = w.run_once(now=at(300))
    assert result.fired == {"reports.tick": [at(60 * n) for n in range(1, 6)]}
    assert slots_of() == [iso(60 * n) for n in range(1, 6)]


@pytest.mark.django_db
def test_catch_up_all_is_bounded_per_pass_and_says_so(caplog):
    w = worker(schedule(every=timedelta(minutes=1), catch_up="all"), batch=5)
    w.register(now=T0)
    with caplog.at_level(logging.WARNING, logger="django_workpump.periodic"):
        first = w.run_once(now=at(12 * 60 + 1))
    assert first.fired["reports.tick"] == [at(60 * n) for n in range(1, 6)]
    assert first.next_due == first.now, "a backlog is due at once"
    assert w.wait_seconds(first) == pytest.approx(SLOT_MARGIN_SECONDS)
    (record,) = caplog.records
    assert record.action == "periodic_catch_up_bound"
    assert record.getMessage() == (
        "periodic schedule reports.tick: catch_up='all' fired 5 missed slots this pass, the "
        "most one pass fires (up to 2026-01-01T12:05:00Z); the older backlog continues from "
        "2026-01-01T12:06:00Z in the next pass. Use catch_up='latest' to fire only the last "
        "missed slot after downtime."
    )
    second = w.run_once(now=at(12 * 60 + 2))
    third = w.run_once(now=at(12 * 60 + 3))
    assert second.fired["reports.tick"] == [at(60 * n) for n in range(6, 11)]
    assert third.fired["reports.tick"] == [at(660), at(720)]
    assert third.next_due == at(780)
    assert slots_of() == [iso(60 * n) for n in range(1, 13)]


@pytest.mark.django_db
def test_a_paused_schedule_fires_nothing_and_does_not_catch_up_after_resuming():
    w = worker(schedule(every=timedelta(minutes=1), catch_up="all"))
    w.register(now=T0)
    db.pause_periodic(names=["reports.tick"], paused=True)
    for minute in range(1, 6):
        result = w.run_once(now=at(60 * minute + 1))
        assert result.fired == {}
    assert rows() == []
    assert models.PeriodicSchedule.objects.get().last_slot == at(300)
    db.pause_periodic(names=["reports.tick"], paused=False)
    assert w.run_once(now=at(301)).fired == {}
    assert w.run_once(now=at(360)).fired == {"reports.tick": [at(360)]}


@pytest.mark.django_db
@pytest.mark.parametrize(
    ("start", "expected"),
    [
        pytest.param(
            datetime(2026, 3, 27, 12, tzinfo=UTC),
            ["2026-03-28T01:30:00Z", "2026-03-29T01:00:00Z", "2026-03-30T00:30:00Z"],
            id="spring-forward",
        ),
        pytest.param(
            datetime(2026, 10, 23, 12, tzinfo=UTC),
            ["2026-10-24T00:30:00Z", "2026-10-25T00:30:00Z", "2026-10-26T01:30:00Z"],
            id="fall-back",
        ),
    ],
)
def test_cron_in_a_time_zone_fires_once_a_day_across_dst(start, expected):
    w = worker(schedule(cron="30 2 * * *", tz="Europe/Berlin"))
    w.register(now=start)
    # a pass every 10 minutes for three days, as a pump that is always up would
    now = start
    while now < start + timedelta(days=3):
        w.run_once(now=now)
        now += timedelta(minutes=10)
    assert slots_of() == expected
    local = [datetime.fromisoformat(s).astimezone(BERLIN).strftime("%H:%M") for s in expected]
    assert local in (["02:30", "03:00", "02:30"], ["02:30", "02:30", "02:30"])


@pytest.mark.django_db
def test_a_schedule_removed_from_the_code_keeps_its_row():
    upsert("reports.gone")
    w = worker(schedule(every=timedelta(minutes=1)))
    w.run_once(now=at(60))
    assert set(models.PeriodicSchedule.objects.values_list("name", flat=True)) == {
        "reports.gone",
        "reports.tick",
    }
    assert rows("reports.gone") == []


# --- three workers over the same slots --------------------------------------------------


@pytest.fixture
def close_thread_connections() -> Iterator[None]:
    yield
    connections.close_all()


@pytest.mark.django_db(transaction=True)
def test_three_workers_racing_over_the_same_slots_fire_each_slot_once():
    definitions = [
        schedule("race.second", every=timedelta(seconds=1), catch_up="all"),
        schedule("race.five", every=timedelta(seconds=5), catch_up="latest"),
        schedule("race.minute", cron="* * * * *", catch_up="none"),
    ]
    workers = [worker(*definitions) for _ in range(3)]
    workers[0].register(now=T0)
    steps = 240  # two minutes of passes every half second
    barrier = threading.Barrier(3)
    errors: list[Exception] = []

    def run(index: int) -> None:
        try:
            for step in range(steps):
                barrier.wait(10)
                # each instance's pass lands a little apart, as real ones do
                workers[index].run_once(now=at(step * 0.5 + index * 0.01))
        except Exception as exc:  # noqa: BLE001 - reported by the main thread
            errors.append(exc)
            barrier.abort()
        finally:
            connections.close_all()

    threads = [threading.Thread(target=run, args=(i,)) for i in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert errors == []
    fired = Counter(
        (row["topic"], row["slot"])
        for row in run_sql(
            "SELECT topic, payload->>'slot' AS slot FROM workpump_outbox WHERE topic LIKE 'race.%%'"
        )
    )
    assert set(fired.values()) == {1}, "a slot fired more than once"
    last = at((steps - 1) * 0.5)
    assert sorted(slot for name, slot in fired if name == "race.second") == [
        iso(n) for n in range(1, int((last - T0).total_seconds()) + 1)
    ]
    assert sorted(slot for name, slot in fired if name == "race.five") == [
        iso(n) for n in range(5, 120, 5)
    ]
    assert sorted(slot for name, slot in fired if name == "race.minute") == [iso(60)]
    by_worker = [w.fired_total for w in workers]
    assert sum(by_worker) == len(fired)
    print("fired by worker", by_worker, "lost", [w.lost_total for w in workers])


# --- the pump runs it ------------------------------------------------------------------------


@pytest.fixture
def ticking() -> Iterator[list[str]]:
    """A schedule firing every second, whose handler records the slots it ran."""
    ran: list[str] = []

    @workpump.periodic("pump.tick", every=timedelta(seconds=1), payload={"kind": "tick"})
    def tick(work):
        ran.append(work.payload["slot"])

    yield ran
    registry.unregister("outbox", "pump.tick")
    schedules.unregister("pump.tick")


@pytest.mark.django_db(transaction=True)
def test_the_pump_fires_and_runs_a_schedule(pump, ticking):
    from tests.helpers import FAST_PUMP, wait_until

    with override_workpump(FAST_PUMP):
        supervisor = pump()
        assert supervisor.periodic is not None
        assert wait_until(lambda: len(ticking) >= 2, timeout=10), ticking
    assert all(s.endswith("Z") for s in ticking)
    assert len(set(ticking)) == len(ticking)
    assert scalar("SELECT count(*) FROM workpump_periodic_schedule WHERE name = 'pump.tick'") == 1


@pytest.mark.django_db(transaction=True)
def test_periodic_enabled_false_starts_no_periodic_worker(pump, ticking):
    from tests.helpers import FAST_PUMP

    with override_workpump(FAST_PUMP | {"PERIODIC_ENABLED": False}):
        supervisor = pump()
    assert supervisor.periodic is None
    assert "periodic" not in supervisor._services


def override_workpump(values: dict[str, object]):
    from django.test import override_settings

    return override_settings(WORKPUMP=values)


# --- the admin and workpump_status ------------------------------------------------------

ADMIN_URL = "/admin/workpump/periodicschedule/"


@pytest.fixture
def two_schedules() -> Iterator[None]:
    """reports.tick is registered (defined by the code), reports.gone is a leftover row."""
    schedules.register(schedule(every=timedelta(minutes=1)))
    upsert(next_fire_at=at(120))
    fire(at(60), now=at(61))
    upsert("reports.gone", every_seconds=None, cron="0 3 * * *", timezone="Europe/Berlin")
    yield
    schedules.unregister("reports.tick")


@pytest.mark.django_db
def test_the_admin_lists_schedules_with_next_fire_last_slot_and_registration(
    admin_client, two_schedules
):
    html = admin_client.get(ADMIN_URL).content.decode()
    assert "every 1m" in html and "cron 0 3 * * * (Europe/Berlin)" in html
    assert "not registered" in html
    assert "2026-01-01 12:01:00" in html  # the last slot
    assert "2026-01-01 12:02:00" in html  # the next fire time
    detail = admin_client.get(f"{ADMIN_URL}reports.tick/change/").content.decode()
    assert "daily" in detail and "not registered" not in detail


@pytest.mark.django_db
def test_the_admin_pause_switch_goes_through_pause_periodic(admin_client, two_schedules):
    # the list's checkbox (list_editable), as the changelist form posts it
    form = {
        "form-TOTAL_FORMS": "2",
        "form-INITIAL_FORMS": "2",
        "form-0-name": "reports.gone",
        "form-1-name": "reports.tick",
        "form-1-paused": "on",
        "_save": "Save",
    }
    response = admin_client.post(ADMIN_URL, form)
    assert response.status_code == 302, response.content.decode()[:2000]
    paused = dict(models.PeriodicSchedule.objects.values_list("name", "paused"))
    assert paused == {"reports.gone": False, "reports.tick": True}
    assert models.PeriodicSchedule.objects.get(name="reports.tick").last_slot == at(60)
    # the actions
    admin_client.post(
        ADMIN_URL,
        {"action": "pause", "_selected_action": ["reports.gone", "reports.tick"]},
    )
    assert set(models.PeriodicSchedule.objects.values_list("paused", flat=True)) == {True}
    response = admin_client.post(
        ADMIN_URL, {"action": "resume", "_selected_action": ["reports.tick"]}, follow=True
    )
    assert "Resumed 1 schedule(s): reports.tick." in response.content.decode()
    assert not models.PeriodicSchedule.objects.get(name="reports.tick").paused


@pytest.mark.django_db
def test_only_a_schedule_the_code_no_longer_defines_can_be_deleted(admin_client, two_schedules):
    assert admin_client.get(f"{ADMIN_URL}reports.tick/delete/").status_code == 403
    assert admin_client.get(f"{ADMIN_URL}reports.gone/delete/").status_code == 200


@pytest.mark.django_db
def test_workpump_status_shows_the_schedules(two_schedules):
    import io
    import json

    out = io.StringIO()
    call_command("workpump_status", "--json", stdout=out)
    periodic = {p["name"]: p for p in json.loads(out.getvalue())["periodic"]}
    assert periodic["reports.tick"] | {"registered_at": None} == {
        "name": "reports.tick",
        "schedule": "every 60s",
        "catch_up": "latest",
        "paused": False,
        "registered": True,
        "next_fire_at": at(120).isoformat(),
        "last_slot": at(60).isoformat(),
        "last_fired_at": at(61).isoformat(),
        "last_message_id": str(rows()[0].work_id),
        "registered_at": None,
    }
    assert periodic["reports.gone"]["registered"] is False
    assert periodic["reports.gone"]["schedule"] == "cron 0 3 * * * (Europe/Berlin)"
    out = io.StringIO()
    call_command("workpump_status", stdout=out)
    text = out.getvalue()
    assert "periodic schedules: 2" in text
    assert "reports.gone  cron 0 3 * * * (Europe/Berlin)" in text
    assert "no (not registered)" in text


def test_periodic_enabled_must_be_a_boolean():
    from django.test import override_settings

    from django_workpump.checks import validate_settings

    with override_settings(WORKPUMP={"PERIODIC_ENABLED": "no"}):
        (message,) = validate_settings()
    assert message.id == "workpump.E003"
    assert message.msg == "WORKPUMP['PERIODIC_ENABLED'] ('no') must be True or False."
    assert message.hint == "Set it to a boolean; the default is True."
