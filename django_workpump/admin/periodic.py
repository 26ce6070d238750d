"""The admin of periodic schedules: rule, next fire time, last slot, and a pause switch.

Rows are written by the periodic SQL functions of sql/schema.sql only. The pause switch (the
list's checkbox and the two actions) goes through ``workpump.pause_periodic``, so it
never writes back a last slot read before a pump advanced it (docs/periodic.md).
"""

from __future__ import annotations

from typing import Any

from django.contrib import admin, messages
from django.db.models import QuerySet
from django.http import HttpRequest
from django.utils.html import format_html
from django.utils.safestring import SafeString

from django_workpump import db
from django_workpump.admin import display
from django_workpump.admin.base import PumpDatabaseAdmin
from django_workpump.models import PeriodicSchedule
from django_workpump.periodic import schedules

# The change page: everything read-only but the pause switch.
DETAIL_FIELDS = [
    "name",
    "rule",
    "catch_up",
    "paused",
    "registered",
    "next_fire",
    "last_slot_at",
    "last_fired",
    "last_message_id",
    "payload_json",
    "priority",
    "max_attempts",
    "created_at",
    "registered_at",
    "updated_at",
]


class PeriodicScheduleAdmin(PumpDatabaseAdmin):
    list_display = [
        "name",
        "rule",
        "catch_up",
        "next_fire",
        "last_slot_at",
        "last_fired",
        "paused",
        "registered",
    ]
    list_display_links = ["name"]
    list_editable = ["paused"]
    list_filter = ["paused", "catch_up"]
    search_fields = ["name"]
    actions = ["pause", "resume"]
    empty_value_display = display.DASH
    fields = tuple(DETAIL_FIELDS)

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False  # schedules come from the code, registered at pump start

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        # A registered schedule would be created again at the next pump start.
        registered = obj is not None and schedules.get(obj.name) is not None
        return super().has_delete_permission(request, obj) and not registered

    def get_actions(self, request: HttpRequest) -> dict[str, Any]:
        actions = super().get_actions(request)
        actions.pop("delete_selected", None)  # it would not tell registered rows apart
        return actions

    def get_readonly_fields(self, request: HttpRequest, obj: Any = None) -> list[str]:
        return [name for name in DETAIL_FIELDS if name != "paused"]

    def save_model(self, request: HttpRequest, obj: Any, form: Any, change: bool) -> None:
        if "paused" in form.changed_data:
            db.pause_periodic(names=[obj.name], paused=obj.paused)

    # -- columns

    @admin.display(description="schedule")
    def rule(self, obj: PeriodicSchedule) -> str:
        if obj.cron is not None:
            return f"cron {obj.cron} ({obj.timezone})"
        return f"every {display.duration(obj.every_seconds or 0)}"

    @admin.display(description="next fire", ordering="next_fire_at")
    def next_fire(self, obj: PeriodicSchedule) -> str:
        return display.when(obj.next_fire_at) if not obj.paused else "paused"

    @admin.display(description="last slot", ordering="last_slot")
    def last_slot_at(self, obj: PeriodicSchedule) -> str:
        return display.when(obj.last_slot)

    @admin.display(description="last fired", ordering="last_fired_at")
    def last_fired(self, obj: PeriodicSchedule) -> str:
        return display.when(obj.last_fired_at)

    @admin.display(description="registered")
    def registered(self, obj: PeriodicSchedule) -> SafeString:
        if schedules.get(obj.name) is not None:
            return format_html('<span class="wp-flag" style="color:{}">yes</span>', "#2e7d32")
        return format_html(
            '<span class="wp-flag" style="color:#c2410c" title="{}">not registered</span>',
            "No workpump.py of this project defines it any more; it fires nothing.",
        )

    @admin.display(description="payload")
    def payload_json(self, obj: PeriodicSchedule) -> SafeString:
        return display.pretty_json(obj.payload)

    # -- actions

    @admin.action(permissions=["change"], description="Pause (fire nothing until resumed)")
    def pause(self, request: HttpRequest, queryset: QuerySet[Any]) -> None:
        self._switch(request, queryset, paused=True)

    @admin.action(permissions=["change"], description="Resume (missed slots stay skipped)")
    def resume(self, request: HttpRequest, queryset: QuerySet[Any]) -> None:
        self._switch(request, queryset, paused=False)

    def _switch(self, request: HttpRequest, queryset: QuerySet[Any], *, paused: bool) -> None:
        names = list(queryset.values_list("name", flat=True))
        changed = db.pause_periodic(names=names, paused=paused)
        verb = "Paused" if paused else "Resumed"
        if changed:
            self.message_user(
                request,
                f"{verb} {len(changed)} schedule(s): {', '.join(changed)}.",
                messages.SUCCESS,
            )
        if unchanged := len(names) - len(changed):
            state = "paused" if paused else "running"
            self.message_user(
                request, f"{unchanged} schedule(s) were {state} already.", messages.WARNING
            )
