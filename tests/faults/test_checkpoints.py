"""Checkpointed steps under a kill -9: an interrupted import resumes at its last step.

R outbox rows (``fx.steps``) each run S steps, checkpointing after every step
(``work.checkpoint``), on three ``runworkpump`` processes. Once a third of the steps
ran, the instance running the most rows is killed. When everything drained: every row is
done and every step of it ran; each row the kill cut short was resumed by its next
attempt at the step its last checkpoint named, so no step ran more than twice and only
the step in progress at the kill ran twice.
"""

from __future__ import annotations

import json
from collections import Counter, defaultdict
from typing import Any

import pytest

from tests.faults import harness
from tests.faults.harness import Database, Stopwatch, wait_for

pytestmark = pytest.mark.faults

ROWS, STEPS = (60, 100) if harness.FULL else (12, 40)
STEP_SECONDS = 0.02


def produce(db: Database) -> list[Any]:
    with db.connect() as conn, conn.transaction():
        return [
            conn.execute(
                "SELECT workpump.send('fx.steps', %s::jsonb) AS id",
                [json.dumps({"n": n, "steps": STEPS, "seconds": STEP_SECONDS})],
            ).fetchone()["id"]
            for n in range(ROWS)
        ]


@pytest.mark.timeout(1800 if harness.FULL else 300)
def test_an_import_cut_short_by_a_kill_resumes_at_its_last_checkpoint(db, make_fleet):
    ids = produce(db)
    fleet = make_fleet(db, harness.FAST)
    fleet.start(3, "--concurrency", "2")
    run = Stopwatch()

    def busiest() -> harness.Pump | None:
        if db.scalar("SELECT count(*) FROM fx_step") < ROWS * STEPS // 3:
            return None
        running = {
            r["pid"]: r["n"]
            for r in db.sql(
                "SELECT pid, count(*) AS n FROM fx_execution WHERE finished_at IS NULL GROUP BY pid"
            )
        }
        alive = [pump for pump in fleet.alive() if running.get(pump.pid)]
        return max(alive, key=lambda pump: running[pump.pid]) if alive else None

    victim = wait_for(busiest, 120, "an instance running imports")
    victim.kill9()
    killed_after_s = run.seconds()
    wait_for(lambda: db.undone() == 0, 600 if harness.FULL else 180, "the imports to drain")
    drain_s = run.seconds()
    codes = fleet.stop_all()
    assert set(codes.values()) == {0}, fleet.outputs()

    verdict = harness.check_invariants(db, expected={"outbox": ROWS}, killed=fleet.killed)
    harness.assert_invariants(verdict, fleet)
    assert verdict.done == ROWS

    steps: dict[Any, list[dict[str, Any]]] = defaultdict(list)
    for r in db.sql("SELECT * FROM fx_step ORDER BY started_at"):
        steps[r["work_id"]].append(r)
    victim_pid = victim.pid
    resumed = 0
    for work_id in ids:
        ran = Counter(r["step"] for r in steps[work_id])
        assert set(ran) == set(range(STEPS)), work_id  # every step ran
        twice = [step for step, times in ran.items() if times > 1]
        assert len(twice) <= 1 and all(ran[step] == 2 for step in twice), ran
        attempts = sorted({r["attempt"] for r in steps[work_id]})
        if len(attempts) == 1:
            assert not twice
            continue
        # cut short by the kill, then resumed where its checkpoint said
        first, *later = attempts
        killed = [r for r in steps[work_id] if r["attempt"] == first]
        assert {r["pid"] for r in killed} == {victim_pid}
        resumed_at = min(r["step"] for r in steps[work_id] if r["attempt"] == later[0])
        assert resumed_at in (max(r["step"] for r in killed), max(r["step"] for r in killed) + 1)
        resumed += resumed_at > 0
    assert resumed >= 1  # the kill cut at least one import short mid-way

    harness.report(
        "checkpoints",
        rows=ROWS,
        steps=STEPS,
        kill_at_s=killed_after_s,
        resumed=resumed,
        steps_run=sum(len(v) for v in steps.values()),
        reruns=len(verdict.rerun_rows),
        drain_s=drain_s,
    )
