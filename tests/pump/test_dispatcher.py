"""Dispatcher: a row claimed again by this instance while its older attempt still runs here.

The database can hand the same row back to the instance that is still running it (an
operator force-released it, or its lease ran out); the older attempt is then superseded.
Runs on a fake coordinator and a frozen clock; waits are on Events with a timeout.
"""

from __future__ import annotations

import dataclasses
import threading
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from django_workpump import Work
from django_workpump.clock import FrozenClock
from django_workpump.pump.dispatch import Dispatcher
from django_workpump.pump.lease import LeaseRegistry
from django_workpump.registry import Handler, Registry
from tests.fakes import TOPIC, WAIT, FakeCoordinator, make_row, watching


class Attempts:
    """A handler that blocks each attempt until the test lets it go, recording what it saw."""

    def __init__(self) -> None:
        self.started: dict[int, threading.Event] = {1: threading.Event(), 2: threading.Event()}
        self.release: dict[int, threading.Event] = {1: threading.Event(), 2: threading.Event()}
        self.seen: dict[int, Work] = {}

    def __call__(self, work: Work) -> str:
        self.seen[work.attempts] = work
        self.started[work.attempts].set()
        assert self.release[work.attempts].wait(WAIT), "the test never let the attempt finish"
        return f"attempt {work.attempts}"


def attempts_dispatcher(
    concurrency: int,
) -> tuple[Dispatcher, FakeCoordinator, Attempts, LeaseRegistry]:
    """A dispatcher (not started) running ``Attempts`` for make_row's topic."""
    coordinator = FakeCoordinator()
    handler = Attempts()
    handlers = Registry()
    handlers.register(Handler("outbox", TOPIC, handler))
    leases = LeaseRegistry()
    dispatcher = Dispatcher(
        coordinator,
        handlers,
        leases,
        concurrency=concurrency,
        lease_grace_seconds=5,
        clock=FrozenClock(),
    )
    return dispatcher, coordinator, handler, leases


@pytest.fixture
def setup() -> Iterator[tuple[Dispatcher, FakeCoordinator, Attempts, LeaseRegistry]]:
    dispatcher, coordinator, handler, leases = attempts_dispatcher(concurrency=2)
    dispatcher.start()
    yield dispatcher, coordinator, handler, leases
    for event in handler.release.values():
        event.set()
    dispatcher.stop()


def _again(row: Any) -> Any:
    """The row as the next claim returns it: one attempt more, a new lease token."""
    return dataclasses.replace(row, attempts=row.attempts + 1, lease_token=uuid.uuid4())


def test_a_row_claimed_again_while_it_runs_supersedes_the_older_attempt(setup):
    dispatcher, coordinator, handler, leases = setup
    first = make_row()
    dispatcher.submit([first])
    assert handler.started[1].wait(WAIT)

    with watching("django_workpump.dispatch") as log:
        dispatcher.submit([_again(first)])  # no DuplicateLease: the claimer must live on
        assert log.wait_for("superseded")
    assert handler.started[2].wait(WAIT)
    # The older attempt is told its lease is gone; the new one holds the registry slot.
    assert handler.seen[1].lease.cancel_reason == "lost"
    assert handler.seen[2].cancelled is False
    assert leases.get("outbox", first.work_id) is handler.seen[2].lease

    with watching("django_workpump.dispatch") as log:
        handler.release[1].set()
        assert log.wait_for("superseded_outcome_dropped")
    handler.release[2].set()
    assert coordinator.wait_for_call("complete")
    assert dispatcher.wait_idle(WAIT)
    # Only the newer attempt's outcome reaches the database, under the newer claim's token.
    assert coordinator.completed == [(first.work_id, '"attempt 2"')]
    assert coordinator.tokens == [("complete", first.work_id, handler.seen[2].lease_token)]
    assert handler.seen[2].lease_token != first.lease_token
    assert dispatcher.stats.superseded == 1
    assert dispatcher.in_flight == 0
    assert len(leases) == 0


def test_a_superseded_attempt_that_never_started_neither_runs_nor_releases_the_row(setup):
    dispatcher, coordinator, handler, leases = setup
    blockers = [make_row(), make_row()]  # fill both threads
    queued = make_row()
    dispatcher.submit([blockers[0], blockers[1], queued])
    assert handler.started[1].wait(WAIT)

    dispatcher.submit([_again(queued)])
    handler.release[1].set()  # both blockers (attempt 1) finish and free their threads
    assert handler.started[2].wait(WAIT)
    handler.release[2].set()
    assert dispatcher.wait_idle(WAIT)
    assert coordinator.wait_for_call("complete")

    # A release by the stale attempt would have handed back the row's new lease.
    assert coordinator.released == []
    assert handler.seen[2].id == queued.work_id
    assert dispatcher.stats.superseded == 1
    assert dispatcher.stats.started == 3  # two blockers and the new attempt, not the stale one
    assert len(leases) == 0


def test_a_finished_attempt_whose_handle_is_not_yet_disposed_does_not_block_the_new_claim(setup):
    dispatcher, _coordinator, handler, leases = setup
    first = make_row()
    dispatcher.submit([first])
    assert handler.started[1].wait(WAIT)
    job = dispatcher._jobs[(first.category, first.work_id)]
    # The moment between a job finishing and its handle being disposed.
    with job.lock:
        job.state = "finished"

    dispatcher.submit([_again(first)])
    assert handler.started[2].wait(WAIT)
    assert job.handle.disposed
    assert leases.get("outbox", first.work_id) is handler.seen[2].lease
    assert dispatcher.stats.superseded == 0  # its outcome stands; nothing was superseded
    handler.release[1].set()
    handler.release[2].set()
    assert dispatcher.wait_idle(WAIT)
    assert len(leases) == 0


def test_every_outcome_and_release_names_the_lease_token_of_its_own_claim():
    coordinator = FakeCoordinator()
    handlers = Registry()
    handlers.register(Handler("outbox", "ok", lambda work: None))

    def boom(work: Work) -> None:
        raise RuntimeError("boom")

    handlers.register(Handler("outbox", "boom", boom))
    clock = FrozenClock()
    dispatcher = Dispatcher(
        coordinator, handlers, LeaseRegistry(), concurrency=1, lease_grace_seconds=5, clock=clock
    )
    done = dataclasses.replace(make_row(), topic="ok")
    failed = dataclasses.replace(make_row(), topic="boom")
    # A lease shorter than the grace: the row's deadline has passed before it could start.
    unstarted = make_row(lease_seconds=1)
    dispatcher.submit([done, failed, unstarted])
    dispatcher.start()
    try:
        assert dispatcher.wait_idle(WAIT)
    finally:
        dispatcher.stop()

    assert sorted(coordinator.tokens) == sorted(
        [
            ("complete", done.work_id, done.lease_token),
            ("fail", failed.work_id, failed.lease_token),
            ("release", unstarted.work_id, unstarted.lease_token),
        ]
    )


class Halt(BaseException):
    """A BaseException of the handler's own, outside the Exception tree."""


BASE_EXCEPTIONS = [
    pytest.param(SystemExit(3), "SystemExit: 3", id="SystemExit"),
    pytest.param(KeyboardInterrupt(), "KeyboardInterrupt", id="KeyboardInterrupt"),
    pytest.param(GeneratorExit(), "GeneratorExit", id="GeneratorExit"),
    pytest.param(Halt("stop now"), "tests.pump.test_dispatcher.Halt: stop now", id="custom"),
]


@pytest.mark.parametrize("is_async", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize(("exc", "headline"), BASE_EXCEPTIONS)
def test_a_base_exception_from_a_handler_fails_its_attempt_and_the_thread_lives_on(
    exc, headline, is_async
):
    coordinator = FakeCoordinator()
    handlers = Registry()
    if is_async:

        async def raising(work: Work) -> None:
            raise exc

        handlers.register(Handler("outbox", "raises", raising))
    else:

        def raising_sync(work: Work) -> None:
            raise exc

        handlers.register(Handler("outbox", "raises", raising_sync))
    handlers.register(Handler("outbox", "ok", lambda work: "fine"))
    leases = LeaseRegistry()
    # One thread: the row after the raising one runs only if that thread survived.
    dispatcher = Dispatcher(
        coordinator, handlers, leases, concurrency=1, lease_grace_seconds=5, clock=FrozenClock()
    )
    raised = dataclasses.replace(make_row(), topic="raises")
    after = dataclasses.replace(make_row(), topic="ok")
    dispatcher.start()
    try:
        dispatcher.submit([raised, after])
        assert dispatcher.wait_idle(WAIT)
        assert coordinator.wait_for_call("fail")
        assert coordinator.wait_for_call("complete")
    finally:
        dispatcher.stop()

    [(work_id, error, reason)] = coordinator.failed
    assert (work_id, reason) == (raised.work_id, "handler_error")
    assert error.splitlines()[0] == headline
    assert coordinator.completed == [(after.work_id, '"fine"')]
    assert coordinator.released == []
    assert dispatcher.stats.failed == 1
    assert dispatcher.in_flight == 0
    assert len(leases) == 0


def test_a_graceful_stop_tells_running_handlers_releases_queued_rows_and_fails_stragglers():
    dispatcher, coordinator, handler, leases = attempts_dispatcher(concurrency=1)
    running, queued = make_row(), make_row()
    dispatcher.start()
    try:
        dispatcher.submit([running, queued])
        assert handler.started[1].wait(WAIT)

        dispatcher.stop_accepting()
        work = handler.seen[1]
        # Told at once; its lease stays live and renewable meanwhile.
        assert work.cancelled is True
        assert work.lease.cancel_reason is None
        assert work.lease.can_renew()
        assert dispatcher.fail_running(7) == 1
        assert coordinator.wait_for_call("fail")
        handler.release[1].set()  # it returns late; the queued row is released unstarted
        assert coordinator.wait_for_call("release")
        assert dispatcher.wait_idle(WAIT)
    finally:
        handler.release[1].set()
        dispatcher.stop()

    [(work_id, error, reason)] = coordinator.failed
    assert (work_id, reason) == (running.work_id, "shutdown")
    assert "7 s shutdown timeout" in error
    assert coordinator.released == [queued.work_id]
    assert coordinator.completed == []  # the late outcome was dropped
    assert dispatcher.stats.started == 1
    assert len(leases) == 0


def test_rows_handed_over_at_the_front_start_before_the_rows_queued_earlier():
    # an underserved fairness group's row (claimed with every slot busy) starts next
    order: list[str] = []
    started, gate = threading.Event(), threading.Event()
    handlers = Registry()

    def handler(work: Work) -> None:
        order.append(work.payload["name"])
        started.set()
        assert gate.wait(WAIT)

    handlers.register(Handler("outbox", TOPIC, handler))
    coordinator = FakeCoordinator()
    dispatcher = Dispatcher(
        coordinator, handlers, LeaseRegistry(), concurrency=1, clock=FrozenClock()
    )
    dispatcher.start()
    try:

        def row(name: str) -> Any:
            return dataclasses.replace(make_row(), payload={"name": name})

        dispatcher.submit([row("running")])
        assert started.wait(WAIT)  # the one slot is busy
        dispatcher.submit([row("noisy 1"), row("noisy 2")])
        dispatcher.submit([row("quiet 1"), row("quiet 2")], front=True)
        dispatcher.submit([row("noisy 3")])
        gate.set()
        assert dispatcher.wait_idle(WAIT)
    finally:
        gate.set()
        dispatcher.stop()
    assert order == ["running", "quiet 1", "quiet 2", "noisy 1", "noisy 2", "noisy 3"]
