"""The admin of the four work tables: state, lease, attempts and heartbeat per row, and
the operator actions, each through the SQL function that keeps leases fenced (docs/admin.md).
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any, Literal, cast

from django.contrib import admin, messages
from django.contrib.admin import helpers
from django.contrib.admin.utils import model_ngettext
from django.contrib.admin.views.main import ORDER_VAR, ChangeList
from django.core.exceptions import PermissionDenied, ValidationError
from django.db.models import F, Q, QuerySet, TextField
from django.db.models.expressions import Combinable
from django.db.models.functions import Cast, Coalesce
from django.http import HttpRequest, HttpResponse, HttpResponseRedirect
from django.template.response import TemplateResponse
from django.urls import URLPattern, path, reverse
from django.utils.html import format_html, format_html_join
from django.utils.safestring import SafeString

from django_workpump import db
from django_workpump.actions import MAX_REASON_CHARS
from django_workpump.admin import display
from django_workpump.admin.base import WorkpumpModelAdmin, pump_database
from django_workpump.admin.expressions import (
    ADMIN_QUERIES,
    HOLDER_LIVE,
    NOT_LIVE_HOLDERS,
    WorkSpec,
    annotate_work,
    held_seqs,
    not_live_seqs,
    owner_holds_alive_lock,
    pending_seqs,
    state_condition,
    state_of,
    stuck_seqs,
)
from django_workpump.admin.pagination import EstimatingPaginator
from django_workpump.admin.perms import has_model_permission
from django_workpump.conf import get_settings
from django_workpump.dead_letters import log_when_committed
from django_workpump.models import (
    ServiceInstance,
    dead_condition,
    ready_condition,
    timer_condition,
)
from django_workpump.registry import registry
from django_workpump.states import ENDED_STATES, WorkState
from django_workpump.status import STATES

# The most rows one admin action changes: "select all" over a large table is refused
# with a message instead of one statement that locks every row.
MAX_ACTION_ROWS = 1_000


def admin_reason(username: str) -> str:
    """The failure reason of rows a user dead-lettered in the admin, cut to fit its column
    (the dead-letter's ERROR log line names the user in full)."""
    reason = f"dead-lettered in the admin by {username}"
    return reason if len(reason) <= MAX_REASON_CHARS else reason[: MAX_REASON_CHARS - 1] + "…"


NEIGHBOURS = 5  # rows shown on each side of a row of an ordered stream
STUCK = "stuck"


@dataclass(frozen=True)
class PageOrder:
    """A changelist's default order (Django ordering names) and how the page says it."""

    ordering: tuple[str, ...]
    note: str


NEWEST_FIRST = PageOrder(("-seq",), "newest first")
# The default order of a state's page, when the operator has not sorted by a column: the
# order of the partial index that holds the state's rows, so the page reads the rows it
# shows instead of scanning the table newest first past rows of other states
# (docs/admin.md). The leased, orphaned and stuck pages read their indexes newest first.
STATE_ORDERS: dict[str | None, PageOrder] = {
    WorkState.DONE: PageOrder(("-wp_done", "-seq"), "most recently done first"),  # _done
    WorkState.CANCELLED: PageOrder(("-wp_done", "-seq"), "most recently ended first"),  # _ended
    WorkState.DISCARDED: PageOrder(("-wp_done", "-seq"), "most recently ended first"),
    WorkState.DEAD: PageOrder(("-dead_lettered_at", "-seq"), "most recently dead-lettered first"),
    WorkState.SCHEDULED: PageOrder(("scheduled_for", "seq"), "soonest due first"),  # _waiting
    # _ready's order (pending_seqs): the order the pump claims them in.
    WorkState.PENDING: PageOrder(
        ("-priority", "seq"), "in claim order: highest priority first, then oldest first"
    ),
}


def page_order(state: str | None) -> PageOrder:
    """The default order of the page of ``state`` (a value of the state filter, or None)."""
    return STATE_ORDERS.get(state, NEWEST_FIRST)


class WorkFilter(admin.SimpleListFilter):
    """A filter of a work changelist, which knows the table's ``WorkSpec``."""

    def __init__(self, request: HttpRequest, params: Any, model: Any, model_admin: Any) -> None:
        self.spec: WorkSpec = model_admin.spec
        super().__init__(request, params, model, model_admin)


class StateFilter(WorkFilter):
    """The state of ``workpump.state_of``, plus ``stuck`` (see ``stuck_condition``).

    Each choice filters through the table's partial indexes (``state_condition``,
    ``stuck_candidates``), so its page costs the rows it selects, not the table.
    """

    title = "state"
    parameter_name = "state"

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, str]]:
        return [(state, state) for state in STATES] + [(STUCK, "stuck (needs a look)")]

    def queryset(self, request: HttpRequest, queryset: QuerySet[Any]) -> QuerySet[Any]:
        value = self.value()
        # The topic filter's topic, if any: each bounded filter applies it as it reads.
        topic = request.GET.get(self.spec.topic_field)
        if value == STUCK:
            return queryset.filter(seq__in=stuck_seqs(self.spec, topic))
        if value in (WorkState.LEASED, WorkState.ORPHANED):
            # Each holder's rows newest first (_held), not a scan past newer rows.
            return queryset.filter(seq__in=held_seqs(self.spec, value, topic))
        if value == WorkState.PENDING:
            # Three indexes, each read in the claim's order, the page's default.
            return queryset.filter(seq__in=pending_seqs(self.spec, topic))
        if value in STATES:
            return queryset.filter(state_condition(self.spec, value))
        return queryset


class TopicFilter(WorkFilter):
    """The topic (destination, handler, perspective or receptor name) of a row.

    Its choices are the topics of the registered handlers and of a bounded sample of the
    rows that need attention (claimable, waiting for a time, dead), each read through its
    partial index: never a DISTINCT over the whole table, which holds mostly done rows.
    The parameter is the topic column's name (``?destination=...``), as before.
    """

    title = "topic"
    parameter_name = "topic"  # replaced by the column's name in ``for_spec``

    @classmethod
    def for_spec(cls, spec: WorkSpec) -> type[TopicFilter]:
        """This filter with the parameter named after ``spec``'s topic column."""
        return type(f"TopicFilter_{spec.category}", (cls,), {"parameter_name": spec.topic_field})

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, str]]:
        topics = set(topic_choices(model_admin.model, self.spec))
        if self.value():
            topics.add(str(self.value()))
        return [(topic, topic) for topic in sorted(topics)]

    def queryset(self, request: HttpRequest, queryset: QuerySet[Any]) -> QuerySet[Any]:
        value = self.value()
        if value is None:
            return queryset
        return queryset.filter(**{self.spec.topic_field: value})


# Rows read from each index of rows that need attention for the topic filter's choices.
TOPIC_SAMPLE_ROWS = 500


def topic_choices(model: Any, spec: WorkSpec) -> list[str]:
    """Registered topics of ``spec``'s category and those of rows that need attention.

    One query: the first rows of the _ready, _timer and _dead indexes, in index order.
    """
    registered = {handler.topic for handler in registry.handlers(spec.category)}
    done, topic = spec.done_field, spec.topic_field
    rows = model._default_manager.using(pump_database()).order_by()
    ready = rows.filter(ready_condition(done)).order_by("-priority", "seq")
    timer = rows.filter(timer_condition(done)).order_by(Coalesce("lease_expiry", "scheduled_for"))
    dead = rows.filter(dead_condition(done)).order_by("dead_lettered_at")
    samples = [qs.values_list(topic, flat=True)[:TOPIC_SAMPLE_ROWS] for qs in (ready, timer, dead)]
    found = samples[0].union(*samples[1:], all=True)
    return sorted(registered | set(found))


class OwnerFilter(WorkFilter):
    """The instance holding the lease: a registered one, none, or one that is not live."""

    title = "owner"
    parameter_name = "owner"
    NONE = "none"
    NOT_LIVE = "not-live"

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, str]]:
        instances = ServiceInstance.objects.using(pump_database()).order_by(
            "service_name", "host_name", "started_at"
        )
        return [
            (self.NONE, "nobody (unleased)"),
            (self.NOT_LIVE, "an instance that is not live"),
            *((str(i.instance_id), str(i)) for i in instances),
        ]

    def queryset(self, request: HttpRequest, queryset: QuerySet[Any]) -> QuerySet[Any]:
        value = self.value()
        if value is None:
            return queryset
        if value == self.NONE:
            return queryset.filter(instance_id__isnull=True)
        if value == self.NOT_LIVE:
            # The rows of each holder that is not live, through the _held index.
            topic = request.GET.get(self.spec.topic_field)
            return queryset.filter(seq__in=not_live_seqs(self.spec, topic))
        try:
            return queryset.filter(instance_id=value)
        except ValidationError:
            return queryset.none()


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


class WorkAdmin(WorkpumpModelAdmin):
    """Base of the four work admins; a subclass names its table's columns in ``spec``."""

    spec: WorkSpec
    list_per_page = 50
    show_full_result_count = False  # a filtered page runs no extra count of the whole table
    paginator = EstimatingPaginator  # no exact count past EXACT_COUNT_LIMIT rows
    empty_value_display = display.DASH
    actions = [
        "retry_now",
        "release_lease",
        "force_release_lease",
        "dead_letter",
        "requeue_dead",
        "cancel",
    ]
    list_display_links = ["work_id"]
    ordering = list(NEWEST_FIRST.ordering)  # a state's page: page_order

    # -- permissions: rows are produced by send/receive/emit and removed by retention only

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_retry_work_permission(self, request: HttpRequest) -> bool:
        return has_model_permission(request, self.model, "retry_work")

    def has_release_work_lease_permission(self, request: HttpRequest) -> bool:
        return has_model_permission(request, self.model, "release_work_lease")

    def has_force_release_work_lease_permission(self, request: HttpRequest) -> bool:
        return has_model_permission(request, self.model, "force_release_work_lease")

    def has_dead_letter_work_permission(self, request: HttpRequest) -> bool:
        return has_model_permission(request, self.model, "dead_letter_work")

    def has_requeue_work_permission(self, request: HttpRequest) -> bool:
        return has_model_permission(request, self.model, "requeue_work")

    def has_cancel_work_permission(self, request: HttpRequest) -> bool:
        return has_model_permission(request, self.model, "cancel_work")

    # -- queries

    @property
    def heavy_fields(self) -> list[str]:
        fields = ["last_error", "result"]
        if self.has_own_payload:
            fields.append("payload")
        return fields

    @property
    def has_own_payload(self) -> bool:
        return any(f.name == "payload" for f in self.model._meta.concrete_fields)

    def get_ordering(self, request: HttpRequest) -> list[str | Combinable]:
        # The state filter's value, as the changelist reads it from the URL.
        return list(page_order(request.GET.get(StateFilter.parameter_name)).ordering)

    def get_queryset(self, request: HttpRequest) -> QuerySet[Any]:
        # Not ModelAdmin.get_queryset: it orders before the annotations a state's default
        # order may name (wp_done). The pump's database, as PumpDatabaseAdmin.
        rows = self.model._default_manager.using(pump_database())
        queryset = annotate_work(rows, self.spec)
        # Aliases, so the topic and done columns sort whatever each table calls them.
        queryset = queryset.annotate(
            wp_topic=F(self.spec.topic_field), wp_done=F(self.spec.done_field)
        )
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
            *super().get_urls(),
        ]

    def work_id_redirect(self, request: HttpRequest, work_id: uuid.UUID) -> HttpResponse:
        """Redirect to the change page of the row whose work id is ``work_id``."""
        if not self.has_view_or_change_permission(request):
            raise PermissionDenied
        rows = self.model._default_manager.using(pump_database())
        seq = rows.filter(**{self.spec.key_field: work_id}).values_list("seq", flat=True).first()
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
        return [StateFilter, TopicFilter.for_spec(self.spec), OwnerFilter]

    def get_search_fields(self, request: HttpRequest) -> list[str]:
        return [f"={self.spec.key_field}", self.spec.topic_field, "stream"]

    def get_search_results(
        self, request: HttpRequest, queryset: QuerySet[Any], search_term: str
    ) -> tuple[QuerySet[Any], bool]:
        # An exact id lookup with a term that is no uuid would raise: search the rest only.
        key = self.spec.key_field
        try:
            self.model._meta.get_field(key).to_python(search_term.strip())
        except ValidationError:
            term = search_term.strip()
            if not term:
                return queryset, False
            lookup = Q(**{f"{self.spec.topic_field}__icontains": term}) | Q(stream__icontains=term)
            return queryset.filter(lookup), False
        return super().get_search_results(request, queryset, search_term)

    def get_list_display(self, request: HttpRequest) -> list[Any]:
        return [
            "work_id",
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
        work = ["work_id_full", "state_detail", "topic", "stream", "priority"]
        if not self.has_own_payload:
            work.insert(3, "event_detail")
        return [
            (None, {"fields": work}),
            ("Attempts", {"fields": ["attempts_of_max", "failure_reason", "last_error_full"]}),
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

    @admin.display(description="id", ordering="seq")
    def work_id(self, obj: Any) -> SafeString:
        # In full: it is the id logs, workpump_status and cancel() print.
        key = str(getattr(obj, self.spec.key_field))
        return format_html('<span title="{}" class="wp-id">{}</span>', key, key)

    @admin.display(description="id")
    def work_id_full(self, obj: Any) -> SafeString:
        # One click selects the whole id, ready to copy.
        return format_html(
            '<code class="wp-id" style="user-select:all">{}</code>',
            getattr(obj, self.spec.key_field),
        )

    @admin.display(description="state", ordering="wp_state")
    def state(self, obj: Any) -> SafeString:
        return display.badge(obj.wp_state, "stuck" if obj.wp_stuck else "")

    @admin.display(description="state")
    def state_detail(self, obj: Any) -> SafeString:
        reasons = stuck_reasons(obj) if obj.wp_stuck else []
        note = f"stuck: {', '.join(reasons)}" if reasons else ""
        return display.badge(obj.wp_state, note)

    @admin.display(description="topic", ordering="wp_topic")
    def topic(self, obj: Any) -> str:
        return str(getattr(obj, self.spec.topic_field))

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

    @admin.display(description="created", ordering="created_at")
    def created(self, obj: Any) -> str:
        return display.when(obj.created_at)

    @admin.display(description="scheduled", ordering="scheduled_for")
    def scheduled(self, obj: Any) -> str:
        return display.when(obj.scheduled_for)

    @admin.display(description="done", ordering="wp_done")
    def done(self, obj: Any) -> str:
        return display.when(getattr(obj, self.spec.done_field))

    @admin.display(description="claimed")
    def claimed(self, obj: Any) -> str:
        return display.when(obj.claimed_at)

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
        if self.spec.scope_field:
            same[self.spec.scope_field] = getattr(obj, self.spec.scope_field)
        rows = self.model._default_manager.using(pump_database()).filter(**same)
        rows = rows.annotate(wp_state=state_of(self.spec))
        rows = rows.only(
            "seq", self.spec.key_field, "stream_head", "attempts", "max_attempts", "created_at"
        )
        before = list(rows.filter(seq__lt=obj.seq).order_by("-seq")[:NEIGHBOURS])[::-1]
        after = list(rows.filter(seq__gt=obj.seq).order_by("seq")[:NEIGHBOURS])
        info = self.model._meta.app_label, self.model._meta.model_name

        def cells(row: Any) -> tuple[Any, ...]:
            key = str(getattr(row, self.spec.key_field))
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

    # -- actions

    def _ids(self, queryset: QuerySet[Any]) -> list[Any]:
        return list(queryset.values_list(self.spec.key_field, flat=True))

    def _too_many(self, request: HttpRequest, queryset: QuerySet[Any]) -> bool:
        """Refuse (with a message) a selection over MAX_ACTION_ROWS, e.g. "select all"."""
        selected = len(queryset.values_list("pk", flat=True)[: MAX_ACTION_ROWS + 1])
        if selected <= MAX_ACTION_ROWS:
            return False
        self.message_user(
            request,
            f"More than {MAX_ACTION_ROWS:,} {model_ngettext(self.opts, 2)} selected: an action "
            f"changes at most {MAX_ACTION_ROWS:,} at a time. Narrow the selection with the "
            "filters, or use manage.py workpump_action for bulk changes.",
            messages.ERROR,
        )
        return True

    def _run(self, name: str, **params: Any) -> set[Any]:
        rows = db.fetch_named(ADMIN_QUERIES, name, {"category": self.spec.category, **params})
        return {row["id"] for row in rows}

    def _rows(self, count: int) -> str:
        return f"{count} {model_ngettext(self.opts, count)}"

    @admin.action(permissions=["retry_work"], description="Retry now (scheduled → pending)")
    def retry_now(self, request: HttpRequest, queryset: QuerySet[Any]) -> None:
        if self._too_many(request, queryset):
            return
        ids = self._ids(queryset)
        changed = self._run("retry_now", ids=ids)
        if changed:
            self.message_user(request, f"Retried {self._rows(len(changed))} now.", messages.SUCCESS)
        if skipped := len(ids) - len(changed):
            self.message_user(
                request,
                f"{self._rows(skipped)} left as they were: only scheduled rows (waiting for a "
                "retry or a deferral; not leased, done or dead) can be retried now.",
                messages.WARNING,
            )

    @admin.action(
        permissions=["release_work_lease"],
        description="Release lease (held → pending; not from a live instance)",
    )
    def release_lease(self, request: HttpRequest, queryset: QuerySet[Any]) -> None:
        if self._too_many(request, queryset):
            return
        self._release(request, queryset, force=False)

    @admin.action(
        permissions=["force_release_work_lease"],
        description="Force-release lease, even from a live instance (asks first)",
    )
    def force_release_lease(
        self, request: HttpRequest, queryset: QuerySet[Any]
    ) -> TemplateResponse | None:
        if self._too_many(request, queryset):
            return None
        if request.POST.get("post") != "yes":
            return self._confirm(
                request,
                queryset,
                action="force_release_lease",
                title="Force-release leases?",
                warning=(
                    "A live instance may still be running these rows: released, they can be "
                    "claimed again and run twice. Its late completion is fenced out."
                ),
                button="Yes, release these leases",
            )
        self._release(request, queryset, force=True)
        return None

    def _release(self, request: HttpRequest, queryset: QuerySet[Any], *, force: bool) -> None:
        settings = get_settings()
        ids = self._ids(queryset)
        released = self._run(
            "release_leases",
            ids=ids,
            force=force,
            stale_after_seconds=settings["STALE_AFTER_SECONDS"],
            definitively_dead_after_seconds=settings["DEFINITIVELY_DEAD_AFTER_SECONDS"],
        )
        if released:
            self.message_user(
                request,
                f"Released the leases of {self._rows(len(released))}; they can be claimed again.",
                messages.SUCCESS,
            )
        # What is still held after the call was refused: its holder is live.
        key = self.spec.key_field
        refused = (
            self.model._default_manager.using(pump_database())
            .filter(
                **{f"{key}__in": ids, f"{self.spec.done_field}__isnull": True},
                instance_id__isnull=False,
            )
            .count()
        )
        if refused:
            self.message_user(
                request,
                f"{self._rows(refused)} not released: held by a live instance, which may "
                "still be running them. Use “Force-release lease” if that instance is hung.",
                messages.ERROR,
            )
        if unheld := len(ids) - len(released) - refused:
            self.message_user(
                request, f"{self._rows(unheld)} had no lease to release.", messages.WARNING
            )

    @admin.action(
        permissions=["dead_letter_work"],
        description="Dead-letter (park as dead; asks first for rows a live instance holds)",
    )
    def dead_letter(self, request: HttpRequest, queryset: QuerySet[Any]) -> TemplateResponse | None:
        if self._too_many(request, queryset):
            return None
        held_live = any(
            obj.instance_id is not None and obj.wp_holder == HOLDER_LIVE for obj in queryset
        )
        if held_live and request.POST.get("post") != "yes":
            return self._confirm(
                request,
                queryset,
                action="dead_letter",
                title="Dead-letter rows a live instance is running?",
                warning=(
                    "A live instance holds some of these rows and may be running them now: "
                    "dead-lettered, their handlers' outcomes are fenced out, but what the "
                    "handlers already did is not undone."
                ),
                button="Yes, dead-letter these rows",
            )
        self._dead_letter(request, queryset)
        return None

    def _dead_letter(self, request: HttpRequest, queryset: QuerySet[Any]) -> None:
        ids = self._ids(queryset)
        user = request.user.get_username()
        reason = admin_reason(user)
        changed = self._run("dead_letter", ids=ids, reason=reason)
        log_when_committed(
            self.spec.category,
            changed,
            reason,
            by=f"{user!r} in the admin",
            using=get_settings()["DATABASE_ALIAS"],
        )
        if changed:
            self.message_user(
                request,
                f"Dead-lettered {self._rows(len(changed))}; they are never claimed again "
                "until re-queued.",
                messages.SUCCESS,
            )
        if skipped := len(ids) - len(changed):
            self.message_user(
                request,
                f"{self._rows(skipped)} left as they were: already done or dead.",
                messages.WARNING,
            )

    @admin.action(permissions=["requeue_work"], description="Re-queue dead rows (attempts reset)")
    def requeue_dead(self, request: HttpRequest, queryset: QuerySet[Any]) -> None:
        if self._too_many(request, queryset):
            return
        ids = self._ids(queryset)
        changed = self._run("requeue_dead", ids=ids)
        if changed:
            self.message_user(
                request,
                f"Re-queued {self._rows(len(changed))}: attempts reset to 0, last error kept.",
                messages.SUCCESS,
            )
        if skipped := len(ids) - len(changed):
            self.message_user(
                request,
                f"{self._rows(skipped)} left as they were: only dead rows can be re-queued.",
                messages.WARNING,
            )

    @admin.action(
        permissions=["cancel_work"],
        description="Cancel (end as cancelled; asks first for rows a live instance runs)",
    )
    def cancel(self, request: HttpRequest, queryset: QuerySet[Any]) -> TemplateResponse | None:
        if self._too_many(request, queryset):
            return None
        held = any(obj.instance_id is not None for obj in queryset)
        if held and request.POST.get("post") != "yes":
            return self._confirm(
                request,
                queryset,
                action="cancel",
                title="Cancel rows that are running?",
                warning=(
                    "Some of these rows are leased: their handlers are told to stop at once "
                    "(work.cancelled; an async handler's task is cancelled) and what they "
                    "report later is fenced out, but what they already did is not undone."
                ),
                button="Yes, cancel these rows",
            )
        ids = self._ids(queryset)
        changed = self._run("cancel_work", ids=ids)
        if changed:
            self.message_user(
                request,
                f"Cancelled {self._rows(len(changed))}; they never run again and their "
                "streams move on.",
                messages.SUCCESS,
            )
        if skipped := len(ids) - len(changed):
            self.message_user(
                request,
                f"{self._rows(skipped)} left as they were: already ended (done, cancelled or "
                "discarded).",
                messages.WARNING,
            )
        return None

    def _confirm(
        self,
        request: HttpRequest,
        queryset: QuerySet[Any],
        *,
        action: str,
        title: str,
        warning: str,
        button: str,
    ) -> TemplateResponse:
        return confirmation(
            self,
            request,
            queryset,
            action=action,
            title=title,
            warning=warning,
            button=button,
            describe=lambda obj: format_html(
                "{} — {} {}, held by {}",
                obj,
                obj.wp_state,
                "(stuck)" if obj.wp_stuck else "",
                (obj.wp_owner_label or obj.instance_id or "nobody")
                if obj.instance_id is None or obj.wp_holder == HOLDER_LIVE
                else f"{obj.wp_owner_label or obj.instance_id} ({obj.wp_holder})",
            ),
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


def confirmation(
    model_admin: admin.ModelAdmin,
    request: HttpRequest,
    queryset: QuerySet[Any],
    *,
    action: str,
    title: str,
    warning: str,
    button: str,
    describe: Any,
) -> TemplateResponse:
    """An intermediate page that posts the same action back with ``post=yes``."""
    opts = model_admin.model._meta
    context = {
        **model_admin.admin_site.each_context(request),
        "title": title,
        "subtitle": None,
        "opts": opts,
        "app_label": opts.app_label,
        "action": action,
        "warning": warning,
        "button": button,
        "objects": [(obj.pk, describe(obj)) for obj in queryset],
        "action_checkbox_name": helpers.ACTION_CHECKBOX_NAME,
        "media": model_admin.media,
    }
    request.current_app = model_admin.admin_site.name
    return TemplateResponse(request, "admin/workpump/confirm_action.html", context)


class OutboxAdmin(WorkAdmin):
    spec = WorkSpec.of("outbox")


class InboxAdmin(WorkAdmin):
    spec = WorkSpec.of("inbox")


class PerspectiveEventAdmin(WorkAdmin):
    spec = WorkSpec.of("perspective_event")


class ReceptorProcessingAdmin(WorkAdmin):
    spec = WorkSpec.of("receptor")
