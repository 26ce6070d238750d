"""URLs of the example shop: the Django admin shows orders and every work row."""

from django.contrib import admin
from django.urls import path

urlpatterns = [
    path("admin/", admin.site.urls),
]
