"""PeriodicWorker: fires the slots of the periodic schedules (docs/periodic.md).

Every instance runs one, with no leader and no local state: a pass reads the database
clock and each schedule's last slot and paused flag, works out which slot is due by the
schedule's ``catch_up`` rule, and calls ``workpump.fire_periodic``, whose conditional
update lets exactly one racing instance send each slot's outbox row. Between passes the
worker waits until the next slot of any schedule (at most ``max_idle_seconds``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from datetime import datetime

from django.db import close_old_connections

from django_workpump import db
from django_workpump.clock import Clock, SystemClock
from django_workpump.periodic import (
    CATCH_UP_BATCH,
    NONE_TOLERANCE,
    Schedule,
    ScheduleRegistry,
    schedules,
    slot_text,
)
from django_workpump.pump.service import LoopService

logger = logging.getLogger("django_workpump.periodic")

# A wait for a slot ends this much after it, so that the database clock has passed it.
SLOT_MARGIN_SECONDS = 0.005
# After a failed pass the next one is tried this soon, doubling up to max_idle_seconds.
ERROR_RETRY_SECONDS = 1.0


@dataclass
class PeriodicResult:
    """What one pass did; slots by schedule name."""

    now: datetime  # the database clock the pass worked with
    fired: dict[str, list[datetime]] = field(default_factory=dict)  # sent by this worker
    lost: dict[str, list[datetime]] = field(default_factory=dict)  # sent by someone else
    skipped: dict[str, list[datetime]] = field(default_factory=dict)  # missed, not sent
    failed: list[str] = field(default_factory=list)  # schedules whose pass raised
    next_due: datetime | None = None  # the earliest slot still to come (now: a backlog)

    def _due(self, when: datetime) -> None:
        if self.next_due is None or when < self.next_due:
            self.next_due = when

    @property
    def fired_count(self) -> int:
        return sum(len(slots) for slots in self.fired.values())


class PeriodicWorker(LoopService):
    """Fire the due slots of every schedule, waiting until the next one, until stopped."""

    name = "periodic"

    def __init__(
        self,
        *,
        alias: str,
        partition_count: int,
        max_payload_bytes: int,
        default_max_attempts: int,
        registry: ScheduleRegistry = schedules,
        clock: Clock | None = None,
        max_idle_seconds: float = 60.0,
        catch_up_batch: int = CATCH_UP_BATCH,
    ) -> None:
        super().__init__()
        self.alias = alias
        self.partition_count = partition_count
        self.max_payload_bytes = max_payload_bytes
        self.default_max_attempts = default_max_attempts
        self.registry = registry
        self.clock = clock or SystemClock()
        self.max_idle_seconds = max_idle_seconds
        self.catch_up_batch = catch_up_batch
        self.passes = 0
        self.fired_total = 0  # slots this worker sent
        self.lost_total = 0  # slots it tried to send after another caller had

    # -- registration ----------------------------------------------------------------

    def register(self, now: datetime | None = None) -> list[str]:
        """Upsert every schedule of the code; return the names whose row was created."""
        db_now, _ = db.periodic_states(now=now, using=self.alias)
        return [s.name for s in self.registry.all() if self._upsert(s, db_now, now)]

    def _upsert(self, schedule: Schedule, db_now: datetime, now: datetime | None) -> bool:
        return db.upsert_periodic(
            name=schedule.name,
            cron=schedule.cron,
            every_seconds=schedule.every_seconds,
            timezone=schedule.timezone,
            catch_up=schedule.catch_up,
            payload_json=schedule.payload_json(),
            priority=schedule.priority,
            max_attempts=schedule.max_attempts or self.default_max_attempts,
            next_fire_at=schedule.next_after(db_now),
            now=now,
            using=self.alias,
        )

    # -- one pass --------------------------------------------------------------------

    def run_once(self, now: datetime | None = None) -> PeriodicResult:
        """Fire what is due at the database clock (``now`` in tests) for every schedule."""
        db_now, states = db.periodic_states(now=now, using=self.alias)
        result = PeriodicResult(now=db_now)
        self.passes += 1
        for schedule in self.registry.all():
            try:
                state = states.get(schedule.name)
                if state is None:  # registered after the pump started (or row deleted)
                    self._upsert(schedule, db_now, now)
                    result._due(schedule.next_after(db_now))
                    continue
                self._pass(schedule, state, result, now)
            except Exception:
                result.failed.append(schedule.name)
                logger.exception(
                    "periodic schedule %s: the pass failed; it is tried again next pass",
                    schedule.name,
                    extra={"action": "periodic_failed"},
                )
        self.fired_total += result.fired_count
        self.lost_total += sum(len(slots) for slots in result.lost.values())
        return result

    def _pass(
        self,
        schedule: Schedule,
        state: db.PeriodicState,
        result: PeriodicResult,
        now: datetime | None,
    ) -> None:
        db_now = result.now
        # A new schedule counts its slots from when its row was created.
        handled = state.last_slot or state.created_at
        upcoming = schedule.next_after(db_now)
        latest = schedule.latest_at_or_before(db_now)
        if latest is None or latest <= handled:
            result._due(upcoming)
            return
        name = schedule.name
        if state.paused:
            self._skip(schedule, latest, upcoming, result, now)
        elif schedule.catch_up == "latest":
            self._fire(schedule, latest, upcoming, result, now)
        elif schedule.catch_up == "none":
            if db_now - latest <= NONE_TOLERANCE:
                self._fire(schedule, latest, upcoming, result, now)
            else:
                self._skip(schedule, latest, upcoming, result, now)
        else:  # "all": every missed slot in order, a bounded number per pass
            missed: list[datetime] = []
            for slot in schedule.slots_after(handled):
                if slot > db_now or len(missed) > self.catch_up_batch:
                    break
                missed.append(slot)
            backlog = len(missed) > self.catch_up_batch
            batch = missed[: self.catch_up_batch]
            for index, slot in enumerate(batch):
                following = missed[index + 1] if index + 1 < len(missed) else upcoming
                self._fire(schedule, slot, following, result, now)
            if backlog:
                logger.warning(
                    "periodic schedule %s: catch_up='all' fired %d missed slots this pass, "
                    "the most one pass fires (up to %s); the older backlog continues from "
                    "%s in the next pass. Use catch_up='latest' to fire only the last "
                    "missed slot after downtime.",
                    name,
                    len(batch),
                    slot_text(batch[-1]),
                    slot_text(missed[-1]),
                    extra={"action": "periodic_catch_up_bound"},
                )
                result._due(db_now)
                return
        result._due(upcoming)

    def _fire(
        self,
        schedule: Schedule,
        slot: datetime,
        next_fire_at: datetime,
        result: PeriodicResult,
        now: datetime | None,
    ) -> None:
        work_id = db.fire_periodic(
            name=schedule.name,
            slot=slot,
            next_fire_at=next_fire_at,
            partition_count=self.partition_count,
            max_payload_bytes=self.max_payload_bytes,
            now=now,
            using=self.alias,
        )
        if work_id is None:
            result.lost.setdefault(schedule.name, []).append(slot)
            return
        result.fired.setdefault(schedule.name, []).append(slot)
        logger.debug(
            "periodic schedule %s: fired slot %s as outbox message %s",
            schedule.name,
            slot_text(slot),
            work_id,
            extra={"action": "periodic_fired"},
        )

    def _skip(
        self,
        schedule: Schedule,
        slot: datetime,
        next_fire_at: datetime,
        result: PeriodicResult,
        now: datetime | None,
    ) -> None:
        if db.skip_periodic(
            name=schedule.name, slot=slot, next_fire_at=next_fire_at, now=now, using=self.alias
        ):
            result.skipped.setdefault(schedule.name, []).append(slot)

    # -- the loop --------------------------------------------------------------------

    def wait_seconds(self, result: PeriodicResult, elapsed: float = 0.0) -> float:
        """How long to wait after a pass that took ``elapsed`` seconds."""
        if result.next_due is None:
            return self.max_idle_seconds
        due_in = (result.next_due - result.now).total_seconds() - elapsed
        return min(max(due_in, 0.0) + SLOT_MARGIN_SECONDS, self.max_idle_seconds)

    def run(self) -> None:
        retry = ERROR_RETRY_SECONDS
        while not self._stop.is_set():
            started = self.clock.monotonic()
            try:
                result = self.run_once()
            except Exception:
                logger.exception(
                    "periodic pass failed; retrying in %s s",
                    retry,
                    extra={"action": "periodic_pass_failed"},
                )
                close_old_connections()
                self._stop.wait(retry)
                retry = min(retry * 2, self.max_idle_seconds)
                continue
            retry = ERROR_RETRY_SECONDS
            self._stop.wait(self.wait_seconds(result, self.clock.monotonic() - started))
