"""The db package maps result rows to its dataclasses by column name, and parameters by name."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime

import pytest

import django_workpump as workpump
from django_workpump import db
from django_workpump.states import OutcomeStatus, WorkState
from tests.helpers import enroll

T = datetime(2026, 1, 1, tzinfo=UTC)


def claimed_columns() -> dict[str, object]:
    return {
        "category": "outbox",
        "work_id": uuid.uuid4(),
        "topic": "emails.welcome",
        "payload": {"user_id": 7},
        "stream": "user-7",
        "attempts": 1,
        "max_attempts": 10,
        "lease_expiry": T,
        "event_id": None,
        "event_type": None,
        "priority": 5,
        "claimed_at": T,
        "lease_token": uuid.uuid4(),
        "has_more": True,
    }


def test_from_row_maps_by_name_whatever_the_column_order():
    columns = claimed_columns()
    reordered = dict(reversed(list(columns.items())))

    work = db.ClaimedWork.from_row(reordered)

    assert work == db.ClaimedWork.from_row(columns)
    for name, value in columns.items():
        assert getattr(work, name) == value
    assert work.payload_error is None  # a field with a default may have no column


def test_from_row_names_the_missing_columns():
    columns = claimed_columns()
    del columns["lease_token"], columns["priority"]

    with pytest.raises(ValueError, match="no column for priority, lease_token"):
        db.ClaimedWork.from_row(columns)


def test_from_row_ignores_columns_the_dataclass_has_no_field_for():
    state = db.PeriodicState.from_row(
        {"created_at": T, "now": T, "last_slot": None, "paused": False, "name": "nightly"}
    )

    assert state == db.PeriodicState(name="nightly", paused=False, last_slot=None, created_at=T)


def test_outcome_and_selected_work_hold_enum_members():
    work_id = uuid.uuid4()
    outcome = db.Outcome.from_row({"status": "retry", "work_id": work_id, "scheduled_for": T})
    selected = db.SelectedWork.from_row(
        {
            "state": "orphaned",
            "work_id": work_id,
            "topic": "t",
            "category": "inbox",
            "created_at": T,
        }
    )

    assert outcome.status is OutcomeStatus.RETRY
    assert selected.work_id == work_id
    assert selected.state is WorkState.ORPHANED
    with pytest.raises(ValueError):
        db.Outcome.from_row({"work_id": work_id, "status": "vanished"})


def test_a_query_gets_exactly_the_parameters_it_names():
    with pytest.raises(TypeError, match=r"'purge_evictions' takes the parameters"):
        db.queries._fetch("purge_evictions", {"retention_seconds": 1, "batch": 2}, None)


@pytest.mark.django_db
def test_the_rows_of_one_claim_share_their_parsed_timestamps_and_keep_their_zone():
    instance = uuid.uuid4()
    enroll(instance)
    for n in range(3):
        workpump.send("emails.welcome", {"n": n})
    rows = db.claim_work(instance_id=instance, max_rows=10, lease_seconds=60, partition_count=10000)

    assert len(rows) == 3
    # One claim time and one lease expiry for the claim, parsed once, aware, in UTC.
    assert rows[0].claimed_at is rows[1].claimed_at is rows[2].claimed_at
    assert rows[0].lease_expiry is rows[2].lease_expiry
    assert rows[0].claimed_at.utcoffset().total_seconds() == 0
    assert (rows[0].lease_expiry - rows[0].claimed_at).total_seconds() == 60
    # A later claim parses its own.
    workpump.send("emails.welcome", {"n": 3})
    later = db.claim_work(
        instance_id=instance, max_rows=10, lease_seconds=30, partition_count=10000
    )
    assert (later[0].lease_expiry - later[0].claimed_at).total_seconds() == 30
