"""MaintenanceWorker and the supervisor's reaction to a dying service."""

from __future__ import annotations

import logging
import threading
import uuid
from datetime import timedelta

import pytest
from django.test import override_settings
from django.utils import timezone

import django_workpump as workpump
from django_workpump import models
from django_workpump.pump.supervisor import EXIT_SERVICE_DIED, PumpOptions, Supervisor
from tests.factories import EvictionFactory, OutboxFactory, ServiceInstanceFactory
from tests.helpers import enroll, maintenance_worker, run_sql, scalar


@pytest.mark.django_db
def test_a_pass_reaps_purges_in_batches_and_keeps_undone_rows(caplog):
    now = timezone.now()
    old = now - timedelta(days=2)
    stale = ServiceInstanceFactory(last_heartbeat_at=now - timedelta(minutes=10))
    fresh = ServiceInstanceFactory(last_heartbeat_at=now + timedelta(minutes=1))
    for _ in range(5):
        OutboxFactory(done_at=old)
    recent = OutboxFactory(done_at=now)
    undone_old = OutboxFactory(created_at=old)
    EvictionFactory(evicted_at=now - timedelta(days=3))
    kept_tombstone = EvictionFactory(evicted_at=now)

    # A 1 s stale cutoff: the reap pauses while the server is younger than the cutoff
    # (a restart is no evidence of death), and the test server may have just started.
    result = maintenance_worker(stale_after_seconds=1, definitively_dead_after_seconds=2).run_once()

    assert result.ran
    assert result.reaped == 1
    assert not models.ServiceInstance.objects.filter(pk=stale.pk).exists()
    assert models.ServiceInstance.objects.filter(pk=fresh.pk).exists()
    # five old processed rows went in batches of two; nothing undone or recent went
    assert result.purged["outbox"] == 5
    assert set(models.Outbox.objects.values_list("pk", flat=True)) == {recent.pk, undone_old.pk}
    # the stale instance's tombstone is new; the 3-day-old one is gone
    assert result.purged["eviction"] == 1
    assert models.Eviction.objects.filter(pk=kept_tombstone.pk).exists()


@pytest.mark.django_db
def test_rows_using_up_their_attempts_are_logged(caplog):
    caplog.set_level(logging.WARNING, logger="django_workpump.maintenance")
    trace = 'Traceback (most recent call last):\n  File "h.py", line 3, in h\n    x()\n'
    stuck = OutboxFactory(attempts=6, max_attempts=10, last_error=trace + "KeyError: 'x'\n")
    OutboxFactory(attempts=1, max_attempts=10)

    result = maintenance_worker().run_once()

    assert result.stuck == 1
    [record] = [r for r in caplog.records if getattr(r, "action", "") == "stuck_row"]
    assert str(stuck.work_id) in record.getMessage()
    assert "6 of 10" in record.getMessage()
    assert record.getMessage().endswith("last error: KeyError: 'x'")  # the line, no list repr


@pytest.mark.django_db(transaction=True)
def test_only_one_instance_runs_maintenance_at_a_time(raw_connect):
    holder = raw_connect()
    assert holder.execute("SELECT workpump.try_maintenance_lock()").fetchone()[
        "try_maintenance_lock"
    ]

    assert maintenance_worker().run_once().ran is False

    holder.execute("SELECT workpump.release_maintenance_lock()")
    assert maintenance_worker().run_once().ran is True
    # the pass let go of the lock again
    assert holder.execute("SELECT workpump.try_maintenance_lock()").fetchone()[
        "try_maintenance_lock"
    ]


@pytest.mark.django_db
def test_idle_stream_ownership_rows_are_dropped():
    message_id = workpump.send("m.x", {}, stream="s-1")
    me = uuid.uuid4()
    enroll(me)
    [claimed] = run_sql("SELECT * FROM workpump.claim_work(%s)", [me])
    run_sql(
        "SELECT * FROM workpump.complete_work(%s, 'outbox', ARRAY[%s]::uuid[], ARRAY[%s]::uuid[])",
        [me, message_id, claimed["lease_token"]],
    )
    assert scalar("SELECT count(*) FROM workpump_active_stream") == 1

    assert maintenance_worker().run_once().purged["active_stream"] == 1
    assert scalar("SELECT count(*) FROM workpump_active_stream") == 0


@pytest.mark.django_db(transaction=True)
@override_settings(WORKPUMP={"POLLING_INTERVAL_MS": 50, "NOTIFY_HEALTHY_POLLING_INTERVAL_MS": 100})
def test_a_dying_service_stops_the_whole_instance_with_a_non_zero_code():
    supervisor = Supervisor(PumpOptions(listen=False))
    died = threading.Event()

    def broken() -> None:
        died.set()
        raise RuntimeError("maintenance exploded")

    supervisor.maintenance.run = broken  # type: ignore[method-assign]
    supervisor.start()
    try:
        assert died.wait(10)
        assert supervisor.wait(10), "the supervisor did not stop after a service died"
    finally:
        code = supervisor.shutdown()
    assert code == EXIT_SERVICE_DIED
    assert "service maintenance died: maintenance exploded" in supervisor.stop_reason
    # it still deregistered on the way out
    assert models.ServiceInstance.objects.count() == 0
