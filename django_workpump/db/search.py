"""The opt-in payload indexes of the admin's payload search (docs/admin.md, "Search")."""

from __future__ import annotations

import re

from django.db import connections

from django_workpump.db.queries import _alias
from django_workpump.sql import named_queries


def payload_indexes(*, create: bool, using: str | None = None) -> list[str]:
    """Create (or drop) the payload GIN indexes, each CONCURRENTLY: outside a transaction,
    without blocking writers. Returns the index names."""
    connection = connections[_alias(using)]
    with connection.cursor() as cursor:
        cursor.execute(named_queries("admin.sql")["payload_index_ddl"], {"create": create})
        statements = [row[0] for row in cursor.fetchall()]
        for statement in statements:
            cursor.execute(statement)
    return [re.findall(r"wp_\w+_payload", s)[0] for s in statements]


def payload_index_ready(name: str, *, using: str | None = None) -> bool:
    """Whether the payload index ``name`` exists and is valid (a build CONCURRENTLY that
    failed leaves an invalid one, which serves no search)."""
    with connections[_alias(using)].cursor() as cursor:
        cursor.execute(named_queries("admin.sql")["payload_index_ready"], {"name": name})
        (ready,) = cursor.fetchone()
    return bool(ready)
