"""The database connections of handler threads, between one job and the next.

Django closes a request's connection when the request ends unless ``CONN_MAX_AGE``
keeps it, and its default (0) keeps none. A dispatch thread is not a request: a
handler using the ORM would open a connection per job, which costs more than most
jobs. So by default (``HANDLER_CONNECTIONS = "persistent"``) a handler thread keeps its
connections across jobs whatever ``CONN_MAX_AGE`` says:

- between jobs each open connection gets Django's ``close_if_unusable_or_obsolete``
  treatment (closed when a handler left autocommit changed, or when an error left it
  unusable), except that ``CONN_MAX_AGE = 0`` does not close it;
- a positive ``CONN_MAX_AGE`` still bounds its age;
- between jobs it is also checked for a drop without a round trip: an idle connection
  the server or a pooler closed (or terminated) has its socket readable, and is then
  tested with a query and replaced instead of failing the next job (with Django's
  ``CONN_HEALTH_CHECKS`` on, Django's own check runs too);
- the thread closes them when it exits (shutdown, or its job was abandoned).

``"per_job"`` restores Django's own rules (``close_old_connections`` around each job).
"""

from __future__ import annotations

import select
from typing import Any

from django.db import close_old_connections, connections

PERSISTENT = "persistent"
PER_JOB = "per_job"
MODES = (PERSISTENT, PER_JOB)


def between_jobs(mode: str) -> None:
    """Tidy the calling thread's connections before or after a job, per ``mode``."""
    if mode != PERSISTENT:
        close_old_connections()
        return
    for connection in connections.all(initialized_only=True):
        if connection.connection is None:
            continue
        if not connection.settings_dict.get("CONN_MAX_AGE"):
            # 0 would close it now; None never does: either way no age limit here.
            connection.close_at = None
        connection.close_if_unusable_or_obsolete()
        if connection.connection is not None and _dropped(connection):
            connection.close()


def _dropped(connection: Any) -> bool:
    """True when an idle connection is no longer usable.

    An idle PostgreSQL session has nothing to read; a server that ended it sent its last
    words (or EOF) on the socket, so a readable socket is tested with a query. Other
    backends are always tested.
    """
    if connection.vendor == "postgresql":
        try:
            readable, _, _ = select.select([connection.connection.fileno()], [], [], 0)
        except (OSError, ValueError):
            return True  # the socket is gone
        if not readable:
            return False
    return not connection.is_usable()
