"""Snooze, Discard, Retry and timeout in Python, and how a cancel reaches a running handler.

The exceptions and the registration options are checked for bad input; the dispatcher
runs handlers on a fake coordinator and a frozen clock, and each test waits on Events
(with a timeout), never on sleeps.
"""

from __future__ import annotations

import asyncio
import json
import math
import threading
import uuid
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
from django.core.exceptions import ImproperlyConfigured

import django_workpump as workpump
from django_workpump import Work
from django_workpump.clock import FrozenClock
from django_workpump.pump.lease import LeaseRegistry
from django_workpump.pump.notify import CancelHint, NotifyGate
from django_workpump.pump.renewal import LeaseRenewalWorker, RenewalRequest
from django_workpump.registry import registry
from django_workpump.states import CancelReason, FailureReason
from tests.fakes import WAIT, FakeCoordinator, make_dispatcher, make_row

# --- bad input ---------------------------------------------------------------------------


@pytest.mark.parametrize("seconds", [-1, -0.001, float("inf"), float("nan"), timedelta(-1)])
def test_a_negative_or_non_finite_snooze_names_the_argument(seconds):
    with pytest.raises(ValueError, match=r"workpump\.Snooze\(seconds\) must be finite and >= 0"):
        workpump.Snooze(seconds)


@pytest.mark.parametrize("seconds", ["10", None, True])
def test_a_snooze_of_no_number_names_the_argument(seconds):
    with pytest.raises(ValueError, match=r"workpump\.Snooze\(seconds\) must be a number"):
        workpump.Snooze(seconds)


def test_a_snooze_takes_seconds_or_a_timedelta():
    assert workpump.Snooze(0).seconds == 0.0
    assert workpump.Snooze(2.5).seconds == 2.5
    assert workpump.Snooze(timedelta(minutes=2)).seconds == 120.0


@pytest.mark.parametrize("reason", ["", "   ", None, 3])
def test_a_discard_needs_a_reason(reason):
    with pytest.raises(ValueError, match=r"workpump\.Discard\(reason\) needs a non-empty string"):
        workpump.Discard(reason)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_attempts": 0}, r"Retry\(max_attempts=\.\.\.\) must be a whole number >= 1"),
        ({"max_attempts": 2.5}, r"Retry\(max_attempts=\.\.\.\) must be a whole number >= 1"),
        ({"backoff": 30}, r"Retry\(backoff=\.\.\.\) must be a callable backoff\(attempt, exc\)"),
        ({"on": ()}, r"Retry\(on=\.\.\.\) must be a non-empty tuple of exception types"),
        ({"on": ("TimeoutError",)}, r"Retry\(on=\.\.\.\) must name exception classes"),
        ({"on": (int,)}, r"Retry\(on=\.\.\.\) must name exception classes"),
    ],
)
def test_bad_retry_arguments_name_the_argument_and_the_fix(kwargs, message):
    with pytest.raises(ImproperlyConfigured, match=message):
        workpump.Retry(**kwargs)


def test_retry_on_takes_one_class_or_several():
    assert workpump.Retry(on=TimeoutError).on == (TimeoutError,)
    policy = workpump.Retry(on=[TimeoutError, ConnectionError])
    assert policy.retries(TimeoutError()) and policy.retries(ConnectionResetError())
    assert not policy.retries(ValueError())
    assert workpump.Retry().retries(ValueError())  # None: every exception retries


@pytest.mark.parametrize("returned", [-1, float("nan"), "soon"])
def test_a_backoff_returning_no_valid_delay_is_an_error_naming_it(returned):
    def backoff(attempt: int, exc: BaseException) -> Any:
        return returned

    with pytest.raises(ValueError, match=r"Retry\(backoff=.*backoff\)"):
        workpump.Retry(backoff=backoff).delay(1, RuntimeError())


@pytest.fixture
def clean_registry() -> Iterator[None]:
    yield
    for topic in ("tests.control.retry", "tests.control.timeout", "tests.control.both"):
        registry.unregister("outbox", topic)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"retry": 3}, r"retry of outbox destination 'tests.control.retry' must be a workpump"),
        ({"timeout": 0}, r"timeout of outbox destination 'tests.control.retry' must be a number"),
        ({"timeout": -5}, r"must be a number of seconds > 0"),
        ({"timeout": float("inf")}, r"must be a number of seconds > 0"),
        ({"timeout": "60"}, r"must be a number of seconds > 0"),
        (
            {"max_attempts": 3, "retry": workpump.Retry(max_attempts=5)},
            r"given max_attempts=3 and retry=Retry\(max_attempts=5\); give one of them",
        ),
    ],
)
def test_bad_handler_options_are_refused_at_registration(clean_registry, options, message):
    with pytest.raises(ImproperlyConfigured, match=message):

        @workpump.outbox_handler("tests.control.retry", **options)
        def handle(work: Work) -> None: ...

    assert registry.get("outbox", "tests.control.retry") is None


def test_handler_options_are_registered(clean_registry):
    policy = workpump.Retry(max_attempts=4, on=(TimeoutError,))

    @workpump.outbox_handler("tests.control.both", retry=policy, timeout=timedelta(seconds=90))
    def handle(work: Work) -> None: ...

    handler = registry.get("outbox", "tests.control.both")
    assert handler is not None
    assert (handler.retry, handler.timeout, handler.max_attempts) == (policy, 90.0, 4)


# --- the dispatcher --------------------------------------------------------------------------


def test_a_snooze_gives_the_row_back_with_its_delay(run):
    def handle(work: Work) -> None:
        raise workpump.Snooze(45)

    row = make_row()
    dispatcher, coordinator = run(handle, [row])

    assert coordinator.wait_for_call("snooze")
    assert dispatcher.wait_idle(WAIT)
    assert coordinator.snoozed == [(row.work_id, 45.0)]
    assert coordinator.tokens == [("snooze", row.work_id, row.lease_token)]
    assert coordinator.failed == coordinator.completed == []
    assert dispatcher.stats.snoozed == 1


def test_a_discard_ends_the_row_with_its_reason(run):
    async def handle(work: Work) -> None:
        raise workpump.Discard("the order was withdrawn")

    row = make_row()
    dispatcher, coordinator = run(handle, [row])

    assert coordinator.wait_for_call("discard")
    assert dispatcher.wait_idle(WAIT)
    assert coordinator.discarded == [(row.work_id, "the order was withdrawn")]
    assert coordinator.failed == coordinator.completed == []
    assert dispatcher.stats.discarded == 1


def test_an_exception_retry_does_not_name_dead_letters_the_row(run):
    def handle(work: Work) -> None:
        raise KeyError("missing")

    row = make_row()
    dispatcher, coordinator = run(handle, [row], retry=workpump.Retry(on=(TimeoutError,)))

    assert coordinator.wait_for_call("dead_letter")
    assert dispatcher.wait_idle(WAIT)
    assert [work_id for work_id, _ in coordinator.dead_lettered] == [row.work_id]
    assert coordinator.dead_lettered[0][1].startswith("KeyError")
    assert coordinator.dead_letter_reasons == [FailureReason.NOT_RETRYABLE]
    assert coordinator.failed == []


def test_the_backoff_picks_the_retry_delay_of_a_retried_exception(run):
    seen: list[tuple[int, str]] = []

    def backoff(attempt: int, exc: BaseException) -> float | None:
        seen.append((attempt, type(exc).__name__))
        return 2.0**attempt

    def handle(work: Work) -> None:
        raise TimeoutError("slow upstream")

    row = make_row()
    _dispatcher, coordinator = run(
        handle, [row], retry=workpump.Retry(backoff=backoff, on=(TimeoutError,))
    )

    assert coordinator.wait_for_call("fail")
    assert seen == [(1, "TimeoutError")]
    assert coordinator.fail_delays == [2.0]
    assert coordinator.failed[0][2] == FailureReason.HANDLER_ERROR


@pytest.mark.parametrize("backoff", [lambda a, e: None, lambda a, e: 1 / 0, lambda a, e: -1])
def test_a_backoff_of_none_or_a_broken_one_leaves_the_default_backoff(run, backoff):
    def handle(work: Work) -> None:
        raise RuntimeError("boom")

    _dispatcher, coordinator = run(handle, [make_row()], retry=workpump.Retry(backoff=backoff))

    assert coordinator.wait_for_call("fail")
    assert coordinator.fail_delays == [None]


def test_a_timeout_shorter_than_the_lease_sets_the_deadline_and_allows_no_renewal():
    dispatcher, _, leases, clock = make_dispatcher(lambda work: None, timeout=20)
    row = make_row()  # leased for 300 s
    dispatcher.submit([row])

    handle = leases.get("outbox", row.work_id)
    assert handle is not None
    assert handle.seconds_left() == pytest.approx(20)
    assert handle.max_renewals == 0 and not handle.can_renew()
    clock.advance(20)
    assert handle.check_deadline()
    assert handle.timed_out


def test_a_timeout_longer_than_the_lease_takes_the_renewals_it_needs_and_no_more():
    dispatcher, _, leases, clock = make_dispatcher(lambda work: None, timeout=1000)
    row = make_row()  # 300 s lease, 30 s grace: a local lease of 270 s
    dispatcher.submit([row])

    handle = leases.get("outbox", row.work_id)
    assert handle is not None
    # renewed with a third (90 s) left, each renewal gains 180 s: 730 s more takes 5
    assert handle.max_renewals == math.ceil((1000 - 270) / 180) == 5
    renewals = 0
    while handle.can_renew():
        clock.advance(handle.seconds_left() - 90)
        assert handle.confirm_renewal(clock.monotonic() + 270)
        renewals += 1
    # the last renewal stops at the timeout, 1000 s after the dispatch, and no later
    assert renewals == 5
    assert handle.deadline == pytest.approx(1000.0 + 1000)


def test_a_handler_past_its_timeout_fails_with_reason_timeout():
    release = threading.Event()
    started = threading.Event()

    def handle(work: Work) -> None:
        started.set()
        release.wait(WAIT)

    dispatcher, coordinator, leases, clock = make_dispatcher(handle, timeout=20)
    dispatcher.start()
    try:
        row = make_row()
        dispatcher.submit([row])
        assert started.wait(WAIT)
        clock.advance(21)
        (expired,) = leases.expire_due()
        assert dispatcher.abandon(expired)
        assert coordinator.wait_for_call("fail")
        ((work_id, error, reason),) = coordinator.failed
        assert (work_id, reason) == (row.work_id, FailureReason.TIMEOUT)
        assert "end of its timeout (20 s)" in error
    finally:
        release.set()
        dispatcher.stop()


def test_a_cancel_reaches_a_running_sync_handler_and_its_outcome_is_dropped():
    started, saw_cancel = threading.Event(), threading.Event()

    def handle(work: Work) -> str:
        started.set()
        while not work.cancelled:
            if saw_cancel.wait(0.01):
                break
        saw_cancel.set()
        return "finished anyway"

    dispatcher, coordinator, _leases, _ = make_dispatcher(handle)
    dispatcher.start()
    try:
        row = make_row()
        dispatcher.submit([row])
        assert started.wait(WAIT)
        # another attempt's token is not this one: nothing happens
        assert dispatcher.cancel_running("outbox", [(row.work_id, uuid.uuid4())]) == 0
        assert dispatcher.cancel_running("outbox", [(row.work_id, row.lease_token)]) == 1
        assert saw_cancel.wait(WAIT)
        assert dispatcher.wait_idle(WAIT)
    finally:
        dispatcher.stop()
    assert coordinator.completed == coordinator.failed == []
    assert dispatcher.stats.cancelled == 1


def test_a_cancel_cancels_a_running_async_handlers_task():
    started = threading.Event()
    outcome: dict[str, Any] = {}

    async def handle(work: Work) -> None:
        started.set()
        try:
            await asyncio.sleep(WAIT)
        except asyncio.CancelledError:
            outcome["cancelled"] = work.cancelled
            raise

    dispatcher, coordinator, _, _ = make_dispatcher(handle)
    dispatcher.start()
    try:
        row = make_row()
        dispatcher.submit([row])
        assert started.wait(WAIT)
        assert dispatcher.cancel_running("outbox", [(row.work_id, row.lease_token)]) == 1
        assert dispatcher.wait_idle(WAIT)
    finally:
        dispatcher.stop()
    assert outcome == {"cancelled": True}
    assert coordinator.completed == coordinator.failed == []


def test_a_renewal_answered_cancelled_cancels_the_handle_and_tells_the_dispatcher():
    clock = FrozenClock()
    leases = LeaseRegistry()
    row = make_row()
    coordinator = FakeCoordinator(cancelled_renewal=[row.work_id])
    told: list[tuple[str, list[tuple[uuid.UUID, uuid.UUID]]]] = []
    worker = LeaseRenewalWorker(
        coordinator,
        leases,
        lease_seconds=300,
        lease_grace_seconds=30,
        clock=clock,
        on_cancelled=lambda category, attempts: told.append((category, attempts)),
    )
    from django_workpump.pump.lease import LeaseHandle

    handle = LeaseHandle(
        "outbox", row.work_id, clock.monotonic() + 10, 6, clock, lease_token=row.lease_token
    )
    leases.register(handle)

    worker.flush([RenewalRequest("outbox", row.work_id, row.lease_token)])

    assert handle.cancel_reason == CancelReason.CANCELLED
    assert told == [("outbox", [(row.work_id, row.lease_token)])]
    assert handle.renewal_count == 0


def test_the_gate_passes_only_its_own_instances_cancels_on():
    me = uuid.uuid4()
    told: list[tuple[str, list[tuple[uuid.UUID, uuid.UUID]]]] = []
    gate = NotifyGate(
        "",
        me,
        on_signal=lambda signal: None,
        on_cancel=lambda category, attempts: told.append((category, attempts)),
    )
    work_id, token = uuid.uuid4(), uuid.uuid4()

    def message(instance: uuid.UUID) -> str:
        work = [[str(work_id), str(token)]]
        return json.dumps({"instance": str(instance), "category": "inbox", "work": work})

    gate._dispatch("workpump_cancel", message(uuid.uuid4()))  # another instance's
    gate._dispatch("workpump_cancel", "not json")  # ignored, logged
    gate._dispatch("workpump_cancel", message(me))

    # a hint only: queued for the database to confirm (tests/pump/test_notify_hostile.py)
    assert told == []
    assert gate._pending == [CancelHint(me, "inbox", ((work_id, token),))]
    assert gate.cancels_received == 1
    assert gate.rejected == {"invalid_json": 1}


def test_a_cancelled_handler_that_ignores_it_is_abandoned_at_its_deadline_unwritten():
    release, started = threading.Event(), threading.Event()

    def stubborn(work: Work) -> None:
        started.set()
        release.wait(WAIT)  # never looks at work.cancelled

    dispatcher, coordinator, leases, clock = make_dispatcher(stubborn)
    dispatcher.start()
    try:
        row = make_row()  # 300 s lease, 30 s grace: deadline in 270 s
        dispatcher.submit([row])
        assert started.wait(WAIT)
        dispatcher.cancel_running("outbox", [(row.work_id, row.lease_token)])
        assert leases.expire_due() == []  # cancelled, but not yet at its deadline
        clock.advance(270)

        (overdue,) = leases.expire_due()
        assert leases.expire_due() == []  # reported once

        assert dispatcher.abandon(overdue)
        assert dispatcher.in_flight == 0 and dispatcher.free_slots() == 2
    finally:
        release.set()
        dispatcher.stop()
    # the row ended cancelled: nothing is written for the abandoned attempt
    assert coordinator.failed == coordinator.completed == []
    assert dispatcher.stats.abandoned == 1
