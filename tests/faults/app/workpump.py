"""Handlers of the fault-injection suite: every execution is logged in fx_execution.

The log row is written on a connection of its own, in autocommit, so it survives a handler
whose transaction is rolled back (atomic handlers) and shows even executions whose outcome
was lost. The payload steers the behaviour:

- ``seconds``: simulated work time (an Event wait, not a sleep);
- ``exit``: the process kills itself (``os._exit``) once the start is logged (poison);
- ``hang_seconds`` with ``hang_attempts``: attempts up to that number hang, deaf to the
  lease's cancellation (a hung handler);
- ``fail``: raise (a plain failing handler);
- ``flaky``: raise on attempts up to that number, then succeed;
- ``bad_error`` (``nul`` or ``surrogate``): raise with that character in the message on
  attempts up to ``fail_attempts`` (1 unless given);
- ``bad_result`` (``nul``, ``surrogate`` or ``unjson``): return that in the result.

Handlers return ``{"attempt": n, "instance": id}``, stored as the row's result.

The batch callback handlers (``fx.batch_done``, ``fx.batch_failed``) also log each
execution with the payload it got in fx_callback. ``fx.steps`` runs ``steps`` steps of
``seconds`` each, from the step its last checkpoint names, checkpointing after each; it
logs every step it starts in fx_step.
"""

from __future__ import annotations

import json
import os
import threading
from typing import Any

import psycopg
from django.db import connection, connections

import django_workpump as workpump

_pause = threading.Event()  # never set: wait() simulates work without time.sleep
# Text PostgreSQL cannot store, and a result that is not JSON.
BAD_TEXT = {"nul": "nul \x00 here", "surrogate": "lone \ud800 here"}
BAD_RESULT: dict[str, Any] = {**BAD_TEXT, "unjson": {"a", "set"}}
_log = threading.local()


def _log_connection() -> psycopg.Connection[Any]:
    conn = getattr(_log, "conn", None)
    if conn is None or conn.closed:
        params = dict(connections["default"].get_connection_params())
        for key in ("cursor_factory", "context", "prepare_threshold", "server_side_binding"):
            params.pop(key, None)
        params = {k: v for k, v in params.items() if v is not None}
        # FAULTS_LOG_DSN: a direct DSN when the pump's own connections go through a pooler.
        conninfo = os.environ.get("FAULTS_LOG_DSN") or psycopg.conninfo.make_conninfo(**params)
        conn = _log.conn = psycopg.connect(conninfo, autocommit=True, application_name="fx-log")
    return conn


def _log_sql(query: str, params: list[Any]) -> None:
    try:
        _log_connection().execute(query, params)
    except psycopg.OperationalError:
        # The log connection was killed by the test: reconnect once.
        _log.conn = None
        _log_connection().execute(query, params)


def _log_start(work: Any) -> None:
    payload = work.payload
    _log_sql(
        "INSERT INTO fx_execution (work_id, category, topic, stream, n, instance_id, pid, "
        "attempt, started_at) VALUES (%s, %s, %s, %s, %s, %s, %s, %s, clock_timestamp())",
        [
            work.id,
            work.category,
            work.topic,
            work.stream,
            payload.get("n"),
            work.instance_id,
            os.getpid(),
            work.attempts,
        ],
    )


def _log_end(work: Any, outcome: str) -> None:
    _log_sql(
        "UPDATE fx_execution SET finished_at = clock_timestamp(), outcome = %s "
        "WHERE work_id = %s AND attempt = %s AND pid = %s",
        [outcome, work.id, work.attempts, os.getpid()],
    )


def _run(work: Any) -> dict[str, Any]:
    payload = work.payload
    key = [work.id, work.attempts, os.getpid()]
    _log_start(work)
    if payload.get("exit"):
        os._exit(70)
    outcome = "done"
    try:
        if payload.get("effect"):
            # A database effect on the handler's own Django connection (in the completing
            # transaction for atomic handlers), written before the work and marked after it.
            with connection.cursor() as cursor:
                cursor.execute(
                    "INSERT INTO fx_effect (work_id, attempt, pid) VALUES (%s, %s, %s)", key
                )
        if work.attempts <= payload.get("hang_attempts", 0):
            _pause.wait(payload["hang_seconds"])  # ignores work.cancelled on purpose
        else:
            _pause.wait(payload.get("seconds", 0))
        if payload.get("fail") or work.attempts <= payload.get("flaky", 0):
            raise RuntimeError(f"fx: failing on purpose (attempt {work.attempts})")
        if payload.get("bad_error") and work.attempts <= payload.get("fail_attempts", 1):
            raise RuntimeError(f"fx: {BAD_TEXT[payload['bad_error']]} (attempt {work.attempts})")
        if payload.get("effect"):
            with connection.cursor() as cursor:
                cursor.execute(
                    "UPDATE fx_effect SET finished = true "
                    "WHERE work_id = %s AND attempt = %s AND pid = %s",
                    key,
                )
    except BaseException:
        outcome = "error"
        raise
    finally:
        _log_end(work, outcome)
    result: dict[str, Any] = {"attempt": work.attempts, "instance": str(work.instance_id)}
    if payload.get("bad_result"):
        result["bad"] = BAD_RESULT[payload["bad_result"]]
    return result


@workpump.outbox_handler("fx.outbox")
def fx_outbox(work: Any) -> dict[str, Any]:
    return _run(work)


@workpump.inbox_handler("fx.inbox")
def fx_inbox(work: Any) -> dict[str, Any]:
    return _run(work)


@workpump.perspective("fx.perspective", events=["fx.event"])
def fx_perspective(work: Any) -> dict[str, Any]:
    return _run(work)


@workpump.receptor("fx.receptor", events=["fx.event"])
def fx_receptor(work: Any) -> dict[str, Any]:
    return _run(work)


@workpump.outbox_handler("fx.steps")
def fx_steps(work: Any) -> dict[str, Any]:
    """A long import: each step checkpointed, a new attempt resumed where it stopped."""
    _log_start(work)
    outcome = "done"
    try:
        for step in range((work.state or {}).get("next", 0), work.payload["steps"]):
            _log_sql(
                "INSERT INTO fx_step (work_id, attempt, step, pid, started_at)"
                " VALUES (%s, %s, %s, %s, clock_timestamp())",
                [work.id, work.attempts, step, os.getpid()],
            )
            _pause.wait(work.payload.get("seconds", 0))
            work.checkpoint({"next": step + 1})
    except BaseException:
        outcome = "error"
        raise
    finally:
        _log_end(work, outcome)
    return {"attempt": work.attempts, "instance": str(work.instance_id)}


@workpump.outbox_handler("fx.poison", max_attempts=3)
def fx_poison(work: Any) -> dict[str, Any]:
    return _run(work)


@workpump.outbox_handler("fx.atomic", atomic=True)
def fx_atomic(work: Any) -> dict[str, Any]:
    return _run(work)


def _callback(work: Any) -> dict[str, Any]:
    _log_sql(
        "INSERT INTO fx_callback (work_id, topic, attempt, pid, payload) "
        "VALUES (%s, %s, %s, %s, %s::jsonb)",
        [work.id, work.topic, work.attempts, os.getpid(), json.dumps(work.payload)],
    )
    return _run(work)


@workpump.outbox_handler("fx.batch_done")
def fx_batch_done(work: Any) -> dict[str, Any]:
    return _callback(work)


@workpump.outbox_handler("fx.batch_failed")
def fx_batch_failed(work: Any) -> dict[str, Any]:
    return _callback(work)


# New code in a rolling deploy: only processes started with FX_NEW_CODE=1 have a handler
# for fx.v2; the others run the code from before it existed.
if os.environ.get("FX_NEW_CODE"):

    @workpump.outbox_handler("fx.v2")
    def fx_v2(work: Any) -> dict[str, Any]:
        return _run(work)
