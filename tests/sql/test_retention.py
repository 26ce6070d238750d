"""Nothing grows without bound: dead rows, received message ids, task attempts.

The SQL purges run in the test's transaction on real PostgreSQL; the maintenance pass
runs them in turn until each has caught up with its backlog.
"""

from __future__ import annotations

import uuid
from datetime import timedelta

import pytest
from django.db import DataError, transaction
from django.test import override_settings
from django.utils import timezone

import django_workpump as workpump
from django_workpump import models
from django_workpump.conf import DEFAULTS
from tests.factories import OutboxFactory
from tests.helpers import maintenance_worker, run_sql, scalar

pytestmark = pytest.mark.django_db

DAY = 24 * 3600


def purge_dead(category: str, before, batch: int = 100) -> int:
    return scalar("SELECT workpump.purge_dead(%s, %s, %s)", [category, before, batch])


def purge_dedup(before, batch: int = 100) -> int:
    return scalar("SELECT workpump.purge_inbox_dedup(%s, %s)", [before, batch])


# --- dead rows ------------------------------------------------------------------------------


def test_purge_dead_deletes_only_rows_dead_before_the_cutoff_oldest_first():
    now = timezone.now()
    old = [OutboxFactory(dead_lettered_at=now - timedelta(days=3 - i)) for i in range(3)]
    recent = OutboxFactory(dead_lettered_at=now)
    undone = OutboxFactory()
    done = OutboxFactory(done_at=now - timedelta(days=5))

    assert purge_dead("outbox", now - timedelta(hours=1), batch=2) == 2
    assert set(models.Outbox.objects.values_list("pk", flat=True)) == {
        old[2].pk,
        recent.pk,
        undone.pk,
        done.pk,
    }
    assert purge_dead("outbox", now - timedelta(hours=1)) == 1
    assert purge_dead("outbox", now - timedelta(hours=1)) == 0


# Plans in which the purge's key sub-select is run again per row of the table: with
# them, the old `key IN (SELECT ... LIMIT n FOR UPDATE SKIP LOCKED)` deleted past n.
NESTED_LOOPS_ONLY = [
    "SET LOCAL enable_hashjoin = off",
    "SET LOCAL enable_mergejoin = off",
    "SET LOCAL enable_material = off",
    "SET LOCAL enable_memoize = off",
    "SET LOCAL enable_hashagg = off",  # no de-duplicated keys driving the loop
    "SET LOCAL enable_sort = off",
]


def test_each_purge_deletes_at_most_its_batch_whatever_the_plan():
    now = timezone.now()
    long_ago = now - timedelta(days=10)
    for i in range(5):
        OutboxFactory(dead_lettered_at=long_ago + timedelta(seconds=i))
        OutboxFactory(done_at=long_ago + timedelta(seconds=i))
        run_sql(
            "INSERT INTO workpump_event (event_id, event_type, payload, created_at)"
            " VALUES (gen_random_uuid(), 'purged', '{}', %s)",
            [long_ago],
        )
        run_sql(
            "INSERT INTO workpump_inbox_dedup (message_id, first_seen_at) VALUES (%s, %s)",
            [uuid.uuid4(), long_ago],
        )
    for setting in NESTED_LOOPS_ONLY:
        run_sql(setting)
    cutoff = now - timedelta(days=1)
    purges = {
        "purge_dead": ("SELECT workpump.purge_dead('outbox', %s, 2)", [cutoff]),
        "purge_processed": ("SELECT workpump.purge_processed('outbox', %s, 2)", [cutoff]),
        "purge_events": ("SELECT workpump.purge_events(%s, 2)", [cutoff]),
        "purge_inbox_dedup": ("SELECT workpump.purge_inbox_dedup(%s, 2)", [cutoff]),
    }
    deleted = {name: scalar(sql, params) for name, (sql, params) in purges.items()}
    assert deleted == dict.fromkeys(purges, 2)
    assert models.Outbox.objects.filter(dead_lettered_at__isnull=False).count() == 3
    assert models.Outbox.objects.filter(done_at__isnull=False).count() == 3


def test_purging_a_dead_stream_head_lets_the_stream_move_on():
    workpump.send("retention.dest", {"n": 1}, stream="s-1")
    workpump.send("retention.dest", {"n": 2}, stream="s-1")
    first, second = models.Outbox.objects.filter(stream="s-1").order_by("seq")
    models.Outbox.objects.filter(pk=first.pk).update(
        dead_lettered_at=timezone.now() - timedelta(days=2)
    )
    second.refresh_from_db()
    assert first.stream_head and not second.stream_head  # the dead head blocks the stream

    assert purge_dead("outbox", timezone.now() - timedelta(days=1)) == 1

    second.refresh_from_db()
    assert second.stream_head


@pytest.mark.parametrize(("before", "batch"), [(None, 10), ("2026-01-01", 0)])
def test_purge_dead_refuses_a_missing_cutoff_or_batch(before, batch):
    with pytest.raises(DataError, match="purge_dead needs"), transaction.atomic():
        purge_dead("outbox", before, batch)


# --- received message ids -------------------------------------------------------------------


def test_received_ids_are_forgotten_after_retention_only_once_their_row_is_gone():
    long_ago = timezone.now() - timedelta(days=40)
    gone, stored, recent = uuid.uuid4(), uuid.uuid4(), uuid.uuid4()
    for message_id in (gone, stored, recent):
        assert workpump.receive(message_id, "retention.inbox", {"n": 1})
    models.InboxDedup.objects.filter(message_id__in=[gone, stored]).update(first_seen_at=long_ago)
    models.Inbox.objects.filter(work_id=gone).delete()  # purged by retention

    assert purge_dedup(timezone.now() - timedelta(days=30)) == 1
    assert set(models.InboxDedup.objects.values_list("message_id", flat=True)) == {stored, recent}
    # the forgotten id is accepted again; the remembered ones are still refused
    assert workpump.receive(gone, "retention.inbox", {"n": 2}) is True
    assert workpump.receive(stored, "retention.inbox", {"n": 2}) is False


def test_receive_without_deduplication_writes_no_dedup_row():
    message_id = uuid.uuid4()
    assert workpump.receive(message_id, "retention.inbox", {"n": 1}, deduplicate=False)
    assert models.Inbox.objects.filter(work_id=message_id).exists()
    assert not models.InboxDedup.objects.filter(message_id=message_id).exists()


# --- the maintenance pass -------------------------------------------------------------------


def test_a_pass_keeps_purging_until_every_backlog_has_caught_up():
    old = timezone.now() - timedelta(days=2)
    for _ in range(9):
        OutboxFactory(done_at=old)
    for _ in range(5):
        OutboxFactory(dead_lettered_at=old)
    kept_dead = OutboxFactory(dead_lettered_at=timezone.now())

    result = maintenance_worker(dead_retention_seconds=DAY, batch=2).run_once()

    # 9 and 5 rows in batches of 2: many batches, one pass
    assert result.purged["outbox"] == 9
    assert result.purged["dead_outbox"] == 5
    assert list(models.Outbox.objects.values_list("pk", flat=True)) == [kept_dead.pk]


def test_dead_rows_are_kept_unless_a_dead_retention_is_set():
    OutboxFactory(dead_lettered_at=timezone.now() - timedelta(days=400))
    result = maintenance_worker().run_once()
    assert "dead_outbox" not in result.purged
    assert models.Outbox.objects.count() == 1


def test_a_pass_purges_received_ids_and_task_attempts_not_the_handlers():
    long_ago = timezone.now() - timedelta(days=40)
    message_id = uuid.uuid4()
    models.InboxDedup.objects.create(message_id=message_id)
    models.InboxDedup.objects.update(first_seen_at=long_ago)
    models.TaskAttempt.objects.create(work_id=uuid.uuid4(), attempt=1, instance_id=uuid.uuid4())
    models.TaskAttempt.objects.update(started_at=long_ago)

    result = maintenance_worker(inbox_dedup_retention_seconds=30 * DAY).run_once()

    assert result.purged["inbox_dedup"] == 1
    assert result.purged["task_attempt"] == 1
    assert not models.InboxDedup.objects.exists()
    assert not models.TaskAttempt.objects.exists()


def test_finished_batches_are_purged_after_retention_and_open_ones_never():
    long_ago = timezone.now() - timedelta(days=9)
    old_finished, recent_finished, old_open = (uuid.uuid4() for _ in range(3))
    models.Batch.objects.create(id=old_finished, sealed=True, finished_at=long_ago)
    models.Batch.objects.create(id=recent_finished, sealed=True, finished_at=timezone.now())
    models.Batch.objects.create(id=old_open, sealed=True, pending=1, total=1)
    models.Batch.objects.filter(id=old_open).update(created_at=long_ago)

    result = maintenance_worker(batch=1).run_once()

    assert result.purged["batch"] == 1
    assert set(models.Batch.objects.values_list("id", flat=True)) == {recent_finished, old_open}
    assert workpump.batch_status(old_finished) is None
    assert workpump.batch_status(old_open).pending == 1


def test_the_retention_settings_are_documented_defaults_and_checked():
    assert DEFAULTS["DEAD_RETENTION_SECONDS"] is None  # opt-in
    assert DEFAULTS["INBOX_DEDUP_RETENTION_SECONDS"] == 30 * DAY
    from django.core import checks

    with override_settings(WORKPUMP={"DEAD_RETENTION_SECONDS": 0}):
        errors = [m for m in checks.run_checks() if m.id and m.id.startswith("workpump.")]
    assert any("DEAD_RETENTION_SECONDS" in m.msg for m in errors), errors


# --- search_path ----------------------------------------------------------------------------


def test_every_function_that_sets_a_search_path_pins_pg_catalog_first_and_pg_temp_last():
    schema = scalar(
        "SELECT n.nspname FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace"
        " WHERE c.relname = 'workpump_outbox'"
    )
    rows = run_sql(
        "SELECT p.proname, c AS config FROM pg_proc p, unnest(p.proconfig) c"
        " WHERE p.pronamespace = 'workpump'::regnamespace AND c LIKE 'search_path=%%'"
    )
    assert rows
    expected = f"search_path=pg_catalog, {schema}, pg_temp"
    wrong = {
        r["proname"]: r["config"]
        for r in rows
        if r["config"] != expected and r["proname"] != "pin_search_path"
    }
    assert wrong == {}, f"run SELECT workpump.pin_search_path() in the migration: {wrong}"


def test_a_temporary_table_cannot_shadow_a_workpump_table():
    run_sql("CREATE TEMPORARY TABLE workpump_eviction (instance_id uuid)")
    run_sql("INSERT INTO pg_temp.workpump_eviction VALUES (%s)", [uuid.uuid4()])
    # record_heartbeat reads workpump_eviction: the real table, not the temporary one
    beat = "SELECT workpump.record_heartbeat(%s, 'tests', 'host', 1)"
    victim = uuid.uuid4()
    run_sql("INSERT INTO pg_temp.workpump_eviction VALUES (%s)", [victim])
    assert scalar(beat, [victim]) is True
