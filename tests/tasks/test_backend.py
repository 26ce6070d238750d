"""The django.tasks backend: Django's expectations of a backend, and the pump's.

Enqueue and get_result run in a rolled-back transaction; tasks run under a real
in-process Supervisor (threads, PostgreSQL, short timings) in drain mode. Tasks live in
tests/task_funcs.py, TASKS in tests/settings_tasks.py. Skipped without django.tasks (or
its backport, django-tasks).
"""

from __future__ import annotations

import logging
import math
import subprocess
import sys
import threading
import uuid
from collections.abc import Iterator
from datetime import timedelta
from io import StringIO
from typing import Any

import pytest

from django_workpump.tasks import TASKS_AVAILABLE

if not TASKS_AVAILABLE:
    pytest.skip(
        "needs django.tasks (Django >= 6.0) or the django-tasks backport",
        allow_module_level=True,
    )

from asgiref.sync import async_to_sync
from django.apps import apps
from django.core.management import call_command
from django.db import connection, transaction
from django.test import override_settings
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

import django_workpump as workpump
from django_workpump import models
from django_workpump.db import purge_task_attempts
from django_workpump.pump.supervisor import EXIT_OK
from django_workpump.registry import registry
from django_workpump.tasks.backend import WorkPumpBackend

# django.tasks' names, or the backport's on Django < 6.0
from django_workpump.tasks.compat import (
    InvalidTask,
    TaskResultDoesNotExist,
    TaskResultStatus,
    task_backends,
    task_enqueued,
    task_finished,
    task_started,
)
from django_workpump.tasks.resolution import load_task_code
from django_workpump.tasks.runner import register_backends, unregister_backends
from django_workpump.testing import run_pending
from tests.helpers import FAST_PUMP, ROOT, drain, wait_until
from tests.settings_tasks import TASKS

with override_settings(TASKS=TASKS):  # @task builds WorkPumpTask objects of these backends
    from tests import task_funcs

task = task_funcs.task
TaskResultMismatch = task_funcs.TaskResultMismatch


FAST = {**FAST_PUMP, "CONCURRENCY": 2}

db = pytest.mark.django_db
pumped = pytest.mark.django_db(transaction=True)


@pytest.fixture(autouse=True)
def tasks_settings() -> Iterator[None]:
    """TASKS of tests/settings_tasks.py, fast pump timings, a clean record of calls."""
    task_funcs.calls.clear()
    task_funcs.started.clear()
    task_funcs.release.clear()
    with override_settings(TASKS=TASKS, WORKPUMP=FAST):
        yield
    task_funcs.release.set()


@pytest.fixture
def signals() -> Iterator[list[tuple[str, str, str, int]]]:
    """(signal, result id, status, attempts) for each task signal sent, in order."""
    seen: list[tuple[str, str, str, int]] = []
    lock = threading.Lock()
    receivers = []
    for name, signal in (
        ("enqueued", task_enqueued),
        ("started", task_started),
        ("finished", task_finished),
    ):

        def on_signal(sender: Any, task_result: Any, _name: str = name, **kwargs: Any) -> None:
            with lock:
                seen.append((_name, task_result.id, task_result.status, task_result.attempts))

        signal.connect(on_signal, weak=False)
        receivers.append((signal, on_signal))
    yield seen
    for signal, on_signal in receivers:
        signal.disconnect(on_signal)


def row(result_id: str) -> models.Inbox:
    return models.Inbox.objects.get(work_id=result_id)


def forge(task_path: str, **payload: Any) -> uuid.UUID:
    """An inbox row on the default queue that enqueue() would never have written."""
    message_id = uuid.uuid4()
    workpump.receive(
        message_id,
        "django.tasks:default:default",
        {"task": task_path, "args": [], "kwargs": {}, **payload},
        max_attempts=5,
    )
    return message_id


# -- the backend, as Django sees it ----------------------------------------------------


@db
def test_the_backend_supports_defer_priority_async_tasks_and_results():
    backend = task_backends["default"]
    assert isinstance(backend, WorkPumpBackend)
    assert backend.supports_defer
    assert backend.supports_priority
    assert backend.supports_async_task
    assert backend.supports_get_result
    assert backend.check() == []
    assert type(task_funcs.add).__name__ == "WorkPumpTask"


@db
def test_enqueue_and_get_result_round_trip():
    result = task_funcs.add.enqueue(1, b=2)

    assert result.status == TaskResultStatus.READY
    assert result.is_finished is False
    assert result.args == [1]
    assert result.kwargs == {"b": 2}
    assert result.attempts == 0
    assert result.errors == []
    assert result.started_at is None and result.finished_at is None
    assert result.enqueued_at is not None
    with pytest.raises(ValueError, match="Task has not finished yet"):
        result.return_value  # noqa: B018
    assert task_backends["default"].get_result(result.id) == result
    assert task_funcs.add.get_result(result.id) == result
    with pytest.raises(TaskResultMismatch):
        task_funcs.record.get_result(result.id)
    result.refresh()
    assert result.status == TaskResultStatus.READY


@db
def test_enqueue_is_one_query_and_get_result_one_query_with_its_attempts():
    with CaptureQueriesContext(connection) as enqueued:
        result = task_funcs.add.enqueue(1, b=2)
    assert len(enqueued) == 1, [q["sql"] for q in enqueued]
    assert "workpump.receive" in enqueued[0]["sql"]
    assert result.enqueued_at == row(result.id).created_at  # read in the same statement

    with CaptureQueriesContext(connection) as read:
        ready = task_backends["default"].get_result(result.id)
    assert len(read) == 1
    assert ready == result

    # Two attempts recorded: the second failed, the first ended without an outcome.
    first, second = uuid.uuid4(), uuid.uuid4()
    models.TaskAttempt.objects.create(work_id=result.id, attempt=1, instance_id=first)
    models.TaskAttempt.objects.create(
        work_id=result.id,
        attempt=2,
        instance_id=second,
        finished_at=timezone.now(),
        error_class="builtins.ValueError",
        traceback="ValueError: no",
    )
    with CaptureQueriesContext(connection) as read:
        retried = task_backends["default"].get_result(result.id)
    assert len(read) == 1
    assert retried.worker_ids == [str(first), str(second)]
    assert [e.exception_class_path for e in retried.errors] == [
        "django_workpump.tasks.errors.AttemptLost",
        "builtins.ValueError",
    ]
    assert retried.errors[1].traceback == "ValueError: no"
    assert retried.started_at is not None and retried.last_attempted_at >= retried.started_at


@db
def test_enqueue_writes_one_inbox_row_per_task():
    result = task_funcs.send_email.using(priority=7).enqueue("ada@example.com")

    stored = row(result.id)
    assert stored.topic == "django.tasks:default:emails"
    assert stored.payload == {
        "task": "tests.task_funcs.send_email",
        "args": ["ada@example.com"],
        "kwargs": {},
        "run_after": None,
    }
    assert stored.priority == 7
    assert stored.scheduled_for is None
    assert stored.max_attempts == 3  # TASKS OPTIONS
    assert stored.created_at == result.enqueued_at


@db
def test_a_rolled_back_transaction_takes_its_tasks_with_it():
    with pytest.raises(RuntimeError), transaction.atomic():
        task_funcs.add.enqueue(1)
        assert models.Inbox.objects.count() == 1
        raise RuntimeError("roll back")
    assert models.Inbox.objects.count() == 0


@db
def test_a_cancelled_task_reads_back_as_failed_and_never_runs():
    import django_workpump as workpump

    result = task_funcs.add.enqueue(1, b=2)

    assert list(workpump.cancel(result.id)) == [uuid.UUID(result.id)]

    read = task_funcs.add.get_result(result.id)
    assert read.status == TaskResultStatus.FAILED
    assert read.finished_at is not None
    assert [e.exception_class_path for e in read.errors] == [
        "django_workpump.tasks.errors.WorkCancelled"
    ]
    assert "cancelled with workpump.cancel" in read.errors[0].traceback


@db
def test_aenqueue_and_aget_result_round_trip():
    async def enqueue_and_read() -> tuple[Any, Any]:
        result = await task_funcs.double_async.aenqueue(4)
        return result, await task_funcs.double_async.aget_result(result.id)

    result, read = async_to_sync(enqueue_and_read)()

    assert read == result
    assert read.args == [4]
    assert row(result.id).topic == "django.tasks:default:default"


@db
def test_a_task_on_an_unknown_queue_is_refused_with_invalid_task():
    with pytest.raises(InvalidTask, match=r"Queue 'nope' is not valid for backend\."):
        task_funcs.add.using(queue_name="nope")
    # A task built while its queue was configured is refused at enqueue once it is not.
    narrowed = {**TASKS, "default": {**TASKS["default"], "QUEUES": ["default"]}}
    with (
        override_settings(TASKS=narrowed),
        pytest.raises(InvalidTask, match=r"Queue 'emails' is not valid for backend\."),
    ):
        task_funcs.send_email.enqueue("x@example.com")
    assert models.Inbox.objects.count() == 0


# A backend with empty QUEUES: any queue name, as Django documents.
OPEN = {
    "BACKEND": "django_workpump.tasks.WorkPumpBackend",
    "QUEUES": [],
    "OPTIONS": {"TASK_MODULES": ["tests.task_funcs"]},
}


@db
def test_empty_queues_accept_any_queue_name_and_pass_the_checks():
    with override_settings(TASKS={**TASKS, "open": OPEN}):
        assert task_backends["open"].check() == []
        result = task_funcs.add.using(backend="open", queue_name="anything").enqueue(1, b=2)
        assert result.task.queue_name == "anything"
        assert row(result.id).topic == "django.tasks:open:anything"
        assert task_backends["open"].get_result(result.id).task.queue_name == "anything"
        # one prefix handler serves every queue of the alias
        handler = registry.get("inbox", "django.tasks:open:anything")
        assert handler is not None and handler.prefix
        assert handler is registry.get("inbox", "django.tasks:open:never-seen")


@db
@pytest.mark.parametrize(
    ("args", "kwargs", "error", "message"),
    [
        ([timezone.now()], {}, TypeError, "Unsupported type"),
        ([], {"b": uuid.uuid4()}, TypeError, "Unsupported type"),
        ([math.nan], {}, ValueError, "are not JSON"),
        ([{1: "one"}], {}, TypeError, "dict keys must be strings"),
    ],
    ids=["datetime", "uuid", "nan", "int-keys"],
)
def test_arguments_that_do_not_round_trip_through_json_are_refused(args, kwargs, error, message):
    with pytest.raises(error, match=message):
        task_funcs.add.enqueue(*args, **kwargs)
    assert models.Inbox.objects.count() == 0


@db
def test_tuples_become_lists_like_django_does():
    result = task_funcs.add.enqueue((1, 2), b={"k": (3,)})
    assert result.args == [[1, 2]]
    assert task_funcs.add.get_result(result.id).kwargs == {"b": {"k": [3]}}


@db
def test_priority_and_run_after_become_the_rows_priority_and_scheduled_for():
    later = timezone.now() + timedelta(hours=1)
    result = task_funcs.add.using(priority=-100, run_after=later).enqueue(1)

    stored = row(result.id)
    assert stored.priority == -100
    assert stored.scheduled_for == later
    read = task_funcs.add.get_result(result.id)
    assert read.task.run_after == later
    assert read.task.priority == -100


@db
def test_max_attempts_comes_from_the_task_then_options_then_workpump():
    assert row(task_funcs.always_fails.enqueue().id).max_attempts == 2  # @task(max_attempts=2)
    assert row(task_funcs.add.enqueue(1).id).max_attempts == 3  # OPTIONS
    assert row(task_funcs.add.using(backend="bulk").enqueue(1).id).max_attempts == 1
    plain = {"default": {**TASKS["default"], "OPTIONS": {"TASK_MODULES": ["tests.task_funcs"]}}}
    with override_settings(TASKS=plain, WORKPUMP={**FAST, "MAX_ATTEMPTS": 7}):
        assert row(task_funcs.add.enqueue(1).id).max_attempts == 7


@db
def test_a_bad_per_task_max_attempts_is_refused_at_declaration():
    message = r"max_attempts of task '\S+' must be a whole number >= 1"
    with pytest.raises(InvalidTask, match=message):
        task(max_attempts=0)(task_funcs.add.func)


@db
def test_enqueue_refuses_a_task_that_is_not_its_module_attribute():
    with pytest.raises(InvalidTask, match="is not a task"):
        task_funcs.unbound_task.enqueue()
    assert models.Inbox.objects.count() == 0


@db
def test_enqueue_refuses_tasks_outside_installed_apps_and_task_modules():
    closed = {"default": {**TASKS["default"], "OPTIONS": {}}}
    with override_settings(TASKS=closed), pytest.raises(InvalidTask, match="TASK_MODULES"):
        task_funcs.add.enqueue(1)
    assert models.Inbox.objects.count() == 0


@db
def test_get_result_of_an_unknown_or_foreign_id_does_not_exist():
    plain = uuid.uuid4()
    workpump.receive(plain, "tasks.plain", {})
    on_bulk = task_funcs.add.using(backend="bulk").enqueue(1)
    for result_id in ("123", str(uuid.uuid4()), str(plain), on_bulk.id):
        with pytest.raises(TaskResultDoesNotExist):
            task_backends["default"].get_result(result_id)
    assert task_backends["bulk"].get_result(on_bulk.id).backend == "bulk"


def test_check_reports_bad_queues_and_options_with_ids_and_hints():
    backend = WorkPumpBackend(
        "odd",
        {
            "BACKEND": "django_workpump.tasks.WorkPumpBackend",
            "QUEUES": ["ok", ""],
            "OPTIONS": {"LEASE_SECONDS": 5, "MAX_ATTEMPTS": 0, "TASK_MODULES": "tests"},
        },
    )
    messages = backend.check()
    assert [m.id for m in messages] == [
        "workpump.E103",
        "workpump.E104",
        "workpump.E105",
        "workpump.E106",
    ]
    assert messages[0].msg == (
        "TASKS['odd']['QUEUES'] holds ''; a queue name must be a non-empty string."
    )
    assert messages[1].hint == (
        "LEASE_SECONDS applies to every runworkpump instance, not to one backend: "
        "set WORKPUMP['LEASE_SECONDS'] instead."
    )


def test_every_queue_of_every_workpump_backend_gets_an_inbox_handler():
    topics = {h.topic for h in registry.handlers("inbox") if h.topic.startswith("django.tasks:")}
    assert topics == {
        "django.tasks:default:default",
        "django.tasks:default:emails",
        "django.tasks:bulk:default",
    }
    with override_settings(TASKS={"default": TASKS["default"]}):
        kept = {h.topic for h in registry.handlers("inbox") if h.topic.startswith("django.tasks")}
        assert kept == {"django.tasks:default:default", "django.tasks:default:emails"}


def test_the_app_registers_task_handlers_at_startup():
    # A runworkpump process that never enqueued a task must still run task rows.
    unregister_backends()
    apps.get_app_config("workpump").ready()
    assert registry.get("inbox", "django.tasks:default:default") is not None


def test_without_django_tasks_the_module_imports_and_the_backend_explains():
    script = (
        "import sys; sys.modules['django.tasks'] = sys.modules['django_tasks'] = None\n"
        "from django_workpump import tasks\n"
        "assert tasks.TASKS_AVAILABLE is False and tasks.register_backends() == []\n"
        "try:\n"
        "    tasks.WorkPumpBackend('default', {})\n"
        "except Exception as exc:\n"
        "    print(type(exc).__name__, exc)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=30
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(
        "ImproperlyConfigured django_workpump.tasks.WorkPumpBackend needs django.tasks, "
        "which Django "
    )
    assert "Upgrade to Django 6.0 or later" in done.stdout


# -- running under the pump ------------------------------------------------------------


@pumped
def test_a_task_runs_and_its_result_reads_back_from_the_row(pump, signals):
    with transaction.atomic():
        result = task_funcs.add.enqueue(2, b=40)
        assert signals == []  # not enqueued until the caller commits
    assert signals == [("enqueued", result.id, TaskResultStatus.READY, 0)]

    supervisor = pump(drain=True)
    instance = str(supervisor.identity.instance_id)
    assert drain(supervisor) == EXIT_OK

    done = task_funcs.add.get_result(result.id)
    assert done.status == TaskResultStatus.SUCCESSFUL
    assert done.return_value == 42
    assert done.attempts == 1
    assert done.worker_ids == [instance]
    assert done.errors == []
    assert done.enqueued_at <= done.started_at == done.last_attempted_at <= done.finished_at
    assert done.finished_at == row(result.id).done_at
    assert signals[1:] == [
        ("started", result.id, TaskResultStatus.RUNNING, 1),
        ("finished", result.id, TaskResultStatus.SUCCESSFUL, 1),
    ]
    result.refresh()
    assert result.status == TaskResultStatus.SUCCESSFUL


@pumped
def test_a_rolled_back_enqueue_sends_no_signal_and_runs_nothing(pump, signals):
    with pytest.raises(RuntimeError), transaction.atomic():
        task_funcs.record.enqueue("ghost")
        raise RuntimeError("roll back")
    assert drain(pump(drain=True)) == EXIT_OK
    assert signals == []
    assert task_funcs.calls == []


@pumped
def test_higher_priority_runs_first(pump):
    for label, priority in (("low", -50), ("mid", 0), ("high", 50), ("top", 100)):
        task_funcs.record.using(priority=priority).enqueue(label)
    assert drain(pump(drain=True, concurrency=1)) == EXIT_OK
    assert task_funcs.calls == ["top", "high", "mid", "low"]


@pumped
def test_a_deferred_task_waits_for_its_run_after(pump):
    later = task_funcs.record.using(run_after=timezone.now() + timedelta(hours=1)).enqueue("later")
    due = task_funcs.record.using(run_after=timezone.now() - timedelta(seconds=1)).enqueue("due")
    assert drain(pump(drain=True)) == EXIT_OK
    assert task_funcs.calls == ["due"]
    assert task_funcs.record.get_result(later.id).status == TaskResultStatus.READY
    assert task_funcs.record.get_result(due.id).status == TaskResultStatus.SUCCESSFUL


@pumped
def test_async_tasks_and_other_queues_run(pump):
    doubled = task_funcs.double_async.enqueue(21)
    emailed = task_funcs.send_email.enqueue("ada@example.com")
    assert drain(pump(drain=True)) == EXIT_OK
    assert task_funcs.double_async.get_result(doubled.id).return_value == 42
    assert task_funcs.send_email.get_result(emailed.id).return_value == {"sent": "ada@example.com"}


@pumped
def test_tasks_sync_and_async_run_under_an_async_middleware(pump):
    # docs/middleware.md's async timing middleware: the task handler is sync, so it runs
    # on the handler thread through sync_to_async, where the ORM is allowed
    with override_settings(
        WORKPUMP={**FAST, "MIDDLEWARE": ["tests.pump.test_async_handlers.timing"]}
    ):
        added = task_funcs.add.enqueue(2, b=40)
        doubled = task_funcs.double_async.enqueue(21)
        recorded = task_funcs.record.enqueue("under middleware")
        assert drain(pump(drain=True)) == EXIT_OK
    assert task_funcs.add.get_result(added.id).return_value == 42
    assert task_funcs.double_async.get_result(doubled.id).return_value == 42
    assert task_funcs.record.get_result(recorded.id).status == TaskResultStatus.SUCCESSFUL
    assert task_funcs.calls == ["under middleware"]
    # each ran once: its attempt record (the ORM, on the handler thread) was written
    assert {row(r.id).attempts for r in (added, doubled, recorded)} == {1}


@pumped
def test_a_task_moved_to_another_workpump_backend_runs_there(pump):
    result = task_funcs.add.using(backend="bulk").enqueue(5, b=5)
    assert row(result.id).topic == "django.tasks:bulk:default"
    assert drain(pump(drain=True)) == EXIT_OK
    assert task_backends["bulk"].get_result(result.id).return_value == 10


@pumped
def test_a_task_taking_context_sees_its_result_id_and_attempt(pump):
    result = task_funcs.report_context.enqueue()
    assert drain(pump(drain=True)) == EXIT_OK
    assert task_funcs.report_context.get_result(result.id).return_value == {
        "id": result.id,
        "attempt": 1,
    }


@pumped
def test_a_running_task_reads_as_running_with_its_worker(pump):
    result = task_funcs.wait_for_release.enqueue()
    supervisor = pump()
    assert task_funcs.started.wait(10), "the task never started"

    running = task_funcs.wait_for_release.get_result(result.id)
    assert running.status == TaskResultStatus.RUNNING
    assert running.worker_ids == [str(supervisor.identity.instance_id)]
    assert running.started_at is not None and running.finished_at is None

    task_funcs.release.set()
    assert wait_until(lambda: task_funcs.wait_for_release.get_result(result.id).is_finished)
    assert task_funcs.wait_for_release.get_result(result.id).return_value == "released"


@pumped
def test_a_task_that_raises_twice_then_succeeds_is_successful_with_two_errors(pump, signals):
    result = task_funcs.flaky.enqueue(fail_times=2)
    assert drain(pump(drain=True)) == EXIT_OK

    done = task_funcs.flaky.get_result(result.id)
    assert done.status == TaskResultStatus.SUCCESSFUL
    assert done.return_value == {"attempt": 3}
    assert done.attempts == 3
    assert [e.exception_class_path for e in done.errors] == ["builtins.ValueError"] * 2
    assert "ValueError: attempt 1 failed" in done.errors[0].traceback
    assert "ValueError: attempt 2 failed" in done.errors[1].traceback
    assert done.errors[0].exception_class is ValueError
    assert done.started_at < done.last_attempted_at
    # one started per attempt, one finished for the final outcome only
    assert [(name, status) for name, _, status, _ in signals[1:]] == [
        ("started", TaskResultStatus.RUNNING),
        ("started", TaskResultStatus.RUNNING),
        ("started", TaskResultStatus.RUNNING),
        ("finished", TaskResultStatus.SUCCESSFUL),
    ]


@pumped
def test_a_task_failing_every_attempt_is_failed_with_all_its_errors(pump, signals, caplog):
    result = task_funcs.always_fails.enqueue()
    caplog.set_level(logging.INFO)
    assert drain(pump(drain=True)) == EXIT_OK

    # each failed attempt is logged once: a WARNING, then the dead-letter's ERROR
    logged = [
        (r.levelname, r.workpump_attempt, r.workpump_error)
        for r in caplog.records
        if r.levelno >= logging.WARNING and r.name.startswith("django_workpump")
    ]
    assert logged == [
        ("WARNING", 1, "RuntimeError: no luck"),
        ("ERROR", 2, "RuntimeError: no luck"),
    ]
    # both name the task that failed, not only the queue's topic
    task_path = "tests.task_funcs.always_fails"
    failures = [
        r
        for r in caplog.records
        if r.levelno >= logging.WARNING
        and r.name in ("django_workpump.dispatch", "django_workpump.dead_letter")
    ]
    assert [r.workpump_subject for r in failures] == [f"task '{task_path}'"] * 2
    assert all(f"(task '{task_path}', topic 'django.tasks:" in r.getMessage() for r in failures)

    failed = task_funcs.always_fails.get_result(result.id)
    assert failed.status == TaskResultStatus.FAILED
    assert failed.attempts == 2
    assert [e.exception_class_path for e in failed.errors] == ["builtins.RuntimeError"] * 2
    assert all("RuntimeError: no luck" in e.traceback for e in failed.errors)
    with pytest.raises(ValueError, match="Task failed"):
        failed.return_value  # noqa: B018
    stored = row(result.id)
    assert stored.dead_lettered_at is not None
    assert failed.finished_at == stored.dead_lettered_at
    assert task_funcs.calls == ["always_fails", "always_fails"]
    assert [s for s in signals if s[0] == "finished"] == [
        ("finished", result.id, TaskResultStatus.FAILED, 2)
    ]


@pumped
@pytest.mark.parametrize("kind", ["SystemExit", "KeyboardInterrupt", "Halt"])
def test_a_task_raising_a_base_exception_fails_each_attempt_and_is_announced_failed_once(
    pump, signals, kind
):
    result = task_funcs.raises_base_exception.enqueue(kind)
    after = task_funcs.add.enqueue(1, b=2)
    supervisor = pump(drain=True, concurrency=1)
    assert drain(supervisor) == EXIT_OK

    failed = task_funcs.raises_base_exception.get_result(result.id)
    assert failed.status == TaskResultStatus.FAILED
    assert failed.attempts == 2
    path = "tests.task_funcs.Halt" if kind == "Halt" else f"builtins.{kind}"
    assert [e.exception_class_path for e in failed.errors] == [path] * 2
    stored = row(result.id)
    assert stored.dead_lettered_at is not None
    assert stored.instance_id is None
    assert task_funcs.calls.count(("raises_base_exception", kind)) == 2
    # Announced FAILED once, at the last attempt, and never run again after it.
    assert [s for s in signals if s[0] == "finished" and s[1] == result.id] == [
        ("finished", result.id, TaskResultStatus.FAILED, 2)
    ]
    # The one dispatch thread survived: the task after it ran.
    assert task_funcs.add.get_result(after.id).status == TaskResultStatus.SUCCESSFUL
    assert supervisor.dispatcher.stats.failed == 2


@pumped
@pytest.mark.parametrize("character", ["0", "d800"], ids=["nul", "lone-surrogate"])
def test_a_task_raising_text_postgres_cannot_store_records_its_attempt_and_fails(pump, character):
    result = task_funcs.raises_unstorable_text.enqueue(character)
    assert drain(pump(drain=True)) == EXIT_OK

    failed = task_funcs.raises_unstorable_text.get_result(result.id)
    assert failed.status == TaskResultStatus.FAILED
    [error] = failed.errors
    assert error.exception_class_path == "builtins.RuntimeError"
    assert "RuntimeError: bad \ufffd here" in error.traceback
    assert "1 character PostgreSQL cannot store" in error.traceback
    assert "RuntimeError: bad \ufffd here" in row(result.id).last_error


@pumped
def test_a_task_returning_text_postgres_cannot_store_succeeds_with_it_replaced(pump):
    result = task_funcs.returns_unstorable_text.enqueue()
    assert drain(pump(drain=True)) == EXIT_OK

    done = task_funcs.returns_unstorable_text.get_result(result.id)
    assert done.status == TaskResultStatus.SUCCESSFUL
    assert done.return_value == {"text": "nul \ufffd and lone \ufffd"}


@pumped
def test_a_return_value_that_is_not_json_fails_the_task_without_retries(pump):
    result = task_funcs.returns_a_datetime.enqueue()
    assert drain(pump(drain=True)) == EXIT_OK

    failed = task_funcs.returns_a_datetime.get_result(result.id)
    assert failed.status == TaskResultStatus.FAILED
    assert [e.exception_class_path for e in failed.errors] == ["builtins.TypeError"]
    assert task_funcs.calls == ["returns_a_datetime"]  # max_attempts 3, ran once
    assert row(result.id).attempts == 1


@pumped
@pytest.mark.parametrize(
    ("task_path", "error"),
    [
        ("tests.task_funcs.plain_function", "is not a task (a function decorated with @task)"),
        ("tests.task_funcs.inline_only", "declared for backend 'inline'"),
        ("this.s", "its module is not part of an installed app"),
        ("tests.app.never_loaded.add", "a worker never imports a module a row names"),
        ("tests.task_funcs.nothing_here", "is not a task"),
        ("no_dots", "is not the module path of a task"),
    ],
    ids=["plain-function", "other-backend", "foreign-module", "unloaded", "missing", "no-module"],
)
def test_a_row_naming_anything_but_a_workpump_task_is_dead_lettered_unrun(pump, task_path, error):
    message_id = forge(task_path)
    assert drain(pump(drain=True)) == EXIT_OK

    stored = row(message_id)
    assert stored.dead_lettered_at is not None
    assert stored.attempts == 1  # refused once, not retried
    assert error in stored.last_error
    assert "django_workpump.tasks.errors.TaskRefused" in stored.last_error
    attempt = models.TaskAttempt.objects.get(work_id=message_id)
    assert attempt.error_class == "django_workpump.tasks.errors.TaskRefused"
    assert task_funcs.calls == []
    assert "this" not in sys.modules  # never imported: it prints on import
    assert "tests.app.never_loaded" not in sys.modules
    with pytest.raises(TaskResultDoesNotExist):
        task_backends["default"].get_result(str(message_id))


@pumped
def test_a_row_with_malformed_arguments_is_dead_lettered(pump):
    message_id = forge("tests.task_funcs.add", args={"a": 1})
    assert drain(pump(drain=True)) == EXIT_OK
    stored = row(message_id)
    assert stored.dead_lettered_at is not None
    assert "args must be a list" in stored.last_error


@pumped
def test_a_queue_no_worker_handles_waits_unclaimed_and_shows_as_no_live_handler(pump):
    message_id = uuid.uuid4()
    workpump.receive(
        message_id,
        "django.tasks:default:retired",
        {"task": "tests.task_funcs.add", "args": [1], "kwargs": {}},
        max_attempts=1,
    )
    supervisor = pump(drain=True)
    assert drain(supervisor) == EXIT_OK
    # No worker claims a row of a queue this backend no longer lists: it waits, unspent.
    waiting = task_backends["default"].get_result(str(message_id))
    assert waiting.status == TaskResultStatus.READY
    assert (waiting.attempts, waiting.errors) == (0, [])
    assert "django.tasks:default:retired" not in supervisor.topics["inbox"]
    assert {"django.tasks:default:default", "django.tasks:default:emails"} <= set(
        supervisor.topics["inbox"]
    )


@pumped
def test_queues_narrow_a_worker_to_the_named_task_queues(pump):
    on_default = task_funcs.add.enqueue(1)
    on_emails = task_funcs.send_email.enqueue("ada@example.com")

    supervisor = pump(drain=True, queues=["emails"])
    assert drain(supervisor) == EXIT_OK

    assert supervisor.topics["inbox"] == ["django.tasks:default:emails"]
    assert task_funcs.send_email.get_result(on_emails.id).status == TaskResultStatus.SUCCESSFUL
    assert task_funcs.add.get_result(on_default.id).status == TaskResultStatus.READY
    assert row(on_default.id).attempts == 0


@pumped
def test_a_pump_runs_tasks_on_any_queue_of_a_backend_with_empty_queues(pump, signals):
    with override_settings(TASKS={**TASKS, "open": OPEN}):
        reports = task_funcs.add.using(backend="open", queue_name="reports").enqueue(1, b=2)
        nightly = task_funcs.double_async.using(backend="open", queue_name="nightly").enqueue(4)
        listed = task_funcs.add.enqueue(3, b=4)  # a backend with QUEUES, beside it

        supervisor = pump(drain=True)
        assert drain(supervisor) == EXIT_OK

        assert supervisor.topic_prefixes["inbox"] == ["django.tasks:open:"]
        assert not any("django.tasks:open:" in t for t in supervisor.topics["inbox"])
        backend = task_backends["open"]
        done = backend.get_result(reports.id)
        assert (done.status, done.return_value) == (TaskResultStatus.SUCCESSFUL, 3)
        assert done.task.queue_name == "reports"
        assert backend.get_result(nightly.id).return_value == 8
        assert task_funcs.add.get_result(listed.id).return_value == 7
        finished = [s for s in signals if s[0] == "finished" and s[1] == reports.id]
        assert finished == [("finished", reports.id, TaskResultStatus.SUCCESSFUL, 1)]


@pumped
def test_queues_narrow_a_backend_with_empty_queues_to_the_named_queues(pump):
    with override_settings(TASKS={**TASKS, "open": OPEN}):
        wanted = task_funcs.add.using(backend="open", queue_name="reports").enqueue(1, b=1)
        other = task_funcs.add.using(backend="open", queue_name="nightly").enqueue(2, b=2)
        listed = task_funcs.add.enqueue(3, b=3)

        supervisor = pump(drain=True, queues=["reports"])
        assert drain(supervisor) == EXIT_OK

        assert supervisor.topics["inbox"] == ["django.tasks:open:reports"]
        assert supervisor.topic_prefixes["inbox"] == []
        backend = task_backends["open"]
        assert backend.get_result(wanted.id).status == TaskResultStatus.SUCCESSFUL
        assert backend.get_result(other.id).status == TaskResultStatus.READY
        assert row(other.id).attempts == 0
        assert task_funcs.add.get_result(listed.id).status == TaskResultStatus.READY


@pumped
def test_the_runworkpump_command_runs_a_task_on_an_unlisted_queue():
    with override_settings(TASKS={**TASKS, "open": OPEN}):
        result = task_funcs.add.using(backend="open", queue_name="adhoc").enqueue(20, b=22)
        out = StringIO()

        call_command("runworkpump", "--drain", "--categories", "inbox", stdout=out)

        assert "topic_prefixes=django.tasks:open:" in out.getvalue().splitlines()[0]
        done = task_backends["open"].get_result(result.id)
        assert (done.status, done.return_value) == (TaskResultStatus.SUCCESSFUL, 42)


@db
def test_run_pending_runs_a_task_on_an_unlisted_queue_in_the_tests_transaction():
    with override_settings(TASKS={**TASKS, "open": OPEN}):
        result = task_funcs.add.using(backend="open", queue_name="adhoc").enqueue(1, b=1)
        assert run_pending() == 1
        done = task_backends["open"].get_result(result.id)
        assert (done.status, done.return_value) == (TaskResultStatus.SUCCESSFUL, 2)


@db
def test_attempts_of_task_rows_purged_after_retention_are_purged_too():
    kept_row = task_funcs.add.enqueue(1)
    long_ago = timezone.now() - timedelta(days=30)
    gone, kept, recent = uuid.uuid4(), uuid.UUID(kept_row.id), uuid.uuid4()
    for message_id, started_at in ((gone, long_ago), (kept, long_ago), (recent, timezone.now())):
        for attempt in (1, 2):
            models.TaskAttempt.objects.create(
                work_id=message_id, attempt=attempt, instance_id=uuid.uuid4()
            )
        models.TaskAttempt.objects.filter(work_id=message_id).update(started_at=started_at)

    assert purge_task_attempts(retention_seconds=86400, batch=1) == 1  # bounded batch
    assert purge_task_attempts(retention_seconds=86400, batch=100) == 1
    assert purge_task_attempts(retention_seconds=86400, batch=100) == 0
    left = set(models.TaskAttempt.objects.values_list("work_id", flat=True))
    assert left == {kept, recent}  # its task row still exists / not past retention yet


@db
def test_a_task_enqueue_writes_no_deduplication_row():
    result = task_funcs.add.enqueue(1)
    assert models.Inbox.objects.filter(work_id=result.id).exists()
    assert not models.InboxDedup.objects.filter(message_id=result.id).exists()


def test_building_a_backend_registers_and_imports_nothing_runworkpump_start_imports():
    params = {
        "BACKEND": "django_workpump.tasks.WorkPumpBackend",
        "QUEUES": ["lazy-q"],
        "OPTIONS": {"TASK_MODULES": ["colorsys"]},
    }
    sys.modules.pop("colorsys", None)

    backend = WorkPumpBackend("lazy", params)

    assert backend.queues == {"lazy-q"}
    assert registry.get("inbox", "django.tasks:lazy:lazy-q") is None
    assert "colorsys" not in sys.modules
    with override_settings(TASKS={**TASKS, "lazy": params}):
        assert "lazy" in load_task_code()
        assert "colorsys" in sys.modules
        # WorkPumpConfig.ready() and a TASKS change register the queues from settings
        assert registry.get("inbox", "django.tasks:lazy:lazy-q") is not None


def test_register_backends_is_idempotent():
    first = register_backends()
    assert register_backends() == first
    assert sorted(first) == [
        "django.tasks:bulk:default",
        "django.tasks:default:default",
        "django.tasks:default:emails",
    ]


@db
def test_a_unique_task_enqueued_twice_returns_the_first_result_and_stores_one_row():
    first = task_funcs.refresh.enqueue("a")
    again = task_funcs.refresh.enqueue("a")
    other = task_funcs.refresh.enqueue("b")

    assert again.id == first.id
    assert other.id != first.id
    assert row(first.id).unique_key.startswith("task:")
    assert models.Inbox.objects.filter(payload__task=task_funcs.refresh.module_path).count() == 2
    # a done row frees the key
    models.Inbox.objects.filter(work_id=first.id).update(done_at=timezone.now())
    assert task_funcs.refresh.enqueue("a").id not in (first.id, other.id)


@db
def test_a_unique_task_with_on_conflict_raise_raises_duplicate_within_its_window():
    first = task_funcs.refresh_hourly.enqueue("a")
    models.Inbox.objects.filter(work_id=first.id).update(done_at=timezone.now())

    with pytest.raises(workpump.Duplicate) as raised:
        task_funcs.refresh_hourly.enqueue("a")

    assert str(raised.value.holder_id) == first.id
    assert task_funcs.add.enqueue(1).id  # the transaction is still usable


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"unique": "yes"}, "unique of task '\\S+' must be True or False"),
        ({"unique_for": timedelta(minutes=1)}, "unique_for of task '\\S+' must be a timedelta"),
        ({"unique": True, "unique_for": timedelta(-1)}, "must be a timedelta >= 0"),
        ({"unique": True, "on_conflict": "skip"}, "on_conflict of task '\\S+' must be"),
    ],
)
def test_bad_unique_task_options_are_refused_at_declaration(options, message):
    with pytest.raises(InvalidTask, match=message):
        task(**options)(task_funcs.add.func)


# -- waiting for results ---------------------------------------------------------------


@pumped
@pytest.mark.parametrize("waiter", ["sync", "async"])
def test_wait_for_returns_the_finished_results_woken_by_their_completion(pump, waiter):
    added = task_funcs.add.enqueue(2, b=40)
    failed = task_funcs.always_fails.enqueue()
    backend = task_backends["default"]
    supervisor = pump()

    if waiter == "sync":
        done = backend.wait_for([added, failed], timeout=30)
    else:
        done = async_to_sync(backend.await_for)([added, failed], timeout=30)

    assert [r.status for r in done] == [TaskResultStatus.SUCCESSFUL, TaskResultStatus.FAILED]
    assert done[0].return_value == 42
    assert done[1].attempts == 2  # the retry ran first: a task to be retried has not ended
    supervisor.shutdown()


@pumped
def test_wait_for_a_task_that_cannot_run_yet_times_out_naming_it():
    later = task_funcs.add.using(run_after=timezone.now() + timedelta(hours=1)).enqueue(1)
    with pytest.raises(workpump.WaitTimeout, match=str(later.id)):
        task_backends["default"].wait_for([later], timeout=0.2)
