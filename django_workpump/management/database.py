"""What the management commands say when the database cannot be used."""

from __future__ import annotations

from django.core.management.base import CommandError
from django.db import OperationalError, connections


def ensure_reachable(alias: str) -> None:
    """Connect to ``alias`` or raise a CommandError that says, in one sentence, why not."""
    connection = connections[alias]
    try:
        connection.ensure_connection()
    except OperationalError as exc:
        where = connection.settings_dict.get("NAME") or alias
        text = str(exc).strip()
        reason = text.splitlines()[0] if text else type(exc).__name__
        raise CommandError(
            f"Cannot reach the database {alias!r} ({where}): {reason}. Check "
            f"settings.DATABASES[{alias!r}] and that PostgreSQL is running."
        ) from None
