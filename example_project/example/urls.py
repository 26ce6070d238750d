"""URLs of the example shop: the Django admin shows orders and every work row; /metrics
serves the Prometheus metrics (with the ``prometheus`` extra installed)."""

from django.contrib import admin
from django.urls import path

from django_workpump.metrics import metrics_view

urlpatterns = [
    path("admin/", admin.site.urls),
    path("metrics", metrics_view),
]
