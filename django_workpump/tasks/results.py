"""A task's ``TaskResult``, read from its inbox row and its recorded attempts.

The row gives the status (processed: SUCCESSFUL, dead-lettered: FAILED, leased to a
live attempt: RUNNING, else READY), the return value and the task's arguments;
``workpump_task_attempt`` gives ``errors``, ``worker_ids`` and the attempt times. The
row's ``last_error`` only holds the last error.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Mapping
from datetime import datetime
from typing import Any

from django.utils import timezone

from django_workpump import db
from django_workpump.conf import setting
from django_workpump.tasks.compat import (
    BaseTaskBackend,
    InvalidTask,
    TaskError,
    TaskResult,
    TaskResultDoesNotExist,
    TaskResultStatus,
)
from django_workpump.tasks.errors import AttemptLost, WorkCancelled, WorkFailed, class_path
from django_workpump.tasks.resolution import resolve_task, topic_of


def read_result(backend: BaseTaskBackend, result_id: Any) -> TaskResult:
    """The ``TaskResult`` of one task row of ``backend``, from the database."""
    try:
        work_id = uuid.UUID(str(result_id))
    except ValueError:
        raise TaskResultDoesNotExist(result_id) from None
    using = setting("DATABASE_ALIAS")
    prefix = topic_of(backend.alias, "")
    # One statement: the row and its attempts.
    rows = db.fetch_named(
        "tasks.sql",
        "task_result",
        {"work_id": work_id, "topic_prefix": prefix},
        using=using,
    )
    if not rows:
        raise TaskResultDoesNotExist(result_id)
    row = rows[0]
    # Django's connections load jsonb as its text.
    row["payload"], row["result"] = (_json(row["payload"]), _json(row["result"]))
    attempts = [
        {
            "attempt": number,
            "instance_id": instance_id,
            "started_at": started_at,
            "finished_at": finished_at,
            "error_class": error_class,
            "traceback": traceback,
        }
        for number, instance_id, started_at, finished_at, error_class, traceback in zip(
            row["attempt_numbers"] or (),
            row["attempt_instance_ids"] or (),
            row["attempt_started_at"] or (),
            row["attempt_finished_at"] or (),
            row["attempt_error_classes"] or (),
            row["attempt_tracebacks"] or (),
            strict=True,
        )
    ]
    payload = row["payload"] if isinstance(row["payload"], Mapping) else {}
    run_after = parse_time(payload.get("run_after"))
    declared = resolve_task(payload.get("task"), backend)
    try:
        task = declared.using(
            backend=backend.alias,
            queue_name=row["topic"][len(prefix) :],
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
    if row["done_at"] is not None and row["end_state"] is not None:
        # Cancelled (workpump.cancel) or discarded: ended without a return value.
        status, finished_at = TaskResultStatus.FAILED, row["done_at"]
        errors.append(
            TaskError(
                exception_class_path=class_path(WorkCancelled),
                traceback=(
                    f"discarded by its handler: {row['last_error']}"
                    if row["end_state"] == "discarded"
                    else "cancelled with workpump.cancel before it finished"
                ),
            )
        )
    elif row["done_at"] is not None:
        status, finished_at = TaskResultStatus.SUCCESSFUL, row["done_at"]
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
        id=str(work_id),
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


def _json(value: Any) -> Any:
    return json.loads(value) if isinstance(value, str) else value


def _lost(attempt: Mapping[str, Any]) -> str:
    return (
        f"Attempt {attempt['attempt']} on worker {attempt['instance_id']} ended without an "
        "outcome: the worker died or its lease expired, so the task ran again."
    )


def parse_time(value: Any) -> datetime | None:
    """Return the ISO time ``value`` holds (a payload's ``run_after``), or None."""
    if not isinstance(value, str):
        return None
    try:
        return datetime.fromisoformat(value)
    except ValueError:
        return None
