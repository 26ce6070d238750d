"""Fixtures of the pump tests: handlers registered through the public decorators."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

import django_workpump as workpump
from django_workpump.registry import registry
from tests.fakes import make_dispatcher
from tests.helpers import run_sql

# The category each public decorator registers its handler in.
DECORATOR_CATEGORIES = {
    "outbox_handler": "outbox",
    "inbox_handler": "inbox",
    "perspective": "perspective_event",
    "receptor": "receptor",
}


@pytest.fixture
def handlers() -> Iterator[Callable[..., None]]:
    """``handlers(kind, topic, func, **options)`` registers ``func`` with the decorator
    ``workpump.<kind>``; every handler registered is unregistered after the test."""
    registered: list[tuple[str, str]] = []

    def register(kind: str, topic: str, func: Callable[..., Any], **options: Any) -> None:
        getattr(workpump, kind)(topic, **options)(func)
        registered.append((DECORATOR_CATEGORIES[kind], topic))

    yield register
    for category, topic in registered:
        registry.unregister(category, topic)


@pytest.fixture
def outbox_handler(handlers: Callable[..., None]) -> Callable[..., None]:
    """``outbox_handler(topic, func, **options)``: ``handlers`` for outbox topics."""

    def register(topic: str, func: Callable[..., Any], **options: Any) -> None:
        handlers("outbox_handler", topic, func, **options)

    return register


@pytest.fixture
def run() -> Iterator[Callable[..., tuple[Any, Any]]]:
    """``run(func, rows, **options)``: start a ``make_dispatcher`` dispatcher running
    ``func`` and submit ``rows`` to it; every one started is stopped after the test."""
    started: list[Any] = []

    def go(func: Any, rows: list[Any], **options: Any) -> tuple[Any, Any]:
        dispatcher, coordinator, _, _ = make_dispatcher(func, **options)
        started.append(dispatcher)
        dispatcher.start()
        dispatcher.submit(rows)
        return dispatcher, coordinator

    yield go
    for dispatcher in started:
        dispatcher.stop()


@pytest.fixture
def executions() -> Iterator[None]:
    """The mp_execution table the handlers of tests/app/workpump.py record each run in."""
    run_sql(
        "CREATE TABLE mp_execution (work_id uuid, category text, stream text, n int, "
        "pid int, attempt int, started_at timestamptz, finished_at timestamptz)"
    )
    yield
    run_sql("DROP TABLE mp_execution")
