"""Which code a task row may name, and the inbox handler of each queue.

A row never names arbitrary code. The modules tasks may live in (each installed app's
``tasks`` module and ``OPTIONS["TASK_MODULES"]``) are imported when ``runworkpump``
starts; resolving a row's task path afterwards imports nothing, and accepts only a ``Task``
declared for a ``WorkPumpBackend``. Anything else raises ``TaskRefused``.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Mapping
from importlib import import_module
from typing import Any

from django.apps import apps
from django.conf import settings
from django.utils.module_loading import autodiscover_modules, import_string

from django_workpump.registry import TASK_TOPIC_PREFIX
from django_workpump.tasks.compat import BaseTaskBackend, InvalidTaskBackend, Task, task_backends
from django_workpump.tasks.errors import TaskRefused

TOPIC_PREFIX = TASK_TOPIC_PREFIX

# The outbox topic of a task's on_complete callback (runner._enqueue_hook runs it).
ON_COMPLETE_TOPIC = "workpump.tasks.on_complete"


def topic_of(alias: str, queue: str) -> str:
    """The inbox handler name of one (backend alias, queue)."""
    return f"{TOPIC_PREFIX}:{alias}:{queue}"


class PumpBackend(BaseTaskBackend):
    """The base of ``WorkPumpBackend``: what a row's task must be declared for.

    Defined here, below ``backend.py`` (which imports this module), so the checks of this
    module and the runner need not import the backend.
    """


def backend_class() -> type[BaseTaskBackend]:
    """Return the class every work-pump backend is an instance of."""
    return PumpBackend


def is_workpump_backend(path: Any) -> bool:
    """Whether ``path`` (a ``TASKS`` ``BACKEND``) names a ``WorkPumpBackend`` class."""
    if not isinstance(path, str):
        return False
    try:
        found = import_string(path)
    except Exception:  # noqa: BLE001 - another backend's import error is Django's to report
        return False
    return isinstance(found, type) and issubclass(found, backend_class())


def _may_import(module_name: str, backend: BaseTaskBackend) -> bool:
    """Whether tasks may live in ``module_name``: an installed app's, or TASK_MODULES'."""
    roots = [config.name for config in apps.get_app_configs()]
    roots += [m for m in backend.options.get("TASK_MODULES", ()) if isinstance(m, str)]
    return any(module_name == root or module_name.startswith(root + ".") for root in roots)


def import_task_modules(task_modules: Iterable[Any] = ()) -> None:
    """Import the modules tasks may live in: each installed app's ``tasks`` module and
    ``task_modules`` (a backend's ``OPTIONS["TASK_MODULES"]``)."""
    autodiscover_modules("tasks")
    if isinstance(task_modules, str):
        return  # not a list: the backend's check() reports it
    for name in task_modules:
        if isinstance(name, str) and name not in sys.modules:
            import_module(name)


def load_task_code() -> list[str]:
    """Import the task modules of every WorkPumpBackend of ``TASKS``; return the aliases.

    ``runworkpump`` calls it before it claims anything, so that resolving a row's task
    path never imports anything: the code a worker may run is fixed by configuration,
    not by what a row names. Backends are not built: only their settings are read.
    """
    configured = getattr(settings, "TASKS", None) or {}
    if not isinstance(configured, Mapping):
        return []
    aliases = []
    for alias, params in configured.items():
        if isinstance(params, Mapping) and is_workpump_backend(params.get("BACKEND")):
            options = params.get("OPTIONS") or {}
            modules = options.get("TASK_MODULES", ()) if isinstance(options, Mapping) else ()
            import_task_modules(modules)
            aliases.append(alias)
    return aliases


def resolve_task(module_path: Any, backend: BaseTaskBackend) -> Task:
    """Return the task ``module_path`` names, or raise ``TaskRefused`` (never run blindly).

    Nothing is imported: the module must already be loaded (each installed app's
    ``tasks`` module and ``OPTIONS["TASK_MODULES"]`` are, once ``load_task_code`` ran) and
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
        if not isinstance(declared, backend_class()):
            raise TaskRefused(
                f"Task '{module_path}' is declared for backend '{found.backend}', which is "
                "not a WorkPumpBackend; the work pump runs only its own tasks."
            )
    return found
