"""BatchFlusher: coalescing window, size triggers, FIFO, failures, capacity, drain.

Timing logic runs on a FrozenClock through due()/flush_once(); the threaded tests wait on an
Event set by the flush callback, never on sleep.
"""

from __future__ import annotations

import logging
import threading

import pytest
from django.db import DataError, OperationalError

from django_workpump.clock import FrozenClock
from django_workpump.pump.flusher import BatchFlusher


class Recorder:
    """A flush callback that records batches and can be told to fail."""

    def __init__(self, *, fail_times=0):
        self.batches: list[list[int]] = []
        self.fail_times = fail_times
        self.flushed = threading.Event()

    def __call__(self, batch):
        if self.fail_times > 0:
            self.fail_times -= 1
            raise OperationalError("database went away")
        self.batches.append(list(batch))
        self.flushed.set()

    @property
    def items(self):
        return [item for batch in self.batches for item in batch]


@pytest.fixture
def clock():
    return FrozenClock(start=1000.0)


def make_flusher(flush, clock=None, **options):
    return BatchFlusher("test-flusher", flush, clock=clock, **options)


def test_single_item_is_due_only_once_the_window_has_passed(clock):
    flusher = make_flusher(Recorder(), clock, coalesce_window=0.2)
    assert not flusher.due()

    flusher.put(1)
    assert not flusher.due()
    clock.advance(0.19)
    assert not flusher.due()
    clock.advance(0.01)
    assert flusher.due()


def test_flush_once_takes_at_most_max_batch_items(clock):
    recorder = Recorder()
    flusher = make_flusher(recorder, clock, max_batch=200)
    for item in range(250):
        flusher.put(item)

    assert flusher.flush_once() == 200
    assert flusher.flush_once() == 50
    assert flusher.flush_once() == 0

    assert [len(batch) for batch in recorder.batches] == [200, 50]
    assert flusher.flushed_items == 250
    assert len(flusher) == 0


def test_reaching_the_immediate_threshold_makes_it_due_at_once(clock):
    flusher = make_flusher(Recorder(), clock, immediate_flush_at=100, coalesce_window=60)
    for item in range(99):
        flusher.put(item)
    assert not flusher.due()

    flusher.put(99)

    assert flusher.due()


def test_a_full_batch_is_due_even_below_the_immediate_threshold(clock):
    flusher = make_flusher(Recorder(), clock, max_batch=5, immediate_flush_at=50, capacity=50)
    for item in range(5):
        flusher.put(item)

    assert flusher.due()


def test_batches_keep_arrival_order(clock):
    recorder = Recorder()
    flusher = make_flusher(recorder, clock, max_batch=3)
    for item in range(7):
        flusher.put(item)

    while flusher.flush_once():
        pass

    assert recorder.batches == [[0, 1, 2], [3, 4, 5], [6]]


def test_empty_flush_once_does_not_call_flush(clock):
    recorder = Recorder()
    flusher = make_flusher(recorder, clock)

    assert flusher.flush_once() == 0
    assert recorder.batches == []


def test_failed_flush_puts_the_batch_back_in_front(clock, caplog):
    recorder = Recorder(fail_times=1)
    flusher = make_flusher(recorder, clock)
    for item in (1, 2, 3):
        flusher.put(item)

    with caplog.at_level(logging.WARNING, logger="django_workpump.pump.flusher"):
        assert flusher.flush_once() == 0
    flusher.put(4)
    assert flusher.flush_once() == 4

    assert recorder.batches == [[1, 2, 3, 4]]
    assert flusher.failed_flushes == 1
    assert flusher.flushed_items == 4
    assert [r.action for r in caplog.records] == ["flusher_flush_failed"]


def test_failed_flush_is_not_due_again_before_a_window(clock):
    flusher = make_flusher(Recorder(fail_times=1), clock, coalesce_window=0.2, immediate_flush_at=2)
    flusher.put(1)
    flusher.put(2)
    assert flusher.due()

    flusher.flush_once()

    assert not flusher.due()  # backs off instead of hammering a failing database
    clock.advance(0.2)
    assert flusher.due()


def test_put_back_over_capacity_drops_the_newest_items(clock):
    flusher = None

    def flush(batch):
        # While this batch is out, producers fill the buffer to capacity.
        for item in (10, 11, 12):
            assert flusher.put(item)
        raise OperationalError("database went away")

    flusher = make_flusher(flush, clock, max_batch=2, capacity=4)
    flusher.put(1)
    flusher.put(2)

    flusher.flush_once()

    assert flusher.dropped_items == 1
    recorder = Recorder()
    flusher._flush = recorder
    while flusher.flush_once():
        pass
    assert recorder.items == [1, 2, 10, 11]


def test_put_is_refused_when_the_buffer_is_at_capacity(clock, caplog):
    flusher = make_flusher(Recorder(), clock, max_batch=2, capacity=3)
    assert all(flusher.put(item) for item in range(3))

    with caplog.at_level(logging.WARNING, logger="django_workpump.pump.flusher"):
        assert flusher.put(3) is False

    assert len(flusher) == 3
    assert [r.action for r in caplog.records] == ["flusher_full"]
    flusher.flush_once()
    assert flusher.put(4) is True


def test_final_drain_gives_up_after_two_failures_in_a_row(clock):
    recorder = Recorder(fail_times=5)
    flusher = make_flusher(recorder, clock)
    flusher.put(1)
    stop = threading.Event()
    stop.set()

    flusher.run(stop)  # stop already set: goes straight to the final drain, then returns

    assert flusher.failed_flushes == 2
    assert len(flusher) == 1
    assert recorder.batches == []


def test_stop_is_idempotent_and_safe_before_start(clock):
    flusher = make_flusher(Recorder(), clock)

    flusher.stop()
    flusher.stop()

    with pytest.raises(RuntimeError, match="already started or stopped"):
        flusher.start()


def test_stop_drains_everything_left():
    recorder = Recorder()
    flusher = make_flusher(recorder, max_batch=2, coalesce_window=60, immediate_flush_at=50)
    flusher.start()
    for item in range(5):
        flusher.put(item)

    flusher.stop(timeout=5)
    flusher.stop(timeout=5)

    assert recorder.items == [0, 1, 2, 3, 4]
    assert len(flusher) == 0
    assert not flusher._thread.is_alive()


def test_the_flusher_thread_runs_its_exit_hook_after_the_final_drain_in_its_own_thread():
    recorder = Recorder()
    seen: list[tuple[list[int], str]] = []
    flusher = BatchFlusher(
        "exit-hook",
        recorder,
        coalesce_window=60,
        on_thread_exit=lambda: seen.append((list(recorder.items), threading.current_thread().name)),
    )
    flusher.start()
    flusher.put(1)
    flusher.stop(timeout=5)

    # The hook (which closes the thread's DB connection in the pump) ran once, after
    # the drain, on the flusher's thread.
    assert seen == [([1], "exit-hook")]


def test_started_flusher_delivers_an_item_within_the_window():
    recorder = Recorder()
    flusher = make_flusher(recorder, coalesce_window=0.05)
    flusher.start()
    try:
        flusher.put("renew")
        assert recorder.flushed.wait(timeout=5)
    finally:
        flusher.stop()

    assert recorder.batches == [["renew"]]
    assert flusher._thread.name == "test-flusher"


def test_started_flusher_flushes_at_the_immediate_threshold_without_waiting_the_window():
    recorder = Recorder()
    flusher = make_flusher(recorder, coalesce_window=600, immediate_flush_at=3)
    flusher.start()
    try:
        for item in range(3):
            flusher.put(item)
        assert recorder.flushed.wait(timeout=5)
    finally:
        flusher.stop()

    assert recorder.items == [0, 1, 2]


# Errors: connection errors are retried, data errors are split around


class Picky:
    """A flush callback that refuses (DataError) every batch holding a 'bad' item."""

    def __init__(self):
        self.calls: list[list[str]] = []
        self.written: list[str] = []

    def __call__(self, batch):
        self.calls.append(list(batch))
        if any(item.startswith("bad") for item in batch):
            raise DataError("unsupported Unicode escape sequence")
        self.written.extend(batch)


def test_a_data_error_is_split_around_and_only_the_bad_item_takes_the_safe_path(clock, caplog):
    picky = Picky()
    rejected = []
    flusher = make_flusher(
        picky, clock, max_batch=16, on_rejected=lambda item, exc: rejected.append((item, exc))
    )
    items = [f"good-{n}" for n in range(16)]
    items[5] = "bad-5"
    for item in items:
        flusher.put(item)

    with caplog.at_level(logging.WARNING, logger="django_workpump.pump.flusher"):
        assert flusher.flush_once() == 16

    assert picky.written == [item for item in items if item != "bad-5"]  # in arrival order
    assert [(item, type(exc)) for item, exc in rejected] == [("bad-5", DataError)]
    assert len(picky.calls) <= 2 * 4 + 1  # halving: a few calls per bad item, not one per item
    assert len(flusher) == 0 and flusher.due() is False  # nothing is retried
    assert flusher.rejected_items == 1 and flusher.failed_flushes == 0
    assert [r.action for r in caplog.records] == ["flusher_item_rejected"]


def test_a_refused_item_without_a_safe_path_is_dropped_and_logged(clock, caplog):
    picky = Picky()
    flusher = make_flusher(picky, clock)
    for item in ("good-1", "bad-2", "bad-3", "good-4"):
        flusher.put(item)

    with caplog.at_level(logging.WARNING, logger="django_workpump.pump.flusher"):
        assert flusher.flush_once() == 4

    assert picky.written == ["good-1", "good-4"]
    assert flusher.dropped_items == 2
    assert [r.action for r in caplog.records].count("flusher_item_dropped") == 2


def test_a_safe_path_that_fails_on_the_connection_puts_the_item_back(clock):
    picky = Picky()
    fail_next = [True]

    def on_rejected(item, exc):
        if fail_next[0]:
            fail_next[0] = False
            raise OperationalError("server closed the connection unexpectedly")

    flusher = make_flusher(picky, clock, on_rejected=on_rejected)
    for item in ("good-1", "bad-2", "good-3"):
        flusher.put(item)

    assert flusher.flush_once() == 1  # good-1; bad-2 and what follows go back
    assert picky.written == ["good-1"]
    clock.advance(1)
    assert flusher.flush_once() == 2

    assert picky.written == ["good-1", "good-3"]
    assert flusher.rejected_items == 2 and flusher.dropped_items == 0


def test_groups_are_flushed_apart_and_a_connection_error_keeps_only_the_rest(clock):
    calls = []

    def flush(batch):
        calls.append(list(batch))
        if batch[0][0] == "inbox" and len(calls) == 2:
            raise OperationalError("terminating connection due to administrator command")

    flusher = make_flusher(flush, clock, group_by=lambda item: item[0])
    for item in [("outbox", 1), ("inbox", 2), ("outbox", 3), ("receptor", 4)]:
        flusher.put(item)

    assert flusher.flush_once() == 2  # the outbox group was written before inbox failed
    clock.advance(1)
    assert flusher.flush_once() == 2

    assert calls == [
        [("outbox", 1), ("outbox", 3)],
        [("inbox", 2)],
        [("inbox", 2)],
        [("receptor", 4)],
    ]


def test_connection_errors_are_retried_with_a_doubling_capped_delay(clock):
    flusher = make_flusher(
        Recorder(fail_times=10), clock, coalesce_window=0.1, immediate_flush_at=1,
        max_retry_delay=1.0,
    )  # fmt: skip
    flusher.put(1)
    for delay in (0.1, 0.2, 0.4, 0.8, 1.0, 1.0):
        assert flusher.due()
        flusher.flush_once()
        clock.advance(delay - 0.01)
        assert not flusher.due()
        clock.advance(0.01)

    assert flusher.due()
    assert flusher.failed_flushes == 6


def test_a_flusher_that_cannot_write_says_it_is_stalled_until_it_writes_again(clock, caplog):
    recorder = Recorder(fail_times=3)
    flusher = make_flusher(recorder, clock, coalesce_window=0.1)
    flusher.put(1)
    assert flusher.health().stalled is False

    with caplog.at_level(logging.WARNING, logger="django_workpump.pump.flusher"):
        for _ in range(3):
            flusher.flush_once()
            clock.advance(1)
        health = flusher.health()
        assert health.stalled is True
        assert (health.failures, health.pending) == (3, 1)
        assert health.failing_seconds == pytest.approx(3.0)
        assert health.last_error == "OperationalError: database went away"
        assert health.summary() == (
            "test-flusher(3 failures in 3s, 1 waiting: OperationalError: database went away)"
        )
        assert flusher.flush_once() == 1

    assert flusher.health().stalled is False
    assert [r.action for r in caplog.records] == [
        "flusher_flush_failed",
        "flusher_flush_failed",
        "flusher_stalled",
        "flusher_recovered",
    ]
