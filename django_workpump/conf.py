"""The ``WORKPUMP`` settings dict: every key declared once, merged lazily, reset on change.

``SETTINGS`` is the one table of keys: each one's default, how ``manage.py check``
validates it (``checks.py``) and what it means (the table of docs/settings.md, rendered by
``docs/settings_table.py``). Units are part of every key name. Validation lives in
``checks.py`` so a bad value is reported with an id and a hint instead of failing at import.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import KW_ONLY, dataclass
from typing import Any, Literal

from django.core.signals import setting_changed
from django.dispatch import receiver

# How a key is checked: "int" (at least ``minimum``; None too when ``optional``), "bool",
# or a check of its own for the keys with one value set ("liveness_mode",
# "handler_connections") or a connection to name ("database_alias", "dsn").
Kind = Literal[
    "int",
    "bool",
    "liveness_mode",
    "handler_connections",
    "database_alias",
    "dsn",
    "dotted_paths",
    "log_level",
]


@dataclass(frozen=True, slots=True)
class Setting:
    """One ``WORKPUMP`` key: its default, how it is checked and what it means."""

    name: str
    default: Any
    kind: Kind
    _: KW_ONLY
    meaning: str  # one line of Markdown: the table of docs/settings.md shows it
    minimum: int | None = None  # "int": the smallest value allowed
    optional: bool = False  # "int": None is allowed too

    def __post_init__(self) -> None:
        if (self.kind == "int") != (self.minimum is not None):
            raise ValueError(f"{self.name}: a minimum is given for integer settings only.")
        if self.optional and self.kind != "int":
            raise ValueError(f"{self.name}: only integer settings are optional.")


SETTINGS: tuple[Setting, ...] = (
    # Leases.
    Setting(
        "LEASE_SECONDS",
        300,
        "int",
        minimum=1,
        meaning="a claimed row is held this long unless renewed",
    ),
    Setting(
        "LEASE_GRACE_SECONDS",
        30,
        "int",
        minimum=0,
        meaning="a handler is cancelled this long before its DB lease ends",
    ),
    Setting(
        "MAX_RENEWALS_PER_WORK",
        6,
        "int",
        minimum=0,
        meaning=(
            "renewals one dispatch may use (≈ 30 min at 300 s); then the lease expires and "
            "the row is re-claimed"
        ),
    ),
    # Failure and retry.
    Setting(
        "MAX_ATTEMPTS",
        10,
        "int",
        minimum=1,
        meaning="claims before a row is parked as dead (per-handler `max_attempts=`)",
    ),
    Setting(
        "RETRY_BACKOFF_BASE_SECONDS",
        30,
        "int",
        minimum=0,
        meaning="first retry delay, doubling per attempt (+ up to 10 % jitter)",
    ),
    Setting(
        "RETRY_BACKOFF_MAX_SECONDS",
        300,
        "int",
        minimum=0,
        meaning="retry delay cap; 0 retries at once",
    ),
    Setting(
        "MAX_SNOOZES",
        25,
        "int",
        minimum=0,
        meaning=(
            "times a row may raise `workpump.Snooze`; the next snooze counts as a failed "
            "attempt (reason `max_snoozes`)"
        ),
    ),
    # Liveness.
    Setting(
        "HEARTBEAT_INTERVAL_SECONDS",
        10,
        "int",
        minimum=1,
        meaning="fast heartbeat cadence",
    ),
    Setting(
        "HEARTBEAT_SLOW_INTERVAL_SECONDS",
        60,
        "int",
        minimum=1,
        meaning="cadence while the alive-lock proves liveness",
    ),
    Setting(
        "STALE_AFTER_SECONDS",
        30,
        "int",
        minimum=1,
        meaning="a heartbeat older than this is stale; must be ≥ 2 × the fast cadence",  # noqa: RUF001
    ),
    Setting(
        "DEFINITIVELY_DEAD_AFTER_SECONDS",
        300,
        "int",
        minimum=1,
        meaning="evicted even if its alive-lock is still held",
    ),
    Setting(
        "STALE_PEER_PROBE_INTERVAL_SECONDS",
        4,
        "int",
        minimum=1,
        meaning="how often each instance looks for stale peers (a read)",
    ),
    Setting(
        "LIVENESS_SOURCE_MODE",
        "advisory_lock_when_available",
        "liveness_mode",
        meaning='or `"heartbeat_table_only"` (behind a transaction pooler)',
    ),
    Setting(
        "HEARTBEAT_ENABLED",
        True,
        "bool",
        meaning=(
            "kill switch: False lets peers evict this instance (drain); an instance that "
            "never registered is refused its claims"
        ),
    ),
    # Claiming.
    Setting("CLAIM_ENABLED", True, "bool", meaning="kill switch for claiming"),
    Setting("POLLING_INTERVAL_MS", 250, "int", minimum=1, meaning="tight poll base"),
    Setting(
        "POLLING_MAX_INTERVAL_MS",
        10_000,
        "int",
        minimum=1,
        meaning="backoff cap; ≤ base disables backoff",
    ),
    Setting(
        "NOTIFY_HEALTHY_POLLING_INTERVAL_MS",
        5_000,
        "int",
        minimum=1,
        optional=True,
        meaning="relaxed base while NOTIFY works; None disables",
    ),
    Setting(
        "ENABLE_SAFETY_NET_POLL",
        True,
        "bool",
        meaning="False + healthy NOTIFY: poll only when woken",
    ),
    Setting(
        "CLAIM_SYNCHRONOUS_COMMIT",
        False,
        "bool",
        meaning="True: a claim's commit waits for its WAL flush; False saves that wait on"
        " every claim, and a claim lost in a server crash is claimed again"
        " (docs/architecture.md, step 6)",
    ),
    Setting(
        "PREPARED_STATEMENTS",
        True,
        "bool",
        meaning="claims run a statement prepared once per session (under a name unique to"
        " the process; a pooler that loses it turns this off with a warning); False:"
        " parsed and planned on every call",
    ),
    Setting(
        "MAX_STREAMS_PER_BATCH",
        1_000,
        "int",
        minimum=1,
        meaning="most rows one claim returns",
    ),
    Setting(
        "PARTITION_COUNT",
        10_000,
        "int",
        minimum=1,
        meaning="stream hash space shared among live instances",
    ),
    Setting(
        "STREAM_RUN_MAX",
        100,
        "int",
        minimum=1,
        meaning=(
            "most rows of one ordered stream a claim leases together (its head and the rows "
            "after it), or of one chain of rows sent with after=, run in order in one "
            "dispatch slot; 1: one row per claim"
        ),
    ),
    Setting("CONCURRENCY", 4, "int", minimum=1, meaning="dispatch threads"),
    Setting(
        "CLAIM_PREFETCH",
        2,
        "int",
        minimum=0,
        meaning="rows claimed beyond the free slots",
    ),
    Setting(
        "CLAIM_FAIR_PREFETCH",
        8,
        "int",
        minimum=0,
        meaning=(
            "rows claimed beyond the free slots (CLAIM_PREFETCH when larger) after a claim "
            "that reached rows of fairness keys; fewer: a quiet tenant's new row waits for a "
            "shorter claim, and a flood of fast rows drains slower (flow-control.md)"
        ),
    ),
    # The lease renewal batcher.
    Setting(
        "RENEWAL_MAX_BATCH",
        5_000,
        "int",
        minimum=1,
        meaning="the renewal batcher: most renewals one write sends",
    ),
    Setting(
        "RENEWAL_COALESCE_WINDOW_MS",
        200,
        "int",
        minimum=1,
        meaning="the renewal batcher: how long the first waiting renewal waits for others",
    ),
    Setting(
        "RENEWAL_IMMEDIATE_FLUSH_AT",
        100,
        "int",
        minimum=1,
        meaning="the renewal batcher: once this many renewals wait, they are written at once",
    ),
    Setting(
        "RENEWAL_CAPACITY",
        20_000,
        "int",
        minimum=1,
        meaning="the renewal batcher: most renewals waiting; more are refused",
    ),
    # Connections.
    Setting(
        "DATABASE_ALIAS",
        "default",
        "database_alias",
        meaning="the Django database holding the tables",
    ),
    Setting(
        "LISTEN_DSN",
        None,
        "dsn",
        meaning="direct DSN for LISTEN + alive-lock when the alias goes through a pooler",
    ),
    Setting(
        "HANDLER_CONNECTIONS",
        "persistent",
        "handler_connections",
        meaning=(
            "handler threads keep their connections across jobs (health-checked, replaced "
            'after an error, a positive `CONN_MAX_AGE` bounds their age); `"per_job"`: '
            "Django's per-request rules"
        ),
    ),
    # Housekeeping and shutdown.
    Setting(
        "RETENTION_SECONDS",
        7 * 24 * 3600,
        "int",
        minimum=0,
        meaning=(
            "processed rows, finished batches and the attempts of purged tasks are kept "
            "this long (admin history, results), then purged"
        ),
    ),
    Setting(
        "DEAD_RETENTION_SECONDS",
        None,
        "int",
        minimum=1,
        optional=True,
        meaning=(
            "dead rows are purged this long after dead-lettering (a purged dead stream head "
            "unblocks its stream); None keeps them for an operator"
        ),
    ),
    Setting(
        "INBOX_DEDUP_RETENTION_SECONDS",
        30 * 24 * 3600,
        "int",
        minimum=1,
        optional=True,
        meaning=(
            "inbox message ids are remembered this long (and while their row is stored): the "
            "de-duplication window; None remembers forever. Task enqueues write none"
        ),
    ),
    Setting(
        "CONSOLE_RETENTION_SECONDS",
        7 * 24 * 3600,
        "int",
        minimum=3600,
        meaning=(
            "the admin console's per-minute series (counters, backlog, instances) are kept "
            "this long, then purged by the maintenance pass (docs/console.md)"
        ),
    ),
    Setting(
        "MAINTENANCE_INTERVAL_SECONDS",
        300,
        "int",
        minimum=1,
        meaning="maintenance cadence (one instance at a time)",
    ),
    Setting(
        "SHUTDOWN_TIMEOUT_SECONDS",
        30,
        "int",
        minimum=0,
        meaning="how long a graceful stop waits for running handlers",
    ),
    Setting(
        "MAX_ABANDONED_HANDLERS",
        10,
        "int",
        minimum=0,
        meaning="past this many hung handlers the instance exits for a clean restart",
    ),
    Setting(
        "STATUS_INTERVAL_SECONDS",
        60,
        "int",
        minimum=1,
        meaning="`runworkpump` status line cadence",
    ),
    # Producer limits.
    Setting(
        "MAX_PAYLOAD_BYTES",
        1_048_576,
        "int",
        minimum=1,
        meaning=(
            "larger payloads (JSON text, UTF-8) are refused at produce time; passed to the "
            "SQL producers as `p_max_payload_bytes`"
        ),
    ),
    Setting(
        "MAX_CHECKPOINT_BYTES",
        65_536,
        "int",
        minimum=1,
        meaning=(
            "larger `work.checkpoint(state)` states (JSON text, UTF-8) are refused with "
            "`CheckpointTooLarge` ([docs/workflows.md](docs/workflows.md))"
        ),
    ),
    # Handlers (docs/middleware.md).
    Setting(
        "MIDDLEWARE",
        (),
        "dotted_paths",
        meaning=(
            "dotted paths of callables `middleware(work, call_next)` wrapping every handler "
            "call, the first outermost ([docs/middleware.md](docs/middleware.md))"
        ),
    ),
    Setting(
        "ATTEMPT_LOG_LEVEL",
        "WARNING",
        "log_level",
        meaning=(
            "log records a handler emits at this level and above are stored with its "
            'attempt and shown in the admin (a level name such as `"INFO"`, or a number); '
            "None stores none ([docs/admin.md](docs/admin.md#attempt-logs))"
        ),
    ),
    # Metrics (docs/metrics.md).
    Setting(
        "METRICS_PORT",
        None,
        "int",
        minimum=0,
        optional=True,
        meaning=(
            "`runworkpump` serves Prometheus metrics at `/metrics` on this port (the "
            "`prometheus` extra; `--metrics-port` overrides); None: not served"
        ),
    ),
    Setting(
        "METRICS_CACHE_SECONDS",
        5,
        "int",
        minimum=0,
        meaning=(
            "the database-wide gauges (rows per state, oldest waiting row, instances) are "
            "read at most this often, however often Prometheus scrapes"
        ),
    ),
    Setting(
        "METRICS_MAX_TOPICS",
        100,
        "int",
        minimum=0,
        meaning=(
            "distinct `topic` label values a process exports; rows of later topics are counted "
            'under `topic="other"` (one warning when the cap is first hit), so the series '
            "stay bounded"
        ),
    ),
    # Tracing (docs/tracing.md).
    Setting(
        "TRACING",
        True,
        "bool",
        meaning=(
            "OpenTelemetry producer and consumer spans, trace context in each row's headers; "
            "takes effect only when `opentelemetry-api` is installed (extra `otel`) "
            "([docs/tracing.md](docs/tracing.md))"
        ),
    ),
    # Periodic work (docs/periodic.md).
    Setting(
        "PERIODIC_ENABLED",
        True,
        "bool",
        meaning="False: this instance fires no periodic slots (others still do)",
    ),
)

# Each key by name, in the table's order.
SETTINGS_BY_NAME: dict[str, Setting] = {s.name: s for s in SETTINGS}
# The defaults ``WORKPUMP`` is merged over.
DEFAULTS: dict[str, Any] = {s.name: s.default for s in SETTINGS}

_cache: dict[str, Any] | None = None
# Keys this process overrides while a block of ``overridden`` runs (runworkpump --database).
_overrides: dict[str, Any] = {}


def get_settings() -> Mapping[str, Any]:
    """Return ``WORKPUMP`` merged over the defaults (unknown keys are kept for the checks)."""
    global _cache
    if _cache is None:
        from django.conf import settings

        user = getattr(settings, "WORKPUMP", None) or {}
        merged = dict(DEFAULTS)
        if isinstance(user, Mapping):
            merged.update(user)
        merged.update(_overrides)
        _cache = merged
    return _cache


@contextmanager
def overridden(**values: Any) -> Iterator[None]:
    """Override ``WORKPUMP`` keys for this whole process while the block runs.

    ``runworkpump --database ALIAS`` runs under ``DATABASE_ALIAS=ALIAS``, so the pump and
    the producers its handlers call write to that database.
    """
    global _cache
    unknown = sorted(set(values) - set(DEFAULTS))
    if unknown:
        raise KeyError(f"Unknown WORKPUMP keys {', '.join(unknown)}.")
    previous = dict(_overrides)
    _overrides.update(values)
    _cache = None
    try:
        yield
    finally:
        _overrides.clear()
        _overrides.update(previous)
        _cache = None


def setting(name: str) -> Any:
    """Return one ``WORKPUMP`` value by key."""
    return get_settings()[name]


# The level names ATTEMPT_LOG_LEVEL takes, as the logging module numbers them.
LOG_LEVELS = {"DEBUG": 10, "INFO": 20, "WARNING": 30, "ERROR": 40, "CRITICAL": 50}


def log_level(value: Any) -> int | None:
    """``ATTEMPT_LOG_LEVEL`` as logging's number (None: nothing is captured).

    Raises ValueError naming the accepted values for anything else.
    """
    if value is None:
        return None
    if isinstance(value, str) and value.upper() in LOG_LEVELS:
        return LOG_LEVELS[value.upper()]
    if isinstance(value, int) and not isinstance(value, bool) and 1 <= value <= 100:
        return value
    raise ValueError(
        f"WORKPUMP['ATTEMPT_LOG_LEVEL'] ({value!r}) must be a level name "
        f"({', '.join(LOG_LEVELS)}), a number from 1 to 100, or None."
    )


def lock_loss_grace_seconds(settings: Mapping[str, Any]) -> float:
    """Seconds a stale instance whose alive-lock went missing is given before eviction.

    A live instance that loses its LISTEN connection (and the lock with it) beats at once
    and then on the fast cadence, so one fast interval is enough for it to prove itself.
    In heartbeat-table-only mode no lock protects anyone, so there is nothing to wait for.
    """
    if settings["LIVENESS_SOURCE_MODE"] == "heartbeat_table_only":
        return 0.0
    return float(settings["HEARTBEAT_INTERVAL_SECONDS"])


# Tombstones are kept at least a day, whatever the lease settings.
MIN_TOMBSTONE_RETENTION_SECONDS = 24 * 3600


def tombstone_retention_seconds(settings: Mapping[str, Any]) -> int:
    """Seconds a tombstone of an evicted instance is kept before maintenance purges it.

    While it exists the instance's heartbeats, claims and renewals are refused; once it
    is gone a zombie that wakes up would register again. So it must outlive the longest
    lease the instance could still believe it holds (the lease and every renewal) plus
    the definitive-dead cutoff, the latest its peers can have evicted it.
    """
    longest_lease = int(settings["LEASE_SECONDS"]) * (int(settings["MAX_RENEWALS_PER_WORK"]) + 1)
    cutoff = max(
        int(settings["STALE_AFTER_SECONDS"]), int(settings["DEFINITIVELY_DEAD_AFTER_SECONDS"])
    )
    return max(MIN_TOMBSTONE_RETENTION_SECONDS, longest_lease + cutoff)


@receiver(setting_changed)
def _reset_cache(*, setting: str, **kwargs: Any) -> None:
    global _cache
    if setting == "WORKPUMP":
        _cache = None
