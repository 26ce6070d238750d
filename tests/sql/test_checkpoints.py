"""Checkpoints: a handler's state stored on its row, fenced like an outcome.

checkpoint_work writes a row's state only under the lease token (and instance) of the
attempt that holds it; the row's next claim returns the last state stored, so an
attempt whose lease ran out (a crash) is resumed from it by the next one. A state over
the size limit is refused with an error naming the row. Time comes from p_now; each
test runs in a rolled-back transaction.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

import pytest
from django.db import DatabaseError, transaction
from django.test import override_settings

import django_workpump as workpump
from django_workpump import db
from django_workpump.pump.running import claimed_work, store_checkpoint
from django_workpump.states import OutcomeStatus
from django_workpump.work import Work, checkpoint_text
from tests.helpers import T0, WORK_TABLES, at, enroll, run_sql

pytestmark = pytest.mark.django_db

A = uuid.UUID("00000000-0000-0000-0000-0000000000c1")
B = uuid.UUID("00000000-0000-0000-0000-0000000000c2")


def claim(instance: uuid.UUID, seconds: float, lease_seconds: int = 60) -> list[db.ClaimedWork]:
    return db.claim_work(
        instance_id=instance,
        max_rows=10,
        lease_seconds=lease_seconds,
        partition_count=10_000,
        categories=["outbox"],
        now=at(seconds),
    )


def checkpoint(instance: uuid.UUID, row: db.ClaimedWork, state: Any) -> OutcomeStatus:
    return db.checkpoint_work(
        instance_id=instance,
        category=row.category,
        id=row.work_id,
        lease_token=row.lease_token,
        state=json.dumps(state),
        max_bytes=65_536,
    )


def stored_state(work_id: uuid.UUID) -> Any:
    table, key = WORK_TABLES["outbox"]
    [found] = run_sql(f"SELECT checkpoint::text AS state FROM {table} WHERE {key} = %s", [work_id])
    return None if found["state"] is None else json.loads(found["state"])


def work_of(row: db.ClaimedWork, instance: uuid.UUID) -> Work:
    # no lease: a checkpoint reads only the row, the instance and the lease token
    return claimed_work(row, None, instance)  # type: ignore[arg-type]


def test_the_next_claim_after_a_crash_resumes_from_the_last_checkpoint():
    enroll(A, T0)
    enroll(B, T0)
    work_id = workpump.send("ckpt.import", {"file": "big.csv"})
    [first] = claim(A, 0)
    assert first.checkpoint is None  # nothing stored yet
    assert checkpoint(A, first, {"line": 1000}) == OutcomeStatus.DONE
    assert checkpoint(A, first, {"line": 2000, "ids": [1, 2]}) == OutcomeStatus.DONE

    # A crashes: its lease runs out and B claims the row, with A's last checkpoint
    [second] = claim(B, 61)
    assert (second.work_id, second.attempts) == (work_id, 2)
    assert second.checkpoint == {"line": 2000, "ids": [1, 2]}


def test_an_older_attempts_checkpoint_is_refused_and_writes_nothing():
    enroll(A, T0)
    enroll(B, T0)
    work_id = workpump.send("ckpt.import", {})
    [old] = claim(A, 0)
    assert checkpoint(A, old, {"step": 1}) == OutcomeStatus.DONE
    [new] = claim(B, 61)  # the lease expired: a new attempt, a new token
    assert new.lease_token != old.lease_token

    # the old attempt, still running, checkpoints late: refused, nothing written
    assert checkpoint(A, old, {"step": 99}) == OutcomeStatus.LOST
    assert stored_state(work_id) == {"step": 1}
    # through Work.checkpoint the old attempt gets LeaseLost, naming the row
    with pytest.raises(workpump.LeaseLost, match=f"outbox {work_id}: attempt 1 no longer"):
        store_checkpoint("default", work_of(old, A), {"step": 100})
    assert stored_state(work_id) == {"step": 1}
    # the new attempt's own checkpoint goes through
    store_checkpoint("default", work_of(new, B), {"step": 2})
    assert stored_state(work_id) == {"step": 2}


def test_the_same_instances_older_attempt_is_fenced_by_its_token():
    enroll(A, T0)
    work_id = workpump.send("ckpt.import", {})
    [old] = claim(A, 0)
    [new] = claim(A, 61)  # the same instance claims it again after its lease ran out
    assert checkpoint(A, old, {"from": "old"}) == OutcomeStatus.LOST
    assert checkpoint(A, new, {"from": "new"}) == OutcomeStatus.DONE
    assert stored_state(work_id) == {"from": "new"}


def test_a_checkpoint_of_an_ended_or_unheld_row_is_refused():
    enroll(A, T0)
    enroll(B, T0)
    workpump.send("ckpt.import", {})
    [row] = claim(A, 0)
    # another instance naming the right token is not the holder
    assert checkpoint(B, row, {"x": 1}) == OutcomeStatus.LOST
    outcome = db.complete_work(
        instance_id=A, category="outbox", ids=[row.work_id], lease_tokens=[row.lease_token]
    )
    assert outcome[0].status == OutcomeStatus.DONE
    assert checkpoint(A, row, {"x": 2}) == OutcomeStatus.LOST
    assert stored_state(row.work_id) is None


def test_none_clears_the_checkpoint():
    enroll(A, T0)
    workpump.send("ckpt.import", {})
    [row] = claim(A, 0)
    store_checkpoint("default", work_of(row, A), {"step": 1})
    store_checkpoint("default", work_of(row, A), None)
    [again] = claim(A, 61)
    assert again.checkpoint is None


@override_settings(WORKPUMP={"MAX_CHECKPOINT_BYTES": 64})
def test_a_state_over_the_size_limit_is_refused_with_a_clear_error():
    enroll(A, T0)
    work_id = workpump.send("ckpt.import", {})
    [row] = claim(A, 0)
    store_checkpoint("default", work_of(row, A), {"ids": list(range(10))})  # under 64
    with pytest.raises(workpump.CheckpointTooLarge, match=r"over the limit of 64 \(WORKPUMP"):
        store_checkpoint("default", work_of(row, A), {"ids": list(range(100))})
    assert stored_state(work_id) == {"ids": list(range(10))}


def test_the_sql_refuses_a_state_over_its_byte_limit_itself():
    enroll(A, T0)
    workpump.send("ckpt.import", {})
    [row] = claim(A, 0)
    refused = pytest.raises(DatabaseError, match="bytes of JSON, over the limit of 10 bytes")
    with refused, transaction.atomic():
        db.checkpoint_work(
            instance_id=A,
            category="outbox",
            id=row.work_id,
            lease_token=row.lease_token,
            state=json.dumps({"much": "more than ten bytes"}),
            max_bytes=10,
        )


def test_python_measures_a_state_as_postgresql_prints_it():
    state = {"ü": [1, 2.5, "ß"], "nested": {"a": None, "b": True}}
    text = checkpoint_text(state, 1000, "outbox x")
    assert text is not None
    printed = run_sql("SELECT %s::jsonb::text AS t", [text])[0]["t"]
    assert len(printed.encode()) == len(text.encode())


@pytest.mark.parametrize(
    "state, problem",
    [
        ({"when": object()}, "not storable JSON"),
        ({"x": float("nan")}, "not storable JSON"),
        ({"x": "a\x00b"}, "NUL character"),
        ({"x": "\ud800"}, "not storable JSON"),
    ],
    ids=["object", "nan", "nul", "surrogate"],
)
def test_a_state_that_is_not_storable_json_is_refused(state, problem):
    with pytest.raises(workpump.InvalidCheckpoint, match=problem):
        checkpoint_text(state, 1000, "outbox x")


def test_an_undecodable_stored_state_starts_the_attempt_without_it(caplog):
    enroll(A, T0)
    work_id = workpump.send("ckpt.import", {})
    table, key = WORK_TABLES["outbox"]
    deep = "[" * 600 + "]" * 600  # written through SQL, deeper than the claim decodes
    run_sql(f"UPDATE {table} SET checkpoint = %s::jsonb WHERE {key} = %s", [deep, work_id])
    [row] = claim(A, 0)
    assert row.work_id == work_id and row.checkpoint is None
    assert "its checkpoint cannot be decoded" in caplog.text
