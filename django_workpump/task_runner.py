"""The ``django.tasks`` backend on the work pump (DESIGN §11): enqueue, results, runner.

Import it as ``django_workpump.tasks.WorkPumpBackend``: that path also imports on Django
versions without ``django.tasks`` and explains what is missing when used; this module
needs ``django.tasks`` (Django >= 6.0) or its backport ``django_tasks``.

A task is an inbox row (DESIGN §2): ``message_id`` is the ``TaskResult`` id, the handler
name is ``django.tasks:<backend alias>:<queue>``, the payload holds the task's module
path, its JSON arguments and ``run_after``; priority and ``run_after`` are the row's
``priority`` and ``scheduled_for``. One inbox handler per (alias, queue) runs the rows
under ``runworkpump`` with the pump's leases, heartbeats, retries and dead letter. The
runner records every attempt in ``workpump_task_attempt`` (who ran it, when, how it
ended), which is where ``TaskResult.errors``, ``worker_ids`` and the attempt times come
from; the row's ``last_error`` only holds the last error.

Safety: a row never names arbitrary code. The runner imports the module a row names only
if it belongs to an installed app or to ``OPTIONS["TASK_MODULES"]``, and runs the
attribute only if it is a ``Task`` declared for a ``WorkPumpBackend``. Anything else
raises ``TaskRefused`` and the row is dead-lettered at once, without retries.
"""

from __future__ import annotations

import json
import logging
import sys
import threading
import traceback as tracebacks
import uuid
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from datetime import datetime
from functools import partial
from importlib import import_module
from typing import TYPE_CHECKING, Any

from django.apps import apps
from django.conf import settings
from django.core import checks
from django.core.signals import setting_changed
from django.db import DatabaseError, IntegrityError, transaction
from django.db.models.functions import Now
from django.dispatch import receiver
from django.utils import timezone
from django.utils.module_loading import autodiscover_modules, import_string

from django_workpump import db, producer
from django_workpump.conf import setting
from django_workpump.registry import TASK_TOPIC_PREFIX, Handler, registry
from django_workpump.storable import ascii_text, is_transient, storable_text

try:  # Django >= 6.0
    from django.tasks import (
        DEFAULT_TASK_QUEUE_NAME,
        Task,
        TaskContext,
        TaskResult,
        TaskResultStatus,
        task_backends,
    )
    from django.tasks.backends.base import BaseTaskBackend
    from django.tasks.base import TaskError
    from django.tasks.exceptions import InvalidTask, InvalidTaskBackend, TaskResultDoesNotExist
    from django.tasks.signals import task_enqueued, task_finished, task_started
    from django.utils.json import normalize_json
except ImportError:  # older Django with the django-tasks backport installed
    if not TYPE_CHECKING:  # the same names, from the backport
        from django_tasks import (
            DEFAULT_TASK_QUEUE_NAME,
            TaskContext,
            TaskResult,
            TaskResultStatus,
            task_backends,
        )
        from django_tasks.backends.base import BaseTaskBackend
        from django_tasks.base import Task, TaskError
        from django_tasks.exceptions import InvalidTaskBackendError as InvalidTaskBackend
        from django_tasks.exceptions import InvalidTaskError as InvalidTask
        from django_tasks.exceptions import TaskResultDoesNotExist
        from django_tasks.signals import task_enqueued, task_finished, task_started
        from django_tasks.utils import normalize_json

if TYPE_CHECKING:
    from django_workpump.pump.dispatch import Work

logger = logging.getLogger("django_workpump.tasks")

TOPIC_PREFIX = TASK_TOPIC_PREFIX
OPTION_KEYS = ("MAX_ATTEMPTS", "TASK_MODULES")
# Per-instance settings a user may look for in OPTIONS: they live in WORKPUMP.
INSTANCE_KEYS = (
    "LEASE_SECONDS",
    "LEASE_GRACE_SECONDS",
    "MAX_RENEWALS_PER_WORK",
    "RETRY_BACKOFF_BASE_SECONDS",
    "RETRY_BACKOFF_MAX_SECONDS",
)
TRACEBACK_CHARS = 20_000  # the end of a long trace is what explains it


class TaskRefused(Exception):
    """A row names something this backend may not run; the row is dead-lettered at once."""


class AttemptLost(Exception):
    """An attempt ended without an outcome: its worker died or its lease expired."""


class WorkFailed(Exception):
    """The pump failed an attempt outside the task (no handler for its queue, ...)."""


def class_path(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def topic_of(alias: str, queue: str) -> str:
    """The inbox handler name of one (backend alias, queue)."""
    return f"{TOPIC_PREFIX}:{alias}:{queue}"


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
        # Empty QUEUES would let Django accept any queue, but only listed queues have a
        # handler in the workers: a task on another queue would never run.
        if task.queue_name not in self.queues:
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
        return list(_check_backend(self.alias, self.queues, self.options))

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


# -- results from the row and its attempts ---------------------------------------------


def read_result(backend: WorkPumpBackend, result_id: Any) -> TaskResult:
    """The ``TaskResult`` of one task row of ``backend``, from the database."""
    from django_workpump.models import Inbox, TaskAttempt

    try:
        message_id = uuid.UUID(str(result_id))
    except ValueError:
        raise TaskResultDoesNotExist(result_id) from None
    using = setting("DATABASE_ALIAS")
    prefix = topic_of(backend.alias, "")
    row = (
        Inbox.objects.using(using)
        .filter(message_id=message_id, handler_name__startswith=prefix)
        .values(
            "handler_name",
            "payload",
            "priority",
            "created_at",
            "attempts",
            "instance_id",
            "lease_expiry",
            "processed_at",
            "dead_lettered_at",
            "last_error",
            "result",
        )
        .first()
    )
    if row is None:
        raise TaskResultDoesNotExist(result_id)
    attempts = list(
        TaskAttempt.objects.using(using)
        .filter(message_id=message_id)
        .order_by("attempt")
        .values("attempt", "instance_id", "started_at", "finished_at", "error_class", "traceback")
    )
    payload = row["payload"] if isinstance(row["payload"], Mapping) else {}
    run_after = _parse_time(payload.get("run_after"))
    declared = resolve_task(payload.get("task"), backend)
    try:
        task = declared.using(
            backend=backend.alias,
            queue_name=row["handler_name"][len(prefix) :],
            priority=row["priority"],
            run_after=run_after,
        )
    except InvalidTask:
        task = declared  # e.g. its queue left QUEUES since: the result still reads back
    now = timezone.now()
    current = None
    if row["instance_id"] is not None and row["lease_expiry"] and row["lease_expiry"] > now:
        current = next(
            (
                a
                for a in attempts
                if a["attempt"] == row["attempts"]
                and a["instance_id"] == row["instance_id"]
                and a["finished_at"] is None
            ),
            None,
        )
    errors = []
    for a in attempts:
        if a["error_class"]:
            errors.append(
                TaskError(exception_class_path=a["error_class"], traceback=a["traceback"] or "")
            )
        elif a["finished_at"] is None and a is not current:
            errors.append(
                TaskError(exception_class_path=class_path(AttemptLost), traceback=_lost(a))
            )
    finished_at = None
    if row["processed_at"] is not None:
        status, finished_at = TaskResultStatus.SUCCESSFUL, row["processed_at"]
    elif row["dead_lettered_at"] is not None:
        status, finished_at = TaskResultStatus.FAILED, row["dead_lettered_at"]
        last = attempts[-1] if attempts else None
        if last is None or (last["finished_at"] is not None and not last["error_class"]):
            # Failed by the pump, not by the task: its last_error says why.
            errors.append(
                TaskError(
                    exception_class_path=class_path(WorkFailed),
                    traceback=row["last_error"] or "failed by the work pump",
                )
            )
    elif current is not None:
        status = TaskResultStatus.RUNNING
    else:
        status = TaskResultStatus.READY
    result: TaskResult[Any, Any] = TaskResult(
        task=task,
        id=str(message_id),
        status=status,
        enqueued_at=row["created_at"],
        started_at=attempts[0]["started_at"] if attempts else None,
        finished_at=finished_at,
        last_attempted_at=attempts[-1]["started_at"] if attempts else None,
        args=payload.get("args", []),
        kwargs=payload.get("kwargs", {}),
        backend=backend.alias,
        errors=errors,
        worker_ids=[str(a["instance_id"]) for a in attempts],
    )
    if status == TaskResultStatus.SUCCESSFUL:
        object.__setattr__(result, "_return_value", row["result"])
    return result


def _lost(attempt: Mapping[str, Any]) -> str:
    return (
        f"Attempt {attempt['attempt']} on worker {attempt['instance_id']} ended without an "
        "outcome: the worker died or its lease expired, so the task ran again."
    )


def _parse_time(value: Any) -> datetime | None:
    if not isinstance(value, str):
        return None
    try:
        return datetime.fromisoformat(value)
    except ValueError:
        return None


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


# -- which code a row may name ---------------------------------------------------------


def _may_import(module_name: str, backend: WorkPumpBackend) -> bool:
    """Whether tasks may live in ``module_name``: an installed app's, or TASK_MODULES'."""
    roots = [config.name for config in apps.get_app_configs()]
    roots += [m for m in backend.options.get("TASK_MODULES", ()) if isinstance(m, str)]
    return any(module_name == root or module_name.startswith(root + ".") for root in roots)


def import_task_modules(task_modules: Iterable[Any] = ()) -> None:
    """Import the modules tasks may live in: each installed app's ``tasks`` module and
    ``task_modules`` (a backend's ``OPTIONS["TASK_MODULES"]``).

    Called when a backend is built (``runworkpump`` builds every WorkPumpBackend at
    start), so that resolving a row's task path never imports anything: the code a worker
    may run is fixed by configuration, not by what a row names.
    """
    autodiscover_modules("tasks")
    if isinstance(task_modules, str):
        return  # not a list: the backend's check() reports it
    for name in task_modules:
        if isinstance(name, str) and name not in sys.modules:
            import_module(name)


def load_task_code() -> list[str]:
    """Build every WorkPumpBackend of ``TASKS`` (importing their task modules); return the
    aliases. ``runworkpump`` calls it before it claims anything."""
    configured = getattr(settings, "TASKS", None) or {}
    aliases = [
        alias
        for alias, params in configured.items()
        if isinstance(params, Mapping) and _is_workpump_backend(params.get("BACKEND"))
    ]
    for alias in aliases:
        task_backends[alias]
    return aliases


def resolve_task(module_path: Any, backend: WorkPumpBackend) -> Task:
    """Return the task ``module_path`` names, or raise ``TaskRefused`` (never run blindly).

    Nothing is imported: the module must already be loaded (each installed app's
    ``tasks`` module and ``OPTIONS["TASK_MODULES"]`` are, once the backend is built) and
    belong to an installed app or to ``TASK_MODULES``, as enqueue checks too, so that a
    worker will accept the row. The attribute must be a ``Task`` declared for a
    ``WorkPumpBackend``.
    """
    if not isinstance(module_path, str) or "." not in module_path.strip("."):
        raise TaskRefused(f"{module_path!r} is not the module path of a task.")
    module_name, _, name = module_path.rpartition(".")
    if not _may_import(module_name, backend):
        raise TaskRefused(
            f"Task '{module_path}' is refused: its module is not part of an installed app "
            f"or of TASKS['{backend.alias}']['OPTIONS']['TASK_MODULES']. Define tasks in "
            "an installed app, or list the module there."
        )
    module = sys.modules.get(module_name)
    if module is None:
        raise TaskRefused(
            f"Task '{module_path}' is refused: its module was not loaded when this process "
            "started, and a worker never imports a module a row names. Put the task in "
            f"its app's tasks.py, or list '{module_name}' in TASKS['{backend.alias}']"
            "['OPTIONS']['TASK_MODULES']."
        )
    found = getattr(module, name, None)
    if not isinstance(found, Task):
        raise TaskRefused(
            f"'{module_path}' is not a task (a function decorated with @task) but "
            f"{type(found).__name__}; it is never run."
        )
    if found.backend != backend.alias:
        try:
            declared = task_backends[found.backend]
        except InvalidTaskBackend:
            declared = None
        if not isinstance(declared, WorkPumpBackend):
            raise TaskRefused(
                f"Task '{module_path}' is declared for backend '{found.backend}', which is "
                "not a WorkPumpBackend; the work pump runs only its own tasks."
            )
    return found


# -- handlers: one per (alias, queue) ----------------------------------------------------

_registered: set[str] = set()
_registered_lock = threading.Lock()


def _valid_name(value: Any) -> bool:
    return isinstance(value, str) and bool(value.strip()) and ":" not in value


def register_queues(alias: str, queues: Iterable[Any]) -> list[str]:
    """Register the inbox handler of each queue of backend ``alias``; return the topics."""
    topics = []
    for queue in queues:
        if not (_valid_name(alias) and isinstance(queue, str) and queue.strip()):
            continue  # reported by the backend's check()
        topic = topic_of(alias, queue)
        with _registered_lock:
            if topic not in _registered or registry.get("inbox", topic) is None:
                registry.register(Handler("inbox", topic, _handler(alias, queue)))
                _registered.add(topic)
        topics.append(topic)
    return topics


def register_backends() -> list[str]:
    """Register the inbox handlers of every WorkPumpBackend in ``TASKS``; return the topics.

    Call it at startup (``WorkPumpConfig.ready``) so that a ``runworkpump`` process runs
    tasks it never enqueued itself. Backends are not built: only their settings are read.
    """
    topics: list[str] = []
    configured = getattr(settings, "TASKS", None) or {}
    if not isinstance(configured, Mapping):
        return topics
    for alias, params in configured.items():
        if isinstance(params, Mapping) and _is_workpump_backend(params.get("BACKEND")):
            queues = params.get("QUEUES", [DEFAULT_TASK_QUEUE_NAME])
            if isinstance(queues, Iterable) and not isinstance(queues, str):
                topics += register_queues(alias, queues)
    return topics


def unregister_backends() -> None:
    """Forget every task handler (``TASKS`` changed)."""
    with _registered_lock:
        for topic in _registered:
            registry.unregister("inbox", topic)
        _registered.clear()


def _is_workpump_backend(path: Any) -> bool:
    if not isinstance(path, str):
        return False
    try:
        backend_class = import_string(path)
    except Exception:  # noqa: BLE001 - another backend's import error is Django's to report
        return False
    return isinstance(backend_class, type) and issubclass(backend_class, WorkPumpBackend)


@receiver(setting_changed)
def _tasks_changed(*, setting: str, **kwargs: Any) -> None:
    if setting == "TASKS":
        unregister_backends()
        register_backends()


def _handler(alias: str, queue: str) -> Any:
    def run_task(work: Work) -> Any:
        return AttemptRunner(alias, queue, work).run()

    return run_task


# -- one attempt -------------------------------------------------------------------------


class AttemptRunner:
    """Run one claimed task row: record the attempt, run the task, report the outcome."""

    def __init__(self, alias: str, queue: str, work: Work) -> None:
        self.alias = alias
        self.queue = queue
        self.work = work
        self.using: str = setting("DATABASE_ALIAS")
        self.backend: WorkPumpBackend | None = None
        # The pump always says which instance runs the work; the nil UUID stands for
        # "unknown" when a Work is built by hand.
        self.instance_id = work.instance_id or uuid.UUID(int=0)

    def run(self) -> Any:
        self._start_attempt()
        try:
            task, args, kwargs = self._decode()
        except TaskRefused as exc:
            self._refuse(exc)
            raise
        backend = self.backend
        assert backend is not None
        sender = type(backend)
        running = read_result(backend, self.work.id)
        _send(task_started, sender, running)
        try:
            if task.takes_context:
                value = task.call(TaskContext(task_result=running), *args, **kwargs)
            else:
                value = task.call(*args, **kwargs)
        except BaseException as exc:
            self._finish(exc)
            if self.work.attempts >= self.work.max_attempts:
                _send(task_finished, sender, self._final(backend, TaskResultStatus.FAILED))
            else:
                logger.warning(
                    "task %s attempt %d/%d failed (%s); it will be retried",
                    running.task.module_path,
                    self.work.attempts,
                    self.work.max_attempts,
                    class_path(type(exc)),
                    extra={"action": "task_retry"},
                )
            raise
        try:
            value = normalize_json(value)
            _check_return(running.task.module_path, value)
        except (TypeError, ValueError) as exc:
            # Running it again would return the same kind of value: no retries.
            self._spend_attempts()
            self._finish(exc)
            _send(task_finished, sender, self._final(backend, TaskResultStatus.FAILED))
            raise
        self._finish(None)
        _send(task_finished, sender, self._final(backend, TaskResultStatus.SUCCESSFUL, value))
        return value

    # -- steps -----------------------------------------------------------------------
    def _start_attempt(self) -> None:
        from django_workpump.models import TaskAttempt

        work = self.work
        # Earlier attempts still open ended without an outcome (DESIGN §6): stamp them.
        TaskAttempt.objects.using(self.using).filter(
            message_id=work.id, attempt__lt=work.attempts, finished_at__isnull=True
        ).update(
            finished_at=Now(),
            error_class=class_path(AttemptLost),
            traceback=(
                "This attempt ended without an outcome: its worker died or its lease "
                f"expired, and attempt {work.attempts} took the task over."
            ),
        )
        try:
            TaskAttempt.objects.using(self.using).create(
                message_id=work.id,
                attempt=work.attempts,
                instance_id=self.instance_id,
                lease_token=work.lease_token,
            )
        except IntegrityError:
            # The same claim count again (an operator re-queued a dead row): start over.
            TaskAttempt.objects.using(self.using).filter(
                message_id=work.id, attempt=work.attempts
            ).update(
                instance_id=self.instance_id,
                lease_token=work.lease_token,
                started_at=Now(),
                finished_at=None,
                error_class=None,
                traceback=None,
            )

    def _decode(self) -> tuple[Task, list[Any], dict[str, Any]]:
        try:
            backend = task_backends[self.alias]
        except InvalidTaskBackend as exc:
            raise TaskRefused(f"Task backend '{self.alias}' is not configured: {exc}") from None
        if not isinstance(backend, WorkPumpBackend):
            raise TaskRefused(f"Task backend '{self.alias}' is not a WorkPumpBackend.")
        self.backend = backend
        payload = self.work.payload
        args, kwargs = payload.get("args", []), payload.get("kwargs", {})
        if not isinstance(args, list) or not isinstance(kwargs, dict):
            raise TaskRefused(
                "The task row's payload is malformed: args must be a list and kwargs a dict."
            )
        declared = resolve_task(payload.get("task"), backend)
        try:
            task = declared.using(
                backend=self.alias,
                queue_name=self.queue,
                priority=self.work.priority,
                run_after=_parse_time(payload.get("run_after")),
            )
        except InvalidTask as exc:
            raise TaskRefused(f"Task '{declared.module_path}' is refused: {exc}") from None
        return task, args, kwargs

    def _refuse(self, exc: TaskRefused) -> None:
        logger.error(
            "inbox row %s (%s) refused and dead-lettered: %s",
            self.work.id,
            self.work.topic,
            exc,
            extra={"action": "task_refused"},
        )
        self._spend_attempts()
        self._finish(exc)

    def _spend_attempts(self) -> None:
        if self.work.instance_id is None or self.work.lease_token is None:
            return
        db.fetch_named(
            "tasks.sql",
            "spend_attempts",
            {
                "message_id": self.work.id,
                "instance_id": self.work.instance_id,
                "lease_token": self.work.lease_token,
            },
            using=self.using,
        )

    def _finish(self, exc: BaseException | None) -> None:
        from django_workpump.models import TaskAttempt

        error_class = traceback = None
        if exc is not None:
            error_class = storable_text(class_path(type(exc)))
            text = "".join(tracebacks.format_exception(exc))[-TRACEBACK_CHARS:]
            traceback = storable_text(text)

        def record(error_class: str | None, traceback: str | None) -> None:
            # First outcome wins: a late one (an abandoned thread) does not overwrite it,
            # nor does an older claim's run that reached the same attempt number (a
            # re-queued row).
            attempt = TaskAttempt.objects.using(self.using).filter(
                message_id=self.work.id, attempt=self.work.attempts, finished_at__isnull=True
            )
            if self.work.lease_token is not None:
                attempt = attempt.filter(lease_token=self.work.lease_token)
            attempt.update(finished_at=Now(), error_class=error_class, traceback=traceback)

        try:
            record(error_class, traceback)
        except (DatabaseError, ValueError) as refused:
            if is_transient(refused) or traceback is None:
                raise
            # The database refused the text itself: record the attempt's end in plain ASCII.
            logger.error(
                "task attempt %s/%d: the database refused its traceback (%s); stored as ASCII",
                self.work.id,
                self.work.attempts,
                type(refused).__name__,
                extra={"action": "task_traceback_made_ascii"},
            )
            record(ascii_text(error_class or ""), ascii_text(traceback))

    def _final(
        self, backend: WorkPumpBackend, status: TaskResultStatus, value: Any = None
    ) -> TaskResult:
        """The result as it is once the pump records this outcome (the row lags a bit)."""
        result = read_result(backend, self.work.id)
        final = replace(result, status=status, finished_at=timezone.now())
        if status == TaskResultStatus.SUCCESSFUL:
            object.__setattr__(final, "_return_value", value)
        return final


def _check_return(module_path: str, value: Any) -> None:
    try:
        json.dumps(value, allow_nan=False)
    except ValueError as exc:
        raise ValueError(f"The return value of task '{module_path}' is not JSON ({exc}).") from None


def _send(signal: Any, sender: type, result: TaskResult) -> None:
    """Send a task signal; a failing receiver is logged, it does not fail the task."""
    for receiver_, response in signal.send_robust(sender, task_result=result):
        if isinstance(response, Exception):
            logger.error(
                "receiver %r of a task signal raised %r",
                receiver_,
                response,
                extra={"action": "task_signal_failed"},
            )


# -- system checks of a backend (called through BaseTaskBackend.check) ------------------


def _check_backend(
    alias: str, queues: Iterable[Any], options: Any
) -> Iterable[checks.CheckMessage]:
    where = f"TASKS['{alias}']"
    if not apps.is_installed("django_workpump"):
        yield checks.Error(
            f"{where} uses WorkPumpBackend but 'django_workpump' is not in INSTALLED_APPS.",
            hint="Add 'django_workpump' to INSTALLED_APPS and run migrate.",
            id="workpump.E101",
        )
    if not _valid_name(alias):
        yield checks.Error(
            f"The task backend alias {alias!r} cannot be used by WorkPumpBackend: it must be "
            "a non-empty string without ':'.",
            hint="Rename the alias in TASKS.",
            id="workpump.E102",
        )
    queues = list(queues)
    if not queues:
        yield checks.Error(
            f"{where}['QUEUES'] is empty: WorkPumpBackend runs only the queues it lists, so "
            "no task could run.",
            hint="List the queues, e.g. 'QUEUES': ['default'], or leave QUEUES out.",
            id="workpump.E103",
        )
    for queue in queues:
        if not isinstance(queue, str) or not queue.strip():
            yield checks.Error(
                f"{where}['QUEUES'] holds {queue!r}; a queue name must be a non-empty string.",
                hint="Fix the name in QUEUES.",
                id="workpump.E103",
            )
    if not isinstance(options, Mapping):
        yield checks.Error(
            f"{where}['OPTIONS'] must be a dict, not {type(options).__name__}.",
            hint=f"Use a dict with keys among {', '.join(OPTION_KEYS)}.",
            id="workpump.E104",
        )
        return
    for key in options:
        if key not in OPTION_KEYS:
            hint = f"Known keys: {', '.join(OPTION_KEYS)}."
            if key in INSTANCE_KEYS:
                hint = (
                    f"{key} applies to every runworkpump instance, not to one backend: "
                    f"set WORKPUMP['{key}'] instead."
                )
            yield checks.Error(
                f"{where}['OPTIONS'] has an unknown key {key!r}.", hint=hint, id="workpump.E104"
            )
    max_attempts = options.get("MAX_ATTEMPTS")
    if max_attempts is not None and (
        isinstance(max_attempts, bool) or not isinstance(max_attempts, int) or max_attempts < 1
    ):
        yield checks.Error(
            f"{where}['OPTIONS']['MAX_ATTEMPTS'] must be a whole number >= 1, not "
            f"{max_attempts!r}.",
            hint="Leave it out to use WORKPUMP['MAX_ATTEMPTS'].",
            id="workpump.E105",
        )
    modules = options.get("TASK_MODULES", ())
    if not isinstance(modules, list | tuple) or not all(isinstance(m, str) and m for m in modules):
        yield checks.Error(
            f"{where}['OPTIONS']['TASK_MODULES'] must be a list of module names, not {modules!r}.",
            hint="E.g. 'TASK_MODULES': ['myproject.jobs'].",
            id="workpump.E106",
        )
