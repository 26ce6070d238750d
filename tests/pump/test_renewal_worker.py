"""LeaseRenewalWorker: fenced renewals, the renewal cap, deadlines and renewal requests.

Flushes are driven by hand (``flusher.flush_once()``) and ticks by ``run_once()`` on a
FrozenClock; the fake coordinator records every ``renew`` call. Leases are 300 s with a 30 s
grace, so a renewal is requested once 90 s or less of the local lease is left.
"""

from __future__ import annotations

import logging
import threading
import uuid

import pytest
from django.db import OperationalError

from django_workpump.clock import FrozenClock
from django_workpump.db import InstanceRefused
from django_workpump.pump.lease import LeaseHandle, LeaseRegistry
from django_workpump.pump.renewal import LeaseRenewalWorker
from tests.fakes import FakeCoordinator, ServiceThread

START = 1000.0
LEASE, GRACE = 300, 30
RENEWED_FOR = LEASE - GRACE  # a confirmed renewal moves the local deadline this far


@pytest.fixture
def clock():
    return FrozenClock(start=START)


@pytest.fixture
def leases():
    return LeaseRegistry()


def make_worker(coordinator, leases, clock, **kwargs):
    return LeaseRenewalWorker(
        coordinator, leases, lease_seconds=LEASE, lease_grace_seconds=GRACE, clock=clock, **kwargs
    )


def register(leases, clock, *, seconds_left=50.0, max_renewals=6, category="outbox"):
    handle = LeaseHandle(
        category,
        uuid.uuid4(),
        clock.monotonic() + seconds_left,
        max_renewals,
        clock,
        lease_token=uuid.uuid4(),
    )
    leases.register(handle)
    return handle


def actions(caplog):
    return [getattr(record, "action", None) for record in caplog.records]


# flush(): renewals reaching the database


# original: Renewal_BumpsHandleCountAndCallsRenewLeasesAsync
def test_flushed_renewal_renews_the_id_and_moves_the_deadline(clock, leases):
    coordinator = FakeCoordinator()
    worker = make_worker(coordinator, leases, clock)
    handle = register(leases, clock, seconds_left=50)
    worker.enqueue("outbox", handle.work_id)
    clock.advance(10)

    assert worker.flusher.flush_once() == 1

    assert coordinator.renewals == [("outbox", [handle.work_id])]
    assert handle.renewal_count == 1
    assert handle.deadline == START + 10 + RENEWED_FOR  # sent_at + lease - grace
    assert worker.renewed == 1


# original: RenewalCount_AtCap_StopsSubmittingToRenewLeasesAsync
def test_renewals_stop_reaching_the_database_at_the_cap(clock, leases, caplog):
    coordinator = FakeCoordinator()
    worker = make_worker(coordinator, leases, clock)
    handle = register(leases, clock, max_renewals=3)

    for _ in range(4):
        worker.enqueue("outbox", handle.work_id)
        worker.flusher.flush_once()

    assert coordinator.renewed_ids == [handle.work_id] * 3
    assert handle.renewal_count == 3
    assert worker.skipped_at_cap == 1
    assert actions(caplog).count("renewal_cap") == 1


# original: DisposedHandle_SkippedAtRenewalAsync
def test_disposed_handle_is_not_renewed(clock, leases):
    coordinator = FakeCoordinator()
    worker = make_worker(coordinator, leases, clock)
    handle = register(leases, clock)
    worker.enqueue("outbox", handle.work_id)

    handle.dispose()  # the dispatch finished: the registry drops it
    worker.flusher.flush_once()

    assert leases.get("outbox", handle.work_id) is None
    assert coordinator.renewals == []
    assert worker.skipped_gone == 1


# original: NullRegistry_FallsBackToLegacyBehaviorAsync
def test_without_a_registry_every_request_reaches_the_database(clock):
    coordinator = FakeCoordinator()
    worker = make_worker(coordinator, None, clock)
    work_id, token = uuid.uuid4(), uuid.uuid4()

    for _ in range(3):
        worker.enqueue("inbox", work_id, token)
        worker.flusher.flush_once()

    assert coordinator.renewals == [("inbox", [work_id])] * 3
    assert coordinator.renewal_tokens == [token] * 3
    assert worker.renewed == 3
    assert worker.run_once() == (0, 0)  # no registry: nothing to tick over


def test_id_the_database_did_not_renew_is_cancelled_and_logged(clock, leases, caplog):
    kept = register(leases, clock, seconds_left=50)
    lost = register(leases, clock, seconds_left=50)
    coordinator = FakeCoordinator(refuse_renewal=[lost.work_id])
    worker = make_worker(coordinator, leases, clock)
    worker.enqueue("outbox", kept.work_id)
    worker.enqueue("outbox", lost.work_id)

    worker.flusher.flush_once()

    assert coordinator.renewals == [("outbox", [kept.work_id, lost.work_id])]
    assert (kept.renewal_count, kept.deadline) == (1, START + RENEWED_FOR)
    assert (lost.renewal_count, lost.deadline) == (0, START + 50)
    assert worker.renewed == 1
    [record] = [r for r in caplog.records if getattr(r, "action", None) == "renewal_lost"]
    assert record.levelno == logging.WARNING
    assert str(lost.work_id) in record.getMessage()
    # the handler is told (work.cancelled) and no further renewal is asked for it
    assert lost.cancelled.is_set() and lost.cancel_reason == "lost"
    assert not kept.cancelled.is_set()
    assert not lost.can_renew()


def test_ids_are_grouped_per_category_into_one_renew_call_each(clock, leases):
    coordinator = FakeCoordinator()
    worker = make_worker(coordinator, leases, clock)
    first = register(leases, clock, category="outbox")
    second = register(leases, clock, category="inbox")
    third = register(leases, clock, category="outbox")
    for handle in (first, second, third):
        worker.enqueue(handle.category, handle.work_id)

    worker.flusher.flush_once()

    assert coordinator.renewals == [
        ("outbox", [first.work_id, third.work_id]),
        ("inbox", [second.work_id]),
    ]
    assert [h.renewal_count for h in (first, second, third)] == [1, 1, 1]


def test_an_id_asked_twice_in_one_batch_is_renewed_once(clock, leases):
    coordinator = FakeCoordinator()
    worker = make_worker(coordinator, leases, clock)
    handle = register(leases, clock)
    worker.enqueue("outbox", handle.work_id)
    worker.enqueue("outbox", handle.work_id)

    worker.flusher.flush_once()

    assert coordinator.renewals == [("outbox", [handle.work_id])]
    assert handle.renewal_count == 1


def test_failed_renew_call_is_retried_and_renews_once(clock, leases):
    coordinator = FakeCoordinator(renew_errors=1)
    worker = make_worker(coordinator, leases, clock)
    handle = register(leases, clock, seconds_left=80)
    worker.run_once()

    # renew_leases failed on the connection: the ids go back and wait for a backoff
    assert worker.flusher.flush_once() == 0
    assert len(worker.flusher) == 1
    assert handle.renewal_count == 0
    assert not worker.flusher.due()
    worker.run_once()  # still asked: a tick meanwhile does not ask twice
    assert len(worker.flusher) == 1
    clock.advance(worker.flusher.coalesce_window)
    assert worker.flusher.flush_once() == 1

    assert coordinator.renewals == [("outbox", [handle.work_id])]
    assert handle.renewal_count == 1


def test_a_category_that_renewed_is_not_renewed_again_when_another_fails(clock, leases):
    coordinator = FakeCoordinator()
    worker = make_worker(coordinator, leases, clock)
    outbox = register(leases, clock, seconds_left=80, category="outbox")
    inbox = register(leases, clock, seconds_left=80, category="inbox")
    worker.run_once()
    real_renew = coordinator.renew

    def renew(leases):
        if leases[0].category == "inbox" and coordinator.renew_errors == 0:
            coordinator.renew_errors = -1  # once
            raise OperationalError("server closed the connection unexpectedly")
        return real_renew(leases)

    coordinator.renew = renew
    assert worker.flusher.flush_once() == 1  # outbox renewed, inbox put back
    clock.advance(worker.flusher.coalesce_window)
    assert worker.flusher.flush_once() == 1

    assert coordinator.renewals == [("outbox", [outbox.work_id]), ("inbox", [inbox.work_id])]
    assert (outbox.renewal_count, inbox.renewal_count) == (1, 1)


def test_stop_flushes_requests_still_queued(clock, leases):
    coordinator = FakeCoordinator()
    worker = make_worker(coordinator, leases, clock)  # frozen clock: the window never passes
    handle = register(leases, clock)
    worker.start()
    worker.enqueue("outbox", handle.work_id)

    worker.stop()

    assert coordinator.renewals == [("outbox", [handle.work_id])]
    assert handle.renewal_count == 1


# run_once(): deadlines and renewal requests


def test_expired_handle_is_passed_to_on_deadline_once(clock, leases):
    expired = []
    worker = make_worker(FakeCoordinator(), leases, clock, on_deadline=expired.append)
    handle = register(leases, clock, seconds_left=10)
    register(leases, clock, seconds_left=200)

    clock.advance(9.9)
    assert worker.run_once()[0] == 0
    clock.advance(0.1)
    assert worker.run_once()[0] == 1
    assert worker.run_once()[0] == 0
    clock.advance(60)
    assert worker.run_once()[0] == 0

    assert expired == [handle]
    assert handle.cancel_reason == "deadline"


def test_handle_with_more_time_left_than_the_threshold_is_not_requested(clock, leases):
    worker = make_worker(FakeCoordinator(), leases, clock)
    assert worker.renew_when_left == 90
    register(leases, clock, seconds_left=90.5)

    assert worker.run_once() == (0, 0)

    assert len(worker.flusher) == 0


def test_due_handle_is_requested_once_until_its_renewal_is_flushed(clock, leases):
    coordinator = FakeCoordinator()
    worker = make_worker(coordinator, leases, clock)
    handle = register(leases, clock, seconds_left=80)

    assert worker.run_once() == (0, 1)
    for _ in range(3):
        clock.advance(1)
        assert worker.run_once() == (0, 0)
    assert len(worker.flusher) == 1

    worker.flusher.flush_once()
    assert handle.deadline == clock.monotonic() + RENEWED_FOR
    assert worker.run_once() == (0, 0)  # 270 s left again

    clock.advance(RENEWED_FOR - 89)  # 89 s left: due again
    assert worker.run_once() == (0, 1)
    worker.flusher.flush_once()

    assert coordinator.renewed_ids == [handle.work_id] * 2
    assert handle.renewal_count == 2


def test_handle_that_cannot_renew_is_not_requested(clock, leases):
    worker = make_worker(FakeCoordinator(), leases, clock)
    register(leases, clock, seconds_left=30, max_renewals=0)  # no renewals at all
    cancelled = register(leases, clock, seconds_left=30)
    cancelled.cancel("shutdown")

    assert worker.run_once() == (0, 0)

    assert len(worker.flusher) == 0


def test_request_refused_by_a_full_buffer_is_asked_again_on_a_later_tick(clock, leases):
    coordinator = FakeCoordinator()
    worker = make_worker(coordinator, leases, clock, max_batch=1, immediate_flush_at=1, capacity=1)
    worker.enqueue("outbox", uuid.uuid4())  # fills the buffer
    handle = register(leases, clock, seconds_left=80)
    assert worker.run_once() == (0, 0)  # refused: the buffer is full

    worker.flusher.flush_once()  # the buffer has room again
    worker.run_once()
    worker.flusher.flush_once()

    assert handle.renewal_count == 1


def test_run_ticks_until_stop(clock, leases):
    expired = threading.Event()
    worker = make_worker(
        FakeCoordinator(), leases, clock, tick_seconds=60, on_deadline=lambda _: expired.set()
    )
    register(leases, clock, seconds_left=10)
    clock.advance(10)
    thread = ServiceThread(worker)

    thread.start()
    assert expired.wait(5)
    worker.stop()
    thread.finish()


# lease tokens and refusals


def test_a_renewal_sends_the_token_of_the_handle_in_flight(clock, leases):
    handle = register(leases, clock, seconds_left=50)
    coordinator = FakeCoordinator()
    worker = make_worker(coordinator, leases, clock)

    worker.run_once()
    worker.flusher.flush_once()

    assert coordinator.renewals == [("outbox", [handle.work_id])]
    assert coordinator.renewal_tokens == [handle.lease_token]


def test_a_renewal_asked_for_an_older_claim_of_the_row_is_not_sent(clock, leases):
    newer = register(leases, clock, seconds_left=50)
    coordinator = FakeCoordinator()
    worker = make_worker(coordinator, leases, clock)

    worker.enqueue("outbox", newer.work_id, uuid.uuid4())  # asked by the superseded attempt
    worker.flusher.flush_once()

    assert coordinator.renewals == []
    assert worker.skipped_gone == 1


def test_a_refused_renewal_stops_the_instance_once_and_renews_nothing_more(clock, leases):
    handles = [register(leases, clock, seconds_left=50, category=c) for c in ("outbox", "inbox")]
    refusal = InstanceRefused("renew_leases refused instance x: it is not registered.")
    coordinator = FakeCoordinator(renew_refusal=refusal)
    stops: list[str] = []
    worker = make_worker(coordinator, leases, clock, on_refused=stops.append)

    worker.run_once()
    worker.flusher.flush_once()
    worker.run_once()
    worker.flusher.flush_once()

    assert stops == [str(refusal)]
    assert coordinator.calls.count("renew") == 1  # the other category was not even tried
    assert all(h.renewal_count == 0 for h in handles)


# One renew_leases per category per renewal window


def test_a_round_of_1000_due_renewals_is_one_renew_call_per_category(clock, leases):
    coordinator = FakeCoordinator()
    worker = make_worker(coordinator, leases, clock)
    handles = [
        register(leases, clock, seconds_left=50, category=("outbox", "receptor")[n % 2])
        for n in range(1000)
    ]

    _, requested = worker.run_once()
    assert requested == 1000
    assert worker.flusher.flush_once() == 1000

    assert [(category, len(ids)) for category, ids in coordinator.renewals] == [
        ("outbox", 500),
        ("receptor", 500),
    ]
    assert sorted(coordinator.renewed_ids) == sorted(handle.work_id for handle in handles)
    assert len(worker.flusher) == 0


def test_renewals_past_the_max_batch_are_chunked(clock, leases):
    coordinator = FakeCoordinator()
    worker = make_worker(coordinator, leases, clock, max_batch=400, capacity=1000)
    for _ in range(1000):
        register(leases, clock, seconds_left=50)

    worker.run_once()
    while worker.flusher.flush_once():
        pass

    assert [len(ids) for _, ids in coordinator.renewals] == [400, 400, 200]


def test_a_round_larger_than_the_buffer_asks_again_for_what_was_refused(clock, leases):
    coordinator = FakeCoordinator()
    worker = make_worker(coordinator, leases, clock, max_batch=300, capacity=300)
    for _ in range(500):
        register(leases, clock, seconds_left=50)

    assert worker.run_once() == (0, 300)
    worker.flusher.flush_once()
    # the 200 refused were not marked as asked: the next tick asks for them at once
    assert worker.run_once() == (0, 200)
