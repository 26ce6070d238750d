"""Name every connection the pump opens after its instance and role.

Operators read ``pg_stat_activity.application_name`` to see which instance, and which of
its threads, holds a session: ``workpump:<first 8 hex digits of the instance id>:<role>``,
with roles ``main``, ``heartbeat``, ``claim``, ``maintenance``, ``renewal``,
``renewals``, ``completions``, ``failures``, ``deregister`` and ``handler-<n>``. The
NOTIFY gate's listener keeps ``workpump-<instance id>``: ``workpump_status`` and the
admin recognise a listening instance by that name.

Django keeps one connection per thread and alias, so a service thread calls
``name_thread_connections`` once when it starts; every connection the thread opens from
then on (a reconnect after an error too) is named by one ``set_config`` when it is
opened (Django's ``connection_created`` signal), never per query.
"""

from __future__ import annotations

import threading
import uuid
from typing import Any

from django.db import connections
from django.db.backends.signals import connection_created
from django.dispatch import receiver

from django_workpump import db

# PostgreSQL keeps the first NAMEDATALEN - 1 bytes of an application_name.
MAX_LENGTH = 63

_thread = threading.local()


def application_name(instance_id: uuid.UUID, role: str) -> str:
    """The application_name of one role of one instance."""
    return f"workpump:{instance_id.hex[:8]}:{role}"[:MAX_LENGTH]


def name_thread_connections(name: str | None) -> None:
    """Name the connections of the calling thread ``name`` (None: stop naming them).

    Connections already open in this thread are renamed now; later ones when they open.
    """
    _thread.name = name
    if name is None:
        return
    for connection in connections.all(initialized_only=True):
        if connection.connection is not None and connection.vendor == "postgresql":
            db.set_application_name(name=name, using=connection.alias)


def thread_connection_name() -> str | None:
    """The name this thread gives its connections, if any."""
    return getattr(_thread, "name", None)


@receiver(connection_created)
def _name_new_connection(sender: Any, connection: Any, **kwargs: Any) -> None:
    name = thread_connection_name()
    if name is not None and connection.vendor == "postgresql":
        db.set_application_name(name=name, using=connection.alias)
