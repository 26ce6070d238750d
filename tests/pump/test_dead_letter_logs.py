"""Every dead-lettered row is logged once, at ERROR, with its reason and the re-queue.

Each path that parks a row is driven here: the dispatcher's (on a fake coordinator that
answers ``dead``), the claim's undecodable payloads, the claim's own parking of a row
whose last attempt ended without an outcome (real PostgreSQL, through the claim worker
and through ``run_pending``), an operator's action and the command (real PostgreSQL),
and a handler that runs out its timeout on its last attempt under a real pump, whose row
is stored with reason ``timeout``.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import uuid
from collections.abc import Sequence
from datetime import datetime, timedelta
from typing import Any

import pytest
from django.core.management import call_command
from django.test import override_settings

import django_workpump as workpump
from django_workpump import Work, models
from django_workpump.db import Outcome
from django_workpump.pump.claim import ClaimPolicy, ClaimWorker
from django_workpump.pump.coordinator import DatabaseCoordinator, InstanceIdentity
from django_workpump.registry import registry
from django_workpump.states import FailureReason
from django_workpump.testing import run_pending
from django_workpump.work import Lease
from tests.fakes import WAIT, FakeCoordinator, FakeSink, make_dispatcher, make_row
from tests.helpers import FAST_PUMP, enroll, scalar, wait_until
from tests.sql.test_claim import CATEGORIES, TOPICS, A, claim, make, row


def dead_letter_logs(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if getattr(r, "action", None) == "dead_lettered"]


def assert_one_error(caplog: pytest.LogCaptureFixture, work_id: uuid.UUID, reason: str) -> str:
    """The one dead-letter record of ``work_id``; return its message."""
    (record,) = dead_letter_logs(caplog)
    message = record.getMessage()
    assert record.levelno == logging.ERROR
    assert (record.workpump_id, record.workpump_reason) == (str(work_id), reason)
    assert f"with reason {reason}" in message
    assert "re-queues it" in message and f"manage.py workpump_action requeue {work_id}" in message
    return message


class DeadCoordinator(FakeCoordinator):
    """Answers every failure and snooze ``dead``: each row is on its last attempt."""

    def fail(self, leases: Sequence[Lease], *args: Any, **kwargs: Any) -> Any:
        super().fail(leases, *args, **kwargs)
        return [Outcome(lease.id, "dead") for lease in leases]

    def snooze(self, leases: Sequence[Lease], *args: Any) -> Any:
        super().snooze(leases, *args)
        return [Outcome(lease.id, "dead") for lease in leases]


def run_to_its_end(func: Any, caplog: pytest.LogCaptureFixture, **options: Any) -> Any:
    caplog.set_level(logging.INFO)
    dispatcher, coordinator, _, _ = make_dispatcher(func, DeadCoordinator(), **options)
    row = make_row()
    dispatcher.start()
    try:
        dispatcher.submit([row])
        assert dispatcher.wait_idle(WAIT)
    finally:
        dispatcher.stop()  # the final flush writes queued failures
    return row, coordinator


def test_a_not_retryable_exception_logs_its_dead_letter(caplog):
    def handle(work: Work) -> None:
        raise KeyError("no such account")

    row, _ = run_to_its_end(handle, caplog, retry=workpump.Retry(on=(TimeoutError,)))

    message = assert_one_error(caplog, row.work_id, FailureReason.NOT_RETRYABLE)
    assert "KeyError: 'no such account'" in message
    assert "(topic 'orders.created', attempt 1/10)" in message


def test_a_failed_last_attempt_logs_its_dead_letter_as_max_attempts(caplog):
    def handle(work: Work) -> None:
        raise ValueError("still broken")

    row, _ = run_to_its_end(handle, caplog)

    message = assert_one_error(caplog, row.work_id, FailureReason.MAX_ATTEMPTS)
    assert "ValueError: still broken" in message


def test_a_snooze_over_the_maximum_on_the_last_attempt_logs_its_dead_letter(caplog):
    def handle(work: Work) -> None:
        raise workpump.Snooze(5)

    row, _ = run_to_its_end(handle, caplog)

    message = assert_one_error(caplog, row.work_id, FailureReason.MAX_ATTEMPTS)
    assert "MAX_SNOOZES" in message


def test_an_undecodable_payload_logs_its_dead_letter(caplog):
    caplog.set_level(logging.INFO)
    bad = dataclasses.replace(make_row(), payload={}, payload_error="not JSON")
    worker = ClaimWorker(FakeCoordinator(claims=[[bad]]), FakeSink(free=4), ClaimPolicy())

    worker.run_once()

    message = assert_one_error(caplog, bad.work_id, FailureReason.UNDECODABLE_PAYLOAD)
    assert "the payload cannot be decoded: not JSON" in message
    assert "fix its payload first" in message


def expired_lease_on_the_last_attempt(category: str, topic: str | None = None) -> uuid.UUID:
    """A row of ``category`` with one attempt, leased by instance A a minute ago for 10 s:
    its holder died, the lease ran out (A itself is alive, so nobody evicts it)."""
    now: datetime = scalar("SELECT now()")
    enroll(A, now)
    work_id = make(category, "s-1", topic=topic, max_attempts=1)
    assert len(claim(A, now - timedelta(seconds=60), p_lease_seconds=10)) == 1
    return work_id


def claim_worker(sink: FakeSink | None = None) -> ClaimWorker:
    """A claim worker of a second instance, over the database."""
    coordinator = DatabaseCoordinator(InstanceIdentity(service_name="dead-letter-logs"))
    coordinator.heartbeat({})
    return ClaimWorker(coordinator, sink or FakeSink(free=4), ClaimPolicy())


@pytest.mark.django_db
@pytest.mark.parametrize("category", CATEGORIES)
def test_a_row_the_claim_parks_at_its_attempt_cap_logs_its_dead_letter(category, caplog):
    caplog.set_level(logging.INFO)
    work_id = expired_lease_on_the_last_attempt(category)
    sink = FakeSink(free=4)
    worker = claim_worker(sink)

    assert worker.run_once().claimed == 0

    message = assert_one_error(caplog, work_id, FailureReason.MAX_ATTEMPTS)
    stored = row(category, work_id)
    assert stored["dead_lettered_at"] is not None
    assert stored["failure_reason"] == FailureReason.MAX_ATTEMPTS
    assert stored["last_error"].startswith(
        f"attempt 1 ended without a reported outcome: the lease of instance {A} expired at "
    )
    assert f"with reason max_attempts: {stored['last_error']}. It is parked" in message
    (record,) = dead_letter_logs(caplog)
    assert (record.workpump_category, record.workpump_topic, record.workpump_stream) == (
        category,
        TOPICS[category],
        "s-1",
    )
    assert (record.workpump_attempt, record.workpump_max_attempts) == (1, 1)
    assert sink.batches == []
    # parked for good: the next claims find it no more, and log nothing more
    assert worker.run_once().claimed == 0
    assert len(dead_letter_logs(caplog)) == 1


@pytest.mark.django_db
def test_a_claim_that_parks_nothing_logs_no_dead_letter(caplog):
    caplog.set_level(logging.INFO)
    now: datetime = scalar("SELECT now()")
    enroll(A, now)
    taken_over = make("outbox", "s-1", max_attempts=2)  # an expired lease, an attempt left
    claim(A, now - timedelta(seconds=60), p_lease_seconds=10)
    ready = make("outbox", "s-2")
    sink = FakeSink(free=4)

    assert claim_worker(sink).run_once().claimed == 2

    assert {r.work_id for batch in sink.batches for r in batch} == {taken_over, ready}
    assert dead_letter_logs(caplog) == []


@pytest.mark.django_db
def test_run_pending_logs_a_row_the_claim_parks_once(caplog):
    caplog.set_level(logging.INFO)
    ran: list[Work] = []
    workpump.outbox_handler("logs.parked")(ran.append)
    try:
        work_id = expired_lease_on_the_last_attempt("outbox", topic="logs.parked")
        assert run_pending() == 0
        assert run_pending() == 0
    finally:
        registry.unregister("outbox", "logs.parked")

    assert ran == []
    message = assert_one_error(caplog, work_id, FailureReason.MAX_ATTEMPTS)
    assert f"the lease of instance {A} expired at" in message


@pytest.mark.django_db
def test_an_operators_dead_letter_logs_once_when_it_commits(
    caplog, django_capture_on_commit_callbacks
):
    caplog.set_level(logging.INFO)
    work_id = workpump.send("logs.operator", {})

    with django_capture_on_commit_callbacks(execute=True) as callbacks:
        assert workpump.dead_letter([work_id], "bad data") == [work_id]
        assert dead_letter_logs(caplog) == []  # not before the commit
    assert len(callbacks) == 1

    message = assert_one_error(caplog, work_id, "bad data")
    assert "by an operator" in message
    # parked already: dead-lettering it again changes nothing and logs nothing
    with django_capture_on_commit_callbacks(execute=True):
        assert workpump.dead_letter([work_id], "again") == []
    assert len(dead_letter_logs(caplog)) == 1


@pytest.mark.django_db(transaction=True)
def test_the_commands_dead_letter_logs_each_row_and_a_dry_run_none(caplog):
    caplog.set_level(logging.INFO)
    work_id = workpump.send("logs.command", {})

    call_command("workpump_action", "dead-letter", str(work_id), "--dry-run", "--yes")
    assert dead_letter_logs(caplog) == []
    assert models.Outbox.objects.get(work_id=work_id).dead_lettered_at is None

    call_command("workpump_action", "dead-letter", str(work_id), "--yes")
    assert_one_error(caplog, work_id, "dead-lettered by workpump_action")


@pytest.mark.django_db(transaction=True)
@override_settings(WORKPUMP={**FAST_PUMP, "CONCURRENCY": 1})
def test_a_timeout_on_the_last_attempt_is_stored_and_logged_as_timeout(pump, caplog):
    caplog.set_level(logging.INFO)
    release = threading.Event()

    def stuck(work: Work) -> None:
        release.wait(30)  # never looks at work.cancelled: abandoned at its timeout

    workpump.outbox_handler("logs.timeout", max_attempts=1, timeout=0.5)(stuck)
    try:
        work_id = workpump.send("logs.timeout", {})
        pump()
        assert wait_until(
            lambda: models.Outbox.objects.get(work_id=work_id).dead_lettered_at is not None,
            20,
        )
        # The record is written after the failure commits: wait for it too.
        assert wait_until(lambda: dead_letter_logs(caplog), 20)
    finally:
        release.set()
        registry.unregister("outbox", "logs.timeout")
    row = models.Outbox.objects.get(work_id=work_id)
    assert (row.failure_reason, row.attempts) == ("timeout", 1)
    message = assert_one_error(caplog, work_id, FailureReason.TIMEOUT)
    assert "end of its timeout" in message
    abandoned = [r for r in caplog.records if getattr(r, "action", None) == "abandoned"]
    assert "end of its timeout" in abandoned[0].getMessage()
