"""workpump.evict_instance: an operator evicts one instance, live or not."""

from __future__ import annotations

import uuid
from datetime import timedelta

import pytest

from tests.helpers import T0, A, B, at, run_sql, scalar

pytestmark = pytest.mark.django_db


def beat(instance: uuid.UUID, when=T0) -> bool:
    return scalar(
        "SELECT workpump.record_heartbeat(%s, 'svc', 'host', 1, p_now => %s)", [instance, when]
    )


def test_evicting_a_live_instance_tombstones_it_and_releases_its_work():
    beat(A)
    beat(B)
    mine = scalar("SELECT workpump.send('x', '{}', 's1')")
    theirs = scalar("SELECT workpump.send('x', '{}', 's2')")
    run_sql("SELECT * FROM workpump.claim_work(%s, p_max_rows => 1, p_now => %s)", [A, T0])
    run_sql("SELECT * FROM workpump.claim_work(%s, p_max_rows => 1, p_now => %s)", [B, T0])
    held_by_a = scalar("SELECT work_id FROM workpump_outbox WHERE instance_id = %s", [A])

    released = scalar("SELECT workpump.evict_instance(%s, 'drained by ops', %s)", [A, at(5)])

    assert released == 1
    assert scalar("SELECT count(*) FROM workpump_service_instance WHERE instance_id = %s", [A]) == 0
    assert scalar("SELECT reason FROM workpump_eviction WHERE instance_id = %s", [A]) == (
        "drained by ops"
    )
    row = run_sql(
        "SELECT instance_id, claimed_at, failure_reason, last_error, attempts "
        "FROM workpump_outbox WHERE work_id = %s",
        [held_by_a],
    )[0]
    assert row["instance_id"] is None
    assert row["claimed_at"] is not None  # the attempt reads as orphaned
    assert row["failure_reason"] == "instance_evicted"
    assert str(A) in row["last_error"] and "drained by ops" in row["last_error"]
    assert row["attempts"] == 1
    assert (
        scalar("SELECT count(*) FROM workpump_active_stream WHERE owner_instance_id = %s", [A]) == 0
    )
    # B keeps its own lease; the evicted instance's heartbeat is refused
    other = {mine, theirs} - {held_by_a}
    assert scalar("SELECT instance_id FROM workpump_outbox WHERE work_id = %s", [other.pop()]) == B
    assert beat(A, at(6)) is False


def test_evicting_twice_or_an_unknown_instance_changes_nothing_more():
    beat(A)
    assert scalar("SELECT workpump.evict_instance(%s)", [A]) == 0
    assert scalar("SELECT workpump.evict_instance(%s)", [A]) == 0
    assert scalar("SELECT count(*) FROM workpump_eviction") == 1
    unknown = uuid.uuid4()
    assert scalar("SELECT workpump.evict_instance(%s)", [unknown]) == 0
    assert scalar("SELECT count(*) FROM workpump_eviction") == 2


def test_evicting_needs_an_instance_id():
    with pytest.raises(Exception, match="evict_instance needs p_instance_id"):
        scalar("SELECT workpump.evict_instance(NULL)")


@pytest.mark.django_db
def test_no_instance_is_evicted_while_the_server_has_just_restarted():
    """A restart drops every alive-lock and pauses every heartbeat: no evidence of death."""
    started = scalar("SELECT pg_postmaster_start_time()")
    beat(A, started - timedelta(minutes=10))  # long silent, and no alive-lock
    # a cutoff before the restart: the server started within the stale window
    assert (
        run_sql(
            "SELECT * FROM workpump.cleanup_stale_instances(%s, NULL, 0, %s)",
            [started - timedelta(seconds=5), started + timedelta(seconds=25)],
        )
        == []
    )
    # once the restart is older than the stale window, the silence counts
    assert run_sql(
        "SELECT * FROM workpump.cleanup_stale_instances(%s, NULL, 0, %s)",
        [started + timedelta(seconds=1), started + timedelta(seconds=31)],
    ) == [{"instance_id": A}]
