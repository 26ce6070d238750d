"""factory-boy factories for every workpump table, with explicit times.

Work rows are inserted through the ORM, so the insert triggers fill partition_number and
stream_head exactly as they do for the SQL producers.
"""

from __future__ import annotations

import uuid

import factory
from factory.django import DjangoModelFactory

from django_workpump import models
from tests.helpers import T0


class OutboxFactory(DjangoModelFactory):
    class Meta:
        model = models.Outbox

    work_id = factory.LazyFunction(uuid.uuid4)
    topic = "emails.welcome"
    payload = factory.Sequence(lambda n: {"n": n})
    partition_number = None  # filled by the insert trigger
    created_at = T0


class InboxFactory(DjangoModelFactory):
    class Meta:
        model = models.Inbox

    work_id = factory.LazyFunction(uuid.uuid4)
    topic = "stripe.webhook"
    payload = factory.Sequence(lambda n: {"n": n})
    partition_number = None
    created_at = T0


class InboxDedupFactory(DjangoModelFactory):
    class Meta:
        model = models.InboxDedup

    message_id = factory.LazyFunction(uuid.uuid4)
    first_seen_at = T0


class EventFactory(DjangoModelFactory):
    class Meta:
        model = models.Event

    event_id = factory.LazyFunction(uuid.uuid4)
    event_type = "order.placed"
    payload = factory.Sequence(lambda n: {"order_id": n})
    stream = "order-1"
    created_at = T0


class PerspectiveEventFactory(DjangoModelFactory):
    class Meta:
        model = models.PerspectiveEvent

    work_id = factory.LazyFunction(uuid.uuid4)
    topic = "order_totals"
    event = factory.SubFactory(EventFactory)
    stream = factory.SelfAttribute("event.stream")
    partition_number = None
    created_at = T0


class ReceptorProcessingFactory(DjangoModelFactory):
    class Meta:
        model = models.ReceptorProcessing

    work_id = factory.LazyFunction(uuid.uuid4)
    topic = "warehouse"
    event = factory.SubFactory(EventFactory)
    stream = factory.SelfAttribute("event.stream")
    partition_number = None
    created_at = T0


class ServiceInstanceFactory(DjangoModelFactory):
    class Meta:
        model = models.ServiceInstance

    instance_id = factory.LazyFunction(uuid.uuid4)
    service_name = "tests"
    host_name = "localhost"
    process_id = factory.Sequence(lambda n: 1000 + n)
    started_at = T0
    last_heartbeat_at = T0
    metadata = factory.LazyFunction(dict)
    alive_lock_key = factory.Sequence(lambda n: 1_000_000 + n)


class ActiveStreamFactory(DjangoModelFactory):
    class Meta:
        model = models.ActiveStream

    category = "outbox"
    scope = ""
    stream = factory.Sequence(lambda n: f"stream-{n}")
    partition_number = 0
    created_at = T0
    last_activity_at = T0


class EvictionFactory(DjangoModelFactory):
    class Meta:
        model = models.Eviction

    instance_id = factory.LazyFunction(uuid.uuid4)
    evicted_at = T0
    reason = "test"
