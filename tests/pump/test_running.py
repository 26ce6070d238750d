"""HandlerRunner: what a handler did comes back as one outcome value, never as a raise."""

from __future__ import annotations

import threading
from typing import Any

import pytest

import django_workpump as workpump
from django_workpump.clock import FrozenClock
from django_workpump.pump.jobs import Job, Run
from django_workpump.pump.lease import LeaseHandle
from django_workpump.pump.outcomes import (
    Completed,
    Discarded,
    Failed,
    Released,
    Snoozed,
)
from django_workpump.pump.running import HandlerRunner
from django_workpump.registry import Handler
from django_workpump.states import FailureReason
from django_workpump.work import Lease
from tests.fakes import make_row


def make_job() -> Job:
    row = make_row()
    clock = FrozenClock()
    handle = LeaseHandle(
        row.category, row.work_id, clock.monotonic() + 60, 3, clock, lease_token=row.lease_token
    )
    return Job(row, handle)


@pytest.fixture
def runner():
    written: list[Any] = []
    made = HandlerRunner(
        lambda leases, results: written.append((leases, results)) or [],
        alias="default",
        middleware=(),
        stopping=threading.Event(),
        instance_id=lambda: None,
    )
    yield made
    made.discard_loop()
    assert written == []  # only an atomic handler writes from here


def handler(func: Any, **options: Any) -> Handler:
    return Handler("outbox", "orders.created", func, **options)


def raising(exc: BaseException) -> Any:
    def handle(work: Any) -> None:
        raise exc

    return handle


def test_a_handler_that_returns_completes_its_row_with_the_result(runner):
    assert runner.run(handler(lambda work: None), make_job()) == Completed(None)
    got = runner.run(handler(lambda work: {"total": 3}), make_job())
    assert isinstance(got, Completed) and '"total"' in (got.result or "")


def test_an_async_handler_is_awaited_on_the_thread_loop(runner):
    async def handle(work: Any) -> dict[str, int]:
        return {"n": work.attempts}

    got = runner.run(handler(handle), make_job())
    assert isinstance(got, Completed) and '"n"' in (got.result or "")


def test_the_control_exceptions_become_their_outcomes(runner):
    assert runner.run(handler(raising(workpump.Snooze(30))), make_job()) == Snoozed(30)
    assert runner.run(handler(raising(workpump.Discard("poison"))), make_job()) == Discarded(
        "poison"
    )
    assert runner.run(handler(raising(workpump.Release())), make_job()) == Released()


def test_a_failure_follows_the_handlers_retry_policy(runner):
    plain = runner.run(handler(raising(ValueError("bad total"))), make_job())
    assert isinstance(plain, Failed)
    assert (plain.reason, plain.backoff) == (FailureReason.HANDLER_ERROR, None)
    assert "ValueError: bad total" in plain.error

    own_delay = workpump.Retry(backoff=lambda attempt, exc: 7.0)
    delayed = runner.run(handler(raising(ValueError("x")), retry=own_delay), make_job())
    assert isinstance(delayed, Failed) and delayed.backoff == 7.0

    only_timeouts = workpump.Retry(on=(TimeoutError,))
    fatal = runner.run(handler(raising(ValueError("x")), retry=only_timeouts), make_job())
    assert isinstance(fatal, Failed) and fatal.reason == FailureReason.NOT_RETRYABLE


def test_a_row_with_no_handler_fails_as_such(runner):
    got = runner.run(None, make_job())
    assert isinstance(got, Failed) and got.reason == FailureReason.NO_HANDLER
    assert "no handler registered for" in got.error


def test_a_batch_snooze_names_the_row_it_means(runner):
    jobs = [make_job(), make_job(), make_job()]
    works = [runner.work_for(job) for job in jobs]

    def handle(batch: list[Any]) -> None:
        raise workpump.Snooze(5, work=batch[1])

    got = runner.run_batch(handler(handle, batch=True), jobs, works, Run(jobs))
    assert got == (Snoozed(5), 1)


def test_a_job_names_its_claims_lease():
    job = make_job()
    assert job.lease == Lease(job.row.category, job.row.work_id, job.row.lease_token)
    assert job.handle.lease == job.lease
