"""Compatibility: the error classes under the path older versions stored.

Task attempts recorded before the ``django_workpump.tasks`` package name their errors
``django_workpump.task_runner.TaskRefused`` (``AttemptLost``, ``WorkFailed``), and
``TaskError.exception_class`` imports that path. The backend itself is
``django_workpump.tasks.WorkPumpBackend``.
"""

from django_workpump.tasks.errors import AttemptLost, TaskRefused, WorkFailed

__all__ = ["AttemptLost", "TaskRefused", "WorkFailed"]
