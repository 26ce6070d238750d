"""Handlers for the multi-process tests: each execution is recorded in mp_execution.

The table is created by the tests that produce mp.* work; no other test produces it.
"""

from __future__ import annotations

import os
import threading
from typing import Any

from django.db import connection

import django_workpump as workpump

_pause = threading.Event()  # never set: wait() simulates work without time.sleep
_instances_met = threading.Event()  # _await_instances' condition held once


def _record(work: Any) -> None:
    with connection.cursor() as cursor:
        cursor.execute(
            "INSERT INTO mp_execution (work_id, category, stream, n, pid, attempt, started_at) "
            "VALUES (%s, %s, %s, %s, %s, %s, clock_timestamp())",
            [
                work.id,
                work.category,
                work.stream,
                work.payload.get("n"),
                os.getpid(),
                work.attempts,
            ],
        )
    _await_instances(work.payload.get("instances", 0))
    _pause.wait(work.payload.get("seconds", 0))
    with connection.cursor() as cursor:
        cursor.execute(
            "UPDATE mp_execution SET finished_at = clock_timestamp() "
            "WHERE work_id = %s AND pid = %s AND attempt = %s",
            [work.id, os.getpid(), work.attempts],
        )


def _await_instances(wanted: int, timeout: float = 30.0) -> None:
    """Hold the row until ``wanted`` processes have started a row (or ``timeout``).

    A process that starts a moment after another (a busy machine) still finds a share of
    the backlog: the first one's rows wait for it instead of draining everything. The
    condition is a started row, not a registered instance: a process can register and
    then take seconds to claim on a loaded machine, long enough for its peer to drain
    alone. Once met, never again: a peer that drained its share and deregistered must not
    hold up every later row.
    """
    if not wanted or _instances_met.is_set():
        return
    for _ in range(int(timeout / 0.02)):
        with connection.cursor() as cursor:
            cursor.execute("SELECT count(DISTINCT pid) >= %s FROM mp_execution", [wanted])
            if cursor.fetchone()[0]:
                _instances_met.set()
                return
        _pause.wait(0.02)


@workpump.outbox_handler("mp.outbox")
def mp_outbox(work: Any) -> None:
    _record(work)


@workpump.inbox_handler("mp.inbox")
def mp_inbox(work: Any) -> None:
    _record(work)


@workpump.perspective("mp.perspective", events=["mp.event"])
def mp_perspective(work: Any) -> None:
    _record(work)


@workpump.receptor("mp.receptor", events=["mp.event"])
def mp_receptor(work: Any) -> None:
    _record(work)


class Halt(BaseException):
    """A BaseException of the handler's own, outside the Exception tree."""


# What mp.raise raises, by the payload's "raise" key.
RAISES: dict[str, type[BaseException]] = {
    "SystemExit": SystemExit,
    "KeyboardInterrupt": KeyboardInterrupt,
    "Halt": Halt,
}


@workpump.outbox_handler("mp.raise", max_attempts=2)
def mp_raise(work: Any) -> None:
    raise RAISES[work.payload["raise"]]("raised by mp.raise")


@workpump.outbox_handler("mp.member")
def mp_member(work: Any) -> None:
    _record(work)


@workpump.outbox_handler("mp.batch_done")
def mp_batch_done(work: Any) -> None:
    _record(work)
