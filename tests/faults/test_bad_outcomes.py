"""Scenario 8: outcomes PostgreSQL cannot store, mixed into a stream of good work.

Handlers of every category return results holding a NUL or a lone surrogate, or a value
that is not JSON, or raise with a NUL or a lone surrogate in the message (once: the retry
succeeds), on rows interleaved with good ones in the same streams. Real ``runworkpump
--drain`` processes work the backlog: no outcome may jam a flusher, every row is done,
every good row ran exactly once, and the pumps drain and exit 0.
"""

from __future__ import annotations

import pytest

from tests.faults import harness
from tests.faults.harness import Backlog, Stopwatch

pytestmark = pytest.mark.faults

# The backlog, step by step: good steps, and bad steps (one row per stream and category).
STEPS: list[dict[str, str]] = [
    {}, {}, {"bad_result": "nul"}, {}, {"bad_error": "nul"}, {},
    {"bad_result": "surrogate"}, {}, {"bad_error": "surrogate"}, {},
    {"bad_result": "unjson"}, {}, {},
]  # fmt: skip
NOTE = "PostgreSQL cannot store (NUL or lone surrogate) replaced with U+FFFD]"


@pytest.mark.timeout(300)
def test_unstorable_outcomes_jam_nothing_and_the_pumps_drain(db, make_fleet):
    fleet = make_fleet(db, harness.FAST)
    backlog = Backlog(db, streams=8, seconds=0.02)
    kinds: dict[int, dict[str, str]] = {}
    for step in STEPS:
        kinds[backlog.steps] = step
        backlog.produce(1, **step)
    watch = Stopwatch()
    pumps = fleet.start(2, "--drain", "--concurrency", "4")
    codes = [pump.wait_exit(120) for pump in pumps]
    drained_s = watch.seconds()
    assert codes == [0, 0], fleet.outputs()

    jammed = db.undone()
    assert jammed == 0, fleet.outputs()
    verdict = harness.check_invariants(db, expected=backlog.expected)
    harness.assert_invariants(verdict, fleet)
    assert not verdict.reruns, verdict.reruns  # only the planned failures ran twice

    good = [n for n, step in kinds.items() if not step]
    runs = db.sql("SELECT n, work_id, count(*) AS runs FROM fx_execution GROUP BY n, work_id")
    good_runs = [r["runs"] for r in runs if r["n"] in good]
    assert len(good_runs) == len(good) * 8 * 4 and set(good_runs) == {1}, runs

    rows = db.sql(harness.ALL_ROWS)
    counts = {"bad_result": 0, "bad_error": 0}
    for row in rows:
        step = kinds[row["n"]]
        if "bad_result" in step:
            counts["bad_result"] += 1
            bad = row["result"].get("bad")
            if step["bad_result"] == "unjson":
                assert "it is not JSON (TypeError" in row["result"]["workpump_note"], row
            else:
                assert bad in ("nul \ufffd here", "lone \ufffd here"), row
        if "bad_error" in step:
            counts["bad_error"] += 1
            assert row["attempts"] == 2, row  # failed once, recorded, then done
            assert "\ufffd here (attempt 1)" in row["last_error"], row
            assert NOTE in row["last_error"], row
    outputs = "".join(pump.output() for pump in pumps)
    stalled = outputs.count(" is stalled: ")  # the flusher_stalled log line
    harness.report(
        "bad-outcomes",
        rows=verdict.rows,
        bad_results=counts["bad_result"],
        bad_errors=counts["bad_error"],
        good_rows=len(good_runs),
        executions=verdict.executions,
        jammed=jammed,
        good_reruns=sum(r - 1 for r in good_runs),
        stalled_flushers=stalled,
        drained_s=drained_s,
    )
