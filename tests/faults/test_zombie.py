"""Scenario 2: SIGSTOP past the stale cutoff, then SIGCONT (a zombie that wakes up).

A stopped process keeps its database sessions, so its alive-lock stays held: in the
default liveness mode it is evicted only once its heartbeat is older than
DEFINITIVELY_DEAD_AFTER_SECONDS, set to 6 s here (docs/reliability.md). While stopped it
is evicted and its rows run elsewhere; once woken its renewals are refused (it is
tombstoned), its late completions are fenced out, its heartbeat is refused and it exits
with code 3. Only the rows it was
running run twice.
"""

from __future__ import annotations

import signal

import pytest

from tests.faults import harness
from tests.faults.harness import Backlog, send_outbox, wait_for

pytestmark = pytest.mark.faults

# Long rows: 16 s of work under a 20 s lease (local deadline 18 s, renewal due 6 s before
# it), so the zombie's renewal and completion both fall after its wake-up.
ZOMBIE = {
    **harness.FAST,
    "DEFINITIVELY_DEAD_AFTER_SECONDS": 6,
    "LEASE_SECONDS": 20,
    "LEASE_GRACE_SECONDS": 2,
    "SHUTDOWN_TIMEOUT_SECONDS": 20,
}
LONG_SECONDS = 16


@pytest.mark.timeout(300)
def test_a_stopped_instance_is_evicted_and_fenced_out_when_it_wakes(db, make_fleet):
    fleet = make_fleet(db, ZOMBIE)
    long_rows = {
        send_outbox(db, "fx.outbox", {"n": 0, "seconds": LONG_SECONDS}, stream=f"long-{i}")
        for i in range(3)
    }
    zombie = fleet.start(1, "--concurrency", "3")[0]
    wait_for(
        lambda: db.scalar("SELECT count(*) FROM fx_execution WHERE pid = %s", [zombie.pid]) == 3,
        30,
        "the zombie-to-be to run the three long rows",
    )
    backlog = Backlog(db, streams=6, seconds=0.1)
    backlog.produce(6)
    peers = fleet.start(2, "--concurrency", "3")

    stopped_at = zombie.signal(signal.SIGSTOP)
    evicted_at = wait_for(
        lambda: db.evicted().get(zombie.instance_id), 30, "the stopped instance to be evicted"
    )
    stopped_for = (evicted_at - stopped_at).total_seconds()
    # Its rows run elsewhere while it sleeps.
    wait_for(
        lambda: (
            db.scalar(
                "SELECT count(DISTINCT work_id) FROM fx_execution"
                " WHERE work_id = ANY(%s) AND pid <> %s",
                [list(long_rows), zombie.pid],
            )
            == 3
        ),
        30,
        "the zombie's rows to be re-claimed by peers",
    )
    zombie.signal(signal.SIGCONT)
    code = zombie.wait_exit(60)
    output = zombie.output()
    assert code == 3, output  # EXIT_EVICTED
    assert "was evicted by its peers" in output
    # Its renewals are refused: the instance as a whole (it is tombstoned), or
    # row by row when the heartbeat stopped it before the renewal flush went out.
    instance_refused = output.count("renew_leases refused this instance")
    renewals_refused = output.count("refused: the lease was lost")
    completions_fenced = output.count("before its outcome was recorded (fenced out)")
    assert instance_refused == 1 or renewals_refused >= 3, output
    assert completions_fenced >= 3, output

    wait_for(lambda: db.undone() == 0, 120, "the backlog to drain")
    codes = fleet.stop_all()
    assert set(codes.values()) == {0}, fleet.outputs()

    # The peers' attempt completed the long rows; the zombie's late outcome changed nothing.
    peer_ids = {str(p.instance_id) for p in peers}
    results = db.sql(
        "SELECT result FROM workpump_outbox WHERE work_id = ANY(%s)", [list(long_rows)]
    )
    assert all(r["result"]["attempt"] == 2 and r["result"]["instance"] in peer_ids for r in results)
    # Nothing started on the zombie after its eviction, and no peer was evicted.
    late = db.executions("pid = %s AND started_at > %s", [zombie.pid, evicted_at])
    assert late == [], late
    assert set(db.evicted()) == {zombie.instance_id}

    verdict = harness.check_invariants(
        db,
        expected={"outbox": backlog.expected["outbox"] + 3, **{
            c: backlog.expected[c] for c in ("inbox", "perspective_event", "receptor")}},
    )  # fmt: skip
    harness.assert_invariants(verdict, fleet)
    assert verdict.rerun_rows == long_rows, verdict.reruns
    assert set(verdict.reruns) == {"eviction"}
    harness.report(
        "zombie-sigstop",
        evicted_after_s=stopped_for,
        instance_refused=instance_refused,
        renewals_refused=renewals_refused,
        completions_fenced=completions_fenced,
        exit_code=code,
        rows=verdict.rows,
        reruns=len(verdict.rerun_rows),
        lost=0,
    )
