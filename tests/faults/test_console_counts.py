"""The console's counters after a multi-instance run with a kill -9: they equal what the
rows say.

Three ``runworkpump`` processes work a backlog of all four categories where every third
step fails once; one of them is killed while it runs handlers. Once the rest drained the
backlog, per category: the done counters equal the rows done; each claim is counted to
end exactly once (claimed = done + failed + released + orphaned + expired), and claims
minus the attempts given back equal the attempts the rows record; failures are the
errors the handlers raised, but at most those of the killed process that it never
reported.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import pytest

from tests.faults import harness
from tests.faults.harness import Backlog, wait_for

pytestmark = pytest.mark.faults  # opt-in like every scenario: WORKPUMP_FAULTS=1

ENDINGS = ("done", "failed", "dead", "released", "orphaned", "expired", "cancelled", "discarded")


@pytest.mark.timeout(300)
def test_the_console_counters_equal_the_rows_after_a_kill(db, make_fleet):
    fleet = make_fleet(db, harness.FAST)
    backlog = Backlog(db, streams=6, seconds=0.05)
    for step in range(9):
        backlog.produce(1, **({"bad_error": "surrogate"} if step % 3 == 1 else {}))
    fleet.start(3, "--concurrency", "3")

    victim = wait_for(fleet.running, 60, "an instance running handlers")
    victim_pid = victim.pid
    victim.kill9()
    wait_for(lambda: db.undone() == 0, 180, "the backlog to drain")
    codes = fleet.stop_all()
    assert set(codes.values()) == {0}, fleet.outputs()

    counted: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    for r in db.sql(
        "SELECT category, outcome, sum(n)::bigint AS n FROM workpump_console_count GROUP BY 1, 2"
    ):
        counted[r["category"]][r["outcome"]] = r["n"]
    rows = db.sql(harness.ALL_ROWS)
    errors: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    for e in db.sql("SELECT category, pid FROM fx_execution WHERE outcome = 'error'"):
        errors[e["category"]]["victim" if e["pid"] == victim_pid else "others"] += 1

    figures: dict[str, Any] = {}
    for category in ("outbox", "inbox", "perspective_event", "receptor"):
        mine = [r for r in rows if r["category"] == category]
        c = counted[category]
        assert c["done"] == sum(1 for r in mine if r["done_at"] is not None), (category, c)
        assert c["claimed"] == sum(c[o] for o in ENDINGS), (category, dict(c))
        assert c["claimed"] - c["released"] == sum(r["attempts"] for r in mine), (category, c)
        assert errors[category]["others"] <= c["failed"], (category, c, errors[category])
        assert c["failed"] <= errors[category]["others"] + errors[category]["victim"]
        assert c["dead"] == 0
        figures[category] = dict(c)
    assert sum(counted[k]["orphaned"] for k in counted) > 0, "the kill orphaned nothing"
    # the whole pump's totals are the same counts summed over categories and topics
    totals = {
        r["outcome"]: r["n"]
        for r in db.sql(
            "SELECT outcome, sum(n)::bigint AS n"
            " FROM workpump.console_totals('-infinity', 'infinity') GROUP BY 1"
        )
    }
    summed: dict[str, int] = defaultdict(int)
    for c in counted.values():
        for outcome, n in c.items():
            summed[outcome] += n
    assert totals == {k: v for k, v in summed.items() if v}, (totals, dict(summed))
    harness.report(
        "console-counts",
        rows=len(rows),
        claimed=sum(counted[k]["claimed"] for k in counted),
        done=sum(counted[k]["done"] for k in counted),
        failed=sum(counted[k]["failed"] for k in counted),
        orphaned=sum(counted[k]["orphaned"] for k in counted),
        released=sum(counted[k]["released"] for k in counted),
    )
