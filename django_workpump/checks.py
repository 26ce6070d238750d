"""System checks for the ``WORKPUMP`` settings dict.

Each key is checked on its own by its kind in ``conf.SETTINGS`` (type, then range), then
the rules across keys run in order, each only when all its keys passed their own check.
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
    E014 ``MIDDLEWARE`` names something that does not import or is not callable.
    E015 ``METRICS_PORT`` is not a port, or is set without ``prometheus_client``.
    E016 ``HANDLER_CONNECTIONS`` is not a known mode.
    E017 ``ATTEMPT_LOG_LEVEL`` is not a log level.
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
from collections.abc import Callable, Mapping
from importlib import import_module
from typing import Any

import psycopg
from django.conf import settings
from django.core.checks import CheckMessage, Error, Info, Warning, register
from django.utils.module_loading import import_string
from psycopg.conninfo import conninfo_to_dict

from django_workpump.conf import DEFAULTS, SETTINGS, Kind, Setting, log_level
from django_workpump.pump.handler_connections import MODES as HANDLER_CONNECTION_MODES

LIVENESS_MODES = ("advisory_lock_when_available", "heartbeat_table_only")
POSTGRES_ENGINES = ("django.db.backends.postgresql", "django.contrib.gis.db.backends.postgis")


def _name(key: str) -> str:
    return f"WORKPUMP[{key!r}]"


def _is_int(value: Any) -> bool:
    # bool is an int subclass; True as a lease length is a typo, not a choice.
    return isinstance(value, int) and not isinstance(value, bool)


# -- each key on its own, by its kind: type first, then range; at most one message -------


def _check_int(setting: Setting, value: Any) -> list[CheckMessage]:
    """An integer of at least ``setting.minimum`` (or None, for an optional key)."""
    name = _name(setting.name)
    minimum = setting.minimum
    assert minimum is not None  # every "int" setting has one (conf.Setting)
    if setting.optional and value is None:
        return []
    if not _is_int(value):
        expected = "an integer or None" if setting.optional else "an integer"
        if isinstance(value, bool):
            expected += ", not a boolean"
        return [
            Error(
                f"{name} ({value!r}) must be {expected}.",
                hint=f"Set it to a whole number such as {setting.default!r} (the default).",
                id="workpump.E003",
            )
        ]
    if value < minimum:
        return [
            Error(
                f"{name} ({value!r}) must be at least {minimum}.",
                hint=f"Set it to {minimum} or more; the default is {setting.default!r}.",
                id="workpump.E004",
            )
        ]
    return []


def _check_bool(setting: Setting, value: Any) -> list[CheckMessage]:
    """True or False, not a truthy value."""
    if not isinstance(value, bool):
        return [
            Error(
                f"{_name(setting.name)} ({value!r}) must be True or False.",
                hint=f"Set it to a boolean; the default is {setting.default!r}.",
                id="workpump.E003",
            )
        ]
    return []


def _check_liveness_mode(setting: Setting, value: Any) -> list[CheckMessage]:
    """One of ``LIVENESS_MODES``."""
    if value not in LIVENESS_MODES:
        return [
            Error(
                f"{_name(setting.name)} ({value!r}) must be "
                f"{LIVENESS_MODES[0]!r} or {LIVENESS_MODES[1]!r}.",
                hint=(
                    "Use 'heartbeat_table_only' behind a transaction pooler, "
                    "else 'advisory_lock_when_available'."
                ),
                id="workpump.E005",
            )
        ]
    return []


def _check_handler_connections(setting: Setting, value: Any) -> list[CheckMessage]:
    """One of ``handler_connections.MODES``."""
    if value not in HANDLER_CONNECTION_MODES:
        return [
            Error(
                f"{_name(setting.name)} ({value!r}) must be "
                f"{HANDLER_CONNECTION_MODES[0]!r} or {HANDLER_CONNECTION_MODES[1]!r}.",
                hint=(
                    "Use 'persistent' (handler threads keep their connections across jobs), "
                    "or 'per_job' for Django's per-request rules."
                ),
                id="workpump.E016",
            )
        ]
    return []


def _check_database_alias(setting: Setting, value: Any) -> list[CheckMessage]:
    """The alias of a PostgreSQL database in ``settings.DATABASES``."""
    name = _name(setting.name)
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


def _check_dsn(setting: Setting, value: Any) -> list[CheckMessage]:
    """None, or a libpq connection string that parses."""
    name = _name(setting.name)
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


def _check_dotted_paths(setting: Setting, value: Any) -> list[CheckMessage]:
    """A list or tuple of dotted paths, each importing a callable."""
    name = _name(setting.name)
    if not isinstance(value, list | tuple) or not all(isinstance(p, str) for p in value):
        return [
            Error(
                f"{name} ({value!r}) must be a list of dotted paths.",
                hint="Set it to e.g. ['myapp.middleware.sentry_scope'], or [] for none.",
                id="workpump.E003",
            )
        ]
    errors: list[CheckMessage] = []
    for path in value:
        try:
            found = import_string(path)
        except ImportError as exc:
            errors.append(
                Error(
                    f"{name} names {path!r}, which cannot be imported: {exc}.",
                    hint="Fix the dotted path, or remove it from the list.",
                    id="workpump.E014",
                )
            )
            continue
        if not callable(found):
            errors.append(
                Error(
                    f"{name} names {path!r}, which is a {type(found).__name__}, not a callable.",
                    hint="Name a function middleware(work, call_next).",
                    id="workpump.E014",
                )
            )
    return errors


def _check_log_level(setting: Setting, value: Any) -> list[CheckMessage]:
    """A logging level name or number (conf.log_level), or None."""
    if value is not None and (isinstance(value, bool) or not isinstance(value, str | int)):
        return [
            Error(
                f"{_name(setting.name)} ({value!r}) must be a level name, a number or None.",
                hint='Set it to "WARNING" (the default), "INFO", "DEBUG", or None for none.',
                id="workpump.E003",
            )
        ]
    try:
        log_level(value)
    except ValueError as exc:
        return [
            Error(
                str(exc),
                hint='Set it to "WARNING" (the default), "INFO", "DEBUG", or None for none.',
                id="workpump.E017",
            )
        ]
    return []


_KIND_CHECKS: dict[Kind, Callable[[Setting, Any], list[CheckMessage]]] = {
    "int": _check_int,
    "bool": _check_bool,
    "liveness_mode": _check_liveness_mode,
    "handler_connections": _check_handler_connections,
    "database_alias": _check_database_alias,
    "dsn": _check_dsn,
    "dotted_paths": _check_dotted_paths,
    "log_level": _check_log_level,
}


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


# -- rules across keys, run in the order they are declared ----------------------------------

Rule = Callable[[Mapping[str, Any]], CheckMessage | None]
# Each rule with the keys it reads: it runs only when all of them passed their own check.
_RULES: list[tuple[tuple[str, ...], Rule]] = []


def _rule(*keys: str) -> Callable[[Rule], Rule]:
    """Declare a rule across ``keys``; rules run in the order of their declaration."""

    def declare(rule: Rule) -> Rule:
        _RULES.append((keys, rule))
        return rule

    return declare


@_rule("RENEWAL_IMMEDIATE_FLUSH_AT", "RENEWAL_MAX_BATCH")
def _renewal_flush_within_batch(v: Mapping[str, Any]) -> CheckMessage | None:
    """E006: the renewal batcher's immediate flush size must fit in one batch."""
    if v["RENEWAL_IMMEDIATE_FLUSH_AT"] <= v["RENEWAL_MAX_BATCH"]:
        return None
    return Error(
        f"{_name('RENEWAL_IMMEDIATE_FLUSH_AT')} ({v['RENEWAL_IMMEDIATE_FLUSH_AT']!r}) "
        f"must be at most RENEWAL_MAX_BATCH ({v['RENEWAL_MAX_BATCH']!r}).",
        hint="Lower RENEWAL_IMMEDIATE_FLUSH_AT or raise RENEWAL_MAX_BATCH.",
        id="workpump.E006",
    )


@_rule("RENEWAL_MAX_BATCH", "RENEWAL_CAPACITY")
def _renewal_batch_within_capacity(v: Mapping[str, Any]) -> CheckMessage | None:
    """E006: one renewal batch must fit in the batcher's buffer."""
    if v["RENEWAL_MAX_BATCH"] <= v["RENEWAL_CAPACITY"]:
        return None
    return Error(
        f"{_name('RENEWAL_MAX_BATCH')} ({v['RENEWAL_MAX_BATCH']!r}) "
        f"must be at most RENEWAL_CAPACITY ({v['RENEWAL_CAPACITY']!r}).",
        hint="Lower RENEWAL_MAX_BATCH or raise RENEWAL_CAPACITY.",
        id="workpump.E006",
    )


@_rule("LEASE_SECONDS", "LEASE_GRACE_SECONDS")
def _grace_below_lease(v: Mapping[str, Any]) -> CheckMessage | None:
    """E007: a handler's deadline (lease minus grace) must lie after its start."""
    lease, grace = v["LEASE_SECONDS"], v["LEASE_GRACE_SECONDS"]
    if grace < lease:
        return None
    return Error(
        f"{_name('LEASE_GRACE_SECONDS')} ({grace!r}) must be less than LEASE_SECONDS ({lease!r}).",
        hint=(
            "A handler would be cancelled as soon as it starts; "
            "lower LEASE_GRACE_SECONDS or raise LEASE_SECONDS."
        ),
        id="workpump.E007",
    )


@_rule("LEASE_SECONDS", "LEASE_GRACE_SECONDS")
def _lease_above_twice_grace(v: Mapping[str, Any]) -> CheckMessage | None:
    """W002: the lease should leave renewals time to run (only when E007 does not apply)."""
    lease, grace = v["LEASE_SECONDS"], v["LEASE_GRACE_SECONDS"]
    if grace >= lease or lease > 2 * grace:
        return None
    return Warning(
        f"{_name('LEASE_SECONDS')} ({lease!r}) "
        f"should be more than twice LEASE_GRACE_SECONDS ({grace!r}).",
        hint=(
            "A handler's deadline is LEASE_SECONDS minus LEASE_GRACE_SECONDS, "
            "which leaves renewals hardly any time to run; raise LEASE_SECONDS "
            "or lower LEASE_GRACE_SECONDS."
        ),
        id="workpump.W002",
    )


@_rule("STALE_AFTER_SECONDS", "HEARTBEAT_INTERVAL_SECONDS")
def _stale_after_two_heartbeats(v: Mapping[str, Any]) -> CheckMessage | None:
    """E008: one late heartbeat must not make a live instance stale."""
    stale, fast = v["STALE_AFTER_SECONDS"], v["HEARTBEAT_INTERVAL_SECONDS"]
    if stale >= 2 * fast:
        return None
    return Error(
        f"{_name('STALE_AFTER_SECONDS')} ({stale!r}) "
        f"must be at least twice HEARTBEAT_INTERVAL_SECONDS ({fast!r}).",
        hint=(
            f"A live instance whose heartbeat is a little late would be evicted; "
            f"raise STALE_AFTER_SECONDS to {2 * fast} or more, "
            f"or lower HEARTBEAT_INTERVAL_SECONDS."
        ),
        id="workpump.E008",
    )


@_rule("DEFINITIVELY_DEAD_AFTER_SECONDS", "STALE_AFTER_SECONDS")
def _dead_after_stale(v: Mapping[str, Any]) -> CheckMessage | None:
    """E009: an instance is stale before it is definitively dead."""
    dead, stale = v["DEFINITIVELY_DEAD_AFTER_SECONDS"], v["STALE_AFTER_SECONDS"]
    if dead >= stale:
        return None
    return Error(
        f"{_name('DEFINITIVELY_DEAD_AFTER_SECONDS')} ({dead!r}) "
        f"must be at least STALE_AFTER_SECONDS ({stale!r}).",
        hint=(
            "An instance is stale before it is definitively dead; raise "
            "DEFINITIVELY_DEAD_AFTER_SECONDS or lower STALE_AFTER_SECONDS."
        ),
        id="workpump.E009",
    )


@_rule("LIVENESS_SOURCE_MODE", "HEARTBEAT_SLOW_INTERVAL_SECONDS", "DEFINITIVELY_DEAD_AFTER_SECONDS")
def _slow_heartbeat_before_dead(v: Mapping[str, Any]) -> CheckMessage | None:
    """E010: with the alive-lock, an instance beating slowly must not look definitively dead."""
    slow, dead = v["HEARTBEAT_SLOW_INTERVAL_SECONDS"], v["DEFINITIVELY_DEAD_AFTER_SECONDS"]
    if v["LIVENESS_SOURCE_MODE"] != "advisory_lock_when_available" or slow < dead:
        return None
    return Error(
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


@_rule("HEARTBEAT_SLOW_INTERVAL_SECONDS", "HEARTBEAT_INTERVAL_SECONDS")
def _slow_heartbeat_not_faster(v: Mapping[str, Any]) -> CheckMessage | None:
    """W001: the slow heartbeat cadence should not be faster than the fast one."""
    slow, fast = v["HEARTBEAT_SLOW_INTERVAL_SECONDS"], v["HEARTBEAT_INTERVAL_SECONDS"]
    if slow >= fast:
        return None
    return Warning(
        f"{_name('HEARTBEAT_SLOW_INTERVAL_SECONDS')} ({slow!r}) "
        f"should be at least HEARTBEAT_INTERVAL_SECONDS ({fast!r}).",
        hint=(
            "The slow cadence applies while the alive-lock proves liveness; "
            "set it to HEARTBEAT_INTERVAL_SECONDS or more."
        ),
        id="workpump.W001",
    )


@_rule("POLLING_MAX_INTERVAL_MS", "POLLING_INTERVAL_MS")
def _polling_backoff(v: Mapping[str, Any]) -> CheckMessage | None:
    """I001: a polling cap not above the base disables backoff."""
    cap, base = v["POLLING_MAX_INTERVAL_MS"], v["POLLING_INTERVAL_MS"]
    if cap > base:
        return None
    return Info(
        f"{_name('POLLING_MAX_INTERVAL_MS')} ({cap!r}) is not above "
        f"POLLING_INTERVAL_MS ({base!r}), so backoff is disabled.",
        hint=(
            "Empty polls will not slow down; raise POLLING_MAX_INTERVAL_MS above "
            "POLLING_INTERVAL_MS to let idle instances poll less often."
        ),
        id="workpump.I001",
    )


@_rule("HEARTBEAT_ENABLED")
def _heartbeat_disabled(v: Mapping[str, Any]) -> CheckMessage | None:
    """W003: without heartbeats peers evict this instance."""
    if v["HEARTBEAT_ENABLED"] is not False:
        return None
    return Warning(
        f"{_name('HEARTBEAT_ENABLED')} (False) stops heartbeats, "
        f"so peers will evict this instance.",
        hint="Use it only to drain an instance; set it to True for normal running.",
        id="workpump.W003",
    )


@_rule("CLAIM_ENABLED")
def _claim_disabled(v: Mapping[str, Any]) -> CheckMessage | None:
    """I002: this instance claims nothing."""
    if v["CLAIM_ENABLED"] is not False:
        return None
    return Info(
        f"{_name('CLAIM_ENABLED')} (False) stops this instance from claiming work.",
        hint="Set it to True to process work again.",
        id="workpump.I002",
    )


@_rule("METRICS_PORT")
def _metrics_port(v: Mapping[str, Any]) -> CheckMessage | None:
    """E015: the metrics endpoint needs a real port and the prometheus extra."""
    from django_workpump import metrics

    port = v["METRICS_PORT"]
    if port is None:
        return None
    if port > 65535:
        return Error(
            f"{_name('METRICS_PORT')} ({port!r}) must be a TCP port, at most 65535.",
            hint="Choose a free port such as 9464, or None to serve no metrics.",
            id="workpump.E015",
        )
    if not metrics.AVAILABLE:
        return Error(
            f"{_name('METRICS_PORT')} ({port!r}) serves Prometheus metrics, but "
            "prometheus_client is not installed.",
            hint=f"Install it with: {metrics.INSTALL}; or set METRICS_PORT to None.",
            id="workpump.E015",
        )
    return None


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
    for setting in SETTINGS:
        found = _KIND_CHECKS[setting.kind](setting, values[setting.name])
        messages.extend(found)
        if not found:
            ok.add(setting.name)
    for keys, rule in _RULES:
        if ok.issuperset(keys) and (message := rule(values)) is not None:
            messages.append(message)
    return messages


@register("workpump")
def check_workpump_settings(app_configs: Any = None, **kwargs: Any) -> list[CheckMessage]:
    """Validate ``WORKPUMP``: unknown keys, types, ranges and unsafe combinations."""
    return validate_settings()
