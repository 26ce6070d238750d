"""What the work pump is doing now: counts, blocked streams, dead rows, instances, and
whether VACUUM keeps up with the work tables.

Plain functions over the named queries of ``sql/status.sql``, shared by
``manage.py workpump_status`` and the admin. States come from ``workpump.state_of`` and
ages from the database clock, so every reader agrees. ``now`` is for tests only.
A full report (``collect``) runs a fixed number of queries, whatever the row count.
"""

from __future__ import annotations

import math
import unicodedata
import uuid
from dataclasses import asdict, dataclass, field
from datetime import datetime
from typing import Any

from django_workpump import db
from django_workpump.categories import NAMES as CATEGORIES
from django_workpump.conf import get_settings
from django_workpump.db.rows import FromRow
from django_workpump.payloads import StoredJSON, decode_or_stored
from django_workpump.periodic import ScheduleRegistry, schedules
from django_workpump.registry import CONTROL_CATEGORIES
from django_workpump.states import WAITING_STATES, WorkState

# Every state, in the order reports show them.
STATES = tuple(WorkState)
# Functions the report calls; without them the migrations were not applied.
REQUIRED_FUNCTIONS = ("state_of", "live_instances", "held_alive_lock_keys")

QUERIES = "status.sql"
BLOCKED_STREAMS_LIMIT = 50
DEAD_ROWS_LIMIT = 20
TOMBSTONES_LIMIT = 20
# Done rows are counted exactly up to here; past it their count is an estimate.
EXACT_COUNT_LIMIT = 10_000
# A work table with more dead row versions than live ones, and at least this many, is
# reported as one VACUUM is behind on (TableVacuum.behind).
VACUUM_BEHIND_MIN_DEAD = 10_000


@dataclass(frozen=True)
class CategoryStatus:
    """Row counts of one category by state, and the age of its oldest waiting row."""

    category: str
    counts: dict[str, int]  # every state in STATES, zeros included
    oldest_pending_age_seconds: float | None  # None: nothing pending or orphaned
    # States whose count is the planner's estimate, not a count (done, past the limit)
    estimated: tuple[WorkState, ...] = ()

    @property
    def total(self) -> int:
        return sum(self.counts.values())


@dataclass(frozen=True)
class StateCounts:
    """The per-category counts and the database time they were taken at."""

    taken_at: datetime
    categories: list[CategoryStatus]

    def by_category(self) -> dict[str, CategoryStatus]:
        return {c.category: c for c in self.categories}


@dataclass(frozen=True)
class BlockedStream:
    """An ordered stream whose head is dead or waiting for a retry."""

    category: str
    scope: str  # perspective or receptor name; '' for outbox and inbox
    stream: str
    head_id: uuid.UUID
    head_state: WorkState  # dead | scheduled
    attempts: int
    max_attempts: int
    retry_at: datetime | None
    dead_lettered_at: datetime | None
    failure_reason: str | None
    last_error: str | None  # first line
    waiting: int  # undone rows behind the head


@dataclass(frozen=True)
class BlockedStreams:
    streams: list[BlockedStream]
    total: int  # all blocked streams, also those past the limit


@dataclass(frozen=True)
class DeadRow:
    """A row parked after its last attempt (or by an operator)."""

    category: str
    work_id: uuid.UUID
    topic: str
    stream: str | None
    attempts: int
    max_attempts: int
    failure_reason: str | None
    dead_lettered_at: datetime
    last_error: str | None  # first line


@dataclass(frozen=True)
class InstanceStatus:
    """One registered ``runworkpump`` process as the database sees it."""

    instance_id: uuid.UUID
    service_name: str
    host_name: str
    process_id: int
    started_at: datetime
    last_heartbeat_at: datetime
    heartbeat_age_seconds: float
    alive_lock_held: bool
    live: bool  # by the liveness rule with the configured cutoffs
    listening: bool  # a session named workpump-<instance id> is connected
    # flusher name -> {failures, failing_seconds, pending, last_error}, as of its last beat
    stalled_flushers: dict[str, Any]
    # seconds its NOTIFY listener had been down at its last beat; None while it is up
    listener_down_seconds: float | None
    rows_held: dict[str, int]  # per category; EXACT_COUNT_LIMIT + 1: at least that many
    rows_held_estimated: tuple[str, ...] = ()  # categories counted no further than the limit

    @property
    def total_held(self) -> int:
        return sum(self.rows_held.values())


@dataclass(frozen=True)
class UnhandledTopic:
    """Rows of a topic that no live instance runs: they wait, spending no attempt."""

    category: str
    topic: str
    rows: int  # past EXACT_COUNT_LIMIT waiting rows of a category: of the rows read
    oldest_age_seconds: float
    estimated: bool = False  # rows (and the age) are of the first rows read, not all


@dataclass(frozen=True)
class Tombstone:
    """An evicted instance: its heartbeats are refused from then on."""

    instance_id: uuid.UUID
    evicted_at: datetime
    reason: str
    age_seconds: float


@dataclass(frozen=True)
class PeriodicStatus:
    """A periodic schedule: its rule, when it fires next, and the slot it handled last."""

    name: str
    schedule: str  # "cron 30 2 * * * (Europe/Berlin)" or "every 60s"
    catch_up: str
    paused: bool
    registered: bool  # defined by the code this process runs; False: a leftover row
    next_fire_at: datetime | None
    last_slot: datetime | None
    last_fired_at: datetime | None
    last_message_id: uuid.UUID | None
    registered_at: datetime


@dataclass(frozen=True)
class TableVacuum(FromRow):
    """A work table's row versions as the statistics system last counted them, and
    VACUUM's last pass over it (``pg_stat_user_tables``).

    Every claim and every outcome updates a row, and a row done is deleted at the end of
    its retention: each leaves a dead version behind, and its index entries, until VACUUM
    removes them. A claim steps over the entries of done rows, so with VACUUM stopped
    (autovacuum off, or an old snapshot holding it back) each claim costs more than the
    one before it.
    """

    category: str
    table_name: str
    live_versions: int
    dead_versions: int
    vacuum_age_seconds: float | None  # since VACUUM last finished on it (None: never)
    autovacuum: bool  # whether autovacuum may run on it (server setting and the table's)

    @property
    def behind(self) -> bool:
        """More dead versions than live ones, and at least VACUUM_BEHIND_MIN_DEAD."""
        return (
            self.dead_versions >= VACUUM_BEHIND_MIN_DEAD and self.dead_versions > self.live_versions
        )


@dataclass(frozen=True)
class OldestSnapshot(FromRow):
    """The session of the database that holds the oldest snapshot or transaction id:
    VACUUM keeps every row version it may still see, in every table. A session of
    another role is seen only by a role that may read its activity (pg_read_all_stats)."""

    pid: int
    role_name: str | None
    application_name: str | None
    state: str | None
    open_seconds: float | None  # since its transaction began


@dataclass(frozen=True)
class VacuumHealth:
    tables: list[TableVacuum] = field(default_factory=list)
    oldest_snapshot: OldestSnapshot | None = None


@dataclass(frozen=True)
class StatusReport:
    """Everything ``workpump_status`` shows."""

    taken_at: datetime
    stale_after_seconds: int
    definitively_dead_after_seconds: int
    categories: list[CategoryStatus]
    blocked_streams: list[BlockedStream]
    blocked_streams_total: int
    dead_rows: list[DeadRow]
    instances: list[InstanceStatus]
    tombstones: list[Tombstone]
    unhandled: list[UnhandledTopic] = field(default_factory=list)  # no live handler
    periodic: list[PeriodicStatus] = field(default_factory=list)
    # flow rules (docs/flow-control.md): limits, rows held, tokens left, rows waiting
    flow_rules: list[db.FlowRuleStatus] = field(default_factory=list)
    vacuum: VacuumHealth = field(default_factory=VacuumHealth)
    dead_counts: dict[str, int] = field(init=False)

    def __post_init__(self) -> None:
        dead = {c.category: c.counts[WorkState.DEAD] for c in self.categories}
        object.__setattr__(self, "dead_counts", dead)


def schema_ready(*, using: str | None = None) -> bool:
    """Whether the workpump migrations (the SQL functions) are applied."""
    return db.schema_functions_present(REQUIRED_FUNCTIONS, using=using)


def state_counts(*, now: datetime | None = None, using: str | None = None) -> StateCounts:
    """Count rows per category x state (one query) with each category's oldest waiting age.

    Each state is counted exactly up to ``EXACT_COUNT_LIMIT`` rows (per partial index it
    is read through); past it, its count is the planner's estimate (one EXPLAIN more) or,
    for done rows, the _done index's ``reltuples``, listed in ``CategoryStatus.estimated``:
    the report never reads every row of a table.
    """
    params = {
        "now": now,
        "categories": list(CATEGORIES),
        "states": list(STATES),
        "exact_limit": EXACT_COUNT_LIMIT,
    }
    rows = db.fetch_named(QUERIES, "state_counts", params, using=using)
    if any(row["estimated"] and row["state"] != WorkState.DONE for row in rows):
        rows = _with_estimates(rows, now=now, using=using)
    categories = []
    for category in CATEGORIES:
        mine = [row for row in rows if row["category"] == category]
        ages = [
            row["oldest_age_seconds"]
            for row in mine
            if row["state"] in WAITING_STATES and row["oldest_age_seconds"] is not None
        ]
        categories.append(
            CategoryStatus(
                category=category,
                counts={WorkState(row["state"]): int(row["count"]) for row in mine},
                oldest_pending_age_seconds=max(ages) if ages else None,
                estimated=tuple(WorkState(row["state"]) for row in mine if row["estimated"]),
            )
        )
    return StateCounts(taken_at=rows[0]["now"], categories=categories)


# The arms of the state_estimates query, in its order.
ESTIMATED_STATES = (
    WorkState.PENDING,
    WorkState.SCHEDULED,
    WorkState.LEASED,
    WorkState.ORPHANED,
    WorkState.DEAD,
)


def _with_estimates(
    rows: list[dict[str, Any]], *, now: datetime | None, using: str | None
) -> list[dict[str, Any]]:
    """``rows`` with each undone count found past the limit raised to the planner's
    estimate of its state (one EXPLAIN, not run, of every category x undone state)."""
    arms = db.explain_arms(QUERIES, "state_estimates", {"now": now}, using=using)
    keys = [(category, state) for category in CATEGORIES for state in ESTIMATED_STATES]
    # No estimate (a plan of another shape): the rows counted, still marked estimated.
    estimates = dict(zip(keys, arms, strict=True)) if len(arms) == len(keys) else {}
    result = []
    for row in rows:
        key = (row["category"], row["state"])
        if row["estimated"] and key in estimates:
            row = {**row, "count": max(int(row["count"]), estimates[key])}
        result.append(row)
    return result


def blocked_streams(
    *, now: datetime | None = None, limit: int = BLOCKED_STREAMS_LIMIT, using: str | None = None
) -> BlockedStreams:
    """Return the streams held back by a dead head or a head waiting for its retry."""
    rows = db.fetch_named(QUERIES, "blocked_streams", {"now": now, "limit": limit}, using=using)
    total = int(rows[0]["total"]) if rows else 0
    return BlockedStreams(
        streams=[
            BlockedStream(
                **{k: v for k, v in row.items() if k not in ("total", "head_state")},
                head_state=WorkState(row["head_state"]),
            )
            for row in rows
        ],
        total=total,
    )


def dead_rows(*, limit: int = DEAD_ROWS_LIMIT, using: str | None = None) -> list[DeadRow]:
    """Return the most recently dead-lettered rows of all categories, newest first."""
    rows = db.fetch_named(QUERIES, "dead_rows", {"limit": limit}, using=using)
    return [DeadRow(**row) for row in rows]


def instances(*, now: datetime | None = None, using: str | None = None) -> list[InstanceStatus]:
    """Return every registered instance with heartbeat age, alive-lock, liveness, rows held."""
    settings = get_settings()
    params = {
        "now": now,
        "stale_after_seconds": settings["STALE_AFTER_SECONDS"],
        "definitively_dead_after_seconds": settings["DEFINITIVELY_DEAD_AFTER_SECONDS"],
        "exact_limit": EXACT_COUNT_LIMIT,
    }
    result = []
    for row in db.fetch_named(QUERIES, "instances", params, using=using):
        held = {category: int(row.pop(f"held_{category}")) for category in CATEGORIES}
        capped = tuple(c for c, n in held.items() if n > EXACT_COUNT_LIMIT)
        stalled = _stalled(row.pop("stalled_flushers"))
        result.append(
            InstanceStatus(
                **row,
                stalled_flushers=stalled or {},
                rows_held=held,
                rows_held_estimated=capped,
            )
        )
    return result


def _stalled(value: Any) -> dict[str, Any]:
    """An instance's stalled flushers from its metadata (jsonb, which Django's psycopg
    setup leaves as text); metadata that cannot be read (written through SQL) counts as
    one stalled flusher named ``unreadable``, so the report shows it and goes on."""
    if isinstance(value, str):
        value = decode_or_stored(value)
    if isinstance(value, StoredJSON) or not isinstance(value, dict):
        error = value.error if isinstance(value, StoredJSON) else "not a JSON object"
        return {"unreadable": {"last_error": f"its stalled_flushers cannot be read: {error}"}}
    return value


def unhandled_topics(
    *,
    now: datetime | None = None,
    stale_after_seconds: int | None = None,
    definitively_dead_after_seconds: int | None = None,
    using: str | None = None,
) -> list[UnhandledTopic]:
    """Return the topics with waiting rows that no live instance advertises it runs.

    The liveness cutoffs default to the settings'.
    """
    # Without JIT: the planner costs the per-index limits past jit_above_cost, and
    # compiling took about 2 s where running takes milliseconds, on every maintenance pass.
    with db.without_jit(using=using):
        return _unhandled_topics(
            now=now,
            stale_after_seconds=stale_after_seconds,
            definitively_dead_after_seconds=definitively_dead_after_seconds,
            using=using,
        )


def _unhandled_topics(
    *,
    now: datetime | None,
    stale_after_seconds: int | None = None,
    definitively_dead_after_seconds: int | None = None,
    using: str | None,
) -> list[UnhandledTopic]:
    settings = get_settings()
    params = {
        "now": now,
        "stale_after_seconds": settings["STALE_AFTER_SECONDS"]
        if stale_after_seconds is None
        else stale_after_seconds,
        "definitively_dead_after_seconds": settings["DEFINITIVELY_DEAD_AFTER_SECONDS"]
        if definitively_dead_after_seconds is None
        else definitively_dead_after_seconds,
        "exact_limit": EXACT_COUNT_LIMIT,
    }
    rows = db.fetch_named(QUERIES, "unhandled_topics", params, using=using)
    return [UnhandledTopic(**{**row, "rows": int(row["rows"])}) for row in rows]


def tombstones(
    *, now: datetime | None = None, limit: int = TOMBSTONES_LIMIT, using: str | None = None
) -> list[Tombstone]:
    """Return the newest tombstones of evicted instances."""
    rows = db.fetch_named(QUERIES, "tombstones", {"now": now, "limit": limit}, using=using)
    return [Tombstone(**row) for row in rows]


def periodic_schedules(
    *, using: str | None = None, registry: ScheduleRegistry = schedules
) -> list[PeriodicStatus]:
    """Return every periodic schedule row, marking those the code no longer defines."""
    result = []
    for row in db.fetch_named(QUERIES, "periodic_schedules", using=using):
        cron, every = row.pop("cron"), row.pop("every_seconds")
        timezone = row.pop("timezone")
        rule = f"cron {cron} ({timezone})" if cron is not None else f"every {every}s"
        registered = registry.get(row["name"]) is not None
        result.append(PeriodicStatus(**row, schedule=rule, registered=registered))
    return result


def flow_rules(*, now: datetime | None = None, using: str | None = None) -> list[db.FlowRuleStatus]:
    """Every flow rule as it stands: its limits, rows held now, whole tokens left, and its
    heads waiting (counted up to ``EXACT_COUNT_LIMIT`` + 1)."""
    return db.flow_rule_status(waiting_cap=EXACT_COUNT_LIMIT, now=now, using=using)


def vacuum_health(*, now: datetime | None = None, using: str | None = None) -> VacuumHealth:
    """Each work table's live and dead row versions and VACUUM's last pass over it, and
    the session that holds the oldest snapshot (TableVacuum, OldestSnapshot)."""
    rows = db.fetch_named(
        QUERIES, "vacuum_health", {"now": now, "categories": list(CATEGORIES)}, using=using
    )
    held = rows and rows[0]["pid"] is not None  # every row carries the same session
    return VacuumHealth(
        tables=[TableVacuum.from_row(row) for row in rows],
        oldest_snapshot=OldestSnapshot.from_row(rows[0]) if held else None,
    )


def collect(*, now: datetime | None = None, using: str | None = None) -> StatusReport:
    """Gather the whole status report: nine queries in one transaction, without JIT."""
    settings = get_settings()
    using = using or settings["DATABASE_ALIAS"]
    with db.without_jit(using=using):
        return _collect(now=now, using=using)


def _collect(*, now: datetime | None, using: str) -> StatusReport:
    settings = get_settings()
    counts = state_counts(now=now, using=using)
    blocked = blocked_streams(now=now, using=using)
    return StatusReport(
        taken_at=counts.taken_at,
        stale_after_seconds=settings["STALE_AFTER_SECONDS"],
        definitively_dead_after_seconds=settings["DEFINITIVELY_DEAD_AFTER_SECONDS"],
        categories=counts.categories,
        blocked_streams=blocked.streams,
        blocked_streams_total=blocked.total,
        dead_rows=dead_rows(using=using),
        instances=instances(now=now, using=using),
        tombstones=tombstones(now=now, using=using),
        unhandled=_unhandled_topics(now=now, using=using),  # collect is without JIT
        periodic=periodic_schedules(using=using),
        flow_rules=flow_rules(now=now, using=using),
        vacuum=vacuum_health(now=now, using=using),
    )


def as_json(report: StatusReport) -> dict[str, Any]:
    """Return the report as JSON-ready data: stable keys, ISO timestamps, numbers as numbers."""
    return {
        "taken_at": _iso(report.taken_at),
        "settings": {
            "stale_after_seconds": report.stale_after_seconds,
            "definitively_dead_after_seconds": report.definitively_dead_after_seconds,
        },
        "categories": {
            c.category: {
                "counts": dict(c.counts),
                "total": c.total,
                "oldest_pending_age_seconds": _finite(c.oldest_pending_age_seconds),
                "estimated": list(c.estimated),
            }
            for c in report.categories
        },
        "dead_counts": dict(report.dead_counts),
        "blocked_streams": {
            "total": report.blocked_streams_total,
            "streams": [_plain(asdict(s)) for s in report.blocked_streams],
        },
        "dead_rows": [_plain(asdict(r)) for r in report.dead_rows],
        "instances": [
            _plain(asdict(i))
            | {"total_held": i.total_held, "rows_held_estimated": list(i.rows_held_estimated)}
            for i in report.instances
        ],
        "tombstones": [_plain(asdict(t)) for t in report.tombstones],
        "no_live_handler": [_plain(asdict(u)) for u in report.unhandled],
        "periodic": [_plain(asdict(p)) for p in report.periodic],
        "flow_rules": [_plain(asdict(r)) for r in report.flow_rules],
        "vacuum": {
            "tables": [_plain(asdict(t)) | {"behind": t.behind} for t in report.vacuum.tables],
            "oldest_snapshot": (
                None
                if report.vacuum.oldest_snapshot is None
                else _plain(asdict(report.vacuum.oldest_snapshot))
            ),
        },
    }


def _iso(value: datetime | None) -> str | None:
    return value.isoformat() if value is not None else None


def _plain(values: dict[str, Any]) -> dict[str, Any]:
    """Datetimes as ISO strings and uuids as text; everything else is JSON already, but an
    infinite age (of a time written through SQL as 'infinity'), which JSON has no number
    for: null."""
    out: dict[str, Any] = {}
    for key, value in values.items():
        if isinstance(value, datetime):
            out[key] = value.isoformat()
        elif isinstance(value, uuid.UUID):
            out[key] = str(value)
        else:
            out[key] = _finite(value)
    return out


def _finite(value: Any) -> Any:
    """``value``, but None for an infinite or NaN float (strict JSON has neither)."""
    return None if isinstance(value, float) and not math.isfinite(value) else value


def printable(text: str) -> str:
    """``text`` with each control or format character escaped as in a Python literal
    (``\\x1b``, ``\\n``, ``\\u202e``): topics, streams, host names and errors come from
    rows anyone with table access can write, and must not move a terminal's cursor,
    colour its text or forge a line of the report."""
    if all(unicodedata.category(char) not in CONTROL_CATEGORIES for char in text):
        return text
    return "".join(
        char.encode("unicode_escape").decode("ascii")
        if unicodedata.category(char) in CONTROL_CATEGORIES
        else char
        for char in text
    )


def health_problems(
    report: StatusReport,
    *,
    host_name: str | None = None,
    max_pending_age_seconds: float | None = None,
    max_listener_down_seconds: float = 60,
) -> list[str]:
    """What makes the pump unhealthy, one sentence each; empty when healthy.

    ``host_name``: judge that host's instances (its instance missing or stale is a
    problem); None: the whole fleet (no live instance at all is a problem).
    ``max_pending_age_seconds``: a pending row older than this is a problem (None: not
    checked). A NOTIFY listener down for longer than ``max_listener_down_seconds`` (as of
    the instance's last beat, plus the beat's age) is a problem.
    """
    problems = []
    if host_name is not None:
        mine = [i for i in report.instances if i.host_name == host_name]
        live = [i for i in mine if i.live]
        if not mine:
            problems.append(f"No workpump instance of host {host_name} is registered.")
        elif not live:
            freshest = min(mine, key=lambda i: i.heartbeat_age_seconds)
            problems.append(
                f"The workpump instance {freshest.instance_id} of host {host_name} is stale: "
                f"its last heartbeat is {freshest.heartbeat_age_seconds:.0f} s old "
                f"(stale after {report.stale_after_seconds} s)."
            )
    else:
        live = [i for i in report.instances if i.live]
        if not live:
            problems.append("No live workpump instance is registered.")
    for instance in live:
        if instance.listener_down_seconds is None:
            continue
        down = instance.listener_down_seconds + instance.heartbeat_age_seconds
        if down > max_listener_down_seconds:
            problems.append(
                f"The NOTIFY listener of instance {instance.instance_id} "
                f"({instance.host_name}) has been down for {down:.0f} s "
                f"(bound {max_listener_down_seconds:.0f} s)."
            )
    if max_pending_age_seconds is not None:
        for category in report.categories:
            age = category.oldest_pending_age_seconds
            if age is not None and age > max_pending_age_seconds:
                problems.append(
                    f"The oldest pending {category.category} row is {age:.0f} s old "
                    f"(bound {max_pending_age_seconds:.0f} s)."
                )
    return problems
