"""Dispatcher: what a stream run tells the claimer when it ends, and what each row costs.

A stream's next run is claimable only once the completions of its current run are
written, so the dispatcher says when that happened (``on_stream_ready``) instead of
leaving the claimer to a poll or the NOTIFY of the promotion. Runs on a fake coordinator
and a frozen clock; waits are on Events with a timeout.
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Any

import pytest
from django.test import override_settings

import django_workpump as workpump
from django_workpump import Work
from django_workpump.pump import dispatch
from django_workpump.registry import Handler, Registry, registry
from tests.fakes import WAIT, FakeCoordinator, drain_rows, make_row
from tests.helpers import FAST_PUMP, wait_until


def stream_rows(count: int, stream: str | None = "s", topic: str = "ok") -> list[Any]:
    return [dataclasses.replace(make_row(), stream=stream, topic=topic) for _ in range(count)]


class Ready:
    """on_stream_ready: records what the coordinator had completed at each call."""

    def __init__(self, coordinator: FakeCoordinator) -> None:
        self.coordinator = coordinator
        self.calls: list[list[Any]] = []
        self.called = threading.Event()

    def __call__(self) -> None:
        self.calls.append([work_id for work_id, _ in self.coordinator.completed])
        self.called.set()


def run(rows: list[Any], handlers: Registry, **kwargs: Any) -> tuple[FakeCoordinator, Ready]:
    coordinator = FakeCoordinator()
    ready = Ready(coordinator)
    drain_rows(rows, handlers, coordinator, on_stream_ready=ready, **kwargs)
    return coordinator, ready


def registry_with(**funcs: Any) -> Registry:
    handlers = Registry()
    for topic, func in funcs.items():
        handlers.register(Handler("outbox", topic, func))
    return handlers


def test_a_stream_run_that_completes_says_so_once_its_completions_are_written():
    rows = stream_rows(3)
    coordinator, ready = run(rows, registry_with(ok=lambda work: None))

    assert ready.called.wait(WAIT)
    assert len(ready.calls) == 1
    # Called after the write that took the run's last row, never before it.
    assert rows[-1].work_id in ready.calls[0]
    assert [work_id for work_id, _ in coordinator.completed] == [row.work_id for row in rows]


def test_a_stream_run_cut_short_by_a_failure_does_not_say_the_stream_is_ready():
    def fail_second(work: Work) -> None:
        if work.id == rows[1].work_id:
            raise RuntimeError("the second row fails")

    rows = stream_rows(3)
    coordinator, ready = run(rows, registry_with(ok=fail_second))

    # Its next row is the failed one's retry, not claimable now.
    assert ready.calls == []
    assert [work_id for work_id, _ in coordinator.completed] == [rows[0].work_id]
    assert coordinator.released == [rows[2].work_id]


def test_unordered_rows_never_say_a_stream_is_ready():
    rows = stream_rows(3, stream=None)
    coordinator, ready = run(rows, registry_with(ok=lambda work: None))

    assert len(coordinator.completed) == 3
    assert ready.calls == []


@pytest.mark.parametrize("count", [1, 4])
def test_connections_are_tidied_once_between_two_rows_of_a_run(monkeypatch, count):
    tidied: list[str] = []
    ran: list[int] = []

    def between_jobs(mode: str) -> None:
        tidied.append(f"tidy after {len(ran)}")  # how many rows ran before it

    def handle(work: Work) -> None:
        ran.append(len(ran))

    monkeypatch.setattr(dispatch, "between_jobs", between_jobs)
    run(stream_rows(count), registry_with(ok=handle))

    # Once before the run and once after each row (that one also serves the next row).
    assert tidied == ["tidy after 0"] + [f"tidy after {n}" for n in range(1, count + 1)]


MINUTE_POLLS = {
    **FAST_PUMP,
    "STREAM_RUN_MAX": 10,
    "POLLING_INTERVAL_MS": 60_000,
    "POLLING_MAX_INTERVAL_MS": 60_000,
    "NOTIFY_HEALTHY_POLLING_INTERVAL_MS": 60_000,
}


@pytest.mark.django_db(transaction=True)
@override_settings(WORKPUMP=MINUTE_POLLS)
def test_a_stream_moves_run_after_run_without_a_poll_or_a_notify(pump):
    """No NOTIFY listener and a poll a minute: only the dispatcher saying that a run's
    completions are written gets the stream's next run claimed in time."""
    ran: list[int] = []
    workpump.outbox_handler("ready.hot")(lambda work: ran.append(work.payload["n"]))
    try:
        for n in range(30):
            workpump.send("ready.hot", {"n": n}, stream="hot")
        supervisor = pump(listen=False)
        assert wait_until(lambda: len(ran) == 30, timeout=20)
        supervisor.shutdown()
    finally:
        registry.unregister("outbox", "ready.hot")

    assert ran == list(range(30))
    assert supervisor.claim.claimed_total == 30  # three runs of ten
