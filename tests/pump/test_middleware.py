"""Handler middleware (WORKPUMP["MIDDLEWARE"]): order, async, failures, the setting's check.

The dispatcher runs on a fake coordinator; waits are on its recorded calls.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
from django.core import checks
from django.test import override_settings

from django_workpump.clock import FrozenClock
from django_workpump.middleware import load, wrap
from django_workpump.pump.dispatch import Dispatcher
from django_workpump.pump.lease import LeaseRegistry
from django_workpump.registry import Handler, Registry
from tests.fakes import FakeCoordinator, make_row

EVENTS: list[str] = []


def outer(work: Any, call_next: Any) -> Any:
    EVENTS.append("outer in")
    result = call_next(work)
    EVENTS.append("outer out")
    return result


def inner(work: Any, call_next: Any) -> Any:
    EVENTS.append("inner in")
    result = call_next(work)
    EVENTS.append("inner out")
    return {"wrapped": result}


async def async_timing(work: Any, call_next: Any) -> Any:
    EVENTS.append("async in")
    result = await call_next(work)
    EVENTS.append("async out")
    return result


def refuses(work: Any, call_next: Any) -> Any:
    raise PermissionError("tenant suspended")


NOT_CALLABLE = 42


def sync_handler(work: Any) -> Any:
    EVENTS.append("handler")
    return work.payload["order"]


async def async_handler(work: Any) -> Any:
    EVENTS.append("async handler")
    return work.payload["order"]


@pytest.fixture(autouse=True)
def clean() -> Iterator[None]:
    EVENTS.clear()
    yield
    EVENTS.clear()


def run(handler: Any, middleware: list[Any]) -> FakeCoordinator:
    coordinator = FakeCoordinator()
    handlers = Registry()
    handlers.register(Handler("outbox", "orders.created", handler))
    dispatcher = Dispatcher(
        coordinator,
        handlers,
        LeaseRegistry(),
        concurrency=1,
        clock=FrozenClock(),
        middleware=middleware,
    )
    dispatcher.start()
    try:
        dispatcher.submit([make_row()])
        assert coordinator.wait_for_any_call("complete", "fail")
    finally:
        dispatcher.stop()
    return coordinator


def test_middleware_wraps_a_handler_in_order_the_first_outermost():
    coordinator = run(sync_handler, [outer, inner])

    assert EVENTS == ["outer in", "inner in", "handler", "inner out", "outer out"]
    [(_, result)] = coordinator.completed
    assert json.loads(result) == {"wrapped": 1}  # what the middleware returned is stored


@pytest.mark.parametrize(
    ("handler", "middleware", "events", "result"),
    [
        (
            sync_handler,
            [async_timing, inner],
            ["async in", "inner in", "handler", "inner out", "async out"],
            {"wrapped": 1},
        ),
        (async_handler, [async_timing], ["async in", "async handler", "async out"], 1),
        # a plain def middleware around an async handler hands its coroutine on: it sees
        # the call start, not its end (docs/middleware.md)
        (
            async_handler,
            [outer, async_timing],
            ["outer in", "outer out", "async in", "async handler", "async out"],
            1,
        ),
    ],
    ids=["async-around-sync", "async-around-async", "sync-around-async"],
)
def test_an_async_middleware_awaits_sync_and_async_handlers(handler, middleware, events, result):
    coordinator = run(handler, middleware)

    assert events == EVENTS
    assert [json.loads(r) for _, r in coordinator.completed] == [result]


def test_an_exception_in_a_middleware_fails_the_attempt():
    coordinator = run(sync_handler, [outer, refuses])

    assert EVENTS == ["outer in"]  # the handler never ran
    [(_, error, reason)] = coordinator.failed
    assert error.startswith("PermissionError: tenant suspended")
    assert reason == "handler_error"
    assert coordinator.completed == []


def test_no_middleware_is_the_handler_itself():
    assert wrap(sync_handler, []) is sync_handler


def test_load_imports_the_dotted_paths():
    assert load(["tests.pump.test_middleware.outer", "tests.pump.test_middleware.inner"]) == (
        outer,
        inner,
    )


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("tests.pump.test_middleware.outer", "must be a list of dotted paths"),
        (["tests.pump.test_middleware.missing"], "cannot be imported"),
        (["tests.pump.test_middleware.NOT_CALLABLE"], "not a callable"),
    ],
)
def test_the_setting_is_checked_with_its_name_and_the_fix(value, message):
    with override_settings(WORKPUMP={"MIDDLEWARE": value}):
        found = [m for m in checks.run_checks() if "MIDDLEWARE" in m.msg]
    assert [message in m.msg for m in found] == [True], found
    assert found[0].id in ("workpump.E003", "workpump.E014")
