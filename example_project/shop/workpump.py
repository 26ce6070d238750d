"""Handlers of the shop's work, one per category; autodiscovered by django_workpump.

Delivery is at least once. Handlers whose only effect is on this database run with
``atomic=True``: their writes commit with the row's completion, so they happen exactly
once. The others are idempotent (``get_or_create``) or, like email, accept that a
retry after a lost outcome may repeat them.
"""

import threading

from django.core.mail import send_mail
from django.db.models import F

import django_workpump as workpump
from django_workpump import Work
from shop.models import CustomerTotals, Order, Payment, ShipmentRequest


class SentCounter:
    """Emails sent by this process (the demo prints it)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.value = 0

    def add(self, count: int = 1) -> None:
        with self._lock:
            self.value += count


emails_sent = SentCounter()


@workpump.outbox_handler("shop.order_confirmation")
def send_order_confirmation(work: Work) -> None:
    """Email the customer that their order was placed."""
    order = work.payload
    sent = send_mail(
        subject=f"Your order #{order['order_id']} is confirmed",
        message=(
            f"Thank you for your order #{order['order_id']} of "
            f"{order['amount_cents'] / 100:.2f} EUR. It ships soon."
        ),
        from_email=None,
        recipient_list=[order["email"]],
    )
    emails_sent.add(sent)


@workpump.perspective("customer_totals", events=["order.placed"], atomic=True)
def project_customer_totals(work: Work) -> None:
    """Add the order to its customer's totals (events of a customer arrive in order)."""
    event = work.payload
    totals, _ = CustomerTotals.objects.get_or_create(customer=event["customer"])
    CustomerTotals.objects.filter(pk=totals.pk).update(
        orders=F("orders") + 1, amount_cents=F("amount_cents") + event["amount_cents"]
    )


@workpump.receptor("shipping", events=["order.placed"])
def request_shipment(work: Work) -> None:
    """Ask the warehouse to ship the order; a repeat finds the request already there."""
    ShipmentRequest.objects.get_or_create(order_id=work.payload["order_id"])


@workpump.inbox_handler("payments.webhook", atomic=True)
def record_payment(work: Work) -> None:
    """Store the provider's payment and mark its order paid."""
    webhook = work.payload
    Payment.objects.get_or_create(
        provider_event_id=webhook["event_id"],
        defaults={"order_id": webhook["order_id"], "amount_cents": webhook["amount_cents"]},
    )
    Order.objects.filter(pk=webhook["order_id"]).update(paid=True)
