"""HeartbeatWorker: adaptive cadence, eviction, failed beats and the stale-peer probe.

Cadence and timers run on a FrozenClock through cadence()/beat()/run_once(). The loop runs in
a thread only to show it ends on eviction; the fake coordinator moves the frozen clock on each
beat, so the loop never waits on real time.
"""

from __future__ import annotations

import logging
import threading
import uuid
from dataclasses import replace

import pytest

from django_workpump.clock import FrozenClock
from django_workpump.pump.heartbeat import (
    ADVISORY_LOCK_MODE,
    PROBE_MARGIN_SECONDS,
    TABLE_ONLY_MODE,
    HeartbeatPolicy,
    HeartbeatWorker,
    heartbeat_cadence,
)
from tests.fakes import FakeCoordinator, ServiceThread

POLICY = HeartbeatPolicy(
    interval_seconds=5, slow_interval_seconds=60, stale_peer_probe_interval_seconds=5
)
START = 1000.0
NEVER = float("inf")


class AliveLock:
    """An alive-lock source a test can take and drop."""

    def __init__(self, held: bool) -> None:
        self.held = held

    def __call__(self) -> bool:
        return self.held


@pytest.fixture
def clock():
    return FrozenClock(start=START)


def make_worker(coordinator=None, policy=POLICY, **kwargs):
    return HeartbeatWorker(coordinator or FakeCoordinator(), policy, **kwargs)


# Adaptive cadence (interval 5, slow 60)


# original: LockHeld_AdvisoryLockMode_UsesSlowCadenceAsync
def test_held_alive_lock_gives_the_slow_cadence():
    assert make_worker(alive_lock_held=AliveLock(True)).cadence() == 60


# original: LockNotHeld_AdvisoryLockMode_UsesFastCadenceAsync
def test_alive_lock_not_held_gives_the_fast_cadence():
    assert make_worker(alive_lock_held=AliveLock(False)).cadence() == 5


# original: NoLockSource_AdvisoryLockMode_UsesFastCadenceAsync
def test_no_alive_lock_source_gives_the_fast_cadence():
    assert make_worker(alive_lock_held=None).cadence() == 5


# original: HeartbeatTableOnlyMode_IgnoresLockAndUsesFastCadenceAsync
def test_table_only_mode_ignores_a_held_lock_and_gives_the_fast_cadence():
    policy = HeartbeatPolicy(
        interval_seconds=5, slow_interval_seconds=60, liveness_source_mode=TABLE_ONLY_MODE
    )

    assert make_worker(policy=policy, alive_lock_held=AliveLock(True)).cadence() == 5


# original: LockTransitionsHeldToNotHeld_NextResolveReturnsFastCadenceAsync
def test_dropping_the_alive_lock_makes_the_next_cadence_fast():
    lock = AliveLock(True)
    worker = make_worker(alive_lock_held=lock)
    assert worker.cadence() == 60

    lock.held = False

    assert worker.cadence() == 5


# original: LockTransitionsNotHeldToHeld_NextResolveReturnsSlowCadenceAsync
def test_taking_the_alive_lock_makes_the_next_cadence_slow():
    lock = AliveLock(False)
    worker = make_worker(alive_lock_held=lock)
    assert worker.cadence() == 5

    lock.held = True

    assert worker.cadence() == 60


@pytest.mark.parametrize(
    ("mode", "held", "expected"),
    [
        (ADVISORY_LOCK_MODE, True, 60),
        (ADVISORY_LOCK_MODE, False, 5),
        (ADVISORY_LOCK_MODE, None, 5),
        (TABLE_ONLY_MODE, True, 5),
        (TABLE_ONLY_MODE, None, 5),
    ],
)
def test_heartbeat_cadence_table(mode, held, expected):
    policy = HeartbeatPolicy(
        interval_seconds=5, slow_interval_seconds=60, liveness_source_mode=mode
    )

    assert heartbeat_cadence(policy, held) == expected


# beat()


def test_accepted_beat_sends_the_metadata_and_counts(clock):
    coordinator = FakeCoordinator()
    worker = make_worker(coordinator, metadata=lambda: {"in_flight": 3}, clock=clock)

    result = worker.beat()

    assert result.accepted is True
    assert result.cadence == 5
    assert coordinator.heartbeats == [{"in_flight": 3}]
    assert worker.beats == 1
    assert worker.last_beat_at == START
    assert worker.evicted is False


def test_refused_beat_marks_the_instance_evicted_and_calls_on_evicted_once(caplog):
    coordinator = FakeCoordinator(heartbeats=[False])
    evictions = []
    worker = make_worker(coordinator, on_evicted=lambda: evictions.append(True))

    result = worker.beat()

    assert result.accepted is False
    assert worker.evicted is True
    assert evictions == [True]
    [record] = [r for r in caplog.records if getattr(r, "action", None) == "evicted"]
    assert record.levelno == logging.ERROR
    assert str(coordinator.identity.instance_id) in record.getMessage()


def test_raising_beat_is_counted_as_failed_and_the_next_beat_goes_ahead(clock, caplog):
    coordinator = FakeCoordinator(heartbeats=[RuntimeError("server closed the connection")])
    worker = make_worker(coordinator, clock=clock)

    next_beat, _ = worker.run_once(START, NEVER)

    assert worker.failed_beats == 1
    assert worker.beats == 0
    assert worker.evicted is False
    assert worker.last_beat_at is None
    assert next_beat == START + 0.5  # retried soon: peers wait only one grace
    [record] = [r for r in caplog.records if getattr(r, "action", None) == "heartbeat_failed"]
    assert "server closed the connection" in record.getMessage()

    clock.advance(0.5)
    worker.run_once(next_beat, NEVER)

    assert worker.beats == 1
    assert len(coordinator.heartbeats) == 2


def test_failed_beats_are_retried_sooner_than_the_cadence_backing_off_up_to_it(clock):
    error = RuntimeError("server closed the connection")
    coordinator = FakeCoordinator(heartbeats=[error] * 6 + [True, True])
    worker = make_worker(coordinator, alive_lock_held=AliveLock(True), clock=clock)

    waits = []
    next_beat = START
    for _ in range(8):
        clock.advance(max(0.0, next_beat - clock.monotonic()))
        before = clock.monotonic()
        next_beat, _ = worker.run_once(next_beat, NEVER)
        waits.append(next_beat - before)

    # 0.5 s, doubling (never past the cadence); an accepted beat goes back to the cadence
    assert waits[:6] == [0.5, 1.0, 2.0, 4.0, 8.0, 16.0]
    assert waits[6:] == [60, 60]
    assert worker.failed_beats == 6
    assert worker.beats == 2


# original: HeartbeatWorkerTests.ExecuteAsync_WhenEvicted_StopsHeartbeatingAsync
def test_loop_stops_by_itself_once_a_beat_is_refused(clock):
    # Each beat moves the frozen clock a cadence on, so the loop is due again at once.
    evicted = threading.Event()
    on_evicted_calls = []

    def on_evicted():
        on_evicted_calls.append(True)
        evicted.set()

    coordinator = FakeCoordinator(heartbeats=[True, False], on_heartbeat=lambda: clock.advance(5))
    worker = make_worker(coordinator, on_evicted=on_evicted, clock=clock)
    thread = ServiceThread(worker)

    thread.start()
    assert evicted.wait(5)
    thread.finish()  # returned without stop()

    assert worker.evicted is True
    assert len(coordinator.heartbeats) == 2
    assert on_evicted_calls == [True]


def test_raising_beats_do_not_stop_the_loop(clock):
    error = RuntimeError("timeout expired")
    coordinator = FakeCoordinator(
        heartbeats=[error, error, False], on_heartbeat=lambda: clock.advance(5)
    )
    worker = make_worker(coordinator, clock=clock)
    thread = ServiceThread(worker)

    thread.start()
    thread.finish()  # the third beat was refused, so the loop ended by itself

    assert worker.failed_beats == 2
    assert len(coordinator.heartbeats) == 3
    assert worker.evicted is True


def test_stop_ends_a_loop_waiting_for_its_next_beat(clock):
    coordinator = FakeCoordinator()
    beaten = threading.Event()
    coordinator.on_heartbeat = beaten.set
    worker = make_worker(coordinator, clock=clock)
    thread = ServiceThread(worker)

    thread.start()
    assert beaten.wait(5)
    worker.stop()
    thread.finish()

    assert worker.evicted is False
    assert len(coordinator.heartbeats) == 1  # the frozen clock never made another beat due


# probe_peers()


def test_probe_without_an_evictable_peer_does_not_reap():
    coordinator = FakeCoordinator(eviction_due_in=None, reap=[uuid.uuid4()])
    worker = make_worker(coordinator)

    assert worker.probe_peers() == []

    assert coordinator.calls == ["next_eviction_in"]
    assert worker.probes == 1
    assert worker.reaped == []


def test_probe_that_finds_an_evictable_peer_reaps_and_records_it(caplog):
    dead = uuid.uuid4()
    coordinator = FakeCoordinator(eviction_due_in=0.0, reap=[dead])
    worker = make_worker(coordinator)

    assert worker.probe_peers() == [dead]

    assert coordinator.calls == ["next_eviction_in", "reap_stale"]
    assert worker.reaped == [dead]
    [record] = [r for r in caplog.records if getattr(r, "action", None) == "reaped"]
    assert str(dead) in record.getMessage()


def test_failing_probe_is_logged_and_returns_nothing(caplog):
    coordinator = FakeCoordinator(eviction_due_in=RuntimeError("statement timeout"))
    worker = make_worker(coordinator)

    assert worker.probe_peers() == []

    assert coordinator.reap_calls == 0
    assert [getattr(r, "action", None) for r in caplog.records] == ["probe_failed"]


# run_once(): the two timers


def test_beat_happens_when_due_and_not_before(clock):
    coordinator = FakeCoordinator()
    worker = make_worker(coordinator, clock=clock)

    next_beat, _ = worker.run_once(START, NEVER)
    assert worker.beats == 1
    assert next_beat == START + 5

    clock.advance(4.9)
    assert worker.run_once(next_beat, NEVER)[0] == next_beat
    assert worker.beats == 1

    clock.advance(0.1)
    next_beat, _ = worker.run_once(next_beat, NEVER)
    assert worker.beats == 2
    assert next_beat == START + 10


def test_held_lock_schedules_the_next_beat_a_slow_cadence_away(clock):
    worker = make_worker(alive_lock_held=AliveLock(True), clock=clock)

    next_beat, _ = worker.run_once(START, NEVER)

    assert next_beat == START + 60


def test_probe_runs_on_its_own_cadence_between_slow_beats(clock):
    coordinator = FakeCoordinator()
    worker = make_worker(coordinator, alive_lock_held=AliveLock(True), clock=clock)
    next_beat, next_probe = worker.run_once(START, START)
    assert (worker.beats, worker.probes) == (1, 1)

    for step in range(1, 12):  # 5 s .. 55 s: a probe each time, no beat
        clock.advance(5)
        next_beat, next_probe = worker.run_once(next_beat, next_probe)
        assert (worker.beats, worker.probes) == (1, 1 + step)
        assert next_probe == clock.monotonic() + 5

    clock.advance(5)  # 60 s: both are due
    worker.run_once(next_beat, next_probe)
    assert (worker.beats, worker.probes) == (2, 13)
    assert coordinator.calls.count("heartbeat") == 2


def test_a_peer_becoming_evictable_before_the_next_probe_brings_that_probe_forward(clock):
    dead = uuid.uuid4()
    coordinator = FakeCoordinator(eviction_due_in=2.0, reap=[dead])
    worker = make_worker(coordinator, clock=clock)

    _, next_probe = worker.run_once(NEVER, START)
    assert next_probe == START + 2.0 + PROBE_MARGIN_SECONDS  # not the regular START + 5
    assert worker.reaped == []

    coordinator.eviction_due_in = 0.0
    clock.advance(next_probe - START)
    _, next_probe = worker.run_once(NEVER, next_probe)

    assert worker.reaped == [dead]
    assert coordinator.calls == ["next_eviction_in", "next_eviction_in", "reap_stale"]
    assert next_probe == clock.monotonic() + 5  # back to the regular cadence


def test_a_peer_evictable_only_after_the_next_regular_probe_changes_nothing(clock):
    worker = make_worker(FakeCoordinator(eviction_due_in=7.5), clock=clock)

    _, next_probe = worker.run_once(NEVER, START)

    assert next_probe == START + 5


def test_probe_is_not_run_before_it_is_due(clock):
    coordinator = FakeCoordinator()
    worker = make_worker(coordinator, clock=clock)

    _, next_probe = worker.run_once(NEVER, START + 5)
    clock.advance(4.9)
    worker.run_once(NEVER, next_probe)

    assert worker.probes == 0
    assert coordinator.calls == []


def test_disabled_heartbeat_never_beats_but_still_probes(clock):
    coordinator = FakeCoordinator()
    worker = make_worker(coordinator, policy=replace(POLICY, enabled=False), clock=clock)
    next_beat, next_probe = START, START

    for _ in range(4):
        next_beat, next_probe = worker.run_once(next_beat, next_probe)
        clock.advance(5)

    assert worker.beats == 0
    assert "heartbeat" not in coordinator.calls
    assert worker.probes == 4
    assert coordinator.calls == ["next_eviction_in"] * 4


def test_a_requested_beat_goes_out_at_once_instead_of_at_the_slow_cadence(clock):
    lock = AliveLock(True)
    worker = make_worker(alive_lock_held=lock, clock=clock)
    next_beat, _ = worker.run_once(START, NEVER)
    assert next_beat == START + 60

    clock.advance(1)
    worker.request_beat()  # the NOTIFY gate just lost its connection (and the lock)
    next_beat, _ = worker.run_once(next_beat, NEVER)

    assert worker.beats == 2
    # one request, one beat: the next tick waits for the cadence again
    clock.advance(1)
    worker.run_once(next_beat, NEVER)
    assert worker.beats == 2
