"""LeaseHandle deadlines, renewals, the cap and cancellation; LeaseRegistry.

Pure unit tests on a FrozenClock: no database, no sleeping.
"""

from __future__ import annotations

import uuid

import pytest

from django_workpump.clock import FrozenClock
from django_workpump.pump.lease import DuplicateLease, LeaseHandle, LeaseRegistry


@pytest.fixture
def clock():
    return FrozenClock(start=1000.0)


def make_handle(clock, *, seconds=60.0, max_renewals=6, category="inbox", work_id=None):
    """A handle whose deadline is `seconds` from the clock's now."""
    return LeaseHandle(
        category, work_id or uuid.uuid4(), clock.monotonic() + seconds, max_renewals, clock
    )


# LeaseHandle


def test_handle_with_a_future_deadline_starts_live(clock):
    handle = make_handle(clock, seconds=60)

    assert not handle.cancelled.is_set()
    assert handle.cancel_reason is None
    assert handle.renewal_count == 0
    assert handle.seconds_left() == 60
    assert handle.can_renew()


def test_handle_whose_deadline_is_past_starts_cancelled_by_deadline(clock):
    handle = make_handle(clock, seconds=-1)

    assert handle.cancelled.is_set()
    assert handle.cancel_reason == "deadline"
    assert not handle.can_renew()


def test_check_deadline_cancels_at_the_deadline_not_before(clock):
    handle = make_handle(clock, seconds=30)

    clock.advance(29.9)
    assert handle.check_deadline() is False
    assert not handle.cancelled.is_set()

    clock.advance(0.1)
    assert handle.check_deadline() is True
    assert handle.cancelled.is_set()
    assert handle.cancel_reason == "deadline"


def test_confirm_renewal_moves_the_deadline_and_counts(clock):
    handle = make_handle(clock, seconds=30)
    new_deadline = clock.monotonic() + 300

    assert handle.confirm_renewal(new_deadline) is True

    assert handle.deadline == new_deadline
    assert handle.renewal_count == 1
    clock.advance(100)  # past the old deadline, well before the new one
    assert handle.check_deadline() is False


def test_fourth_renewal_over_a_cap_of_three_is_refused_and_keeps_the_deadline(clock):
    handle = make_handle(clock, seconds=30, max_renewals=3)
    for step in range(1, 4):
        assert handle.confirm_renewal(clock.monotonic() + 30 + step)
    kept = handle.deadline
    assert not handle.can_renew()

    assert handle.confirm_renewal(clock.monotonic() + 999) is False

    assert handle.renewal_count == 3
    assert handle.deadline == kept


def test_a_waiting_row_of_a_run_renews_past_the_cap_and_is_charged_once_it_starts(clock):
    handle = LeaseHandle("outbox", uuid.uuid4(), clock.monotonic() + 60, 2, clock, charged=False)
    for step in range(1, 6):  # waiting behind the run's earlier rows: never capped
        assert handle.can_renew()
        assert handle.confirm_renewal(clock.monotonic() + 60 + step)
    assert handle.renewal_count == 0

    handle.start_charging()
    assert handle.confirm_renewal(clock.monotonic() + 100)
    assert handle.confirm_renewal(clock.monotonic() + 101)
    assert handle.renewal_count == 2
    assert not handle.can_renew()
    assert not handle.confirm_renewal(clock.monotonic() + 102)


def test_a_waiting_row_of_a_run_starts_its_own_timeout_when_it_starts(clock):
    """Time spent waiting behind the run's earlier rows does not use up a handler's
    timeout: the hard deadline is set when the row starts, not at the claim."""
    handle = LeaseHandle(
        "outbox", uuid.uuid4(), clock.monotonic() + 60, 3, clock, charged=False, timeout=10
    )
    assert handle.hard_deadline is None
    for _ in range(4):  # 160 s of waiting, renewed each time
        clock.advance(40)
        assert handle.confirm_renewal(clock.monotonic() + 60)
    assert not handle.check_deadline()

    handle.start_charging()

    assert handle.hard_deadline == clock.monotonic() + 10
    assert handle.seconds_left() == 10
    clock.advance(10)
    assert handle.check_deadline()
    assert handle.timed_out


def test_disposed_handle_refuses_renewal(clock):
    handle = make_handle(clock, seconds=30)
    deadline = handle.deadline
    handle.dispose()

    assert not handle.can_renew()
    assert handle.confirm_renewal(clock.monotonic() + 300) is False
    assert handle.deadline == deadline
    assert handle.renewal_count == 0


def test_cancelled_handle_refuses_renewal(clock):
    handle = make_handle(clock, seconds=30)
    handle.cancel("shutdown")

    assert not handle.can_renew()
    assert handle.confirm_renewal(clock.monotonic() + 300) is False
    assert handle.renewal_count == 0


def test_confirm_renewal_to_a_deadline_already_past_is_refused(clock):
    handle = make_handle(clock, seconds=30)
    clock.advance(10)

    assert handle.confirm_renewal(clock.monotonic()) is False
    assert handle.confirm_renewal(clock.monotonic() - 5) is False
    assert handle.renewal_count == 0
    assert handle.deadline == 1030


def test_dispose_cancels_once_and_is_idempotent(clock):
    handle = make_handle(clock)

    handle.dispose()
    handle.dispose()

    assert handle.disposed
    assert handle.cancelled.is_set()
    assert handle.cancel_reason == "disposed"


def test_first_cancel_reason_wins(clock):
    handle = make_handle(clock, seconds=30)

    handle.cancel("shutdown")
    clock.advance(60)
    handle.check_deadline()
    handle.cancel("deadline")
    handle.dispose()

    assert handle.cancel_reason == "shutdown"
    assert handle.disposed


def test_cancel_refuses_an_unknown_reason(clock):
    handle = make_handle(clock)

    with pytest.raises(ValueError, match="must be one of"):
        handle.cancel("bored")
    assert not handle.cancelled.is_set()


# LeaseRegistry


def test_registering_the_same_row_twice_raises_duplicate_lease(clock):
    registry = LeaseRegistry()
    work_id = uuid.uuid4()
    first = make_handle(clock, work_id=work_id)
    registry.register(first)

    with pytest.raises(DuplicateLease, match="same row claimed twice in flight") as excinfo:
        registry.register(make_handle(clock, work_id=work_id))

    assert str(work_id) in str(excinfo.value)
    assert "inbox" in str(excinfo.value)
    assert isinstance(excinfo.value, ValueError)
    assert registry.get("inbox", work_id) is first


def test_same_id_in_another_category_is_a_different_lease(clock):
    registry = LeaseRegistry()
    work_id = uuid.uuid4()

    registry.register(make_handle(clock, work_id=work_id, category="inbox"))
    registry.register(make_handle(clock, work_id=work_id, category="outbox"))

    assert len(registry) == 2


def test_dispose_removes_the_handle_from_the_registry(clock):
    registry = LeaseRegistry()
    handle = make_handle(clock)
    registry.register(handle)
    assert registry.get("inbox", handle.work_id) is handle

    handle.dispose()

    assert registry.get("inbox", handle.work_id) is None
    assert len(registry) == 0


def test_late_dispose_of_a_stale_handle_keeps_the_newer_one(clock):
    registry = LeaseRegistry()
    work_id = uuid.uuid4()
    stale = make_handle(clock, work_id=work_id)
    registry.register(stale)
    registry.discard(stale)  # abandoned: dropped while its thread still runs
    newer = make_handle(clock, work_id=work_id)
    registry.register(newer)

    stale.dispose()  # the abandoned thread finishes late

    assert registry.get("inbox", work_id) is newer
    assert not newer.cancelled.is_set()


def test_registering_a_disposed_handle_is_refused(clock):
    registry = LeaseRegistry()
    handle = make_handle(clock)
    handle.dispose()

    with pytest.raises(ValueError, match="already disposed"):
        registry.register(handle)
    assert len(registry) == 0


def test_expire_due_returns_only_newly_expired_handles(clock):
    registry = LeaseRegistry()
    short = make_handle(clock, seconds=10)
    long = make_handle(clock, seconds=100)
    shut = make_handle(clock, seconds=10)
    for handle in (short, long, shut):
        registry.register(handle)
    shut.cancel("shutdown")

    clock.advance(10)
    assert registry.expire_due() == [short]
    assert registry.expire_due() == []
    assert shut.cancel_reason == "shutdown"
    assert not long.cancelled.is_set()

    clock.advance(90)
    assert registry.expire_due() == [long]
    assert len(registry) == 3  # expired handles stay until their dispatch disposes them


def test_cancel_all_cancels_every_handle_for_shutdown(clock):
    registry = LeaseRegistry()
    handles = [make_handle(clock) for _ in range(3)]
    for handle in handles:
        registry.register(handle)
    handles[0].cancel("deadline")

    registry.cancel_all()

    assert all(handle.cancelled.is_set() for handle in handles)
    assert [handle.cancel_reason for handle in handles] == ["deadline", "shutdown", "shutdown"]
    assert set(registry.handles()) == set(handles)
