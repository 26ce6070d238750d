"""Subscriptions in the database: synced from the registry, fanned out by SQL emit."""

from __future__ import annotations

import pytest
from django.core.management import call_command
from django.db import DataError, transaction

import django_workpump as workpump
from django_workpump import models, subscriptions
from django_workpump.registry import registry
from tests.helpers import run_sql, scalar


def stored() -> list[tuple[str, str, str, int]]:
    return [
        (s.event_type, s.category, s.name, s.max_attempts)
        for s in models.Subscription.objects.filter(event_type__startswith="order.")
    ]


@pytest.mark.django_db
def test_sql_emit_without_subscribers_creates_the_registered_work(order_handlers):
    subscriptions.sync(replace=True)

    event_id = scalar("SELECT workpump.emit('order.placed', '{\"order\": 1}', 'order-1')")

    perspective = models.PerspectiveEvent.objects.get(event_id=event_id)
    receptor = models.ReceptorProcessing.objects.get(event_id=event_id)
    assert (perspective.topic, perspective.stream) == ("order_totals", "order-1")
    assert (receptor.topic, receptor.max_attempts) == ("warehouse", 3)
    refunded = scalar("SELECT workpump.emit('order.refunded', '{}')")
    assert models.PerspectiveEvent.objects.filter(event_id=refunded).count() == 1
    assert models.ReceptorProcessing.objects.filter(event_id=refunded).count() == 0


@pytest.mark.django_db
def test_sql_emit_with_an_empty_subscriber_list_creates_no_work(order_handlers):
    subscriptions.sync(replace=True)

    event_id = scalar("SELECT workpump.emit('order.placed', '{}', p_subscribers => '[]')")

    assert models.Event.objects.filter(event_id=event_id).exists()
    assert not models.PerspectiveEvent.objects.filter(event_id=event_id).exists()
    assert not models.ReceptorProcessing.objects.filter(event_id=event_id).exists()


@pytest.mark.django_db
def test_python_emit_still_passes_its_own_subscribers(order_handlers):
    models.Subscription.objects.all().delete()  # the table is not what Python reads

    event_id = workpump.emit("order.placed", {})

    assert models.PerspectiveEvent.objects.filter(event_id=event_id).count() == 1
    assert models.ReceptorProcessing.objects.filter(event_id=event_id).count() == 1


@pytest.mark.django_db
def test_sync_replaces_or_upserts_and_updates_max_attempts(order_handlers):
    gone = ("order.cancelled", "receptor", "refunds", 5)
    models.Subscription.objects.create(
        event_type=gone[0], category=gone[1], name=gone[2], max_attempts=gone[3]
    )
    registered = [
        ("order.placed", "perspective_event", "order_totals", 10),
        ("order.placed", "receptor", "warehouse", 3),
        ("order.refunded", "perspective_event", "order_totals", 10),
    ]

    subscriptions.sync(replace=False)
    assert stored() == [gone, *registered]

    registry.unregister("receptor", "warehouse")
    workpump.receptor("warehouse", events=["order.placed"], max_attempts=7)(lambda work: None)
    assert subscriptions.sync(replace=True) == 1  # only warehouse's row changed
    assert stored() == [registered[0], (*registered[1][:3], 7), registered[2]]


@pytest.mark.django_db
def test_sync_refuses_a_bad_subscription():
    with pytest.raises(DataError, match="Bad subscription"), transaction.atomic():
        run_sql(
            'SELECT workpump.sync_subscriptions(\'[{"event_type": "e",'
            ' "category": "outbox", "name": "n", "max_attempts": 1}]\')'
        )


@pytest.mark.django_db
def test_migrate_replaces_the_subscriptions_with_the_registrys(order_handlers):
    models.Subscription.objects.create(
        event_type="order.cancelled", category="receptor", name="refunds", max_attempts=5
    )

    call_command("migrate", "workpump", verbosity=0)

    expected = [
        (s["event_type"], s["category"], s["name"], s["max_attempts"])
        for s in subscriptions.registered()
    ]
    rows = [
        (s.event_type, s.category, s.name, s.max_attempts)
        for s in models.Subscription.objects.all()
    ]
    assert rows == expected
    assert ("order.placed", "receptor", "warehouse", 3) in rows


@pytest.mark.django_db(transaction=True)
def test_the_pump_upserts_the_subscriptions_at_start_and_deletes_none(pump, order_handlers):
    models.Subscription.objects.all().delete()
    models.Subscription.objects.create(
        event_type="order.cancelled", category="receptor", name="refunds", max_attempts=5
    )

    pump()

    assert stored() == [
        ("order.cancelled", "receptor", "refunds", 5),
        ("order.placed", "perspective_event", "order_totals", 10),
        ("order.placed", "receptor", "warehouse", 3),
        ("order.refunded", "perspective_event", "order_totals", 10),
    ]


def test_a_fresh_migrate_stores_the_subscriptions_of_the_loaded_code(scratch_database):
    scratch_database.migrate()
    with scratch_database.connect() as conn:
        rows = conn.execute(
            "SELECT event_type, category, name FROM workpump_subscription ORDER BY 1, 2, 3"
        ).fetchall()
    assert rows == [
        ("mp.event", "perspective_event", "mp.perspective"),
        ("mp.event", "receptor", "mp.receptor"),
    ]
    scratch_database.migrate("workpump", "0001")  # the receiver skips a schema without it
