"""Periodic work: ``@workpump.periodic(name, cron=... | every=...)`` (docs/periodic.md).

A schedule is an outbox handler for destination ``name`` plus a rule for its slots: a
5-field cron expression evaluated in a time zone (DST-correct, by ``cronsim``) or a fixed
interval aligned to the Unix epoch. Each slot becomes one outbox row with
``payload | {"slot": "<ISO-8601 UTC>"}``, fired by ``workpump.fire_periodic`` in SQL,
whose conditional update lets exactly one of any number of instances fire it. This
module holds the definitions and the slot arithmetic; ``pump/periodic.py`` fires them.
"""

from __future__ import annotations

import inspect
import json
import threading
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any, TypeVar
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from cronsim import CronSim, CronSimError

from django_workpump.registry import Handler, registry

F = TypeVar("F", bound=Callable[..., Any])

CATCH_UP_MODES = ("latest", "none", "all")
# catch_up="none" still fires a slot this late: the pump's own wake-up and query time.
NONE_TOLERANCE = timedelta(seconds=5)
# catch_up="all" fires at most this many missed slots of one schedule per pass.
CATCH_UP_BATCH = 100
# The longest every=: slot arithmetic must stay inside Python's datetime (year 9999) and
# every_seconds inside its integer column.
MAX_EVERY = timedelta(days=3650)
_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
_TICK = timedelta(microseconds=1)


class InvalidSchedule(ValueError):
    """A periodic schedule that cannot work: bad cron, time zone, interval or option."""


def slot_text(slot: datetime) -> str:
    """The slot as the payload carries it: ISO-8601 in UTC with a ``Z``."""
    return slot.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclass(frozen=True)
class Schedule:
    """One periodic schedule and the slots it produces."""

    name: str
    cron: str | None = None
    every_seconds: int | None = None
    timezone: str = "UTC"
    payload: Mapping[str, Any] = field(default_factory=dict)
    catch_up: str = "latest"
    priority: int = 0
    max_attempts: int | None = None

    @property
    def zone(self) -> ZoneInfo:
        return ZoneInfo(self.timezone)

    def describe(self) -> str:
        """'cron 30 2 * * * (Europe/Berlin)' or 'every 90s'."""
        if self.cron is not None:
            return f"cron {self.cron} ({self.timezone})"
        return f"every {self.every_seconds}s"

    def payload_json(self) -> str:
        return json.dumps(dict(self.payload), allow_nan=False, ensure_ascii=False)

    # -- slots (aware datetimes in, UTC datetimes out) --------------------------------

    def slots_after(self, after: datetime) -> Iterator[datetime]:
        """Slots strictly after ``after``, in order (endless)."""
        if self.every_seconds is not None:
            step = timedelta(seconds=self.every_seconds)
            slot = _EPOCH + step * ((after - _EPOCH) // step + 1)
            while True:
                yield slot
                slot += step
        assert self.cron is not None
        for slot in CronSim(self.cron, after.astimezone(self.zone)):
            yield slot.astimezone(UTC)

    def next_after(self, after: datetime) -> datetime:
        """The first slot strictly after ``after``."""
        return next(self.slots_after(after))

    def latest_at_or_before(self, now: datetime) -> datetime | None:
        """The last slot at or before ``now`` (None if there is none)."""
        if self.every_seconds is not None:
            step = timedelta(seconds=self.every_seconds)
            return _EPOCH + step * ((now - _EPOCH) // step)
        assert self.cron is not None
        # cronsim's reverse iteration includes its start only when it has microseconds.
        for slot in CronSim(self.cron, (now + _TICK).astimezone(self.zone), reverse=True):
            return slot.astimezone(UTC)
        return None


def build_schedule(
    name: str,
    *,
    cron: str | None,
    every: timedelta | None,
    tz: str | None,
    payload: Mapping[str, Any] | None,
    catch_up: str,
    priority: int,
    max_attempts: int | None,
) -> Schedule:
    """Check every argument of ``periodic()``; raise ``InvalidSchedule`` naming the fix."""
    if not isinstance(name, str) or not name.strip():
        raise InvalidSchedule(f"A periodic schedule name must be a non-empty string, not {name!r}.")
    what = f"Periodic schedule {name!r}"
    if (cron is None) == (every is None):
        raise InvalidSchedule(
            f"{what} needs exactly one of cron= and every=, "
            f"{'not both' if cron is not None else 'got neither'}: e.g. cron='0 3 * * *' "
            "or every=timedelta(minutes=5)."
        )
    every_seconds = None
    if every is not None:
        if not isinstance(every, timedelta):
            raise InvalidSchedule(
                f"{what}: every= must be a datetime.timedelta, not {every!r}; "
                "e.g. every=timedelta(seconds=30)."
            )
        if every < timedelta(seconds=1):
            raise InvalidSchedule(
                f"{what}: every= ({every}) must be at least one second; "
                "e.g. every=timedelta(seconds=1)."
            )
        if every > MAX_EVERY:
            raise InvalidSchedule(
                f"{what}: every= ({every.days} days) must be at most {MAX_EVERY.days} days "
                "(about ten years); for rarer work use cron=, e.g. cron='0 3 1 1 *'."
            )
        if every % timedelta(seconds=1):
            raise InvalidSchedule(
                f"{what}: every= ({every}) must be a whole number of seconds; "
                f"e.g. every=timedelta(seconds={int(every.total_seconds())})."
            )
        if tz is not None:
            raise InvalidSchedule(
                f"{what}: tz= applies to cron= only (every= slots are aligned to the Unix "
                "epoch in UTC); remove tz=."
            )
        every_seconds = int(every.total_seconds())
    timezone = "UTC" if tz is None else tz
    try:
        zone = ZoneInfo(timezone) if isinstance(timezone, str) else None
    except (ZoneInfoNotFoundError, ValueError):
        zone = None
    if zone is None:
        raise InvalidSchedule(
            f"{what}: tz= ({tz!r}) is not a known IANA time zone; use a name such as "
            "'Europe/Berlin' or 'UTC' (on systems without zone data: pip install tzdata)."
        )
    if cron is not None:
        _check_cron(what, cron, zone)
    if catch_up not in CATCH_UP_MODES:
        raise InvalidSchedule(
            f"{what}: catch_up= ({catch_up!r}) must be one of "
            f"{', '.join(repr(m) for m in CATCH_UP_MODES)}."
        )
    if payload is None:
        payload = {}
    if not isinstance(payload, Mapping):
        raise InvalidSchedule(
            f"{what}: payload= must be a dict of JSON values, not {type(payload).__name__}."
        )
    if "slot" in payload:
        raise InvalidSchedule(
            f"{what}: payload= may not have a 'slot' key: each row's payload gets the slot "
            "time under that key. Rename it."
        )
    try:
        json.dumps(dict(payload), allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise InvalidSchedule(
            f"{what}: payload= is not JSON ({exc}); pass only dicts, lists, strings, numbers, "
            "booleans and None."
        ) from exc
    if isinstance(priority, bool) or not isinstance(priority, int):
        raise InvalidSchedule(f"{what}: priority= must be an int, not {priority!r}.")
    if not -32768 <= priority <= 32767:
        raise InvalidSchedule(f"{what}: priority= must be within -32768..32767, not {priority}.")
    if max_attempts is not None and (
        isinstance(max_attempts, bool) or not isinstance(max_attempts, int) or max_attempts < 1
    ):
        raise InvalidSchedule(
            f"{what}: max_attempts= must be a whole number >= 1 (or None), not {max_attempts!r}."
        )
    return Schedule(
        name=name,
        cron=" ".join(cron.split()) if cron is not None else None,
        every_seconds=every_seconds,
        timezone=timezone,
        payload=dict(payload),
        catch_up=catch_up,
        priority=priority,
        max_attempts=max_attempts,
    )


def _check_cron(what: str, cron: Any, zone: ZoneInfo) -> None:
    fix = "Use five fields: minute hour day-of-month month day-of-week, e.g. '30 2 * * *'."
    if not isinstance(cron, str) or len(cron.split()) != 5:
        raise InvalidSchedule(f"{what}: cron= ({cron!r}) is not a 5-field cron expression. {fix}")
    try:
        CronSim(cron, datetime.now(zone))
    except CronSimError as exc:
        raise InvalidSchedule(
            f"{what}: cron= ({cron!r}) is not a valid cron expression ({exc}). {fix}"
        ) from exc


class ScheduleRegistry:
    """Periodic schedules by name (their handlers are in the handler registry)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._schedules: dict[str, Schedule] = {}

    def register(self, schedule: Schedule) -> None:
        with self._lock:
            self._schedules[schedule.name] = schedule

    def unregister(self, name: str) -> None:
        with self._lock:
            self._schedules.pop(name, None)

    def get(self, name: str) -> Schedule | None:
        return self._schedules.get(name)

    def all(self) -> list[Schedule]:
        return sorted(self._schedules.values(), key=lambda s: s.name)


schedules = ScheduleRegistry()


def periodic(
    name: str,
    *,
    cron: str | None = None,
    every: timedelta | None = None,
    tz: str | None = None,
    payload: Mapping[str, Any] | None = None,
    catch_up: str = "latest",
    priority: int = 0,
    max_attempts: int | None = None,
    task: Any = None,
) -> Any:
    """Run the decorated handler once per slot of ``cron`` (in ``tz``) or ``every``.

    With ``task=`` (a ``django.tasks`` task) nothing is decorated: each slot enqueues
    ``task`` with the payload as keyword arguments plus ``slot``; returns the schedule.
    """
    schedule = build_schedule(
        name,
        cron=cron,
        every=every,
        tz=tz,
        payload=payload,
        catch_up=catch_up,
        priority=priority,
        max_attempts=max_attempts,
    )
    if task is not None:
        func, atomic = _task_handler(schedule, task)
        _register(schedule, func, atomic=atomic)
        return schedule

    def decorate(func: F) -> F:
        if not callable(func):
            raise InvalidSchedule(
                f"{func!r} is not callable and cannot handle periodic schedule {name!r}."
            )
        _register(schedule, func, atomic=False)
        return func

    return decorate


def _register(schedule: Schedule, func: Callable[..., Any], *, atomic: bool) -> None:
    registry.register(
        Handler("outbox", schedule.name, func, max_attempts=schedule.max_attempts, atomic=atomic)
    )
    schedules.register(schedule)


def _task_handler(schedule: Schedule, task: Any) -> tuple[Callable[..., Any], bool]:
    """An outbox handler that enqueues ``task`` for each slot, and whether it is atomic."""
    what = f"Periodic schedule {schedule.name!r}"
    func = getattr(task, "func", None)
    if not callable(getattr(task, "enqueue", None)) or func is None:
        raise InvalidSchedule(
            f"{what}: task= ({task!r}) must be a django.tasks task, i.e. a function "
            "decorated with @task."
        )
    try:
        inspect.signature(func).bind(**schedule.payload, slot="")
    except TypeError as exc:
        raise InvalidSchedule(
            f"{what}: task {func.__module__}.{func.__qualname__} cannot be called with the "
            f"schedule's payload and slot= as keyword arguments ({exc}); add a 'slot' "
            "parameter (or **kwargs) to it."
        ) from exc
    # Enqueued in the transaction of the handler's own completion: with a work-pump
    # backend on the same database, each slot's task is enqueued exactly once.
    atomic = _enqueues_in_callers_transaction(task)

    def enqueue_task(work: Any) -> None:
        task.enqueue(**work.payload)

    enqueue_task.__qualname__ = f"enqueue_task[{func.__module__}.{func.__qualname__}]"
    return enqueue_task, atomic


def _enqueues_in_callers_transaction(task: Any) -> bool:
    """Whether the task's backend writes its row in the caller's transaction. The work
    pump's backend says so itself (``enqueues_in_callers_transaction``), so this module,
    which the backend builds on, need not import it."""
    try:
        backend = task.get_backend()
    except Exception:  # noqa: BLE001 - an unknown backend is simply not ours
        return False
    return getattr(backend, "enqueues_in_callers_transaction", False) is True
