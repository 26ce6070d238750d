"""What a handler receives (``Work``) and the lease an attempt holds (``Lease``).

A leaf module: it imports nothing of the pump, so ``import django_workpump`` (and the
modules that only name ``Work``) never load the engine.
"""

from __future__ import annotations

import json
import threading
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Protocol

from django_workpump.states import CancelReason, StopReason


class LeaseLost(Exception):
    """The attempt no longer holds its row (its lease expired and the row was claimed
    again, it was cancelled, or its holder was evicted), so what it would write about
    the row is refused: an atomic handler's completion, or a ``work.checkpoint``.

    Raised out of a handler, it ends the attempt without an outcome (the newer attempt
    owns the row), and rolls back an atomic handler's transaction. ``rows``: how many
    rows' leases were lost (an atomic batch may lose several).
    """

    def __init__(self, message: str, rows: int = 1) -> None:
        super().__init__(message)
        self.rows = rows


class InvalidCheckpoint(ValueError):
    """A ``work.checkpoint`` state that cannot be stored: not JSON, or not storable."""


class CheckpointTooLarge(InvalidCheckpoint):
    """A ``work.checkpoint`` state over ``WORKPUMP['MAX_CHECKPOINT_BYTES']``."""


def checkpoint_text(state: Any, max_bytes: int, what: str) -> str | None:
    """The JSON text of a checkpoint state (None for None); raise InvalidCheckpoint when
    it is not JSON or not storable, CheckpointTooLarge over ``max_bytes`` (UTF-8)."""
    if state is None:
        return None
    try:
        # PostgreSQL's jsonb prints with these separators, unescaped: the same size.
        text = json.dumps(state, allow_nan=False, ensure_ascii=False)
        size = len(text.encode("utf-8"))
    except (TypeError, ValueError, RecursionError) as exc:  # UnicodeEncodeError too
        raise InvalidCheckpoint(
            f"The checkpoint of {what} is not storable JSON ({type(exc).__name__}: {exc}); "
            "pass dicts with string keys, lists, strings, finite numbers, booleans, None."
        ) from exc
    if "\\u0000" in text:
        raise InvalidCheckpoint(
            f"The checkpoint of {what} holds a NUL character, which PostgreSQL's jsonb "
            "cannot store; leave it out or encode it."
        )
    if size > max_bytes:
        raise CheckpointTooLarge(
            f"The checkpoint of {what} is {size} bytes of JSON, over the limit of "
            f"{max_bytes} (WORKPUMP['MAX_CHECKPOINT_BYTES']): checkpoint a small state (a "
            "cursor, an offset, the ids done) and keep bulk data in your own tables."
        )
    return text


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
    # The last checkpoint stored for the row (by an earlier attempt): resume from it.
    state: Any = None
    # Stores a checkpoint for this attempt (the pump's; None outside a pump).
    checkpointer: Callable[[Work, Any], None] | None = None

    def checkpoint(self, state: Any) -> None:
        """Store ``state`` (small JSON; None clears it) as this row's checkpoint: the
        row's next attempt starts with ``work.state`` equal to it.

        Fenced by this attempt's lease: once another attempt holds the row (or the row
        ended) nothing is written and ``LeaseLost`` is raised. In an ``atomic=True``
        handler the checkpoint commits, or rolls back, with the handler's transaction;
        otherwise it commits at once (inside a transaction the handler opened, with
        that). Raises ``CheckpointTooLarge`` over ``WORKPUMP['MAX_CHECKPOINT_BYTES']``
        and ``InvalidCheckpoint`` for a state that is not JSON. From a coroutine, await
        ``acheckpoint``.
        """
        if self.checkpointer is None:
            raise RuntimeError(
                f"{self.category} {self.id} has no pump to store its checkpoint: "
                "checkpoint from a handler the pump (or workpump.testing) runs."
            )
        self.checkpointer(self, state)

    async def acheckpoint(self, state: Any) -> None:
        """``checkpoint`` from an async handler: runs on the handler's thread and its
        connection (so inside an atomic handler's transaction)."""
        from asgiref.sync import sync_to_async

        await sync_to_async(self.checkpoint, thread_sensitive=True)(state)

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
