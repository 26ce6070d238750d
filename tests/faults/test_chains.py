"""Chains under a kill -9: every link runs after the link before it, none is lost.

C chains of L outbox links (each sent with ``after=[the link before]``; a link is leased
with the links behind it and run in turn, docs/workflows.md) are drained by three
``runworkpump`` processes. Once a quarter of the links ran, the instance running a link
is killed: the rest of its chains' runs, leased to it and still waiting in the
database, go back to waiting for their dependencies. When everything drained: every
link is done, each link's every execution started after an execution of the link before
it had run to completion, and every second execution belongs to the killed instance.
"""

from __future__ import annotations

import json
from itertools import pairwise
from typing import Any

import pytest

from tests.faults import harness
from tests.faults.harness import Database, Stopwatch, wait_for

pytestmark = pytest.mark.faults

CHAINS, LINKS = (100, 200) if harness.FULL else (12, 60)
LINK = {"seconds": 0.01}  # simulated work per link


def produce(db: Database, chains: int, links: int) -> list[list[Any]]:
    """Send the chains, one transaction each; each chain's link ids in order."""
    produced: list[list[Any]] = []
    with db.connect() as conn:
        for c in range(chains):
            ids: list[Any] = []
            with conn.transaction():
                for n in range(links):
                    ids.append(
                        conn.execute(
                            "SELECT workpump.send('fx.outbox', %s::jsonb,"
                            " p_after => %s::uuid[]) AS id",
                            [json.dumps({**LINK, "n": n, "chain": c}), ids[-1:] or None],
                        ).fetchone()["id"]
                    )
            produced.append(ids)
    return produced


@pytest.mark.timeout(3600 if harness.FULL else 300)
def test_chains_keep_their_order_and_lose_nothing_when_an_instance_is_killed(db, make_fleet):
    chains = produce(db, CHAINS, LINKS)
    fleet = make_fleet(db, harness.FAST)
    fleet.start(3, "--concurrency", "3")
    run = Stopwatch()

    def link_runner() -> harness.Pump | None:
        ran = db.scalar("SELECT count(*) FROM fx_execution WHERE finished_at IS NOT NULL")
        if ran >= CHAINS * LINKS:
            raise AssertionError("every link ran before an instance could be killed")
        return fleet.running() if ran >= CHAINS * LINKS // 4 else None

    victim = wait_for(link_runner, 120, "an instance running a link")
    victim.kill9()
    killed_after_s = run.seconds()
    held_at_kill = db.scalar(
        "SELECT count(*) FROM workpump_outbox WHERE instance_id = %s", [victim.instance_id]
    )

    wait_for(lambda: db.undone() == 0, 3000 if harness.FULL else 180, "the chains to drain")
    drain_s = run.seconds()
    codes = fleet.stop_all()
    assert set(codes.values()) == {0}, fleet.outputs()

    verdict = harness.check_invariants(db, expected={"outbox": CHAINS * LINKS}, killed=fleet.killed)
    harness.assert_invariants(verdict, fleet)
    assert verdict.done == CHAINS * LINKS
    assert set(verdict.reruns) <= {"kill"}, verdict.reruns

    # Each link ran only after the link before it had run to completion.
    executions: dict[Any, list[dict[str, Any]]] = {}
    for e in db.executions():
        executions.setdefault(e["work_id"], []).append(e)
    out_of_order = []
    for ids in chains:
        for before, after in pairwise(ids):
            completed = [e["finished_at"] for e in executions[before] if e["outcome"] == "done"]
            first = min(completed)
            out_of_order += [e for e in executions[after] if e["started_at"] < first]
    assert out_of_order == []
    assert db.sql("SELECT * FROM workpump_dependency") == []

    harness.report(
        "chains",
        chains=CHAINS,
        links=LINKS,
        held_at_kill=held_at_kill,
        kill_at_s=killed_after_s,
        reruns=len(verdict.rerun_rows),
        executions=verdict.executions,
        drain_s=drain_s,
    )
