"""Periodic ``django.tasks`` tasks: ``workpump.periodic(name, every=..., task=...)``
enqueues the task once per slot through its backend (docs/periodic.md).

Skipped without django.tasks (or its backport, django-tasks).
"""

from __future__ import annotations

from collections.abc import Iterator
from datetime import timedelta

import pytest

from django_workpump.tasks import TASKS_AVAILABLE

if not TASKS_AVAILABLE:
    pytest.skip(
        "needs django.tasks (Django >= 6.0) or the django-tasks backport",
        allow_module_level=True,
    )

from django.test import override_settings

import django_workpump as workpump
from django_workpump import models
from django_workpump.periodic import InvalidSchedule, schedules
from django_workpump.pump.supervisor import EXIT_OK
from django_workpump.registry import registry
from tests.helpers import FAST_PUMP, T0, at, drain
from tests.pump.test_periodic import worker
from tests.settings_tasks import TASKS

with override_settings(TASKS=TASKS):
    from tests import task_funcs


@pytest.fixture(autouse=True)
def tasks_settings() -> Iterator[None]:
    task_funcs.calls.clear()
    # The test fires its slots by hand: the pump's own periodic worker stays off.
    with override_settings(TASKS=TASKS, WORKPUMP={**FAST_PUMP, "PERIODIC_ENABLED": False}):
        yield
    registry.unregister("outbox", "tasks.tick")
    schedules.unregister("tasks.tick")


@pytest.mark.django_db(transaction=True)
def test_each_slot_enqueues_the_task_once_and_the_pump_runs_it(pump):
    schedule = workpump.periodic(
        "tasks.tick", every=timedelta(minutes=1), task=task_funcs.on_slot, payload={"label": "p"}
    )
    handler = registry.get("outbox", "tasks.tick")
    assert handler is not None and handler.atomic, "enqueued with the row's own completion"
    w = worker(schedule)
    w.register(now=T0)
    w.run_once(now=at(60))
    w.run_once(now=at(120))
    assert drain(pump(drain=True)) == EXIT_OK
    assert sorted(task_funcs.calls) == [
        ("p", "2026-01-01T12:01:00Z"),
        ("p", "2026-01-01T12:02:00Z"),
    ]
    task_rows = models.Inbox.objects.filter(topic="django.tasks:default:default")
    assert task_rows.count() == 2
    assert all(row.done_at is not None for row in task_rows)


def test_a_task_of_another_backend_is_enqueued_outside_the_rows_completion():
    workpump.periodic(
        "tasks.tick", every=timedelta(minutes=1), task=task_funcs.on_slot.using(backend="inline")
    )
    handler = registry.get("outbox", "tasks.tick")
    # Only the work pump's backend writes its row in the caller's transaction.
    assert handler is not None and not handler.atomic


def test_a_task_that_cannot_take_the_slot_is_refused_at_declaration():
    with pytest.raises(InvalidSchedule, match=r"add a 'slot' parameter \(or \*\*kwargs\)"):
        workpump.periodic("tasks.tick", every=timedelta(minutes=1), task=task_funcs.record)
    with pytest.raises(InvalidSchedule, match=r"task= .* must be a django\.tasks task"):
        workpump.periodic("tasks.tick", every=timedelta(minutes=1), task=print)
    assert schedules.get("tasks.tick") is None
