"""Batch perspectives and receptors: one call per stream run, with ``list[Work]`` in order.

Real pumps on real PostgreSQL; events are emitted before the pump starts, so a stream's
rows are claimed as runs.
"""

from __future__ import annotations

import itertools
import threading
import uuid
from typing import Any

import pytest
from django.test import override_settings

import django_workpump as workpump
from django_workpump import models
from django_workpump.pump.supervisor import EXIT_OK
from tests.helpers import FAST_PUMP, drain, run_sql, wait_until

pytestmark = pytest.mark.django_db(transaction=True)

FAST = {**FAST_PUMP, "CONCURRENCY": 2, "CLAIM_PREFETCH": 50, "STREAM_RUN_MAX": 100}


@pytest.mark.parametrize("kind", ["perspective", "receptor"])
@override_settings(WORKPUMP=FAST)
def test_a_batch_handler_gets_each_stream_run_as_one_list_in_order(handlers, pump, kind):
    calls: list[tuple[str, list[int]]] = []
    lock = threading.Lock()

    def project(works: list[Any]) -> None:
        assert isinstance(works, list)
        with lock:
            calls.append((works[0].stream, [work.payload["n"] for work in works]))
            assert {work.stream for work in works} == {works[0].stream}

    handlers(kind, "batch.totals", project, events=["batch.placed"], batch=True)
    for n in range(20):
        for stream in ("a", "b"):
            workpump.emit("batch.placed", {"n": n}, stream=stream)

    assert drain(pump(drain=True)) == EXIT_OK
    for stream in ("a", "b"):
        runs = [ns for s, ns in calls if s == stream]
        assert [n for ns in runs for n in ns] == list(range(20))
        assert len(runs) < 20, "rows came one per call, not as runs"
    model = models.PerspectiveEvent if kind == "perspective" else models.ReceptorProcessing
    assert set(model.objects.values_list("attempts", flat=True)) == {1}


@override_settings(WORKPUMP=FAST)
def test_a_failing_batch_fails_the_first_row_and_releases_the_rest_unspent(handlers, pump):
    calls: list[list[int]] = []

    def project(works: list[Any]) -> None:
        calls.append([(work.payload["n"], work.attempts) for work in works])
        if len(calls) == 1:
            raise RuntimeError("the first batch fails")

    handlers("perspective", "batch.fail", project, events=["batch.failing"], batch=True)
    for n in range(6):
        workpump.emit("batch.failing", {"n": n}, stream="s")

    assert drain(pump(drain=True)) == EXIT_OK
    first = calls[0]
    assert [n for n, _ in first] == list(range(6))
    # the retry starts with the failed first row (its second attempt), the rest on their first
    rerun = [pair for call in calls[1:] for pair in call]
    assert rerun == [(0, 2), *((n, 1) for n in range(1, 6))]
    rows = list(models.PerspectiveEvent.objects.order_by("seq"))
    assert rows[0].last_error.startswith("RuntimeError")
    assert [row.attempts for row in rows] == [2, 1, 1, 1, 1, 1]


@override_settings(WORKPUMP=FAST)
def test_an_atomic_batch_rolls_back_the_whole_run_when_a_lease_is_lost(handlers, pump, raw_connect):
    run_sql("CREATE TABLE batch_effect (work_id uuid, attempt int, call int)")
    try:
        entered = threading.Event()
        proceed = threading.Event()
        calls = itertools.count(1)

        def project(works: list[Any]) -> None:
            call = next(calls)
            for work in works:
                run_sql(
                    "INSERT INTO batch_effect VALUES (%s, %s, %s)", [work.id, work.attempts, call]
                )
            if call == 1:
                entered.set()
                proceed.wait(10)

        handlers(
            "perspective", "batch.atomic", project, events=["batch.atomic"], atomic=True, batch=True
        )
        for n in range(5):
            workpump.emit("batch.atomic", {"n": n}, stream="s")
        supervisor = pump()
        assert entered.wait(10)
        # Another instance takes the run's last two rows over while the batch runs.
        taken = list(models.PerspectiveEvent.objects.order_by("-seq")[:2])
        assert all(row.instance_id is not None for row in taken)
        thief = uuid.uuid4()
        other = raw_connect()
        other.execute(
            "UPDATE workpump_perspective_event SET instance_id = %s,"
            " lease_expiry = now() + interval '1 h' WHERE work_id = ANY (%s)",
            [thief, [row.work_id for row in taken]],
        )
        proceed.set()
        # each row whose lease was lost counts
        assert wait_until(lambda: supervisor.dispatcher.stats.lost_leases >= 2)
        # Nothing of the first call committed: not one of its effects (its rows not taken
        # over run again at once, in a call of their own), and the taken rows not completed.
        assert run_sql("SELECT count(*) AS n FROM batch_effect WHERE call = 1")[0]["n"] == 0
        assert not models.PerspectiveEvent.objects.filter(
            work_id__in=[row.work_id for row in taken], done_at__isnull=False
        ).exists()
        # Once the thief lets go, the stream runs again from its first row, in order.
        other.execute(
            "SELECT workpump.release_leases('perspective_event', %s::uuid[], p_force => true)",
            [[row.work_id for row in taken]],
        )
        assert wait_until(
            lambda: not models.PerspectiveEvent.objects.filter(done_at__isnull=True).exists()
        )
        effects = run_sql("SELECT work_id FROM batch_effect")
        order = list(
            models.PerspectiveEvent.objects.order_by("seq").values_list("work_id", flat=True)
        )
        assert [row["work_id"] for row in effects] == order
    finally:
        run_sql("DROP TABLE batch_effect")


@pytest.mark.parametrize("outcome", ["snooze", "discard"])
@override_settings(WORKPUMP=FAST)
def test_a_batch_naming_a_poison_row_completes_the_rows_before_it_and_keeps_order(
    handlers, pump, outcome
):
    handled: list[int] = []  # rows whose work the handler did, in call order
    acted = threading.Event()

    def project(works: list[Any]) -> None:
        for work in works:
            if work.payload["n"] == 3 and not acted.is_set():
                acted.set()
                if outcome == "snooze":
                    raise workpump.Snooze(0, work=work)
                raise workpump.Discard("row 3 is poison", work=work)
            handled.append(work.payload["n"])

    handlers("receptor", "batch.poison", project, events=["batch.poison"], batch=True)
    for n in range(8):
        workpump.emit("batch.poison", {"n": n}, stream="s")

    assert drain(pump(drain=True)) == EXIT_OK
    rows = {
        row.event.payload["n"]: row
        for row in models.ReceptorProcessing.objects.select_related("event")
    }
    if outcome == "snooze":
        # 0-2 done by the first call, 3 snoozed (its attempt given back), then 3-7 in order
        assert handled == list(range(8))
        assert rows[3].snoozes == 1 and rows[3].attempts == 1
        assert all(row.done_at is not None for row in rows.values())
    else:
        assert handled == [0, 1, 2, 4, 5, 6, 7]
        assert rows[3].end_state == "discarded" and rows[3].last_error == "row 3 is poison"
    assert {n: row.attempts for n, row in rows.items() if n != 3} == dict.fromkeys(
        [0, 1, 2, 4, 5, 6, 7], 1
    )


@override_settings(WORKPUMP=FAST)
def test_an_atomic_batch_naming_a_poison_row_redoes_the_rows_before_it(handlers, pump):
    run_sql("CREATE TABLE batch_effect (n int)")
    try:
        calls: list[list[int]] = []

        def project(works: list[Any]) -> None:
            calls.append([work.payload["n"] for work in works])
            for work in works:
                if work.payload["n"] == 3:
                    raise workpump.Discard("row 3 is poison", work=work)
                run_sql("INSERT INTO batch_effect VALUES (%s)", [work.payload["n"]])

        handlers(
            "perspective", "batch.redo", project, events=["batch.redo"], atomic=True, batch=True
        )
        for n in range(6):
            workpump.emit("batch.redo", {"n": n}, stream="s")

        assert drain(pump(drain=True)) == EXIT_OK
        # The first call's transaction rolled back with rows 0-2's work: they were released,
        # not completed, and ran again after row 3 was discarded.
        assert calls[0] == [0, 1, 2, 3, 4, 5]
        assert [n for call in calls[1:] for n in call] == [0, 1, 2, 4, 5]
        effects = [row["n"] for row in run_sql("SELECT n FROM batch_effect")]
        assert effects == [0, 1, 2, 4, 5]
        rows = {
            row.event.payload["n"]: row
            for row in models.PerspectiveEvent.objects.select_related("event")
        }
        assert rows[3].end_state == "discarded"
        assert {n: row.attempts for n, row in rows.items() if n != 3} == dict.fromkeys(
            [0, 1, 2, 4, 5], 1
        )
    finally:
        run_sql("DROP TABLE batch_effect")


@override_settings(WORKPUMP=FAST)
def test_an_abandoned_batch_lets_go_of_its_rows_at_once_and_they_run_again(handlers, pump):
    stuck = threading.Event()
    unstick = threading.Event()
    calls: list[list[tuple[int, int]]] = []

    def project(works: list[Any]) -> None:
        calls.append([(work.payload["n"], work.attempts) for work in works])
        if len(calls) == 1:
            stuck.set()
            unstick.wait(20)  # ignores work.cancelled: abandoned at its timeout

    handlers("perspective", "batch.stuck", project, events=["batch.stuck"], batch=True, timeout=1)
    for n in range(5):
        workpump.emit("batch.stuck", {"n": n}, stream="s")
    supervisor = pump()
    try:
        assert stuck.wait(10)
        assert wait_until(lambda: supervisor.dispatcher.stats.abandoned == 1)
        # While the stuck handler still runs, its rows are claimed and run again: the
        # rows after the first were released at once, not left to their leases.
        assert wait_until(
            lambda: not models.PerspectiveEvent.objects.filter(done_at__isnull=True).exists()
        )
        assert not unstick.is_set()
        assert supervisor.dispatcher.wait_idle(10)
        assert len(supervisor.leases) == 0, "a lease handle of the abandoned batch lingers"
    finally:
        unstick.set()
    # The rerun started at the failed first row (its second attempt), the rest on their first.
    assert [pair for call in calls[1:] for pair in call] == [(0, 2), *((n, 1) for n in range(1, 5))]
    rows = list(models.PerspectiveEvent.objects.order_by("seq"))
    assert "still running at its timeout" in rows[0].last_error
    assert [row.attempts for row in rows] == [2, 1, 1, 1, 1]


@override_settings(WORKPUMP={**FAST, "SHUTDOWN_TIMEOUT_SECONDS": 0})
def test_a_pump_stopping_mid_batch_fails_its_first_row_and_gives_the_rest_back(handlers, pump):
    stuck = threading.Event()
    unstick = threading.Event()

    def project(works: list[Any]) -> None:
        stuck.set()
        unstick.wait(20)  # ignores work.cancelled: still running at the shutdown timeout

    handlers("receptor", "batch.stopping", project, events=["batch.stopping"], batch=True)
    for n in range(4):
        workpump.emit("batch.stopping", {"n": n}, stream="s")
    supervisor = pump()
    try:
        assert stuck.wait(10)
        supervisor.shutdown()
        assert len(supervisor.leases) == 0, "a lease handle of the stopped batch lingers"
    finally:
        unstick.set()

    rows = list(models.ReceptorProcessing.objects.select_related("event").order_by("seq"))
    assert [row.event.payload["n"] for row in rows] == [0, 1, 2, 3]
    assert rows[0].failure_reason == "shutdown" and rows[0].attempts == 1
    # the others are free at once, their attempts given back
    assert [(row.instance_id, row.lease_token, row.attempts) for row in rows[1:]] == [
        (None, None, 0)
    ] * 3
    assert all(row.done_at is None for row in rows)
