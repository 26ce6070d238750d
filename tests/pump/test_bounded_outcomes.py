"""Values a handler hands over are stored, or refused where they are made.

A Discard reason with NUL or a lone surrogate, a Snooze or a Retry backoff too far away
for the database (or for Python's dates) used to fail the outcome's write every time:
the lease ran out, the row ran again and spent an attempt, again and again. Each case
here is driven on real PostgreSQL and the row ends in one step.
"""

from __future__ import annotations

import logging
import threading
from datetime import timedelta

import pytest
from django.test import override_settings
from django.utils import timezone

import django_workpump as workpump
from django_workpump import Work, models
from django_workpump.control import MAX_DELAY_SECONDS
from django_workpump.testing import RunReport, run_pending
from tests.fakes import make_dispatcher, make_row
from tests.helpers import FAST_PUMP, wait_until

TOPIC = "bounded.outcome"


# --- Discard reasons ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("reason", "stored"), [("a\x00b", "a\ufffdb"), ("\ud800 gone", "\ufffd gone")]
)
def test_a_discard_reason_postgresql_cannot_store_is_made_storable(reason, stored):
    discard = workpump.Discard(reason)

    assert discard.reason.startswith(stored)
    assert "1 character PostgreSQL cannot store" in discard.reason


@pytest.mark.django_db
@pytest.mark.parametrize("reason", ["a\x00b", "\ud800"])
def test_a_discard_with_such_a_reason_ends_its_row(outbox_handler, reason):
    def discard(work: Work) -> None:
        raise workpump.Discard(reason)

    outbox_handler(TOPIC, discard)
    work_id = workpump.send(TOPIC, {})
    report = RunReport()

    run_pending(report=report)

    assert report.discarded == [work_id]
    row = models.Outbox.objects.get(work_id=work_id)
    assert (row.end_state, row.attempts) == ("discarded", 1)
    assert row.last_error is not None and "\ufffd" in row.last_error


# --- Snooze: refused where it is made ------------------------------------------------------


@pytest.mark.parametrize("seconds", [1e12, 1e15, 1e300, timedelta(days=365.25 * 101)])
def test_a_snooze_past_the_longest_wait_is_refused_naming_the_value_and_the_limit(seconds):
    with pytest.raises(ValueError, match=r"must be at most 100 years \(3155760000 s\)") as info:
        workpump.Snooze(seconds)

    assert repr(seconds) in str(info.value)


def test_a_snooze_of_the_longest_wait_is_taken():
    assert workpump.Snooze(MAX_DELAY_SECONDS).seconds == MAX_DELAY_SECONDS
    assert workpump.Snooze(timedelta(days=365 * 100)).seconds == 365 * 100 * 86400


@pytest.mark.django_db
def test_a_handler_raising_a_too_long_snooze_fails_its_attempt_once(outbox_handler):
    def snooze(work: Work) -> None:
        raise workpump.Snooze(1e15)

    outbox_handler(TOPIC, snooze, max_attempts=3)
    work_id = workpump.send(TOPIC, {})
    report = RunReport()

    run_pending(report=report, raise_errors=False)

    row = models.Outbox.objects.get(work_id=work_id)
    assert [type(f.error) for f in report.failures] == [ValueError] * len(report.failures)
    assert "must be at most 100 years" in (row.last_error or "")
    assert row.failure_reason in ("handler_error", "max_attempts")
    assert row.snoozes == 0  # it never snoozed: nothing the database refused was written


@pytest.mark.django_db
def test_the_longest_snooze_is_stored(outbox_handler):
    def snooze(work: Work) -> None:
        raise workpump.Snooze(MAX_DELAY_SECONDS)

    outbox_handler(TOPIC, snooze)
    work_id = workpump.send(TOPIC, {})
    before = timezone.now()

    run_pending()

    row = models.Outbox.objects.get(work_id=work_id)
    assert (row.attempts, row.snoozes) == (0, 1)
    assert row.scheduled_for is not None and row.scheduled_for.year < 9999
    assert row.scheduled_for - before >= timedelta(seconds=MAX_DELAY_SECONDS - 60)


# --- Retry backoff: known only at run time, cut to the longest wait ----------------------


def test_a_backoff_past_the_longest_wait_is_cut_to_it():
    seen: list[float] = []
    retry = workpump.Retry(backoff=lambda attempt, exc: 1e300)

    assert retry.delay(1, ValueError(), seen.append) == MAX_DELAY_SECONDS
    assert seen == [1e300]
    assert workpump.Retry(backoff=lambda a, e: 10.0).delay(1, ValueError(), seen.append) == 10.0
    assert seen == [1e300]


def test_the_dispatcher_cuts_a_huge_backoff_and_logs_it(caplog):
    caplog.set_level(logging.INFO)

    def handle(work: Work) -> None:
        raise TimeoutError("slow upstream")

    dispatcher, coordinator, _, _ = make_dispatcher(
        handle, retry=workpump.Retry(backoff=lambda attempt, exc: 1e300)
    )
    dispatcher.start()
    try:
        dispatcher.submit([make_row()])
        assert coordinator.wait_for_call("fail")
    finally:
        dispatcher.stop()
    assert coordinator.fail_delays == [MAX_DELAY_SECONDS]
    (record,) = [r for r in caplog.records if getattr(r, "action", None) == "backoff_clamped"]
    assert record.levelno == logging.WARNING
    assert "returned 1e+300 s, over the longest wait (100 years" in record.getMessage()


@pytest.mark.django_db(transaction=True)
@override_settings(WORKPUMP={**FAST_PUMP, "CONCURRENCY": 1})
def test_a_huge_backoff_schedules_the_retry_a_hundred_years_on_in_one_attempt(outbox_handler, pump):
    ran = threading.Event()
    runs: list[int] = []

    def flaky(work: Work) -> None:
        runs.append(work.attempts)
        ran.set()
        raise TimeoutError("slow upstream")

    outbox_handler(TOPIC, flaky, retry=workpump.Retry(backoff=lambda attempt, exc: 1e300))
    work_id = workpump.send(TOPIC, {})
    before = timezone.now()
    pump()

    assert ran.wait(20)
    assert wait_until(
        lambda: models.Outbox.objects.get(work_id=work_id).scheduled_for is not None, 20
    )
    row = models.Outbox.objects.get(work_id=work_id)
    assert (row.attempts, row.failure_reason, row.instance_id) == (1, "handler_error", None)
    assert timedelta(days=36000) < row.scheduled_for - before < timedelta(days=36600)
    assert runs == [1]  # written at once: no lease ran out, nothing ran again
