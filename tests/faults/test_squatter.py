"""Scenario 10: a role with CONNECT alone squats on the pump's advisory locks.

The squatter holds the next 200 alive-lock keys the sequence will hand out and the
maintenance lock for the whole scenario. Three instances (fast preset) start with every
key they draw taken; kill -9 rounds must fail over as fast as without the squatter (a
lockless instance is evicted only by heartbeat age: 9.8 s on this preset). Then one
instance with a 1 s maintenance interval and no retention must purge the processed rows
although the squatter never lets go of the maintenance lock.
"""

from __future__ import annotations

import uuid

import pytest
from psycopg import sql

from tests.faults import harness
from tests.faults.harness import wait_for
from tests.faults.test_kill import kill_rounds

pytestmark = pytest.mark.faults

ALIVE, MAINTENANCE = 1464877377, 1464877421


@pytest.mark.timeout(600)
def test_a_squatter_on_the_alive_lock_keys_and_the_maintenance_lock_changes_neither_failover_nor_purging(  # noqa: E501
    db, make_fleet
):
    role = f"fx_squatter_{uuid.uuid4().hex[:8]}"
    admin = db.connect()
    admin.execute(sql.SQL("CREATE ROLE {} LOGIN").format(sql.Identifier(role)))
    admin.execute(
        sql.SQL("GRANT CONNECT ON DATABASE {} TO {}").format(
            sql.Identifier(db.name), sql.Identifier(role)
        )
    )
    squat = db.connect(user=role, application_name="fx-squatter")
    try:
        next_key = db.scalar(
            "SELECT CASE WHEN is_called THEN last_value + 1 ELSE last_value END"
            " FROM workpump.alive_lock_key_seq"
        )
        squatted = range(next_key, next_key + 200)
        for key in squatted:
            squat.execute("SELECT pg_advisory_lock(%s, %s)", [ALIVE, key])
        squat.execute("SELECT pg_advisory_lock(%s, 0)", [MAINTENANCE])

        fleet = make_fleet(db, harness.FAST)
        figures = kill_rounds(
            db, fleet, rounds=6 if harness.FULL else 3, seconds=0.2, keep_undone=300,
            failover_timeout=30,
        )  # fmt: skip
        # every instance took its lock, on a key outside the squatted range
        assert "alive-lock of instance" not in fleet.outputs()
        harness.report("squatter-kill9-fast", preset="1s/3s", **figures)
        assert figures["max_s"] <= 5.0, figures

        processed = db.scalar("SELECT count(*) FROM workpump_outbox")
        assert processed > 0
        purger = make_fleet(
            db, {**harness.FAST, "MAINTENANCE_INTERVAL_SECONDS": 1, "RETENTION_SECONDS": 0}
        )
        purger.start(1)
        purged = harness.Stopwatch()
        wait_for(
            lambda: db.scalar("SELECT count(*) FROM workpump_outbox") == 0,
            60,
            "the processed rows to be purged past the squatted maintenance lock",
        )
        harness.report("squatter-purge", outbox_rows=processed, purged_s=purged.seconds())
        assert purger.stop_all() == {purger.pumps[0].pid: 0}
        holders = db.sql(
            "SELECT pid FROM pg_locks WHERE locktype = 'advisory' AND granted AND classid = %s"
            " AND objid = 0 AND database = (SELECT oid FROM pg_database"
            " WHERE datname = current_database())",
            [MAINTENANCE],
        )
        assert holders == [{"pid": squat.info.backend_pid}]  # it held on the whole time
    finally:
        squat.close()
        admin.execute(sql.SQL("DROP OWNED BY {}").format(sql.Identifier(role)))
        admin.execute(sql.SQL("DROP ROLE {}").format(sql.Identifier(role)))
        admin.close()
