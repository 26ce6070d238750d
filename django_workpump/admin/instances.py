"""The admin of instances, tombstones and stream ownership, and the summary page."""

from __future__ import annotations

from typing import Any

from django.contrib import admin, messages
from django.core.exceptions import PermissionDenied, ValidationError
from django.db import transaction
from django.db.models import BooleanField, Case, ExpressionWrapper, Q, QuerySet, Value, When
from django.db.models import IntegerField as IntegerFieldType
from django.http import HttpRequest
from django.template.response import TemplateResponse
from django.urls import URLPattern, path, reverse
from django.utils.html import format_html
from django.utils.http import urlencode
from django.utils.safestring import SafeString

from django_workpump import db, status
from django_workpump.admin import display
from django_workpump.admin.base import WorkpumpModelAdmin
from django_workpump.admin.console import console_urls
from django_workpump.admin.expressions import (
    ADMIN_QUERIES,
    HOLDER_LIVE,
    held_alive_lock_keys,
    held_count,
    holder_kind,
    instance_heartbeat_age,
    instance_label,
    listening_instance_ids,
    live_instance_ids,
    owner_holds_alive_lock,
    seconds_since,
    seconds_until,
    undone_in_stream,
)
from django_workpump.admin.perms import can_view_summary, has_model_permission
from django_workpump.admin.work import (
    InboxAdmin,
    OutboxAdmin,
    PerspectiveEventAdmin,
    ReceptorProcessingAdmin,
)
from django_workpump.admin.work_actions import confirmation
from django_workpump.conf import get_settings
from django_workpump.models import (
    Inbox,
    Outbox,
    PerspectiveEvent,
    ReceptorProcessing,
    ServiceInstance,
)

# Category -> (model, admin class): the order of the summary and of the held columns.
WORK_MODELS = {
    "outbox": (Outbox, OutboxAdmin),
    "inbox": (Inbox, InboxAdmin),
    "perspective_event": (PerspectiveEvent, PerspectiveEventAdmin),
    "receptor": (ReceptorProcessing, ReceptorProcessingAdmin),
}


class ReadOnlyAdmin(WorkpumpModelAdmin):
    """Rows written by the SQL functions only: shown, never added, edited or deleted here."""

    show_full_result_count = False  # a filtered page runs no extra count of the whole table
    empty_value_display = display.DASH

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False


def changelist_url(model: Any, **query: str) -> str:
    url = reverse(f"admin:{model._meta.app_label}_{model._meta.model_name}_changelist")
    return f"{url}?{urlencode(query)}" if query else url


def yes_no(value: bool) -> SafeString:
    return format_html(
        '<span class="wp-flag" style="color:{}">{}</span>',
        "#2e7d32" if value else "#6b7280",
        "yes" if value else "no",
    )


class ServiceInstanceAdmin(ReadOnlyAdmin):
    """Registered ``runworkpump`` processes, their liveness and the rows they hold."""

    list_display = [
        "instance",
        "service_name",
        "host_name",
        "process_id",
        "started",
        "heartbeat",
        "live",
        "alive_lock",
        "listening",
        "held_outbox",
        "held_inbox",
        "held_perspective_event",
        "held_receptor",
    ]
    list_filter = ["service_name", "host_name"]
    search_fields = ["=instance_id", "service_name", "host_name"]
    ordering = ["service_name", "started_at"]
    actions = ["evict"]

    def get_queryset(self, request: HttpRequest) -> QuerySet[Any]:
        held = {
            f"wp_held_{category}": held_count(model) for category, (model, _) in WORK_MODELS.items()
        }
        return (
            super()
            .get_queryset(request)
            .annotate(
                wp_heartbeat_age=seconds_since("last_heartbeat_at"),
                wp_alive_lock=ExpressionWrapper(
                    Q(alive_lock_key__in=held_alive_lock_keys()), output_field=BooleanField()
                ),
                wp_live=ExpressionWrapper(
                    Q(instance_id__in=live_instance_ids()), output_field=BooleanField()
                ),
                wp_listening=ExpressionWrapper(
                    Q(instance_id__in=listening_instance_ids()), output_field=BooleanField()
                ),
                **held,
            )
        )

    def get_search_results(
        self, request: HttpRequest, queryset: QuerySet[Any], search_term: str
    ) -> tuple[QuerySet[Any], bool]:
        try:
            ServiceInstance._meta.pk.to_python(search_term.strip())
        except ValidationError:
            term = search_term.strip()
            if not term:
                return queryset, False
            lookup = Q(service_name__icontains=term) | Q(host_name__icontains=term)
            return queryset.filter(lookup), False
        return super().get_search_results(request, queryset, search_term)

    def get_urls(self) -> list[URLPattern]:
        summary = path(
            "summary/", self.admin_site.admin_view(self.summary_view), name="workpump_summary"
        )
        return [summary, *console_urls(self), *super().get_urls()]

    def has_evict_instance_permission(self, request: HttpRequest) -> bool:
        return has_model_permission(request, ServiceInstance, "evict_instance")

    # -- columns

    @admin.display(description="instance", ordering="instance_id")
    def instance(self, obj: Any) -> SafeString:
        return format_html('<span title="{}">{}</span>', obj.instance_id, str(obj.instance_id)[:8])

    @admin.display(description="started", ordering="started_at")
    def started(self, obj: Any) -> str:
        return display.when(obj.started_at)

    @admin.display(description="heartbeat age", ordering="wp_heartbeat_age")
    def heartbeat(self, obj: Any) -> SafeString | str:
        return display.heartbeat(obj.wp_heartbeat_age, obj.wp_alive_lock)

    @admin.display(description="live", ordering="wp_live")
    def live(self, obj: Any) -> SafeString:
        return yes_no(obj.wp_live)

    @admin.display(description="alive-lock held", ordering="wp_alive_lock")
    def alive_lock(self, obj: Any) -> SafeString:
        return yes_no(obj.wp_alive_lock)

    @admin.display(description="listener", ordering="wp_listening")
    def listening(self, obj: Any) -> SafeString:
        return yes_no(obj.wp_listening)

    def _held(self, obj: Any, category: str) -> SafeString | int:
        count = getattr(obj, f"wp_held_{category}")
        if not count:
            return 0
        model = WORK_MODELS[category][0]
        return format_html(
            '<a href="{}">{}</a>', changelist_url(model, owner=str(obj.instance_id)), count
        )

    @admin.display(description="outbox held", ordering="wp_held_outbox")
    def held_outbox(self, obj: Any) -> SafeString | int:
        return self._held(obj, "outbox")

    @admin.display(description="inbox held", ordering="wp_held_inbox")
    def held_inbox(self, obj: Any) -> SafeString | int:
        return self._held(obj, "inbox")

    @admin.display(description="perspective held", ordering="wp_held_perspective_event")
    def held_perspective_event(self, obj: Any) -> SafeString | int:
        return self._held(obj, "perspective_event")

    @admin.display(description="receptor held", ordering="wp_held_receptor")
    def held_receptor(self, obj: Any) -> SafeString | int:
        return self._held(obj, "receptor")

    # -- the eviction action

    @admin.action(permissions=["evict_instance"], description="Evict (release all its work)")
    def evict(self, request: HttpRequest, queryset: QuerySet[Any]) -> TemplateResponse | None:
        if request.POST.get("post") != "yes":
            return confirmation(
                self,
                request,
                queryset,
                action="evict",
                title="Evict these instances?",
                warning=(
                    "An evicted instance is tombstoned: its next heartbeat is refused and it "
                    "exits. Every lease it holds is released now, so a live instance's "
                    "running work may run twice."
                ),
                button="Yes, evict",
                describe=lambda obj: format_html(
                    "{} — heartbeat {} ago ({}), {} rows held",
                    obj,
                    display.duration(obj.wp_heartbeat_age),
                    "live" if obj.wp_live else "not live",
                    sum(getattr(obj, f"wp_held_{c}") for c in WORK_MODELS),
                ),
            )
        reason = f"evicted in the admin by {request.user.get_username()}"
        ids = list(queryset.values_list("instance_id", flat=True))
        released = 0
        with transaction.atomic(using=get_settings()["DATABASE_ALIAS"]):
            for instance_id in ids:
                rows = db.fetch_named(
                    ADMIN_QUERIES,
                    "evict_instance",
                    {"instance_id": instance_id, "reason": reason},
                )
                released += int(rows[0]["released"])
        self.message_user(
            request,
            f"Evicted {len(ids)} instance{'s' if len(ids) != 1 else ''}; "
            f"{released} row{'s' if released != 1 else ''} released, claimable again.",
            messages.SUCCESS,
        )
        return None

    # -- the summary page

    def summary_view(self, request: HttpRequest) -> TemplateResponse:
        """Counts per category x state and the rest of ``workpump_status``."""
        if not can_view_summary(self.admin_site, request):
            raise PermissionDenied
        report = status.collect()  # without JIT, as every page (admin/base.py)
        snapshot = report.vacuum.oldest_snapshot
        categories = []
        for category in report.categories:
            model = WORK_MODELS[category.category][0]
            categories.append(
                {
                    "name": category.category,
                    "label": model._meta.verbose_name_plural,
                    "url": changelist_url(model),
                    "counts": [
                        (
                            state,
                            category.counts[state],
                            changelist_url(model, state=state),
                            state in category.estimated,
                        )
                        for state in status.STATES
                    ],
                    "total": category.total,
                    "oldest": (
                        display.duration(category.oldest_pending_age_seconds)
                        if category.oldest_pending_age_seconds is not None
                        else display.DASH
                    ),
                    "oldest_seconds": category.oldest_pending_age_seconds,
                    "stuck_url": changelist_url(model, state="stuck"),
                }
            )
        totals = [
            (state, sum(c.counts[state] for c in report.categories)) for state in status.STATES
        ]
        instances = [
            {
                "status": instance,
                "age": display.heartbeat(instance.heartbeat_age_seconds, instance.alive_lock_held),
                "held": instance.total_held,
                "held_estimated": bool(instance.rows_held_estimated),
            }
            for instance in report.instances
        ]
        context = {
            **self.admin_site.each_context(request),
            "title": "Work pump summary",
            "exact_limit": f"{status.EXACT_COUNT_LIMIT:,}",
            "subtitle": None,
            "opts": self.model._meta,
            "app_label": self.model._meta.app_label,
            "report": report,
            "states": status.STATES,
            "categories": categories,
            "totals": totals,
            "grand_total": sum(c.total for c in report.categories),
            "dead_total": sum(report.dead_counts.values()),
            "unhandled_total": sum(u.rows for u in report.unhandled),
            "unhandled": [
                {"topic": u, "oldest": display.duration(u.oldest_age_seconds)}
                for u in report.unhandled
            ],
            "live_instances": sum(1 for i in report.instances if i.live),
            "instances": instances,
            "instances_url": changelist_url(ServiceInstance),
            "streams_url": reverse("admin:workpump_activestream_changelist"),
            "tombstones_url": reverse("admin:workpump_eviction_changelist"),
            "vacuum": [
                {
                    "table": table,
                    "age": (
                        "never"
                        if table.vacuum_age_seconds is None
                        else display.duration(table.vacuum_age_seconds)
                    ),
                }
                for table in report.vacuum.tables
            ],
            "oldest_snapshot": snapshot,
            "oldest_snapshot_open": (
                display.duration(snapshot.open_seconds)
                if snapshot is not None and snapshot.open_seconds is not None
                else display.DASH
            ),
        }
        request.current_app = self.admin_site.name
        return TemplateResponse(request, "admin/workpump/summary.html", context)


class EvictionAdmin(ReadOnlyAdmin):
    """Tombstones of evicted instances: their heartbeats are refused from then on."""

    list_display = ["instance_id", "evicted", "age", "reason"]
    search_fields = ["=instance_id", "reason"]
    ordering = ["-evicted_at"]

    def get_queryset(self, request: HttpRequest) -> QuerySet[Any]:
        return super().get_queryset(request).annotate(wp_age=seconds_since("evicted_at"))

    def get_search_results(
        self, request: HttpRequest, queryset: QuerySet[Any], search_term: str
    ) -> tuple[QuerySet[Any], bool]:
        try:
            ServiceInstance._meta.pk.to_python(search_term.strip())
        except ValidationError:
            term = search_term.strip()
            return (queryset.filter(reason__icontains=term) if term else queryset), False
        return super().get_search_results(request, queryset, search_term)

    @admin.display(description="evicted", ordering="evicted_at")
    def evicted(self, obj: Any) -> str:
        return display.when(obj.evicted_at)

    @admin.display(description="age", ordering="-wp_age")
    def age(self, obj: Any) -> str:
        return f"{display.duration(obj.wp_age)} ago"


class StreamOwnerFilter(admin.SimpleListFilter):
    title = "owner"
    parameter_name = "owner"

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, str]]:
        return [("none", "nobody"), ("live", "a live instance"), ("not-live", "not live")]

    def queryset(self, request: HttpRequest, queryset: QuerySet[Any]) -> QuerySet[Any]:
        value = self.value()
        if value == "none":
            return queryset.filter(owner_instance_id__isnull=True)
        if value == "live":
            return queryset.filter(wp_holder=HOLDER_LIVE)
        if value == "not-live":
            return queryset.filter(owner_instance_id__isnull=False).exclude(wp_holder=HOLDER_LIVE)
        return queryset


class ActiveStreamAdmin(ReadOnlyAdmin):
    """Stream ownership (``workpump_active_stream``): who works on which ordered stream."""

    list_display = [
        "stream",
        "category",
        "scope",
        "owner",
        "owner_heartbeat",
        "stream_lease",
        "pending_rows",
        "last_activity",
    ]
    list_filter = ["category", StreamOwnerFilter]
    search_fields = ["stream", "scope"]
    ordering = ["category", "scope", "stream"]

    def get_queryset(self, request: HttpRequest) -> QuerySet[Any]:
        undone = Case(
            *(
                When(category=category, then=undone_in_stream(model, admin_class.spec))
                for category, (model, admin_class) in WORK_MODELS.items()
            ),
            default=Value(0),
            output_field=IntegerFieldType(),
        )
        return (
            super()
            .get_queryset(request)
            .annotate(
                wp_holder=holder_kind("owner_instance_id"),
                wp_owner_label=instance_label("owner_instance_id"),
                wp_owner_heartbeat_age=instance_heartbeat_age("owner_instance_id"),
                wp_lease_seconds_left=seconds_until("lease_expiry"),
                wp_undone=undone,
            )
        )

    @admin.display(description="owner", ordering="wp_owner_label")
    def owner(self, obj: Any) -> SafeString | str:
        if obj.owner_instance_id is None:
            return display.DASH
        label = obj.wp_owner_label or str(obj.owner_instance_id)[:8]
        note = "" if obj.wp_holder == HOLDER_LIVE else f" ({obj.wp_holder})"
        return format_html('<span title="{}">{}{}</span>', obj.owner_instance_id, label, note)

    @admin.display(description="owner heartbeat", ordering="wp_owner_heartbeat_age")
    def owner_heartbeat(self, obj: Any) -> SafeString | str:
        if obj.owner_instance_id is None:
            return display.DASH
        if obj.wp_owner_heartbeat_age is None:
            return obj.wp_holder
        return display.heartbeat(obj.wp_owner_heartbeat_age, owner_holds_alive_lock(obj))

    @admin.display(description="stream lease expires", ordering="lease_expiry")
    def stream_lease(self, obj: Any) -> SafeString | str:
        if obj.lease_expiry is None:
            return display.DASH
        return format_html(
            "{}<br>{}", display.when(obj.lease_expiry), display.relative(obj.wp_lease_seconds_left)
        )

    @admin.display(description="pending rows", ordering="wp_undone")
    def pending_rows(self, obj: Any) -> SafeString | int:
        if not obj.wp_undone:
            return 0
        model = WORK_MODELS[obj.category][0]
        return format_html(
            '<a href="{}">{}</a>', changelist_url(model, q=obj.stream), obj.wp_undone
        )

    @admin.display(description="last activity", ordering="last_activity_at")
    def last_activity(self, obj: Any) -> str:
        return display.when(obj.last_activity_at)
