"""The work tables (docs/architecture.md, Tables and states).

Rows are written by the SQL functions in ``sql/`` (producers, claim, renew, complete,
fail), never by forms; these models exist for migrations, the admin and factories.

Every work row carries the same lease columns (``WorkRow``). A row's state is derived
from them (``pending``, ``scheduled``, ``leased``, ``orphaned``, ``done``, ``dead``,
``cancelled``, ``discarded``):
see ``states.py``.

``stream_head`` is maintained by triggers and ``complete_work``: it is true for the
earliest undone row of each ordered stream, and only heads are claimable, which makes
per-stream FIFO a property of the index the claim scans instead of a per-row check.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from django.db import models
from django.db.models import F, Q
from django.db.models.functions import Coalesce, Now

from django_workpump.console_models import (  # noqa: F401 (the app's models)
    ConsoleBacklog,
    ConsoleCount,
    ConsoleInstance,
    ConsoleRollup,
    ConsoleSample,
    ConsoleTotal,
)
from django_workpump.payloads import decode_or_stored

if TYPE_CHECKING:
    from django_stubs_ext import StrPromise


class StoredJSONField(models.JSONField):
    """A JSONField whose stored text, when Python cannot decode it (nested too deep for
    the recursion limit, an integer past the digit limit), loads as a ``StoredJSON`` of
    that text: a hostile value written through SQL affects its own row, not every query
    that reads it. Migrations see a plain JSONField: the column is the same."""

    def from_db_value(self, value: Any, expression: Any, connection: Any) -> Any:
        if not isinstance(value, str) or self.decoder is not None:
            return super().from_db_value(value, expression, connection)
        return decode_or_stored(value)

    def deconstruct(self) -> Any:
        name, _path, args, kwargs = super().deconstruct()
        return name, "django.db.models.JSONField", args, kwargs


class WorkRow(models.Model):
    """Columns shared by the four work tables."""

    seq = models.BigAutoField(primary_key=True)  # monotonic order key
    work_id = models.UUIDField(unique=True)  # the work's id (Work.id), stable across attempts
    topic = models.TextField()  # what the handler is registered under
    stream = models.TextField(null=True, blank=True)  # NULL: a stream of its own
    partition_number = models.IntegerField()
    priority = models.SmallIntegerField(db_default=0)  # higher runs first
    stream_head = models.BooleanField(db_default=True, editable=False)
    scheduled_for = models.DateTimeField(null=True, blank=True)  # not claimable before
    created_at = models.DateTimeField(db_default=Now())
    attempts = models.IntegerField(db_default=0)
    max_attempts = models.IntegerField(db_default=10)
    instance_id = models.UUIDField(null=True, blank=True, editable=False)
    lease_expiry = models.DateTimeField(null=True, blank=True, editable=False)
    lease_renewals = models.IntegerField(db_default=0, editable=False)
    claimed_at = models.DateTimeField(null=True, blank=True, editable=False)
    # When the row became claimable for the claim that holds it (or last held it): the
    # pickup latency of that attempt, counted by the console when the attempt ends.
    claim_due_at = models.DateTimeField(null=True, blank=True, editable=False)
    # Issued afresh by every claim; every later write about the row must name it, so an
    # older attempt's outcome cannot land on a newer attempt of the same instance.
    lease_token = models.UUIDField(null=True, blank=True, editable=False)
    last_error = models.TextField(null=True, blank=True)
    failure_reason = models.CharField(max_length=40, null=True, blank=True)
    dead_lettered_at = models.DateTimeField(null=True, blank=True)
    result = StoredJSONField(null=True, blank=True)
    # What the producer sent along, a JSON object of strings: e.g. the W3C trace context
    # ("traceparent", "tracestate") that links a handler's span to its producer's.
    headers = StoredJSONField(null=True, blank=True, editable=False)
    # How a done row ended when not by completing: "cancelled" (workpump.cancel) or
    # "discarded" (the handler raised workpump.Discard). NULL for a completed row.
    end_state = models.CharField(max_length=20, null=True, blank=True, editable=False)
    # Times the handler raised workpump.Snooze; capped by MAX_SNOOZES.
    snoozes = models.IntegerField(db_default=0, editable=False)
    # The last checkpoint of a handler (work.checkpoint): the next attempt starts from it.
    checkpoint = StoredJSONField(null=True, blank=True, editable=False)
    done_at = models.DateTimeField(null=True, blank=True)  # set when the work is done
    # The batch this row is a member of (workpump.batch): its ending is counted there.
    batch_id = models.UUIDField(null=True, blank=True, editable=False)
    # Rows sent with after=[this row] wait on it (workpump_dependency).
    has_dependents = models.BooleanField(db_default=False, editable=False)
    # Flow control (docs/flow-control.md); '' is none, so index row comparisons see no
    # NULLs. A concurrency key is capped across topics and categories (a partner); a
    # fairness key is what the claim round-robins over within a topic (a tenant).
    concurrency_key = models.TextField(db_default="", blank=True, editable=False)
    fairness_key = models.TextField(db_default="", blank=True, editable=False)
    # Set at insert when the row has a key or its topic a flow rule: such rows are
    # claimed by the flow pass only, and never sit in the fast indexes.
    flow_controlled = models.BooleanField(db_default=False, editable=False)

    class Meta:
        abstract = True


class MessageRow(WorkRow):
    """Columns shared by outbox and inbox rows, which carry their payload themselves."""

    payload = StoredJSONField()
    # send/receive(unique_key=...), unique tasks: at most one undone row per (topic, key).
    unique_key = models.TextField(null=True, blank=True)

    class Meta:
        abstract = True


# Operator actions of the admin, each gated by its own permission (not just "change").
WORK_PERMISSIONS: list[tuple[str, str | StrPromise]] = [
    ("retry_work", "Can retry scheduled work now"),
    ("release_work_lease", "Can release work leases"),
    ("force_release_work_lease", "Can force-release work leases held by live instances"),
    ("dead_letter_work", "Can dead-letter work"),
    ("requeue_work", "Can re-queue dead work"),
    ("cancel_work", "Can cancel work"),
]


def _lease_pair_check(table: str) -> models.CheckConstraint:
    both_null = Q(instance_id__isnull=True, lease_expiry__isnull=True)
    both_set = Q(instance_id__isnull=False, lease_expiry__isnull=False)
    return models.CheckConstraint(condition=both_null | both_set, name=f"{table}_lease_pair")


def ready_condition() -> Q:
    """Rows the fast passes claim right now: undone, live stream heads, unleased and
    unscheduled, not flow-controlled."""
    return _live_head() & Q(
        instance_id__isnull=True, scheduled_for__isnull=True, flow_controlled=False
    )


def timer_condition() -> Q:
    """Live stream heads waiting for a time (a lease to expire or a retry/deferral), not
    flow-controlled."""
    return (
        _live_head()
        & (Q(instance_id__isnull=False) | Q(scheduled_for__isnull=False))
        & Q(flow_controlled=False)
    )


def flow_condition() -> Q:
    """Live stream heads under flow control that no lease holds (the flow pass's index)."""
    return _live_head() & Q(flow_controlled=True, instance_id__isnull=True)


def flow_timer_condition() -> Q:
    """Live stream heads under flow control that a lease holds (expired or not)."""
    return _live_head() & Q(flow_controlled=True, instance_id__isnull=False)


def dead_condition() -> Q:
    """Undone rows parked as dead."""
    return Q(done_at__isnull=True) & Q(dead_lettered_at__isnull=False)


def _live_head() -> Q:
    return Q(done_at__isnull=True) & Q(dead_lettered_at__isnull=True, stream_head=True)


def _live() -> Q:
    return Q(done_at__isnull=True, dead_lettered_at__isnull=True)


def orphan_condition() -> Q:
    """Rows whose holder was evicted mid-attempt and that no one has re-claimed yet."""
    return _live() & Q(instance_id__isnull=True, claimed_at__isnull=False)


def waiting_condition() -> Q:
    """Unleased live rows with a time set: a retry wait or a deferral (due or not)."""
    return _live() & Q(instance_id__isnull=True, scheduled_for__isnull=False)


def ended_condition() -> Q:
    """Rows that ended cancelled or discarded rather than completed."""
    return Q(done_at__isnull=False) & Q(end_state__isnull=False)


def attempts_high_condition() -> Q:
    """Live rows that used half their attempts, and more than one (the stuck rule)."""
    return _live() & Q(attempts__gt=1, max_attempts__lte=F("attempts") * 2)


def _work_indexes(prefix: str, scope: tuple[str, ...] = ()) -> list[models.Index]:
    """The partial indexes every work table needs; ``claim.sql`` repeats their predicates.

    Names are ``<prefix>_ready`` etc. (Django caps index names at 30 characters).
    """
    return [
        # Rows claimable right now: a scan of this index is the claim (priority, then FIFO).
        models.Index(
            fields=["-priority", "seq"], name=f"{prefix}_ready", condition=ready_condition()
        ),
        # Rows waiting for a time: a lease to expire or a retry/deferral to fall due.
        models.Index(
            Coalesce("lease_expiry", "scheduled_for"),
            name=f"{prefix}_timer",
            condition=timer_condition(),
        ),
        # Flow-controlled heads by group (topic, concurrency key, fairness key), each in
        # claim order: the flow pass's loose index scan and its per-group picks.
        models.Index(
            fields=["topic", "concurrency_key", "fairness_key", "-priority", "seq"],
            name=f"{prefix}_flow",
            condition=flow_condition(),
        ),
        # Leased flow-controlled heads by lease expiry: the flow pass takes over those
        # whose lease expired. Kept out of _flow: a lease would add an entry to that wide
        # index, which every claim of a flow-controlled row paid for.
        models.Index(
            fields=["lease_expiry"],
            name=f"{prefix}_flowtimer",
            condition=flow_timer_condition(),
        ),
        # Flow-controlled rows held now: the in-flight counts of topic and key caps.
        models.Index(
            fields=["concurrency_key", "topic"],
            name=f"{prefix}_flowheld",
            condition=Q(done_at__isnull=True, instance_id__isnull=False, flow_controlled=True),
        ),
        # Rows held by an instance (eviction, deregistration, admin), newest first per
        # holder: the admin's stuck and owner = not-live pages read a page of each.
        models.Index(
            fields=["instance_id", "seq"],
            name=f"{prefix}_held",
            condition=Q(instance_id__isnull=False),
        ),
        # Undone rows of each ordered stream, in order (head promotion, blocked streams).
        models.Index(
            fields=[*scope, "stream", "seq"],
            name=f"{prefix}_stream",
            condition=Q(done_at__isnull=True, stream__isnull=False),
        ),
        # Processed rows by age (retention purge).
        models.Index(fields=["done_at"], name=f"{prefix}_done", condition=Q(done_at__isnull=False)),
        # Dead rows (admin, status), in the order the admin's dead page shows them.
        models.Index(
            fields=["dead_lettered_at", "seq"],
            name=f"{prefix}_dead",
            condition=dead_condition(),
        ),
        # The admin's state and stuck filters and the status counts (docs/admin.md). Each
        # holds rows in a rare state only, which a claim or renewal never writes, so the
        # hot path does not maintain them: orphaned by an eviction, waiting unleased for
        # a retry or deferral, and past half their attempts.
        models.Index(fields=["seq"], name=f"{prefix}_orphan", condition=orphan_condition()),
        # Keyed by time, then seq: the admin's scheduled page reads a page in this order.
        models.Index(
            fields=["scheduled_for", "seq"],
            name=f"{prefix}_waiting",
            condition=waiting_condition(),
        ),
        models.Index(fields=["seq"], name=f"{prefix}_retried", condition=attempts_high_condition()),
        # Rows that ended cancelled or discarded (admin state filter, status counts).
        models.Index(fields=["done_at"], name=f"{prefix}_ended", condition=ended_condition()),
        # Undone rows with an error, per topic (the console's failure reasons): a row
        # enters it when an attempt fails, never on a claim or a first-time success.
        models.Index(
            fields=["topic", "seq"],
            name=f"{prefix}_failing",
            condition=Q(done_at__isnull=True, last_error__isnull=False),
        ),
    ]


def _message_meta(table: str, prefix: str) -> tuple[list[Any], list[models.Index]]:
    """Constraints and indexes of the outbox or inbox table."""
    constraints = [
        _lease_pair_check(table),
        # Dead rows are not done: they hold their key (a requeue never conflicts).
        models.UniqueConstraint(
            fields=["topic", "unique_key"],
            name=f"{table}_unique_key",
            condition=Q(done_at__isnull=True, unique_key__isnull=False),
        ),
    ]
    indexes = [
        *_work_indexes(prefix),
        # the producer's holder lookup, done rows included (the unique_for window)
        models.Index(
            fields=["topic", "unique_key", "created_at"],
            name=f"{prefix}_unique_key",
            condition=Q(unique_key__isnull=False),
        ),
    ]
    return constraints, indexes


class Outbox(MessageRow):
    """A message sent to an outbox destination (the topic)."""

    class Meta:
        db_table = "workpump_outbox"
        permissions = WORK_PERMISSIONS
        verbose_name = "outbox message"
        constraints, indexes = _message_meta("workpump_outbox", "wp_outbox")

    def __str__(self) -> str:
        return f"outbox {self.topic} {self.work_id}"


class Inbox(MessageRow):
    """A message received for an inbox handler (the topic)."""

    class Meta:
        db_table = "workpump_inbox"
        permissions = WORK_PERMISSIONS
        verbose_name = "inbox message"
        constraints, indexes = _message_meta("workpump_inbox", "wp_inbox")

    def __str__(self) -> str:
        return f"inbox {self.topic} {self.work_id}"


class InboxDedup(models.Model):
    """Every inbox message id received within INBOX_DEDUP_RETENTION_SECONDS; outlives the
    purge of processed rows."""

    message_id = models.UUIDField(primary_key=True)
    first_seen_at = models.DateTimeField(db_default=Now())

    class Meta:
        db_table = "workpump_inbox_dedup"
        verbose_name = "received message id"
        # the retention purge takes the oldest first
        indexes = [models.Index(fields=["first_seen_at"], name="wp_inbox_dedup_seen")]

    def __str__(self) -> str:
        return str(self.message_id)


class Event(models.Model):
    """An emitted event; perspective and receptor rows point at it."""

    seq = models.BigAutoField(primary_key=True)
    event_id = models.UUIDField(unique=True)
    event_type = models.TextField()
    payload = StoredJSONField()
    stream = models.TextField(null=True, blank=True)
    created_at = models.DateTimeField(db_default=Now())
    # emit(unique_key=...): held while the event's work is not all done.
    unique_key = models.TextField(null=True, blank=True)

    class Meta:
        db_table = "workpump_event"
        indexes = [
            models.Index(fields=["created_at"], name="wp_event_created"),
            # emit's holder lookup
            models.Index(
                fields=["event_type", "unique_key", "created_at"],
                name="wp_event_unique_key",
                condition=Q(unique_key__isnull=False),
            ),
        ]

    def __str__(self) -> str:
        return f"event {self.event_type} {self.event_id}"


class PerspectiveEvent(WorkRow):
    """An event's work for one perspective (the topic), ordered per (topic, stream)."""

    event = models.ForeignKey(
        Event, to_field="event_id", db_column="event_id", on_delete=models.PROTECT
    )

    class Meta:
        db_table = "workpump_perspective_event"
        verbose_name = "perspective event"
        permissions = WORK_PERMISSIONS
        constraints = [
            _lease_pair_check("workpump_perspective_event"),
            models.UniqueConstraint(
                fields=["stream", "topic", "event"],
                name="workpump_perspective_event_unique",
                nulls_distinct=False,
            ),
        ]
        indexes = _work_indexes("wp_persp", ("topic",))

    def __str__(self) -> str:
        return f"perspective {self.topic} {self.work_id}"


class ReceptorProcessing(WorkRow):
    """An event's work for one receptor (the topic), ordered per (topic, stream)."""

    event = models.ForeignKey(
        Event, to_field="event_id", db_column="event_id", on_delete=models.PROTECT
    )

    class Meta:
        db_table = "workpump_receptor_processing"
        verbose_name = "receptor processing"
        permissions = WORK_PERMISSIONS
        verbose_name_plural = "receptor processing"
        constraints = [
            _lease_pair_check("workpump_receptor_processing"),
            models.UniqueConstraint(
                fields=["event", "topic"], name="workpump_receptor_processing_unique"
            ),
        ]
        indexes = _work_indexes("wp_receptor", ("topic",))

    def __str__(self) -> str:
        return f"receptor {self.topic} {self.work_id}"


class ServiceInstance(models.Model):
    """One running ``runworkpump`` process, proving it is alive with a heartbeat."""

    instance_id = models.UUIDField(primary_key=True)
    service_name = models.TextField()
    host_name = models.TextField()
    process_id = models.IntegerField()
    started_at = models.DateTimeField(db_default=Now())
    last_heartbeat_at = models.DateTimeField(db_default=Now())
    metadata = StoredJSONField(db_default={})
    # Second half of the alive-lock's two-int advisory key; unique among live rows.
    alive_lock_key = models.IntegerField(unique=True, editable=False)
    # When a peer first saw the alive-lock missing; eviction for a missing lock waits a
    # grace period from here, so a listener blip is not mistaken for a death.
    alive_lock_lost_at = models.DateTimeField(null=True, blank=True, editable=False)
    # The backend pid of the session that took the alive-lock: a lock on the key held by
    # any other session (any role may take advisory locks) proves nothing.
    alive_lock_pid = models.IntegerField(null=True, blank=True, editable=False)

    class Meta:
        db_table = "workpump_service_instance"
        permissions = [("evict_instance", "Can evict a service instance")]
        indexes = [models.Index(fields=["last_heartbeat_at"], name="wp_instance_heartbeat")]

    def __str__(self) -> str:
        return f"{self.service_name}@{self.host_name}:{self.process_id}"


class ActiveStream(models.Model):
    """Who is working on an ordered stream now (set by claims, cleared on release)."""

    category = models.CharField(max_length=20)
    scope = models.TextField(blank=True, db_default="")  # perspective or receptor name
    stream = models.TextField()
    partition_number = models.IntegerField()
    owner_instance_id = models.UUIDField(null=True, blank=True)
    lease_expiry = models.DateTimeField(null=True, blank=True)
    created_at = models.DateTimeField(db_default=Now())
    last_activity_at = models.DateTimeField(db_default=Now())

    class Meta:
        db_table = "workpump_active_stream"
        constraints = [
            models.UniqueConstraint(
                fields=["category", "scope", "stream"], name="workpump_active_stream_unique"
            )
        ]
        indexes = [
            models.Index(
                fields=["owner_instance_id"],
                name="wp_active_stream_owner",
                condition=Q(owner_instance_id__isnull=False),
            )
        ]

    def __str__(self) -> str:
        return f"{self.category}:{self.scope}:{self.stream}"


class Eviction(models.Model):
    """Tombstone of an evicted instance: its heartbeats are refused from then on."""

    instance_id = models.UUIDField(primary_key=True)
    evicted_at = models.DateTimeField(db_default=Now())
    reason = models.TextField()

    class Meta:
        db_table = "workpump_eviction"
        indexes = [models.Index(fields=["evicted_at"], name="wp_eviction_at")]

    def __str__(self) -> str:
        return f"evicted {self.instance_id}"


class TaskAttempt(models.Model):
    """One run of a ``django.tasks`` task (an inbox row): who ran it, when, how it ended.

    The task runner (``tasks/runner.py``) writes it at the start and the end of each
    attempt, in autocommit and apart from the row's completion, so an attempt whose
    worker died stays visible as started and never finished.
    """

    work_id = models.UUIDField()  # the inbox row's work_id, which is TaskResult.id
    attempt = models.IntegerField()  # the row's claim count when this run started
    instance_id = models.UUIDField()  # the runworkpump instance that ran it
    lease_token = models.UUIDField(null=True, blank=True)  # the claim this run belongs to
    started_at = models.DateTimeField(db_default=Now())
    finished_at = models.DateTimeField(null=True, blank=True)
    error_class = models.TextField(null=True, blank=True)  # exception class path; NULL: success
    traceback = models.TextField(null=True, blank=True)

    class Meta:
        db_table = "workpump_task_attempt"
        constraints = [
            models.UniqueConstraint(
                fields=["work_id", "attempt"], name="workpump_task_attempt_unique"
            )
        ]
        # Purge of attempts whose task row is gone (retention), oldest first.
        indexes = [models.Index(fields=["started_at"], name="wp_task_attempt_started")]

    def __str__(self) -> str:
        return f"task {self.work_id} attempt {self.attempt}"


class AttemptLog(models.Model):
    """A log record a handler emitted while one attempt of a work row ran (WARNING and
    above unless ``ATTEMPT_LOG_LEVEL`` lowers it), stored with that attempt's outcome.

    Written only by ``complete_work``, ``fail_work`` and ``discard_work``, in the same
    statement as the outcome and under its lease fence; deleted with its work row (the
    work tables' delete triggers), so retention purges them together.
    """

    id = models.BigAutoField(primary_key=True)
    category = models.TextField()  # outbox, inbox, perspective_event or receptor
    work_id = models.UUIDField()  # the work row's work_id (the Work.id its handler saw)
    attempt = models.IntegerField()  # the row's attempt count when the outcome was written
    lease_token = models.UUIDField()  # the claim of that attempt
    logged_at = models.DateTimeField()
    level = models.IntegerField()  # logging's number: 30 WARNING, 40 ERROR; 0: a note
    logger = models.TextField()
    message = models.TextField()

    class Meta:
        db_table = "workpump_attempt_log"
        # A row's records, by attempt, in the order they were logged; and the delete of a
        # purged row's records.
        indexes = [
            models.Index(fields=["work_id", "category", "attempt", "id"], name="wp_attempt_log_row")
        ]

    def __str__(self) -> str:
        return f"{self.category} {self.work_id} attempt {self.attempt}: {self.message[:60]}"


class Batch(models.Model):
    """A group of work rows whose last ending produces one callback row (workpump.batch).

    The counts are kept by the ending transactions themselves (a row trigger on the work
    tables), under this row's lock, so the callback is produced exactly once.
    """

    id = models.UUIDField(primary_key=True)
    parent_batch_id = models.UUIDField(null=True, blank=True)  # counted as a member there
    on_complete = StoredJSONField(null=True, blank=True)  # {"topic", "payload", options}
    on_failure = StoredJSONField(null=True, blank=True)  # used when a member did not end done
    sealed = models.BooleanField(db_default=False)  # no callback before the producer is done
    total = models.IntegerField(db_default=0)
    pending = models.IntegerField(db_default=0)
    done = models.IntegerField(db_default=0)
    dead = models.IntegerField(db_default=0)
    discarded = models.IntegerField(db_default=0)
    cancelled = models.IntegerField(db_default=0)
    callback_id = models.UUIDField(null=True, blank=True)  # the outbox row produced
    callback_error = models.TextField(null=True, blank=True)  # why none could be produced
    created_at = models.DateTimeField(db_default=Now())
    finished_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        db_table = "workpump_batch"
        verbose_name_plural = "batches"
        indexes = [
            models.Index(fields=["-created_at"], name="wp_batch_created"),
            # open batches only: what counting a statement's member endings probes
            models.Index(
                fields=["id"], name="wp_batch_open", condition=Q(finished_at__isnull=True)
            ),
            models.Index(
                fields=["parent_batch_id"],
                name="wp_batch_parent",
                condition=Q(parent_batch_id__isnull=False),
            ),
            # finished batches, oldest first: what the retention purge takes
            models.Index(
                fields=["finished_at"],
                name="wp_batch_finished",
                condition=Q(finished_at__isnull=False),
            ),
        ]

    def __str__(self) -> str:
        return f"batch {self.id}"


AFTER_POLICIES = [("cancel", "cancel"), ("run", "run")]


class Dependency(models.Model):
    """An outbox row (dependent) waiting for another (dependency) to end: send(after=...).

    The edge is deleted when the dependency ends; the dependent becomes claimable when
    its last edge goes (or is cancelled, per policy, when a dependency fails).
    """

    category = models.TextField(db_default="outbox")
    dependent_id = models.UUIDField()
    dependency_id = models.UUIDField()
    policy = models.CharField(max_length=10, choices=AFTER_POLICIES, db_default="cancel")

    class Meta:
        db_table = "workpump_dependency"
        constraints = [
            models.UniqueConstraint(
                fields=["category", "dependency_id", "dependent_id"],
                name="workpump_dependency_unique",
            )
        ]
        indexes = [
            models.Index(fields=["category", "dependent_id"], name="wp_dependency_dependent")
        ]

    def __str__(self) -> str:
        return f"{self.dependent_id} after {self.dependency_id}"


CATCH_UP_CHOICES = [
    ("latest", "latest: fire the most recent missed slot once"),
    ("none", "none: skip missed slots"),
    ("all", "all: fire every missed slot"),
]


class PeriodicSchedule(models.Model):
    """A periodic schedule as last registered by a pump, and the slot it fired last.

    Rows are written by the periodic SQL functions of ``sql/schema.sql`` (registered at pump
    start, advanced by ``fire_periodic``); a schedule removed from the code keeps its row.
    """

    name = models.TextField(primary_key=True)  # the outbox destination of its rows
    cron = models.TextField(null=True, blank=True)  # 5-field expression, or NULL
    every_seconds = models.IntegerField(null=True, blank=True)  # interval, or NULL
    timezone = models.TextField(db_default="UTC")  # the zone cron is evaluated in
    catch_up = models.TextField(choices=CATCH_UP_CHOICES, db_default="latest")
    payload = StoredJSONField(db_default={})
    priority = models.SmallIntegerField(db_default=0)
    max_attempts = models.IntegerField(db_default=10)
    paused = models.BooleanField(db_default=False)  # a paused schedule fires nothing
    last_slot = models.DateTimeField(null=True, blank=True)  # fired or skipped last
    next_fire_at = models.DateTimeField(null=True, blank=True)  # for display
    last_fired_at = models.DateTimeField(null=True, blank=True)  # when a row was last made
    last_message_id = models.UUIDField(null=True, blank=True)  # the outbox row it made
    created_at = models.DateTimeField(db_default=Now())  # slots count from here
    registered_at = models.DateTimeField(db_default=Now())  # last registered by a pump
    updated_at = models.DateTimeField(db_default=Now())

    class Meta:
        db_table = "workpump_periodic_schedule"
        verbose_name = "periodic schedule"
        ordering = ["name"]
        constraints = [
            models.CheckConstraint(
                condition=Q(cron__isnull=False, every_seconds__isnull=True)
                | Q(cron__isnull=True, every_seconds__gte=1),
                name="workpump_periodic_one_rule",
            ),
            models.CheckConstraint(
                condition=Q(catch_up__in=["latest", "none", "all"]),
                name="workpump_periodic_catch_up",
            ),
        ]

    def __str__(self) -> str:
        return self.name


SUBSCRIPTION_CATEGORIES = [
    ("perspective_event", "perspective"),
    ("receptor", "receptor"),
]


class Subscription(models.Model):
    """A perspective or receptor subscribed to an event type, as the registry says.

    Synced from the Python registry (``subscriptions.py``): replaced on ``migrate``,
    upserted at ``runworkpump`` start. SQL ``workpump.emit`` fans out from these rows
    when its caller passes no subscriber list.
    """

    pk = models.CompositePrimaryKey("event_type", "category", "name")
    event_type = models.TextField()
    category = models.TextField(choices=SUBSCRIPTION_CATEGORIES)
    name = models.TextField()  # the perspective or receptor name
    max_attempts = models.IntegerField()
    updated_at = models.DateTimeField(db_default=Now())

    class Meta:
        db_table = "workpump_subscription"
        ordering = ["event_type", "category", "name"]
        constraints = [
            models.CheckConstraint(
                condition=Q(category__in=["perspective_event", "receptor"]),
                name="workpump_subscription_category",
            ),
        ]

    def __str__(self) -> str:
        return f"{self.event_type} -> {self.category} {self.name}"


FLOW_RULE_KINDS = [
    ("topic", "topic: a topic of one category"),
    ("key", "key: a concurrency or fairness key, in every topic and category"),
    ("category", "category: every topic of one category (pause only)"),
]


class FlowRule(models.Model):
    """A flow-control rule (docs/flow-control.md): a cap, a rate, a weight or a pause of a
    topic, a key or a category, enforced by the claim on every instance.

    ``declared_*`` come from the code (handler declarations, upserted at ``runworkpump``
    start); ``override_*`` from an operator (``workpump.set_limit``, the admin), and win.
    The token bucket (``tokens`` at ``tokens_at``) is the claim's own state.
    """

    kind = models.CharField(max_length=10, choices=FLOW_RULE_KINDS)
    category = models.TextField(blank=True, db_default="")  # '' for a key rule
    name = models.TextField(blank=True, db_default="")  # the topic or key; '' for a category
    declared_concurrency = models.IntegerField(null=True, blank=True)
    declared_rate = models.FloatField(null=True, blank=True)  # starts per second
    declared_burst = models.IntegerField(null=True, blank=True)
    declared_key_concurrency = models.IntegerField(null=True, blank=True)
    override_concurrency = models.IntegerField(null=True, blank=True)
    override_rate = models.FloatField(null=True, blank=True)
    override_burst = models.IntegerField(null=True, blank=True)
    override_key_concurrency = models.IntegerField(null=True, blank=True)
    weight = models.IntegerField(db_default=1)  # a fairness key's share per round
    paused = models.BooleanField(db_default=False)
    tokens = models.FloatField(null=True, blank=True, editable=False)
    tokens_at = models.DateTimeField(null=True, blank=True, editable=False)
    updated_at = models.DateTimeField(db_default=Now())

    class Meta:
        db_table = "workpump_flow_rule"
        verbose_name = "flow rule"
        ordering = ["kind", "category", "name"]
        permissions = [("pause_flow", "Can pause and resume work")]
        constraints = [
            models.UniqueConstraint(
                fields=["kind", "category", "name"], name="workpump_flow_rule_subject"
            ),
            models.CheckConstraint(
                condition=Q(kind__in=["topic", "key", "category"]),
                name="workpump_flow_rule_kind",
            ),
        ]
        # every claim reads the paused categories and topics
        indexes = [
            models.Index(fields=["kind"], name="wp_flow_rule_paused", condition=Q(paused=True))
        ]

    def __str__(self) -> str:
        if self.kind == "key":
            return f"key {self.name}"
        if self.kind == "category":
            return f"category {self.category}"
        return f"{self.category} topic {self.name}"
