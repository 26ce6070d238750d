"""``workpump.Release`` and ``work.cancel_reason`` in the dispatcher.

The dispatcher runs handlers on a fake coordinator and a frozen clock; each test waits on
Events (with a timeout), never on sleeps. The end-to-end run on PostgreSQL is in
tests/pump/test_cancel_integration.py.
"""

from __future__ import annotations

import dataclasses
import threading
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest

import django_workpump as workpump
from django_workpump import Work
from django_workpump.db import ClaimedWork
from django_workpump.states import FailureReason, StopReason
from tests.fakes import WAIT, make_dispatcher, make_row


def stops_when_told(seen: list[Any], started: threading.Event) -> Any:
    """A handler that loops until ``work.cancelled``, notes why, and hands the row back."""

    def handle(work: Work) -> None:
        seen.append(work.cancel_reason)
        started.set()
        while not work.cancelled:
            work.lease.cancelled.wait(0.01)
        seen.append(work.cancel_reason)
        raise workpump.Release()

    return handle


@contextmanager
def running_until_told(
    **options: Any,
) -> Iterator[tuple[list[Any], ClaimedWork, Any, Any, Any, Any]]:
    """A dispatcher (``make_dispatcher`` options) running ``stops_when_told`` on one row,
    entered once the handler has started and stopped on exit: what the handler saw, the
    row, and the dispatcher, coordinator, leases and clock."""
    seen: list[Any] = []
    started = threading.Event()
    dispatcher, coordinator, leases, clock = make_dispatcher(
        stops_when_told(seen, started), **options
    )
    dispatcher.start()
    try:
        row = make_row()
        dispatcher.submit([row])
        assert started.wait(WAIT)
        yield seen, row, dispatcher, coordinator, leases, clock
    finally:
        dispatcher.stop()


def test_a_release_at_shutdown_gives_the_row_back_with_its_attempt():
    with running_until_told() as (seen, row, dispatcher, coordinator, _, _):
        dispatcher.stop_accepting()

        assert coordinator.wait_for_call("release")
        assert dispatcher.wait_idle(WAIT)
    assert seen == [None, StopReason.SHUTDOWN] and seen[1] == "shutdown"
    assert coordinator.tokens == [("release", row.work_id, row.lease_token)]
    assert coordinator.failed == coordinator.completed == []
    assert dispatcher.stats.released == 1


def test_an_operator_cancel_says_operator_and_a_release_writes_nothing():
    with running_until_told() as (seen, row, dispatcher, coordinator, _, _):
        assert dispatcher.cancel_running("outbox", [(row.work_id, row.lease_token)]) == 1

        assert dispatcher.wait_idle(WAIT)
    assert seen == [None, StopReason.OPERATOR] and seen[1] == "operator"
    assert coordinator.tokens == []  # the row ended cancelled; the database fences it anyway
    assert dispatcher.stats.cancelled == 1


def test_a_release_at_the_timeout_counts_the_attempt_as_timed_out():
    with running_until_told(timeout=20) as (seen, row, _, coordinator, leases, clock):
        clock.advance(21)
        assert len(leases.expire_due()) == 1  # the lease monitor's turn: cancelled

        assert coordinator.wait_for_call("fail")
    assert seen == [None, StopReason.DEADLINE]
    ((work_id, error, reason),) = coordinator.failed
    assert (work_id, reason) == (row.work_id, FailureReason.TIMEOUT)
    assert "end of its timeout" in error
    assert coordinator.fail_delays == [None]  # the usual backoff
    assert coordinator.released == []


def test_a_release_of_its_own_accord_counts_the_attempt_and_retries_at_once(run):
    def handle(work: Work) -> None:
        assert work.cancel_reason is None and not work.cancelled
        raise workpump.Release()

    row = make_row()
    _dispatcher, coordinator = run(handle, [row])

    assert coordinator.wait_for_call("fail")
    ((work_id, error, reason),) = coordinator.failed
    assert (work_id, reason) == (row.work_id, FailureReason.RELEASED)
    assert error == "the handler released the row unfinished"
    assert coordinator.fail_delays == [0.0]
    assert coordinator.released == [] and coordinator.completed == []


def test_a_lost_lease_says_lease_lost():
    with running_until_told() as (seen, row, dispatcher, coordinator, leases, _):
        handle = leases.get("outbox", row.work_id)
        assert handle is not None
        handle.cancel("lost")  # what a refused renewal does

        assert coordinator.wait_for_call("release")  # fenced out by the database
        assert dispatcher.wait_idle(WAIT)
    assert seen == [None, StopReason.LEASE_LOST]
    assert coordinator.failed == []


@pytest.mark.parametrize("stopping", [True, False])
def test_a_batch_release_gives_every_row_back_at_shutdown_else_fails_the_first(stopping):
    started = threading.Event()

    def handle(works: list[Work]) -> None:
        started.set()
        while stopping and not works[0].cancelled:
            works[0].lease.cancelled.wait(0.01)
        raise workpump.Release()

    rows = [dataclasses.replace(make_row(), stream="s") for _ in range(3)]
    dispatcher, coordinator, _, _ = make_dispatcher(handle, batch=True)
    dispatcher.start()
    try:
        dispatcher.submit(rows)
        assert started.wait(WAIT)
        if stopping:
            dispatcher.stop_accepting()
        assert dispatcher.wait_idle(WAIT)
        if not stopping:
            assert coordinator.wait_for_call("fail")
    finally:
        dispatcher.stop()
    ids = [row.work_id for row in rows]
    if stopping:
        assert sorted(coordinator.released) == sorted(ids)
        assert coordinator.failed == []
    else:
        assert [(i, r) for i, _, r in coordinator.failed] == [(ids[0], FailureReason.RELEASED)]
        assert sorted(coordinator.released) == sorted(ids[1:])


def test_release_is_public_and_takes_no_arguments():
    assert workpump.Release is not None and "Release" in workpump.__all__
    with pytest.raises(TypeError):
        workpump.Release(uuid.uuid4())  # type: ignore[call-arg]


@pytest.mark.django_db
def test_run_pending_treats_a_release_as_the_handlers_own_decision():
    from django_workpump import models
    from django_workpump.registry import registry
    from django_workpump.testing import RunReport, run_pending

    runs: list[int] = []

    @workpump.outbox_handler("release.in.tests")
    def once_more(work: Work) -> str:
        runs.append(work.attempts)
        if len(runs) == 1:
            raise workpump.Release()
        return "second time"

    try:
        work_id = workpump.send("release.in.tests", {})
        report = RunReport()
        run_pending(report=report)
    finally:
        registry.unregister("outbox", "release.in.tests")

    assert report.released == [work_id]
    assert runs == [1, 2]  # the first attempt counted, the row claimable again at once
    row = models.Outbox.objects.get(work_id=work_id)
    assert (row.attempts, row.result, row.failure_reason) == (2, "second time", "released")
