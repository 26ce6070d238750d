"""Scenario 4: PostgreSQL is stopped and started mid-run (the suite's own server).

Every instance must come back by itself: reconnect, beat again, LISTEN again (a NOTIFY
after the restart wakes a claimer even with the safety-net poll off) and finish the
backlog with nothing lost. No instance is evicted by the outage, brief or longer than
the stale cutoff.
"""

from __future__ import annotations

import pytest

from tests.faults import harness
from tests.faults.harness import Backlog, Stopwatch, send_outbox, wait_for
from tests.faults.test_connection_blips import listener_pid

pytestmark = pytest.mark.faults

# No safety-net poll: with the gate up, only a NOTIFY (or a freed slot) wakes a claimer.
RESTART = {**harness.FAST, "ENABLE_SAFETY_NET_POLL": False}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("outage", ["brief", "past-the-stale-cutoff"])
def test_a_postgresql_restart_mid_run_is_survived_by_every_instance(
    own_cluster, own_db, make_fleet, outage
):
    db = own_db
    fleet = make_fleet(db, RESTART)
    backlog = Backlog(db, streams=6, seconds=0.1)
    backlog.produce(12)
    pumps = fleet.start(3, "--concurrency", "3")
    wait_for(
        lambda: db.scalar("SELECT count(*) FROM fx_execution WHERE outcome = 'done'") >= 40,
        60,
        "work under way",
    )

    down = Stopwatch()
    own_cluster.stop()
    failed_beats = {p.pid: p.output().count("heartbeat failed") for p in pumps}
    # Brief: start again as soon as every instance saw the outage. Past the stale cutoff:
    # stay down until every instance missed more beats than the cutoff allows.
    missed = 1 if outage == "brief" else RESTART["STALE_AFTER_SECONDS"] + 1
    wait_for(
        lambda: all(
            "NOTIFY connection lost" in p.output()
            and p.output().count("heartbeat failed") - failed_beats[p.pid] >= missed
            for p in pumps
        ),
        60,
        "every instance to notice the outage",
    )
    own_cluster.start()
    outage_s = down.seconds()
    restarted_at = db.now()

    # Every instance beats again (well before the stale cutoff runs out).
    wait_for(
        lambda: (
            db.evicted()
            or db.scalar(
                "SELECT count(*) FROM workpump_service_instance WHERE last_heartbeat_at > %s",
                [restarted_at],
            )
            == len(pumps)
        ),
        10,
        "every instance to beat again",
    )
    assert db.evicted() == {}, f"the outage evicted live instances\n{fleet.outputs()}"

    # Every instance LISTENs again.
    wait_for(lambda: all(listener_pid(db, p) for p in pumps), 60, "every listener to return")
    relisten_s = down.seconds() - outage_s
    # The backlog drains after the restart, and a row sent now is woken by its NOTIFY.
    wait_for(lambda: db.undone() == 0, 40, "the backlog to drain after the restart")
    wait_for(
        # (the first connection is reported by the startup line, not by this line)
        lambda: all(p.output().count("NOTIFY gate available") >= 1 for p in pumps),
        30,
        "every gate to report itself available again",
    )
    sent_at = db.now()
    work_id = send_outbox(db, "fx.outbox", {"n": 0}, stream="after-restart")
    started = wait_for(
        lambda: db.scalar("SELECT min(started_at) FROM fx_execution WHERE work_id = %s", [work_id]),
        10,
        "the row sent after the restart to start",
    )
    wake_s = (started - sent_at).total_seconds()

    assert all(p.alive() for p in pumps), fleet.outputs()
    assert db.evicted() == {}, "the outage evicted a live instance"
    codes = fleet.stop_all()
    assert set(codes.values()) == {0}, fleet.outputs()
    expected = {**backlog.expected, "outbox": backlog.expected["outbox"] + 1}
    verdict = harness.check_invariants(db, expected=expected)
    harness.assert_invariants(verdict, fleet)
    # Only handlers caught by the outage ran again (their own writes failed with it).
    caught = {
        e["work_id"]
        for e in db.executions("started_at < %s AND finished_at IS NULL", [restarted_at])
    }
    assert verdict.rerun_rows <= caught, verdict.reruns
    assert wake_s < 2.0, wake_s
    harness.report(
        f"postgres-restart-{outage}",
        outage_s=outage_s,
        relisten_s=relisten_s,
        notify_wake_s=wake_s,
        evictions=0,
        rows=verdict.rows,
        reruns=len(verdict.rerun_rows),
        lost=0,
    )
