"""Waiting for rows to end: ``workpump.wait`` and ``await workpump.await_work``.

A row has ended once it is done, discarded, cancelled or dead (a dead row runs again
only if an operator re-queues it). Every function that ends rows notifies the channel
``workpump_done`` at commit with their ids (``workpump.notify_ended``); the waiter
LISTENs on its own connection, and reads the rows again when a notification names one
it waits for, or when ``poll_seconds`` passed without one (a notification is a hint,
and a row ended by hand through SQL notifies no one). Between wake-ups it blocks on the
socket: no busy loop.

The waiter reads on its own connection, so it sees committed rows only: wait after the
transaction that sent the work has committed.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import psycopg
from psycopg import sql

from django_workpump.conf import setting
from django_workpump.db.waiting import DONE_CHANNEL, outcomes_params
from django_workpump.payloads import decode_or_stored
from django_workpump.states import WorkState

# The states in which a row has ended, for a waiter.
FINISHED_STATES = frozenset(
    {WorkState.DONE, WorkState.DEAD, WorkState.DISCARDED, WorkState.CANCELLED}
)
# How long a waiter waits for a notification before it reads the rows anyway.
DEFAULT_POLL_SECONDS = 1.0


@dataclass(frozen=True)
class WorkOutcome:
    """How one row stands (``wait`` returns only ended ones): its state, its handler's
    result (done rows), and the last error and failure reason (dead, discarded and
    cancelled rows; a done row may keep an earlier attempt's error)."""

    id: uuid.UUID
    category: str
    state: WorkState
    result: Any = None
    last_error: str | None = None
    failure_reason: str | None = None
    ended_at: datetime | None = None

    @property
    def ended(self) -> bool:
        return self.state in FINISHED_STATES

    @property
    def succeeded(self) -> bool:
        return self.state == WorkState.DONE


class UnknownWork(LookupError):
    """``wait`` was given ids of no (committed) work row; ``ids`` names them."""

    def __init__(self, ids: Sequence[uuid.UUID]) -> None:
        shown = ", ".join(str(i) for i in ids[:10]) + (" ..." if len(ids) > 10 else "")
        super().__init__(
            f"No work row has the id {shown}: pass the ids send() returned, after the "
            "transaction that sent them committed (the waiter reads committed rows only); "
            "an ended row may also have been purged by retention."
        )
        self.ids = list(ids)


class WaitTimeout(TimeoutError):
    """``wait`` timed out: ``pending`` are the ids that had not ended, ``outcomes`` the
    rows that had."""

    def __init__(self, pending: Sequence[uuid.UUID], outcomes: dict[uuid.UUID, WorkOutcome]):
        shown = ", ".join(str(i) for i in pending[:10]) + (" ..." if len(pending) > 10 else "")
        super().__init__(f"{len(pending)} work rows had not ended when the wait timed out: {shown}")
        self.pending = list(pending)
        self.outcomes = outcomes


class _Waiting:
    """What one wait knows: the ids asked for, the rows that ended, those still pending."""

    def __init__(self, ids: Iterable[uuid.UUID | str], categories: Sequence[str] | None) -> None:
        try:
            self.ids = list(dict.fromkeys(uuid.UUID(str(i)) for i in ids))
        except ValueError as exc:
            raise ValueError(f"wait() takes work ids (UUIDs): {exc}") from None
        self.categories = list(categories) if categories else None
        self.outcomes: dict[uuid.UUID, WorkOutcome] = {}
        self.pending = set(self.ids)
        self.read_once = False

    def query(self) -> tuple[str, dict[str, Any]]:
        return outcomes_params([i for i in self.ids if i in self.pending], self.categories)

    def take(self, rows: list[tuple[Any, ...]]) -> None:
        """Take the rows read; raise UnknownWork for ids that named none."""
        seen: dict[uuid.UUID, str] = {}
        for work_id, category, state, result, last_error, reason, ended_at in rows:
            if work_id in seen:
                raise ValueError(
                    f"The id {work_id} names a {seen[work_id]} row and a {category} row: "
                    "pass categories=[...] to say which one to wait for."
                )
            seen[work_id] = category
            outcome = WorkOutcome(
                work_id,
                category,
                WorkState(state),
                None if result is None else decode_or_stored(result),
                last_error,
                reason,
                ended_at,
            )
            if outcome.ended:
                self.outcomes[work_id] = outcome
                self.pending.discard(work_id)
        missing = [i for i in self.ids if i in self.pending and i not in seen]
        if missing:
            raise UnknownWork(missing)
        self.read_once = True

    def concerns(self, payload: str) -> bool:
        """Whether a workpump_done payload may name a pending row (anything unexpected
        does: the rows are read again, which is all a hint can cause)."""
        if payload == "*":
            return True
        for text in payload.split(","):
            try:
                if uuid.UUID(text) in self.pending:
                    return True
            except ValueError:
                return True
        return False

    def result(self) -> dict[uuid.UUID, WorkOutcome]:
        return {i: self.outcomes[i] for i in self.ids if i in self.outcomes}

    def timed_out(self) -> WaitTimeout:
        return WaitTimeout([i for i in self.ids if i in self.pending], self.result())


def _conninfo(using: str | None) -> str:
    from django_workpump.pump.supervisor import listen_conninfo

    alias = using or setting("DATABASE_ALIAS")
    return listen_conninfo({"LISTEN_DSN": setting("LISTEN_DSN"), "DATABASE_ALIAS": alias})


def _check(timeout: float | None, poll_seconds: float) -> None:
    if timeout is not None and timeout < 0:
        raise ValueError(f"wait() needs timeout >= 0 seconds (or None: no limit), not {timeout}.")
    if poll_seconds <= 0:
        raise ValueError(f"wait() needs poll_seconds > 0, not {poll_seconds}.")


def _left(deadline: float | None, next_read: float) -> float:
    return max(
        0.0, min(next_read, deadline if deadline is not None else next_read) - time.monotonic()
    )


def wait(
    ids: Iterable[uuid.UUID | str],
    *,
    timeout: float | None = None,
    poll_seconds: float = DEFAULT_POLL_SECONDS,
    categories: Sequence[str] | None = None,
    using: str | None = None,
) -> dict[uuid.UUID, WorkOutcome]:
    """Block until every row ``ids`` names has ended (done, dead, discarded or
    cancelled); return ``{id: WorkOutcome}`` in the order of ``ids``.

    Woken by NOTIFY on ``workpump_done``, and reads the rows every ``poll_seconds``
    anyway. ``timeout`` (seconds; None: no limit) raises ``WaitTimeout`` naming the ids
    still pending (its ``outcomes`` has the rows that ended). Ids of no committed row
    raise ``UnknownWork``. ``categories`` limits where the ids are looked up (all four
    when None). Runs on a connection of its own to the ``using`` alias's database
    (``LISTEN_DSN`` when set), opened for the call.
    """
    _check(timeout, poll_seconds)
    waiting = _Waiting(ids, categories)
    if not waiting.ids:
        return {}
    deadline = None if timeout is None else time.monotonic() + timeout
    with psycopg.connect(_conninfo(using), autocommit=True) as conn:
        conn.execute(sql.SQL("LISTEN {}").format(sql.Identifier(DONE_CHANNEL)))
        while True:
            # Read after LISTEN: a row ending from now on notifies this session.
            waiting.take(conn.execute(*waiting.query()).fetchall())
            if not waiting.pending:
                return waiting.result()
            if deadline is not None and time.monotonic() >= deadline:
                raise waiting.timed_out()
            next_read = time.monotonic() + poll_seconds
            while time.monotonic() < next_read and (
                deadline is None or time.monotonic() < deadline
            ):
                # Read to its end: the generator holds the connection while it lives.
                arrived = list(conn.notifies(timeout=_left(deadline, next_read), stop_after=1))
                if any(waiting.concerns(n.payload) for n in arrived):
                    break


async def await_work(
    ids: Iterable[uuid.UUID | str],
    *,
    timeout: float | None = None,
    poll_seconds: float = DEFAULT_POLL_SECONDS,
    categories: Sequence[str] | None = None,
    using: str | None = None,
) -> dict[uuid.UUID, WorkOutcome]:
    """``wait`` for coroutines: the same arguments, outcomes and errors, on an async
    psycopg connection of its own (the event loop runs meanwhile)."""
    _check(timeout, poll_seconds)
    waiting = _Waiting(ids, categories)
    if not waiting.ids:
        return {}
    deadline = None if timeout is None else time.monotonic() + timeout
    conn = await psycopg.AsyncConnection.connect(_conninfo(using), autocommit=True)
    async with conn:
        await conn.execute(sql.SQL("LISTEN {}").format(sql.Identifier(DONE_CHANNEL)))
        while True:
            cursor = await conn.execute(*waiting.query())
            waiting.take(await cursor.fetchall())
            if not waiting.pending:
                return waiting.result()
            if deadline is not None and time.monotonic() >= deadline:
                raise waiting.timed_out()
            next_read = time.monotonic() + poll_seconds
            woken = False
            while (
                not woken
                and time.monotonic() < next_read
                and (deadline is None or time.monotonic() < deadline)
            ):
                async for notify in conn.notifies(timeout=_left(deadline, next_read), stop_after=1):
                    woken = woken or waiting.concerns(notify.payload)
