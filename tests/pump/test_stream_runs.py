"""Stream runs end to end: pumps on real PostgreSQL running ordered streams (STREAM_RUN_MAX).

A claim that takes a stream's head leases the rows after it too; the dispatcher runs them
in order in one slot. Handlers record what ran, in which order, on which instance.
"""

from __future__ import annotations

import itertools
import threading
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import pytest
from django.db import OperationalError
from django.test import override_settings

import django_workpump as workpump
from django_workpump import models
from django_workpump.pump.coordinator import DatabaseCoordinator
from tests.helpers import FAST_PUMP, wait_until

pytestmark = pytest.mark.django_db(transaction=True)

FAST = {**FAST_PUMP, "CONCURRENCY": 4, "STREAM_RUN_MAX": 100}


def _all_processed() -> bool:
    return not models.Outbox.objects.filter(done_at__isnull=True).exists()


def run_stream(pump: Callable[..., Any], topic: str, rows: int, stream: str = "s") -> Any:
    """Send rows ``{"n": 0..rows-1}`` of ``topic`` in ``stream``, run a pump until every
    row is processed and shut it down; the pump, for its counters."""
    for n in range(rows):
        workpump.send(topic, {"n": n}, stream=stream)
    supervisor = pump()
    assert wait_until(_all_processed)
    supervisor.shutdown()
    return supervisor


@override_settings(WORKPUMP=FAST)
def test_a_stream_runs_in_order_in_runs_not_a_claim_per_row(outbox_handler, pump):
    ran: list[tuple[int, int]] = []  # (n, thread)
    lock = threading.Lock()

    def handle(work: Any) -> None:
        with lock:
            ran.append((work.payload["n"], threading.get_ident()))

    outbox_handler("runs.hot", handle)
    supervisor = run_stream(pump, "runs.hot", 300, stream="hot")
    assert [n for n, _ in ran] == list(range(300))
    # Rows came in runs: fewer claims than rows (a claim per row would need 300 and more),
    # and each run on one thread.
    assert supervisor.claim.claimed_total == 300
    assert supervisor.claim.polls < 200, supervisor.claim.polls
    switches = sum(1 for a, b in itertools.pairwise(ran) if a[1] != b[1])
    assert switches < 150, switches
    assert set(models.Outbox.objects.values_list("attempts", flat=True)) == {1}


@override_settings(WORKPUMP=FAST)
def test_a_stream_shows_its_owner_while_the_owner_works_through_its_run(outbox_handler, pump):
    owners: list[Any] = []  # the stream's owner as each row after the first starts

    def handle(work: Any) -> None:
        if work.payload["n"] > 0:
            owners.append(
                models.ActiveStream.objects.filter(category="outbox", stream="owned")
                .values_list("owner_instance_id", flat=True)
                .get()
            )

    outbox_handler("runs.owned", handle)
    supervisor = run_stream(pump, "runs.owned", 40, stream="owned")
    assert len(owners) == 39
    assert set(owners) == {supervisor.identity.instance_id}
    # The last row done, the stream is nobody's.
    assert models.ActiveStream.objects.get(stream="owned").owner_instance_id is None


@override_settings(WORKPUMP={**FAST, "CLAIM_PREFETCH": 20})
def test_a_failure_mid_run_blocks_the_stream_and_releases_the_rest_unspent(outbox_handler, pump):
    ran: list[int] = []
    lock = threading.Lock()

    def handle(work: Any) -> None:
        with lock:
            ran.append(work.payload["n"])
        if work.payload["n"] == 2 and work.attempts == 1:
            raise RuntimeError("row 2 fails once")

    outbox_handler("runs.fail", handle)
    supervisor = run_stream(pump, "runs.fail", 8)
    # Nothing after row 2 ran before its retry; the retry came first.
    assert ran == [0, 1, 2, 2, 3, 4, 5, 6, 7]
    attempts = dict(models.Outbox.objects.values_list("payload__n", "attempts"))
    # The rows released behind the failure kept their attempts (one run each, once).
    assert attempts == {0: 1, 1: 1, 2: 2, 3: 1, 4: 1, 5: 1, 6: 1, 7: 1}
    assert supervisor.dispatcher.stats.released >= 5
    assert models.Outbox.objects.get(payload__n=2).last_error.startswith("RuntimeError")


@override_settings(WORKPUMP={**FAST, "CLAIM_PREFETCH": 20})
def test_a_release_cut_off_by_a_connection_error_is_retried_not_left_to_expire(
    outbox_handler, pump, monkeypatch
):
    """The database going away as a run is cut short must not leave the run's unstarted
    rows leased until their leases run out: the release is tried again."""
    real_release = DatabaseCoordinator.release
    calls: list[int] = []

    def flaky_release(self: DatabaseCoordinator, leases: Any) -> Any:
        calls.append(len(leases))
        if len(calls) == 1:
            raise OperationalError("server closed the connection unexpectedly")
        return real_release(self, leases)

    monkeypatch.setattr(DatabaseCoordinator, "release", flaky_release)

    def handle(work: Any) -> None:
        if work.payload["n"] == 1 and work.attempts == 1:
            raise RuntimeError("row 1 fails once")

    outbox_handler("runs.release", handle)
    run_stream(pump, "runs.release", 6)
    assert calls[:2] == [4, 4]  # rows 2-5, refused once, then released
    attempts = dict(models.Outbox.objects.values_list("payload__n", "attempts"))
    assert attempts == {0: 1, 1: 2, 2: 1, 3: 1, 4: 1, 5: 1}


@override_settings(WORKPUMP=FAST)
def test_a_discard_the_server_rolled_back_to_break_a_deadlock_is_written_again(
    outbox_handler, pump, monkeypatch
):
    """A row's discard and the completion of the row before it are written at once on two
    connections and may deadlock on the stream's lock; the server rolls one back. The
    discard is written again, not left for its lease to run out."""
    real_discard = DatabaseCoordinator.discard
    calls: list[list[Any]] = []

    def deadlocking_discard(self: DatabaseCoordinator, leases: Any, reasons: Any) -> Any:
        calls.append([lease.id for lease in leases])
        if len(calls) == 1:
            raise OperationalError("deadlock detected")
        return real_discard(self, leases, reasons)

    monkeypatch.setattr(DatabaseCoordinator, "discard", deadlocking_discard)
    ran: list[int] = []

    def handle(work: Any) -> None:
        ran.append(work.payload["n"])
        if work.payload["n"] == 1:
            raise workpump.Discard("row 1 is poison")

    outbox_handler("runs.discard", handle)
    supervisor = run_stream(pump, "runs.discard", 4)
    assert len(calls) == 2 and calls[0] == calls[1]  # refused once, then written
    assert ran == [0, 1, 2, 3]  # the poison row ran once: its lease never ran out
    poison = models.Outbox.objects.get(payload__n=1)
    assert (poison.end_state, poison.attempts) == ("discarded", 1)
    assert supervisor.dispatcher.stats.discarded == 1


@override_settings(WORKPUMP={**FAST, "STREAM_RUN_MAX": 4, "CONCURRENCY": 3})
def test_two_instances_keep_fifo_per_stream_across_runs_and_retries(outbox_handler, pump):
    attempted: dict[str, list[int]] = defaultdict(list)
    succeeded: dict[str, list[int]] = defaultdict(list)
    instances: set[Any] = set()
    lock = threading.Lock()
    pause = threading.Event()

    def handle(work: Any) -> None:
        n = work.payload["n"]
        with lock:
            attempted[work.stream].append(n)
            instances.add(work.instance_id)
        pause.wait(0.002)  # a little work, so both instances get some
        if n % 7 == 3 and work.attempts == 1:
            raise RuntimeError("fails once")
        with lock:
            succeeded[work.stream].append(n)

    outbox_handler("runs.many", handle)
    streams = [f"s-{i}" for i in range(16)]
    first, second = pump(), pump()
    for n in range(12):
        for stream in streams:
            workpump.send("runs.many", {"n": n}, stream=stream)

    assert wait_until(lambda: not models.Outbox.objects.filter(done_at__isnull=True).exists(), 60)
    first.shutdown()
    second.shutdown()
    for stream in streams:
        assert succeeded[stream] == list(range(12)), stream
        # every attempt of a row came after the previous row succeeded: a retry repeats
        # its own row, never one behind it
        tries = attempted[stream]
        assert tries == sorted(tries), (stream, tries)
        assert len(tries) == 12 + sum(1 for n in range(12) if n % 7 == 3)
    assert instances == {first.identity.instance_id, second.identity.instance_id}


@override_settings(WORKPUMP={**FAST, "STREAM_RUN_MAX": 1})
def test_stream_run_max_1_claims_one_row_of_a_stream_at_a_time(outbox_handler, pump):
    ran: list[int] = []
    outbox_handler("runs.single", lambda work: ran.append(work.payload["n"]))
    supervisor = run_stream(pump, "runs.single", 10)
    assert ran == list(range(10))
    assert supervisor.claim.claimed_total == 10
    assert supervisor.claim.polls >= 10
