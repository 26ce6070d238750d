"""Cancel, Snooze, Discard and Retry end to end: a real pump in this process, real PostgreSQL.

Tests wait on Events or database conditions with a deadline, never for a fixed time. How
fast a cancel reaches a handler is measured by bench/cancel_latency.py; here the test
shows that it arrives by the NOTIFY path (not the renewal fallback, which the default
300 s lease keeps minutes away) and that the attempt's outcome is fenced out.
"""

from __future__ import annotations

import threading
import uuid
from datetime import timedelta
from typing import Any

import pytest
from django.test import override_settings
from django.utils import timezone

import django_workpump as workpump
from django_workpump import models
from django_workpump.pump.supervisor import EXIT_OK
from django_workpump.states import CancelReason
from tests.helpers import FAST_PUMP, drain, wait_until

pytestmark = pytest.mark.django_db(transaction=True)

FAST = {**FAST_PUMP, "CONCURRENCY": 2}
WAIT = 20.0


@override_settings(WORKPUMP=FAST)
def test_a_running_handler_sees_work_cancelled_and_its_outcome_is_fenced(outbox_handler, pump):
    started, observed = threading.Event(), threading.Event()
    seen: dict[str, Any] = {}
    ran: list[int] = []

    def slow(work: Any) -> dict[str, bool]:
        if work.payload.get("n") == 2:
            ran.append(2)
            return {"second": True}
        started.set()
        if work.lease.cancelled.wait(WAIT):
            seen["reason"] = work.lease.cancel_reason
            seen["cancelled"] = work.cancelled
            seen["why"] = work.cancel_reason
            observed.set()
        return {"late": True}  # reported after the cancel: must not land

    outbox_handler("it.cancel.slow", slow)
    first = workpump.send("it.cancel.slow", {"n": 1}, stream="s")
    workpump.send("it.cancel.slow", {"n": 2}, stream="s")
    supervisor = pump()
    assert started.wait(WAIT)

    result = workpump.cancel([first])

    assert list(result) == [first] and result.running == [first]
    assert observed.wait(WAIT), "the handler never saw work.cancelled"
    assert seen == {"reason": CancelReason.CANCELLED, "cancelled": True, "why": "operator"}
    assert supervisor.gate is not None and supervisor.gate.cancels_received == 1
    # the stream moves on to the next row; the cancelled one keeps no result
    assert wait_until(lambda: ran == [2], WAIT)
    row = models.Outbox.objects.get(work_id=first)
    assert (row.end_state, row.result, row.instance_id) == ("cancelled", None, None)
    assert row.done_at is not None
    assert wait_until(lambda: supervisor.dispatcher.stats.cancelled == 1, WAIT)
    assert wait_until(lambda: supervisor.dispatcher.stats.completed == 1, WAIT)  # the second


@override_settings(WORKPUMP=FAST)
def test_a_running_async_handlers_task_is_cancelled(outbox_handler, pump):
    import asyncio

    started, cancelled = threading.Event(), threading.Event()

    async def sleeper(work: Any) -> None:
        started.set()
        try:
            await asyncio.sleep(WAIT)
        except asyncio.CancelledError:
            cancelled.set()
            raise

    outbox_handler("it.cancel.async", sleeper)
    work_id = workpump.send("it.cancel.async", {})
    pump()
    assert started.wait(WAIT)

    workpump.cancel(work_id)

    assert cancelled.wait(WAIT), "the async handler's task was not cancelled"
    assert models.Outbox.objects.get(work_id=work_id).end_state == "cancelled"


@override_settings(WORKPUMP=FAST)
def test_cancelled_pending_rows_never_run_and_unknown_ids_are_reported(outbox_handler, pump):
    ran: list[str] = []
    outbox_handler("it.cancel.pending", lambda work: ran.append(work.payload["name"]))
    keep = workpump.send("it.cancel.pending", {"name": "keep"})
    drop = workpump.send("it.cancel.pending", {"name": "drop"})
    later = workpump.send(
        "it.cancel.pending", {"name": "later"}, run_after=timezone.now() + timedelta(hours=1)
    )
    unknown = uuid.uuid4()

    result = workpump.cancel([drop, later, unknown])

    assert sorted(map(str, result)) == sorted(map(str, [drop, later]))
    assert (result.unknown, result.running, result.ended) == ([unknown], [], [])
    assert drain(pump(drain=True)) == EXIT_OK
    assert ran == ["keep"]
    assert models.Outbox.objects.get(work_id=keep).end_state is None
    # cancelling again changes nothing: the rows already ended
    again = workpump.cancel([drop, keep])
    assert (list(again), sorted(map(str, again.ended))) == ([], sorted(map(str, [drop, keep])))


@override_settings(WORKPUMP=FAST)
def test_snooze_discard_and_retry_through_the_pump(outbox_handler, pump):
    attempts: list[tuple[str, int]] = []

    def snoozer(work: Any) -> str:
        attempts.append(("snooze", work.attempts))
        if len([a for a in attempts if a[0] == "snooze"]) < 3:
            raise workpump.Snooze(0)
        return "woke"

    def discarder(work: Any) -> None:
        raise workpump.Discard("nothing to do for this one")

    def picky(work: Any) -> None:
        attempts.append(("picky", work.attempts))
        raise KeyError("not retryable")

    outbox_handler("it.snooze", snoozer)
    outbox_handler("it.discard", discarder)
    outbox_handler("it.picky", picky, retry=workpump.Retry(max_attempts=5, on=(TimeoutError,)))
    snoozed = workpump.send("it.snooze", {}, stream="z")
    behind = workpump.send("it.snooze", {}, stream="z")
    discarded = workpump.send("it.discard", {})
    picked = workpump.send("it.picky", {})

    assert drain(pump(drain=True)) == EXIT_OK

    row = models.Outbox.objects.get(work_id=snoozed)
    # three runs, never more than one attempt spent: snoozes give theirs back
    assert [a for a in attempts if a[0] == "snooze"][:3] == [("snooze", 1)] * 3
    assert (row.attempts, row.snoozes, row.result) == (1, 2, "woke")
    assert models.Outbox.objects.get(work_id=behind).done_at is not None
    gone = models.Outbox.objects.get(work_id=discarded)
    assert (gone.end_state, gone.last_error) == ("discarded", "nothing to do for this one")
    dead = models.Outbox.objects.get(work_id=picked)
    assert [a for a in attempts if a[0] == "picky"] == [("picky", 1)]
    assert (dead.failure_reason, dead.max_attempts) == ("not_retryable", 5)
    assert dead.dead_lettered_at is not None


@override_settings(WORKPUMP=FAST)
def test_a_handler_that_releases_at_shutdown_leaves_its_row_to_a_later_pump(outbox_handler, pump):
    started = threading.Event()
    runs: list[tuple[int, Any]] = []

    def long_job(work: Any) -> str:
        if runs:  # the later pump: finish
            runs.append((work.attempts, work.cancel_reason))
            return "finished"
        runs.append((work.attempts, work.cancel_reason))
        started.set()
        for _ in range(int(WAIT * 100)):
            if work.cancelled:
                runs.append((work.attempts, work.cancel_reason))
                raise workpump.Release()
            work.lease.cancelled.wait(0.01)
        return "never told"

    outbox_handler("it.release.shutdown", long_job)
    work_id = workpump.send("it.release.shutdown", {})
    first = pump()
    assert started.wait(WAIT)

    assert first.shutdown() == EXIT_OK

    assert runs == [(1, None), (1, "shutdown")]
    row = models.Outbox.objects.get(work_id=work_id)
    # pending again, its attempt given back, nothing recorded against it
    assert (row.attempts, row.instance_id, row.lease_token) == (0, None, None)
    assert (row.done_at, row.dead_lettered_at, row.failure_reason) == (None, None, None)
    assert (row.result, row.last_error) == (None, None)

    assert drain(pump(drain=True)) == EXIT_OK

    row = models.Outbox.objects.get(work_id=work_id)
    assert runs[-1] == (1, None)
    assert (row.attempts, row.result) == (1, "finished")
    assert row.done_at is not None and row.dead_lettered_at is None
