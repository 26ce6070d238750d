"""Query expressions of the admin: states, ages and the stuck rule, computed by PostgreSQL.

Every time comes from the database clock, ``now()`` (the transaction's start, the clock
``workpump.state_of`` and the status report use), never from Python, so one page shows
one instant and sorting or filtering by state or age happens in SQL.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from django.db import models
from django.db.models import (
    BooleanField,
    Case,
    CharField,
    Count,
    Exists,
    ExpressionWrapper,
    F,
    FloatField,
    Func,
    OuterRef,
    Q,
    Subquery,
    Value,
    When,
)
from django.db.models.expressions import RawSQL
from django.db.models.functions import Cast, Coalesce, Concat, Left
from django.db.models.lookups import In, Lookup
from django.db.models.sql.where import AND

from django_workpump.categories import category
from django_workpump.conf import get_settings
from django_workpump.models import (
    Eviction,
    ServiceInstance,
    attempts_high_condition,
    dead_condition,
    ended_condition,
    flow_condition,
    orphan_condition,
    ready_condition,
    timer_condition,
    waiting_condition,
)
from django_workpump.sql import named_queries
from django_workpump.states import WorkState

ADMIN_QUERIES = "admin.sql"

# What a holder of a lease is, by the liveness rule (workpump.live_instances).
HOLDER_LIVE = "live"
HOLDER_STALE = "stale"  # registered, but its heartbeat is past the cutoffs
HOLDER_EVICTED = "evicted"  # tombstoned: its heartbeats are refused
HOLDER_GONE = "gone"  # neither registered nor tombstoned (deregistered, or purged)
NOT_LIVE_HOLDERS = (HOLDER_STALE, HOLDER_EVICTED, HOLDER_GONE)


@dataclass(frozen=True)
class WorkSpec:
    """What differs between the four work tables for the admin.

    Every table names its fields alike: ``work_id``, ``topic``, ``done_at``.
    """

    category: str
    scoped: bool  # the topic orders streams together with the stream (perspective, receptor)

    @classmethod
    def of(cls, name: str) -> WorkSpec:
        """The spec of category ``name``, from ``django_workpump.categories``."""
        found = category(name)
        return cls(found.name, found.topic_scopes_streams)


class DbNow(Func):
    """``now()``: the database clock, fixed for the whole transaction."""

    template = "now()"
    output_field = models.DateTimeField()


def seconds_until(field: str) -> Func:
    """Seconds from the database clock until ``field`` (negative once it has passed).

    A difference of epochs, not of times: PostgreSQL cannot subtract an infinite time
    (one written through SQL), whose epoch is infinite instead."""
    return Func(
        F(field),
        template="(EXTRACT(EPOCH FROM %(expressions)s) - EXTRACT(EPOCH FROM now()))"
        "::double precision",
        output_field=FloatField(),
    )


def seconds_since(field: str) -> Func:
    """Seconds from ``field`` until the database clock (as ``seconds_until``, by epochs)."""
    return Func(
        F(field),
        template="(EXTRACT(EPOCH FROM now()) - EXTRACT(EPOCH FROM %(expressions)s))"
        "::double precision",
        output_field=FloatField(),
    )


def _fragment(name: str, params: tuple[Any, ...] = ()) -> RawSQL:
    """A subquery of ``sql/admin.sql`` for an ``__in`` lookup."""
    return RawSQL(named_queries(ADMIN_QUERIES)[name], params)


@dataclass(frozen=True)
class FragmentOrder:
    """The order in which a fragment of ``sql/admin.sql`` reads its rows: a page ordered
    by ``fields`` (Django ordering names, ``pk`` spelled ``seq``) needs no more of them
    than it shows. ``rows`` is that order in SQL over the fragment's rows ``s``, ``arm``
    over an arm's table rows ``t``."""

    fields: tuple[str, ...]
    rows: str
    arm: str


NEWEST_FIRST = FragmentOrder(("-seq",), "s.seq DESC", "t.seq DESC")
# The order of the _ready index, in which the claim takes claimable rows.
CLAIM_ORDER = FragmentOrder(
    ("-priority", "seq"), "s.priority DESC, s.seq", "t.priority DESC, t.seq"
)


class FilteredSeqs(RawSQL):
    """The seqs a filter of ``sql/admin.sql`` selects (``stuck_seqs``, ``not_live_seqs``,
    ``held_seqs``, ``pending_seqs``), for ``seq__in``, bounded by what the query around
    it fetches.

    The fragment reads each partial index in its ``order`` and stops after as many rows
    as the query around it can use: the page's last row (``[offset:offset + 50]``,
    ordered as the fragment reads) or the count's limit (unordered). Any other ordering,
    another condition beside it, or no limit (the planner's estimate), reads them all.
    """

    # Conditions of the query around it that the fragment applies itself, as (field,
    # lookup, value): they leave its bound valid (``bounding_fragment``).
    covered: tuple[tuple[str, str, Any], ...] = ()

    def __init__(
        self,
        name: str,
        spec: WorkSpec,
        bounds: int,
        *,
        cutoffs: bool = True,
        order: FragmentOrder = NEWEST_FIRST,
        topic: str | None = None,
        **parts: str,
    ) -> None:
        self.name, self.spec, self.bounds = name, spec, bounds
        self.cutoffs, self.order, self.topic, self.parts = cutoffs, order, topic, parts
        # The topic filter's topic, if any, is applied by each arm as it reads.
        if topic is not None:
            self.covered = (("topic", "exact", topic),)
        super().__init__("", (), output_field=models.BigIntegerField())

    def as_sql(self, compiler: Any, connection: Any) -> Any:
        sql, params = self.select(connection, *fetch_bound(compiler.query, self.order))
        return f"({sql})", params

    def select(self, connection: Any, bound: int | None, ordered: bool) -> tuple[str, list[Any]]:
        """The fragment's SELECT reading at most ``bound`` rows (None: all), in its order
        when ``ordered``, and its parameters."""
        names = {
            "table": connection.ops.quote_name(category(self.spec.category).table),
            "same_scope": "AND h.topic = r.topic" if self.spec.scoped else "",
            "same_topic": "AND t.topic = %s" if self.topic is not None else "",
            "same_topic_r": "AND r.topic = %s" if self.topic is not None else "",
            "in_order": f"ORDER BY {self.order.rows}" if ordered else "",
            # Arms read in order for a count too: unordered, a LIMIT lets the planner
            # read the table from its start, past every older row of other states.
            "arm_order": f"ORDER BY {self.order.arm}",
        }
        parts = {key: part.format(**names) for key, part in self.parts.items()}
        sql = named_queries(ADMIN_QUERIES)[self.name].format(**names, **parts)
        params: list[Any] = []
        if self.cutoffs:
            settings = get_settings()
            params += [settings["STALE_AFTER_SECONDS"], settings["DEFINITIVELY_DEAD_AFTER_SECONDS"]]
        # Each arm's bound, with same_topic after the topic, then the outer bound.
        arm = [bound] if self.topic is None else [self.topic, bound]
        return sql, [*params, *arm * (self.bounds - 1), bound]

    def covers(self, condition: Any) -> bool:
        """Whether ``condition``, of the query around the fragment, is one it applies."""
        if not isinstance(condition, Lookup) or isinstance(condition.rhs, models.Expression):
            return False
        field = getattr(condition.lhs, "target", None)
        if field is None:
            return False
        return (field.name, condition.lookup_name, condition.rhs) in self.covered


def bounding_fragment(query: Any) -> FilteredSeqs | None:
    """The fragment of ``query``'s one ``seq IN (FilteredSeqs)`` condition when it alone
    decides the rows: every other condition is one it applies itself (``covers``). With
    any other condition (an owner, a search), rows the fragment yields may be filtered
    out after its bound, so it must yield them all."""
    where = query.where
    if where.negated or where.connector != AND:
        return None
    pk = query.get_meta().pk
    fragments = [
        child
        for child in where.children
        if isinstance(child, In)
        and isinstance(child.rhs, FilteredSeqs)
        and getattr(child.lhs, "target", None) == pk
    ]
    if len(fragments) != 1:
        return None
    (lookup,) = fragments
    others = [child for child in where.children if child is not lookup]
    return lookup.rhs if all(lookup.rhs.covers(child) for child in others) else None


def fetch_bound(query: Any, order: FragmentOrder = NEWEST_FIRST) -> tuple[int | None, bool]:
    """How many rows a query can use, and whether they must come in ``order``: its limit
    when the fragment alone decides its rows (``bounding_fragment``) and it is ordered as
    ``order`` begins (a page) or not at all (a count, any rows will do); None (all, in
    order) otherwise."""
    if query.high_mark is None or bounding_fragment(query) is None:
        return None, True
    ordering = list(query.order_by) or list(query.get_meta().ordering)
    if not ordering:
        return int(query.high_mark), False
    if not all(isinstance(name, str) for name in ordering[: len(order.fields)]):
        return None, True
    names = tuple(re.sub(r"^(-?)pk$", r"\1seq", name) for name in ordering[: len(order.fields)])
    if query.standard_ordering and names == order.fields:
        return int(query.high_mark), True
    return None, True


def stuck_seqs(spec: WorkSpec, topic: str | None = None) -> FilteredSeqs:
    """The stuck rows of ``spec``'s table (the stuck rule), through its partial indexes;
    of ``topic`` only, when given."""
    return FilteredSeqs("stuck_seqs", spec, bounds=5, topic=topic)


def not_live_seqs(spec: WorkSpec, topic: str | None = None) -> FilteredSeqs:
    """The rows of ``spec``'s table held by an instance that is not live (of ``topic``)."""
    return FilteredSeqs("not_live_seqs", spec, bounds=2, topic=topic)


def held_seqs(spec: WorkSpec, state: str, topic: str | None = None) -> FilteredSeqs:
    """The leased or orphaned rows of ``spec``'s table, each holder's through _held (of
    ``topic`` only, when given)."""
    if state == WorkState.LEASED:
        return FilteredSeqs(
            "held_seqs",
            spec,
            2,
            cutoffs=False,
            topic=topic,
            lease="t.lease_expiry > now()",
            unheld_arm="",
        )
    return FilteredSeqs(
        "held_seqs",
        spec,
        3,
        cutoffs=False,
        topic=topic,
        lease="t.lease_expiry <= now()",
        unheld_arm=named_queries(ADMIN_QUERIES)["orphans_arm"],
    )


def pending_seqs(spec: WorkSpec, topic: str | None = None) -> FilteredSeqs:
    """The pending rows of ``spec``'s table (of ``topic`` only, when given), each arm read
    in the claim's order."""
    seqs = FilteredSeqs("pending_seqs", spec, 5, cutoffs=False, order=CLAIM_ORDER, topic=topic)
    # A pending row is unheld: the owner filter's "nobody" drops none of them.
    seqs.covered = (*seqs.covered, ("instance_id", "isnull", True))
    return seqs


def live_instance_ids() -> RawSQL:
    """The ids of live instances: workpump.live_instances with the configured cutoffs."""
    settings = get_settings()
    cutoffs = (settings["STALE_AFTER_SECONDS"], settings["DEFINITIVELY_DEAD_AFTER_SECONDS"])
    return _fragment("live_instance_ids", cutoffs)


def held_alive_lock_keys() -> RawSQL:
    """The alive-lock keys some session holds now (read from pg_locks)."""
    return _fragment("held_alive_lock_keys")


def listening_instance_ids() -> RawSQL:
    """Instances whose NOTIFY gate is connected (application_name workpump-<id>)."""
    return _fragment("listening_instance_ids")


def instance_label(instance_ref: str) -> Subquery:
    """``service@host:pid`` of the instance whose id is the outer ``instance_ref``."""
    return Subquery(
        ServiceInstance.objects.filter(pk=OuterRef(instance_ref))
        .annotate(
            label=Concat(
                "service_name",
                Value("@"),
                "host_name",
                Value(":"),
                Cast("process_id", CharField()),
                output_field=CharField(),
            )
        )
        .values("label")[:1],
        output_field=CharField(),
    )


def instance_heartbeat_age(instance_ref: str) -> Subquery:
    """Heartbeat age in seconds of the instance whose id is the outer ``instance_ref``."""
    return Subquery(
        ServiceInstance.objects.filter(pk=OuterRef(instance_ref))
        .annotate(age=seconds_since("last_heartbeat_at"))
        .values("age")[:1],
        output_field=FloatField(),
    )


def owner_holds_alive_lock(obj: Any) -> bool:
    """Whether the live owner of a row annotated with ``wp_holder`` and
    ``wp_owner_heartbeat_age`` holds its alive-lock, as far as its colour matters: a live
    instance whose heartbeat is past the stale cutoff is live only by its lock
    (workpump.live_instances); within the cutoff it is fresh either way."""
    return obj.wp_holder == HOLDER_LIVE and (
        obj.wp_owner_heartbeat_age >= get_settings()["STALE_AFTER_SECONDS"]
    )


def holder_kind(instance_ref: str) -> Case:
    """What holds a row (or stream): '', live, stale, evicted or gone (see HOLDER_*)."""
    lookup = f"{instance_ref}__in"
    return Case(
        When(**{f"{instance_ref}__isnull": True}, then=Value("")),
        When(**{lookup: live_instance_ids()}, then=Value(HOLDER_LIVE)),
        When(
            Exists(ServiceInstance.objects.filter(pk=OuterRef(instance_ref))),
            then=Value(HOLDER_STALE),
        ),
        When(
            Exists(Eviction.objects.filter(pk=OuterRef(instance_ref))), then=Value(HOLDER_EVICTED)
        ),
        default=Value(HOLDER_GONE),
        output_field=CharField(),
    )


def state_of(spec: WorkSpec) -> Func:
    """The row's state by ``workpump.state_of`` at the database clock."""
    return Func(
        F("done_at"),
        F("dead_lettered_at"),
        F("instance_id"),
        F("lease_expiry"),
        F("claimed_at"),
        F("scheduled_for"),
        F("end_state"),
        DbNow(),
        function="workpump.state_of",
        output_field=CharField(),
    )


def blocked_by_head(model: type[models.Model], spec: WorkSpec) -> Exists:
    """True for a row behind its stream's head while that head is dead or waiting to retry.

    The same rule as the status report's blocked streams: a dead head, or a head scheduled
    after an attempt; a deferred first attempt is the producer's choice, not a blockage.
    """
    same_stream = {"stream": OuterRef("stream")}
    if spec.scoped:
        same_stream["topic"] = OuterRef("topic")
    heads = model._default_manager.filter(
        **same_stream,
        stream_head=True,
        seq__lt=OuterRef("seq"),
        done_at__isnull=True,
    ).filter(Q(dead_lettered_at__isnull=False) | Q(scheduled_for__gt=DbNow(), attempts__gt=0))
    return Exists(heads)


def stuck_condition(spec: WorkSpec) -> Q:
    """The stuck rule over the annotations of ``annotate_work`` (documented in docs/admin.md).

    An undone, not dead row is stuck when it is held by an instance that is not live
    (stale, evicted or gone), or orphaned (lease expired, or its holder was evicted and it
    was not re-claimed), or has used at least half its attempts (and more than one, as
    the maintenance log counts), or waits behind a dead or retrying stream head.
    """
    undone = Q(done_at__isnull=True, dead_lettered_at__isnull=True)
    return undone & (
        Q(wp_holder__in=NOT_LIVE_HOLDERS)
        | Q(wp_state=WorkState.ORPHANED)
        | (Q(attempts__gt=1) & Q(max_attempts__lte=F("attempts") * 2))
        | Q(wp_blocked=True)
    )


def state_condition(spec: WorkSpec, state: str) -> Q:
    """Rows in ``state``: ``workpump.state_of`` spelled as column conditions.

    The same rows as ``wp_state = state`` (tests/admin/test_admin.py compares them), written so
    each arm of the condition implies the predicate of a partial index of the table
    (models.py): the planner reads the rows of a state through its indexes instead of
    evaluating ``state_of`` over every row.
    """
    live = Q(done_at__isnull=True, dead_lettered_at__isnull=True)
    unheld = live & Q(instance_id__isnull=True, claimed_at__isnull=True)
    now = DbNow()
    if state == WorkState.DONE:
        return Q(done_at__isnull=False, end_state__isnull=True)  # the _done index
    if state in (WorkState.CANCELLED, WorkState.DISCARDED):
        return ended_condition() & Q(end_state=state)  # the _ended index
    if state == WorkState.DEAD:
        return dead_condition()
    if state == WorkState.LEASED:
        return live & Q(instance_id__isnull=False, lease_expiry__gt=now)  # _held
    if state == WorkState.ORPHANED:
        expired = live & Q(instance_id__isnull=False, lease_expiry__lte=now)  # _held
        return expired | orphan_condition()
    if state == WorkState.SCHEDULED:
        return waiting_condition() & unheld & Q(scheduled_for__gt=now)
    if state == WorkState.PENDING:
        due = Q(scheduled_for__isnull=True) | Q(scheduled_for__lte=now)
        # Every live row is a stream head (the _ready and _timer indexes) or waits behind
        # one in an ordered stream (the _stream index).
        behind_head = live & Q(stream_head=False, stream__isnull=False) & due
        return unheld & (
            ready_condition()
            | (timer_condition() & Q(scheduled_for__lte=now))
            | (flow_condition() & due)  # the _flow index: flow-controlled heads
            | behind_head
        )
    raise ValueError(f"Unknown work state {state!r}; states are {', '.join(WorkState)}.")


def stuck_candidates(spec: WorkSpec) -> Q:
    """A superset of the stuck rows that the table's partial indexes serve.

    Held (_held), orphaned by an eviction (_orphan), past half their attempts (_retried),
    or behind a stream head (_stream): ``stuck_condition`` then decides among these only.
    """
    live = Q(done_at__isnull=True, dead_lettered_at__isnull=True)
    return live & (
        Q(instance_id__isnull=False)
        | orphan_condition()
        | attempts_high_condition()
        | Q(stream_head=False, stream__isnull=False)
    )


def annotate_work(queryset: models.QuerySet[Any], spec: WorkSpec) -> models.QuerySet[Any]:
    """Add state, lease, holder, heartbeat, blockage and stuck annotations (one SELECT)."""
    queryset = queryset.annotate(
        wp_state=state_of(spec),
        wp_lease_seconds_left=seconds_until("lease_expiry"),
        wp_holder=holder_kind("instance_id"),
        wp_owner_label=instance_label("instance_id"),
        wp_owner_heartbeat_age=instance_heartbeat_age("instance_id"),
        wp_blocked=blocked_by_head(queryset.model, spec),
        wp_error_short=Left(
            Func(F("last_error"), Value("\n"), Value(1), function="split_part"),
            120,
            output_field=CharField(),
        ),
    )
    return queryset.annotate(
        wp_stuck=ExpressionWrapper(stuck_condition(spec), output_field=BooleanField())
    )


def held_count(model: type[models.Model]) -> Coalesce:
    """How many rows of ``model`` the outer instance holds (a correlated count)."""
    counts = (
        model._default_manager.filter(instance_id=OuterRef("instance_id"))
        .order_by()
        .values("instance_id")
        .annotate(n=Count("*"))
        .values("n")
    )
    return Coalesce(Subquery(counts, output_field=models.IntegerField()), 0)


def undone_in_stream(model: type[models.Model], spec: WorkSpec) -> Coalesce:
    """Undone rows of the outer ActiveStream's stream (and scope) in ``model``'s table."""
    same_stream: dict[str, Any] = {"stream": OuterRef("stream")}
    if spec.scoped:
        same_stream["topic"] = OuterRef("scope")
    counts = (
        model._default_manager.filter(**same_stream, done_at__isnull=True)
        .order_by()
        .values("stream")
        .annotate(n=Count("*"))
        .values("n")
    )
    return Coalesce(Subquery(counts, output_field=models.IntegerField()), 0)
