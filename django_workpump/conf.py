"""The ``WORKPUMP`` settings dict: documented defaults, merged lazily, reset on change.

Units are part of every key name. Validation lives in ``checks.py`` so a bad value is
reported by ``manage.py check`` with an id and a hint instead of failing at import.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from django.core.signals import setting_changed
from django.dispatch import receiver

DEFAULTS: dict[str, Any] = {
    # Leases (§5).
    "LEASE_SECONDS": 300,  # a claimed row is held this long unless renewed
    "LEASE_GRACE_SECONDS": 30,  # a handler is cancelled this long before its DB lease ends
    "MAX_RENEWALS_PER_WORK": 6,  # renewals a dispatch may use; then its lease is let expire
    # Failure and retry (§6).
    "MAX_ATTEMPTS": 10,  # claims before a row is parked as dead (per-handler override)
    "RETRY_BACKOFF_BASE_SECONDS": 30,  # first retry waits this long, then doubles
    "RETRY_BACKOFF_MAX_SECONDS": 300,  # cap of the retry wait; 0 retries at once
    # Liveness (§4).
    "HEARTBEAT_INTERVAL_SECONDS": 10,  # fast cadence
    "HEARTBEAT_SLOW_INTERVAL_SECONDS": 60,  # cadence while the alive-lock proves liveness
    "STALE_AFTER_SECONDS": 30,  # a heartbeat older than this is stale (evictable)
    "DEFINITIVELY_DEAD_AFTER_SECONDS": 300,  # evicted even if its alive-lock is held
    "STALE_PEER_PROBE_INTERVAL_SECONDS": 5,  # how often to look for stale peers (a read)
    "LIVENESS_SOURCE_MODE": "advisory_lock_when_available",  # or "heartbeat_table_only"
    "HEARTBEAT_ENABLED": True,  # kill switch: False lets peers evict this instance
    # Claiming (§7).
    "CLAIM_ENABLED": True,  # kill switch
    "POLLING_INTERVAL_MS": 250,  # tight base wait between polls
    "POLLING_MAX_INTERVAL_MS": 10_000,  # backoff cap; <= base disables backoff
    "NOTIFY_HEALTHY_POLLING_INTERVAL_MS": 5_000,  # relaxed base while NOTIFY works; None = off
    "ENABLE_SAFETY_NET_POLL": True,  # False + healthy NOTIFY: poll only when woken
    "MAX_STREAMS_PER_BATCH": 1_000,  # upper bound of rows one claim may return
    "PARTITION_COUNT": 10_000,  # stream hash space shared out among live instances
    "CONCURRENCY": 4,  # dispatch threads per instance
    "CLAIM_PREFETCH": 2,  # rows claimed beyond the free dispatch slots
    # Lease renewal flusher (§5).
    "RENEWAL_MAX_BATCH": 200,
    "RENEWAL_COALESCE_WINDOW_MS": 200,
    "RENEWAL_IMMEDIATE_FLUSH_AT": 100,
    "RENEWAL_CAPACITY": 5_000,
    # Connections (§8).
    "DATABASE_ALIAS": "default",
    "LISTEN_DSN": None,  # direct DSN for LISTEN + alive-lock when DATABASE_ALIAS is pooled
    # Housekeeping and shutdown (§8).
    "RETENTION_SECONDS": 7 * 24 * 3600,  # processed rows are kept this long, then purged
    "DEAD_RETENTION_SECONDS": None,  # dead rows are purged this long after; None = kept
    "INBOX_DEDUP_RETENTION_SECONDS": 30 * 24 * 3600,  # inbox de-duplication window; None = ever
    "MAINTENANCE_INTERVAL_SECONDS": 300,
    "SHUTDOWN_TIMEOUT_SECONDS": 30,
    "MAX_ABANDONED_HANDLERS": 10,  # past this many hung handlers the instance exits
    "STATUS_INTERVAL_SECONDS": 60,
    # Producer limits.
    "MAX_PAYLOAD_BYTES": 1_048_576,  # a larger JSON payload is refused at send/receive/emit
    # Periodic work (docs/periodic.md).
    "PERIODIC_ENABLED": True,  # False: this instance fires no periodic slots
}

_cache: dict[str, Any] | None = None


def get_settings() -> Mapping[str, Any]:
    """Return ``WORKPUMP`` merged over the defaults (unknown keys are kept for the checks)."""
    global _cache
    if _cache is None:
        from django.conf import settings

        user = getattr(settings, "WORKPUMP", None) or {}
        merged = dict(DEFAULTS)
        if isinstance(user, Mapping):
            merged.update(user)
        _cache = merged
    return _cache


def setting(name: str) -> Any:
    """Return one ``WORKPUMP`` value by key."""
    return get_settings()[name]


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
