"""The state and outcome enums say exactly the words the SQL produces.

Rows read from the database are compared with these members, so a word the SQL
returns that no member has (or a member no SQL returns) would silently never match.
"""

from __future__ import annotations

import re
from datetime import timedelta

import pytest

from django_workpump.states import FailureReason, OutcomeStatus, WorkState
from tests.helpers import ROOT, T0, new_id, scalar

SQL_DIR = ROOT / "django_workpump" / "sql"
WORD = r"'([a-z_]+)'"

# failure_reason = 'word'  |  failure_reason = CASE ... END
FAILURE_ASSIGNMENT = re.compile(r"failure_reason\s*=\s*(CASE\b.*?\bEND\b|'[a-z_]+')", re.S)
# The reason fail_work stores when the caller gives none, and the one dead_letter stores.
FAILURE_DEFAULTS = (
    re.compile(r"coalesce\(i\.reason,\s*" + WORD + r"\)"),
    re.compile(r"coalesce\(p_reason,\s*" + WORD + r"\)"),
)
# Reasons only Python writes (passed to fail_work / dead_letter as parameters).
PYTHON_ONLY_REASONS = {
    FailureReason.NO_HANDLER,
    FailureReason.UNSTORABLE_OUTCOME,
    FailureReason.SHUTDOWN,
    FailureReason.RELEASED,
}
# The functions that report what they did with each row they were given.
OUTCOME_FUNCTIONS = (
    "renew_leases",
    "complete_work",
    "fail_work",
    "release_work",
    "snooze_work",
    "discard_work",
)


def sql_text(pattern: str = "**/*.sql") -> str:
    return "\n".join(path.read_text() for path in sorted(SQL_DIR.glob(pattern)))


def failure_reasons_in_sql() -> set[str]:
    text = sql_text()
    words = set()
    for assignment in FAILURE_ASSIGNMENT.findall(text):
        words.update(re.findall(WORD, assignment))
    for pattern in FAILURE_DEFAULTS:
        words.update(pattern.findall(text))
    return words


def function_body(name: str) -> str:
    """The definition of workpump.<name> in schema.sql (the current one)."""
    found = re.search(
        r"^CREATE FUNCTION workpump\." + name + r"\(.*?^\$\$;$", sql_text("schema.sql"), re.S | re.M
    )
    assert found is not None, name
    return found.group(0)


def outcome_statuses_in_sql() -> set[str]:
    """The words the outcome functions return (failure reasons aside): CASE branches and
    literal status columns."""
    text = FAILURE_ASSIGNMENT.sub("", "\n".join(map(function_body, OUTCOME_FUNCTIONS)))
    return set(re.findall(r"\b(?:THEN|ELSE)\s+" + WORD, text)) | set(
        re.findall(WORD + r"::text", text)
    )


def test_failure_reasons_cover_every_reason_the_sql_writes():
    written = failure_reasons_in_sql()

    assert written  # the scan found the assignments
    assert written <= set(FailureReason)
    assert set(FailureReason) - written == PYTHON_ONLY_REASONS


def test_outcome_statuses_are_the_words_the_outcome_functions_return():
    assert outcome_statuses_in_sql() == set(OutcomeStatus)


# (done_at, dead_lettered_at, has holder, lease left s, claimed, scheduled in s,
#  end_state) -> state
STATE_CASES = [
    ((T0, None, False, None, False, None, None), WorkState.DONE),
    ((T0, None, False, None, True, None, "cancelled"), WorkState.CANCELLED),
    ((T0, None, False, None, False, None, "discarded"), WorkState.DISCARDED),
    ((None, T0, False, None, False, None, None), WorkState.DEAD),
    ((None, None, True, 60, True, None, None), WorkState.LEASED),
    ((None, None, True, 0, True, None, None), WorkState.ORPHANED),
    ((None, None, False, None, True, None, None), WorkState.ORPHANED),
    ((None, None, False, None, False, 60, None), WorkState.SCHEDULED),
    ((None, None, False, None, False, None, None), WorkState.PENDING),
]


@pytest.mark.django_db
@pytest.mark.parametrize(("inputs", "expected"), STATE_CASES)
def test_each_branch_of_state_of_returns_a_work_state(inputs, expected):
    done_at, dead_at, held, lease_left, claimed, scheduled_in, end_state = inputs
    state = scalar(
        "SELECT workpump.state_of(%s::timestamptz, %s::timestamptz, %s::uuid, %s::timestamptz,"
        " %s::timestamptz, %s::timestamptz, %s::text, %s::timestamptz)",
        (
            done_at,
            dead_at,
            new_id() if held else None,
            None if lease_left is None else T0 + timedelta(seconds=lease_left),
            T0 - timedelta(seconds=1) if claimed else None,
            None if scheduled_in is None else T0 + timedelta(seconds=scheduled_in),
            end_state,
            T0,
        ),
    )

    assert state == expected
    assert WorkState(state) is expected


def test_every_work_state_has_a_branch_of_state_of():
    assert {expected for _, expected in STATE_CASES} == set(WorkState)
    branches = re.search(
        r"CREATE FUNCTION workpump\.state_of\(.*?RETURN CASE(.*?)END;", sql_text(), re.S
    )
    assert branches is not None
    # a done row reads as its end_state when it has one: the words the SQL stores there
    assert "coalesce(p_end_state, 'done')" in branches.group(1)
    # stored as a literal, or as the literal a CASE on the outcome picks
    end_states = set(
        re.findall(
            r"end_state\s*=\s*(?:CASE WHEN p_outcome = '[a-z_]+' THEN\s*)?" + WORD,
            sql_text("schema.sql"),
        )
    )
    assert end_states == {WorkState.CANCELLED, WorkState.DISCARDED}
    words = set(re.findall(r"\b(?:THEN|ELSE)\s+" + WORD, branches.group(1)))
    assert words | {"done"} | end_states == set(WorkState)
