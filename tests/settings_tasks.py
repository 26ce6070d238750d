"""Settings of the django.tasks tests: tests.settings plus TASKS.

The test modules import ``TASKS`` from here for ``override_settings``; the runworkpump
subprocesses of tests/tasks/test_multiprocess.py run with ``--settings=tests.settings_tasks``.
"""

from importlib.util import find_spec

from tests.settings import *  # noqa: F403

# django.tasks on Django >= 6.0, else the django-tasks backport
TASKS_PACKAGE = "django.tasks" if find_spec("django.tasks") else "django_tasks"

TASKS = {
    "default": {
        "BACKEND": "django_workpump.tasks.WorkPumpBackend",
        "QUEUES": ["default", "emails"],
        "OPTIONS": {"MAX_ATTEMPTS": 3, "TASK_MODULES": ["tests.task_funcs"]},
    },
    # A second work-pump backend: tasks may move to it with .using(backend="bulk").
    "bulk": {
        "BACKEND": "django_workpump.tasks.WorkPumpBackend",
        "OPTIONS": {"MAX_ATTEMPTS": 1, "TASK_MODULES": ["tests.task_funcs"]},
    },
    # Not the work pump: its tasks must never run under runworkpump.
    "inline": {"BACKEND": f"{TASKS_PACKAGE}.backends.immediate.ImmediateBackend"},
}
