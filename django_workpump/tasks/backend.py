"""``WorkPumpBackend``: enqueue a task as an inbox row; validate tasks; read results.

A task is an inbox row: ``message_id`` is the ``TaskResult`` id, the handler name is
``django.tasks:<backend alias>:<queue>``, the payload holds the task's module path, its
JSON arguments and ``run_after``; priority and ``run_after`` are the row's ``priority``
and ``scheduled_for``. The row is written in the caller's transaction; ``runner.py``
runs it under ``runworkpump``.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from functools import partial
from typing import Any

from django.core import checks
from django.db import transaction

from django_workpump import producer
from django_workpump.conf import setting
from django_workpump.tasks.checks import check_backend
from django_workpump.tasks.compat import (
    BaseTaskBackend,
    InvalidTask,
    Task,
    TaskResult,
    TaskResultDoesNotExist,
    TaskResultStatus,
    normalize_json,
    task_enqueued,
)
from django_workpump.tasks.errors import TaskRefused
from django_workpump.tasks.resolution import import_task_modules, resolve_task, topic_of
from django_workpump.tasks.results import read_result
from django_workpump.tasks.runner import register_queues


@dataclass(frozen=True, slots=True, kw_only=True)
class WorkPumpTask(Task):
    """A ``Task`` with the work pump's per-task options (``@task(max_attempts=3)``)."""

    max_attempts: int | None = None  # None: OPTIONS["MAX_ATTEMPTS"], else WORKPUMP's


class WorkPumpBackend(BaseTaskBackend):
    """Run ``django.tasks`` tasks under ``runworkpump``: leased, retried, dead-lettered."""

    task_class = WorkPumpTask
    supports_defer = True
    supports_async_task = True
    supports_get_result = True
    supports_priority = True

    def __init__(self, alias: str, params: dict[str, Any]) -> None:
        super().__init__(alias, params)
        # The workers of this process must run what any process enqueues.
        register_queues(alias, self.queues)
        # Task paths are resolved among loaded modules only: load the ones tasks may
        # live in now, never because a row names one.
        import_task_modules(self.options.get("TASK_MODULES", ()))

    # -- validation ----------------------------------------------------------------
    def validate_task(self, task: Task) -> None:
        super().validate_task(task)
        # Django's rule: empty QUEUES accepts any queue name.
        if self.queues and task.queue_name not in self.queues:
            raise InvalidTask(f"Queue '{task.queue_name}' is not valid for backend.")
        max_attempts = getattr(task, "max_attempts", None)
        if max_attempts is not None and (
            isinstance(max_attempts, bool) or not isinstance(max_attempts, int) or max_attempts < 1
        ):
            raise InvalidTask(
                f"max_attempts of task '{task.module_path}' must be a whole number >= 1 "
                f"(or None for the backend's default), not {max_attempts!r}."
            )

    def check(self, **kwargs: Any) -> list[checks.CheckMessage]:
        return list(check_backend(self.alias, self.queues, self.options))

    # -- producing -----------------------------------------------------------------
    def enqueue(self, task: Task, args: Any, kwargs: Any) -> TaskResult:
        """Store the task as an inbox row in the caller's transaction."""
        self.validate_task(task)
        if task.backend != self.alias:
            raise InvalidTask(
                f"Task '{task.module_path}' is for backend '{task.backend}', not "
                f"'{self.alias}'; enqueue it with task.using(backend='{self.alias}')."
            )
        try:
            declared = resolve_task(task.module_path, self)
        except TaskRefused as exc:
            raise InvalidTask(str(exc)) from None
        if declared.func is not task.func:
            raise InvalidTask(
                f"'{task.module_path}' is another task than the one enqueued; a task must "
                "be the module attribute its function's name gives (use @task on it)."
            )
        # Django's rule and message for arguments (TypeError "Unsupported type: ..."),
        # then a strict round trip: NaN, infinities and non-string keys do not survive.
        args = normalize_json(args)
        kwargs = normalize_json(kwargs)
        payload = {
            "task": task.module_path,
            "args": args,
            "kwargs": kwargs,
            "run_after": task.run_after.isoformat() if task.run_after else None,
        }
        _check_round_trip(task.module_path, payload)
        message_id = uuid.uuid4()
        using = setting("DATABASE_ALIAS")
        producer.receive(
            message_id,
            topic_of(self.alias, task.queue_name),
            payload,
            priority=task.priority,
            run_after=task.run_after,
            max_attempts=self.max_attempts_of(task),
            deduplicate=False,  # a fresh UUID: nothing to de-duplicate
            using=using,
        )
        from django_workpump.models import Inbox

        enqueued_at = (
            Inbox.objects.using(using)
            .values_list("created_at", flat=True)
            .get(message_id=message_id)
        )
        result: TaskResult[Any, Any] = TaskResult(
            task=task,
            id=str(message_id),
            status=TaskResultStatus.READY,
            enqueued_at=enqueued_at,
            started_at=None,
            finished_at=None,
            last_attempted_at=None,
            args=args,
            kwargs=kwargs,
            backend=self.alias,
            errors=[],
            worker_ids=[],
        )
        # "Enqueued" means a worker can see it: after the caller's commit (at once in
        # autocommit); a rolled-back task never announces itself.
        transaction.on_commit(
            partial(task_enqueued.send, type(self), task_result=result), using=using
        )
        return result

    def max_attempts_of(self, task: Task) -> int:
        """Attempts the task's row gets: the task's own, else OPTIONS', else WORKPUMP's."""
        own = getattr(task, "max_attempts", None)
        if own is not None:
            return int(own)
        option = self.options.get("MAX_ATTEMPTS")
        return int(option) if option is not None else int(setting("MAX_ATTEMPTS"))

    # -- results -------------------------------------------------------------------
    def get_result(self, result_id: str) -> TaskResult:
        """Read the task's row and attempts; TaskResultDoesNotExist if there is none."""
        try:
            return read_result(self, result_id)
        except TaskRefused as exc:
            raise TaskResultDoesNotExist(f"{result_id}: {exc}") from None


def _check_round_trip(module_path: str, payload: dict[str, Any]) -> None:
    try:
        text = json.dumps(payload, allow_nan=False)
    except ValueError as exc:
        raise ValueError(
            f"The arguments of task '{module_path}' are not JSON ({exc}); "
            "pass only finite numbers, strings, booleans, None, lists and dicts."
        ) from None
    if json.loads(text) != payload:
        raise TypeError(
            f"The arguments of task '{module_path}' do not round-trip through JSON: "
            "dict keys must be strings."
        )
