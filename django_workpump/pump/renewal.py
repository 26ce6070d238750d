"""LeaseRenewalWorker: keeps the leases of running handlers alive, within the cap.

Each tick it (1) abandons dispatches whose local deadline passed, and (2) hands the
flusher the renewals of every dispatch whose deadline is near, all at once. A
``BatchFlusher`` sends them as one ``renew_leases`` call per category (chunked only past
``RENEWAL_MAX_BATCH`` rows), fenced by each dispatch's
lease token; a handle's deadline moves only for the ids the database confirmed. A call
that fails on the connection is retried by the flusher (only that category's ids); an id
the database refuses for its data is dropped and logged, and its lease runs out. A handle
that used its renewals (or was disposed, or superseded by a newer claim of its row) is
skipped: its lease expires and the row surfaces through a re-claim. A refused instance
(evicted, or no longer registered) stops: ``on_refused`` is called. A renewal the
database answers ``cancelled`` (an operator cancelled the row) cancels the handle and
calls ``on_cancelled``: the fallback when the NOTIFY of the cancel was missed.
"""

from __future__ import annotations

import logging
import threading
import uuid
from collections.abc import Callable
from typing import Any, NamedTuple

from django.db import connections

from django_workpump.clock import Clock, SystemClock
from django_workpump.db import InstanceRefused
from django_workpump.metrics import NullRecorder, recorder
from django_workpump.pump.coordinator import Coordinator
from django_workpump.pump.flusher import BatchFlusher
from django_workpump.pump.lease import LeaseHandle, LeaseRegistry
from django_workpump.pump.naming import application_name, name_thread_connections
from django_workpump.pump.service import LoopService
from django_workpump.states import CancelReason
from django_workpump.work import Lease

logger = logging.getLogger("django_workpump.renewal")


# How long stop() waits for the final flush of renewals when not told.
FINAL_FLUSH_SECONDS = 5.0


class RenewalRequest(NamedTuple):
    """A renewal asked for: ``token`` is the attempt's lease token, None for the handle's."""

    category: str
    work_id: uuid.UUID
    token: uuid.UUID | None = None


class LeaseRenewalWorker(LoopService):
    """Tick (abandon, request renewals) on one thread; renew in batches on the flusher's."""

    name = "renewal"

    def __init__(
        self,
        coordinator: Coordinator,
        leases: LeaseRegistry | None,
        *,
        lease_seconds: float = 300,
        lease_grace_seconds: float = 30,
        max_batch: int = 5_000,
        coalesce_window: float = 0.2,
        immediate_flush_at: int = 100,
        capacity: int = 20_000,
        tick_seconds: float = 0.5,
        on_deadline: Callable[[LeaseHandle], Any] | None = None,
        on_refused: Callable[[str], Any] | None = None,
        on_cancelled: Callable[[str, list[tuple[uuid.UUID, uuid.UUID]]], Any] | None = None,
        clock: Clock | None = None,
        metrics: NullRecorder | None = None,
    ) -> None:
        super().__init__()
        self.coordinator = coordinator
        self.metrics = recorder() if metrics is None else metrics
        self.leases = leases
        self.lease_seconds = lease_seconds
        self.lease_grace_seconds = lease_grace_seconds
        self.tick_seconds = tick_seconds
        self.on_deadline = on_deadline
        self.on_refused = on_refused
        self.on_cancelled = on_cancelled
        self.refused: str | None = None  # why the database refused this instance
        self.clock = clock or SystemClock()
        # Renew once a third of the local lease is left: two more chances before the end.
        self.renew_when_left = max((lease_seconds - lease_grace_seconds) / 3, 1.0)
        self.renewed = 0
        self.skipped_at_cap = 0
        self.skipped_gone = 0
        self._requested: dict[tuple[str, uuid.UUID], float] = {}  # key -> asked at
        self.request_retry_seconds = max(coalesce_window * 10, 5.0)
        self._requested_lock = threading.Lock()
        self.flusher: BatchFlusher[RenewalRequest] = BatchFlusher(
            "workpump-renewals",
            self.flush,
            max_batch=max_batch,
            coalesce_window=coalesce_window,
            immediate_flush_at=immediate_flush_at,
            capacity=capacity,
            clock=self.clock,
            on_thread_start=lambda: name_thread_connections(
                application_name(coordinator.identity.instance_id, "renewals")
            ),
            on_thread_exit=connections.close_all,
            group_by=lambda item: item.category,
            on_rejected=self._rejected,
        )

    def enqueue(
        self, category: str, work_id: uuid.UUID, lease_token: uuid.UUID | None = None
    ) -> bool:
        """Ask for a renewal of one row's lease (coalesced with others).

        ``lease_token`` is the attempt's; None means the one of the handle in flight.
        """
        return self.flusher.put(RenewalRequest(category, work_id, lease_token))

    def flush(self, batch: list[RenewalRequest]) -> None:
        """Renew a batch of one category: one fenced call, for handles that may still renew."""
        category = batch[0].category
        leases: dict[uuid.UUID, Lease] = {}  # work id -> the lease renewed
        for _, work_id, token in dict.fromkeys(batch):  # de-duplicated, order kept
            if self.leases is None:
                if token is not None:  # no registry: renew what was asked
                    leases[work_id] = Lease(category, work_id, token)
                self._answered(category, work_id)
                continue
            handle = self.leases.get(category, work_id)
            lease = None if handle is None else handle.lease
            if handle is None or lease is None or token not in (None, lease.token):
                self.skipped_gone += 1  # finished, or superseded by a newer claim
                self._answered(category, work_id)
                continue
            if not handle.can_renew():
                self.skipped_at_cap += 1
                self._answered(category, work_id)
                logger.warning(
                    "%s %s used its %d lease renewals: letting the lease expire so the row "
                    "is re-claimed and the hung handler surfaces",
                    category,
                    work_id,
                    handle.max_renewals,
                    extra={"action": "renewal_cap"},
                )
                continue
            leases[work_id] = lease
        if not leases or self.refused is not None:
            return
        ids = list(leases)
        sent_at = self.clock.monotonic()
        # A failure raises: the flusher retries a connection error (this category's ids
        # only, so others do not spend a second capped renewal) and splits a data error.
        try:
            renewed = self.coordinator.renew(list(leases.values()))
        except InstanceRefused as exc:
            self._refuse(str(exc))
            return
        for work_id in ids:
            self._answered(category, work_id)
        # The DB set expiry = its now + lease; its now is after sent_at, so this
        # local deadline is on the safe side.
        deadline = sent_at + self.lease_seconds - self.lease_grace_seconds
        cancelled = [work_id for work_id, expiry in renewed.items() if expiry is None]
        if cancelled:
            self._cancelled(category, [(work_id, leases[work_id].token) for work_id in cancelled])
        self.metrics.renewed(category, len(renewed) - len(cancelled))
        for work_id in renewed:
            if renewed[work_id] is None:
                continue
            self.renewed += 1
            if self.leases is not None:
                handle = self.leases.get(category, work_id)
                if handle is not None and handle.lease == leases[work_id]:
                    handle.confirm_renewal(deadline)
        lost = set(ids) - set(renewed)
        for work_id in lost:
            logger.warning(
                "renewal of %s %s refused: the lease was lost; cancelling the handler",
                category,
                work_id,
                extra={"action": "renewal_lost"},
            )
            if self.leases is not None:
                handle = self.leases.get(category, work_id)
                if handle is not None and handle.lease == leases[work_id]:
                    # work.cancelled tells the handler; no more renewals are asked.
                    handle.cancel(CancelReason.LOST)

    def _cancelled(self, category: str, attempts: list[tuple[uuid.UUID, uuid.UUID]]) -> None:
        """The database says these attempts were cancelled: stop them."""
        logger.info(
            "renewal found %d %s attempt(s) cancelled by an operator; stopping them",
            len(attempts),
            category,
            extra={"action": "renewal_cancelled"},
        )
        for work_id, token in attempts:
            if self.leases is not None:
                handle = self.leases.get(category, work_id)
                if handle is not None and handle.lease_token == token:
                    handle.cancel(CancelReason.CANCELLED)
        if self.on_cancelled is not None:
            self.on_cancelled(category, attempts)

    def _answered(self, category: str, work_id: uuid.UUID) -> None:
        """The request was settled: a later tick may ask for this row again."""
        with self._requested_lock:
            self._requested.pop((category, work_id), None)

    def _refuse(self, reason: str) -> None:
        """The database refused this instance: stop renewing and say so, once."""
        if self.refused is not None:
            return
        self.refused = reason
        logger.error(
            "renew_leases refused this instance: %s; it stops",
            reason,
            extra={"action": "instance_refused"},
        )
        if self.on_refused is not None:
            self.on_refused(reason)

    def _rejected(self, item: RenewalRequest, error: Exception) -> None:
        """Drop a renewal the database refuses for its data; the lease may run out."""
        category, work_id = item.category, item.work_id
        # Still marked as asked: a later tick asks again only after the retry window.
        logger.error(
            "renewal of %s %s refused by the database (%s); dropped, asked again in %.0f s "
            "at the earliest (if it never lands, the lease runs out and the row is claimed "
            "again)",
            category,
            work_id,
            type(error).__name__,
            self.request_retry_seconds,
            extra={"action": "renewal_rejected"},
        )

    def run_once(self) -> tuple[int, int]:
        """One tick: abandon expired dispatches, request due renewals; return the counts."""
        if self.leases is None:
            return 0, 0
        expired = self.leases.expire_due()
        for handle in expired:
            if self.on_deadline is not None:
                self.on_deadline(handle)
        # Every renewal due this tick goes to the flusher at once: one flush then sends
        # one renew_leases per category, however many rows are due.
        due: list[RenewalRequest] = []
        now = self.clock.monotonic()
        with self._requested_lock:
            for handle in self.leases.handles():
                if handle.seconds_left() > self.renew_when_left or not handle.can_renew():
                    continue
                key = (handle.category, handle.work_id)
                asked_at = self._requested.get(key)
                # A request not flushed within the retry window was dropped (a full
                # buffer, an overflow on put-back): ask again rather than let it lapse.
                if asked_at is not None and now - asked_at < self.request_retry_seconds:
                    continue
                self._requested[key] = now
                due.append(RenewalRequest(*key, handle.lease_token))
        requested = self.flusher.put_many(due)
        if requested < len(due):
            with self._requested_lock:
                for category, work_id, _ in due[requested:]:
                    self._requested.pop((category, work_id), None)
        return len(expired), requested

    def run(self) -> None:
        while not self._stop.is_set():
            self.run_once()
            self._stop.wait(self.tick_seconds)

    def start(self) -> None:
        """Start the renewal flusher, then the ticking thread (once; not after stop())."""
        with self._start_lock:
            if self._thread is not None or self._stop.is_set():
                return
            self.flusher.start()
        super().start()

    def stop(self, timeout: float | None = None) -> None:
        """Stop ticking and flush the renewals still buffered (waiting up to ``timeout``,
        5 s when None); with ``timeout``, also wait that long for the ticking thread."""
        self._stop.set()
        self.flusher.stop(FINAL_FLUSH_SECONDS if timeout is None else timeout)
        if timeout is not None:
            self.join(timeout)

    def join(self, timeout: float | None = None) -> bool:
        """Wait for the ticking and flusher threads; True when neither runs."""
        ticking = super().join(timeout)
        return self.flusher.join(timeout) and ticking
