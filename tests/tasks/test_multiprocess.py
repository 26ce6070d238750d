"""django.tasks under real ``runworkpump`` processes.

A worker process that never enqueued anything runs a task enqueued here, and a task in
flight when its worker is killed with SIGKILL is completed by another worker, with both
attempts and the lost one's error in its result. Workers run with
``--settings=tests.settings_tasks`` and short timings through WORKPUMP_JSON.
"""

from __future__ import annotations

import re
import signal
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from django_workpump.tasks import TASKS_AVAILABLE

if not TASKS_AVAILABLE:
    pytest.skip(
        "needs django.tasks (Django >= 6.0) or the django-tasks backport",
        allow_module_level=True,
    )

from django.test import override_settings

from django_workpump.tasks.compat import TaskResultStatus
from tests.helpers import FAST_PROCESS, wait_until
from tests.settings_tasks import TASKS

with override_settings(TASKS=TASKS):  # @task builds WorkPumpTask objects of these backends
    from tests import task_funcs

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow]


FAST = {**FAST_PROCESS, "SHUTDOWN_TIMEOUT_SECONDS": 5, "STATUS_INTERVAL_SECONDS": 60}

STARTED = re.compile(r"workpump ([0-9a-f-]{36}) started:")


@pytest.fixture(autouse=True)
def tasks_settings() -> Iterator[None]:
    with override_settings(TASKS=TASKS):
        yield


@pytest.fixture
def spawn(pump_process: Callable[..., Any]) -> Callable[..., Any]:
    """Start runworkpump processes with the TASKS settings."""
    return lambda *args: pump_process(*args, settings_module="tests.settings_tasks", timings=FAST)


def instance_of(output: str) -> str:
    found = STARTED.search(output)
    assert found, output
    return found.group(1)


def test_a_worker_process_runs_a_task_enqueued_elsewhere(spawn):
    result = task_funcs.add.enqueue(20, b=22)

    worker = spawn("--drain")
    output, _ = worker.communicate(timeout=60)

    assert worker.returncode == 0, output
    done = task_funcs.add.get_result(result.id)
    assert done.status == TaskResultStatus.SUCCESSFUL
    assert done.return_value == 42
    assert done.worker_ids == [instance_of(output)]


def test_a_task_in_flight_when_its_worker_is_killed_completes_on_another_worker(spawn):
    task = task_funcs.hang_on_first_attempt
    result = task.enqueue()
    victim = spawn("--concurrency", "1")
    assert wait_until(
        lambda: task.get_result(result.id).status == TaskResultStatus.RUNNING, timeout=30
    ), "the first worker never started the task"
    (victim_id,) = task.get_result(result.id).worker_ids

    survivor = spawn("--concurrency", "1")
    victim.send_signal(signal.SIGKILL)
    victim.wait(10)
    assert wait_until(lambda: task.get_result(result.id).is_finished, timeout=30), (
        "no other worker finished the task"
    )
    survivor.send_signal(signal.SIGTERM)
    output, _ = survivor.communicate(timeout=30)
    assert survivor.returncode == 0, output

    done = task.get_result(result.id)
    assert done.status == TaskResultStatus.SUCCESSFUL
    assert done.attempts == 2
    assert done.worker_ids == [victim_id, instance_of(output)]
    assert done.return_value == {"attempt": 2, "pid": survivor.pid}
    assert [e.exception_class_path for e in done.errors] == [
        "django_workpump.tasks.errors.AttemptLost"
    ]
    assert "took the task over" in done.errors[0].traceback
    assert done.started_at < done.last_attempted_at < done.finished_at


def test_tasks_raising_base_exceptions_fail_and_a_drain_worker_exits_zero(spawn):
    kinds = ["SystemExit", "KeyboardInterrupt", "Halt"]
    results = {kind: task_funcs.raises_base_exception.enqueue(kind) for kind in kinds}
    after = task_funcs.add.enqueue(2, b=3)

    worker = spawn("--drain", "--concurrency", "1")
    output, _ = worker.communicate(timeout=60)

    assert worker.returncode == 0, output
    for kind, result in results.items():
        failed = task_funcs.raises_base_exception.get_result(result.id)
        assert failed.status == TaskResultStatus.FAILED, kind
        assert failed.attempts == 2, kind
    assert task_funcs.add.get_result(after.id).return_value == 5
