"""The ``django.tasks`` names the backend uses: Django's own, or the backport's.

Django >= 6.0 has ``django.tasks``; on Django 5.2 the same names come from the
``django-tasks`` backport. Importing this module raises ``ModuleNotFoundError`` when
neither is installed, which ``django_workpump.tasks`` turns into a backend that explains.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

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

__all__ = [
    "DEFAULT_TASK_QUEUE_NAME",
    "BaseTaskBackend",
    "InvalidTask",
    "InvalidTaskBackend",
    "Task",
    "TaskContext",
    "TaskError",
    "TaskResult",
    "TaskResultDoesNotExist",
    "TaskResultStatus",
    "normalize_json",
    "task_backends",
    "task_enqueued",
    "task_finished",
    "task_started",
]
