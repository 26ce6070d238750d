"""Scenario 8: a rolling deploy, new code sending a topic old instances cannot run.

An old instance (no handler for ``fx.v2``) runs alone while ``fx.v2`` messages arrive,
some of them at the head of streams whose later rows it could run. It must not claim
them: no attempt is spent, nothing is failed or parked, the streams behind them wait in
order, and the status report lists them under "no live handler". Then a new instance
(``FX_NEW_CODE=1``) starts beside the old one and everything drains, in order, each
``fx.v2`` row run once by the new instance.
"""

from __future__ import annotations

import pytest

from django_workpump.sql import named_queries
from django_workpump.status import EXACT_COUNT_LIMIT
from tests.faults import harness
from tests.faults.harness import Backlog, Stopwatch, send_outbox, wait_for

pytestmark = pytest.mark.faults

V2_STREAMS = 8  # streams whose head is an fx.v2 message, an fx.outbox message behind it
V2_SINGLES = 16  # fx.v2 messages of no stream

UNHANDLED = named_queries("status.sql")["unhandled_topics"]


def unhandled(db: harness.Database) -> dict[str, int]:
    rows = db.sql(
        UNHANDLED,
        {
            "now": None,
            "stale_after_seconds": harness.FAST["STALE_AFTER_SECONDS"],
            "definitively_dead_after_seconds": harness.FAST["DEFINITIVELY_DEAD_AFTER_SECONDS"],
            "exact_limit": EXACT_COUNT_LIMIT,
        },
    )
    return {row["topic"]: int(row["rows"]) for row in rows}


@pytest.mark.timeout(300)
def test_a_rolling_deploy_spends_no_attempt_of_the_new_topic_on_old_instances(db, make_fleet):
    backlog = Backlog(db, streams=4, seconds=0.02)
    backlog.produce(10)
    v2 = [send_outbox(db, "fx.v2", {"n": 0}, stream=f"v2-{s}") for s in range(V2_STREAMS)]
    behind = [send_outbox(db, "fx.outbox", {"n": 1}, stream=f"v2-{s}") for s in range(V2_STREAMS)]
    v2 += [send_outbox(db, "fx.v2", {"n": 0}) for _ in range(V2_SINGLES)]
    old_fleet = make_fleet(db, harness.FAST)
    new_fleet = make_fleet(db, harness.FAST, env={"FX_NEW_CODE": "1"})

    # Phase 1: old code only. It drains all it can run and leaves the rest untouched.
    [old] = old_fleet.start(1, "--concurrency", "3")
    waiting = len(v2) + len(behind)
    wait_for(lambda: db.undone() == waiting, 120, "the old instance to run what it can")
    backlog.produce(5)  # traffic goes on while the deploy is under way
    wait_for(lambda: db.undone() == waiting, 120, "the old instance to run the new traffic")
    untouched = db.sql(
        "SELECT count(*) AS n, coalesce(sum(attempts), 0) AS attempts,"
        " count(*) FILTER (WHERE instance_id IS NOT NULL OR dead_lettered_at IS NOT NULL"
        "                  OR last_error IS NOT NULL) AS touched"
        " FROM workpump_outbox WHERE work_id = ANY (%s)",
        [v2 + behind],
    )[0]
    assert (untouched["n"], untouched["attempts"], untouched["touched"]) == (waiting, 0, 0)
    assert db.executions("topic = 'fx.v2'") == []
    # The rows behind the fx.v2 heads are fx.outbox: a live instance runs that topic.
    status_during = unhandled(db)
    assert status_during == {"fx.v2": len(v2)}

    # Phase 2: the new code starts beside the old; everything drains.
    clock = Stopwatch()
    [new] = new_fleet.start(1, "--concurrency", "3")
    backlog.produce(5)
    wait_for(lambda: db.undone() == 0, 120, "the fleet to drain after the deploy")
    drained_s = clock.seconds()
    codes = {**old_fleet.stop_all(), **new_fleet.stop_all()}
    assert set(codes.values()) == {0}, old_fleet.outputs() + new_fleet.outputs()

    runs = db.executions("topic = 'fx.v2'")
    assert sorted(r["work_id"] for r in runs) == sorted(v2)
    assert {r["instance_id"] for r in runs} == {new.instance_id}
    assert {r["attempt"] for r in runs} == {1}
    attempts = db.sql(
        "SELECT max(attempts) AS most FROM workpump_outbox WHERE work_id = ANY (%s)", [v2]
    )[0]["most"]
    assert attempts == 1
    assert unhandled(db) == {}
    expected = {**backlog.expected, "outbox": backlog.expected["outbox"] + waiting}
    verdict = harness.check_invariants(db, expected=expected)
    harness.assert_invariants(verdict, old_fleet)
    old_runs = len(db.executions("instance_id = %s", [old.instance_id]))
    harness.report(
        "rolling-deploy",
        rows=verdict.rows,
        v2_rows=len(v2),
        held_behind_v2=len(behind),
        attempts_spent_by_old=int(untouched["attempts"]),
        v2_runs_by_old=0,
        no_live_handler_while_old_alone=status_during.get("fx.v2", 0),
        old_executions=old_runs,
        v2_attempts_max=attempts,
        drained_after_new_start_s=round(drained_s, 2),
        reruns=len(verdict.rerun_rows),
        lost=0,
    )
