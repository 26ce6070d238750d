"""MaintenanceWorker: housekeeping, one instance at a time (DESIGN §8).

Each pass takes the maintenance advisory lock (skipped when a peer holds it), then:
reaps stale instances (a backstop for the heartbeat's reap), purges processed rows and
unreferenced events past retention in small batches, drops idle stream-ownership rows,
purges old tombstones, and logs rows that are using up their attempts.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial

from django.db import close_old_connections

from django_workpump import db
from django_workpump.conf import MIN_TOMBSTONE_RETENTION_SECONDS
from django_workpump.registry import CATEGORIES

logger = logging.getLogger("django_workpump.maintenance")

# Tombstones must outlive any zombie that could still wake up and beat (the pump passes
# conf.tombstone_retention_seconds, which is never less).
TOMBSTONE_RETENTION_SECONDS = MIN_TOMBSTONE_RETENTION_SECONDS


@dataclass
class MaintenanceResult:
    ran: bool
    reaped: int = 0
    purged: dict[str, int] = field(default_factory=dict)
    stuck: int = 0


class MaintenanceWorker:
    def __init__(
        self,
        *,
        alias: str,
        interval_seconds: float,
        retention_seconds: int,
        stale_after_seconds: int,
        definitively_dead_after_seconds: int,
        lock_loss_grace_seconds: float = 0,
        tombstone_retention_seconds: int = TOMBSTONE_RETENTION_SECONDS,
        batch: int = 1_000,
        max_batches_per_pass: int = 50,
    ) -> None:
        self.alias = alias
        self.interval_seconds = interval_seconds
        self.retention_seconds = retention_seconds
        self.stale_after_seconds = stale_after_seconds
        self.definitively_dead_after_seconds = definitively_dead_after_seconds
        self.lock_loss_grace_seconds = lock_loss_grace_seconds
        self.tombstone_retention_seconds = max(
            tombstone_retention_seconds, TOMBSTONE_RETENTION_SECONDS
        )
        self.batch = batch
        self.max_batches_per_pass = max_batches_per_pass
        self.passes = 0
        self._stop = threading.Event()

    def _purge(self, purge_once: Callable[[], int]) -> int:
        total = 0
        for _ in range(self.max_batches_per_pass):
            removed = purge_once()
            total += removed
            if removed < self.batch or self._stop.is_set():
                break
        return total

    def run_once(self) -> MaintenanceResult:
        """One pass, if this instance gets the lock."""
        using = self.alias
        if not db.try_maintenance_lock(using=using):
            return MaintenanceResult(ran=False)
        try:
            self.passes += 1
            result = MaintenanceResult(ran=True)
            result.reaped = len(
                db.reap_stale_instances(
                    stale_after_seconds=self.stale_after_seconds,
                    definitively_dead_after_seconds=self.definitively_dead_after_seconds,
                    lock_loss_grace_seconds=self.lock_loss_grace_seconds,
                    using=using,
                )
            )
            for category in CATEGORIES:
                result.purged[category] = self._purge(
                    partial(
                        db.purge_processed,
                        category=category,
                        retention_seconds=self.retention_seconds,
                        batch=self.batch,
                        using=using,
                    )
                )
            result.purged["event"] = self._purge(
                lambda: db.purge_events(
                    retention_seconds=self.retention_seconds, batch=self.batch, using=using
                )
            )
            result.purged["active_stream"] = self._purge(
                lambda: db.purge_idle_streams(batch=self.batch, using=using)
            )
            result.purged["eviction"] = db.purge_evictions(
                retention_seconds=self.tombstone_retention_seconds, using=using
            )
            stuck = db.stuck_rows(using=using)
            result.stuck = len(stuck)
            for row in stuck:
                logger.warning(
                    "%s %s (%s) is on attempt %d of %d; last error: %s",
                    row.category,
                    row.work_id,
                    row.topic,
                    row.attempts,
                    row.max_attempts,
                    (row.last_error or "").splitlines()[-1:] or "-",
                    extra={"action": "stuck_row"},
                )
            logger.info(
                "maintenance pass: reaped %d, purged %s, stuck %d",
                result.reaped,
                result.purged,
                result.stuck,
                extra={"action": "maintenance"},
            )
            return result
        finally:
            db.release_maintenance_lock(using=using)

    def run(self) -> None:
        while not self._stop.wait(self.interval_seconds):
            try:
                self.run_once()
            except Exception:
                logger.exception("maintenance pass failed", extra={"action": "maintenance_failed"})
            finally:
                close_old_connections()

    def stop(self) -> None:
        self._stop.set()
