"""Subscriptions in the database: the registry's perspectives and receptors per event type.

SQL ``workpump.emit`` called without a subscriber list fans out from the table
``workpump_subscription``, so producers outside Python create the same work as
``django_workpump.emit``. The table is replaced on ``migrate`` (a ``post_migrate``
receiver, when the project's code is loaded whole) and upserted, never pruned, at
``runworkpump`` start: a pump started with part of the code removes nothing.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from django_workpump import db
from django_workpump.conf import setting
from django_workpump.registry import Registry, registry

logger = logging.getLogger("django_workpump.subscriptions")

SUBSCRIBER_CATEGORIES = ("perspective_event", "receptor")


def registered(handlers: Registry = registry) -> list[dict[str, Any]]:
    """One subscription per event type of each perspective and receptor, in a stable order."""
    found = [
        {
            "event_type": event_type,
            "category": handler.category,
            "name": handler.topic,
            "max_attempts": handler.max_attempts or setting("MAX_ATTEMPTS"),
        }
        for category in SUBSCRIBER_CATEGORIES
        for handler in handlers.handlers(category)
        for event_type in handler.events
    ]
    return sorted(found, key=lambda s: (s["event_type"], s["category"], s["name"]))


def sync(*, replace: bool, using: str | None = None, handlers: Registry = registry) -> int:
    """Write the registry's subscriptions (``replace``: delete every other); rows changed."""
    alias = using or setting("DATABASE_ALIAS")
    changed = db.sync_subscriptions(
        subscriptions_json=json.dumps(registered(handlers)), replace=replace, using=alias
    )
    logger.debug(
        "synced %s subscription rows (replace=%s)",
        changed,
        replace,
        extra={"action": "subscriptions_synced"},
    )
    return changed


def sync_on_migrate(using: str, **kwargs: Any) -> None:
    """post_migrate receiver: replace the subscriptions of the workpump database.

    Skipped on other databases and on a schema without the table (migrated back).
    """
    if using != setting("DATABASE_ALIAS"):
        return
    if not db.schema_functions_present(["sync_subscriptions"], using=using):
        return
    sync(replace=True, using=using)
