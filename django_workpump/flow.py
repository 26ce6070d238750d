"""Flow control (docs/flow-control.md): concurrency caps, rate limits, fairness weights
and pauses, kept in the database (``workpump_flow_rule``) and enforced by the claim on
every instance.

A handler declares its topic's limits (``concurrency=``, ``rate=``, ``burst=``,
``key_concurrency=``); ``runworkpump`` writes the declarations at start. An operator
changes them at runtime with ``set_limit``, and stops and restarts work with ``pause``
and ``resume``: these win over the code's declarations and survive restarts. Each runs
in the caller's transaction on ``WORKPUMP['DATABASE_ALIAS']`` (or ``using``) and is in
effect at every instance's next claim once it commits.
"""

from __future__ import annotations

from typing import Any

from django.core.exceptions import ImproperlyConfigured

from django_workpump import db
from django_workpump.categories import NAMES as CATEGORIES
from django_workpump.conf import setting
from django_workpump.flow_limits import (
    MAX_WEIGHT,
    FlowLimits,
    checked_count,
    flow_limits,
    parse_rate,
)
from django_workpump.registry import Registry, registry

__all__ = [
    "FlowLimits",
    "declarations",
    "flow_limits",
    "parse_rate",
    "pause",
    "resume",
    "rules",
    "set_limit",
    "sync",
]


class _Unset:
    def __repr__(self) -> str:
        return "UNSET"


UNSET: Any = _Unset()  # set_limit: leave this setting as it is


def declarations(handlers: Registry | None = None) -> list[dict[str, Any]]:
    """The flow rules the handlers declare, as ``workpump.sync_flow_rules`` takes them."""
    handlers = registry if handlers is None else handlers
    return sorted(
        (
            {"kind": "topic", "category": h.category, "name": h.topic, **h.flow.settings()}
            for h in [*handlers.handlers(), *handlers.prefix_handlers()]
            if h.flow is not None and not h.prefix
        ),
        key=lambda rule: (rule["category"], rule["name"]),
    )


def sync(*, using: str | None = None, handlers: Registry | None = None) -> int:
    """Write the handlers' declarations (``runworkpump`` start); rules declared."""
    return db.sync_flow_rules(
        rules=declarations(handlers), using=using or setting("DATABASE_ALIAS")
    )


def _subject(topic: str | None, category: str | None, key: str | None) -> tuple[str, str, str]:
    """(kind, category, name) of the rule ``topic``/``category``/``key`` names."""
    if category is not None and category not in CATEGORIES:
        raise ValueError(f"Unknown category {category!r}; use one of {', '.join(CATEGORIES)}.")
    if key is not None:
        if topic is not None or category is not None:
            raise ValueError("Name a key alone: a key's rule holds in every topic and category.")
        if not isinstance(key, str) or not key.strip():
            raise ValueError(f"key must be a non-empty string, not {key!r}.")
        return "key", "", key
    if topic is None:
        if category is None:
            raise ValueError("Name what to act on: topic=..., category=... or key=....")
        return "category", category, ""
    if not isinstance(topic, str) or not topic.strip():
        raise ValueError(f"topic must be a non-empty string, not {topic!r}.")
    if category is None:
        found = sorted({h.category for h in registry.handlers() if h.topic == topic})
        if len(found) != 1:
            raise ValueError(
                f"Topic {topic!r} has "
                + ("handlers in " + ", ".join(found) if found else "no handler in this process")
                + ": pass category=... too (one of "
                + ", ".join(CATEGORIES)
                + ")."
            )
        category = found[0]
    return "topic", category, topic


def _set(subject: tuple[str, str, str], settings: dict[str, Any], using: str | None) -> int:
    kind, category, name = subject
    return db.set_flow_rule(
        kind=kind,
        category=category,
        name=name,
        settings=settings,
        using=using or setting("DATABASE_ALIAS"),
    )


def pause(
    *,
    topic: str | None = None,
    category: str | None = None,
    key: str | None = None,
    using: str | None = None,
) -> None:
    """Stop claiming the work of a topic (with its ``category`` when the name is in
    several), of a whole ``category``, or of a concurrency or fairness ``key``. Rows keep
    their attempts and order; running rows finish. Persisted until ``resume``."""
    _set(_subject(topic, category, key), {"paused": True}, using)


def resume(
    *,
    topic: str | None = None,
    category: str | None = None,
    key: str | None = None,
    using: str | None = None,
) -> None:
    """Claim again what ``pause`` stopped (the claimers are woken at commit)."""
    _set(_subject(topic, category, key), {"paused": False}, using)


def set_limit(
    *,
    topic: str | None = None,
    category: str | None = None,
    key: str | None = None,
    concurrency: int | None = UNSET,
    rate: str | float | None = UNSET,
    burst: int | None = UNSET,
    key_concurrency: int | None = UNSET,
    weight: int = UNSET,
    using: str | None = None,
) -> None:
    """Set the operator's limits of a topic or a key, which win over the code's.

    ``concurrency``: rows running at once (a key's: summed over every topic and
    category); ``rate``: ``"50/s"``, ``"600/m"``...; ``burst``: the rate's bucket;
    ``key_concurrency`` (a topic's): the cap of each concurrency key of the topic;
    ``weight`` (a fairness key's): its rows per round. None clears an override (the
    declaration applies again); a setting left out is left as it is.
    """
    subject = _subject(topic, category, key)
    where = f"{subject[0]} {subject[2] or subject[1]!r}"
    given = {
        "concurrency": concurrency,
        "rate": rate,
        "burst": burst,
        "key_concurrency": key_concurrency,
        "weight": weight,
    }
    settings = {name: value for name, value in given.items() if value is not UNSET}
    if not settings:
        raise ValueError("Pass a limit to set: concurrency, rate, burst, key_concurrency, weight.")
    try:
        if "rate" in settings:
            settings["rate"] = parse_rate(settings["rate"], where)
        for name in ("concurrency", "key_concurrency"):
            if name in settings:
                settings[name] = checked_count(settings[name], name, where)
        if "burst" in settings:
            settings["burst"] = checked_count(settings["burst"], "burst", where, minimum=1)
        if "weight" in settings:
            checked_weight = checked_count(settings["weight"], "weight", where, minimum=1)
            if checked_weight is None or checked_weight > MAX_WEIGHT:
                raise ImproperlyConfigured(f"weight of {where} must be 1 to {MAX_WEIGHT}.")
    except ImproperlyConfigured as exc:
        raise ValueError(str(exc)) from None
    _set(subject, settings, using)


def rules(*, using: str | None = None) -> list[db.FlowRuleStatus]:
    """Every rule as it stands now: limits, rows held, tokens left, rows waiting."""
    return db.flow_rule_status(using=using or setting("DATABASE_ALIAS"))
