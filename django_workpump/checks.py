"""System checks for the ``WORKPUMP`` settings dict (DESIGN §9).

Ids are stable; tests pin them and the exact message text.

Errors
    E001 ``WORKPUMP`` is not a dict.
    E002 unknown key.
    E003 wrong type.
    E004 value below its minimum.
    E005 ``LIVENESS_SOURCE_MODE`` is not a known mode.
    E006 renewal flusher sizes out of order (immediate flush <= max batch <= capacity).
    E007 ``LEASE_GRACE_SECONDS`` not below ``LEASE_SECONDS``.
    E008 ``STALE_AFTER_SECONDS`` below twice ``HEARTBEAT_INTERVAL_SECONDS``.
    E009 ``DEFINITIVELY_DEAD_AFTER_SECONDS`` below ``STALE_AFTER_SECONDS``.
    E010 slow heartbeat not below the definitively-dead cutoff (alive-lock mode).
    E011 ``DATABASE_ALIAS`` not in ``settings.DATABASES``.
    E012 ``DATABASE_ALIAS`` is not a PostgreSQL database.
    E013 ``LISTEN_DSN`` unusable.
Warnings
    W001 slow heartbeat faster than the fast one.
    W002 ``LEASE_SECONDS`` at most twice ``LEASE_GRACE_SECONDS``.
    W003 ``HEARTBEAT_ENABLED`` is False.
Info
    I001 polling backoff disabled.
    I002 ``CLAIM_ENABLED`` is False.
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from importlib import import_module
from typing import Any

import psycopg
from django.conf import settings
from django.core.checks import CheckMessage, Error, Info, Warning, register
from psycopg.conninfo import conninfo_to_dict

from django_workpump.conf import DEFAULTS

LIVENESS_MODES = ("advisory_lock_when_available", "heartbeat_table_only")
POSTGRES_ENGINES = ("django.db.backends.postgresql", "django.contrib.gis.db.backends.postgis")

# Integer keys and their minimum (0 where "none" or "at once" is meaningful).
_INT_MINIMUMS: dict[str, int] = {
    "LEASE_SECONDS": 1,
    "LEASE_GRACE_SECONDS": 0,
    "MAX_RENEWALS_PER_WORK": 0,
    "MAX_ATTEMPTS": 1,
    "RETRY_BACKOFF_BASE_SECONDS": 0,
    "RETRY_BACKOFF_MAX_SECONDS": 0,
    "HEARTBEAT_INTERVAL_SECONDS": 1,
    "HEARTBEAT_SLOW_INTERVAL_SECONDS": 1,
    "STALE_AFTER_SECONDS": 1,
    "DEFINITIVELY_DEAD_AFTER_SECONDS": 1,
    "STALE_PEER_PROBE_INTERVAL_SECONDS": 1,
    "POLLING_INTERVAL_MS": 1,
    "POLLING_MAX_INTERVAL_MS": 1,
    "MAX_STREAMS_PER_BATCH": 1,
    "PARTITION_COUNT": 1,
    "CONCURRENCY": 1,
    "CLAIM_PREFETCH": 0,
    "RENEWAL_MAX_BATCH": 1,
    "RENEWAL_COALESCE_WINDOW_MS": 1,
    "RENEWAL_IMMEDIATE_FLUSH_AT": 1,
    "RENEWAL_CAPACITY": 1,
    "RETENTION_SECONDS": 0,
    "MAINTENANCE_INTERVAL_SECONDS": 1,
    "SHUTDOWN_TIMEOUT_SECONDS": 0,
    "MAX_ABANDONED_HANDLERS": 0,
    "STATUS_INTERVAL_SECONDS": 1,
    "MAX_PAYLOAD_BYTES": 1,
}
_OPTIONAL_INT_MINIMUMS: dict[str, int] = {
    "NOTIFY_HEALTHY_POLLING_INTERVAL_MS": 1,
    "DEAD_RETENTION_SECONDS": 1,
    "INBOX_DEDUP_RETENTION_SECONDS": 1,
}
_BOOL_KEYS = ("HEARTBEAT_ENABLED", "CLAIM_ENABLED", "ENABLE_SAFETY_NET_POLL", "PERIODIC_ENABLED")


def _name(key: str) -> str:
    return f"WORKPUMP[{key!r}]"


def _is_int(value: Any) -> bool:
    # bool is an int subclass; True as a lease length is a typo, not a choice.
    return isinstance(value, int) and not isinstance(value, bool)


def _check_key(key: str, value: Any) -> list[CheckMessage]:
    """Check one key on its own: type first, then range; at most one message."""
    name = _name(key)
    default = DEFAULTS[key]
    if key in _INT_MINIMUMS or key in _OPTIONAL_INT_MINIMUMS:
        optional = key in _OPTIONAL_INT_MINIMUMS
        minimum = _OPTIONAL_INT_MINIMUMS[key] if optional else _INT_MINIMUMS[key]
        if optional and value is None:
            return []
        if not _is_int(value):
            expected = "an integer or None" if optional else "an integer"
            if isinstance(value, bool):
                expected += ", not a boolean"
            return [
                Error(
                    f"{name} ({value!r}) must be {expected}.",
                    hint=f"Set it to a whole number such as {default!r} (the default).",
                    id="workpump.E003",
                )
            ]
        if value < minimum:
            return [
                Error(
                    f"{name} ({value!r}) must be at least {minimum}.",
                    hint=f"Set it to {minimum} or more; the default is {default!r}.",
                    id="workpump.E004",
                )
            ]
        return []
    if key in _BOOL_KEYS:
        if not isinstance(value, bool):
            return [
                Error(
                    f"{name} ({value!r}) must be True or False.",
                    hint=f"Set it to a boolean; the default is {default!r}.",
                    id="workpump.E003",
                )
            ]
        return []
    if key == "LIVENESS_SOURCE_MODE":
        if value not in LIVENESS_MODES:
            return [
                Error(
                    f"{name} ({value!r}) must be {LIVENESS_MODES[0]!r} or {LIVENESS_MODES[1]!r}.",
                    hint=(
                        "Use 'heartbeat_table_only' behind a transaction pooler, "
                        "else 'advisory_lock_when_available'."
                    ),
                    id="workpump.E005",
                )
            ]
        return []
    if key == "DATABASE_ALIAS":
        return _check_database_alias(value)
    if key == "LISTEN_DSN":
        return _check_listen_dsn(value)
    raise AssertionError(f"no check for {key}")  # a key added to DEFAULTS needs a rule here


def _check_database_alias(value: Any) -> list[CheckMessage]:
    name = _name("DATABASE_ALIAS")
    if not isinstance(value, str):
        return [
            Error(
                f"{name} ({value!r}) must be a string.",
                hint="Set it to an alias of settings.DATABASES, such as 'default'.",
                id="workpump.E003",
            )
        ]
    databases = getattr(settings, "DATABASES", {})
    if value not in databases:
        known = ", ".join(repr(alias) for alias in databases) or "none"
        return [
            Error(
                f"{name} ({value!r}) must name a database in settings.DATABASES.",
                hint=f"Use one of the configured aliases: {known}.",
                id="workpump.E011",
            )
        ]
    engine = databases[value].get("ENGINE", "")
    if not _is_postgresql(engine):
        return [
            Error(
                f"{name} ({value!r}) must name a PostgreSQL database, not {engine!r}.",
                hint=(
                    "Point DATABASE_ALIAS at a database whose ENGINE is "
                    "'django.db.backends.postgresql'."
                ),
                id="workpump.E012",
            )
        ]
    return []


def _is_postgresql(engine: Any) -> bool:
    if engine in POSTGRES_ENGINES:
        return True
    if not isinstance(engine, str) or not engine:
        return False
    # Wrapping backends (metrics, pooling) keep the vendor; reading it does not connect.
    try:
        wrapper = import_module(f"{engine}.base").DatabaseWrapper
    except Exception:  # noqa: BLE001 - a backend that does not import is not PostgreSQL
        return False
    return getattr(wrapper, "vendor", None) == "postgresql"


def _check_listen_dsn(value: Any) -> list[CheckMessage]:
    name = _name("LISTEN_DSN")
    if value is None:
        return []
    if not isinstance(value, str):
        return [
            Error(
                f"{name} ({value!r}) must be None or a string.",
                hint="Set it to a libpq connection string or URL, or None to use DATABASE_ALIAS.",
                id="workpump.E003",
            )
        ]
    if not value.strip():
        return [
            Error(
                f"{name} ({value!r}) must be None or a non-empty connection string.",
                hint="Set it to None to use the DATABASE_ALIAS connection settings.",
                id="workpump.E013",
            )
        ]
    try:
        conninfo_to_dict(value)
    except psycopg.Error as exc:
        # The value is not echoed: a DSN may carry a password.
        reason = str(exc).strip().rstrip(".")
        return [
            Error(
                f"{name} cannot be parsed as a libpq connection string: {reason}.",
                hint=(
                    "Use 'host=... port=... dbname=... user=...' or "
                    "'postgresql://user@host:port/dbname'."
                ),
                id="workpump.E013",
            )
        ]
    return []


def _check_unknown_key(key: Any) -> CheckMessage:
    matches = difflib.get_close_matches(key, list(DEFAULTS), n=1) if isinstance(key, str) else []
    if matches:
        hint = f"Did you mean {matches[0]!r}?"
    else:
        hint = "Remove it; the known keys are listed in django_workpump.conf.DEFAULTS."
    return Error(
        f"{_name(key)} is not a known setting.",
        hint=hint,
        id="workpump.E002",
    )


def _check_combinations(values: Mapping[str, Any], ok: set[str]) -> list[CheckMessage]:
    """Checks across keys; a rule runs only when all its keys passed their own check."""

    def valid(*keys: str) -> bool:
        return all(key in ok for key in keys)

    messages: list[CheckMessage] = []
    v = values

    if (
        valid("RENEWAL_IMMEDIATE_FLUSH_AT", "RENEWAL_MAX_BATCH")
        and v["RENEWAL_IMMEDIATE_FLUSH_AT"] > v["RENEWAL_MAX_BATCH"]
    ):
        messages.append(
            Error(
                f"{_name('RENEWAL_IMMEDIATE_FLUSH_AT')} ({v['RENEWAL_IMMEDIATE_FLUSH_AT']!r}) "
                f"must be at most RENEWAL_MAX_BATCH ({v['RENEWAL_MAX_BATCH']!r}).",
                hint="Lower RENEWAL_IMMEDIATE_FLUSH_AT or raise RENEWAL_MAX_BATCH.",
                id="workpump.E006",
            )
        )
    if (
        valid("RENEWAL_MAX_BATCH", "RENEWAL_CAPACITY")
        and v["RENEWAL_MAX_BATCH"] > v["RENEWAL_CAPACITY"]
    ):
        messages.append(
            Error(
                f"{_name('RENEWAL_MAX_BATCH')} ({v['RENEWAL_MAX_BATCH']!r}) "
                f"must be at most RENEWAL_CAPACITY ({v['RENEWAL_CAPACITY']!r}).",
                hint="Lower RENEWAL_MAX_BATCH or raise RENEWAL_CAPACITY.",
                id="workpump.E006",
            )
        )

    if valid("LEASE_SECONDS", "LEASE_GRACE_SECONDS"):
        lease, grace = v["LEASE_SECONDS"], v["LEASE_GRACE_SECONDS"]
        if grace >= lease:
            messages.append(
                Error(
                    f"{_name('LEASE_GRACE_SECONDS')} ({grace!r}) "
                    f"must be less than LEASE_SECONDS ({lease!r}).",
                    hint=(
                        "A handler would be cancelled as soon as it starts; "
                        "lower LEASE_GRACE_SECONDS or raise LEASE_SECONDS."
                    ),
                    id="workpump.E007",
                )
            )
        elif lease <= 2 * grace:
            messages.append(
                Warning(
                    f"{_name('LEASE_SECONDS')} ({lease!r}) "
                    f"should be more than twice LEASE_GRACE_SECONDS ({grace!r}).",
                    hint=(
                        "A handler's deadline is LEASE_SECONDS minus LEASE_GRACE_SECONDS, "
                        "which leaves renewals hardly any time to run; raise LEASE_SECONDS "
                        "or lower LEASE_GRACE_SECONDS."
                    ),
                    id="workpump.W002",
                )
            )

    if valid("STALE_AFTER_SECONDS", "HEARTBEAT_INTERVAL_SECONDS"):
        stale, fast = v["STALE_AFTER_SECONDS"], v["HEARTBEAT_INTERVAL_SECONDS"]
        if stale < 2 * fast:
            messages.append(
                Error(
                    f"{_name('STALE_AFTER_SECONDS')} ({stale!r}) "
                    f"must be at least twice HEARTBEAT_INTERVAL_SECONDS ({fast!r}).",
                    hint=(
                        f"A live instance whose heartbeat is a little late would be evicted; "
                        f"raise STALE_AFTER_SECONDS to {2 * fast} or more, "
                        f"or lower HEARTBEAT_INTERVAL_SECONDS."
                    ),
                    id="workpump.E008",
                )
            )

    if valid("DEFINITIVELY_DEAD_AFTER_SECONDS", "STALE_AFTER_SECONDS"):
        dead, stale = v["DEFINITIVELY_DEAD_AFTER_SECONDS"], v["STALE_AFTER_SECONDS"]
        if dead < stale:
            messages.append(
                Error(
                    f"{_name('DEFINITIVELY_DEAD_AFTER_SECONDS')} ({dead!r}) "
                    f"must be at least STALE_AFTER_SECONDS ({stale!r}).",
                    hint=(
                        "An instance is stale before it is definitively dead; raise "
                        "DEFINITIVELY_DEAD_AFTER_SECONDS or lower STALE_AFTER_SECONDS."
                    ),
                    id="workpump.E009",
                )
            )

    if valid(
        "LIVENESS_SOURCE_MODE", "HEARTBEAT_SLOW_INTERVAL_SECONDS", "DEFINITIVELY_DEAD_AFTER_SECONDS"
    ):
        slow, dead = v["HEARTBEAT_SLOW_INTERVAL_SECONDS"], v["DEFINITIVELY_DEAD_AFTER_SECONDS"]
        if v["LIVENESS_SOURCE_MODE"] == "advisory_lock_when_available" and slow >= dead:
            messages.append(
                Error(
                    f"{_name('HEARTBEAT_SLOW_INTERVAL_SECONDS')} ({slow!r}) "
                    f"must be less than DEFINITIVELY_DEAD_AFTER_SECONDS ({dead!r}) "
                    f"when LIVENESS_SOURCE_MODE is 'advisory_lock_when_available'.",
                    hint=(
                        "A live instance beating at the slow cadence would be evicted as "
                        "definitively dead; lower HEARTBEAT_SLOW_INTERVAL_SECONDS or raise "
                        "DEFINITIVELY_DEAD_AFTER_SECONDS."
                    ),
                    id="workpump.E010",
                )
            )

    if valid("HEARTBEAT_SLOW_INTERVAL_SECONDS", "HEARTBEAT_INTERVAL_SECONDS"):
        slow, fast = v["HEARTBEAT_SLOW_INTERVAL_SECONDS"], v["HEARTBEAT_INTERVAL_SECONDS"]
        if slow < fast:
            messages.append(
                Warning(
                    f"{_name('HEARTBEAT_SLOW_INTERVAL_SECONDS')} ({slow!r}) "
                    f"should be at least HEARTBEAT_INTERVAL_SECONDS ({fast!r}).",
                    hint=(
                        "The slow cadence applies while the alive-lock proves liveness; "
                        "set it to HEARTBEAT_INTERVAL_SECONDS or more."
                    ),
                    id="workpump.W001",
                )
            )

    if valid("POLLING_MAX_INTERVAL_MS", "POLLING_INTERVAL_MS"):
        cap, base = v["POLLING_MAX_INTERVAL_MS"], v["POLLING_INTERVAL_MS"]
        if cap <= base:
            messages.append(
                Info(
                    f"{_name('POLLING_MAX_INTERVAL_MS')} ({cap!r}) is not above "
                    f"POLLING_INTERVAL_MS ({base!r}), so backoff is disabled.",
                    hint=(
                        "Empty polls will not slow down; raise POLLING_MAX_INTERVAL_MS above "
                        "POLLING_INTERVAL_MS to let idle instances poll less often."
                    ),
                    id="workpump.I001",
                )
            )

    if valid("HEARTBEAT_ENABLED") and v["HEARTBEAT_ENABLED"] is False:
        messages.append(
            Warning(
                f"{_name('HEARTBEAT_ENABLED')} (False) stops heartbeats, "
                f"so peers will evict this instance.",
                hint="Use it only to drain an instance; set it to True for normal running.",
                id="workpump.W003",
            )
        )

    if valid("CLAIM_ENABLED") and v["CLAIM_ENABLED"] is False:
        messages.append(
            Info(
                f"{_name('CLAIM_ENABLED')} (False) stops this instance from claiming work.",
                hint="Set it to True to process work again.",
                id="workpump.I002",
            )
        )

    return messages


def validate_settings() -> list[CheckMessage]:
    """Return the check messages for the current ``WORKPUMP`` setting."""
    user = getattr(settings, "WORKPUMP", {})
    if not isinstance(user, Mapping):
        return [
            Error(
                f"WORKPUMP must be a dict, not {type(user).__name__}.",
                hint="Set WORKPUMP to a dict of the keys to override, or leave it out.",
                id="workpump.E001",
            )
        ]
    messages: list[CheckMessage] = [_check_unknown_key(key) for key in user if key not in DEFAULTS]
    values = {**DEFAULTS, **{k: v for k, v in user.items() if k in DEFAULTS}}
    ok: set[str] = set()
    for key in DEFAULTS:
        found = _check_key(key, values[key])
        messages.extend(found)
        if not found:
            ok.add(key)
    messages.extend(_check_combinations(values, ok))
    return messages


@register("workpump")
def check_workpump_settings(app_configs: Any = None, **kwargs: Any) -> list[CheckMessage]:
    """Validate ``WORKPUMP``: unknown keys, types, ranges and unsafe combinations."""
    return validate_settings()
