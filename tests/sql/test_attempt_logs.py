"""workpump_attempt_log: written with an outcome, under its fence, and purged with its row.

The SQL functions are called as the pump calls them (db.complete_work, db.fail_work),
with p_now, on real PostgreSQL.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

import pytest

from django_workpump import db
from tests.helpers import T0, A, B, at, enroll, run_sql, scalar

pytestmark = pytest.mark.django_db


def records(*messages: str, level: int = 30) -> str:
    return json.dumps(
        [
            {"at": T0.timestamp() + n, "level": level, "logger": "app", "message": m}
            for n, m in enumerate(messages)
        ]
    )


def send(max_attempts: int = 5) -> uuid.UUID:
    return scalar(
        "SELECT workpump.send('al.topic', '{}'::jsonb, p_max_attempts => %s)", [max_attempts]
    )


def claim(instance: uuid.UUID, now: Any) -> dict[uuid.UUID, uuid.UUID]:
    enroll(instance, now)
    rows = run_sql(
        "SELECT work_id, lease_token FROM workpump.claim_work(p_instance_id => %s,"
        " p_lease_seconds => 60, p_now => %s)",
        [instance, now],
    )
    return {r["work_id"]: r["lease_token"] for r in rows}


def logs_of(work_id: uuid.UUID) -> list[dict[str, Any]]:
    return run_sql(
        "SELECT attempt, lease_token, logged_at, level, logger, message"
        " FROM workpump_attempt_log WHERE work_id = %s ORDER BY attempt, id",
        [work_id],
    )


def test_a_completion_stores_its_records_in_order_with_attempt_and_token():
    work_id = send()
    token = claim(A, T0)[work_id]
    (outcome,) = db.complete_work(
        instance_id=A,
        category="outbox",
        ids=[work_id],
        lease_tokens=[token],
        logs=[records("first", "second")],
        now=at(1),
    )
    assert outcome.status == "done"
    rows = logs_of(work_id)
    assert [(r["attempt"], r["lease_token"], r["message"]) for r in rows] == [
        (1, token, "first"),
        (1, token, "second"),
    ]
    assert rows[0]["logged_at"] == T0 and rows[0]["logger"] == "app"


def test_a_superseded_attempts_records_never_land_on_the_new_attempt():
    work_id = send()
    old_token = claim(A, T0)[work_id]
    new_token = claim(B, at(120))[work_id]  # A's lease ran out: B holds attempt 2
    # A's late failure and completion come back lost, and store nothing
    late_fail = db.fail_work(
        instance_id=A,
        category="outbox",
        ids=[work_id],
        lease_tokens=[old_token],
        errors=["late"],
        logs=[records("from attempt 1")],
        now=at(121),
    )
    late_done = db.complete_work(
        instance_id=A,
        category="outbox",
        ids=[work_id],
        lease_tokens=[old_token],
        logs=[records("from attempt 1, again")],
        now=at(121),
    )
    assert [o.status for o in late_fail + late_done] == ["lost", "lost"]
    assert logs_of(work_id) == []
    # the holder's own outcome lands, with its records only
    db.fail_work(
        instance_id=B,
        category="outbox",
        ids=[work_id],
        lease_tokens=[new_token],
        errors=["boom"],
        logs=[records("from attempt 2")],
        now=at(122),
    )
    assert [(r["attempt"], r["lease_token"], r["message"]) for r in logs_of(work_id)] == [
        (2, new_token, "from attempt 2")
    ]


def test_a_batch_stores_each_rows_records_and_none_for_rows_without():
    ids = [send(), send(), send()]
    tokens = claim(A, T0)
    outcomes = db.complete_work(
        instance_id=A,
        category="outbox",
        ids=ids,
        lease_tokens=[tokens[i] for i in ids],
        logs=[records("one"), None, records("three")],
        now=at(1),
    )
    assert [o.status for o in outcomes] == ["done"] * 3
    assert [r["message"] for r in logs_of(ids[0])] == ["one"]
    assert logs_of(ids[1]) == []
    assert [r["message"] for r in logs_of(ids[2])] == ["three"]


def test_the_sql_caps_hold_for_any_caller():
    work_id = send()
    token = claim(A, T0)[work_id]
    many = records(*[f"m{n}" for n in range(250)])
    long_one = records("x" * 20_000)
    db.fail_work(
        instance_id=A,
        category="outbox",
        ids=[work_id],
        lease_tokens=[token],
        errors=["boom"],
        logs=[many],
        now=at(1),
    )
    assert len(logs_of(work_id)) == 200
    token = claim(A, at(400))[work_id]  # past the retry's backoff
    db.complete_work(
        instance_id=A,
        category="outbox",
        ids=[work_id],
        lease_tokens=[token],
        logs=[long_one],
        now=at(401),
    )
    assert len(logs_of(work_id)[-1]["message"]) == 8000


def test_retention_purges_the_records_with_their_rows_and_only_theirs():
    done, dead, kept = send(), send(max_attempts=1), send()
    tokens = claim(A, T0)
    db.complete_work(
        instance_id=A,
        category="outbox",
        ids=[done, kept],
        lease_tokens=[tokens[done], tokens[kept]],
        logs=[records("done"), records("kept")],
        now=at(1),
    )
    db.fail_work(
        instance_id=A,
        category="outbox",
        ids=[dead],
        lease_tokens=[tokens[dead]],
        errors=["boom"],
        logs=[records("dead")],
        now=at(1),
    )
    # a row of another category with the same id keeps its records
    run_sql(
        "INSERT INTO workpump_attempt_log (category, work_id, attempt, lease_token,"
        " logged_at, level, logger, message) VALUES ('inbox', %s, 1, %s, %s, 30, 'x', 'y')",
        [done, uuid.uuid4(), T0],
    )
    assert scalar("SELECT workpump.purge_dead('outbox', %s, 1000)", [at(2)]) == 1
    run_sql("UPDATE workpump_outbox SET done_at = %s WHERE work_id = %s", [at(10**6), kept])
    assert scalar("SELECT workpump.purge_processed('outbox', %s, 1000)", [at(2)]) == 1
    assert logs_of(dead) == []
    assert [r["message"] for r in logs_of(kept)] == ["kept"]
    assert run_sql("SELECT category FROM workpump_attempt_log WHERE work_id = %s", [done]) == [
        {"category": "inbox"}
    ]
