"""Tasks of the django.tasks backend tests (tests/tasks/).

Import it only while ``TASKS`` is ``tests.settings_tasks.TASKS``: ``@task`` builds each
task with its backend's task class. In-process tests read ``calls`` to see what ran.
"""

from __future__ import annotations

import os
import threading
from datetime import UTC, datetime, timedelta
from typing import Any

try:
    from django.tasks import task
    from django.tasks.exceptions import TaskResultMismatch
except ImportError:  # Django < 6.0 with the django-tasks backport
    from django_tasks import task
    from django_tasks.exceptions import TaskResultMismatch

__all__ = ["TaskResultMismatch", "task"]  # for the tests, whichever package provides them

calls: list[Any] = []  # what ran in this process, in order
started = threading.Event()  # set by wait_for_release once it runs
release = threading.Event()  # lets wait_for_release finish


@task
def add(a: int, b: int = 0) -> int:
    return a + b


@task(unique=True)
def refresh(key: str) -> str:
    return key


@task(unique=True, unique_for=timedelta(hours=1), on_conflict="raise")
def refresh_hourly(key: str) -> str:
    return key


@task
def record(label: str) -> str:
    calls.append(label)
    return label


@task(queue_name="emails")
def send_email(to: str) -> dict[str, str]:
    calls.append(("email", to))
    return {"sent": to}


@task
async def double_async(n: int) -> int:
    return n * 2


@task(takes_context=True)
def flaky(context: Any, fail_times: int) -> dict[str, int]:
    """Raise on the first ``fail_times`` attempts, then succeed."""
    if context.attempt <= fail_times:
        raise ValueError(f"attempt {context.attempt} failed")
    return {"attempt": context.attempt}


@task(max_attempts=2)
def always_fails() -> None:
    calls.append("always_fails")
    raise RuntimeError("no luck")


@task(max_attempts=1)
def raises_unstorable_text(character: str) -> None:
    """Raise with a character PostgreSQL cannot store (NUL, a lone surrogate) in the text."""
    calls.append("raises_unstorable_text")
    raise RuntimeError(f"bad {chr(int(character, 16))} here")


@task
def returns_unstorable_text() -> dict[str, str]:
    return {"text": "nul \x00 and lone \ud800"}


@task
def returns_a_datetime() -> datetime:
    calls.append("returns_a_datetime")
    return datetime(2026, 1, 1, tzinfo=UTC)


@task(takes_context=True)
def report_context(context: Any) -> dict[str, Any]:
    return {"id": context.task_result.id, "attempt": context.attempt}


@task
def wait_for_release() -> str:
    started.set()
    release.wait(10)
    return "released"


@task(takes_context=True)
def hang_on_first_attempt(context: Any) -> dict[str, int]:
    """Block the first attempt (its worker gets killed); later attempts return at once."""
    if context.attempt == 1:
        threading.Event().wait(60)
    return {"attempt": context.attempt, "pid": os.getpid()}


@task(backend="inline")
def inline_only() -> None:
    calls.append("inline_only")


def plain_function() -> None:
    """Not a task: a row naming it must never make it run."""
    calls.append("plain_function")


def _unbound() -> None:
    calls.append("_unbound")


# A task whose module path ("..._unbound") names the plain function, not the task.
unbound_task = task(_unbound)


@task
def on_slot(slot: str, label: str = "") -> str:
    """Run by a periodic schedule (tests/tasks/test_periodic.py): each slot once."""
    calls.append((label, slot))
    return slot


class Halt(BaseException):
    """A BaseException of the task's own, outside the Exception tree."""


# What raises_base_exception raises, by name.
BASE_EXCEPTIONS: dict[str, type[BaseException]] = {
    "SystemExit": SystemExit,
    "KeyboardInterrupt": KeyboardInterrupt,
    "Halt": Halt,
}


@task(max_attempts=2)
def raises_base_exception(kind: str) -> None:
    calls.append(("raises_base_exception", kind))
    raise BASE_EXCEPTIONS[kind](f"raised by {kind}")


backoffs: list[tuple[str, int]] = []  # (exception text, attempts) each backoff call saw


def quick_backoff(exc: BaseException, task_result: Any) -> float:
    backoffs.append((str(exc), task_result.attempts))
    return 0


def hour_backoff(exc: BaseException, task_result: Any) -> float:
    backoffs.append((str(exc), task_result.attempts))
    return 3600


@task(takes_context=True, max_attempts=3, backoff=quick_backoff)
def backs_off(context: Any) -> int:
    if context.attempt < 3:
        raise ValueError(f"attempt {context.attempt} failed")
    return context.attempt


@task(max_attempts=3, backoff=hour_backoff)
def backs_off_an_hour() -> None:
    raise ValueError("later")


@task
def completion_hook(result_id: str) -> str:
    calls.append(("hook", result_id))
    return result_id


@task(on_complete=completion_hook)
def with_hook(n: int) -> int:
    calls.append(("with_hook", n))
    return n


@task(max_attempts=1, on_complete=completion_hook)
def fails_with_hook() -> None:
    raise RuntimeError("no")
