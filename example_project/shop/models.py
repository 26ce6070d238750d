"""The shop: orders and payments (written by requests and handlers), plus read models."""

from django.db import models


class Order(models.Model):
    customer = models.CharField(max_length=100, db_index=True)
    amount_cents = models.PositiveIntegerField()
    created_at = models.DateTimeField(auto_now_add=True)
    paid = models.BooleanField(default=False)

    def __str__(self) -> str:
        return f"order #{self.pk} of {self.customer}"


class CustomerTotals(models.Model):
    """Read model kept by the ``customer_totals`` perspective from ``order.placed`` events."""

    customer = models.CharField(max_length=100, unique=True)
    orders = models.PositiveIntegerField(default=0)
    amount_cents = models.BigIntegerField(default=0)

    class Meta:
        verbose_name_plural = "customer totals"

    def __str__(self) -> str:
        return f"{self.customer}: {self.orders} orders"


class ShipmentRequest(models.Model):
    """Written by the ``shipping`` receptor, once per order."""

    order = models.OneToOneField(Order, on_delete=models.CASCADE, related_name="shipment")
    requested_at = models.DateTimeField(auto_now_add=True)

    def __str__(self) -> str:
        return f"shipment of order #{self.order_id}"


class Payment(models.Model):
    """Written by the ``payments.webhook`` inbox handler, once per provider event."""

    order = models.ForeignKey(Order, on_delete=models.CASCADE, related_name="payments")
    provider_event_id = models.CharField(max_length=100, unique=True)
    amount_cents = models.PositiveIntegerField()
    received_at = models.DateTimeField(auto_now_add=True)

    def __str__(self) -> str:
        return f"payment {self.provider_event_id} of order #{self.order_id}"
