"""Outcomes PostgreSQL cannot store: NUL, lone surrogates, results that are not JSON.

Such an outcome used to fail its whole batch of completions (or failures) on every flush:
every other outcome queued behind it and ``--drain`` never ended. Now the text is made
storable before it is written, and a batch the database still refuses is split so the
good outcomes land and the bad one takes a safe path.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable
from typing import Any

import psycopg
import pytest
from django.db import connection
from django.test import override_settings

import django_workpump as workpump
from django_workpump import models
from django_workpump.pump.coordinator import DatabaseCoordinator, InstanceIdentity
from django_workpump.pump.dispatch import Dispatcher
from django_workpump.pump.lease import LeaseRegistry
from django_workpump.pump.outcomes import Completion, FailedAttempt
from django_workpump.pump.renewal import LeaseRenewalWorker
from django_workpump.pump.supervisor import EXIT_OK
from django_workpump.registry import Registry
from django_workpump.storable import (
    NOTE_KEY,
    ascii_text,
    error_headline,
    error_text,
    is_transient,
    storable_result,
    storable_text,
)
from django_workpump.work import Lease
from tests.helpers import FAST_PUMP, drain

FAST = {**FAST_PUMP, "CONCURRENCY": 3}
NOTE_1 = "[workpump: 1 character PostgreSQL cannot store (NUL or lone surrogate) replaced"


# -- making outcomes storable (no database) ----------------------------------------------


def test_storable_text_replaces_nul_and_surrogates_and_says_so():
    assert storable_text("plain \u00e9 \U0001f600") == "plain \u00e9 \U0001f600"
    assert storable_text("a\x00b") == f"a\ufffdb {NOTE_1} with U+FFFD]"
    assert storable_text("\ud800x\udfff").endswith(
        "2 characters PostgreSQL cannot store (NUL or lone surrogate) replaced with U+FFFD]"
    )
    assert storable_text("\ud800x\udfff").startswith("\ufffdx\ufffd [workpump:")


def test_storable_result_keeps_json_and_replaces_bad_characters_inside_strings():
    warnings: list[str] = []
    assert storable_result({"a": [1, "ok \U0001f600"]}, warnings.append) == json.dumps(
        {"a": [1, "ok \U0001f600"]}
    )
    assert storable_result(None) is None
    assert warnings == []

    text = storable_result({"k\x00": ["x\x00", {"y": "\udc80"}], "n": 1.5}, warnings.append)
    assert json.loads(text) == {"k\ufffd": ["x\ufffd", {"y": "\ufffd"}], "n": 1.5}
    assert warnings == [
        "3 characters of its result PostgreSQL cannot store (NUL or lone surrogate) "
        "replaced with U+FFFD"
    ]


@pytest.mark.parametrize(
    ("result", "why"),
    [({"s": {1, 2}}, "TypeError"), ({"x": float("nan")}, "ValueError"), (object(), "TypeError")],
    ids=["set", "nan", "object"],
)
def test_a_result_that_is_not_json_becomes_a_note(result, why):
    warnings: list[str] = []
    note = json.loads(storable_result(result, warnings.append))
    assert list(note) == [NOTE_KEY]
    assert note[NOTE_KEY].startswith(f"The handler's result was not stored: it is not JSON ({why}")
    assert note[NOTE_KEY].endswith("finite numbers, booleans, None).")
    assert len(warnings) == 1


def test_only_connection_errors_are_transient():
    from django import db

    assert is_transient(db.OperationalError("server closed the connection"))
    assert is_transient(db.InterfaceError("connection already closed"))
    assert is_transient(psycopg.OperationalError("consuming input failed"))
    for permanent in (
        db.DataError("unsupported Unicode escape sequence"),
        db.IntegrityError("null value"),
        db.ProgrammingError("function does not exist"),
        psycopg.DataError("PostgreSQL text fields cannot contain NUL (0x00) bytes"),
        UnicodeEncodeError("utf-8", "\ud800", 0, 1, "surrogates not allowed"),
        ValueError("NUL"),
    ):
        assert not is_transient(permanent), permanent


def test_ascii_text_is_plain_printable_ascii():
    assert ascii_text("caf\u00e9 \x00 \ud800") == "caf\\xe9 ? ?"


# -- the pump end to end, in process -----------------------------------------------------


@pytest.mark.django_db(transaction=True)
@override_settings(WORKPUMP=FAST)
def test_unstorable_results_and_errors_are_settled_and_every_good_row_completes(
    outbox_handler, pump
):
    def good(work: Any) -> dict[str, Any]:
        return {"n": work.payload["n"]}

    def nul_result(work: Any) -> dict[str, Any]:
        return {"n": work.payload["n"], "text": "a\x00b"}

    def surrogate_result(work: Any) -> dict[str, Any]:
        return {"text": "lone \ud800"}

    def not_json(work: Any) -> dict[str, Any]:
        return {"ids": {1, 2}}

    def nul_error(work: Any) -> None:
        raise RuntimeError("bad \x00 byte")

    def surrogate_error(work: Any) -> None:
        raise ValueError("lone \udc80 surrogate")

    outbox_handler("uo.good", good)
    outbox_handler("uo.nul_result", nul_result)
    outbox_handler("uo.surrogate_result", surrogate_result)
    outbox_handler("uo.not_json", not_json)
    outbox_handler("uo.nul_error", nul_error, max_attempts=1)
    outbox_handler("uo.surrogate_error", surrogate_error, max_attempts=1)
    good_ids = []
    for n in range(30):
        good_ids.append(workpump.send("uo.good", {"n": n}, stream=f"s{n % 3}"))
        if n % 10 == 5:
            for topic in ("uo.nul_result", "uo.surrogate_result", "uo.not_json"):
                workpump.send(topic, {"n": n}, stream=f"s{n % 3}")
            for topic in ("uo.nul_error", "uo.surrogate_error"):
                workpump.send(topic, {"n": n})

    assert drain(pump(drain=True), timeout=30) == EXIT_OK

    rows = {row.work_id: row for row in models.Outbox.objects.all()}
    assert [rows[i].result for i in good_ids] == [{"n": n} for n in range(30)]
    assert all(rows[i].attempts == 1 for i in good_ids)  # every good row ran once
    by_topic: dict[str, list[models.Outbox]] = {}
    for row in rows.values():
        by_topic.setdefault(row.topic, []).append(row)
    assert {r.result["text"] for r in by_topic["uo.nul_result"]} == {"a\ufffdb"}
    assert {r.result["text"] for r in by_topic["uo.surrogate_result"]} == {"lone \ufffd"}
    assert all(r.done_at is not None for r in by_topic["uo.not_json"])
    assert all("not JSON (TypeError" in r.result[NOTE_KEY] for r in by_topic["uo.not_json"])
    for topic, text in (
        ("uo.nul_error", "RuntimeError: bad \ufffd byte"),
        ("uo.surrogate_error", "ValueError: lone \ufffd surrogate"),
    ):
        for row in by_topic[topic]:
            assert row.dead_lettered_at is not None and row.failure_reason == "max_attempts"
            # the exception line leads, then the trace: the bad character is in both
            assert row.last_error.startswith(text)
            assert "2 characters PostgreSQL cannot store" in row.last_error


# -- the flushers on the database: what gets past the sanitizing is split around ----------


@pytest.fixture
def held() -> Callable[
    [int], tuple[DatabaseCoordinator, list[uuid.UUID], dict[uuid.UUID, uuid.UUID]]
]:
    """A registered instance holding ``count`` claimed outbox rows, and their lease tokens."""

    def claim(
        count: int,
    ) -> tuple[DatabaseCoordinator, list[uuid.UUID], dict[uuid.UUID, uuid.UUID]]:
        coordinator = DatabaseCoordinator(InstanceIdentity())
        assert coordinator.heartbeat({})
        ids = [workpump.send("uo.raw", {"n": n}) for n in range(count)]
        claimed = coordinator.claim(count)
        assert sorted(r.work_id for r in claimed) == sorted(ids)
        return coordinator, ids, {r.work_id: r.lease_token for r in claimed}

    return claim


def make_dispatcher(coordinator: DatabaseCoordinator) -> Dispatcher:
    return Dispatcher(coordinator, Registry(), LeaseRegistry())


@pytest.mark.django_db(transaction=True)
def test_a_completion_the_database_refuses_is_completed_with_a_note_and_the_batch_lands(held):
    coordinator, ids, tokens = held(6)
    dispatcher = make_dispatcher(coordinator)
    results = [json.dumps({"n": n}) for n in range(6)]
    results[2] = '{"text": "a\\u0000b"}'  # jsonb refuses it: \u0000 cannot be text
    results[4] = '"lone \ud800"'  # psycopg cannot even encode it
    for work_id, result in zip(ids, results, strict=True):
        dispatcher.completions.put(Completion(Lease("outbox", work_id, tokens[work_id]), result))

    assert dispatcher.completions.flush_once() == 6

    rows = {r.work_id: r for r in models.Outbox.objects.all()}
    assert all(rows[i].done_at is not None for i in ids)  # every row completed
    assert [rows[ids[n]].result for n in (0, 1, 3, 5)] == [{"n": n} for n in (0, 1, 3, 5)]
    assert "the database refused it (DataError" in rows[ids[2]].result[NOTE_KEY]
    assert "the database refused it (UnicodeEncodeError" in rows[ids[4]].result[NOTE_KEY]
    assert len(dispatcher.completions) == 0
    assert dispatcher.completions.rejected_items == 2
    assert dispatcher.stats.completed == 6


@pytest.mark.django_db(transaction=True)
def test_a_failure_the_database_refuses_is_recorded_as_plain_ascii_and_the_batch_lands(held):
    coordinator, ids, tokens = held(4)
    dispatcher = make_dispatcher(coordinator)
    errors = ["plain error 0", "nul \x00 error", "lone \udfff error", "plain error 3"]
    for work_id, error in zip(ids, errors, strict=True):
        dispatcher.failures.put(
            FailedAttempt(Lease("outbox", work_id, tokens[work_id]), error, "handler_error")
        )

    assert dispatcher.failures.flush_once() == 4

    rows = {r.work_id: r for r in models.Outbox.objects.all()}
    assert [rows[i].last_error for i in ids] == [
        "plain error 0",
        "nul ? error",
        "lone ? error",
        "plain error 3",
    ]
    assert all(rows[i].instance_id is None for i in ids)  # every attempt ended
    assert dispatcher.failures.rejected_items == 2
    assert dispatcher.stats.failed == 4


@pytest.mark.django_db(transaction=True)
def test_a_renewal_the_database_refuses_is_dropped_and_the_others_are_renewed(held):
    coordinator, ids, tokens = held(3)
    before = dict(models.Outbox.objects.values_list("work_id", "lease_expiry"))
    worker = LeaseRenewalWorker(coordinator, None)
    worker.enqueue("outbox", ids[0], tokens[ids[0]])
    # workpump.renew_leases raises 22023
    worker.enqueue("no-such-category", ids[1], tokens[ids[1]])
    worker.enqueue("outbox", ids[2], tokens[ids[2]])

    assert worker.flusher.flush_once() == 3

    after = dict(models.Outbox.objects.values_list("work_id", "lease_expiry"))
    assert after[ids[0]] > before[ids[0]] and after[ids[2]] > before[ids[2]]
    assert after[ids[1]] == before[ids[1]]
    assert worker.renewed == 2
    assert worker.flusher.rejected_items == 1 and len(worker.flusher) == 0


@pytest.mark.django_db(transaction=True)
def test_a_completion_whose_connection_was_killed_is_retried_on_a_new_one(held, raw_connect):
    coordinator, ids, tokens = held(2)
    dispatcher = make_dispatcher(coordinator)
    for work_id in ids:
        dispatcher.completions.put(Completion(Lease("outbox", work_id, tokens[work_id])))
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_backend_pid()")
        pid = cursor.fetchone()[0]
    raw_connect().execute("SELECT pg_terminate_backend(%s)", [pid])

    assert dispatcher.completions.flush_once() == 0  # a connection error: put back, no split
    assert len(dispatcher.completions) == 2
    assert dispatcher.completions.rejected_items == 0
    assert dispatcher.completions.health().last_error.startswith("OperationalError")

    assert dispatcher.completions.flush_once() == 2  # the next call reconnects
    assert models.Outbox.objects.filter(done_at__isnull=False).count() == 2


@pytest.mark.django_db(transaction=True)
def test_a_stalled_flusher_shows_in_the_heartbeat_and_in_workpump_status(held):
    from django_workpump import status
    from django_workpump.management.commands.workpump_status import render_text

    coordinator, _, _ = held(1)
    stalled = {"workpump-completions": {"failures": 4, "pending": 7, "last_error": "x"}}
    assert coordinator.heartbeat({"stalled_flushers": stalled})

    [instance] = status.instances()
    assert instance.stalled_flushers == stalled
    line = next(line for line in render_text(status.collect()) if str(instance.instance_id) in line)
    assert "STALLED completions" in line
    assert (
        json.loads(json.dumps(status.as_json(status.collect())))["instances"][0]["stalled_flushers"]
        == stalled
    )


@pytest.mark.django_db
def test_the_status_line_and_the_heartbeat_name_a_stalled_flusher(monkeypatch):
    from django_workpump.management.commands.runworkpump import flushers_state
    from django_workpump.pump.flusher import FlusherHealth
    from django_workpump.pump.supervisor import Supervisor

    supervisor = Supervisor()  # not started: only its reports are read
    assert flushers_state(supervisor) == "ok"
    assert supervisor._metadata()["stalled_flushers"] == {}
    stalled = FlusherHealth("workpump-completions", 7, 3, 12.34, "OperationalError: gone", 0, 0)
    monkeypatch.setattr(supervisor, "flusher_health", lambda: [stalled])

    assert flushers_state(supervisor) == (
        "STALLED completions(3 failures in 12s, 7 waiting: OperationalError: gone)"
    )
    assert supervisor._metadata()["stalled_flushers"] == {
        "workpump-completions": {
            "failures": 3,
            "failing_seconds": 12.3,
            "pending": 7,
            "last_error": "OperationalError: gone",
        }
    }


def test_a_stored_error_leads_with_the_exception_line_and_keeps_the_trace():
    try:
        raise KeyError("order-42")
    except KeyError as exc:
        text = error_text(exc)
    first, blank, rest = text.split("\n", 2)
    assert (first, blank) == ("KeyError: 'order-42'", "")
    assert rest.startswith("Traceback (most recent call last):")
    assert error_headline(text) == "KeyError: 'order-42'"


def test_the_headline_of_a_bare_traceback_is_its_exception_line():
    bare = (
        "Traceback (most recent call last):\n"
        '  File "x.py", line 1, in <module>\n'
        "    boom()\n"
        "ValueError: boom\n"
    )
    assert error_headline(bare) == "ValueError: boom"
    assert error_headline("plain error") == "plain error"
    assert error_headline(None) == ""
