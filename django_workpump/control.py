"""Handler control flow: ``Snooze``, ``Discard`` and a handler's own ``Retry`` policy.

A handler raises ``Snooze(seconds)`` to run again later without spending an attempt, or
``Discard(reason)`` to end its row as ``discarded``; ``Retry`` (``retry=`` on the
registration decorators) says which exceptions retry, how long to wait, and how many
attempts a row gets. See docs/control-flow.md.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from numbers import Real
from typing import TYPE_CHECKING, Any

from django.core.exceptions import ImproperlyConfigured

if TYPE_CHECKING:
    from django_workpump.pump.dispatch import Work

Backoff = Callable[[int, BaseException], float | None]


def _seconds(value: Any, what: str, fix: str) -> float:
    """``value`` (seconds or a timedelta) as finite seconds >= 0, or ValueError."""
    if isinstance(value, timedelta):
        value = value.total_seconds()
    if isinstance(value, bool) or not isinstance(value, Real):
        raise ValueError(f"{what} must be a number of seconds or a timedelta, not {value!r}; {fix}")
    seconds = float(value)
    if not math.isfinite(seconds) or seconds < 0:
        raise ValueError(f"{what} must be finite and >= 0, not {value!r}; {fix}")
    return seconds


class Snooze(Exception):
    """Raise to run this row again after ``seconds`` without spending an attempt.

    The row keeps its place at the head of its stream, so the stream waits for it. A row
    may snooze ``WORKPUMP["MAX_SNOOZES"]`` times; the next snooze counts as a failed
    attempt (reason ``max_snoozes``).

    A batch handler may name the row with ``work=`` (one of its ``list[Work]``): the rows
    before it complete, it is snoozed, the rows after it are released. Without ``work=``
    it is the batch's first row (docs/control-flow.md, "Batch handlers").
    """

    def __init__(self, seconds: float | timedelta, *, work: Work | None = None) -> None:
        self.seconds = _seconds(
            seconds,
            "workpump.Snooze(seconds)",
            "pass how long to wait, e.g. Snooze(30) or Snooze(timedelta(minutes=5)).",
        )
        self.work = work
        super().__init__(f"snoozed for {self.seconds:g} s")


class Discard(Exception):
    """Raise to end this row as ``discarded`` with ``reason``; its stream moves on.

    A batch handler may name the row with ``work=``, as for ``Snooze``.
    """

    def __init__(
        self, reason: str = "discarded by its handler", *, work: Work | None = None
    ) -> None:
        if not isinstance(reason, str) or not reason.strip():
            raise ValueError(
                f"workpump.Discard(reason) needs a non-empty string, not {reason!r}: it is "
                "stored as the row's last error."
            )
        self.reason = reason
        self.work = work
        super().__init__(reason)


def named_index(exc: Snooze | Discard, works: Sequence[Work]) -> int:
    """The index in ``works`` of the row a batch handler's ``Snooze``/``Discard`` names
    (``work=``; the first row when it names none).

    Raises ValueError, worded for the handler's author, when it names a row that is not
    one of the batch's: the pump and ``run_pending`` then fail the batch's first row.
    """
    named = exc.work
    if named is None:
        return 0
    for index, work in enumerate(works):
        if work is named or work.id == getattr(named, "id", None):
            return index
    raise ValueError(
        f"workpump.{type(exc).__name__}(work=...) named {getattr(named, 'id', named)!r}, "
        f"which is not one of the {len(works)} rows of this batch; pass one of the "
        "handler's list[Work], or no work= for the first row."
    )


@dataclass(frozen=True)
class Retry:
    """A handler's retry policy.

    - ``max_attempts``: attempts per row (as the decorator's ``max_attempts``).
    - ``backoff(attempt, exc)``: seconds to wait before the next attempt after failed
      attempt number ``attempt``, or None for the default backoff
      (``RETRY_BACKOFF_BASE_SECONDS`` doubling up to ``RETRY_BACKOFF_MAX_SECONDS``).
    - ``on``: the exception types that retry; any other exception fails the row at once
      (dead, reason ``not_retryable``). None retries every exception.
    """

    max_attempts: int | None = None
    backoff: Backoff | None = None
    on: tuple[type[BaseException], ...] | None = None

    def __post_init__(self) -> None:
        if self.max_attempts is not None and (
            isinstance(self.max_attempts, bool)
            or not isinstance(self.max_attempts, int)
            or self.max_attempts < 1
        ):
            raise ImproperlyConfigured(
                f"Retry(max_attempts=...) must be a whole number >= 1 (or None for "
                f"WORKPUMP['MAX_ATTEMPTS']), not {self.max_attempts!r}."
            )
        if self.backoff is not None and not callable(self.backoff):
            raise ImproperlyConfigured(
                f"Retry(backoff=...) must be a callable backoff(attempt, exc) returning "
                f"seconds or None, not {self.backoff!r}."
            )
        if self.on is not None:
            on = (self.on,) if isinstance(self.on, type) else self.on
            if not isinstance(on, tuple | list) or not on:
                raise ImproperlyConfigured(
                    f"Retry(on=...) must be a non-empty tuple of exception types (or None to "
                    f"retry every exception), not {self.on!r}."
                )
            bad = [t for t in on if not (isinstance(t, type) and issubclass(t, BaseException))]
            if bad:
                raise ImproperlyConfigured(
                    f"Retry(on=...) must name exception classes, e.g. on=(TimeoutError,); "
                    f"{', '.join(map(repr, bad))} is not one."
                )
            object.__setattr__(self, "on", tuple(on))

    def retries(self, exc: BaseException) -> bool:
        """Whether ``exc`` may be retried under this policy."""
        return self.on is None or isinstance(exc, self.on)

    def delay(self, attempt: int, exc: BaseException) -> float | None:
        """Seconds before the next attempt, or None for the default backoff.

        A backoff that raises or returns something other than finite seconds >= 0
        raises ValueError naming it.
        """
        if self.backoff is None:
            return None
        value = self.backoff(attempt, exc)
        if value is None:
            return None
        return _seconds(
            value,
            f"The value of Retry(backoff={getattr(self.backoff, '__qualname__', self.backoff)})",
            "return seconds >= 0, or None for the default backoff.",
        )


def check_timeout(timeout: Any, where: str) -> float | None:
    """A handler's ``timeout=`` as seconds > 0 (or None), else ImproperlyConfigured."""
    if timeout is None:
        return None
    if isinstance(timeout, timedelta):
        timeout = timeout.total_seconds()
    if (
        isinstance(timeout, bool)
        or not isinstance(timeout, Real)
        or not math.isfinite(timeout)
        or timeout <= 0
    ):
        raise ImproperlyConfigured(
            f"timeout of {where} must be a number of seconds > 0 (or a timedelta), not "
            f"{timeout!r}: it is how long one attempt may run."
        )
    return float(timeout)
