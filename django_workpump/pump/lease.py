"""Local leases: one deadline per in-flight dispatch, and the registry that finds them.

The database owns the real lease; a ``LeaseHandle`` is the worker's local view of it, set a
grace period short of the database's expiry, so the worker gives up before the row can be
re-claimed elsewhere.
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Callable

from django_workpump.clock import Clock
from django_workpump.states import CancelReason
from django_workpump.work import Lease

_REASONS: frozenset[str] = frozenset(CancelReason)

LeaseKey = tuple[str, uuid.UUID]


class DuplicateLease(ValueError):
    """Signal that a (category, work id) was registered while already in flight."""


class LeaseHandle:
    """Track the local deadline, renewals and cancellation of one in-flight dispatch."""

    def __init__(
        self,
        category: str,
        work_id: uuid.UUID,
        deadline: float,
        max_renewals: int,
        clock: Clock,
        *,
        lease_token: uuid.UUID | None = None,
        hard_deadline: float | None = None,
        charged: bool = True,
        timeout: float | None = None,
    ) -> None:
        if max_renewals < 0:
            raise ValueError(f"max_renewals ({max_renewals}) must be zero or more.")
        self.category = category
        self.work_id = work_id
        # The claim's token: renewals and outcomes of this dispatch name it, so the
        # database tells this attempt from any other of the same row.
        self.lease_token = lease_token
        self.max_renewals = max_renewals
        # The end of the handler's own timeout (monotonic): renewals never move the
        # deadline past it. None: only the lease settings bound the dispatch.
        self.hard_deadline = hard_deadline
        self.cancelled = threading.Event()
        self._clock = clock
        self._lock = threading.Lock()
        self._deadline = deadline if hard_deadline is None else min(deadline, hard_deadline)
        self._renewal_count = 0
        # A row waiting behind others of its stream's run is renewed without counting
        # against the cap until it starts (start_charging): only running time is capped.
        self._charged = charged
        # Such a row's own timeout (seconds) starts when it starts, not at the claim.
        self._timeout_from_start = None if charged else timeout
        self._cancel_reason: CancelReason | None = None
        self._overdue_reported = False  # a cancelled handle past its deadline, reported
        self._disposed = False
        self._on_dispose: Callable[[LeaseHandle], object] | None = None
        # A row claimed with too little lease left must not start work it cannot finish.
        self._expire()

    def __repr__(self) -> str:
        return f"<LeaseHandle {self.category} {self.work_id} renewals={self._renewal_count}>"

    @property
    def lease(self) -> Lease | None:
        """The claim this handle renews and fences by; None when it has no token."""
        if self.lease_token is None:
            return None
        return Lease(self.category, self.work_id, self.lease_token)

    @property
    def key(self) -> LeaseKey:
        """Return the registry key (category, work id)."""
        return (self.category, self.work_id)

    @property
    def deadline(self) -> float:
        """Return the local deadline on the clock's monotonic scale."""
        with self._lock:
            return self._deadline

    @property
    def renewal_count(self) -> int:
        """Return how many renewals the database has confirmed."""
        with self._lock:
            return self._renewal_count

    @property
    def cancel_reason(self) -> CancelReason | None:
        """Return why the handle was cancelled, or None while it is live."""
        with self._lock:
            return self._cancel_reason

    @property
    def disposed(self) -> bool:
        """Return whether the dispatch has let go of the handle."""
        with self._lock:
            return self._disposed

    def seconds_left(self) -> float:
        """Return the seconds until the deadline (negative once past)."""
        with self._lock:
            return self._deadline - self._clock.monotonic()

    @property
    def timed_out(self) -> bool:
        """Whether the handler's own timeout (not the lease) ended the dispatch."""
        with self._lock:
            return (
                self._cancel_reason == CancelReason.DEADLINE
                and self.hard_deadline is not None
                and self._deadline >= self.hard_deadline
            )

    def can_renew(self) -> bool:
        """Return whether a renewal may still be asked of the database."""
        with self._lock:
            return self._renewable_locked()

    def confirm_renewal(self, new_deadline: float) -> bool:
        """Move the deadline after the database confirmed a renewal; return False if refused."""
        with self._lock:
            if self.hard_deadline is not None:
                new_deadline = min(new_deadline, self.hard_deadline)
            if not self._renewable_locked() or new_deadline <= self._clock.monotonic():
                return False
            self._deadline = new_deadline
            if self._charged:
                self._renewal_count += 1
            return True

    def start_charging(self) -> None:
        """The row starts running: from now on its renewals count against the cap."""
        with self._lock:
            self._charged = True
            if self._timeout_from_start is not None:
                self.hard_deadline = self._clock.monotonic() + self._timeout_from_start
                self._deadline = min(self._deadline, self.hard_deadline)
                self._timeout_from_start = None

    def check_deadline(self) -> bool:
        """Cancel the handle if its deadline has come; return whether it is cancelled."""
        self._expire()
        return self.cancelled.is_set()

    def cancel(self, reason: CancelReason | str) -> None:
        """Cancel the handle; the first reason given is the one kept."""
        if reason not in _REASONS:
            raise ValueError(
                f"Cancel reason {reason!r} must be one of {sorted(map(str, _REASONS))}."
            )
        with self._lock:
            self._cancel_locked(CancelReason(reason))

    def dispose(self) -> None:
        """Release the handle: cancel it if still live and drop it from its registry."""
        with self._lock:
            if self._disposed:
                return
            self._disposed = True
            self._cancel_locked(CancelReason.DISPOSED)
            callback, self._on_dispose = self._on_dispose, None
        # Outside the handle lock: the registry takes its own lock, and it takes them in the
        # order registry -> handle elsewhere.
        if callback is not None:
            callback(self)

    def _attach(self, callback: Callable[[LeaseHandle], object]) -> bool:
        """Set the disposal callback; return False if the handle is already disposed."""
        with self._lock:
            if self._disposed:
                return False
            self._on_dispose = callback
            return True

    def _expire(self) -> bool:
        """Cancel by deadline if due; return True only if this call cancelled it."""
        with self._lock:
            if self._cancel_reason is None and self._clock.monotonic() >= self._deadline:
                return self._cancel_locked(CancelReason.DEADLINE)
            return False

    def _cancelled_overdue(self) -> bool:
        """True once for a handle an operator cancelled that is still in flight at its
        deadline: its handler ignored ``work.cancelled`` and must be abandoned."""
        with self._lock:
            if (
                self._cancel_reason == CancelReason.CANCELLED
                and not self._overdue_reported
                and not self._disposed
                and self._clock.monotonic() >= self._deadline
            ):
                self._overdue_reported = True
                return True
            return False

    def _renewable_locked(self) -> bool:
        return (
            not self._disposed
            and self._cancel_reason is None
            and (not self._charged or self._renewal_count < self.max_renewals)
            and (self.hard_deadline is None or self._deadline < self.hard_deadline)
        )

    def _cancel_locked(self, reason: CancelReason) -> bool:
        if self._cancel_reason is not None:
            return False
        self._cancel_reason = reason
        self.cancelled.set()
        return True


class LeaseRegistry:
    """Map (category, work id) to the handle of its in-flight dispatch."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._handles: dict[LeaseKey, LeaseHandle] = {}

    def __len__(self) -> int:
        with self._lock:
            return len(self._handles)

    def register(self, handle: LeaseHandle) -> None:
        """Add a handle; raise DuplicateLease if its key is already in flight."""
        with self._lock:
            current = self._handles.get(handle.key)
            if current is not None:
                raise DuplicateLease(
                    f"Lease {handle.category} {handle.work_id} is already in flight: the same "
                    f"row claimed twice in flight means claiming or disposal is broken."
                )
            if not handle._attach(self.discard):
                raise ValueError(
                    f"Lease {handle.category} {handle.work_id} is already disposed; register "
                    f"a handle before its dispatch runs."
                )
            self._handles[handle.key] = handle

    def discard(self, handle: LeaseHandle) -> bool:
        """Drop the handle if it is the one stored under its key; return whether it was."""
        with self._lock:
            # Identity, not key: a late dispose of an abandoned handle must not drop the
            # handle of the row's next claim.
            if self._handles.get(handle.key) is handle:
                del self._handles[handle.key]
                return True
            return False

    def get(self, category: str, work_id: uuid.UUID) -> LeaseHandle | None:
        """Return the handle in flight for (category, work id), if any."""
        with self._lock:
            return self._handles.get((category, work_id))

    def handles(self) -> list[LeaseHandle]:
        """Return a snapshot of the registered handles."""
        with self._lock:
            return list(self._handles.values())

    def expire_due(self) -> list[LeaseHandle]:
        """Cancel handles whose deadline has come; return those cancelled by this call,
        and those an operator cancelled that are still in flight at their deadline."""
        # Check on a snapshot so no handle lock is taken under the registry lock from here.
        return [
            handle for handle in self.handles() if handle._expire() or handle._cancelled_overdue()
        ]

    def cancel_all(self, reason: CancelReason = CancelReason.SHUTDOWN) -> None:
        """Cancel every registered handle (they stay registered until disposed)."""
        for handle in self.handles():
            handle.cancel(reason)
