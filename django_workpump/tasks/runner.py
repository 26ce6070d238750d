"""Run task rows under ``runworkpump``: one inbox handler per (backend alias, queue).

Each claimed row is one attempt, run by ``AttemptRunner``: it records the attempt in
``workpump_task_attempt`` (who ran it, when, how it ended), resolves the row's task
(``resolution.py``; a row that names anything else raises ``TaskRefused`` and is
dead-lettered at once, without retries), runs it, sends Django's task signals and
reports the outcome to the pump, whose leases, retries and dead letter apply.
"""

from __future__ import annotations

import json
import logging
import threading
import traceback as tracebacks
import uuid
from collections.abc import Iterable, Mapping
from dataclasses import replace
from typing import TYPE_CHECKING, Any, cast

from django.conf import settings
from django.core.signals import setting_changed
from django.db import DatabaseError, IntegrityError
from django.db.models.functions import Now
from django.dispatch import receiver
from django.utils import timezone

from django_workpump import db
from django_workpump.conf import setting
from django_workpump.control import Retry
from django_workpump.registry import FAILURE_SUBJECTS, Handler, registry
from django_workpump.storable import ascii_text, is_transient, storable_text
from django_workpump.tasks.checks import valid_name
from django_workpump.tasks.compat import (
    DEFAULT_TASK_QUEUE_NAME,
    InvalidTask,
    InvalidTaskBackend,
    Task,
    TaskContext,
    TaskResult,
    TaskResultStatus,
    normalize_json,
    task_backends,
    task_finished,
    task_started,
)
from django_workpump.tasks.errors import AttemptLost, TaskRefused, class_path
from django_workpump.tasks.resolution import (
    ON_COMPLETE_TOPIC,
    TOPIC_PREFIX,
    backend_class,
    is_workpump_backend,
    resolve_task,
    topic_of,
)
from django_workpump.tasks.results import parse_time, read_result

if TYPE_CHECKING:
    from django_workpump.tasks.backend import WorkPumpBackend
    from django_workpump.work import Work

logger = logging.getLogger("django_workpump.tasks")

TRACEBACK_CHARS = 20_000  # the end of a long trace is what explains it

# -- handlers: one per (alias, queue) ----------------------------------------------------

_registered: set[str] = set()
_registered_prefixes: set[str] = set()  # of backends with empty QUEUES
_registered_lock = threading.Lock()


def register_queues(alias: str, queues: Iterable[Any]) -> list[str]:
    """Register the inbox handler of each queue of backend ``alias``; return the topics.

    Empty ``queues`` (Django's "any queue name") registers one prefix handler instead,
    for every topic ``topic_of(alias, <any queue>)``; its topic, the prefix, is returned.
    """
    queues = list(queues)
    if not queues:
        if not valid_name(alias):
            return []  # reported by the backend's check()
        prefix = topic_of(alias, "")
        with _registered_lock:
            known = {h.topic for h in registry.prefix_handlers("inbox")}
            if prefix not in _registered_prefixes or prefix not in known:
                registry.register(
                    Handler("inbox", prefix, _prefix_handler(alias), prefix=True, retry=TASK_RETRY)
                )
                _registered_prefixes.add(prefix)
        return [prefix]
    topics = []
    for queue in queues:
        if not (valid_name(alias) and isinstance(queue, str) and queue.strip()):
            continue  # reported by the backend's check()
        topic = topic_of(alias, queue)
        with _registered_lock:
            if topic not in _registered or registry.get("inbox", topic) is None:
                registry.register(Handler("inbox", topic, _handler(alias, queue), retry=TASK_RETRY))
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
    with _registered_lock:
        if registry.get("outbox", ON_COMPLETE_TOPIC) is None:
            registry.register(Handler("outbox", ON_COMPLETE_TOPIC, _enqueue_hook, atomic=True))
    for alias, params in configured.items():
        if isinstance(params, Mapping) and is_workpump_backend(params.get("BACKEND")):
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
        for prefix in _registered_prefixes:
            registry.unregister("inbox", prefix, prefix=True)
        _registered_prefixes.clear()
        if registry.get("outbox", ON_COMPLETE_TOPIC) is not None:
            registry.unregister("outbox", ON_COMPLETE_TOPIC)


@receiver(setting_changed)
def _tasks_changed(*, setting: str, **kwargs: Any) -> None:
    if setting == "TASKS":
        unregister_backends()
        register_backends()


# -- per-task backoff and completion hooks -------------------------------------------------

# The attribute of a failed attempt's exception that carries its task's own backoff.
_DELAY = "_workpump_task_retry_delay"


def _task_delay(attempt: int, exc: BaseException) -> float | None:
    return getattr(exc, _DELAY, None)


# Every task queue's handler retries every exception, after the task's own backoff when
# it gave one (else the pump's default).
TASK_RETRY = Retry(backoff=_task_delay)


def _note_backoff(task: Task, exc: BaseException, running: TaskResult) -> None:
    """Ask the task's ``backoff(exception, task_result)`` for the next attempt's wait."""
    backoff = getattr(task, "backoff", None)
    if backoff is None:
        return
    try:
        seconds = backoff(exc, running)
        setattr(exc, _DELAY, seconds)
    except Exception as error:  # noqa: BLE001 (a backoff bug: the default backoff)
        logger.error(
            "the backoff of task %s failed (%r); the default backoff is used",
            running.task.module_path,
            error,
            extra={"action": "backoff_failed"},
        )


def _enqueue_hook(work: Work) -> None:
    """The callback of a task's one-member batch: enqueue its on_complete task with the
    finished task's result id, in this handler's transaction (so exactly once)."""
    hook = work.payload
    backend = task_backends[hook["backend"]]
    task = resolve_task(hook["task"], backend).using(queue_name=hook["queue"])
    task.enqueue(hook["result_id"])


def _handler(alias: str, queue: str) -> Any:
    def run_task(work: Work) -> Any:
        return AttemptRunner(alias, queue, work).run()

    return run_task


def _prefix_handler(alias: str) -> Any:
    """The handler of every queue of backend ``alias`` (empty QUEUES): the queue is the
    rest of the row's topic."""
    prefix = topic_of(alias, "")

    def run_task(work: Work) -> Any:
        return AttemptRunner(alias, work.topic[len(prefix) :], work).run()

    return run_task


def task_subject(row: Any) -> str | None:
    """Name the task a failed task row ran, for the pump's failure log (its topic names
    only the backend and queue)."""
    if row.category != "inbox" or not row.topic.startswith(f"{TOPIC_PREFIX}:"):
        return None
    path = row.payload.get("task") if isinstance(row.payload, Mapping) else None
    return f"task {path!r}" if isinstance(path, str) else None


FAILURE_SUBJECTS.append(task_subject)


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
            if self.work.attempts < self.work.max_attempts:
                _note_backoff(task, exc, running)
            if self.work.attempts >= self.work.max_attempts:
                _send(task_finished, sender, self._final(backend, TaskResultStatus.FAILED))
            else:
                # DEBUG: the pump logs every failed attempt (one WARNING) once it is written
                logger.debug(
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
        # Earlier attempts still open ended without an outcome: stamp them.
        TaskAttempt.objects.using(self.using).filter(
            work_id=work.id, attempt__lt=work.attempts, finished_at__isnull=True
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
                work_id=work.id,
                attempt=work.attempts,
                instance_id=self.instance_id,
                lease_token=work.lease_token,
            )
        except IntegrityError:
            # The same claim count again (an operator re-queued a dead row): start over.
            TaskAttempt.objects.using(self.using).filter(
                work_id=work.id, attempt=work.attempts
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
        if not isinstance(backend, backend_class()):
            raise TaskRefused(f"Task backend '{self.alias}' is not a WorkPumpBackend.")
        self.backend = cast("WorkPumpBackend", backend)
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
                run_after=parse_time(payload.get("run_after")),
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
                "work_id": self.work.id,
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
                work_id=self.work.id, attempt=self.work.attempts, finished_at__isnull=True
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
