"""The admin of the four work tables: state, lease, attempts and heartbeat per row
(docs/admin.md). The operator actions are in ``work_actions``, the filters and each
state's default order in ``work_filters``.
"""

from __future__ import annotations

import uuid
from datetime import datetime
from typing import Any, Literal, cast

from django.contrib import admin, messages
from django.contrib.admin.views.main import ORDER_VAR, ChangeList
from django.core.exceptions import PermissionDenied, ValidationError
from django.db.models import Max, QuerySet, TextField
from django.db.models.expressions import Combinable
from django.db.models.functions import Cast
from django.http import HttpRequest, HttpResponse, HttpResponseRedirect
from django.urls import URLPattern, path, reverse
from django.utils.html import format_html, format_html_join
from django.utils.safestring import SafeString

from django_workpump import db
from django_workpump.admin import display, work_search
from django_workpump.admin.base import pump_database
from django_workpump.admin.expressions import (
    HOLDER_LIVE,
    NOT_LIVE_HOLDERS,
    WorkSpec,
    annotate_work,
    owner_holds_alive_lock,
    state_of,
)
from django_workpump.admin.pagination import EstimatingPaginator
from django_workpump.admin.work_actions import WorkActionsAdmin
from django_workpump.admin.work_bulk import BulkActionsAdmin
from django_workpump.admin.work_filters import (
    NEWEST_FIRST,
    OwnerFilter,
    StateFilter,
    TopicFilter,
    page_order,
)
from django_workpump.categories import category
from django_workpump.conf import get_settings
from django_workpump.models import AttemptLog
from django_workpump.states import ENDED_STATES, WorkState

NEIGHBOURS = 5  # rows shown on each side of a row of an ordered stream
SHOWN_LOG_RECORDS = 200  # a row's attempt logs shown on its page, the latest attempt first


class WorkChangeList(ChangeList):
    """The changelist never loads payloads, results or full errors, counts its rows
    exactly only up to ``EXACT_COUNT_LIMIT`` (``EstimatingPaginator``), and says its
    default order (``page_order``) until the operator sorts by a column."""

    result_count_estimated = False  # the page says "about N"
    order_note = ""  # e.g. "most recently done first"; empty once sorted by a column

    def __init__(self, request: HttpRequest, *args: Any, **kwargs: Any) -> None:
        super().__init__(request, *args, **kwargs)
        if ORDER_VAR not in self.params:
            self.order_note = page_order(self.params.get(StateFilter.parameter_name)).note

    def get_ordering_field_columns(self) -> dict[int, Literal["desc", "asc"]]:
        if ORDER_VAR in self.params:
            return super().get_ordering_field_columns()
        # The header arrow of the default order's first key, when a column shows it (Django
        # would mark the ModelAdmin's ordering, not this page's).
        first = page_order(self.params.get(StateFilter.parameter_name)).ordering[0]
        for index, attr in enumerate(self.list_display):
            if self.get_ordering_field(attr) == first.removeprefix("-"):
                return {index: "desc" if first.startswith("-") else "asc"}
        return {}

    def get_queryset(self, request: HttpRequest, exclude_parameters: Any = None) -> QuerySet[Any]:
        queryset = super().get_queryset(request, exclude_parameters)
        return queryset.defer(*cast("WorkAdmin", self.model_admin).heavy_fields)

    def get_results(self, request: HttpRequest) -> None:
        super().get_results(request)
        self.result_count_estimated = getattr(self.paginator, "estimated", False)


class WorkAdmin(BulkActionsAdmin, WorkActionsAdmin):
    """Base of the four work admins; a subclass names its table's columns in ``spec``."""

    spec: WorkSpec
    list_per_page = 50
    show_full_result_count = False  # a filtered page runs no extra count of the whole table
    paginator = EstimatingPaginator  # no exact count past EXACT_COUNT_LIMIT rows
    empty_value_display = display.DASH
    list_display_links = ["work_id_cell"]
    ordering = list(NEWEST_FIRST.ordering)  # a state's page: page_order

    # -- permissions: rows are produced by send/receive/emit and removed by retention only

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    # -- queries

    @property
    def heavy_fields(self) -> list[str]:
        fields = ["last_error", "result"]
        if self.has_own_payload:
            fields.append("payload")
        return fields

    @property
    def has_own_payload(self) -> bool:
        return category(self.spec.category).payload_on_row

    def get_ordering(self, request: HttpRequest) -> list[str | Combinable]:
        # The state filter's value, as the changelist reads it from the URL.
        return list(page_order(request.GET.get(StateFilter.parameter_name)).ordering)

    def get_queryset(self, request: HttpRequest) -> QuerySet[Any]:
        # Not ModelAdmin.get_queryset: it orders before the annotations a sorted column
        # may name (wp_state). The pump's database, as PumpDatabaseAdmin.
        rows = self.model._default_manager.using(pump_database())
        queryset = annotate_work(rows, self.spec)
        return queryset.order_by(*self.get_ordering(request))

    def get_changelist(self, request: HttpRequest, **kwargs: Any) -> type[ChangeList]:
        return WorkChangeList

    def get_urls(self) -> list[URLPattern]:
        # Logs, workpump_status, cancel() and workpump_action name a row by its work id,
        # the admin's own URLs by seq: a work id's URL redirects to its row's page.
        by_work_id = self.admin_site.admin_view(self.work_id_redirect)
        return [
            path("<uuid:work_id>/", by_work_id),
            path("<uuid:work_id>/change/", by_work_id),
            *self.bulk_urls(),
            *super().get_urls(),
        ]

    def work_id_redirect(self, request: HttpRequest, work_id: uuid.UUID) -> HttpResponse:
        """Redirect to the change page of the row whose work id is ``work_id``."""
        if not self.has_view_or_change_permission(request):
            raise PermissionDenied
        rows = self.model._default_manager.using(pump_database())
        seq = rows.filter(work_id=work_id).values_list("seq", flat=True).first()
        name = f"admin:{self.opts.app_label}_{self.opts.model_name}"
        if seq is None:
            messages.warning(
                request,
                f"No {self.opts.verbose_name} has the id {work_id}: check the id, or "
                "retention may have removed the row.",
            )
            return HttpResponseRedirect(
                reverse(f"{name}_changelist", current_app=self.admin_site.name)
            )
        url = reverse(f"{name}_change", args=[seq], current_app=self.admin_site.name)
        query = request.GET.urlencode()
        return HttpResponseRedirect(f"{url}?{query}" if query else url)

    def get_object(
        self, request: HttpRequest, object_id: str, from_field: str | None = None
    ) -> Any:
        # The payload is read as text: a payload Python cannot decode (written through the
        # SQL API) is shown as stored instead of failing the page.
        queryset = self.get_queryset(request)
        if self.has_own_payload:
            queryset = queryset.defer("payload")
            payload = "payload"
        else:
            queryset = queryset.select_related("event").defer("event__payload")
            payload = "event__payload"
        queryset = queryset.annotate(wp_payload_text=Cast(payload, TextField()))
        field = (
            self.model._meta.pk if from_field is None else self.model._meta.get_field(from_field)
        )
        try:
            return queryset.get(**{field.name: field.to_python(object_id)})
        except (self.model.DoesNotExist, ValidationError, ValueError):
            return None

    def get_list_filter(self, request: HttpRequest) -> list[Any]:
        return [StateFilter, TopicFilter, OwnerFilter]

    def get_search_fields(self, request: HttpRequest) -> list[str]:
        return ["=work_id", "topic", "stream"]

    def get_search_results(
        self, request: HttpRequest, queryset: QuerySet[Any], search_term: str
    ) -> tuple[QuerySet[Any], bool]:
        # work_search.py: ids and id prefixes, a time window, payload content, words.
        if not search_term.strip():
            return queryset, False
        try:
            search = work_search.parse(search_term)
        except work_search.SearchError as exc:
            messages.error(request, f"Search: {exc}")
            return queryset.none(), False
        newest_seq = None
        spec = category(self.spec.category)
        # the opt-in GIN index of the payloads: the outbox's, the inbox's or the events'
        index = f"{spec.index_prefix}_payload" if spec.payload_on_row else "wp_event_payload"
        if search.payload is not None and not db.payload_index_ready(index, using=queryset.db):
            newest_seq = queryset.model._default_manager.using(queryset.db).aggregate(
                newest=Max("seq")
            )["newest"]
        lookup, note = work_search.condition(
            search,
            payload_field="payload" if self.has_own_payload else "event__payload",
            newest_seq=newest_seq,
        )
        if note is not None:
            messages.info(request, note)
        return queryset.filter(lookup), False

    def get_list_display(self, request: HttpRequest) -> list[Any]:
        return [
            "work_id_cell",
            "state",
            "topic",
            "stream",
            "attempts_of_max",
            "lease_expires",
            "renewals",
            "owner",
            "owner_heartbeat",
            "error",
            "created",
            "scheduled",
            "done",
        ]

    def get_fieldsets(self, request: HttpRequest, obj: Any = None) -> list[tuple[Any, Any]]:
        work = ["work_id_full", "state_detail", "flow_detail", "topic", "stream", "priority"]
        if not self.has_own_payload:
            work.insert(3, "event_detail")
        return [
            (None, {"fields": work}),
            (
                "Attempts",
                {"fields": ["attempts_of_max", "failure_reason", "last_error_full", "logs"]},
            ),
            (
                "Lease",
                {"fields": ["owner_detail", "lease_detail", "renewals", "claimed"]},
            ),
            ("Times", {"fields": ["created", "scheduled", "done", "dead_lettered"]}),
            ("Payload", {"fields": ["payload_json", "result_json"]}),
            ("Stream", {"fields": ["neighbours"]}),
        ]

    def get_readonly_fields(self, request: HttpRequest, obj: Any = None) -> list[str]:
        # Everything but the priority: leases change only through the SQL functions.
        fields = [
            name for _, options in self.get_fieldsets(request, obj) for name in options["fields"]
        ]
        return [name for name in fields if name != "priority"]

    def save_model(self, request: HttpRequest, obj: Any, form: Any, change: bool) -> None:
        # Write the priority alone: a full save would write back lease columns read at the
        # time the form was loaded, over whatever a claim or renewal did since.
        if "priority" in form.changed_data:
            obj.save(update_fields=["priority"])

    # -- columns

    # Not "work_id": a model field of that name would shadow the method in list_display.
    @admin.display(description="id", ordering="seq")
    def work_id_cell(self, obj: Any) -> SafeString:
        # In full: it is the id logs, workpump_status and cancel() print.
        key = str(obj.work_id)
        return format_html('<span title="{}" class="wp-id">{}</span>', key, key)

    @admin.display(description="id")
    def work_id_full(self, obj: Any) -> SafeString:
        # One click selects the whole id, ready to copy.
        return format_html(
            '<code class="wp-id" style="user-select:all">{}</code>',
            obj.work_id,
        )

    @admin.display(description="state", ordering="wp_state")
    def state(self, obj: Any) -> SafeString:
        return display.badge(obj.wp_state, "stuck" if obj.wp_stuck else "")

    @admin.display(description="state")
    def state_detail(self, obj: Any) -> SafeString:
        reasons = stuck_reasons(obj) if obj.wp_stuck else []
        note = f"stuck: {', '.join(reasons)}" if reasons else ""
        return display.badge(obj.wp_state, note)

    @admin.display(description="flow control")
    def flow_detail(self, obj: Any) -> str:
        """The row's keys, and why it waits now (docs/flow-control.md), read at display."""
        if not obj.flow_controlled:
            return "none"
        keys = [
            f"{name} {value}"
            for name, value in (
                ("concurrency key", obj.concurrency_key),
                ("fairness key", obj.fairness_key),
            )
            if value
        ]
        waiting = None
        if obj.wp_state == WorkState.PENDING and obj.stream_head:
            waiting = db.flow_reason(
                category=self.spec.category,
                topic=obj.topic,
                concurrency_key=obj.concurrency_key,
                fairness_key=obj.fairness_key,
                using=pump_database(),
            )
        return "; ".join([*keys, waiting or "flow-controlled, not held back now"])

    @admin.display(description="event")
    def event_detail(self, obj: Any) -> str:
        return f"{obj.event.event_type} {obj.event.event_id}"

    @admin.display(description="attempts", ordering="attempts")
    def attempts_of_max(self, obj: Any) -> SafeString:
        return format_html('<span class="wp-attempts">{}/{}</span>', obj.attempts, obj.max_attempts)

    @admin.display(description="lease expires", ordering="lease_expiry")
    def lease_expires(self, obj: Any) -> SafeString | str:
        if obj.lease_expiry is None:
            return display.DASH
        expired = obj.wp_lease_seconds_left <= 0
        return format_html(
            '<span class="wp-lease-abs">{}</span><br>'
            '<span class="wp-lease-rel" style="color:{}">{}</span>',
            display.when(obj.lease_expiry),
            "#b91c1c" if expired else "inherit",
            display.relative(obj.wp_lease_seconds_left),
        )

    @admin.display(description="lease expires")
    def lease_detail(self, obj: Any) -> SafeString | str:
        return self.lease_expires(obj)

    @admin.display(description="renewals")
    def renewals(self, obj: Any) -> str:
        if obj.instance_id is None:
            return display.DASH
        return f"{obj.lease_renewals}/{get_settings()['MAX_RENEWALS_PER_WORK']}"

    @admin.display(description="owner", ordering="wp_owner_label")
    def owner(self, obj: Any) -> SafeString | str:
        if obj.instance_id is None:
            return display.DASH
        label = obj.wp_owner_label or str(obj.instance_id)[:8]
        note = "" if obj.wp_holder == HOLDER_LIVE else f" ({obj.wp_holder})"
        return format_html(
            '<span class="wp-owner" title="{}">{}{}</span>', obj.instance_id, label, note
        )

    @admin.display(description="owner")
    def owner_detail(self, obj: Any) -> SafeString | str:
        if obj.instance_id is None:
            return display.DASH
        return format_html(
            "{} — {} ({}), heartbeat {}",
            obj.instance_id,
            obj.wp_owner_label or "not registered",
            obj.wp_holder,
            self.owner_heartbeat(obj),
        )

    @admin.display(description="owner heartbeat", ordering="wp_owner_heartbeat_age")
    def owner_heartbeat(self, obj: Any) -> SafeString | str:
        if obj.instance_id is None:
            return display.DASH
        if obj.wp_owner_heartbeat_age is None:  # no instance row: evicted or gone
            return format_html(
                '<span class="wp-heartbeat wp-dead" style="color:{};font-weight:bold">{}</span>',
                display.FRESHNESS_COLOURS["dead"],
                obj.wp_holder,
            )
        return display.heartbeat(obj.wp_owner_heartbeat_age, owner_holds_alive_lock(obj))

    @admin.display(description="last error")
    def error(self, obj: Any) -> str:
        return obj.wp_error_short or ""

    @admin.display(description="last error")
    def last_error_full(self, obj: Any) -> SafeString | str:
        return display.pre(obj.last_error)

    @admin.display(description="attempt logs")
    def logs(self, obj: Any) -> SafeString | str:
        return display.attempt_logs(
            AttemptLog.objects.using(pump_database())
            .filter(work_id=obj.work_id, category=self.spec.category)
            .order_by("-attempt", "id")[:SHOWN_LOG_RECORDS]
        )

    @admin.display(description="created", ordering="created_at")
    def created(self, obj: Any) -> str:
        return display.when(obj.created_at)

    @admin.display(description="scheduled", ordering="scheduled_for")
    def scheduled(self, obj: Any) -> str:
        return display.when(obj.scheduled_for)

    @admin.display(description="done", ordering="done_at")
    def done(self, obj: Any) -> str:
        return display.when(obj.done_at)

    @admin.display(description="claimed")
    def claimed(self, obj: Any) -> str:
        text = display.when(obj.claimed_at)
        due = obj.claim_due_at
        if isinstance(obj.claimed_at, datetime) and isinstance(due, datetime):
            waited = max((obj.claimed_at - due).total_seconds(), 0.0)
            after = f"{waited * 1000:.0f} ms" if waited < 1 else display.duration(waited)
            text += f" ({after} after it was due)"
        return text

    @admin.display(description="dead-lettered")
    def dead_lettered(self, obj: Any) -> str:
        return display.when(obj.dead_lettered_at)

    @admin.display(description="payload")
    def payload_json(self, obj: Any) -> SafeString:
        return display.payload(obj.wp_payload_text)

    @admin.display(description="result")
    def result_json(self, obj: Any) -> SafeString | str:
        return display.DASH if obj.result is None else display.pretty_json(obj.result)

    @admin.display(description="neighbours in the stream")
    def neighbours(self, obj: Any) -> SafeString | str:
        if obj.stream is None:
            return "— (a stream of its own)"
        same = {"stream": obj.stream}
        if self.spec.scoped:
            same["topic"] = obj.topic
        rows = self.model._default_manager.using(pump_database()).filter(**same)
        rows = rows.annotate(wp_state=state_of(self.spec))
        rows = rows.only("seq", "work_id", "stream_head", "attempts", "max_attempts", "created_at")
        before = list(rows.filter(seq__lt=obj.seq).order_by("-seq")[:NEIGHBOURS])[::-1]
        after = list(rows.filter(seq__gt=obj.seq).order_by("seq")[:NEIGHBOURS])
        info = self.model._meta.app_label, self.model._meta.model_name

        def cells(row: Any) -> tuple[Any, ...]:
            key = str(row.work_id)
            this = row.seq == obj.seq
            link = (
                format_html("<strong>{} (this row)</strong>", key[:8])
                if this
                else format_html(
                    '<a href="{}">{}</a>',
                    reverse("admin:{}_{}_change".format(*info), args=[row.pk]),
                    key[:8],
                )
            )
            return (
                row.seq,
                link,
                display.badge(row.wp_state),
                "head" if row.stream_head and row.wp_state not in ENDED_STATES else "",
                f"{row.attempts}/{row.max_attempts}",
                display.when(row.created_at),
            )

        body = format_html_join(
            "",
            "<tr><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td></tr>",
            (cells(row) for row in [*before, obj, *after]),
        )
        return format_html(
            '<table class="wp-neighbours"><thead><tr><th>seq</th><th>id</th><th>state</th>'
            "<th></th><th>attempts</th><th>created</th></tr></thead><tbody>{}</tbody></table>",
            body,
        )


def stuck_reasons(obj: Any) -> list[str]:
    """Why an annotated row is stuck, in the words of the stuck filter."""
    reasons = []
    if obj.wp_holder in NOT_LIVE_HOLDERS:
        reasons.append(f"holder {obj.wp_holder}")
    if obj.wp_state == WorkState.ORPHANED:
        reasons.append("orphaned")
    if obj.attempts > 1 and obj.attempts * 2 >= obj.max_attempts:
        reasons.append("attempts high")
    if obj.wp_blocked:
        reasons.append("stream blocked by its head")
    return reasons


class OutboxAdmin(WorkAdmin):
    spec = WorkSpec.of("outbox")


class InboxAdmin(WorkAdmin):
    spec = WorkSpec.of("inbox")


class PerspectiveEventAdmin(WorkAdmin):
    spec = WorkSpec.of("perspective_event")


class ReceptorProcessingAdmin(WorkAdmin):
    spec = WorkSpec.of("receptor")
