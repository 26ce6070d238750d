"""``WorkPumpBackend``: enqueue a task as an inbox row; validate tasks; read results.

A task is an inbox row: its ``work_id`` is the ``TaskResult`` id, its topic is
``django.tasks:<backend alias>:<queue>``, the payload holds the task's module path, its
JSON arguments and ``run_after``; priority and ``run_after`` are the row's ``priority``
and ``scheduled_for``. The row is written in the caller's transaction; ``runner.py``
runs it under ``runworkpump``.
"""

from __future__ import annotations

import hashlib
import json
import uuid
from collections.abc import Callable, Iterable
from contextlib import nullcontext
from dataclasses import dataclass
from datetime import timedelta
from functools import partial
from typing import Any

from django.core import checks
from django.db import transaction

from django_workpump import db, producer, producer_validation, tracing
from django_workpump.conf import setting
from django_workpump.tasks.checks import check_backend
from django_workpump.tasks.compat import (
    InvalidTask,
    Task,
    TaskResult,
    TaskResultDoesNotExist,
    TaskResultStatus,
    normalize_json,
    task_enqueued,
)
from django_workpump.tasks.errors import TaskRefused
from django_workpump.tasks.resolution import (
    ON_COMPLETE_TOPIC,
    PumpBackend,
    resolve_task,
    topic_of,
)
from django_workpump.tasks.results import read_result
from django_workpump.waiting import await_work, wait
from django_workpump.workflows import Batch, current_batch


@dataclass(frozen=True, slots=True, kw_only=True)
class WorkPumpTask(Task):
    """A ``Task`` with the work pump's per-task options (``@task(max_attempts=3)``)."""

    max_attempts: int | None = None  # None: OPTIONS["MAX_ATTEMPTS"], else WORKPUMP's
    # At most one row of this task with these arguments not yet run: a duplicate enqueue
    # returns the holder's result (on_conflict="raise": workpump.Duplicate).
    unique: bool = False
    unique_for: timedelta | None = None  # with unique: also none enqueued within this
    on_conflict: str = "return"
    # backoff(exception, task_result): seconds before the next attempt, or None for the
    # pump's default backoff (RETRY_BACKOFF_BASE_SECONDS doubling).
    backoff: Callable[[BaseException, Any], float | None] | None = None
    # A task enqueued once, with this task's result id, when this task's row ends
    # (successful or failed): a one-member batch whose callback enqueues it.
    on_complete: Task | None = None


class WorkPumpBackend(PumpBackend):
    """Run ``django.tasks`` tasks under ``runworkpump``: leased, retried, dead-lettered."""

    task_class = WorkPumpTask
    supports_defer = True
    supports_async_task = True
    supports_get_result = True
    supports_priority = True
    # enqueue() writes the row in the caller's transaction: a periodic schedule of this
    # backend's task enqueues it with the slot's own completion, exactly once per slot.
    enqueues_in_callers_transaction = True

    # Building a backend only stores its settings, as Django's backends do: the queues'
    # handlers are registered by WorkPumpConfig.ready() and the task modules imported
    # when runworkpump starts (resolution.load_task_code).

    # -- validation ----------------------------------------------------------------
    def validate_task(self, task: Task) -> None:
        super().validate_task(task)  # also the queue: empty QUEUES accepts any name
        max_attempts = getattr(task, "max_attempts", None)
        if max_attempts is not None and (
            isinstance(max_attempts, bool) or not isinstance(max_attempts, int) or max_attempts < 1
        ):
            raise InvalidTask(
                f"max_attempts of task '{task.module_path}' must be a whole number >= 1 "
                f"(or None for the backend's default), not {max_attempts!r}."
            )

        unique = getattr(task, "unique", False)
        unique_for = getattr(task, "unique_for", None)
        on_conflict = getattr(task, "on_conflict", "return")
        if not isinstance(unique, bool):
            raise InvalidTask(
                f"unique of task '{task.module_path}' must be True or False, not {unique!r}."
            )
        if unique_for is not None and (
            not unique or not isinstance(unique_for, timedelta) or unique_for < timedelta(0)
        ):
            raise InvalidTask(
                f"unique_for of task '{task.module_path}' must be a timedelta >= 0 on a task "
                f"with unique=True, not {unique_for!r}. Pass unique=True too, or leave "
                "unique_for out."
            )
        backoff = getattr(task, "backoff", None)
        if backoff is not None and not callable(backoff):
            raise InvalidTask(
                f"backoff of task '{task.module_path}' must be a callable "
                f"backoff(exception, task_result) returning seconds or None, not {backoff!r}."
            )
        on_complete = getattr(task, "on_complete", None)
        if on_complete is not None and not isinstance(on_complete, Task):
            raise InvalidTask(
                f"on_complete of task '{task.module_path}' must be a task (decorated with "
                f"@task), not {on_complete!r}."
            )
        if on_conflict not in producer_validation.ON_CONFLICT:
            raise InvalidTask(
                f"on_conflict of task '{task.module_path}' must be 'return' (the holder's "
                f"result) or 'raise' (workpump.Duplicate), not {on_conflict!r}."
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
        topic = topic_of(self.alias, task.queue_name)
        unique_key = _unique_key(payload) if getattr(task, "unique", False) else None
        unique_for = getattr(task, "unique_for", None)
        # One statement: the insert, and the row's created_at as enqueued_at. The
        # enqueue span is the producer: the row's headers carry its context. A task with
        # on_complete or inside workpump.batch() joins its batch in the same transaction.
        on_complete = getattr(task, "on_complete", None)
        group = current_batch()
        joins = on_complete is not None or (group is not None and group.using == using)
        with (
            transaction.atomic(using=using) if joins else nullcontext(),
            tracing.producing("enqueue", "inbox", topic) as out,
        ):
            out.note(tracing.TASK, task.module_path)
            out.stored(message_id)
            received = producer.receive_stamped(
                message_id,
                topic,
                payload,
                priority=task.priority,
                run_after=task.run_after,
                max_attempts=self.max_attempts_of(task),
                deduplicate=False,  # a fresh UUID: nothing to de-duplicate
                unique_key=unique_key,
                unique_for=unique_for,
                on_conflict=getattr(task, "on_conflict", "return"),
                using=using,
            )
            if joins and received.stored:
                _join_batch(message_id, on_complete, group, using)
        if not received.stored and unique_key is not None:
            holder = producer.unique_key_holder("inbox", topic, unique_key, unique_for, using=using)
            if holder is not None:
                return self.get_result(str(holder))
            # the holder finished between the two statements: the key is free again
            return self.enqueue(task, args, kwargs)
        result: TaskResult[Any, Any] = TaskResult(
            task=task,
            id=str(message_id),
            status=TaskResultStatus.READY,
            enqueued_at=received.created_at,
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

    def wait_for(
        self, results: Iterable[TaskResult], *, timeout: float | None = None, **options: Any
    ) -> list[TaskResult]:
        """Block until every task of ``results`` has finished (succeeded, failed for good
        or cancelled: a task still to be retried has not); return each read again.

        ``workpump.wait`` on the tasks' inbox rows: woken by NOTIFY, ``WaitTimeout``
        naming the pending result ids after ``timeout`` seconds (``options``:
        ``poll_seconds``). Call it after the enqueueing transaction committed.
        """
        ids = [result.id for result in results]
        wait(ids, timeout=timeout, categories=["inbox"], **options)
        return [self.get_result(result_id) for result_id in ids]

    async def await_for(
        self, results: Iterable[TaskResult], *, timeout: float | None = None, **options: Any
    ) -> list[TaskResult]:
        """``wait_for`` from a coroutine (``workpump.await_work``)."""
        ids = [result.id for result in results]
        await await_work(ids, timeout=timeout, categories=["inbox"], **options)
        return [await self.aget_result(result_id) for result_id in ids]


def _join_batch(
    message_id: uuid.UUID, on_complete: Task | None, group: Batch | None, using: str
) -> None:
    """Make the task's row a member: of its own batch whose callback enqueues
    ``on_complete`` (a member of ``group`` in turn), else of ``group``."""
    if on_complete is None:
        assert group is not None
        db.join_batch("inbox", group.id, [message_id], using=using)
        return
    hook = {
        "backend": on_complete.backend,
        "task": on_complete.module_path,
        "queue": on_complete.queue_name,
        "result_id": str(message_id),
    }
    spec = json.dumps({"topic": ON_COMPLETE_TOPIC, "payload": hook})
    own = db.open_batch(
        on_complete_json=spec,
        on_failure_json=None,
        parent_batch_id=group.id if group is not None and group.using == using else None,
        using=using,
    )
    db.join_batch("inbox", own, [message_id], using=using)
    db.seal_batch(own, using=using)


def _unique_key(payload: dict[str, Any]) -> str:
    """A unique task's key: its path and arguments, hashed (run_after is not part of it)."""
    identity = {"task": payload["task"], "args": payload["args"], "kwargs": payload["kwargs"]}
    text = json.dumps(identity, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return "task:" + hashlib.sha256(text.encode()).hexdigest()


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
