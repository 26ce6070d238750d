"""Renewals against PostgreSQL: 1,000 long-running leased rows, one statement per category.

The statements are counted with a Django execute wrapper on the connection the renewal
flush uses (pg_stat_statements needs shared_preload_libraries, which the test server
does not set). Flushes are driven by hand on this thread, so the wrapper sees them.
"""

from __future__ import annotations

import pytest
from django.db import connection

import django_workpump as workpump
from django_workpump.clock import FrozenClock
from django_workpump.pump.coordinator import DatabaseCoordinator, InstanceIdentity
from django_workpump.pump.lease import LeaseHandle, LeaseRegistry
from django_workpump.pump.renewal import LeaseRenewalWorker
from django_workpump.registry import registry

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def long_runner():
    workpump.perspective("renewal_long", events=["renewal.long"])(lambda work: None)
    yield
    registry.unregister("perspective_event", "renewal_long")


def test_1000_leased_rows_are_renewed_in_one_statement_per_category(long_runner):
    workpump.send_many("renewal.long", [{"n": n} for n in range(600)])
    workpump.emit_many("renewal.long", [{"n": n} for n in range(400)])
    coordinator = DatabaseCoordinator(InstanceIdentity(service_name="renewals"))
    assert coordinator.heartbeat({}) is True
    claimed = coordinator.claim(1000)
    claimed += coordinator.claim(1000)
    assert len(claimed) == 1000
    before = {row["work_id"]: row["lease_expiry"] for row in _expiries()}

    clock = FrozenClock(start=0.0)
    leases = LeaseRegistry()
    for row in claimed:
        leases.register(
            LeaseHandle(row.category, row.work_id, 50.0, 6, clock, lease_token=row.lease_token)
        )
    worker = LeaseRenewalWorker(
        coordinator, leases, lease_seconds=300, lease_grace_seconds=30, clock=clock
    )
    statements: list[str] = []

    def count(execute, sql, params, many, context):
        statements.append(sql)
        return execute(sql, params, many, context)

    with connection.execute_wrapper(count):
        assert worker.run_once() == (0, 1000)
        while worker.flusher.flush_once():
            pass

    renewals = [sql for sql in statements if "renew_leases" in sql]
    assert len(renewals) == 2  # outbox and perspective_event
    assert len(statements) == 2  # and nothing else
    assert worker.renewed == 1000
    after = {row["work_id"]: row["lease_expiry"] for row in _expiries()}
    assert set(after) == set(before)
    assert all(after[work_id] > before[work_id] for work_id in before)


def _expiries() -> list[dict]:
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT work_id, lease_expiry FROM workpump_outbox"
            " WHERE instance_id IS NOT NULL"
            " UNION ALL SELECT work_id, lease_expiry FROM workpump_perspective_event"
            " WHERE instance_id IS NOT NULL"
        )
        return [{"work_id": row[0], "lease_expiry": row[1]} for row in cursor.fetchall()]
