"""The claim as a statement prepared once per session (PREPARED_STATEMENTS), and what
happens when the session loses it, as behind a transaction pooler."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest
from django.db import connection, transaction

from django_workpump import db, send
from django_workpump.prepared import PreparedQuery
from django_workpump.pump.coordinator import DatabaseCoordinator, InstanceIdentity

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def claim_statement() -> Iterator[PreparedQuery]:
    """The process's claim statement, reset around the test (it is process-wide)."""
    statement = db.claim._claim_statement()

    def reset() -> None:
        statement.disabled = None
        statement._prepared.clear()

    reset()
    yield statement
    reset()


def prepared_here() -> list[str]:
    """The statements the test thread's session holds, from pg_prepared_statements."""
    with connection.cursor() as cursor:
        cursor.execute("SELECT name FROM pg_prepared_statements ORDER BY name")
        return [row[0] for row in cursor.fetchall()]


def claim_one(coordinator: DatabaseCoordinator, topic: str = "emails.welcome") -> list[str]:
    send(topic, {"n": 1})
    return [row.topic for row in coordinator.claim(5)]


@pytest.fixture
def coordinator() -> DatabaseCoordinator:
    coordinator = DatabaseCoordinator(InstanceIdentity(service_name="prepared"))
    coordinator.heartbeat({})
    return coordinator


def test_claims_run_one_statement_prepared_once_per_session(claim_statement, coordinator):
    assert claim_one(coordinator) == ["emails.welcome"]
    assert prepared_here() == [claim_statement.statement]
    pid = connection.connection.info.backend_pid
    assert claim_one(coordinator, "emails.receipt") == ["emails.receipt"]
    # the same session, the same statement: prepared once, executed twice
    assert connection.connection.info.backend_pid == pid
    assert prepared_here() == [claim_statement.statement]
    assert claim_statement.statement.startswith("workpump_claim_work_")
    assert claim_statement.disabled is None


def test_a_new_session_prepares_the_statement_again(claim_statement, coordinator):
    assert claim_one(coordinator) == ["emails.welcome"]
    connection.close()
    assert claim_one(coordinator, "emails.receipt") == ["emails.receipt"]
    assert prepared_here() == [claim_statement.statement]


def test_prepared_statements_off_sends_the_claim_as_text(settings, claim_statement, coordinator):
    settings.WORKPUMP = {"PREPARED_STATEMENTS": False}
    assert claim_one(coordinator) == ["emails.welcome"]
    assert prepared_here() == []


def test_a_claim_inside_the_callers_transaction_is_not_prepared(claim_statement, coordinator):
    with transaction.atomic():
        assert claim_one(coordinator) == ["emails.welcome"]
    assert prepared_here() == []


def test_a_session_that_lost_the_statement_claims_as_text_from_then_on(
    claim_statement, coordinator, caplog
):
    assert claim_one(coordinator) == ["emails.welcome"]
    # What a transaction pooler does: the same client connection, another server
    # session, without the statement.
    with connection.cursor() as cursor:
        cursor.execute("DEALLOCATE ALL")
    with caplog.at_level(logging.WARNING, logger="django_workpump.db"):
        assert claim_one(coordinator, "emails.receipt") == ["emails.receipt"]
    assert claim_statement.disabled is not None
    assert "does not exist" in claim_statement.disabled
    [warning] = [r for r in caplog.records if r.action == "prepared_statement_lost"]
    assert "PREPARED_STATEMENTS" in warning.getMessage()
    # Not prepared again, in this session or a new one.
    assert claim_one(coordinator, "emails.refund") == ["emails.refund"]
    connection.close()
    assert claim_one(coordinator, "emails.notice") == ["emails.notice"]
    assert prepared_here() == []


def test_a_session_that_holds_the_statement_already_uses_it(claim_statement, coordinator):
    assert claim_one(coordinator) == ["emails.welcome"]
    # The process forgot (a pooler gave it back a session it prepared on): PREPARE
    # says it exists, and the claim goes on with it.
    claim_statement._prepared.clear()
    assert claim_one(coordinator, "emails.receipt") == ["emails.receipt"]
    assert prepared_here() == [claim_statement.statement]
    assert claim_statement.disabled is None


def test_a_refused_instance_is_refused_through_the_prepared_statement(claim_statement):
    coordinator = DatabaseCoordinator(InstanceIdentity(service_name="unregistered"))
    with pytest.raises(db.InstanceRefused, match="not registered"):
        coordinator.claim(5)
    assert claim_statement.disabled is None


def test_param_types_must_name_every_placeholder():
    with pytest.raises(ValueError, match="placeholders"):
        PreparedQuery("q", "SELECT %(a)s, %(b)s", {"a": "integer"})


def test_each_connection_keeps_one_cursor_for_its_claims(claim_statement, coordinator):
    assert claim_one(coordinator) == ["emails.welcome"]
    first = connection._workpump_claim_cursor[1]
    assert claim_one(coordinator, "emails.receipt") == ["emails.receipt"]
    assert connection._workpump_claim_cursor[1] is first
    connection.close()
    assert claim_one(coordinator, "emails.refund") == ["emails.refund"]
    # a new connection, a new cursor on it
    assert connection._workpump_claim_cursor[1] is not first
    assert connection._workpump_claim_cursor[0] is connection.connection


def test_a_kept_cursor_remembers_a_bounded_number_of_parsed_timestamps():
    from psycopg.types.datetime import TimestamptzLoader

    loader = db.loaders._once_loader(TimestamptzLoader)(1184, connection.connection)
    first = loader.load(b"2026-01-01 00:00:00+00")
    assert loader.load(b"2026-01-01 00:00:00+00") is first  # parsed once
    for n in range(db.PARSED_ONCE_MAX * 3):
        loader.load(f"2026-01-01 00:00:{n % 60:02d}.{n:06d}+00".encode())
    assert len(loader._parsed) <= db.PARSED_ONCE_MAX


def test_while_django_logs_queries_the_claim_goes_through_a_django_cursor(
    claim_statement, coordinator
):
    from django.test.utils import CaptureQueriesContext

    with CaptureQueriesContext(connection) as queries:
        assert claim_one(coordinator) == ["emails.welcome"]
    claims = [q["sql"] for q in queries.captured_queries if "claim_work(" in q["sql"]]
    assert len(claims) == 1  # logged, as text
    assert prepared_here() == []
    assert claim_one(coordinator, "emails.receipt") == ["emails.receipt"]
    assert prepared_here() == [claim_statement.statement]  # not logged: prepared again
