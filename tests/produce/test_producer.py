"""send / receive / emit: validation, transactions, dedup, fan-out."""

from __future__ import annotations

import uuid
from datetime import datetime
from decimal import Decimal

import pytest
from django.db import transaction
from django.test import override_settings

import django_workpump as workpump
from django_workpump import models
from django_workpump.registry import registry
from tests.helpers import T0, scalar

pytestmark = pytest.mark.django_db


def test_send_stores_an_outbox_row_with_its_settings():
    message_id = workpump.send("emails.welcome", {"user_id": 7}, stream="user-7", priority=5)

    row = models.Outbox.objects.get(work_id=message_id)
    assert row.topic == "emails.welcome"
    assert row.payload == {"user_id": 7}
    assert row.stream == "user-7"
    assert row.priority == 5
    assert row.max_attempts == 10
    assert row.attempts == 0
    assert row.instance_id is None
    expected = scalar("SELECT workpump.partition_of('user-7', 10000)")
    assert row.partition_number == expected


def test_send_uses_the_handlers_max_attempts_override():
    workpump.outbox_handler("emails.digest", max_attempts=2)(lambda work: None)
    try:
        message_id = workpump.send("emails.digest", {})
    finally:
        registry.unregister("outbox", "emails.digest")
    assert models.Outbox.objects.get(work_id=message_id).max_attempts == 2


def test_work_produced_in_a_rolled_back_transaction_is_gone():
    class Boom(Exception):
        pass

    with pytest.raises(Boom), transaction.atomic():
        workpump.send("emails.welcome", {"user_id": 1})
        workpump.receive(uuid.uuid4(), "stripe.webhook", {"id": "evt_1"})
        workpump.emit("order.placed", {"order_id": 1}, stream="order-1")
        raise Boom

    assert models.Outbox.objects.count() == 0
    assert models.Inbox.objects.count() == 0
    assert models.Event.objects.count() == 0


@pytest.mark.parametrize(
    ("payload", "message"),
    [
        ({"when": datetime(2026, 1, 1)}, "is not JSON"),
        ({"amount": Decimal("1.5")}, "is not JSON"),
        ({"x": float("nan")}, "is not JSON"),
        ([1, 2, 3], "must be a dict"),
        ("text", "must be a dict"),
    ],
)
def test_a_payload_that_is_not_a_json_object_is_refused_before_writing(payload, message):
    with pytest.raises(workpump.InvalidWork, match=message):
        workpump.send("emails.welcome", payload)
    with pytest.raises(workpump.InvalidWork, match=message):
        workpump.receive(uuid.uuid4(), "stripe.webhook", payload)
    with pytest.raises(workpump.InvalidWork, match=message):
        workpump.emit("order.placed", payload)
    assert models.Outbox.objects.count() == 0
    assert models.Inbox.objects.count() == 0
    assert models.Event.objects.count() == 0


@override_settings(WORKPUMP={"MAX_PAYLOAD_BYTES": 100})
def test_an_oversized_payload_is_refused_with_the_setting_named():
    with pytest.raises(workpump.InvalidWork, match=r"MAX_PAYLOAD_BYTES'\] \(100\)"):
        workpump.send("emails.welcome", {"blob": "x" * 200})
    assert models.Outbox.objects.count() == 0


@pytest.mark.parametrize("stream", [1.5, b"bytes", {"a": 1}, True, " "])
def test_a_stream_key_of_the_wrong_type_is_refused(stream):
    with pytest.raises(workpump.InvalidWork, match="stream"):
        workpump.send("emails.welcome", {}, stream=stream)
    assert models.Outbox.objects.count() == 0


def test_int_and_uuid_stream_keys_are_stored_as_text():
    key = uuid.uuid4()
    first = workpump.send("emails.welcome", {}, stream=42)
    second = workpump.send("emails.welcome", {}, stream=key)
    assert models.Outbox.objects.get(work_id=first).stream == "42"
    assert models.Outbox.objects.get(work_id=second).stream == str(key)


def test_a_naive_run_after_is_refused():
    with pytest.raises(workpump.InvalidWork, match="aware datetime"):
        workpump.send("emails.welcome", {}, run_after=datetime(2026, 1, 1))


def test_run_after_defers_the_row():
    message_id = workpump.send("emails.welcome", {}, run_after=T0)
    assert models.Outbox.objects.get(work_id=message_id).scheduled_for == T0


def test_receive_deduplicates_by_message_id():
    message_id = uuid.uuid4()
    assert workpump.receive(message_id, "stripe.webhook", {"n": 1}) is True
    assert workpump.receive(message_id, "stripe.webhook", {"n": 2}) is False
    assert workpump.receive(str(message_id), "other.handler", {"n": 3}) is False
    rows = list(models.Inbox.objects.all())
    assert [(r.work_id, r.payload) for r in rows] == [(message_id, {"n": 1})]


def test_receive_deduplicates_even_after_the_processed_row_was_purged():
    message_id = uuid.uuid4()
    assert workpump.receive(message_id, "stripe.webhook", {}) is True
    models.Inbox.objects.filter(work_id=message_id).update(done_at=T0)
    assert (
        scalar(
            "SELECT workpump.purge_processed('inbox', %s)", [datetime.max.replace(tzinfo=T0.tzinfo)]
        )
        == 1
    )
    assert models.Inbox.objects.count() == 0

    assert workpump.receive(message_id, "stripe.webhook", {}) is False
    assert models.Inbox.objects.count() == 0


def test_receive_refuses_a_message_id_that_is_not_a_uuid():
    with pytest.raises(workpump.InvalidWork, match="must be a UUID"):
        workpump.receive("not-a-uuid", "stripe.webhook", {})


def test_emit_creates_one_row_per_subscriber(order_handlers):
    event_id = workpump.emit("order.placed", {"order_id": 42}, stream="order-42")

    event = models.Event.objects.get(event_id=event_id)
    assert (event.event_type, event.payload, event.stream) == (
        "order.placed",
        {"order_id": 42},
        "order-42",
    )
    perspective_rows = list(models.PerspectiveEvent.objects.all())
    receptor_rows = list(models.ReceptorProcessing.objects.all())
    assert [(r.topic, r.event_id, r.stream) for r in perspective_rows] == [
        ("order_totals", event_id, "order-42")
    ]
    assert [(r.topic, r.event_id, r.max_attempts) for r in receptor_rows] == [
        ("warehouse", event_id, 3)
    ]


def test_emit_subscribes_only_matching_handlers(order_handlers):
    workpump.emit("order.refunded", {"order_id": 42}, stream="order-42")
    assert models.PerspectiveEvent.objects.count() == 1
    assert models.ReceptorProcessing.objects.count() == 0


def test_emit_with_no_subscribers_stores_the_event_and_no_work():
    event_id = workpump.emit("nobody.listens", {"x": 1})
    assert models.Event.objects.filter(event_id=event_id).exists()
    assert models.PerspectiveEvent.objects.count() == 0
    assert models.ReceptorProcessing.objects.count() == 0


def test_produced_work_wakes_in_process_listeners_only_after_commit(
    django_capture_on_commit_callbacks,
):
    from django_workpump.producer import add_produced_listener, remove_produced_listener

    woken: list[str] = []
    add_produced_listener(woken.append)
    try:
        with django_capture_on_commit_callbacks(execute=True):
            workpump.send("emails.welcome", {})
            workpump.receive(uuid.uuid4(), "stripe.webhook", {})
            assert woken == []
    finally:
        remove_produced_listener(woken.append)
    assert woken == ["outbox", "inbox"]


@pytest.mark.django_db
@pytest.mark.parametrize(
    "unmigrate",
    [
        "DROP SCHEMA workpump CASCADE",  # never migrated
        # not current
        "DROP FUNCTION workpump.receive(uuid, text, jsonb, text, integer, timestamptz, integer,"
        " integer, bigint, integer, boolean, text, interval, text, jsonb, text, text,"
        " timestamptz)",
    ],
    ids=["no-schema", "old-schema"],
)
def test_producing_before_migrate_says_what_to_run(unmigrate):
    from django.core.exceptions import ImproperlyConfigured

    from tests.helpers import run_sql

    # the savepoint rolls back: the schema comes back
    with (
        pytest.raises(ImproperlyConfigured, match=r"run `python manage.py migrate`"),
        transaction.atomic(),
    ):
        run_sql(unmigrate)
        workpump.receive(uuid.uuid4(), "p.inbox", {"n": 1})
    assert workpump.receive(uuid.uuid4(), "p.inbox", {"n": 1}) is True
