"""What a handler receives (``Work``) and the lease an attempt holds (``Lease``).

A leaf module: it imports nothing of the pump, so ``import django_workpump`` (and the
modules that only name ``Work``) never load the engine.
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Protocol

from django_workpump.states import CancelReason, StopReason


@dataclass(frozen=True, slots=True)
class Lease:
    """One claim of one row: every write about the attempt names all three."""

    category: str
    id: uuid.UUID
    token: uuid.UUID


class LeaseView(Protocol):
    """What ``Work`` reads of its local lease (``pump.lease.LeaseHandle``)."""

    @property
    def cancelled(self) -> threading.Event: ...

    @property
    def cancel_reason(self) -> CancelReason | None: ...


@dataclass(frozen=True)
class Work:
    """What a handler receives: one claimed row and its lease."""

    id: uuid.UUID
    category: str
    topic: str
    payload: dict[str, Any]
    stream: str | None
    attempts: int
    max_attempts: int
    event_id: uuid.UUID | None
    event_type: str | None
    priority: int
    lease_expiry: datetime
    lease: LeaseView  # the attempt's local lease (a pump.lease.LeaseHandle)
    instance_id: uuid.UUID | None = None  # the instance running it
    lease_token: uuid.UUID | None = None  # the claim this attempt belongs to
    # Set when the pump begins a graceful stop (the lease is kept, and renewed, meanwhile).
    stopping: threading.Event | None = None
    # What the producer stored with the row, e.g. its trace context ("traceparent").
    headers: Mapping[str, str] | None = None

    @property
    def cancelled(self) -> bool:
        """True once the lease deadline (or the handler's timeout) passed, the row was
        cancelled by an operator, or the pump shuts down: stop early (``raise
        workpump.Release()`` hands the row back unfinished)."""
        return self.lease.cancelled.is_set() or (
            self.stopping is not None and self.stopping.is_set()
        )

    @property
    def cancel_reason(self) -> StopReason | None:
        """Why ``cancelled`` is true: ``"shutdown"``, ``"operator"``, ``"deadline"`` (the
        handler's timeout or its lease deadline) or ``"lease_lost"``; None while not."""
        return stop_reason(self.lease, self.stopping)


_STOP_REASONS = {
    CancelReason.SHUTDOWN: StopReason.SHUTDOWN,
    CancelReason.CANCELLED: StopReason.OPERATOR,
    CancelReason.DEADLINE: StopReason.DEADLINE,
    CancelReason.LOST: StopReason.LEASE_LOST,
}


def stop_reason(handle: LeaseView, stopping: threading.Event | None) -> StopReason | None:
    """Why an attempt was told to stop (``Work.cancel_reason``), or None."""
    reason = handle.cancel_reason
    if reason in _STOP_REASONS:
        return _STOP_REASONS[reason]
    if stopping is not None and stopping.is_set():
        return StopReason.SHUTDOWN
    # Disposed: the dispatch let go of the row while the handler still ran.
    return None if reason is None else StopReason.LEASE_LOST
