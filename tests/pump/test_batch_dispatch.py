"""Dispatcher: what a batch handler's outcome does to each row of its stream run.

``Snooze``/``Discard`` name a row of the batch (the first without ``work=``): the rows
before it complete, it gets the outcome, the rows after it are released; a failure fails
the first row by the handler's ``Retry``; an abandoned batch (its deadline, or a shutdown)
fails its first row and lets go of every other row at once. Runs on a fake coordinator
and a frozen clock; waits are on Events with a timeout.
"""

from __future__ import annotations

import dataclasses
import threading
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest

import django_workpump as workpump
from django_workpump import Work
from django_workpump.clock import FrozenClock
from django_workpump.pump.dispatch import Dispatcher
from django_workpump.pump.lease import LeaseRegistry
from django_workpump.registry import Handler, Registry
from tests.fakes import WAIT, FakeCoordinator, make_row

TOPIC = "totals"


def _run(count: int, stream: str = "s") -> list[Any]:
    """``count`` rows of one stream, as one claim returns a run (stream order)."""
    return [
        dataclasses.replace(make_row("receptor"), topic=TOPIC, stream=stream, payload={"n": n})
        for n in range(count)
    ]


class Pump:
    """A started dispatcher with one batch handler; ``clock`` moves only when told."""

    def __init__(self, func: Callable[[list[Work]], Any], **options: Any) -> None:
        self.coordinator = FakeCoordinator()
        self.clock = FrozenClock()
        self.leases = LeaseRegistry()
        handlers = Registry()
        handlers.register(
            Handler("receptor", TOPIC, func, events=("totals.changed",), batch=True, **options)
        )
        self.dispatcher = Dispatcher(
            self.coordinator,
            handlers,
            self.leases,
            concurrency=1,
            lease_grace_seconds=5,
            clock=self.clock,
        )
        self.dispatcher.start()

    def ids(self, rows: list[Any]) -> list[uuid.UUID]:
        return [row.work_id for row in rows]


@pytest.fixture
def make_pump() -> Iterator[Callable[..., Pump]]:
    pumps: list[Pump] = []

    def make(func: Callable[[list[Work]], Any], **options: Any) -> Pump:
        pumps.append(Pump(func, **options))
        return pumps[-1]

    yield make
    for pump in pumps:
        pump.dispatcher.stop()


def _settled(pump: Pump, *calls: str) -> None:
    assert pump.dispatcher.wait_idle(WAIT)
    for call in calls:
        assert pump.coordinator.wait_for_call(call)


def test_a_snooze_without_work_snoozes_the_first_row_and_releases_the_rest(make_pump):
    def handler(works: list[Work]) -> None:
        raise workpump.Snooze(30)

    pump = make_pump(handler)
    rows = _run(4)
    pump.dispatcher.submit(rows)
    _settled(pump, "snooze", "release")

    assert pump.coordinator.snoozed == [(rows[0].work_id, 30.0)]
    assert pump.coordinator.released == pump.ids(rows[1:])
    assert pump.coordinator.completed == []
    assert pump.coordinator.failed == []
    assert len(pump.leases) == 0


@pytest.mark.parametrize("outcome", ["snooze", "discard"])
def test_a_snooze_or_discard_naming_a_row_completes_the_rows_before_it(make_pump, outcome):
    def handler(works: list[Work]) -> None:
        if outcome == "snooze":
            raise workpump.Snooze(5, work=works[2])
        raise workpump.Discard("poison", work=works[2])

    pump = make_pump(handler)
    rows = _run(5)
    pump.dispatcher.submit(rows)
    _settled(pump, outcome, "release", "complete")

    assert [work_id for work_id, _ in pump.coordinator.completed] == pump.ids(rows[:2])
    if outcome == "snooze":
        assert pump.coordinator.snoozed == [(rows[2].work_id, 5.0)]
        assert pump.dispatcher.stats.snoozed == 1
    else:
        assert pump.coordinator.discarded == [(rows[2].work_id, "poison")]
        assert pump.dispatcher.stats.discarded == 1
    assert pump.coordinator.released == pump.ids(rows[3:])
    # Each write names the lease token of the row it is about.
    tokens = {row.work_id: row.lease_token for row in rows}
    assert all(tokens[work_id] == token for _, work_id, token in pump.coordinator.tokens)
    assert len(pump.leases) == 0
    assert pump.dispatcher.in_flight == 0


def test_a_discard_naming_the_last_row_completes_every_other_row(make_pump):
    def handler(works: list[Work]) -> None:
        raise workpump.Discard("the last one is bad", work=works[-1])

    pump = make_pump(handler)
    rows = _run(3)
    pump.dispatcher.submit(rows)
    _settled(pump, "discard", "complete")

    assert [work_id for work_id, _ in pump.coordinator.completed] == pump.ids(rows[:2])
    assert pump.coordinator.discarded == [(rows[2].work_id, "the last one is bad")]
    assert pump.coordinator.released == []


def test_a_snooze_naming_a_row_outside_the_batch_fails_the_first_row(make_pump):
    stranger = dataclasses.replace(make_row("receptor"), topic=TOPIC)

    def handler(works: list[Work]) -> None:
        raise workpump.Snooze(5, work=dataclasses.replace(works[0], id=stranger.work_id))

    pump = make_pump(handler)
    rows = _run(3)
    pump.dispatcher.submit(rows)
    _settled(pump, "fail", "release")

    [(work_id, error, reason)] = pump.coordinator.failed
    assert (work_id, reason) == (rows[0].work_id, "handler_error")
    assert f"named UUID('{stranger.work_id}'), which is not one of the 3 rows" in error
    assert pump.coordinator.snoozed == []
    assert pump.coordinator.released == pump.ids(rows[1:])


class RateLimited(Exception):
    pass


def test_a_failing_batch_fails_its_first_row_with_the_retry_backoff(make_pump):
    def handler(works: list[Work]) -> None:
        raise RateLimited("slow down")

    retry = workpump.Retry(backoff=lambda attempt, exc: 42.0)
    pump = make_pump(handler, retry=retry)
    rows = _run(3)
    pump.dispatcher.submit(rows)
    _settled(pump, "fail", "release")

    [(work_id, error, reason)] = pump.coordinator.failed
    assert (work_id, reason) == (rows[0].work_id, "handler_error")
    assert error.startswith("tests.pump.test_batch_dispatch.RateLimited: slow down")
    assert pump.coordinator.fail_delays == [42.0]
    assert pump.coordinator.released == pump.ids(rows[1:])


def test_a_batch_error_its_retry_does_not_cover_dead_letters_the_first_row(make_pump):
    def handler(works: list[Work]) -> None:
        raise KeyError("no such account")

    pump = make_pump(handler, retry=workpump.Retry(on=(RateLimited,)))
    rows = _run(3)
    pump.dispatcher.submit(rows)
    _settled(pump, "dead_letter", "release")

    assert [work_id for work_id, _ in pump.coordinator.dead_lettered] == [rows[0].work_id]
    assert pump.coordinator.dead_letter_reasons == ["not_retryable"]
    assert pump.coordinator.failed == []
    assert pump.coordinator.released == pump.ids(rows[1:])


class Blocking:
    """A batch handler that blocks until the test lets it go."""

    def __init__(self) -> None:
        self.started = threading.Event()
        self.release = threading.Event()
        self.calls: list[list[uuid.UUID]] = []

    def __call__(self, works: list[Work]) -> None:
        self.calls.append([work.id for work in works])
        self.started.set()
        assert self.release.wait(WAIT), "the test never let the batch finish"


def test_an_abandoned_batch_fails_its_first_row_and_lets_go_of_every_other_at_once(make_pump):
    handler = Blocking()
    pump = make_pump(handler)
    rows = _run(4)
    pump.dispatcher.submit(rows)
    assert handler.started.wait(WAIT)
    assert len(pump.leases) == 4

    # Past every row's deadline (no renewal came): the renewal tick abandons what expired.
    pump.clock.advance(400)
    expired = pump.leases.expire_due()
    assert len(expired) == 4
    abandoned = [pump.dispatcher.abandon(handle) for handle in expired]

    # The first call gave the whole batch up; the others found nothing left to do.
    assert abandoned == [True, False, False, False]
    assert len(pump.leases) == 0, "a handle of the abandoned batch lingers"
    assert all(handle.disposed for handle in expired)
    assert pump.coordinator.released == pump.ids(rows[1:])
    tokens = {(w, t) for name, w, t in pump.coordinator.tokens if name == "release"}
    assert tokens == {(row.work_id, row.lease_token) for row in rows[1:]}
    assert pump.dispatcher.in_flight == 0
    assert pump.dispatcher.stats.abandoned == 1
    assert pump.coordinator.wait_for_call("fail")
    [(work_id, error, reason)] = pump.coordinator.failed
    assert (work_id, reason) == (rows[0].work_id, "lease_expired")
    assert "batch handler was still running at its lease deadline" in error

    # The stuck thread's late return is dropped; a fresh thread took the slot.
    handler.release.set()
    later = _run(1, stream="t")
    pump.dispatcher.submit(later)
    assert pump.coordinator.wait_for_call("complete")
    assert [work_id for work_id, _ in pump.coordinator.completed] == [later[0].work_id]
    assert pump.dispatcher.wait_idle(WAIT)


def test_a_batch_past_its_timeout_is_failed_with_reason_timeout(make_pump):
    handler = Blocking()
    pump = make_pump(handler, timeout=60)
    rows = _run(3)
    pump.dispatcher.submit(rows)
    assert handler.started.wait(WAIT)

    pump.clock.advance(61)
    for handle in pump.leases.expire_due():
        pump.dispatcher.abandon(handle)
    handler.release.set()

    assert pump.coordinator.wait_for_call("fail")
    [(work_id, error, reason)] = pump.coordinator.failed
    assert (work_id, reason) == (rows[0].work_id, "timeout")
    assert "at its timeout" in error
    assert pump.coordinator.released == pump.ids(rows[1:])
    assert len(pump.leases) == 0


def test_a_batch_still_running_at_the_shutdown_timeout_fails_one_row_and_releases_the_rest(
    make_pump,
):
    handler = Blocking()
    pump = make_pump(handler)
    rows = _run(3)
    queued = _run(1, stream="t")  # behind the batch, on the one thread: never starts
    pump.dispatcher.submit(rows + queued)
    assert handler.started.wait(WAIT)

    pump.dispatcher.stop_accepting()
    assert pump.dispatcher.fail_running(7) == 1  # one handler, however many rows
    assert len([h for h in pump.leases.handles() if h.work_id != queued[0].work_id]) == 0
    handler.release.set()
    assert pump.dispatcher.wait_idle(WAIT)
    assert pump.coordinator.wait_for_call("fail")

    [(work_id, error, reason)] = pump.coordinator.failed
    assert (work_id, reason) == (rows[0].work_id, "shutdown")
    assert "7 s shutdown timeout" in error
    assert sorted(pump.coordinator.released) == sorted(pump.ids(rows[1:] + queued))
    assert pump.coordinator.completed == []
    assert len(pump.leases) == 0
