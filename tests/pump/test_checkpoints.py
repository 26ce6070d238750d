"""Checkpoints under a real pump: ``work.checkpoint`` / ``await work.acheckpoint``.

An attempt that checkpoints and then dies (its lease runs out) is resumed by the next
attempt from its last checkpoint. Without ``atomic`` a checkpoint commits at once and
survives the attempt's failure; with ``atomic=True`` it is part of the handler's
transaction and rolls back with it. Batch handlers checkpoint row by row. Real pumps on
real PostgreSQL.
"""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from django.test import override_settings

import django_workpump as workpump
from django_workpump import db
from django_workpump.pump.supervisor import EXIT_OK
from django_workpump.states import OutcomeStatus
from tests.helpers import FAST_PUMP, drain, enroll, new_id

FAST = {**FAST_PUMP, "CONCURRENCY": 2}
pumped = pytest.mark.django_db(transaction=True)


@pumped
@override_settings(WORKPUMP=FAST)
def test_an_attempt_that_died_is_resumed_from_its_last_checkpoint(handlers, pump):
    seen: list[tuple[int, Any]] = []

    def resume(work: workpump.Work) -> None:
        seen.append((work.attempts, work.state))

    handlers("outbox_handler", "ck.resume", resume)
    work_id = workpump.send("ck.resume", {"file": "big.csv"})
    # A process that is gone now claimed the row, checkpointed, and died mid-import: its
    # claim, an hour ago, leased the row for a minute.
    crashed = new_id()
    enroll(crashed)
    an_hour_ago = datetime.now(UTC) - timedelta(hours=1)
    [row] = db.claim_work(
        instance_id=crashed,
        max_rows=1,
        lease_seconds=60,
        partition_count=10_000,
        topics={"outbox": ["ck.resume"]},
        now=an_hour_ago,
    )
    stored = db.checkpoint_work(
        instance_id=crashed,
        category="outbox",
        id=work_id,
        lease_token=row.lease_token,
        state=json.dumps({"line": 40_000}),
        max_bytes=1000,
    )
    assert stored == OutcomeStatus.DONE

    assert drain(pump(drain=True)) == EXIT_OK

    assert seen == [(2, {"line": 40_000})]


@pumped
@pytest.mark.parametrize("atomic", [False, True], ids=["autocommit", "atomic"])
@pytest.mark.parametrize("is_async", [False, True], ids=["sync", "async"])
@override_settings(WORKPUMP=FAST)
def test_a_checkpoint_survives_a_failure_unless_the_handler_is_atomic(
    handlers, pump, atomic, is_async
):
    seen: list[tuple[int, Any]] = []

    if is_async:

        async def step(work: workpump.Work) -> None:
            seen.append((work.attempts, work.state))
            await work.acheckpoint({"done_by": work.attempts})
            if work.attempts == 1:
                raise RuntimeError("attempt 1 fails after its checkpoint")

    else:

        def step(work: workpump.Work) -> None:
            seen.append((work.attempts, work.state))
            work.checkpoint({"done_by": work.attempts})
            if work.attempts == 1:
                raise RuntimeError("attempt 1 fails after its checkpoint")

    handlers("outbox_handler", "ck.step", step, atomic=atomic, max_attempts=2)
    workpump.send("ck.step", {})

    assert drain(pump(drain=True)) == EXIT_OK

    # atomic: the checkpoint rolled back with attempt 1's transaction
    expected = None if atomic else {"done_by": 1}
    assert seen == [(1, None), (2, expected)]


@pumped
@override_settings(WORKPUMP={**FAST, "STREAM_RUN_MAX": 100})
def test_a_batch_handler_checkpoints_each_row(handlers, pump):
    calls: list[dict[int, Any]] = []

    def project(works: list[workpump.Work]) -> None:
        calls.append({work.payload["n"]: work.state for work in works})
        for work in works:
            work.checkpoint({"n": work.payload["n"], "call": len(calls)})
        if len(calls) == 1:
            raise RuntimeError("the first call fails after its checkpoints")

    handlers("perspective", "ck.batch", project, events=["ck.placed"], batch=True)
    for n in range(3):
        workpump.emit("ck.placed", {"n": n}, stream="s")

    assert drain(pump(drain=True)) == EXIT_OK

    assert calls[0] == {0: None, 1: None, 2: None}
    resumed = {n: state for call in calls[1:] for n, state in call.items()}
    assert resumed == {n: {"n": n, "call": 1} for n in range(3)}


@pumped
@override_settings(WORKPUMP=FAST)
def test_a_checkpoint_too_large_fails_the_attempt_with_the_error(handlers, pump):
    def greedy(work: workpump.Work) -> None:
        work.checkpoint({"rows": ["x" * 100] * 1000})

    handlers("outbox_handler", "ck.greedy", greedy, max_attempts=1)
    work_id = workpump.send("ck.greedy", {})

    assert drain(pump(drain=True)) == EXIT_OK

    [outcome] = workpump.wait([work_id], timeout=5).values()
    assert outcome.state == "dead"
    assert outcome.last_error.startswith(
        "django_workpump.work.CheckpointTooLarge: The checkpoint of outbox"
    )
