"""MaintenanceWorker and the supervisor's reaction to a dying service."""

from __future__ import annotations

import logging
import threading
import uuid
from datetime import datetime, timedelta

import pytest
from django.db import connections
from django.test import override_settings
from django.utils import timezone

import django_workpump as workpump
from django_workpump import models
from django_workpump.pump.maintenance import CONSOLE_RETENTION_SECONDS
from django_workpump.pump.supervisor import EXIT_SERVICE_DIED, PumpOptions, Supervisor
from tests.factories import EvictionFactory, OutboxFactory, ServiceInstanceFactory
from tests.helpers import enroll, maintenance_worker, run_sql, scalar, wait_until


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


def this_minute() -> tuple[datetime, datetime]:
    """The database clock (the transaction's now(), which a pass reads) and its minute."""
    now = scalar("SELECT now()")
    return now, scalar("SELECT date_trunc('minute', now())")


@pytest.mark.django_db
def test_a_pass_samples_the_consoles_backlog_and_instances_of_its_minute_once():
    now, minute = this_minute()
    topic = "mw.console"
    for _ in range(2):
        OutboxFactory(topic=topic, created_at=now - timedelta(seconds=30))
    OutboxFactory(topic=topic, created_at=now, scheduled_for=now + timedelta(hours=1))
    holder = ServiceInstanceFactory(last_heartbeat_at=now - timedelta(seconds=5))
    OutboxFactory(
        topic=topic,
        created_at=now,
        instance_id=holder.instance_id,
        lease_expiry=now + timedelta(minutes=1),
        claimed_at=now - timedelta(seconds=5),
        attempts=1,
    )
    OutboxFactory(topic=topic, created_at=now, done_at=now)  # ended: not in the backlog

    assert maintenance_worker().run_once().sampled is True

    backlog = models.ConsoleBacklog.objects.get(minute=minute, category="outbox", topic=topic)
    assert (backlog.pending, backlog.scheduled, backlog.leased) == (2, 1, 1)
    assert backlog.oldest_pending_seconds == pytest.approx(30)
    instance = models.ConsoleInstance.objects.get(minute=minute, instance_id=holder.instance_id)
    assert instance.in_flight == 1
    assert instance.heartbeat_age_seconds == pytest.approx(5)

    # a second pass in the same minute (a peer's, or this one's next) takes no sample:
    # the minute's backlog stays as first sampled
    OutboxFactory(topic=topic, created_at=now)
    assert maintenance_worker().run_once().sampled is False
    assert models.ConsoleSample.objects.filter(minute=minute).count() == 1
    assert models.ConsoleBacklog.objects.get(minute=minute, topic=topic).pending == 2


@pytest.mark.django_db(transaction=True)
def test_between_passes_the_loop_samples_the_console_without_running_a_pass():
    worker = maintenance_worker(interval_seconds=300, console_sample_seconds=0.05)
    worker.supervise(on_thread_exit=connections.close_all)
    worker.start()
    try:
        assert wait_until(models.ConsoleSample.objects.exists, timeout=10)
    finally:
        worker.stop(timeout=10)
    assert worker.passes == 0  # the pass is 300 s away: the sample did not wait for it


@pytest.mark.django_db
def test_a_pass_purges_console_rows_older_than_the_retention_and_keeps_newer_ones():
    now, minute = this_minute()
    cutoff = now - timedelta(seconds=CONSOLE_RETENTION_SECONDS)
    # three old minutes (more than a batch of two) and one inside the retention
    old = [minute - timedelta(seconds=CONSOLE_RETENTION_SECONDS, minutes=m) for m in (1, 2, 3)]
    newer = minute - timedelta(seconds=CONSOLE_RETENTION_SECONDS, minutes=-2)
    instance = uuid.uuid4()
    for at in [*old, newer]:
        models.ConsoleCount.objects.create(
            minute=at, category="outbox", topic="mw.t", outcome="done", instance_id=instance, n=1
        )
        models.ConsoleBacklog.objects.create(
            minute=at, category="outbox", topic="mw.t", pending=1, scheduled=0, leased=0
        )
        models.ConsoleInstance.objects.create(minute=at, instance_id=instance, in_flight=0)
        models.ConsoleSample.objects.create(minute=at, taken_at=at)

    result = maintenance_worker().run_once()

    # every console table, including what this pass's own sample folded from the old
    # counters, holds nothing before the cutoff
    tables = [
        models.ConsoleCount,
        models.ConsoleTotal,
        models.ConsoleRollup,
        models.ConsoleBacklog,
        models.ConsoleInstance,
        models.ConsoleSample,
    ]
    for table in tables:
        assert not table.objects.filter(minute__lt=cutoff).exists(), table.__name__
    assert result.purged["console"] >= 4 * len(old)
    for table in (models.ConsoleCount, models.ConsoleBacklog, models.ConsoleInstance):
        assert list(table.objects.values_list("minute", flat=True)) == [newer]
    # kept: the minute inside the retention, and the one this pass sampled
    assert set(models.ConsoleSample.objects.values_list("minute", flat=True)) == {newer, minute}


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
