"""Dispatcher: the rows of a chain (send(after=...)) that a claim leased together.

Each row of a chain's run starts only once the row before it completed on this
instance; a row that does not complete releases the rest unstarted, and a chain's row
that may not run behind its dependency here (a batch handler's, or one whose dependency
is not in the claim) is released at once, never run. Runs on a fake coordinator and a
frozen clock; waits are on Events with a timeout.
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Any

from django_workpump import Work
from django_workpump.registry import Handler, Registry
from tests.fakes import WAIT, FakeCoordinator, drain_rows, make_row


def chain_rows(count: int, topic: str = "step") -> list[Any]:
    """A chain's rows as a claim returns them: each after the one before it."""
    rows = [dataclasses.replace(make_row(), topic=topic)]
    for _ in range(count - 1):
        rows.append(dataclasses.replace(make_row(), topic=topic, after_id=rows[-1].work_id))
    return rows


def run(rows: list[Any], handlers: Registry) -> tuple[FakeCoordinator, threading.Event]:
    """Run ``rows`` on four threads; the Event is set when a run says its stream or chain
    may go on."""
    ready = threading.Event()
    return drain_rows(rows, handlers, concurrency=4, on_stream_ready=ready.set), ready


def registry_with(*handlers: Handler) -> Registry:
    registry = Registry()
    for handler in handlers:
        registry.register(handler)
    return registry


class Recorder:
    """A handler that records which rows ran, and on which thread, failing one row."""

    def __init__(self, fail: Any = None) -> None:
        self.lock = threading.Lock()
        self.ran: list[Any] = []
        self.threads: set[int] = set()
        self.fail = fail

    def __call__(self, work: Work) -> None:
        with self.lock:
            self.ran.append(work.id)
            self.threads.add(threading.get_ident())
        if work.id == self.fail:
            raise RuntimeError("this link fails")


def test_a_chain_runs_in_order_on_one_slot_and_says_when_its_last_row_is_written():
    rows = chain_rows(5)
    recorder = Recorder()
    coordinator, ready = run(rows, registry_with(Handler("outbox", "step", recorder)))

    assert recorder.ran == [row.work_id for row in rows]
    assert len(recorder.threads) == 1  # one slot, though four were free
    assert [work_id for work_id, _ in coordinator.completed] == recorder.ran
    assert ready.wait(WAIT)  # the chain's next row may now be claimed


def test_a_link_that_fails_releases_the_rest_of_the_chain_unstarted():
    rows = chain_rows(4)
    recorder = Recorder(fail=rows[1].work_id)
    coordinator, ready = run(rows, registry_with(Handler("outbox", "step", recorder)))

    assert recorder.ran == [rows[0].work_id, rows[1].work_id]
    assert [work_id for work_id, _ in coordinator.completed] == [rows[0].work_id]
    assert coordinator.released == [rows[2].work_id, rows[3].work_id]
    assert not ready.is_set()


def test_a_chain_row_without_its_dependency_in_the_claim_is_released_never_run():
    orphan = dataclasses.replace(chain_rows(2)[1], topic="step")
    alone = dataclasses.replace(make_row(), topic="step")
    recorder = Recorder()
    coordinator, _ = run([alone, orphan], registry_with(Handler("outbox", "step", recorder)))

    assert recorder.ran == [alone.work_id]
    assert coordinator.released == [orphan.work_id]


def test_the_rows_behind_a_batch_handlers_row_are_released_to_wait_for_it():
    rows = chain_rows(3, topic="batched")
    batches: list[list[Any]] = []
    coordinator, _ = run(
        rows, registry_with(Handler("outbox", "batched", batches.append, batch=True))
    )

    # the first row ran alone; the rest were given back to wait for its completion
    assert [[work.id for work in batch] for batch in batches] == [[rows[0].work_id]]
    assert sorted(coordinator.released) == sorted(row.work_id for row in rows[1:])
