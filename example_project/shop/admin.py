from django.contrib import admin

from shop.models import CustomerTotals, Order, Payment, ShipmentRequest


@admin.register(Order)
class OrderAdmin(admin.ModelAdmin):
    list_display = ["id", "customer", "amount_cents", "paid", "created_at"]
    list_filter = ["paid"]
    search_fields = ["customer"]


@admin.register(CustomerTotals)
class CustomerTotalsAdmin(admin.ModelAdmin):
    list_display = ["customer", "orders", "amount_cents"]
    search_fields = ["customer"]


@admin.register(ShipmentRequest)
class ShipmentRequestAdmin(admin.ModelAdmin):
    list_display = ["order", "requested_at"]
    list_select_related = ["order"]


@admin.register(Payment)
class PaymentAdmin(admin.ModelAdmin):
    list_display = ["provider_event_id", "order", "amount_cents", "received_at"]
    list_select_related = ["order"]
    search_fields = ["provider_event_id"]
