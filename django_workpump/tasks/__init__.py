"""The ``django.tasks`` backend of the work pump.

``TASKS = {"default": {"BACKEND": "django_workpump.tasks.WorkPumpBackend"}}``.

Tasks enqueued with it are inbox rows written in the caller's transaction and run by
``manage.py runworkpump`` with leases, heartbeats, retries and dead-lettering; see
``docs/tasks.md``. This module imports on any supported Django, so that
``register_backends()`` can run at startup; without ``django.tasks`` (Django >= 6.0) or
the ``django-tasks`` backport the backend refuses to be built and says why.

The modules below need ``django.tasks``:

- ``backend.py``: ``WorkPumpBackend`` (enqueue, task validation, ``get_result``);
- ``results.py``: ``read_result``, a ``TaskResult`` from the row and its attempts;
- ``resolution.py``: which code a row may name (``resolve_task``, ``load_task_code``);
- ``runner.py``: the inbox handler of each queue and ``AttemptRunner``, one attempt;
- ``checks.py``: the system checks of a backend;
- ``errors.py``: the errors recorded for attempts; ``compat.py``: Django's names or the
  backport's.
"""

from __future__ import annotations

from typing import Any

from django.core.exceptions import ImproperlyConfigured

try:
    from django_workpump.tasks.backend import WorkPumpBackend, WorkPumpTask
    from django_workpump.tasks.errors import AttemptLost, TaskRefused, WorkFailed
    from django_workpump.tasks.resolution import load_task_code, resolve_task, topic_of
    from django_workpump.tasks.results import read_result
    from django_workpump.tasks.runner import register_backends, unregister_backends

    TASKS_AVAILABLE = True
    __all__ = [
        "TASKS_AVAILABLE",
        "AttemptLost",
        "TaskRefused",
        "WorkFailed",
        "WorkPumpBackend",
        "WorkPumpTask",
        "load_task_code",
        "read_result",
        "register_backends",
        "resolve_task",
        "topic_of",
        "unregister_backends",
    ]
except ModuleNotFoundError as exc:
    if exc.name not in ("django.tasks", "django_tasks"):
        raise
    TASKS_AVAILABLE = False

    import django

    MISSING = (
        "django_workpump.tasks.WorkPumpBackend needs django.tasks, which Django "
        f"{django.get_version()} does not have. Upgrade to Django 6.0 or later, or "
        "install the backport (pip install django-tasks), or remove it from TASKS."
    )

    class WorkPumpBackend:  # type: ignore[no-redef]
        """Stand-in that explains why the backend cannot be used here."""

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            raise ImproperlyConfigured(MISSING)

    def register_backends() -> list[str]:
        """Nothing to register without ``django.tasks``."""
        return []

    def unregister_backends() -> None:
        return None

    def load_task_code() -> list[str]:
        """No task code to load without ``django.tasks``."""
        return []

    __all__ = [
        "TASKS_AVAILABLE",
        "WorkPumpBackend",
        "load_task_code",
        "register_backends",
        "unregister_backends",
    ]
