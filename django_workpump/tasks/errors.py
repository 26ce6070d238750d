"""The errors the work pump records for task attempts, by class path.

``TaskResult.errors`` name these classes by their dotted path (stored with each attempt
in ``workpump_task_attempt.error_class``), so the path of each class is part of the
stored data: keep them here.
"""

from __future__ import annotations


class TaskRefused(Exception):
    """A row names something this backend may not run; the row is dead-lettered at once."""


class AttemptLost(Exception):
    """An attempt ended without an outcome: its worker died or its lease expired."""


class WorkFailed(Exception):
    """The pump failed an attempt outside the task (no handler for its queue, ...)."""


class WorkCancelled(Exception):
    """The task's row was cancelled (``workpump.cancel``) or discarded by its handler."""


def class_path(cls: type) -> str:
    """Return the dotted path ``TaskError.exception_class_path`` stores for ``cls``."""
    return f"{cls.__module__}.{cls.__qualname__}"
