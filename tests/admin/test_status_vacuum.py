"""The vacuum part of the status report: each work table's live and dead row versions,
VACUUM's last pass over it, whether autovacuum may run on it, and the session holding
the oldest snapshot; in ``workpump_status`` (text and --json) and the admin summary.

Row-version counts come from PostgreSQL's statistics, which a backend reports when it is
idle, before it answers that it is ready: the writes here commit (a transactional test),
and the writer asks that its next report be made whatever its interval
(``pg_stat_force_next_flush``), so the counts are in place when that call returns. VACUUM
reports its own at once.
"""

from __future__ import annotations

import dataclasses
import io
import json

import pytest
from django.core.management import call_command

from django_workpump import status
from django_workpump.management.commands.workpump_status import render_text
from django_workpump.models import Outbox
from tests import factories
from tests.helpers import run_sql, scalar

TABLES = [
    "workpump_outbox",
    "workpump_inbox",
    "workpump_perspective_event",
    "workpump_receptor_processing",
]


@pytest.mark.django_db(transaction=True)
def test_dead_versions_are_counted_per_work_table_until_vacuum_removes_them(raw_connect):
    rows = factories.OutboxFactory.create_batch(40)
    Outbox.objects.filter(pk__in=[row.pk for row in rows[:30]]).delete()
    run_sql("SELECT pg_stat_force_next_flush()")

    tables = status.vacuum_health().tables

    assert [t.table_name for t in tables] == TABLES
    outbox = tables[0]
    assert outbox.category == "outbox"
    # at least: a backend of an earlier test may still report rows of its own
    assert outbox.dead_versions >= 30
    assert outbox.live_versions >= 10

    raw_connect().execute("VACUUM workpump_outbox")
    outbox = status.vacuum_health().tables[0]

    assert outbox.dead_versions == 0
    assert outbox.live_versions >= 10
    assert outbox.vacuum_age_seconds is not None
    assert 0 <= outbox.vacuum_age_seconds < 60


@pytest.mark.django_db(transaction=True)
def test_autovacuum_shows_off_for_a_table_that_turned_it_off(raw_connect):
    server_on = scalar("SELECT current_setting('autovacuum')::boolean")
    admin = raw_connect()
    admin.execute("ALTER TABLE workpump_inbox SET (autovacuum_enabled = false)")
    try:
        tables = {t.table_name: t for t in status.vacuum_health().tables}
    finally:
        admin.execute("ALTER TABLE workpump_inbox RESET (autovacuum_enabled)")

    assert tables["workpump_inbox"].autovacuum is False
    assert tables["workpump_outbox"].autovacuum is server_on
    assert {t.table_name: t.autovacuum for t in status.vacuum_health().tables} == dict.fromkeys(
        TABLES, server_on
    )


@pytest.mark.django_db(transaction=True)  # each read its own transaction: a fresh view
def test_the_oldest_snapshot_names_the_session_that_holds_vacuum_back(raw_connect):
    holder = raw_connect(application_name="nightly-report")
    holder.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
    holder.execute("SELECT count(*) FROM workpump_outbox")  # takes the snapshot

    snapshot = status.vacuum_health().oldest_snapshot

    assert snapshot is not None
    assert snapshot.pid == holder.info.backend_pid
    assert snapshot.application_name == "nightly-report"
    assert snapshot.state == "idle in transaction"
    assert snapshot.role_name == scalar("SELECT current_user")
    assert snapshot.open_seconds is not None and snapshot.open_seconds > 0

    out = io.StringIO()
    call_command("workpump_status", stdout=out)
    text = out.getvalue()
    assert (
        f"oldest snapshot: pid {holder.info.backend_pid} (role {snapshot.role_name}, "
        "application 'nightly-report', idle in transaction), its transaction open for "
    ) in text

    out = io.StringIO()
    call_command("workpump_status", "--json", stdout=out)
    data = json.loads(out.getvalue())["vacuum"]
    assert data["oldest_snapshot"]["pid"] == holder.info.backend_pid
    assert [t["table_name"] for t in data["tables"]] == TABLES

    holder.execute("ROLLBACK")
    assert status.vacuum_health().oldest_snapshot is None


@pytest.mark.django_db
def test_no_other_session_holding_a_snapshot_reports_none():
    vacuum = status.vacuum_health()

    assert vacuum.oldest_snapshot is None
    assert [t.table_name for t in vacuum.tables] == TABLES


@pytest.mark.parametrize(
    ("live", "dead", "behind"),
    [
        (0, status.VACUUM_BEHIND_MIN_DEAD, True),
        (0, status.VACUUM_BEHIND_MIN_DEAD - 1, False),  # too few to matter
        (50_000, 50_000, False),  # no more dead than live
        (50_000, 50_001, True),
    ],
)
def test_a_table_is_behind_with_more_dead_versions_than_live_ones_and_enough_of_them(
    live, dead, behind
):
    table = status.TableVacuum("outbox", "workpump_outbox", live, dead, None, True)
    assert table.behind is behind


@pytest.mark.django_db
def test_the_text_report_names_the_fix_for_a_table_vacuum_is_behind_on():
    report = status.collect()
    tables = [
        status.TableVacuum("outbox", "workpump_outbox", 1_000, 250_000, 7_200.0, False),
        status.TableVacuum("inbox", "workpump_inbox", 1_000, 250_000, None, True),
        status.TableVacuum("receptor", "workpump_receptor_processing", 9, 3, 5.0, True),
    ]
    report = dataclasses.replace(report, vacuum=status.VacuumHealth(tables, None))

    text = "\n".join(render_text(report))

    assert (
        "VACUUM is behind on workpump_outbox: 250,000 dead row versions against 1,000 live," in text
    )
    assert "run VACUUM (ANALYZE) workpump_outbox, or turn it on." in text
    assert "VACUUM is behind on workpump_inbox" in text
    assert "if the oldest snapshot below is old, it holds VACUUM back." in text
    assert "VACUUM is behind on workpump_receptor_processing" not in text
    assert "2h 0m ago" in text and "never" in text and "OFF" in text
    assert "oldest snapshot:" not in text
