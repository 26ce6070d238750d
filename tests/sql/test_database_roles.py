"""The least-privilege recipe of docs/reliability.md ("Database roles"), applied as written.

The test creates the roles the recipe names, runs its SQL block on the test database and
checks what each role can and cannot do.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import psycopg
import pytest
from django.db import connection
from psycopg import errors
from psycopg.rows import dict_row

from tests.helpers import ROOT, conninfo, scalar

pytestmark = pytest.mark.django_db(transaction=True)

DOC = ROOT / "docs" / "reliability.md"
ROLES = ("app_writer", "app_reader", "app_monitor")


def recipe() -> str:
    """The first SQL block of the "Database roles" section."""
    section = DOC.read_text().split("## Database roles", 1)[1]
    return re.search(r"```sql\n(.*?)```", section, re.DOTALL).group(1)


Connect = Callable[[str], psycopg.Connection[dict[str, Any]]]


@pytest.fixture
def as_role() -> Iterator[Connect]:
    """Apply the recipe with fresh role names; connect as one of the recipe's roles."""
    suffix = uuid.uuid4().hex[:8]
    names = {role: f"{role}_{suffix}" for role in (*ROLES, "app_outsider")}
    database = connection.settings_dict["NAME"]
    text = recipe().replace("DATABASE app ", f'DATABASE "{database}" ')
    for role, name in names.items():
        text = re.sub(rf"\b{role}\b", name, text)
    with connection.cursor() as cursor:
        for name in names.values():
            cursor.execute(f'CREATE ROLE "{name}" LOGIN')
        cursor.execute(text)
    opened: list[psycopg.Connection[dict[str, Any]]] = []

    def connect(role: str) -> psycopg.Connection[dict[str, Any]]:
        conn = psycopg.connect(conninfo(), user=names[role], row_factory=dict_row)
        opened.append(conn)
        return conn

    yield connect
    for conn in opened:
        conn.close()
    with connection.cursor() as cursor:
        cursor.execute(f'GRANT CONNECT, TEMPORARY ON DATABASE "{database}" TO PUBLIC')
        for name in names.values():
            cursor.execute(f'DROP OWNED BY "{name}"')
            cursor.execute(f'DROP ROLE "{name}"')


def refused(conn: psycopg.Connection[Any], query: str, params: Any = None) -> bool:
    """Whether the query fails for want of a privilege (the transaction is rolled back)."""
    try:
        conn.execute(query, params)
    except errors.InsufficientPrivilege:
        conn.rollback()
        return True
    conn.rollback()
    return False


SUBSCRIBERS = json.dumps([{"category": "receptor", "name": "fx.r", "max_attempts": 3}])
INSTANCE = uuid.UUID("00000000-0000-0000-0000-00000000000a")


def test_the_writer_produces_work_and_does_nothing_else(as_role):
    writer = as_role("app_writer")
    with writer.transaction():
        writer.execute("SELECT workpump.send('t.out', '{\"n\": 1}', p_stream => 's-1')")
        writer.execute("SELECT workpump.send('t.out', '{\"n\": 2}', p_unique_key => 'k-1')")
        writer.execute("SELECT workpump.send('t.out', '{\"n\": 3}', p_unique_key => 'k-1')")
        writer.execute(
            "SELECT workpump.receive(%s, 't.in', '{\"n\": 4}', p_stream => 's-1')", [uuid.uuid4()]
        )
        writer.execute(
            "SELECT workpump.emit('t.ev', '{\"n\": 5}', p_stream => 's-1', p_subscribers => %s)",
            [SUBSCRIBERS],
        )
        writer.execute(
            "SELECT workpump.send_many('t.out', ARRAY['{\"n\": 6}', '{\"n\": 7}']::jsonb[],"
            " p_streams => ARRAY['s-2', 's-2'])"
        )
        assert writer.execute("SELECT count(*) AS n FROM workpump_outbox").fetchone()["n"] == 4
    assert scalar("SELECT count(*) FROM workpump_outbox") == 4
    assert scalar("SELECT count(*) FROM workpump_inbox") == 1
    assert scalar("SELECT count(*) FROM workpump_receptor_processing") == 1

    assert refused(writer, "SELECT lease_token FROM workpump_outbox")
    assert refused(writer, "UPDATE workpump_outbox SET done_at = now()")
    assert refused(writer, "DELETE FROM workpump_outbox")
    assert scalar("SELECT workpump.record_heartbeat(%s, 's', 'h', 1)", [INSTANCE])
    assert refused(writer, "SELECT * FROM workpump.claim_work(%s, 10, 60)", [INSTANCE])
    assert refused(writer, "SELECT workpump.record_heartbeat(%s, 's', 'h', 1)", [INSTANCE])
    assert refused(writer, "SELECT workpump.take_alive_lock(%s)", [INSTANCE])
    assert refused(
        writer, "SELECT * FROM workpump.cleanup_stale_instances(now() + interval '1 min')"
    )
    assert refused(writer, "SELECT workpump.try_maintenance_lock()") is False  # any role can
    assert scalar("SELECT count(*) FROM workpump_outbox WHERE done_at IS NULL") == 4


def test_the_read_only_role_reads_all_but_lease_tokens_and_writes_nothing(as_role):
    producer = as_role("app_writer")
    with producer.transaction():
        producer.execute("SELECT workpump.send('t.out', '{\"n\": 1}')")
    reader = as_role("app_reader")

    rows = reader.execute("SELECT work_id, topic, payload FROM workpump_outbox").fetchall()
    assert [(r["topic"], r["payload"]) for r in rows] == [("t.out", {"n": 1})]
    reader.rollback()
    assert refused(reader, "SELECT * FROM workpump_outbox")  # lease_token with the rest
    assert refused(reader, "SELECT lease_token FROM workpump_inbox")
    assert refused(
        reader, "INSERT INTO workpump_eviction (instance_id, reason) VALUES (%s, 'x')", [INSTANCE]
    )
    assert refused(reader, "UPDATE workpump_service_instance SET alive_lock_lost_at = NULL")
    assert refused(reader, "SELECT workpump.send('t.out', '{}')")  # no USAGE on workpump


def test_a_connect_only_role_reads_and_writes_nothing_and_an_unnamed_role_cannot_connect(as_role):
    monitor = as_role("app_monitor")
    assert refused(monitor, "SELECT count(*) FROM workpump_outbox")
    assert refused(monitor, "SELECT count(*) FROM workpump_service_instance")
    assert refused(monitor, "SELECT workpump.send('t.out', '{}')")
    assert refused(monitor, "SELECT workpump.take_alive_lock(%s)", [INSTANCE])
    # It can take any advisory lock: the pump copes (tests/sql/test_strangers.py).
    lock = monitor.execute("SELECT pg_try_advisory_lock(1464877421, 0) AS ok").fetchone()
    assert lock["ok"] is True
    monitor.rollback()

    with pytest.raises(psycopg.OperationalError, match="permission denied for database"):
        as_role("app_outsider")
