"""Scenario 1: kill -9 of one of three instances mid-run, repeated over several rounds.

Each round waits a random while (so kills land at random points of the heartbeat and
probe cycles), kills the instance that is running handlers, measures the failover time
(the kill to the first start elsewhere of a row the victim held) and starts a
replacement. At the end every row is done, per-stream order held, and every second
execution belongs to a row the victim held at its kill.
"""

from __future__ import annotations

import random
import threading
import uuid
from typing import Any

import pytest

from tests.faults import harness
from tests.faults.harness import Backlog, Database, wait_for

pytestmark = pytest.mark.faults


def kill_rounds(
    db: Database,
    fleet: harness.Fleet,
    *,
    rounds: int,
    seconds: float,
    keep_undone: int,
    failover_timeout: float,
    kill_spread: float = 0.0,
) -> dict[str, Any]:
    backlog = Backlog(db, streams=12, seconds=seconds)
    steps = max(1, keep_undone // (backlog.streams * 4))
    backlog.produce(steps)
    fleet.start(3, "--concurrency", "3")
    failovers: list[float] = []
    in_flight: set[uuid.UUID] = set()
    interrupted: set[uuid.UUID] = set()
    rng = random.Random()
    pause = threading.Event()  # never set: waits out the random offset of each kill
    for _ in harness.iter_rounds(rounds):
        pause.wait(rng.uniform(0, kill_spread))
        if db.undone() < keep_undone:
            backlog.produce(steps)

        def busy_pump() -> harness.Pump | None:
            for pump in fleet.alive():
                running = db.scalar(
                    "SELECT count(*) FROM fx_execution WHERE pid = %s AND finished_at IS NULL",
                    [pump.pid],
                )
                if running:
                    return pump
            return None

        victim = wait_for(busy_pump, 60, "an instance running handlers")
        instance = victim.instance_id
        killed_at = victim.kill9()
        # Eviction waits for the stale cutoff, so the rows are still leased to the victim.
        held = db.held_by(instance)
        assert held, "the victim held nothing at its kill"
        assert instance not in db.evicted(), "evicted before its leases were read"
        in_flight |= held
        interrupted |= {
            e["work_id"] for e in db.executions("pid = %s AND finished_at IS NULL", [victim.pid])
        }
        first = wait_for(
            lambda args=[victim.pid, list(held), killed_at]: db.scalar(
                "SELECT min(started_at) FROM fx_execution "
                "WHERE pid <> %s AND work_id = ANY(%s) AND started_at > %s",
                args,
            ),
            failover_timeout,
            "a row of the killed instance to start elsewhere",
        )
        failovers.append((first - killed_at).total_seconds())
        fleet.spawn("--concurrency", "3").wait_started()

    wait_for(lambda: db.undone() == 0, 300, "the backlog to drain")
    codes = fleet.stop_all()
    assert set(codes.values()) == {0}, fleet.outputs()

    verdict = harness.check_invariants(db, expected=backlog.expected, killed=fleet.killed)
    harness.assert_invariants(verdict, fleet)
    assert set(verdict.reruns) <= {"kill"}, verdict.reruns
    # A second execution only for rows the victim held at its kill, and every handler the
    # kill interrupted did run again.
    assert verdict.rerun_rows <= in_flight
    assert interrupted <= verdict.rerun_rows
    # Only the victims were evicted; the survivors deregistered on SIGTERM.
    assert set(db.evicted()) == set(fleet.killed)
    assert db.scalar("SELECT count(*) FROM workpump_service_instance") == 0
    return {
        "rounds": rounds,
        "failover_s": failovers,
        "p50_s": harness.percentile(failovers, 50),
        "p99_s": harness.percentile(failovers, 99),
        "max_s": max(failovers),
        "rows": verdict.rows,
        "executions": verdict.executions,
        "in_flight_at_kills": len(in_flight),
        "reruns": len(verdict.rerun_rows),
        "lost": 0,
    }


@pytest.mark.timeout(600)
def test_kill_9_fails_over_within_5_s_on_the_fast_preset_and_loses_nothing(db, make_fleet):
    fleet = make_fleet(db, harness.FAST)
    figures = kill_rounds(
        db,
        fleet,
        rounds=8 if harness.FULL else 3,
        seconds=0.2,
        keep_undone=300,
        failover_timeout=30,
    )
    harness.report("kill9-fast", preset="1s/3s", **figures)
    assert figures["max_s"] <= 5.0, figures


@pytest.mark.timeout(1800)
@pytest.mark.skipif(not harness.FULL, reason="full mode only (WORKPUMP_FAULTS_FULL=1)")
def test_kill_9_fails_over_within_15_s_at_the_default_timing(db, make_fleet):
    # Defaults: 10 s fast beat (the lock-loss grace), 60 s slow beat, 30 s stale cutoff,
    # 5 s probe. A victim dies holding its alive-lock, so the bound is probe + grace + a
    # claim the orphan NOTIFY starts at once, whatever the age of its last heartbeat.
    fleet = make_fleet(db, harness.DEFAULT_TIMING)
    figures = kill_rounds(
        db,
        fleet,
        rounds=10,
        seconds=1.0,
        keep_undone=500,
        failover_timeout=120,
        kill_spread=60.0,  # one slow heartbeat cycle
    )
    harness.report("kill9-defaults", preset="10s/60s/30s", **figures)
    assert figures["p99_s"] <= 15.0, figures
