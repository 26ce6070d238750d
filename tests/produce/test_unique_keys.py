"""Unique keys of send and emit: one holder per key, enforced by the database."""

from __future__ import annotations

import threading
import time
import uuid
from datetime import timedelta
from typing import Any

import psycopg
import pytest
from django.db import DataError, IntegrityError, transaction

import django_workpump as workpump
from django_workpump import models
from django_workpump.registry import registry
from tests.helpers import run_sql, scalar


@pytest.fixture
def receptor_on_signup():
    """A receptor on user.signed_up, unregistered afterwards."""
    workpump.receptor("welcome_mail", events=["user.signed_up"])(lambda work: None)
    yield
    registry.unregister("receptor", "welcome_mail")


@pytest.mark.django_db
def test_a_duplicate_send_returns_the_holders_id_and_writes_nothing():
    first = workpump.send("reports.build", {"day": 1}, unique_key="2026-01-01")

    again = workpump.send("reports.build", {"day": 2}, unique_key="2026-01-01")
    other_key = workpump.send("reports.build", {"day": 2}, unique_key="2026-01-02")
    other_destination = workpump.send("reports.mail", {"day": 1}, unique_key="2026-01-01")

    assert again == first
    assert len({first, other_key, other_destination}) == 3
    assert models.Outbox.objects.filter(topic="reports.build").count() == 2
    assert models.Outbox.objects.get(work_id=first).payload == {"day": 1}


@pytest.mark.django_db
def test_on_conflict_raise_raises_duplicate_with_the_holders_id():
    first = workpump.send("reports.build", {}, unique_key="k")

    with pytest.raises(workpump.Duplicate, match="already holds unique_key 'k'") as raised:
        workpump.send("reports.build", {}, unique_key="k", on_conflict="raise")

    assert raised.value.holder_id == first
    assert models.Outbox.objects.count() == 1
    # the caller's transaction is still usable: nothing failed in the database
    assert workpump.send("reports.build", {}, unique_key="k2") != first


@pytest.mark.django_db
def test_a_duplicate_receive_returns_false_or_raises_and_writes_nothing():
    first, second, third = uuid.uuid4(), uuid.uuid4(), uuid.uuid4()
    assert workpump.receive(first, "reports.in", {}, unique_key="k") is True

    assert workpump.receive(second, "reports.in", {}, unique_key="k") is False
    with pytest.raises(workpump.Duplicate) as raised:
        workpump.receive(third, "reports.in", {}, unique_key="k", on_conflict="raise")

    assert raised.value.holder_id == first
    assert list(models.Inbox.objects.values_list("work_id", flat=True)) == [first]
    # a duplicate by key records no received id: the message may come again later
    assert not models.InboxDedup.objects.filter(message_id__in=[second, third]).exists()


@pytest.mark.django_db
def test_a_processed_row_frees_its_key_and_a_dead_row_holds_it():
    first = workpump.send("reports.build", {}, unique_key="k")
    models.Outbox.objects.filter(work_id=first).update(dead_lettered_at=scalar("SELECT now()"))

    assert workpump.send("reports.build", {}, unique_key="k") == first

    models.Outbox.objects.filter(work_id=first).update(done_at=scalar("SELECT now()"))
    second = workpump.send("reports.build", {}, unique_key="k")
    assert second != first
    assert models.Outbox.objects.filter(unique_key="k").count() == 2


@pytest.mark.django_db
def test_unique_for_holds_the_key_for_the_window_after_the_row_is_done():
    window = timedelta(hours=1)
    first = workpump.send("reports.build", {}, unique_key="k", unique_for=window)
    models.Outbox.objects.filter(work_id=first).update(done_at=scalar("SELECT now()"))

    assert workpump.send("reports.build", {}, unique_key="k", unique_for=window) == first
    # without the window, the done row holds nothing
    without = workpump.send("reports.build", {}, unique_key="k")
    assert without != first
    models.Outbox.objects.filter(work_id=without).update(done_at=scalar("SELECT now()"))
    # the window, seen from two hours later, has passed
    later = scalar(
        "SELECT workpump.send('reports.build', '{}', p_unique_key => 'k',"
        " p_unique_for => '1 hour', p_now => now() + interval '2 hours')"
    )
    assert later not in (first, without)


@pytest.mark.django_db
def test_a_duplicate_emit_returns_the_holder_until_its_work_is_done(receptor_on_signup):
    first = workpump.emit("user.signed_up", {"user": 1}, unique_key="user-1")

    assert workpump.emit("user.signed_up", {"user": 1}, unique_key="user-1") == first
    with pytest.raises(workpump.Duplicate) as raised:
        workpump.emit("user.signed_up", {}, unique_key="user-1", on_conflict="raise")
    assert raised.value.holder_id == first
    assert models.Event.objects.count() == 1
    assert models.ReceptorProcessing.objects.count() == 1

    models.ReceptorProcessing.objects.update(done_at=scalar("SELECT now()"))
    second = workpump.emit("user.signed_up", {"user": 1}, unique_key="user-1")
    assert second != first
    assert models.ReceptorProcessing.objects.count() == 2


@pytest.mark.django_db
def test_an_event_without_work_holds_its_key_only_for_the_window():
    first = workpump.emit("audit.noted", {}, unique_key="k")
    assert workpump.emit("audit.noted", {}, unique_key="k") != first

    held = workpump.emit("audit.noted", {}, unique_key="w", unique_for=timedelta(minutes=5))
    assert workpump.emit("audit.noted", {}, unique_key="w", unique_for=timedelta(minutes=5)) == held


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        ({"unique_for": timedelta(minutes=1)}, "unique_for of .* needs a unique_key"),
        ({"unique_key": "k", "unique_for": timedelta(seconds=-1)}, "must not be negative"),
        ({"unique_key": "k", "unique_for": 60}, "must be a timedelta"),
        ({"unique_key": "x" * 513}, "513 bytes in UTF-8, over the limit of 512 bytes"),
        ({"unique_key": " "}, "must be a non-empty string"),
        ({"unique_key": "a\x00b"}, "NUL character"),
        ({"unique_key": "k", "on_conflict": "ignore"}, "on_conflict of .* must be 'return'"),
    ],
)
def test_bad_unique_arguments_are_refused_before_anything_is_written(arguments, message):
    with pytest.raises(workpump.InvalidWork, match=message):
        workpump.send("reports.build", {}, **arguments)
    with pytest.raises(workpump.InvalidWork, match=message):
        workpump.emit("audit.noted", {}, **arguments)
    with pytest.raises(workpump.InvalidWork, match=message):
        workpump.receive(uuid.uuid4(), "reports.in", {}, **arguments)


@pytest.mark.django_db
@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        ("p_unique_for => '1 minute'", "p_unique_for of .* needs p_unique_key"),
        ("p_unique_key => 'k', p_unique_for => '-1 second'", "must not be negative"),
        ("p_unique_key => repeat('x', 513)", "513 bytes, over the limit of 512 bytes"),
        ("p_unique_key => 'k', p_on_conflict => 'ignore'", "p_on_conflict must be 'return'"),
    ],
)
def test_the_sql_producers_refuse_bad_unique_arguments(arguments, message):
    for call in (
        f"SELECT workpump.send('reports.build', '{{}}', {arguments})",
        f"SELECT workpump.emit('audit.noted', '{{}}', {arguments})",
        f"SELECT workpump.receive(gen_random_uuid(), 'reports.in', '{{}}', {arguments})",
    ):
        with pytest.raises(DataError, match=message), transaction.atomic():
            run_sql(call)


@pytest.mark.django_db
def test_sql_send_with_on_conflict_raise_raises_unique_violation():
    first = scalar("SELECT workpump.send('reports.build', '{}', p_unique_key => 'k')")
    holds = f"holds unique key 'k' in message {first}"
    with pytest.raises(IntegrityError, match=holds), transaction.atomic():
        run_sql(
            "SELECT workpump.send('reports.build', '{}', p_unique_key => 'k',"
            " p_on_conflict => 'raise')"
        )


PRODUCERS = {
    "send": (
        "SELECT workpump.send('reports.build', '{}', p_unique_key => 'race') AS id",
        "SELECT work_id AS id FROM workpump_outbox WHERE unique_key = 'race'",
    ),
    "receive": (
        "SELECT workpump.receive(gen_random_uuid(), 'reports.in', '{}',"
        " p_unique_key => 'race') AS id",
        "SELECT work_id AS id FROM workpump_inbox WHERE unique_key = 'race'",
    ),
    "emit": (
        "SELECT workpump.emit('audit.noted', '{}', p_subscribers => '[]',"
        " p_unique_key => 'race', p_unique_for => '1 hour') AS id",
        "SELECT event_id AS id FROM workpump_event WHERE unique_key = 'race'",
    ),
}


def _wait_for(condition: Any, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out waiting for the racers"
        threading.Event().wait(0.01)


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("producer", sorted(PRODUCERS))
def test_racing_producers_leave_one_row_per_key_even_when_the_first_rolls_back(
    raw_connect, producer
):
    produce, stored = PRODUCERS[producer]
    racers = 6
    first = raw_connect()
    observer = raw_connect()
    first.execute("BEGIN")
    rolled_back_id = first.execute(produce).fetchone()["id"]

    results: dict[int, Any] = {}
    errors: list[psycopg.Error] = []

    def race(number: int, conn: psycopg.Connection[Any]) -> None:
        try:
            with conn.transaction():
                results[number] = conn.execute(produce).fetchone()["id"]
        except psycopg.Error as exc:  # reported by the assertion below
            errors.append(exc)

    threads = [
        threading.Thread(target=race, args=(number, raw_connect())) for number in range(racers)
    ]
    for thread in threads:
        thread.start()

    def all_waiting() -> bool:
        row = observer.execute(
            "SELECT count(*) AS n FROM pg_locks WHERE locktype = 'advisory' AND NOT granted"
            " AND database = (SELECT oid FROM pg_database WHERE datname = current_database())"
        ).fetchone()
        return row["n"] == racers

    _wait_for(all_waiting)
    first.execute("ROLLBACK")
    for thread in threads:
        thread.join(timeout=30)

    assert not errors
    rows = observer.execute(stored).fetchall()
    assert len(rows) == 1
    if producer == "receive":  # receive says whether it stored: once, for one racer
        assert sorted(results.values()) == [False] * (racers - 1) + [True]
    else:
        assert set(results.values()) == {rows[0]["id"]}
        assert rolled_back_id != rows[0]["id"]
