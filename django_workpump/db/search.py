"""The opt-in payload indexes of the admin's payload search (docs/admin.md, "Search")."""

from __future__ import annotations

from django.db import connections

from django_workpump.db.queries import _alias
from django_workpump.sql import named_queries

# The tables whose payload the search reads (perspective and receptor rows: their event's),
# and each one's index.
PAYLOAD_INDEXES = {
    "workpump_outbox": "wp_outbox_payload",
    "workpump_inbox": "wp_inbox_payload",
    "workpump_event": "wp_event_payload",
}


def payload_indexes(*, create: bool, using: str | None = None) -> list[str]:
    """Create (or drop) the payload GIN indexes, CONCURRENTLY: outside a transaction,
    without blocking writers. Returns the index names."""
    query = named_queries("admin.sql")["payload_index_create" if create else "payload_index_drop"]
    with connections[_alias(using)].cursor() as cursor:
        for table, index in PAYLOAD_INDEXES.items():
            cursor.execute(query.format(table=table, index=index))
    return list(PAYLOAD_INDEXES.values())
