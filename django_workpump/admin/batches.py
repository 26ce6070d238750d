"""The admin of batches (workpump.batch): progress per outcome, read-only.

The counts are kept by the transactions that end the members (docs/workflows.md), so
the page reads one row per batch, never the members themselves.
"""

from __future__ import annotations

from typing import Any

from django.contrib import admin

from django_workpump.admin import display
from django_workpump.admin.instances import ReadOnlyAdmin


class BatchFinishedFilter(admin.SimpleListFilter):
    title = "finished"
    parameter_name = "finished"

    def lookups(self, request: Any, model_admin: Any) -> list[tuple[str, str]]:
        return [("yes", "finished"), ("no", "open")]

    def queryset(self, request: Any, queryset: Any) -> Any:
        if self.value() == "yes":
            return queryset.filter(finished_at__isnull=False)
        if self.value() == "no":
            return queryset.filter(finished_at__isnull=True)
        return queryset


class BatchAdmin(ReadOnlyAdmin):
    """Batches and their progress: members pending, done, dead, discarded, cancelled."""

    list_display = [
        "id",
        "progress",
        "total",
        "pending",
        "done",
        "failed",
        "created",
        "finished",
        "callback_id",
        "parent_batch_id",
    ]
    list_filter = [BatchFinishedFilter]
    search_fields = ["=id", "=parent_batch_id", "=callback_id"]
    ordering = ["-created_at"]

    @admin.display(description="progress")
    def progress(self, obj: Any) -> str:
        ended = obj.total - obj.pending
        return f"{ended}/{obj.total}" if obj.total else display.DASH

    @admin.display(description="failed")
    def failed(self, obj: Any) -> str:
        return f"{obj.dead} dead, {obj.discarded} discarded, {obj.cancelled} cancelled"

    @admin.display(description="created", ordering="created_at")
    def created(self, obj: Any) -> str:
        return display.when(obj.created_at)

    @admin.display(description="finished", ordering="finished_at")
    def finished(self, obj: Any) -> str:
        return display.when(obj.finished_at) if obj.finished_at else display.DASH
