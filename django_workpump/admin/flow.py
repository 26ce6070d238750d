"""The admin of flow rules (docs/flow-control.md): each rule's limits as the code declares
them and as an operator overrides them, and how it stands now (rows held, tokens left,
rows waiting), with pause and resume actions.

Every change goes through ``workpump.set_flow_rule``: a new topic rule flags the topic's
rows, and a pause or resume wakes the claimers. Changing limits takes the model's change
permission; pausing and resuming takes its own, ``pause_flow``.
"""

from __future__ import annotations

import threading
from typing import Any

from django.contrib import admin, messages
from django.db.models import QuerySet
from django.http import HttpRequest

from django_workpump import db
from django_workpump.admin import display
from django_workpump.admin.base import PumpDatabaseAdmin, pump_database
from django_workpump.admin.perms import has_model_permission
from django_workpump.models import FlowRule

# Shown on a rule's page, changed elsewhere: the subject, the pause (the actions) and what
# the code declares.
RULE = ("kind", "category", "name", "paused")
DECLARED = (
    "declared_concurrency",
    "declared_rate",
    "declared_burst",
    "declared_key_concurrency",
)
OVERRIDES = ("override_concurrency", "override_rate", "override_burst", "override_key_concurrency")
# How each rule stands, read once per changelist page, per request thread (a ModelAdmin
# serves every request).
_page = threading.local()
SETTINGS = {
    "override_concurrency": "concurrency",
    "override_rate": "rate",
    "override_burst": "burst",
    "override_key_concurrency": "key_concurrency",
    "weight": "weight",
}


class FlowRuleAdmin(PumpDatabaseAdmin):
    list_display = [
        "subject",
        "paused",
        "limits",
        "in_flight",
        "tokens_left",
        "waiting",
    ]
    list_filter = ["kind", "paused", "category"]
    search_fields = ["name"]
    actions = ["pause", "resume"]
    empty_value_display = display.DASH
    fields = (*RULE, *DECLARED, *OVERRIDES, "weight", "updated_at")
    readonly_fields = (*RULE, *DECLARED, "updated_at")

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False  # rules come from the code, set_limit, pause and workpump_action

    def has_pause_flow_permission(self, request: HttpRequest) -> bool:
        return has_model_permission(request, self.model, "pause_flow")

    def get_actions(self, request: HttpRequest) -> dict[str, Any]:
        actions = super().get_actions(request)
        actions.pop("delete_selected", None)
        return actions

    def changelist_view(self, request: HttpRequest, extra_context: Any = None) -> Any:
        # how each rule stands now, read once per page
        _page.status = {r.id: r for r in db.flow_rule_status(using=pump_database())}
        try:
            response = super().changelist_view(request, extra_context)
            if hasattr(response, "render"):
                response.render()  # the columns read the status now, not after return
            return response
        finally:
            _page.status = {}

    def save_model(self, request: HttpRequest, obj: Any, form: Any, change: bool) -> None:
        changed = {SETTINGS[name]: getattr(obj, name) for name in form.changed_data}
        if changed:
            db.set_flow_rule(
                kind=obj.kind,
                category=obj.category,
                name=obj.name,
                settings=changed,
                using=pump_database(),
            )

    # -- columns

    def _now(self, obj: FlowRule) -> db.FlowRuleStatus | None:
        return getattr(_page, "status", {}).get(obj.pk)

    @admin.display(description="rule", ordering="name")
    def subject(self, obj: FlowRule) -> str:
        return str(obj)

    @admin.display(description="limits")
    def limits(self, obj: FlowRule) -> str:
        now = self._now(obj)
        if now is None:
            return display.DASH
        parts = []
        if now.concurrency is not None:
            parts.append(f"{now.concurrency} at once")
        if now.key_concurrency is not None:
            parts.append(f"{now.key_concurrency} per key")
        if now.rate is not None:
            parts.append(f"{now.rate:g}/s, burst {now.burst:g}")
        if now.weight != 1:
            parts.append(f"weight {now.weight}")
        return ", ".join(parts) or display.DASH

    @admin.display(description="in flight")
    def in_flight(self, obj: FlowRule) -> Any:
        now = self._now(obj)
        return display.DASH if now is None or now.in_flight is None else now.in_flight

    @admin.display(description="tokens left")
    def tokens_left(self, obj: FlowRule) -> Any:
        now = self._now(obj)
        return display.DASH if now is None or now.tokens is None else f"{now.tokens:g}"

    @admin.display(description="waiting")
    def waiting(self, obj: FlowRule) -> Any:
        now = self._now(obj)
        return display.DASH if now is None or now.waiting is None else now.waiting

    # -- actions

    @admin.action(permissions=["pause_flow"], description="Pause (claim none of their work)")
    def pause(self, request: HttpRequest, queryset: QuerySet[Any]) -> None:
        self._switch(request, queryset, paused=True)

    @admin.action(permissions=["pause_flow"], description="Resume")
    def resume(self, request: HttpRequest, queryset: QuerySet[Any]) -> None:
        self._switch(request, queryset, paused=False)

    def _switch(self, request: HttpRequest, queryset: QuerySet[Any], *, paused: bool) -> None:
        rules = list(queryset)
        for rule in rules:
            db.set_flow_rule(
                kind=rule.kind,
                category=rule.category,
                name=rule.name,
                settings={"paused": paused},
                using=pump_database(),
            )
        verb = "Paused" if paused else "Resumed"
        self.message_user(request, f"{verb} {', '.join(str(r) for r in rules)}.", messages.SUCCESS)
