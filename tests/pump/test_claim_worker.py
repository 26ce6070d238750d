"""ClaimWorker: backoff table, claim size, gate transitions, wakes and drain mode.

``poll_wait_ms`` and ``run_once()`` are tested directly against fakes. The loop runs in a
thread only where its waiting matters; those tests wait on conditions set by the fakes and
use a 60 s poll interval, so a second claim can only come from a wake or from drain mode.
"""

from __future__ import annotations

import logging
import threading

import pytest

from django_workpump.clock import FrozenClock
from django_workpump.conf import DEFAULTS as SETTING_DEFAULTS
from django_workpump.db import InstanceRefused
from django_workpump.pump.claim import (
    FREE_FRUITLESS_WAKES,
    UNDERSERVED_QUEUE_ROOM,
    WAKE_FLOOD_QUIET_SECONDS,
    ClaimPolicy,
    ClaimResult,
    ClaimWorker,
    poll_wait_ms,
)
from tests.fakes import (
    FakeCoordinator,
    FakeGate,
    FakeSink,
    ServiceThread,
    blocking,
    make_row,
    running,
    watching,
)

DEFAULTS = ClaimPolicy()  # base 250, max 10 000, relaxed 5 000, safety net on, prefetch 2
# A loop on this policy waits a minute between polls whatever the gate says.
MINUTE = ClaimPolicy(
    polling_interval_ms=60_000,
    polling_max_interval_ms=60_000,
    notify_healthy_polling_interval_ms=None,
)


def waits(policy, gate_available, empty_polls=range(13)):
    return [poll_wait_ms(policy, n, gate_available) for n in empty_polls]


def make_worker(coordinator=None, sink=None, policy=DEFAULTS, **kwargs):
    return ClaimWorker(coordinator or FakeCoordinator(), sink or FakeSink(free=4), policy, **kwargs)


# poll_wait_ms: the backoff table


# original: GateNotInjected_PreservesPreSliceBehaviorAsync
def test_without_a_gate_the_wait_doubles_from_the_tight_base_up_to_the_max():
    assert waits(DEFAULTS, None) == [
        250, 250, 500, 1000, 2000, 4000, 8000, 10000, 10000, 10000, 10000, 10000, 10000,
    ]  # fmt: skip


# original: GateAvailable_AdaptiveBackoffMayStretchToMaxAsync
# original: NotifyHealthyOverride_GateAvailable_UsesRelaxedBaselineAsync
def test_healthy_gate_starts_at_the_relaxed_base_and_backs_off_to_the_max():
    assert waits(DEFAULTS, True) == [5000, 5000] + [10000] * 11


# original: GateUnavailable_PollIntervalStaysAtBaseEvenAfterEmptyStreakAsync
def test_unavailable_gate_pins_the_tight_base_however_long_the_empty_streak():
    assert waits(DEFAULTS, False, [0, 1, 2, 3, 7, 12, 100, 10_000]) == [250] * 8


# original: NotifyHealthyOverride_GateUnavailable_FallsBackToTightBaseAsync
def test_unavailable_gate_ignores_the_relaxed_base():
    policy = ClaimPolicy(polling_interval_ms=50, notify_healthy_polling_interval_ms=1000)

    assert waits(policy, False) == [50] * 13


# original: EnableSafetyNetPollFalse_GateHealthy_LoopWaitsForSignalsOnlyAsync
def test_no_safety_net_with_a_healthy_gate_waits_for_a_wake_only():
    policy = ClaimPolicy(enable_safety_net_poll=False)

    assert waits(policy, True) == [None] * 13


# original: EnableSafetyNetPollFalse_GateUnavailable_ReengagesTightPollingAsync
def test_no_safety_net_with_an_unavailable_gate_polls_at_the_tight_base():
    policy = ClaimPolicy(enable_safety_net_poll=False)

    assert waits(policy, False) == [250] * 13


def test_no_safety_net_without_a_gate_keeps_the_timed_backoff():
    # --no-listen: nothing could wake the loop, so it must keep polling.
    policy = ClaimPolicy(enable_safety_net_poll=False)

    assert waits(policy, None) == waits(DEFAULTS, None)


@pytest.mark.parametrize("max_ms", [250, 100, 0])
def test_max_interval_at_or_below_the_base_disables_backoff(max_ms):
    policy = ClaimPolicy(polling_max_interval_ms=max_ms)

    assert waits(policy, None) == [250] * 13
    assert waits(policy, True) == [5000] * 13  # the relaxed base is above max too


def test_max_interval_equal_to_the_relaxed_base_keeps_a_healthy_gate_at_that_base():
    policy = ClaimPolicy(polling_max_interval_ms=5000)

    assert waits(policy, True) == [5000] * 13
    assert waits(policy, None)[:6] == [250, 250, 500, 1000, 2000, 4000]


def test_relaxed_base_disabled_leaves_a_healthy_gate_on_the_tight_backoff():
    policy = ClaimPolicy(notify_healthy_polling_interval_ms=None)

    assert waits(policy, True) == waits(DEFAULTS, None)


def test_relaxed_base_smaller_than_the_tight_base_is_ignored():
    policy = ClaimPolicy(polling_interval_ms=1000, notify_healthy_polling_interval_ms=500)

    assert waits(policy, True, range(7)) == [1000, 1000, 2000, 4000, 8000, 10000, 10000]


def test_backoff_doubles_at_most_ten_times():
    policy = ClaimPolicy(polling_interval_ms=1, polling_max_interval_ms=10**9)

    assert waits(policy, None, [10, 11, 12, 50]) == [512, 1024, 1024, 1024]


def test_current_wait_follows_the_gate_as_it_changes():
    gate = FakeGate(available=True)
    worker = make_worker(gate=gate)
    worker.empty_polls = 3

    assert worker.current_wait_ms() == 10000
    gate.available = False
    assert worker.current_wait_ms() == 250
    assert make_worker().current_wait_ms() == 250  # no gate, no empty polls yet


# run_once: one claim


def test_claim_asks_for_the_free_slots_plus_the_prefetch():
    coordinator = FakeCoordinator()
    worker = make_worker(coordinator, FakeSink(free=3))

    worker.run_once()

    assert coordinator.claims == [5]


def test_claim_size_is_capped_by_max_rows():
    coordinator = FakeCoordinator()
    worker = make_worker(coordinator, FakeSink(free=10), ClaimPolicy(max_rows=8, prefetch=2))

    worker.run_once()

    assert coordinator.claims == [8]


# original: Distribute_OutboxStreamIds_RoutedToOutboxDrainChannelAsync (rows go to the sink)
def test_claimed_rows_are_handed_to_the_sink_as_one_batch():
    rows = [make_row("outbox"), make_row("inbox")]
    sink = FakeSink(free=4)
    worker = make_worker(FakeCoordinator(claims=[rows]), sink)

    result = worker.run_once()

    assert sink.batches == [rows]
    assert result.claimed == 2
    assert result.has_more is False
    assert worker.claimed_total == 2
    assert worker.last_claimed == 2


def test_empty_claim_hands_nothing_to_the_sink_and_counts_an_empty_poll():
    sink = FakeSink(free=4)
    worker = make_worker(FakeCoordinator(), sink)

    result = worker.run_once()

    assert sink.batches == []
    assert result.claimed == 0
    assert worker.empty_polls == 1


def test_busy_dispatcher_skips_the_claim_entirely():
    coordinator = FakeCoordinator()
    worker = make_worker(coordinator, FakeSink(free=0))

    result = worker.run_once()

    assert result.skipped_busy is True
    assert coordinator.calls == []
    assert worker.empty_polls == 0
    assert worker.polls == 0


def test_batch_with_a_has_more_row_reports_has_more():
    rows = [make_row(), make_row(has_more=True)]
    worker = make_worker(FakeCoordinator(claims=[rows]))

    assert worker.run_once().has_more is True


def test_non_empty_batch_resets_the_empty_poll_streak():
    worker = make_worker(FakeCoordinator(claims=[[], [], [], [make_row()]]))
    for _ in range(3):
        worker.run_once()
    assert worker.empty_polls == 3
    assert worker.current_wait_ms() == 1000

    worker.run_once()

    assert worker.empty_polls == 0
    assert worker.current_wait_ms() == 250


def test_failing_claim_counts_as_an_empty_poll_is_logged_and_does_not_escape(caplog):
    error = RuntimeError("could not connect to server")
    sink = FakeSink(free=4)
    rows = [make_row()]
    worker = make_worker(FakeCoordinator(claims=[error, rows]), sink)

    result = worker.run_once()

    assert result.error is error
    assert result.claimed == 0
    assert worker.empty_polls == 1
    [record] = [r for r in caplog.records if getattr(r, "action", None) == "claim_failed"]
    assert record.levelno == logging.WARNING
    assert "could not connect to server" in record.getMessage()
    assert record.exc_info is not None
    # The next poll works as usual.
    assert worker.run_once().claimed == 1
    assert sink.batches == [rows]


# original: StartupCatchUp_FiresExactlyOnceOnFirstClaimAsync
def test_startup_catch_up_is_counted_once_over_three_polls(caplog):
    caplog.set_level(logging.INFO, logger="django_workpump.claim")
    worker = make_worker(FakeCoordinator(claims=[[make_row()], [], [make_row()]]))

    for _ in range(3):
        worker.run_once()

    assert worker.polls == 3
    assert worker.startup_catch_up_count == 1
    actions = [getattr(r, "action", None) for r in caplog.records]
    assert actions.count("startup_catch_up") == 1


# on_gate_changed


# original: ReconnectCatchUp_GateUnavailableThenAvailable_IncrementsCounterAndFiresImmediatePollAsync  # noqa: E501
def test_gate_coming_back_counts_one_reconnect_catch_up_and_requests_a_poll(caplog):
    caplog.set_level(logging.INFO, logger="django_workpump.claim")
    clock = FrozenClock()
    worker = make_worker(clock=clock)
    worker.on_gate_changed(False)
    wakes_before = worker.wake_requests
    clock.advance(2.5)

    worker.on_gate_changed(True)

    assert worker.reconnect_catch_up_count == 1
    assert worker.wake_requests == wakes_before + 1
    [record] = [r for r in caplog.records if getattr(r, "action", None) == "reconnect_catch_up"]
    assert "2500 ms" in record.getMessage()


# original: ReconnectCatchUp_NoTransition_DoesNotIncrementCounterAsync
def test_reporting_the_gate_state_it_already_has_does_nothing():
    worker = make_worker()
    worker.on_gate_changed(False)
    worker.on_gate_changed(True)
    counts = (worker.reconnect_catch_up_count, worker.wake_requests)

    worker.on_gate_changed(True)
    worker.on_gate_changed(True)

    assert (worker.reconnect_catch_up_count, worker.wake_requests) == counts
    worker.on_gate_changed(False)
    worker.on_gate_changed(False)
    assert worker.wake_requests == counts[1] + 1


def test_first_gate_report_available_is_not_a_reconnect():
    worker = make_worker()

    worker.on_gate_changed(True)

    assert worker.reconnect_catch_up_count == 0
    assert worker.wake_requests == 1  # still a change: poll now


def test_each_return_of_the_gate_counts_one_reconnect():
    worker = make_worker()

    for available in (False, True, False, True):
        worker.on_gate_changed(available)

    assert worker.reconnect_catch_up_count == 2


# The loop (threaded)


# original: ExecuteAsync_PollsAtLeastOnceAsync
def test_started_loop_claims_and_stop_ends_it():
    coordinator = FakeCoordinator()
    worker = make_worker(coordinator, policy=MINUTE)

    with running(worker):
        assert coordinator.wait_for_claims(1)

    assert len(coordinator.claims) == 1


def test_stop_before_run_makes_run_return_without_claiming():
    coordinator = FakeCoordinator()
    worker = make_worker(coordinator, policy=MINUTE)

    worker.stop()
    worker.stop()  # idempotent
    thread = ServiceThread(worker)
    thread.start()
    thread.finish()

    assert coordinator.claims == []


# original: RequestImmediatePoll_BypassesWaitAsync
def test_immediate_poll_request_wakes_a_loop_waiting_a_long_interval():
    coordinator = FakeCoordinator()
    gate = FakeGate(available=True)
    worker = make_worker(coordinator, policy=MINUTE, gate=gate)

    with running(worker):
        assert coordinator.wait_for_claims(1)
        assert gate.wait_for_reads(1)  # the loop is about to wait its minute
        worker.request_immediate_poll()
        assert coordinator.wait_for_claims(2)


# original: GateFlipsToAvailable_TriggersImmediatePollAsync
def test_gate_turning_available_wakes_a_loop_waiting_a_long_interval():
    coordinator = FakeCoordinator()
    gate = FakeGate(available=False)
    worker = make_worker(coordinator, policy=MINUTE, gate=gate)
    worker.on_gate_changed(False)

    with running(worker):
        assert coordinator.wait_for_claims(1)
        assert gate.wait_for_reads(1)
        gate.available = True
        worker.on_gate_changed(True)
        assert coordinator.wait_for_claims(2)

    assert worker.reconnect_catch_up_count == 1


# original: EnableSafetyNetPollFalse_GateHealthy_LoopWaitsForSignalsOnlyAsync
def test_loop_without_safety_net_sleeps_until_woken_then_claims():
    coordinator = FakeCoordinator()
    gate = FakeGate(available=True)
    worker = make_worker(coordinator, policy=ClaimPolicy(enable_safety_net_poll=False), gate=gate)

    with running(worker):
        assert coordinator.wait_for_claims(1)
        assert gate.wait_for_reads(1)
        assert worker.current_wait_ms() is None  # it waits for a wake only
        worker.request_immediate_poll()
        assert coordinator.wait_for_claims(2)


def test_wakes_sent_during_a_claim_coalesce_into_one_extra_poll():
    release = threading.Event()
    coordinator = FakeCoordinator(claims=[blocking(release)])
    gate = FakeGate(available=True)
    worker = make_worker(coordinator, policy=MINUTE, gate=gate)

    with running(worker):
        assert coordinator.wait_for_claims(1)  # the first claim is in progress
        for _ in range(5):
            worker.request_immediate_poll()
        release.set()
        assert coordinator.wait_for_claims(2)
        assert gate.wait_for_reads(2)  # after the second claim the loop waits its minute

    assert worker.wake_requests == 5
    assert len(coordinator.claims) == 2


def test_batch_with_has_more_makes_the_loop_claim_again_without_waiting():
    coordinator = FakeCoordinator(claims=[[make_row(has_more=True)], []])
    gate = FakeGate(available=True)
    worker = make_worker(coordinator, policy=MINUTE, gate=gate)

    with running(worker):
        assert coordinator.wait_for_claims(2)
        assert gate.wait_for_reads(1)

    # Only the empty second claim was followed by a wait; nobody asked for a wake.
    assert gate.reads == 1
    assert worker.wake_requests == 0
    assert len(coordinator.claims) == 2


# original: ExecuteAsync_DisabledOptions_NoClaimFiresAsync
def test_disabled_worker_never_claims_and_returns_on_stop():
    coordinator = FakeCoordinator()
    worker = make_worker(coordinator, policy=MINUTE, enabled=False)

    with watching("django_workpump.claim") as log, running(worker):
        assert log.wait_for("claim_disabled")
        worker.request_immediate_poll()
        worker.on_gate_changed(True)

    assert coordinator.calls == []


# original: ExecuteAsync_RegistersInstanceViaHeartbeat_BeforeFirstClaimWorkAsync
def test_before_first_claim_runs_once_before_the_first_claim():
    coordinator = FakeCoordinator()
    worker = make_worker(
        coordinator, policy=MINUTE, before_first_claim=lambda: coordinator.heartbeat({})
    )

    with running(worker):
        assert coordinator.wait_for_claims(1)
        worker.request_immediate_poll()
        assert coordinator.wait_for_claims(2)

    assert coordinator.calls[:3] == ["heartbeat", "claim", "claim"]
    assert coordinator.calls.count("heartbeat") == 1


def test_failing_before_first_claim_is_logged_and_claiming_still_starts(caplog):
    def refuse():
        raise RuntimeError("relation workpump.instance does not exist")

    coordinator = FakeCoordinator()
    worker = make_worker(coordinator, policy=MINUTE, before_first_claim=refuse)

    with running(worker):
        assert coordinator.wait_for_claims(1)

    [record] = [r for r in caplog.records if getattr(r, "action", None) == "heartbeat_failed"]
    assert record.levelno == logging.ERROR
    assert record.exc_info is not None


class CountingSink(FakeSink):
    """A sink that also reports how many rows it has started (the dispatcher does)."""

    started_total = 0


def claim_at_rates(rows_per_tick: int, tick: float, rounds: int, max_rows: int = 1000):
    clock = FrozenClock()
    sink = CountingSink(free=4)
    coordinator = FakeCoordinator(claims=[[]] * rounds)
    worker = make_worker(coordinator, sink, ClaimPolicy(max_rows=max_rows, prefetch=2), clock=clock)
    for _ in range(rounds):
        worker.run_once()
        clock.advance(tick)
        sink.started_total += rows_per_tick
    return coordinator.claims, worker


def test_fast_work_is_claimed_in_batches_of_a_quarter_second_of_its_start_rate():
    # 1,000 rows started every 0.1 s: 10,000 rows/s, a quarter second is 2,500 rows
    claims, worker = claim_at_rates(1000, 0.1, rounds=4)
    assert claims == [6, 1000, 1000, 1000]  # the first claim starts the measurement
    assert worker.start_rate == pytest.approx(10_000)


def test_the_batch_follows_the_measured_rate_below_max_rows():
    # 40 rows per 0.1 s: 400 rows/s, a quarter second is 100 rows
    claims, _ = claim_at_rates(40, 0.1, rounds=3)
    assert claims == [6, 100, 100]


def test_slow_work_is_claimed_for_the_free_slots_only():
    # one row started every half second: a quarter second is not even one row
    claims, worker = claim_at_rates(1, 0.5, rounds=4)
    assert claims == [6, 6, 6, 6]
    assert worker.start_rate == pytest.approx(2.0)


class FairClaims(FakeCoordinator):
    """Claims whose flow pass reached rows of fairness keys (or not)."""

    def __init__(self, fair: bool, **kwargs) -> None:
        super().__init__(**kwargs)
        self.fair = fair

    def flow_fair(self) -> bool:
        return self.fair


@pytest.mark.parametrize(
    ("prefetch", "fair_prefetch", "ahead"),
    [(2, 8, 8), (2, 0, 2), (2, 3, 3), (20, 8, 20)],  # the larger of the two
)
def test_after_a_claim_that_reached_fairness_keys_the_batch_is_capped_short(
    prefetch, fair_prefetch, ahead
):
    # 10,000 rows/s would claim max_rows ahead, a claim of some 20 ms: a quiet key's row
    # stored meanwhile would wait for its end
    clock = FrozenClock()
    sink = CountingSink(free=4)
    coordinator = FairClaims(True, claims=[[]] * 5)
    policy = ClaimPolicy(max_rows=1000, prefetch=prefetch, fair_prefetch=fair_prefetch)
    worker = make_worker(coordinator, sink, policy, clock=clock)
    for fair in (False, True, True, False, False):
        coordinator.fair = fair
        worker.run_once()
        clock.advance(0.1)
        sink.started_total += 1000
    # each claim follows the previous one's answer: the rate is measured all along
    assert coordinator.claims == [4 + prefetch, 1000, 4 + ahead, 4 + ahead, 1000]
    assert coordinator.underserved_only == [False] * 5


def test_the_policy_reads_the_fair_prefetch_from_the_settings():
    policy = ClaimPolicy.from_settings({**SETTING_DEFAULTS, "CLAIM_FAIR_PREFETCH": 3})
    assert (policy.prefetch, policy.fair_prefetch, policy.fair_ahead) == (2, 3, 3)
    assert ClaimPolicy.from_settings(dict(SETTING_DEFAULTS)).fair_ahead == 8


class BusySink(FakeSink):
    """A dispatcher with every slot taken: ``in_flight`` rows queued or running."""

    def __init__(self, in_flight: int, concurrency: int = 4) -> None:
        super().__init__(free=max(concurrency - in_flight, 0))
        self.in_flight = in_flight
        self.concurrency = concurrency


def test_after_a_fair_claim_new_work_of_underserved_groups_is_claimed_with_no_slot_free():
    # every slot busy with a noisy key's rows and more of them queued: a row another key
    # stores now (its NOTIFY) is claimed at once, by a claim of the groups holding none,
    # and handed over to start before the queued rows
    sink = BusySink(in_flight=10)
    quiet = make_row()
    coordinator = FairClaims(True, claims=[[quiet], [], []])
    worker = make_worker(coordinator, sink, ClaimPolicy(prefetch=2))
    worker.fair = True

    assert worker.run_once().skipped_busy  # no new work: the claim waits for a slot
    worker.request_immediate_poll(new_work=True)
    assert worker.run_once().claimed == 1
    assert (coordinator.claims, coordinator.underserved_only) == ([4], [True])  # a slot's worth
    assert sink.batches == [[quiet]] and sink.fronts == [True]
    assert worker.run_once().skipped_busy  # that wake is spent

    queue_rows = 8 + UNDERSERVED_QUEUE_ROOM  # a fair claim's rows ahead, and the room
    sink.in_flight = 4 + queue_rows - 1
    worker.request_immediate_poll(new_work=True)
    worker.run_once()
    assert coordinator.claims == [4, 1]  # room for one more queued row
    sink.in_flight = 4 + queue_rows
    worker.request_immediate_poll(new_work=True)
    assert worker.run_once().skipped_busy  # the queue is full: no more

    sink.in_flight = 2  # no slot free with two rows in flight: the pump is stopping
    worker.request_immediate_poll(new_work=True)
    assert worker.run_once().skipped_busy

    sink.in_flight = 6
    worker.fair = False  # the last claim reached no fairness key: wait for a slot
    worker.request_immediate_poll(new_work=True)
    assert worker.run_once().skipped_busy
    assert coordinator.claims == [4, 1]


def test_the_underserved_claims_leave_room_beyond_a_larger_fair_prefetch():
    # a fair claim may queue 30 rows beyond the slots: a quiet key's row stored then is
    # still claimed at once, until 30 and the room queue
    policy = ClaimPolicy(prefetch=2, fair_prefetch=30)
    sink = BusySink(in_flight=4 + 30 + UNDERSERVED_QUEUE_ROOM - 1)
    coordinator = FairClaims(True, claims=[[make_row()], []])
    worker = make_worker(coordinator, sink, policy)
    worker.fair = True
    worker.request_immediate_poll(new_work=True)
    assert worker.run_once().claimed == 1
    assert (coordinator.claims, coordinator.underserved_only) == ([1], [True])
    sink.in_flight += 1
    worker.request_immediate_poll(new_work=True)
    assert worker.run_once().skipped_busy


def test_a_claim_of_underserved_groups_leaves_the_loop_waiting_for_a_slot_if_rows_wait():
    # A quiet key's row claimed with no slot free is not the end of the flood: the loop
    # goes on waiting for a slot (has_more), which a freed slot wakes. Waiting for the
    # next poll or NOTIFY instead left the dispatcher idle for up to 20 ms at a time.
    sink = BusySink(in_flight=0)
    coordinator = FairClaims(
        True,
        claims=[[make_row(), make_row(has_more=True)], [make_row()], [make_row()], [make_row()]],
    )
    worker = make_worker(coordinator, sink, ClaimPolicy(prefetch=2))
    assert worker.run_once().has_more  # the flood: more than the claim took

    sink.free, sink.in_flight = 0, 12
    worker.request_immediate_poll(new_work=True)
    underserved = worker.run_once()
    assert (underserved.claimed, coordinator.underserved_only[-1]) == (1, True)
    assert underserved.has_more  # the flood's rows still wait for a slot

    sink.free, sink.in_flight = 4, 0
    assert worker.run_once().has_more is False  # a claim for free slots took the last
    sink.free, sink.in_flight = 0, 12
    worker.request_immediate_poll(new_work=True)
    assert worker.run_once().has_more is False  # and nothing else waits


class SlowClaims(FakeCoordinator):
    """Claims that take ``seconds`` of the injected clock: the round trip to the database."""

    def __init__(self, clock: FrozenClock, seconds: float, **kwargs) -> None:
        super().__init__(**kwargs)
        self.clock = clock
        self.seconds = seconds

    def claim(self, max_rows: int, underserved_only: bool = False):
        self.clock.advance(self.seconds)
        return super().claim(max_rows, underserved_only)


def claim_one_slot(in_flight: int, rounds: int = 3):
    """CONCURRENCY 1: each claim takes 90 ms, then 10 rows start in 10 ms."""
    clock = FrozenClock()
    sink = CountingSink(free=1)
    sink.in_flight = in_flight
    coordinator = SlowClaims(clock, 0.09, claims=[[]] * rounds)
    worker = make_worker(coordinator, sink, ClaimPolicy(prefetch=2), clock=clock)
    for _ in range(rounds):
        worker.run_once()
        clock.advance(0.01)
        sink.started_total += 10
    return coordinator.claims, worker


def test_claims_made_while_the_dispatcher_is_empty_do_not_count_against_its_rate():
    # 10 rows per 10 ms of running: 1,000 rows/s; the batch covers ten 90 ms claims
    claims, worker = claim_one_slot(in_flight=0)
    assert claims == [3, 900, 900]
    assert worker.start_rate == pytest.approx(1000)
    assert worker.starved_seconds == pytest.approx(0.27)


def test_claims_made_while_rows_run_count_as_time_the_dispatcher_worked():
    # the same timings, but a row was running during each claim: 10 rows per 100 ms
    claims, worker = claim_one_slot(in_flight=1)
    assert claims == [3, 90, 90]
    assert worker.start_rate == pytest.approx(100)
    assert worker.starved_seconds == 0


def claim_while_a_row_runs(claim_seconds: float, gap: float, max_rows: int = 1000):
    """Three claims of ``claim_seconds`` each, ``gap`` apart, while a row runs: the
    dispatcher starts 1,000 rows/s."""
    clock = FrozenClock()
    sink = CountingSink(free=4)
    sink.in_flight = 1
    coordinator = SlowClaims(clock, claim_seconds, claims=[[]] * 3)
    policy = ClaimPolicy(prefetch=2, max_rows=max_rows)
    worker = make_worker(coordinator, sink, policy, clock=clock)
    for _ in range(3):
        worker.run_once()
        clock.advance(gap)
        sink.started_total += round((claim_seconds + gap) * 1000)
    assert worker.start_rate == pytest.approx(1000)
    return coordinator.claims, worker


def test_a_batch_covers_ten_round_trips_of_a_slow_claim():
    # each claim takes 50 ms: ten of them are 500 rows, where a quarter second is 250
    claims, worker = claim_while_a_row_runs(0.05, 0.06)
    assert worker.claim_seconds == pytest.approx(0.05)
    assert claims == [6, 500, 500]


def test_a_stalled_claim_makes_the_batch_at_most_a_second_of_work():
    # a claim of 300 ms would make ten round trips 3,000 rows
    claims, _ = claim_while_a_row_runs(0.3, 0.01, max_rows=5000)
    assert claims == [6, 1000, 1000]


def test_fast_claims_keep_the_batch_at_a_quarter_second_of_work():
    # claims of 1 ms: ten round trips are 10 rows, a quarter second 250
    claims, _ = claim_while_a_row_runs(0.001, 0.109)
    assert claims == [6, 250, 250]


# a refused claim: the instance was evicted, or is not registered


def test_a_refused_claim_stops_the_instance_and_the_loop():
    refusal = InstanceRefused("claim_work refused instance x: it was evicted at t (by peers).")
    coordinator = FakeCoordinator(claims=[refusal, [make_row()]])
    sink = FakeSink(free=4)
    stops: list[str] = []
    worker = make_worker(coordinator, sink, MINUTE, on_refused=stops.append)

    with watching("django_workpump.claim") as log:
        thread = ServiceThread(worker)
        thread.start()
        thread.finish()  # run() returned by itself: no stop() was needed
        assert log.wait_for("instance_refused", 0)

    assert stops == [str(refusal)]
    assert worker.refused == str(refusal)
    assert coordinator.claims == [6]  # never claimed again
    assert sink.batches == []


def test_after_a_refusal_run_once_claims_nothing_more():
    coordinator = FakeCoordinator(claims=[InstanceRefused("not registered"), [make_row()]])
    worker = make_worker(coordinator, FakeSink(free=4))

    first = worker.run_once()
    second = worker.run_once()

    assert (first.refused, second.refused) == (True, True)
    assert len(coordinator.claims) == 1


# wake flood control: a NOTIFY flood must not become a claim flood


@pytest.fixture
def clock():
    return FrozenClock(start=1000.0)


def fruitless_wakes(worker, count):
    for _ in range(count):
        worker.note_wake_claim(ClaimResult(claimed=0, has_more=False))


def test_wakes_that_claim_nothing_are_spaced_out_after_a_free_run(clock):
    worker = make_worker(policy=ClaimPolicy(polling_interval_ms=250), clock=clock)

    spacings = []
    for _ in range(FREE_FRUITLESS_WAKES + 8):
        spacings.append(worker.wake_spacing_seconds())
        fruitless_wakes(worker, 1)

    assert spacings[:FREE_FRUITLESS_WAKES] == [0.0] * FREE_FRUITLESS_WAKES
    # then doubling from the base, never past the tight poll interval
    assert spacings[FREE_FRUITLESS_WAKES:] == [0.01, 0.02, 0.04, 0.08, 0.16, 0.25, 0.25, 0.25]


def test_a_wake_that_claims_something_ends_the_spacing(clock):
    worker = make_worker(clock=clock)
    fruitless_wakes(worker, FREE_FRUITLESS_WAKES + 3)
    assert worker.wake_spacing_seconds() > 0

    worker.note_wake_claim(ClaimResult(claimed=2, has_more=False))

    assert worker.wake_spacing_seconds() == 0.0


def test_a_quiet_second_ends_the_spacing(clock):
    worker = make_worker(clock=clock)
    fruitless_wakes(worker, FREE_FRUITLESS_WAKES + 3)
    clock.advance(0.5)
    assert worker.wake_spacing_seconds() > 0

    clock.advance(WAKE_FLOOD_QUIET_SECONDS)

    assert worker.wake_spacing_seconds() == 0.0


def test_a_failed_or_busy_claim_is_not_counted_as_a_fruitless_wake(clock):
    worker = make_worker(clock=clock)
    fruitless_wakes(worker, FREE_FRUITLESS_WAKES + 3)
    worker.note_wake_claim(ClaimResult(claimed=0, has_more=False, error=RuntimeError("x")))
    assert worker.fruitless_wakes == 0
    fruitless_wakes(worker, 2)
    worker.note_wake_claim(ClaimResult(claimed=0, has_more=False, skipped_busy=True))
    assert worker.fruitless_wakes == 0


def test_a_loop_flooded_with_wakes_spaces_its_claims():
    worker = None

    def claim_and_get_woken_again():
        worker.request_immediate_poll()  # a NOTIFY for every claim, and never any work
        return []

    coordinator = FakeCoordinator(claims=[claim_and_get_woken_again] * 40)
    worker = make_worker(
        coordinator, policy=ClaimPolicy(polling_interval_ms=20), gate=FakeGate(available=True)
    )

    with running(worker):
        assert coordinator.wait_for_claims(FREE_FRUITLESS_WAKES + 12)

    # every wake past the free run waited before it claimed
    assert worker.wakes_spaced >= 10


# -- freed slots ---------------------------------------------------------------------
def test_a_freed_slot_does_not_wake_a_loop_that_waits_for_no_slot():
    coordinator = FakeCoordinator(claims=[[make_row()]])  # has_more false: nothing waits
    gate = FakeGate(available=True)
    worker = make_worker(coordinator, policy=MINUTE, gate=gate)

    with running(worker):
        assert coordinator.wait_for_claims(1)
        assert gate.wait_for_reads(1)  # waiting its minute
        for _ in range(3):
            worker.slot_freed()
        worker.request_immediate_poll()  # a real wake still claims
        assert coordinator.wait_for_claims(2)
        assert gate.wait_for_reads(2)

    assert len(coordinator.claims) == 2
    assert worker.slot_wakes_skipped == 3


def test_a_freed_slot_wakes_a_loop_that_left_rows_for_want_of_slots():
    coordinator = FakeCoordinator(claims=[[make_row(has_more=True)], []])
    sink = FakeSink(free=4)
    gate = FakeGate(available=True)
    worker = make_worker(coordinator, sink=sink, policy=MINUTE, gate=gate)
    sink.submit = lambda rows, front=False: setattr(sink, "free", 0)  # the rows fill every slot

    with running(worker):
        assert coordinator.wait_for_claims(1)
        assert gate.wait_for_reads(1)  # all slots busy: it waits for one
        sink.free = 1
        worker.slot_freed()
        assert coordinator.wait_for_claims(2)

    assert worker.slot_wakes_skipped == 0


class WatchedSink(FakeSink):
    """A FakeSink that lets a test wait for the claimer's looks at its free slots."""

    def __init__(self, free: int) -> None:
        super().__init__(free)
        self.looks = 0
        self._cond = threading.Condition()

    def free_slots(self) -> int:
        with self._cond:
            self.looks += 1
            self._cond.notify_all()
            return self.free

    def wait_for_looks(self, count: int) -> bool:
        with self._cond:
            return self._cond.wait_for(lambda: self.looks >= count, 10)


def test_a_loop_skipped_for_busy_slots_is_woken_by_the_next_freed_slot():
    coordinator = FakeCoordinator()
    sink = WatchedSink(free=0)
    worker = make_worker(coordinator, sink=sink, policy=MINUTE)

    with running(worker):
        # run_once finds no slot, the loop says it waits for one and looks again.
        assert sink.wait_for_looks(2)
        assert coordinator.claims == []
        sink.free = 2
        worker.slot_freed()
        assert coordinator.wait_for_claims(1)

    assert worker.slot_wakes_skipped == 0
