"""What a view would call: each function is one transaction that also produces its work."""

import uuid

from django.db import transaction

import django_workpump as workpump
from shop.models import Order

# Inbox message ids are UUIDs; deriving them from the provider's event id makes a
# redelivered webhook the same message, which the inbox stores only once.
PAYMENT_EVENTS = uuid.UUID("6f1c2a8e-5d0b-4b7e-9a51-0c7d3e2f9b14")


def customer_stream(customer: str) -> str:
    """The stream of a customer's work: their events and emails are handled in order."""
    return f"customer-{customer}"


def place_order(customer: str, amount_cents: int) -> Order:
    """Create an order and its event and email in one transaction: all or nothing."""
    with transaction.atomic():
        order = Order.objects.create(customer=customer, amount_cents=amount_cents)
        stream = customer_stream(customer)
        workpump.emit(
            "order.placed",
            {"order_id": order.pk, "customer": customer, "amount_cents": amount_cents},
            stream=stream,
        )
        workpump.send(
            "shop.order_confirmation",
            {
                "order_id": order.pk,
                "email": f"{customer}@example.com",
                "amount_cents": amount_cents,
            },
            stream=stream,
        )
    return order


def simulate_payment_webhook(order: Order) -> bool:
    """Receive the payment provider's webhook for ``order``; False if it was a redelivery."""
    provider_event_id = f"evt_paid_{order.pk}"
    with transaction.atomic():
        return workpump.receive(
            uuid.uuid5(PAYMENT_EVENTS, provider_event_id),
            "payments.webhook",
            {
                "event_id": provider_event_id,
                "order_id": order.pk,
                "amount_cents": order.amount_cents,
            },
            stream=f"order-{order.pk}",
        )
