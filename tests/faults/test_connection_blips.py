"""Scenario 3: pg_terminate_backend of the listener connection, and of a worker's
connection, repeatedly.

A killed listener makes the NOTIFY gate unavailable (polling pinned to the tight
interval) until it reconnects; a killed worker connection fails one call, which is
retried on a fresh connection. Neither is a death: no instance is evicted, and the
backlog keeps flowing with nothing lost and nothing run twice.
"""

from __future__ import annotations

import re
import uuid
from typing import Any

import pytest

from tests.faults import harness
from tests.faults.harness import Backlog, Database, Pump, wait_for

pytestmark = pytest.mark.faults

LISTENER = "SELECT pid FROM pg_stat_activity WHERE application_name = %s"
# A worker connection of an instance, found by its role: every connection the pump opens
# is named workpump:<first 8 hex digits of the instance id>:<role>.
WORKER_ROLES = {
    "heartbeat": "heartbeat",
    "claim": "claim",
    "completion": "completions",
    "handler": "handler-%",
}


def listener_pid(db: Database, pump: Pump) -> int | None:
    rows = db.sql(LISTENER, [f"workpump-{pump.instance_id}"])
    return rows[0]["pid"] if rows else None


def worker_pid(db: Database, pump: Pump, kind: str) -> int | None:
    rows = db.sql(
        "SELECT pid FROM pg_stat_activity WHERE datname = current_database()"
        " AND application_name LIKE %(name)s ORDER BY backend_start LIMIT 1",
        {"name": f"workpump:{pump.instance_id.hex[:8]}:{WORKER_ROLES[kind]}"},
    )
    return rows[0]["pid"] if rows else None


def terminate(db: Database, pid: int) -> None:
    assert db.scalar("SELECT pg_terminate_backend(%s)", [pid]), f"backend {pid} not terminated"


def done_since(db: Database, instance: uuid.UUID, since: Any) -> int:
    return int(
        db.scalar(
            "SELECT count(*) FROM fx_execution WHERE instance_id = %s AND finished_at > %s"
            " AND outcome = 'done'",
            [instance, since],
        )
    )


def finish(db: Database, fleet: harness.Fleet, backlog: Backlog) -> harness.Verdict:
    wait_for(lambda: db.undone() == 0, 120, "the backlog to drain")
    codes = fleet.stop_all()
    assert set(codes.values()) == {0}, fleet.outputs()
    verdict = harness.check_invariants(db, expected=backlog.expected)
    harness.assert_invariants(verdict, fleet)
    return verdict


@pytest.mark.timeout(300)
def test_listener_kills_take_the_gate_down_and_back_and_evict_no_one(db, make_fleet):
    fleet = make_fleet(db, harness.FAST)
    backlog = Backlog(db, streams=8, seconds=0.1)
    backlog.produce(30)
    pumps = fleet.start(3, "--concurrency", "3")
    kills = 0
    reconnects: list[float] = []
    for pump in pumps * (3 if harness.FULL else 1):
        # A burst: kill the listener each time it comes back, so the gate stays down.
        for _ in range(4):
            pid = wait_for(lambda pump=pump: listener_pid(db, pump), 30, "a listener")
            since = db.now()
            terminate(db, pid)
            kills += 1
            back = wait_for(
                lambda pump=pump, pid=pid: listener_pid(db, pump) not in (None, pid),
                30,
                "the listener to reconnect",
            )
            assert back
            reconnects.append((db.now() - since).total_seconds())
        # Work goes on after the burst: fresh work, so an instance that was being
        # knocked off its listener still takes its share (the rest may be drained).
        backlog.produce(6)
        wait_for(lambda pump=pump, since=since: done_since(db, pump.instance_id, since), 30,
                 "the instance to finish work after the burst")  # fmt: skip
    outputs = [pump.output() for pump in pumps]
    verdict = finish(db, fleet, backlog)

    assert db.evicted() == {}, "a connection blip evicted an instance"
    assert not verdict.reruns, verdict.reruns
    for output in outputs:
        assert "NOTIFY gate unavailable" in output
        assert "running a catch-up claim" in output
        # While the gate was down the claimer polled at the tight interval.
        down = re.findall(r"gate=DOWN .*poll_wait_ms=(\d+)", output)
        assert down and set(down) == {str(harness.FAST["POLLING_INTERVAL_MS"])}, down
    harness.report(
        "listener-kills",
        kills=kills,
        reconnect_s_max=max(reconnects),
        evictions=0,
        rows=verdict.rows,
        reruns=0,
        lost=0,
    )


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "kind",
    [
        "heartbeat",
        "claim",
        "completion",
        "handler",
    ],
)
def test_a_killed_worker_connection_is_replaced_and_evicts_no_one(db, make_fleet, kind):
    """Persistent Django connections (CONN_MAX_AGE=None), as production often runs."""
    fleet = make_fleet(db, harness.FAST, env={"FAULTS_CONN_MAX_AGE": "none"})
    backlog = Backlog(db, streams=8, seconds=0.3, effect=True)
    backlog.produce(12)
    pumps = fleet.start(2, "--concurrency", "3")
    victim = pumps[0]
    rounds = 3 if harness.FULL else 2
    for _ in range(rounds):
        pid = wait_for(lambda: worker_pid(db, victim, kind), 30, f"the {kind} connection")
        since = db.now()
        terminate(db, pid)
        # The instance goes on: it beats, claims and completes on a fresh connection.
        wait_for(
            lambda since=since: db.scalar(
                "SELECT last_heartbeat_at > %s FROM workpump_service_instance"
                " WHERE instance_id = %s",
                [since, victim.instance_id],
            ),
            8,
            "a heartbeat after the kill",
        )
        wait_for(
            lambda since=since: (
                db.scalar(
                    "SELECT count(*) FROM workpump_outbox WHERE done_at > %s"
                    " AND result->>'instance' = %s",
                    [since, str(victim.instance_id)],
                )
                >= 2
            ),
            15,
            "the instance to complete work after the kill",
        )
        if db.undone() < 100:
            backlog.produce(10)
    verdict = finish(db, fleet, backlog)
    assert db.evicted() == {}, "a killed connection evicted a live instance"
    # Only the attempt whose connection was killed under it failed and ran again.
    assert set(verdict.reruns) <= set(), verdict.reruns
    harness.report(f"worker-conn-kill-{kind}", kills=rounds, evictions=0, rows=verdict.rows, lost=0)


# The default ratios, scaled down: the slow cadence (used while the alive-lock is held)
# outlasts the stale cutoff, as 60 s does 30 s at the defaults.
SLOW_BEAT = {
    **harness.FAST,
    "HEARTBEAT_SLOW_INTERVAL_SECONDS": 6,
    "DEFINITIVELY_DEAD_AFTER_SECONDS": 30,
}


@pytest.mark.timeout(300)
def test_a_listener_blip_evicts_no_one_when_the_slow_beat_outlasts_the_stale_cutoff(db, make_fleet):
    fleet = make_fleet(db, SLOW_BEAT)
    backlog = Backlog(db, streams=8, seconds=0.1)
    backlog.produce(20)
    pumps = fleet.start(3, "--concurrency", "3")
    stale = SLOW_BEAT["STALE_AFTER_SECONDS"]
    blips = 0
    for pump in pumps * 2:
        if not pump.alive():
            continue
        # Kill the listener while the instance relies on its alive-lock: its last beat is
        # older than the stale cutoff, which is fine as long as the lock is held.
        wait_for(
            lambda pump=pump: db.scalar(
                "SELECT now() - last_heartbeat_at > make_interval(secs => %s)"
                " FROM workpump_service_instance WHERE instance_id = %s",
                [stale + 0.5, pump.instance_id],
            ),
            30,
            "a heartbeat older than the stale cutoff under a held alive-lock",
        )
        pid = listener_pid(db, pump)
        assert pid is not None
        terminate(db, pid)
        blips += 1
        wait_for(
            lambda pump=pump, pid=pid: (
                listener_pid(db, pump) not in (None, pid) or pump.instance_id in db.evicted()
            ),
            30,
            "the listener to reconnect",
        )
        # Give the peers' stale probes (every second) their chance.
        wait_for(
            lambda pump=pump: (
                pump.instance_id in db.evicted()
                or db.scalar(
                    "SELECT now() - last_heartbeat_at < make_interval(secs => 1)"
                    " FROM workpump_service_instance WHERE instance_id = %s",
                    [pump.instance_id],
                )
            ),
            30,
            "a fresh heartbeat or an eviction",
        )
        assert db.evicted() == {}, f"a listener blip evicted a live instance after {blips}"
    verdict = finish(db, fleet, backlog)
    harness.report("listener-kill-slow-beat", blips=blips, evictions=0, rows=verdict.rows)
