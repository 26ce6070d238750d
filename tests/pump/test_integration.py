"""The pump end to end in one process: real threads, real PostgreSQL.

Timings are shortened through WORKPUMP so each test runs in seconds; tests wait on
Events or on database conditions with a deadline, never for a fixed time.
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Callable
from typing import Any

import pytest
from django.test import override_settings

import django_workpump as workpump
from django_workpump import models
from django_workpump.pump.supervisor import (
    EXIT_EVICTED,
    EXIT_OK,
)
from tests.helpers import FAST_PUMP, drain, run_sql, wait_until

pytestmark = pytest.mark.django_db(transaction=True)

FAST = {**FAST_PUMP, "CONCURRENCY": 4}


@override_settings(WORKPUMP=FAST)
def test_rows_of_all_four_categories_run_and_complete(handlers, pump):
    seen: list[tuple[str, Any]] = []
    lock = threading.Lock()

    def record(label: str) -> Callable[[Any], Any]:
        def handle(work: Any) -> Any:
            with lock:
                seen.append((label, work.payload))
            return {"handled": label}

        return handle

    handlers("outbox_handler", "it.email", record("outbox"))
    handlers("inbox_handler", "it.webhook", record("inbox"))
    handlers("perspective", "it.totals", record("perspective"), events=["it.placed"])
    handlers("receptor", "it.warehouse", record("receptor"), events=["it.placed"])
    workpump.send("it.email", {"n": 1})
    workpump.receive(uuid.uuid4(), "it.webhook", {"n": 2})
    workpump.emit("it.placed", {"n": 3}, stream="order-1")

    assert drain(pump(drain=True)) == EXIT_OK

    assert sorted(seen, key=str) == sorted(
        [
            ("outbox", {"n": 1}),
            ("inbox", {"n": 2}),
            ("perspective", {"n": 3}),
            ("receptor", {"n": 3}),
        ],
        key=str,
    )
    assert models.Outbox.objects.get().result == {"handled": "outbox"}
    assert models.Inbox.objects.get().done_at is not None
    assert models.PerspectiveEvent.objects.get().done_at is not None
    assert models.ReceptorProcessing.objects.get().done_at is not None
    # graceful stop deregistered the instance
    assert models.ServiceInstance.objects.count() == 0


@override_settings(WORKPUMP=FAST)
def test_async_handlers_run_too(handlers, pump):
    async def handle(work: Any) -> dict[str, Any]:
        return {"double": work.payload["n"] * 2}

    handlers("outbox_handler", "it.async", handle)
    workpump.send("it.async", {"n": 21})
    assert drain(pump(drain=True)) == EXIT_OK
    assert models.Outbox.objects.get().result == {"double": 42}


@override_settings(WORKPUMP=FAST)
def test_a_raising_handler_is_retried_then_dead_lettered_with_its_last_error(handlers, pump):
    calls: list[int] = []

    def explode(work: Any) -> None:
        calls.append(work.attempts)
        raise ValueError(f"attempt {work.attempts} exploded")

    handlers("outbox_handler", "it.explode", explode, max_attempts=3)
    workpump.send("it.explode", {})

    assert drain(pump(drain=True)) == EXIT_OK

    row = models.Outbox.objects.get()
    assert calls == [1, 2, 3]
    assert row.attempts == 3
    assert row.dead_lettered_at is not None
    assert row.done_at is None
    assert row.failure_reason == "max_attempts"
    assert "ValueError: attempt 3 exploded" in row.last_error


@override_settings(WORKPUMP=FAST)
def test_work_with_no_handler_here_is_not_claimed_and_keeps_its_attempts(pump):
    workpump.send("it.nobody", {}, max_attempts=1)
    assert drain(pump(drain=True)) == EXIT_OK
    row = models.Outbox.objects.get()
    assert (row.attempts, row.instance_id, row.dead_lettered_at, row.last_error) == (
        0,
        None,
        None,
        None,
    )


@override_settings(WORKPUMP=FAST)
def test_a_pump_narrowed_to_some_topics_claims_no_other(handlers, pump):
    ran: list[str] = []
    handlers("outbox_handler", "it.a", lambda work: ran.append("a"))
    handlers("outbox_handler", "it.b", lambda work: ran.append("b"))
    handlers("perspective", "it.totals", lambda work: ran.append("totals"), events=["it.placed"])
    workpump.send("it.b", {}, stream="s")  # the stream's head: the it.a row behind it waits
    workpump.send("it.a", {}, stream="s")
    workpump.send("it.a", {})
    workpump.emit("it.placed", {}, stream="order-1")

    supervisor = pump(drain=True, topics=["it.a"])
    assert drain(supervisor) == EXIT_OK

    assert ran == ["a"]
    assert supervisor.topics == {
        "outbox": ["it.a"],
        "inbox": [],
        "perspective_event": [],
        "receptor": [],
    }
    waiting = models.Outbox.objects.filter(done_at__isnull=True).order_by("seq")
    assert [(r.topic, r.attempts) for r in waiting] == [("it.b", 0), ("it.a", 0)]
    assert models.PerspectiveEvent.objects.get().attempts == 0


@override_settings(WORKPUMP={**FAST, "CONCURRENCY": 4})
def test_per_stream_order_holds_with_several_dispatch_threads(handlers, pump):
    order: dict[str, list[int]] = {}
    lock = threading.Lock()

    def handle(work: Any) -> None:
        with lock:
            order.setdefault(work.stream, []).append(work.payload["n"])

    handlers("outbox_handler", "it.ordered", handle)
    for n in range(12):
        for stream in ("a", "b", "c"):
            workpump.send("it.ordered", {"n": n}, stream=stream)

    assert drain(pump(drain=True)) == EXIT_OK
    assert order == {stream: list(range(12)) for stream in ("a", "b", "c")}


@override_settings(
    WORKPUMP={**FAST, "LEASE_SECONDS": 3, "LEASE_GRACE_SECONDS": 1, "MAX_RENEWALS_PER_WORK": 1}
)
def test_a_handler_past_its_renewal_cap_surfaces_as_a_failure_and_is_reclaimed(handlers, pump):
    release = threading.Event()
    attempts: list[int] = []

    def hang_first_time(work: Any) -> str:
        attempts.append(work.attempts)
        if work.attempts == 1:
            release.wait(30)  # hangs past the lease; set at the end of the test
            return "late"
        return "second attempt"

    handlers("outbox_handler", "it.hang", hang_first_time)
    workpump.send("it.hang", {})
    supervisor = pump()
    try:
        assert wait_until(lambda: models.Outbox.objects.filter(done_at__isnull=False).exists())
        row = models.Outbox.objects.get()
        assert attempts == [1, 2]
        assert row.attempts == 2
        assert row.result == "second attempt"
        assert supervisor.dispatcher.stats.abandoned == 1
        assert supervisor.renewal.renewed >= 1  # it was renewed once, then capped
    finally:
        release.set()
    # the first attempt's late "completion" was dropped: the result is the second one's
    assert wait_until(lambda: supervisor.dispatcher.in_flight == 0)
    assert models.Outbox.objects.get().result == "second attempt"


@override_settings(WORKPUMP=FAST)
def test_an_atomic_handler_whose_lease_was_lost_rolls_back_its_effect(handlers, pump, raw_connect):
    run_sql("CREATE TABLE it_effect (work_id uuid, attempt int)")
    try:
        inserted = threading.Event()
        proceed = threading.Event()

        def effect(work: Any) -> None:
            run_sql("INSERT INTO it_effect VALUES (%s, %s)", [work.id, work.attempts])
            if work.attempts == 1:
                inserted.set()
                proceed.wait(10)

        handlers("outbox_handler", "it.atomic", effect, atomic=True)
        message_id = workpump.send("it.atomic", {})
        supervisor = pump()
        assert inserted.wait(10)
        # Another instance takes the row over while the handler runs.
        thief = uuid.uuid4()
        other = raw_connect()
        other.execute(
            "UPDATE workpump_outbox SET instance_id = %s, lease_expiry = now() + interval '1 h' "
            "WHERE work_id = %s",
            [thief, message_id],
        )
        proceed.set()
        # The first attempt's insert rolled back with its lost completion...
        assert wait_until(lambda: supervisor.dispatcher.stats.lost_leases == 1)
        assert run_sql("SELECT count(*) AS n FROM it_effect")[0]["n"] == 0
        # ...and once the thief lets go, the second attempt commits effect and completion.
        other.execute(
            "SELECT workpump.release_leases('outbox', ARRAY[%s]::uuid[], p_force => true)",
            [message_id],
        )
        assert wait_until(lambda: models.Outbox.objects.filter(done_at__isnull=False).exists())
        assert run_sql("SELECT work_id, attempt FROM it_effect") == [
            {"work_id": message_id, "attempt": 2}
        ]
    finally:
        run_sql("DROP TABLE it_effect")


@override_settings(WORKPUMP=FAST)
def test_a_row_force_released_while_it_runs_is_run_again_here_and_the_old_attempt_dropped(
    handlers, pump, raw_connect
):
    first_started = threading.Event()
    first_may_finish = threading.Event()

    def slow_then_fast(work: Any) -> str:
        if work.attempts == 1:
            first_started.set()
            first_may_finish.wait(10)
        return f"attempt {work.attempts}"

    handlers("outbox_handler", "it.released", slow_then_fast)
    message_id = workpump.send("it.released", {})
    supervisor = pump()
    try:
        assert first_started.wait(10)
        # An operator hands the row back while attempt 1 still runs; this same instance
        # claims it again as attempt 2.
        raw_connect().execute(
            "SELECT workpump.release_leases('outbox', ARRAY[%s]::uuid[], p_force => true)",
            [message_id],
        )
        assert wait_until(lambda: models.Outbox.objects.filter(done_at__isnull=False).exists())
    finally:
        first_may_finish.set()
    row = models.Outbox.objects.get(work_id=message_id)
    assert (row.attempts, row.result) == (2, "attempt 2")
    assert wait_until(lambda: supervisor.dispatcher.in_flight == 0)
    assert supervisor.dispatcher.stats.superseded == 1
    assert supervisor.stop_reason is None  # the claimer lived on


@override_settings(
    WORKPUMP={
        **FAST,
        "NOTIFY_HEALTHY_POLLING_INTERVAL_MS": 60_000,
        "POLLING_MAX_INTERVAL_MS": 60_000,
    }
)
def test_a_notify_from_another_connection_wakes_an_idle_claimer(handlers, pump, raw_connect):
    handled = threading.Event()
    handlers("outbox_handler", "it.wake", lambda work: handled.set())
    supervisor = pump()
    assert wait_until(lambda: supervisor.gate is not None and supervisor.gate.available)
    assert wait_until(lambda: supervisor.claim.polls >= 1)  # idle: the next poll is 60 s away
    assert supervisor.claim.current_wait_ms() == 60_000

    raw_connect().execute("SELECT workpump.send('it.wake', '{}')")

    assert handled.wait(5), "the NOTIFY did not wake the claimer"


@override_settings(WORKPUMP={**FAST, "NOTIFY_HEALTHY_POLLING_INTERVAL_MS": 5_000})
def test_a_killed_listener_tightens_polling_then_recovers_with_one_catch_up(pump, raw_connect):
    supervisor = pump()
    gate = supervisor.gate
    assert gate is not None
    assert wait_until(lambda: gate.available)
    assert supervisor.claim.current_wait_ms() >= 200  # relaxed while NOTIFY works

    raw_connect().execute("SELECT pg_terminate_backend(%s)", [gate.backend_pid])

    assert wait_until(lambda: not gate.available, timeout=10)
    assert supervisor.claim.current_wait_ms() == FAST["POLLING_INTERVAL_MS"]
    assert wait_until(lambda: gate.available, timeout=10)
    assert wait_until(lambda: supervisor.claim.reconnect_catch_up_count == 1)
    # no eviction from a connection blip
    assert models.ServiceInstance.objects.filter(
        instance_id=supervisor.identity.instance_id
    ).exists()


@override_settings(WORKPUMP={**FAST, "LIVENESS_SOURCE_MODE": "heartbeat_table_only"})
def test_an_evicted_instance_stops_claiming_and_exits_non_zero(pump, raw_connect):
    supervisor = pump()
    instance_id = supervisor.identity.instance_id
    raw_connect().execute(
        "WITH gone AS (DELETE FROM workpump_service_instance WHERE instance_id = %s) "
        "INSERT INTO workpump_eviction (instance_id, evicted_at, reason) "
        "VALUES (%s, now(), 'test')",
        [instance_id, instance_id],
    )
    assert supervisor.wait(10), "the evicted instance did not stop"
    assert supervisor.shutdown() == EXIT_EVICTED
    assert supervisor.heartbeat.evicted or supervisor.claim.refused
    assert not models.ServiceInstance.objects.filter(instance_id=instance_id).exists()


# Beats a minute apart: only a refused claim can stop the instance within the test.
SLOW_BEATS = {
    **FAST,
    "HEARTBEAT_INTERVAL_SECONDS": 60,
    "HEARTBEAT_SLOW_INTERVAL_SECONDS": 60,
    "STALE_AFTER_SECONDS": 120,
    "DEFINITIVELY_DEAD_AFTER_SECONDS": 300,
    "STALE_PEER_PROBE_INTERVAL_SECONDS": 60,
}


@override_settings(WORKPUMP=SLOW_BEATS)
def test_an_evicted_instance_stops_at_its_next_claim_without_waiting_for_a_beat(pump):
    supervisor = pump()
    assert wait_until(lambda: supervisor.claim.polls >= 1)
    run_sql(
        "SELECT workpump.evict_instance(%s, 'evicted by the test')",
        [supervisor.identity.instance_id],
    )

    assert supervisor.wait(10), "the evicted instance did not stop"
    assert supervisor.shutdown() == EXIT_EVICTED
    assert "evicted by the test" in (supervisor.claim.refused or "")
    assert supervisor.stop_reason is not None and "claim_work refused" in supervisor.stop_reason
    assert supervisor.heartbeat.beats == 1  # only the registering beat: the claim stopped it


@override_settings(WORKPUMP={**FAST, "SHUTDOWN_TIMEOUT_SECONDS": 10})
def test_shutdown_waits_for_in_flight_handlers_then_deregisters(handlers, pump):
    started = threading.Event()
    finish = threading.Event()

    def slow(work: Any) -> str:
        started.set()
        finish.wait(10)
        return "finished"

    handlers("outbox_handler", "it.slow", slow)
    workpump.send("it.slow", {})
    supervisor = pump()
    assert started.wait(10)
    stopper = threading.Thread(target=supervisor.shutdown)
    stopper.start()
    assert supervisor.wait(1)
    finish.set()
    stopper.join(15)
    assert not stopper.is_alive()
    row = models.Outbox.objects.get()
    assert row.result == "finished"
    assert row.done_at is not None
    assert models.ServiceInstance.objects.count() == 0


@override_settings(WORKPUMP=FAST)
def test_a_handler_sees_the_id_of_the_instance_running_it(handlers, pump):
    seen: list[uuid.UUID] = []
    handlers("outbox_handler", "it.who", lambda work: seen.append(work.instance_id))
    workpump.send("it.who", {})
    supervisor = pump(drain=True)
    assert drain(supervisor) == EXIT_OK
    assert seen == [supervisor.identity.instance_id]


@override_settings(WORKPUMP=FAST)
def test_a_refusal_stops_the_pump_and_tells_every_running_handler_at_once():
    from django_workpump.clock import FrozenClock
    from django_workpump.pump.lease import LeaseHandle
    from django_workpump.pump.supervisor import Supervisor

    supervisor = Supervisor()
    clock = FrozenClock()
    deadline = clock.monotonic() + 100
    handle = LeaseHandle("outbox", uuid.uuid4(), deadline, 6, clock, lease_token=uuid.uuid4())
    supervisor.leases.register(handle)

    supervisor._refused("renew_leases refused instance x: it was evicted at t (by peers).")

    assert supervisor.wait(0)
    assert supervisor.exit_code == EXIT_EVICTED
    assert handle.cancel_reason == "lost"


@override_settings(WORKPUMP={**FAST, "SHUTDOWN_TIMEOUT_SECONDS": 10})
def test_a_graceful_stop_tells_running_handlers_at_once_and_they_finish_early(handlers, pump):
    started = threading.Event()
    seen_cancelled = threading.Event()

    def cooperative(work: Any) -> str:
        started.set()
        stop = threading.Event()
        for _ in range(500):  # up to 10 s: far past the test's wait below
            if work.cancelled:
                seen_cancelled.set()
                return "stopped early"
            stop.wait(0.02)
        return "ran to the end"

    handlers("outbox_handler", "it.cooperative", cooperative)
    workpump.send("it.cooperative", {})
    supervisor = pump()
    assert started.wait(10)
    stopper = threading.Thread(target=supervisor.shutdown)
    stopper.start()
    # Told at once, not at the 10 s shutdown timeout.
    assert seen_cancelled.wait(3)
    stopper.join(15)
    assert not stopper.is_alive()
    row = models.Outbox.objects.get()
    assert (row.result, row.attempts) == ("stopped early", 1)
    assert row.done_at is not None


@override_settings(WORKPUMP={**FAST, "SHUTDOWN_TIMEOUT_SECONDS": 1})
def test_a_handler_outliving_every_shutdown_spends_its_attempts_and_is_dead_lettered(
    handlers, pump
):
    started = threading.Semaphore(0)
    finish = threading.Event()

    def stubborn(work: Any) -> str:
        started.release()
        finish.wait(20)  # ignores work.cancelled
        return "too late"

    handlers("outbox_handler", "it.stubborn", stubborn)
    stubborn_id = workpump.send("it.stubborn", {}, max_attempts=2)
    try:
        for attempt in (1, 2):
            supervisor = pump(concurrency=1)
            assert started.acquire(timeout=10)
            assert supervisor.shutdown() == EXIT_OK
            row = models.Outbox.objects.get(work_id=stubborn_id)
            assert row.attempts == attempt
            assert row.instance_id is None
            if attempt == 1:
                assert row.failure_reason == "shutdown"
                assert row.dead_lettered_at is None
                assert "shutdown timeout" in row.last_error
    finally:
        finish.set()
    row = models.Outbox.objects.get(work_id=stubborn_id)
    assert row.failure_reason == "max_attempts"
    assert row.dead_lettered_at is not None
    assert row.done_at is None  # the late "too late" outcome was dropped
