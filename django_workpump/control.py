"""Handler control flow: ``Snooze``, ``Discard``, ``Release`` and a handler's ``Retry``.

A handler raises ``Snooze(seconds)`` to run again later without spending an attempt,
``Discard(reason)`` to end its row as ``discarded``, or ``Release()`` to hand its row back
unfinished (at a shutdown its attempt is given back); ``Retry`` (``retry=`` on the
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

from django_workpump.storable import storable_text

if TYPE_CHECKING:
    from django_workpump.work import Work

Backoff = Callable[[int, BaseException], float | None]

# The longest wait a Snooze or a Retry backoff may ask for: 100 years. The time it sets
# must stay a date Python, the admin and PostgreSQL all handle (Python's ends at 9999).
MAX_DELAY_SECONDS = 100 * 365.25 * 86400
MAX_DELAY_TEXT = "100 years (3155760000 s)"


def _seconds(value: Any, what: str, fix: str, *, bounded: bool = True) -> float:
    """``value`` (seconds or a timedelta) as finite seconds >= 0 (and at most
    ``MAX_DELAY_SECONDS`` when ``bounded``), or ValueError."""
    given = value
    if isinstance(value, timedelta):
        value = value.total_seconds()
    if isinstance(value, bool) or not isinstance(value, Real):
        raise ValueError(f"{what} must be a number of seconds or a timedelta, not {value!r}; {fix}")
    seconds = float(value)
    if not math.isfinite(seconds) or seconds < 0:
        raise ValueError(f"{what} must be finite and >= 0, not {given!r}; {fix}")
    if bounded and seconds > MAX_DELAY_SECONDS:
        raise ValueError(f"{what} must be at most {MAX_DELAY_TEXT}, not {given!r}; {fix}")
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
        # Stored as the row's last error: NUL and lone surrogates, which PostgreSQL
        # refuses, become U+FFFD (with a note) here, as in error texts.
        self.reason = storable_text(reason)
        self.work = work
        super().__init__(self.reason)


class Release(Exception):
    """Raise to hand this row back unfinished (typically once ``work.cancelled`` is true).

    At a shutdown (``work.cancel_reason == "shutdown"``), or once the lease is no longer
    this attempt's, the row returns to pending with its attempt given back: a later
    instance runs it as if this attempt never started. Otherwise (the handler's own
    decision, or its timeout or lease deadline passed) the attempt counts: the row is
    retried (at once for the handler's own decision; reason ``released``, or ``timeout`` /
    ``lease_expired`` at a deadline), or dead when its attempts are used up. After an
    operator's cancel the row has ended already and nothing is written.
    In a batch handler it concerns the whole batch: at a shutdown every row is given
    back; otherwise the first row's attempt counts and the others are given back.
    """

    def __init__(self) -> None:
        super().__init__("released by its handler")


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

    def delay(
        self,
        attempt: int,
        exc: BaseException,
        on_clamp: Callable[[float], object] | None = None,
    ) -> float | None:
        """Seconds before the next attempt, or None for the default backoff.

        A backoff that raises or returns something other than finite seconds >= 0
        raises ValueError naming it. Seconds over ``MAX_DELAY_SECONDS`` are cut to it
        (``on_clamp`` is called with what the backoff returned): the row waits as long as
        the product allows rather than looping on a time the database refuses.
        """
        if self.backoff is None:
            return None
        value = self.backoff(attempt, exc)
        if value is None:
            return None
        seconds = _seconds(
            value,
            f"The value of Retry(backoff={getattr(self.backoff, '__qualname__', self.backoff)})",
            "return seconds >= 0, or None for the default backoff.",
            bounded=False,
        )
        if seconds > MAX_DELAY_SECONDS:
            if on_clamp is not None:
                on_clamp(seconds)
            return MAX_DELAY_SECONDS
        return seconds


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
