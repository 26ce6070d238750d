"""System checks of one ``WorkPumpBackend`` (called through ``BaseTaskBackend.check``).

Errors
    E101 ``django_workpump`` is not in ``INSTALLED_APPS``.
    E102 the alias is empty or contains ``:``.
    E103 ``QUEUES`` holds a name that is not a non-empty string (empty ``QUEUES`` is
         Django's "any queue": runworkpump then runs every queue of the alias).
    E104 ``OPTIONS`` is not a dict, or has an unknown key.
    E105 ``OPTIONS["MAX_ATTEMPTS"]`` is not a whole number >= 1.
    E106 ``OPTIONS["TASK_MODULES"]`` is not a list of module names.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from django.apps import apps
from django.core import checks

OPTION_KEYS = ("MAX_ATTEMPTS", "TASK_MODULES")
# Per-instance settings a user may look for in OPTIONS: they live in WORKPUMP.
INSTANCE_KEYS = (
    "LEASE_SECONDS",
    "LEASE_GRACE_SECONDS",
    "MAX_RENEWALS_PER_WORK",
    "RETRY_BACKOFF_BASE_SECONDS",
    "RETRY_BACKOFF_MAX_SECONDS",
)


def valid_name(value: Any) -> bool:
    """Whether ``value`` can be part of a task topic: a non-empty string without ':'."""
    return isinstance(value, str) and bool(value.strip()) and ":" not in value


def check_backend(alias: str, queues: Iterable[Any], options: Any) -> Iterable[checks.CheckMessage]:
    """Yield the check messages of the backend ``alias`` with these queues and options."""
    where = f"TASKS['{alias}']"
    if not apps.is_installed("django_workpump"):
        yield checks.Error(
            f"{where} uses WorkPumpBackend but 'django_workpump' is not in INSTALLED_APPS.",
            hint="Add 'django_workpump' to INSTALLED_APPS and run migrate.",
            id="workpump.E101",
        )
    if not valid_name(alias):
        yield checks.Error(
            f"The task backend alias {alias!r} cannot be used by WorkPumpBackend: it must be "
            "a non-empty string without ':'.",
            hint="Rename the alias in TASKS.",
            id="workpump.E102",
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
