"""Batch callbacks under a kill -9: one callback per batch, never two, never none.

B batches of M outbox members each (no stream; every tenth member fails once, and every
other batch has members that end dead) are drained by four ``runworkpump`` processes.
Once a quarter of the batches finished, the instance running a callback handler is
killed. When everything drained: each batch finished with its counts summing to M,
each has exactly one callback row (``on_failure`` where a member ended dead, else
``on_complete``), whose payload counts sum to M, and each callback ran to done once;
a callback runs a second time only when the kill cut its attempt short.

The producer does what ``with workpump.batch(...)`` with ``send_many`` inside does, in
SQL: open_batch, send_many(p_batch_id), seal_batch, in one transaction per batch.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from typing import Any

import pytest
from psycopg.types.json import Jsonb

from tests.faults import harness
from tests.faults.harness import Database, Stopwatch, wait_for

pytestmark = pytest.mark.faults

# The target in full mode; CI mode stays within ~40 s on a small machine.
BATCHES, MEMBERS = (100, 1000) if harness.FULL else (20, 200)
DEAD = 2  # members that end dead, in every other batch
CALLBACKS = ["fx.batch_done", "fx.batch_failed"]
# Callbacks run ahead of the members still queued, and long enough to be killed mid-run.
CALLBACK_PAYLOAD = {"seconds": 1.0}
CALLBACK_OPTIONS = {"priority": 10}


def produce(db: Database, batches: int, members: int) -> dict[str, set[Any]]:
    """Open, fill and seal the batches; return the batch ids that expect dead members
    and the ids of those members."""
    expected: dict[str, set[Any]] = {"failing": set(), "dead": set()}
    with db.connect() as conn:
        for b in range(batches):
            dead = DEAD if b % 2 == 0 else 0
            spec = {"payload": {**CALLBACK_PAYLOAD, "k": b}, **CALLBACK_OPTIONS}
            on_complete, on_failure = (Jsonb({"topic": topic, **spec}) for topic in CALLBACKS)
            with conn.transaction():
                batch_id = conn.execute(
                    "SELECT workpump.open_batch(%s, %s) AS id",
                    [on_complete, on_failure],
                ).fetchone()["id"]
                healthy = [
                    Jsonb({"k": b, "n": n, **({"flaky": 1} if n % 10 == 5 else {})})
                    for n in range(members - dead)
                ]
                conn.execute(
                    "SELECT workpump.send_many('fx.outbox', %s::jsonb[], p_batch_id => %s)",
                    [healthy, batch_id],
                )
                if dead:
                    ids = conn.execute(
                        "SELECT workpump.send_many('fx.outbox', %s::jsonb[], p_max_attempts => 2,"
                        " p_batch_id => %s) AS ids",
                        [
                            [Jsonb({"k": b, "n": n, "fail": True})
                             for n in range(members - dead, members)],
                            batch_id,
                        ],
                    ).fetchone()["ids"]  # fmt: skip
                    expected["failing"].add(batch_id)
                    expected["dead"].update(ids)
                conn.execute("SELECT workpump.seal_batch(%s)", [batch_id])
    return expected


def finished_batches(db: Database) -> int:
    return int(db.scalar("SELECT count(*) FROM workpump_batch WHERE finished_at IS NOT NULL"))


@pytest.mark.timeout(3600 if harness.FULL else 300)
def test_each_batch_calls_back_exactly_once_when_an_instance_is_killed(db, make_fleet):
    produce_time = Stopwatch()
    expected = produce(db, BATCHES, MEMBERS)
    produced_s = produce_time.seconds()
    fleet = make_fleet(db, harness.FAST)
    fleet.start(4, "--concurrency", "3")
    run = Stopwatch()

    def callback_runner() -> harness.Pump | None:
        # Kill mid-run: a quarter of the batches finished (their callbacks run), the rest not.
        finished = finished_batches(db)
        if finished >= BATCHES:
            raise AssertionError("every batch finished before an instance could be killed")
        if finished < BATCHES // 4:
            return None
        for pump in fleet.alive():
            if db.scalar(
                "SELECT count(*) FROM fx_execution "
                "WHERE pid = %s AND finished_at IS NULL AND topic = ANY(%s)",
                [pump.pid, CALLBACKS],
            ):
                return pump
        return None

    victim = wait_for(callback_runner, 600, "an instance running a batch callback")
    victim.kill9()
    killed_after_s = run.seconds()
    finished_at_kill = finished_batches(db)
    interrupted = db.executions("pid = %s AND finished_at IS NULL", [victim.pid])
    assert 0 < finished_at_kill < BATCHES, finished_at_kill
    assert any(e["topic"] in CALLBACKS for e in interrupted), interrupted

    wait_for(
        lambda: db.undone() == 0 and finished_batches(db) == BATCHES,
        3000 if harness.FULL else 180,
        "the batches and their callbacks to drain",
    )
    drain_s = run.seconds()
    codes = fleet.stop_all()
    assert set(codes.values()) == {0}, fleet.outputs()

    # Every batch finished once, its counts summing to its members.
    batches = {str(row["id"]): row for row in db.sql("SELECT * FROM workpump_batch")}
    assert len(batches) == BATCHES
    for batch in batches.values():
        dead = DEAD if batch["id"] in expected["failing"] else 0
        outcomes = {k: batch[k] for k in ("done", "dead", "discarded", "cancelled")}
        assert batch["finished_at"] is not None and batch["pending"] == 0, batch
        assert batch["total"] == sum(outcomes.values()) == MEMBERS, batch
        assert outcomes == {"done": MEMBERS - dead, "dead": dead, "discarded": 0, "cancelled": 0}
        assert batch["callback_error"] is None and batch["callback_id"] is not None, batch

    # Exactly one callback row per batch: none missing, none duplicated.
    callbacks = db.sql(
        "SELECT work_id, topic, payload, done_at, attempts FROM workpump_outbox "
        "WHERE topic = ANY(%s)",
        [CALLBACKS],
    )
    per_batch = Counter(row["payload"]["batch"]["id"] for row in callbacks)
    duplicates = sum(n - 1 for n in per_batch.values())
    assert per_batch == dict.fromkeys(batches, 1), per_batch
    for row in callbacks:
        batch = batches[row["payload"]["batch"]["id"]]
        counts = row["payload"]["batch"]
        assert row["work_id"] == batch["callback_id"]
        assert row["done_at"] is not None, row
        assert row["topic"] == CALLBACKS[batch["id"] in expected["failing"]], row
        assert counts["total"] == MEMBERS, counts
        assert sum(counts[k] for k in ("done", "dead", "discarded", "cancelled")) == MEMBERS
        assert {k: counts[k] for k in ("done", "dead")} == {k: batch[k] for k in ("done", "dead")}

    # Each callback ran to done once; any other run of it is an attempt cut short by the
    # kill, or by the eviction of an instance whose heartbeat the loaded machine delayed
    # past the stale cutoff (its late outcome fenced out), and every run got the counts of
    # its row.
    evicted = db.evicted()
    runs: dict[Any, list[dict[str, Any]]] = defaultdict(list)
    for e in db.executions("topic = ANY(%s)", [CALLBACKS]):
        runs[e["work_id"]].append(e)
    seen: dict[Any, list[dict[str, Any]]] = defaultdict(list)
    for r in db.sql("SELECT work_id, payload FROM fx_callback"):
        seen[r["work_id"]].append(r["payload"])
    for row in callbacks:
        mine = runs[row["work_id"]]
        completing = [e for e in mine if e["attempt"] == row["attempts"]]
        assert len(completing) == 1 and completing[0]["outcome"] == "done", mine
        others = [e for e in mine if e is not completing[0]]
        assert all(
            harness.explain(e, fleet.killed, evicted, local_lease_seconds=270)
            in ("kill", "eviction")
            for e in others
        ), mine
        assert seen[row["work_id"]] == [row["payload"]] * len(mine), seen[row["work_id"]]
    callback_reruns = sum(len(mine) - 1 for mine in runs.values())

    verdict = harness.check_invariants(
        db,
        expected={"outbox": BATCHES * MEMBERS + BATCHES},
        killed=fleet.killed,
        allow_dead=expected["dead"],
    )
    harness.assert_invariants(verdict, fleet)
    assert verdict.dead == len(expected["dead"])
    assert set(verdict.reruns) <= {"kill"}, verdict.reruns
    assert {e["work_id"] for e in interrupted} <= verdict.rerun_rows

    harness.report(
        "batch-callbacks",
        batches=BATCHES,
        members=MEMBERS,
        rows=verdict.rows,
        callbacks=len(callbacks),
        duplicates=duplicates,
        missing=BATCHES - len(per_batch),
        dead=verdict.dead,
        executions=verdict.executions,
        produce_s=produced_s,
        kill_at_s=killed_after_s,
        finished_at_kill=finished_at_kill,
        interrupted=len(interrupted),
        callback_reruns=callback_reruns,
        reruns=len(verdict.rerun_rows),
        drain_s=drain_s,
    )
