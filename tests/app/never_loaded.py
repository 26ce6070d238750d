"""A task module of an installed app that no process loads at start (it is not the app's
``tasks`` module, nor listed in ``TASK_MODULES``): a row that names it is refused, and
the module is never imported because of it."""

from __future__ import annotations

try:
    from django.tasks import task
except ImportError:  # Django < 6.0: the backport
    from django_tasks import task


@task
def add(a: int, b: int) -> int:
    return a + b
