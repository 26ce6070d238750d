"""Batches drained by real ``runworkpump`` processes, one of them killed mid-run: every
batch calls back exactly once, with counts that add up to its members."""

from __future__ import annotations

import signal
from collections.abc import Callable
from typing import Any

import pytest

import django_workpump as workpump
from tests.helpers import FAST_PROCESS, got_going, run_sql, scalar, wait_until

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow]

BATCHES, MEMBERS = 10, 100


def test_a_killed_instance_costs_no_callback_and_makes_none_twice(
    executions: None, pump_process: Callable[..., Any]
) -> None:
    ids = []
    for b in range(BATCHES):
        with workpump.batch(on_complete=("mp.batch_done", {"b": b})) as group:
            workpump.send_many("mp.member", [{"n": n, "seconds": 0.01} for n in range(MEMBERS)])
        ids.append(str(group.id))

    pumps = [pump_process("--concurrency", "4", timings=FAST_PROCESS) for _ in range(3)]
    victim = pumps[0]
    assert wait_until(lambda: got_going(victim.pid, 20)), "the victim never got going"
    victim.send_signal(signal.SIGKILL)
    victim.wait(10)

    assert wait_until(
        lambda: scalar("SELECT count(*) FROM workpump_outbox WHERE done_at IS NULL") == 0,
        timeout=120,
    ), "the survivors did not finish the batches"
    for survivor in pumps[1:]:
        survivor.send_signal(signal.SIGTERM)
        output, _ = survivor.communicate(timeout=60)
        assert survivor.returncode == 0, output

    callbacks = run_sql(
        "SELECT payload -> 'batch' ->> 'id' AS id, (payload -> 'batch' ->> 'done')::int AS done,"
        " (payload -> 'batch' ->> 'total')::int AS total, payload ->> 'b' AS b"
        " FROM workpump_outbox WHERE topic = 'mp.batch_done'"
    )
    assert sorted(c["id"] for c in callbacks) == sorted(ids)  # one each, none twice
    assert all(c["done"] == MEMBERS and c["total"] == MEMBERS for c in callbacks)
    handled = scalar(
        "SELECT count(DISTINCT e.work_id) FROM mp_execution e"
        " JOIN workpump_outbox o ON o.work_id = e.work_id WHERE o.topic = 'mp.batch_done'"
    )
    assert handled == BATCHES
    assert scalar("SELECT count(*) FROM workpump_batch WHERE finished_at IS NULL") == 0
