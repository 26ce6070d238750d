"""The tasks backend's workflow options: per-task backoff, on_complete hooks, groups."""

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
from django.utils import timezone

import django_workpump as workpump
from django_workpump import models
from django_workpump.pump.supervisor import EXIT_OK
from django_workpump.registry import registry
from django_workpump.tasks.compat import TaskResultStatus
from tests.helpers import FAST_PUMP, drain
from tests.settings_tasks import TASKS

with override_settings(TASKS=TASKS):
    from tests import task_funcs

FAST = {**FAST_PUMP, "CONCURRENCY": 2}
pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture(autouse=True)
def tasks_settings() -> Iterator[None]:
    task_funcs.calls.clear()
    task_funcs.backoffs.clear()
    with override_settings(TASKS=TASKS, WORKPUMP=FAST):
        yield


def test_a_retry_waits_what_the_tasks_backoff_says(pump):
    result = task_funcs.backs_off.enqueue()
    assert drain(pump(drain=True)) == EXIT_OK

    done = task_funcs.backs_off.get_result(result.id)
    assert done.status == TaskResultStatus.SUCCESSFUL and done.attempts == 3
    assert task_funcs.backoffs == [("attempt 1 failed", 1), ("attempt 2 failed", 2)]


def test_a_backoff_of_an_hour_schedules_the_retry_an_hour_later(pump):
    result = task_funcs.backs_off_an_hour.enqueue()
    assert drain(pump(drain=True)) == EXIT_OK

    stored = models.Inbox.objects.get(work_id=result.id)
    assert stored.attempts == 1
    assert stored.scheduled_for > timezone.now() + timedelta(minutes=55)
    assert task_funcs.backoffs == [("later", 1)]


def test_a_bad_backoff_or_hook_is_refused_at_declaration():
    with pytest.raises(Exception, match="backoff of task"):
        task_funcs.task(backoff=3)(task_funcs.plain_function)
    with pytest.raises(Exception, match="on_complete of task"):
        task_funcs.task(on_complete="x")(task_funcs.plain_function)


def test_on_complete_runs_once_with_the_finished_result_successful_or_failed(pump):
    ok = task_funcs.with_hook.enqueue(5)
    failed = task_funcs.fails_with_hook.enqueue()
    assert drain(pump(drain=True)) == EXIT_OK

    hooks = sorted(c[1] for c in task_funcs.calls if c[0] == "hook")
    assert hooks == sorted([ok.id, failed.id])
    assert task_funcs.fails_with_hook.get_result(failed.id).status == TaskResultStatus.FAILED
    assert registry.get("outbox", "workpump.tasks.on_complete") is not None


def test_tasks_enqueued_in_a_batch_are_its_members(pump):
    done: list[dict] = []
    workpump.outbox_handler("wf.tasks_done")(lambda work: done.append(work.payload))
    try:
        with workpump.batch(on_complete=("wf.tasks_done", {})) as group:
            task_funcs.add.enqueue(1, 2)
            task_funcs.with_hook.enqueue(1)  # its own hook batch is the member
        assert drain(pump(drain=True)) == EXIT_OK
    finally:
        registry.unregister("outbox", "wf.tasks_done")

    [payload] = done
    assert payload["batch"]["total"] == 2 and payload["batch"]["done"] == 2
    assert workpump.batch_status(group.id).finished
    assert [c[0] for c in task_funcs.calls].count("hook") == 1
