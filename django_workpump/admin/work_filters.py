"""The work changelists' filters (state, topic, owner) and each state's default order,
each read through the table's partial indexes (docs/admin.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from django.contrib import admin
from django.core.exceptions import ValidationError
from django.db.models import QuerySet
from django.db.models.functions import Coalesce
from django.http import HttpRequest

from django_workpump.admin.base import pump_database
from django_workpump.admin.expressions import (
    WorkSpec,
    held_seqs,
    not_live_seqs,
    pending_seqs,
    state_condition,
    stuck_seqs,
)
from django_workpump.models import (
    ServiceInstance,
    dead_condition,
    ready_condition,
    timer_condition,
)
from django_workpump.registry import registry
from django_workpump.states import WorkState
from django_workpump.status import STATES

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
    WorkState.DONE: PageOrder(("-done_at", "-seq"), "most recently done first"),  # _done
    WorkState.CANCELLED: PageOrder(("-done_at", "-seq"), "most recently ended first"),  # _ended
    WorkState.DISCARDED: PageOrder(("-done_at", "-seq"), "most recently ended first"),
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
        topic = request.GET.get("topic")
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
    """The topic of a row (its outbox destination, inbox handler, perspective or receptor).

    Its choices are the topics of the registered handlers and of a bounded sample of the
    rows that need attention (claimable, waiting for a time, dead), each read through its
    partial index: never a DISTINCT over the whole table, which holds mostly done rows.
    The parameter is ``?topic=...`` for every table.
    """

    title = "topic"
    parameter_name = "topic"

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, str]]:
        topics = set(topic_choices(model_admin.model, self.spec))
        if self.value():
            topics.add(str(self.value()))
        return [(topic, topic) for topic in sorted(topics)]

    def queryset(self, request: HttpRequest, queryset: QuerySet[Any]) -> QuerySet[Any]:
        value = self.value()
        if value is None:
            return queryset
        return queryset.filter(topic=value)


# Rows read from each index of rows that need attention for the topic filter's choices.
TOPIC_SAMPLE_ROWS = 500


def topic_choices(model: Any, spec: WorkSpec) -> list[str]:
    """Registered topics of ``spec``'s category and those of rows that need attention.

    One query: the first rows of the _ready, _timer and _dead indexes, in index order.
    """
    registered = {handler.topic for handler in registry.handlers(spec.category)}
    rows = model._default_manager.using(pump_database()).order_by()
    ready = rows.filter(ready_condition()).order_by("-priority", "seq")
    timer = rows.filter(timer_condition()).order_by(Coalesce("lease_expiry", "scheduled_for"))
    dead = rows.filter(dead_condition()).order_by("dead_lettered_at")
    samples = [
        qs.values_list("topic", flat=True)[:TOPIC_SAMPLE_ROWS] for qs in (ready, timer, dead)
    ]
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
            topic = request.GET.get("topic")
            return queryset.filter(seq__in=not_live_seqs(self.spec, topic))
        try:
            return queryset.filter(instance_id=value)
        except ValidationError:
            return queryset.none()
