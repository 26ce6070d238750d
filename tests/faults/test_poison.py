"""Scenario 6: poison and hung work.

A message whose handler kills its own process is claimed MAX_ATTEMPTS times (3 for
``fx.poison``), each time taking an instance down, then parked as dead while the rest of
the backlog flows. A handler that hangs past its renewal cap is abandoned: the attempt
fails with reason ``lease_expired``, the row is claimed again with attempts + 1, and the
hung thread's late completion is fenced out, even when the same instance re-claimed it.
"""

from __future__ import annotations

import pytest

from tests.faults import harness
from tests.faults.harness import Backlog, send_outbox, wait_for

pytestmark = pytest.mark.faults


@pytest.mark.timeout(300)
def test_a_message_that_kills_its_process_is_parked_after_max_attempts(db, make_fleet):
    fleet = make_fleet(db, harness.FAST)
    poison = send_outbox(db, "fx.poison", {"n": 0, "exit": True}, stream="poison", max_attempts=3)
    backlog = Backlog(db, streams=6, seconds=0.05)
    backlog.produce(20)
    fleet.start(2, "--concurrency", "3")
    deaths = 0

    def poison_dead_or_a_death() -> bool:
        nonlocal deaths
        for pump in fleet.pumps:
            if not pump.alive() and pump.instance_id not in fleet.killed:
                assert pump.popen.returncode == 70, pump.output()
                fleet.killed[pump.instance_id] = db.now()  # it killed itself
                deaths += 1
                fleet.spawn("--concurrency", "3")  # what a process supervisor does
        return bool(
            db.scalar(
                "SELECT dead_lettered_at IS NOT NULL FROM workpump_outbox WHERE work_id = %s",
                [poison],
            )
        )

    wait_for(poison_dead_or_a_death, 120, "the poison message to be parked")
    wait_for(lambda: db.undone() == 0, 120, "the rest of the backlog to drain")
    poison_dead_or_a_death()  # count a death that came with the parking
    codes = fleet.stop_all()
    assert set(codes.values()) == {0}, fleet.outputs()

    row = db.sql("SELECT * FROM workpump_outbox WHERE work_id = %s", [poison])[0]
    assert row["attempts"] == 3
    assert row["failure_reason"] == "max_attempts"
    assert "ended without a reported outcome" in row["last_error"]
    runs = db.executions("work_id = %s", [poison])
    assert [e["attempt"] for e in runs] == [1, 2, 3]
    assert deaths == 3
    expected = {**backlog.expected, "outbox": backlog.expected["outbox"] + 1}
    verdict = harness.check_invariants(
        db, expected=expected, killed=fleet.killed, allow_dead={poison}
    )
    harness.assert_invariants(verdict, fleet)
    assert set(verdict.reruns) <= {"kill"}, verdict.reruns
    harness.report(
        "poison-os-exit",
        claims=row["attempts"],
        process_deaths=deaths,
        dead=verdict.dead,
        rows=verdict.rows,
        reruns=len(verdict.rerun_rows),
        lost=0,
    )


# A 6 s lease, 2 s of it grace, one renewal: a dispatch is abandoned about 6.7 s in.
HUNG = {
    **harness.FAST,
    "LEASE_SECONDS": 6,
    "LEASE_GRACE_SECONDS": 2,
    "MAX_RENEWALS_PER_WORK": 1,
}
HANG_SECONDS = 10  # attempt 1 hangs this long, so it finishes while attempt 2 runs
SECOND_SECONDS = 5  # attempt 2's work (it fits in its lease with its one renewal)


def run_hung(db, make_fleet, destination: str) -> tuple[dict, list[dict], harness.Pump]:
    """One instance, so the abandoned row is re-claimed by the very instance that hangs."""
    fleet = make_fleet(db, HUNG)
    work_id = send_outbox(
        db,
        destination,
        {"n": 0, "hang_seconds": HANG_SECONDS, "hang_attempts": 1, "seconds": SECOND_SECONDS,
         "effect": True},
        stream="hung",
    )  # fmt: skip
    pump = fleet.start(1, "--concurrency", "2")[0]
    # Attempt 1's thread finishes (late) and attempt 2 completes the row.
    wait_for(
        lambda: (
            db.scalar(
                "SELECT count(*) FROM fx_execution WHERE work_id = %s AND finished_at IS NOT NULL",
                [work_id],
            )
            == 2
            and db.scalar(
                "SELECT done_at IS NOT NULL FROM workpump_outbox WHERE work_id = %s",
                [work_id],
            )
        ),
        60,
        "both attempts to finish",
    )
    assert set(fleet.stop_all().values()) == {0}, fleet.outputs()
    row = db.sql("SELECT * FROM workpump_outbox WHERE work_id = %s", [work_id])[0]
    runs = db.executions("work_id = %s", [work_id])
    return row, runs, pump


def check_hung(row: dict, runs: list[dict], pump: harness.Pump) -> None:
    first, second = runs
    # The hung attempt surfaced as a failure and the row was claimed again, attempts + 1.
    assert (first["attempt"], second["attempt"], row["attempts"]) == (1, 2, 2)
    assert row["failure_reason"] == "lease_expired"
    assert "abandoned" in row["last_error"]
    output = pump.output()
    assert "still running at its lease deadline: abandoned" in output
    # Attempt 1 finished while attempt 2 held the row: its completion must not count.
    assert second["started_at"] < first["finished_at"] < second["finished_at"]
    assert row["result"]["attempt"] == 2, row["result"]
    # (an atomic completion is stamped with its transaction's now(): the attempt's start)
    assert row["done_at"] >= second["started_at"]


@pytest.mark.timeout(120)
def test_a_hung_handler_is_abandoned_reclaimed_and_its_late_completion_fenced_out(db, make_fleet):
    row, runs, pump = run_hung(db, make_fleet, "fx.outbox")
    check_hung(row, runs, pump)
    assert "finished late; its outcome is dropped" in pump.output()
    harness.report(
        "hung-handler",
        attempts=row["attempts"],
        abandoned_after_s=(runs[1]["started_at"] - runs[0]["started_at"]).total_seconds(),
        late_completion="fenced",
    )


@pytest.mark.timeout(120)
def test_a_hung_atomic_handler_cannot_commit_after_it_was_abandoned(db, make_fleet):
    row, runs, pump = run_hung(db, make_fleet, "fx.atomic")
    check_hung(row, runs, pump)
    # Database effects happen exactly once: those of the attempt that held the lease.
    effects = db.sql("SELECT attempt FROM fx_effect WHERE work_id = %s", [row["work_id"]])
    assert [e["attempt"] for e in effects] == [2]
