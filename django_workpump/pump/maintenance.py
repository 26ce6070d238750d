"""MaintenanceWorker: housekeeping, one instance at a time.

Each pass takes the maintenance advisory lock (skipped when a peer holds it; after
MAX_SKIPPED_PASSES skipped in a row, run without it, since any role that may connect can
take an advisory lock and hold it for ever), then:
reaps stale instances (a backstop for the heartbeat's reap); purges, in small batches
taken in turn until every purge has caught up, processed rows, unreferenced events and
finished batches past RETENTION_SECONDS, dead rows past DEAD_RETENTION_SECONDS (when
set), received message ids past INBOX_DEDUP_RETENTION_SECONDS, the attempts of purged
tasks and idle stream-ownership rows, and the console's series past
CONSOLE_RETENTION_SECONDS; purges old tombstones; and logs rows that are using up their
attempts. Handler threads never purge.

Between passes, every CONSOLE_SAMPLE_SECONDS, it samples the console's gauges of the
current minute (backlog, instances: ``db.console_sample``); the first sample of a minute,
from any instance, is the one kept, so peers and restarts sample no minute twice, and an
idle pump, whose sample would repeat the last one, writes none.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from time import monotonic

from django.db import close_old_connections

from django_workpump import db, status
from django_workpump.conf import MIN_TOMBSTONE_RETENTION_SECONDS
from django_workpump.pump.service import LoopService
from django_workpump.registry import CATEGORIES
from django_workpump.storable import error_headline

logger = logging.getLogger("django_workpump.maintenance")

# Tombstones must outlive any zombie that could still wake up and beat (the pump passes
# conf.tombstone_retention_seconds, which is never less).
TOMBSTONE_RETENTION_SECONDS = MIN_TOMBSTONE_RETENTION_SECONDS
# Passes skipped in a row because another session held the maintenance lock, after which
# one pass runs without it. Safe: every purge deletes a batch it locked with SKIP LOCKED,
# tombstones go by age, and the reap is the one every heartbeat runs concurrently. A
# squatter on the lock delays purging by this many intervals; it never stops it.
MAX_SKIPPED_PASSES = 3
# How often an instance tries to sample the console's gauges: twice a minute, so a late
# wake-up skips no minute.
CONSOLE_SAMPLE_SECONDS = 30.0
CONSOLE_RETENTION_SECONDS = 7 * 24 * 3600


@dataclass
class MaintenanceResult:
    ran: bool
    reaped: int = 0
    locked: bool = True  # False: a pass run without the lock (another session kept it)
    purged: dict[str, int] = field(default_factory=dict)
    stuck: int = 0
    unhandled: int = 0  # topics with waiting rows that no live instance runs
    sampled: bool = False  # this pass took the minute's console sample

    @property
    def quiet(self) -> bool:
        """Whether the pass found nothing to do (its log line is then DEBUG)."""
        return not (self.reaped or any(self.purged.values()) or self.stuck or self.unhandled)


class MaintenanceWorker(LoopService):
    """Run a maintenance pass every ``interval_seconds`` until stopped."""

    name = "maintenance"

    def __init__(
        self,
        *,
        alias: str,
        interval_seconds: float,
        retention_seconds: int,
        stale_after_seconds: int,
        definitively_dead_after_seconds: int,
        lock_loss_grace_seconds: float = 0,
        dead_retention_seconds: int | None = None,
        inbox_dedup_retention_seconds: int | None = None,
        tombstone_retention_seconds: int = TOMBSTONE_RETENTION_SECONDS,
        batch: int = 1_000,
        max_skipped_passes: int = MAX_SKIPPED_PASSES,
        console_retention_seconds: int = CONSOLE_RETENTION_SECONDS,
        console_sample_seconds: float = CONSOLE_SAMPLE_SECONDS,
    ) -> None:
        super().__init__()
        self.alias = alias
        self.interval_seconds = interval_seconds
        self.retention_seconds = retention_seconds
        self.stale_after_seconds = stale_after_seconds
        self.definitively_dead_after_seconds = definitively_dead_after_seconds
        self.lock_loss_grace_seconds = lock_loss_grace_seconds
        self.dead_retention_seconds = dead_retention_seconds
        self.inbox_dedup_retention_seconds = inbox_dedup_retention_seconds
        self.tombstone_retention_seconds = max(
            tombstone_retention_seconds, TOMBSTONE_RETENTION_SECONDS
        )
        self.batch = batch
        self.max_skipped_passes = max_skipped_passes
        self.console_retention_seconds = console_retention_seconds
        self.console_sample_seconds = console_sample_seconds
        self.passes = 0
        self.skipped_in_a_row = 0
        # What was already logged, so a pass logs only what changed: the attempts of each
        # stuck row, and the topics no live instance runs.
        self._stuck_logged: dict[tuple[str, object], int] = {}
        self._unhandled_logged: set[tuple[str, str]] = set()

    def _purges(self) -> dict[str, Callable[[], int]]:
        """Each purge as one batch call, by the name its count is reported under."""
        using, batch = self.alias, self.batch
        purges: dict[str, Callable[[], int]] = {}
        for category in CATEGORIES:
            purges[category] = partial(
                db.purge_processed,
                category=category,
                retention_seconds=self.retention_seconds,
                batch=batch,
                using=using,
            )
        if self.dead_retention_seconds is not None:
            for category in CATEGORIES:
                purges[f"dead_{category}"] = partial(
                    db.purge_dead,
                    category=category,
                    retention_seconds=self.dead_retention_seconds,
                    batch=batch,
                    using=using,
                )
        purges["event"] = partial(
            db.purge_events, retention_seconds=self.retention_seconds, batch=batch, using=using
        )
        purges["batch"] = partial(
            db.purge_batches, retention_seconds=self.retention_seconds, batch=batch, using=using
        )
        purges["task_attempt"] = partial(
            db.purge_task_attempts,
            retention_seconds=self.retention_seconds,
            batch=batch,
            using=using,
        )
        if self.inbox_dedup_retention_seconds is not None:
            purges["inbox_dedup"] = partial(
                db.purge_inbox_dedup,
                retention_seconds=self.inbox_dedup_retention_seconds,
                batch=batch,
                using=using,
            )
        purges["active_stream"] = partial(db.purge_idle_streams, batch=batch, using=using)
        purges["console"] = partial(
            db.purge_console,
            retention_seconds=self.console_retention_seconds,
            batch=batch,
            using=using,
        )
        # not a purge, but batched alike: rows of ruled topics a rule's creation left
        # unflagged (docs/flow-control.md)
        purges["flow_stragglers"] = partial(db.flag_flow_stragglers, batch=batch, using=using)
        return purges

    def _purge_until_caught_up(self) -> dict[str, int]:
        """One batch of each purge in turn, until each has come back short of a batch.

        Batches keep every delete short (row locks, WAL) and taking them in turn keeps one
        large backlog from starving the rest; a pass ends only when all have caught up or
        the worker is stopped, so retention keeps up with any production rate.
        """
        purges = self._purges()
        totals = dict.fromkeys(purges, 0)
        behind = list(purges)
        while behind and not self._stop.is_set():
            for name in list(behind):
                removed = purges[name]()
                totals[name] += removed
                if removed < self.batch:
                    behind.remove(name)
        return totals

    def run_once(self) -> MaintenanceResult:
        """One pass, if this instance gets the lock or was kept from it too long."""
        using = self.alias
        locked = db.try_maintenance_lock(using=using)
        if not locked:
            self.skipped_in_a_row += 1
            if self.skipped_in_a_row <= self.max_skipped_passes:
                return MaintenanceResult(ran=False, locked=False)
            logger.warning(
                "the maintenance lock was held by another session (pid %s) at %d passes in "
                "a row: this pass runs without it. A pump's pass takes seconds; a session "
                "that keeps the lock is not a pump (check pg_locks and the roles that may "
                "connect, docs/reliability.md, Database roles).",
                ", ".join(map(str, db.maintenance_lock_holders(using=using))) or "gone",
                self.skipped_in_a_row - 1,
                extra={"action": "maintenance_lock_held"},
            )
        self.skipped_in_a_row = 0
        try:
            self.passes += 1
            result = MaintenanceResult(ran=True, locked=locked)
            result.sampled = self.sample_once()
            result.reaped = len(
                db.reap_stale_instances(
                    stale_after_seconds=self.stale_after_seconds,
                    definitively_dead_after_seconds=self.definitively_dead_after_seconds,
                    lock_loss_grace_seconds=self.lock_loss_grace_seconds,
                    using=using,
                )
            )
            result.purged = self._purge_until_caught_up()
            result.purged["eviction"] = db.purge_evictions(
                retention_seconds=self.tombstone_retention_seconds, using=using
            )
            stuck = db.stuck_rows(using=using)
            result.stuck = len(stuck)
            self._log_stuck(stuck)
            result.unhandled = self._log_unhandled()
            logger.log(
                logging.DEBUG if result.quiet else logging.INFO,
                "maintenance pass: reaped %d, purged %s, stuck %d, topics without a live "
                "handler %d",
                result.reaped,
                ", ".join(f"{n} {name}" for name, n in result.purged.items() if n) or "nothing",
                result.stuck,
                result.unhandled,
                extra={
                    "action": "maintenance",
                    "workpump_reaped": result.reaped,
                    "workpump_purged": {k: v for k, v in result.purged.items() if v},
                    "workpump_stuck": result.stuck,
                },
            )
            return result
        finally:
            if locked:
                db.release_maintenance_lock(using=using)

    def _log_stuck(self, stuck: list[db.StuckRow]) -> None:
        """Warn about a row using up its attempts when its attempt count changed."""
        seen: dict[tuple[str, object], int] = {}
        for row in stuck:
            key = (row.category, row.work_id)
            seen[key] = row.attempts
            if self._stuck_logged.get(key) == row.attempts:
                continue
            logger.warning(
                "%s %s (%s) is on attempt %d of %d; last error: %s",
                row.category,
                row.work_id,
                row.topic,
                row.attempts,
                row.max_attempts,
                error_headline(row.last_error) or "-",
                extra={
                    "action": "stuck_row",
                    "workpump_category": row.category,
                    "workpump_topic": row.topic,
                    "workpump_id": str(row.work_id),
                    "workpump_attempt": row.attempts,
                    "workpump_max_attempts": row.max_attempts,
                    "workpump_error": error_headline(row.last_error),
                },
            )
        self._stuck_logged = seen

    def _log_unhandled(self) -> int:
        """Warn once per topic whose rows wait with no live instance to run them.

        A topic is named again only after it was handled in between. Return how many
        topics wait.
        """
        waiting = status.unhandled_topics(
            stale_after_seconds=self.stale_after_seconds,
            definitively_dead_after_seconds=self.definitively_dead_after_seconds,
            using=self.alias,
        )
        current = {(u.category, u.topic) for u in waiting}
        for u in waiting:
            if (u.category, u.topic) in self._unhandled_logged:
                continue
            logger.warning(
                "%d %s rows of topic %r wait (the oldest for %.0f s) and no live instance "
                "has a handler for it: they spend no attempt and run once an instance with "
                "its handler starts. Deploy that handler (or correct the topic the producer "
                "uses), or check the --topics/--queues of the running instances; "
                "`manage.py workpump_status` lists them under 'no live handler'.",
                u.rows,
                u.category,
                u.topic,
                u.oldest_age_seconds,
                extra={
                    "action": "no_live_handler",
                    "workpump_category": u.category,
                    "workpump_topic": u.topic,
                    "workpump_rows": u.rows,
                },
            )
        self._unhandled_logged = current
        return len(waiting)

    def sample_once(self) -> bool:
        """Sample the console's gauges of this minute, unless a peer already did."""
        return db.console_sample(
            stale_after_seconds=self.stale_after_seconds,
            definitively_dead_after_seconds=self.definitively_dead_after_seconds,
            using=self.alias,
        )

    def run(self) -> None:
        next_pass = monotonic() + self.interval_seconds
        wait = min(self.interval_seconds, self.console_sample_seconds)
        while not self._stop.wait(max(0.0, min(wait, next_pass - monotonic()))):
            try:
                if monotonic() >= next_pass:
                    next_pass = monotonic() + self.interval_seconds
                    self.run_once()
                else:
                    self.sample_once()
            except Exception:
                logger.exception("maintenance pass failed", extra={"action": "maintenance_failed"})
            finally:
                close_old_connections()
