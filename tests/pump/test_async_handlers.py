"""``async def`` handlers and middleware keep the promises of the sync path.

Their ORM calls (``acreate``, ``sync_to_async``) run on the handler thread, on its
connection: inside an ``atomic=True`` handler's transaction, and inside a test's
transaction under ``run_pending``. A sync handler inside an async middleware runs on the
handler thread too, where Django allows the ORM. A cancel, a timeout, a lease deadline or
a shutdown still cancels an async handler's task.

Real pumps on real PostgreSQL (effects are ``auth.Group`` rows, named by attempt), and
dispatcher tests on a fake coordinator and a frozen clock.
"""

from __future__ import annotations

import asyncio
import contextvars
import dataclasses
import os
import subprocess
import sys
import threading
import time
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import psycopg
import psycopg.sql
import pytest
from asgiref.sync import sync_to_async
from django.conf import settings
from django.contrib.auth.models import Group
from django.db import connection
from django.test import TestCase, override_settings

import django_workpump as workpump
from django_workpump import Work, models
from django_workpump.clock import FrozenClock
from django_workpump.pump.dispatch import Dispatcher
from django_workpump.pump.lease import LeaseRegistry
from django_workpump.pump.supervisor import EXIT_OK
from django_workpump.registry import Handler, Registry, registry
from django_workpump.states import FailureReason
from django_workpump.testing import run_pending
from tests.fakes import FakeCoordinator, make_row
from tests.helpers import FAST_PUMP, TESTS, drain, run_sql

FAST = {**FAST_PUMP, "CONCURRENCY": 2}
WAIT = 20.0
pumped = pytest.mark.django_db(transaction=True)


async def timing(work: Any, call_next: Any) -> Any:
    """The async middleware of docs/middleware.md."""
    started = time.monotonic()
    try:
        return await call_next(work)
    finally:
        print(work.topic, time.monotonic() - started)


TIMED = {**FAST, "MIDDLEWARE": ["tests.pump.test_async_handlers.timing"]}


def effects(prefix: str) -> list[str]:
    return sorted(Group.objects.filter(name__startswith=prefix).values_list("name", flat=True))


# --- atomic=True covers an async handler's ORM writes -----------------------------------------


@pumped
@pytest.mark.parametrize("is_async", [True, False], ids=["async", "sync"])
@override_settings(WORKPUMP=FAST)
def test_an_atomic_perspective_that_fails_once_leaves_one_effect_after_its_retry(
    handlers, pump, is_async
):
    if is_async:

        async def project(work: Any) -> None:
            await Group.objects.acreate(name=f"fx-{work.payload['n']}-attempt-{work.attempts}")
            if work.attempts == 1:
                raise RuntimeError("attempt 1 fails after its write")

    else:

        def project(work: Any) -> None:
            Group.objects.create(name=f"fx-{work.payload['n']}-attempt-{work.attempts}")
            if work.attempts == 1:
                raise RuntimeError("attempt 1 fails after its write")

    handlers("perspective", "fx.totals", project, events=["fx.placed"], atomic=True)
    workpump.emit("fx.placed", {"n": 1}, stream="order-1")

    assert drain(pump(drain=True)) == EXIT_OK

    # attempt 1's write rolled back with its failure: exactly one effect, the retry's
    assert effects("fx-") == ["fx-1-attempt-2"]
    row = models.PerspectiveEvent.objects.get(topic="fx.totals")
    assert (row.attempts, row.done_at is not None) == (2, True)


@pumped
@override_settings(WORKPUMP=FAST)
def test_an_async_atomic_handlers_writes_roll_back_with_its_failure(handlers, pump):
    seen: dict[str, Any] = {}

    async def handle(work: Any) -> None:
        await Group.objects.acreate(name="rb-acreate")
        await sync_to_async(Group.objects.create)(name="rb-sync-to-async")

        def where() -> tuple[bool, str]:
            return connection.in_atomic_block, threading.current_thread().name

        seen["in_atomic_block"], seen["thread"] = await sync_to_async(where)()
        raise RuntimeError("fails after its writes")

    handlers("outbox_handler", "rb.async", handle, atomic=True, max_attempts=1)
    message_id = workpump.send("rb.async", {})

    assert drain(pump(drain=True)) == EXIT_OK

    assert effects("rb-") == []  # both writes went with the handler's transaction
    assert seen["in_atomic_block"] is True
    assert seen["thread"].startswith("workpump-dispatch-")  # the handler thread itself
    row = models.Outbox.objects.get(work_id=message_id)
    assert row.dead_lettered_at is not None and row.last_error.startswith("RuntimeError")


@pumped
@override_settings(WORKPUMP={**FAST, "STREAM_RUN_MAX": 100})
def test_an_async_atomic_batch_that_fails_once_leaves_one_effect_per_row(handlers, pump):
    calls: list[int] = []

    async def project(works: list[Any]) -> None:
        calls.append(len(works))
        for work in works:
            await Group.objects.acreate(name=f"bx-{work.payload['n']}-call-{len(calls)}")
        if len(calls) == 1:
            raise RuntimeError("the first batch fails after its writes")

    handlers("perspective", "bx.feed", project, events=["bx.placed"], atomic=True, batch=True)
    for n in range(4):
        workpump.emit("bx.placed", {"n": n}, stream="s")

    assert drain(pump(drain=True)) == EXIT_OK

    names = effects("bx-")
    assert len(names) == 4 and not any(name.endswith("-call-1") for name in names)
    assert sorted(name.split("-")[1] for name in names) == ["0", "1", "2", "3"]


@pumped
@override_settings(WORKPUMP={**FAST, "CONCURRENCY": 1})
def test_async_and_sync_handlers_share_the_handler_threads_kept_connection(handlers, pump):
    pids: list[tuple[str, int]] = []

    def backend_pid() -> int:
        with connection.cursor() as cursor:
            cursor.execute("SELECT pg_backend_pid()")
            return int(cursor.fetchone()[0])

    async def on_async(work: Any) -> None:
        pids.append(("async", await sync_to_async(backend_pid)()))

    def on_sync(work: Any) -> None:
        pids.append(("sync", backend_pid()))

    handlers("outbox_handler", "pid.async", on_async)
    handlers("outbox_handler", "pid.sync", on_sync)
    for n in range(3):
        workpump.send("pid.async", {"n": n}, stream="pids")
        workpump.send("pid.sync", {"n": n}, stream="pids")

    assert drain(pump(drain=True)) == EXIT_OK

    # one handler thread: its one connection served every row, async or sync
    assert [kind for kind, _ in pids] == ["async", "sync"] * 3
    assert len({pid for _, pid in pids}) == 1
    assert pids[0][1] != backend_pid()  # not the test's own connection


# --- sync handlers and tasks under an async middleware ----------------------------------------


@pumped
@pytest.mark.parametrize("atomic", [False, True], ids=["autocommit", "atomic"])
@override_settings(WORKPUMP=TIMED)
def test_a_sync_orm_handler_runs_under_an_async_middleware(handlers, pump, atomic):
    seen: dict[str, Any] = {}

    def handle(work: Any) -> int:
        Group.objects.create(name=f"mw-{work.payload['n']}")
        seen["thread"] = threading.current_thread().name
        seen["in_atomic_block"] = connection.in_atomic_block
        return Group.objects.filter(name__startswith="mw-").count()

    handlers("outbox_handler", "mw.sync", handle, atomic=atomic)
    message_id = workpump.send("mw.sync", {"n": 1})

    assert drain(pump(drain=True)) == EXIT_OK

    row = models.Outbox.objects.get(work_id=message_id)
    assert (row.done_at is not None, row.last_error) == (True, None)
    assert effects("mw-") == ["mw-1"]
    assert seen["thread"].startswith("workpump-dispatch-")
    assert seen["in_atomic_block"] is atomic
    if not atomic:  # an atomic handler's result is not stored
        assert row.result == 1


@pumped
@override_settings(WORKPUMP=TIMED)
def test_a_failing_sync_handler_under_an_async_middleware_rolls_back_when_atomic(handlers, pump):
    def handle(work: Any) -> None:
        Group.objects.create(name=f"mwf-attempt-{work.attempts}")
        if work.attempts == 1:
            raise RuntimeError("attempt 1 fails after its write")

    handlers("outbox_handler", "mw.fail", handle, atomic=True)
    workpump.send("mw.fail", {})

    assert drain(pump(drain=True)) == EXIT_OK

    assert effects("mwf-") == ["mwf-attempt-2"]


# --- run_pending: async handlers in the test's transaction --------------------------------------


def sessions_on_this_database() -> set[int]:
    return {
        row["pid"]
        for row in run_sql(
            "SELECT pid FROM pg_stat_activity WHERE datname = current_database()"
            " AND pid <> pg_backend_pid()"
        )
    }


@pytest.mark.django_db
def test_run_pending_runs_an_async_receptor_on_the_tests_connection(handlers, raw_connect):
    async def tell_warehouse(work: Any) -> None:  # README's receptor, writing through the ORM
        await sync_to_async(Group.objects.create)(name=f"wh-{work.payload['order']}")
        await Group.objects.acreate(name=f"wh-{work.payload['order']}-again")

    handlers("receptor", "warehouse", tell_warehouse, events=["order.placed"])
    other = raw_connect()
    before = sessions_on_this_database() - {other.info.backend_pid}
    workpump.emit("order.placed", {"order": 7}, stream="order-7")

    assert run_pending() == 1

    # written in this test's transaction: visible here, not to any other session
    assert effects("wh-") == ["wh-7", "wh-7-again"]
    seen = other.execute("SELECT count(*) AS n FROM auth_group WHERE name LIKE 'wh-%%'")
    assert seen.fetchone()["n"] == 0
    # and no connection of another thread was opened for it
    assert sessions_on_this_database() - {other.info.backend_pid} == before


@pytest.mark.django_db
def test_the_pytest_fixtures_run_pending_runs_an_async_handler_in_the_tests_transaction(
    handlers, request, raw_connect
):
    fixture = request.getfixturevalue("workpump")

    async def tell(work: Any) -> None:
        await Group.objects.acreate(name=f"fixture-{work.payload['n']}")

    handlers("outbox_handler", "fixture.async", tell)
    workpump.send("fixture.async", {"n": 1})

    assert fixture.run_pending() == 1

    fixture.assert_sent("fixture.async", n=1)
    assert effects("fixture-") == ["fixture-1"]
    seen = raw_connect().execute("SELECT count(*) AS n FROM auth_group WHERE name = 'fixture-1'")
    assert seen.fetchone()["n"] == 0  # uncommitted: in the test's transaction only


class RunPendingAsyncInATestCase(TestCase):
    """The async receptor's write goes with the test's transaction (tests run in name order)."""

    def setUp(self) -> None:
        async def tell_warehouse(work: Any) -> None:
            await sync_to_async(Group.objects.create)(name=f"tc-{work.payload['order']}")

        workpump.receptor("warehouse", events=["order.placed"])(tell_warehouse)
        self.addCleanup(registry.unregister, "receptor", "warehouse")

    def test_1_the_receptor_writes_in_the_tests_transaction(self) -> None:
        workpump.emit("order.placed", {"order": 42}, stream="order-42")
        assert run_pending() == 1
        assert effects("tc-") == ["tc-42"]

    def test_2_nothing_of_the_previous_test_is_left(self) -> None:
        assert effects("tc-") == []
        assert not models.ReceptorProcessing.objects.filter(topic="warehouse").exists()


# --- cancel, timeout and shutdown still cancel an async handler ---------------------------------


class Waiter:
    """An async handler that waits until cancelled, and says so."""

    def __init__(self) -> None:
        self.started = threading.Event()
        self.cancelled = threading.Event()

    async def __call__(self, work: Any) -> None:
        self.started.set()
        try:
            await asyncio.Event().wait()  # never set: only a cancel ends it
        except asyncio.CancelledError:
            self.cancelled.set()
            raise

    async def batch(self, works: list[Any]) -> None:
        await self(works[0])


def dispatcher_of(
    func: Any, **options: Any
) -> tuple[Dispatcher, FakeCoordinator, LeaseRegistry, FrozenClock]:
    coordinator, handlers, leases, clock = (
        FakeCoordinator(),
        Registry(),
        LeaseRegistry(),
        FrozenClock(),
    )
    handlers.register(Handler("perspective_event", "wait", func, events=("waited",), **options))
    dispatcher = Dispatcher(
        coordinator,
        handlers,
        leases,
        concurrency=1,
        lease_grace_seconds=30,
        lease_seconds=300,
        clock=clock,
    )
    return dispatcher, coordinator, leases, clock


def waiting_row() -> Any:
    return dataclasses.replace(make_row("perspective_event"), topic="wait", stream="s")


def test_a_timeout_cancels_an_async_handlers_task_and_its_thread_comes_back():
    waiter = Waiter()
    dispatcher, coordinator, leases, clock = dispatcher_of(waiter, timeout=20)
    dispatcher.start()
    try:
        dispatcher.submit([waiting_row()])
        assert waiter.started.wait(WAIT)
        first = [t for t in threading.enumerate() if t.name == "workpump-dispatch-1"]
        clock.advance(21)
        (expired,) = leases.expire_due()
        assert dispatcher.abandon(expired)

        assert waiter.cancelled.wait(WAIT), "the timeout did not cancel the task"
        assert coordinator.wait_for_call("fail")
        [(_, error, reason)] = coordinator.failed
        assert reason == FailureReason.TIMEOUT and "timeout (20 s)" in error
        # the abandoned thread got its handler back and ended (a fresh one took its slot)
        first[0].join(WAIT)
        assert not first[0].is_alive()
    finally:
        dispatcher.stop()
    assert coordinator.completed == []


@pytest.mark.parametrize("batch", [False, True], ids=["single", "batch"])
def test_a_shutdown_cancels_a_running_async_handlers_task(batch):
    waiter = Waiter()
    dispatcher, coordinator, _, _ = dispatcher_of(waiter.batch if batch else waiter, batch=batch)
    dispatcher.start()
    try:
        dispatcher.submit([waiting_row()])
        assert waiter.started.wait(WAIT)
        dispatcher.stop_accepting()
        assert dispatcher.fail_running(7) == 1

        assert waiter.cancelled.wait(WAIT), "the shutdown did not cancel the task"
        assert coordinator.wait_for_call("fail")
        [(_, _, reason)] = coordinator.failed
        assert reason == FailureReason.SHUTDOWN
    finally:
        dispatcher.stop()
    assert coordinator.completed == []


def test_an_operator_cancel_before_the_task_exists_still_cancels_it():
    entered, gate = threading.Event(), threading.Event()
    ran: list[str] = []

    def slow_start(work: Any, call_next: Any) -> Any:
        entered.set()
        gate.wait(WAIT)  # a plain middleware: the handler's task does not exist yet
        return call_next(work)

    async def handle(work: Any) -> None:
        ran.append("started")
        await asyncio.Event().wait()  # never set: only a cancel ends it

    coordinator, handlers, leases = FakeCoordinator(), Registry(), LeaseRegistry()
    handlers.register(Handler("outbox", "wait", handle))
    dispatcher = Dispatcher(
        coordinator, handlers, leases, concurrency=1, clock=FrozenClock(), middleware=[slow_start]
    )
    row = dataclasses.replace(make_row(), topic="wait")
    dispatcher.start()
    try:
        dispatcher.submit([row])
        assert entered.wait(WAIT)
        assert dispatcher.cancel_running("outbox", [(row.work_id, row.lease_token)]) == 1
        gate.set()
        # cancelled as its task was made: the coroutine never ran, the attempt ended
        assert dispatcher.wait_idle(WAIT)
    finally:
        gate.set()
        dispatcher.stop()
    assert ran == []
    assert coordinator.completed == coordinator.failed == []
    assert dispatcher.stats.cancelled == 1


def test_a_handler_threads_event_loop_is_kept_across_calls_on_a_daemon_thread():
    loops: list[tuple[int, str, bool]] = []
    done = threading.Semaphore(0)

    async def handle(work: Work) -> None:
        current = threading.current_thread()
        loops.append((id(asyncio.get_running_loop()), current.name, current.daemon))
        done.release()

    coordinator, handlers = FakeCoordinator(), Registry()
    handlers.register(Handler("outbox", "loop", handle))
    dispatcher = Dispatcher(coordinator, handlers, LeaseRegistry(), concurrency=1)
    dispatcher.start()
    try:
        dispatcher.submit([dataclasses.replace(make_row(), topic="loop")])
        assert done.acquire(timeout=WAIT)
        dispatcher.submit([dataclasses.replace(make_row(), topic="loop")])
        assert done.acquire(timeout=WAIT)
    finally:
        dispatcher.stop()
    assert len(loops) == 2 and loops[0] == loops[1]
    assert loops[0][1] == "workpump-dispatch-1-loop" and loops[0][2] is True


def test_a_system_exit_from_an_async_handler_fails_its_attempt_and_the_next_row_runs():
    async def exits(work: Any) -> None:
        raise SystemExit("bye")

    coordinator, handlers = FakeCoordinator(), Registry()
    handlers.register(Handler("outbox", "exits", exits))
    handlers.register(Handler("outbox", "ok", returns_fine))
    dispatcher = Dispatcher(coordinator, handlers, LeaseRegistry(), concurrency=1)
    dispatcher.start()
    try:
        dispatcher.submit([dataclasses.replace(make_row(), topic="exits")])
        dispatcher.submit([dataclasses.replace(make_row(), topic="ok")])
        assert coordinator.wait_for_call("fail") and coordinator.wait_for_call("complete")
    finally:
        dispatcher.stop()
    [(_, error, _)] = coordinator.failed
    assert error.startswith("SystemExit: bye")


async def returns_fine(work: Any) -> str:
    return "fine"


# --- manage.py test of a project with an async receptor, twice ----------------------------------

SAMPLE = TESTS / "async_sample"


def _sample_url(dbname: str) -> str:
    server = urlsplit(settings.DATABASE_URL)
    return urlunsplit(server._replace(path=f"/{dbname}"))


@pytest.mark.slow
def test_manage_py_test_with_an_async_receptor_leaves_no_test_database_behind():
    base = f"{urlsplit(settings.DATABASE_URL).path.lstrip('/') or 'postgres'}_async_sample"
    test_database = f"test_{base}"
    env = {
        **os.environ,
        "DATABASE_URL": _sample_url(base),
        "PYTHONPATH": str(SAMPLE.parent.parent),
    }
    env.pop("DJANGO_SETTINGS_MODULE", None)  # the sample's own settings

    def leftover() -> list[str]:
        with psycopg.connect(_sample_url("postgres"), autocommit=True) as admin:
            found = admin.execute(
                "SELECT datname FROM pg_database WHERE datname = %s", [test_database]
            )
            return [name for (name,) in found.fetchall()]

    def drop() -> None:
        with psycopg.connect(_sample_url("postgres"), autocommit=True) as admin:
            admin.execute(
                psycopg.sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(
                    psycopg.sql.Identifier(test_database)
                )
            )

    drop()  # a run of an older build may have left it
    try:
        for run in (1, 2):
            # No --noinput: a test database left by the first run would make the second
            # ask whether to delete it, and fail on the closed stdin.
            result = subprocess.run(
                [sys.executable, str(SAMPLE / "manage.py"), "test", "warehouse"],
                cwd=SAMPLE,
                env=env,
                stdin=subprocess.DEVNULL,
                capture_output=True,
                text=True,
                timeout=120,
                check=False,
            )
            output = result.stdout + result.stderr
            assert result.returncode == 0, f"run {run}:\n{output}"
            assert "Ran 2 tests" in output and "\nOK" in output, output
            # the run dropped its test database: no session of a thread of its own held on
            assert leftover() == [], f"run {run} left {leftover()}"
    finally:
        drop()


TENANT: contextvars.ContextVar[str] = contextvars.ContextVar("tenant", default="none")


def test_what_an_async_handler_sets_in_its_context_does_not_reach_the_next_job():
    seen: list[str] = []
    done = threading.Semaphore(0)

    async def sets(work: Any) -> None:
        seen.append(TENANT.get())
        TENANT.set(work.payload["tenant"])
        done.release()

    coordinator, handlers = FakeCoordinator(), Registry()
    handlers.register(Handler("outbox", "ctx", sets))
    dispatcher = Dispatcher(coordinator, handlers, LeaseRegistry(), concurrency=1)
    dispatcher.start()
    try:
        for tenant in ("a", "b"):
            row = dataclasses.replace(make_row(), topic="ctx", payload={"tenant": tenant})
            dispatcher.submit([row])
            assert done.acquire(timeout=WAIT)
    finally:
        dispatcher.stop()
    assert seen == ["none", "none"]
