"""Per-attempt logs through the real pump: what a handler logs is stored with its attempt.

Real threads and real PostgreSQL; each test registers its handlers and drains.
"""

from __future__ import annotations

import asyncio
import logging
import re
import uuid
from typing import Any

import pytest
from asgiref.sync import sync_to_async
from django.test import override_settings

import django_workpump as workpump
from django_workpump.attempt_logs import (
    MAX_BYTES,
    MAX_MESSAGE_CHARS,
    MAX_RECORDS,
    NOTE_LEVEL,
    capturing,
    configured_level,
)
from django_workpump.pump.supervisor import EXIT_OK
from tests.helpers import FAST_PUMP, drain, run_sql

pytestmark = pytest.mark.django_db(transaction=True)

app_log = logging.getLogger("tests.attempt_logs")


def logs_of(work_id: uuid.UUID) -> list[dict[str, Any]]:
    return run_sql(
        "SELECT attempt, lease_token, level, logger, message FROM workpump_attempt_log"
        " WHERE category = 'outbox' AND work_id = %s ORDER BY attempt, id",
        [work_id],
    )


@override_settings(WORKPUMP=FAST_PUMP)
def test_each_attempt_keeps_its_own_warnings_and_errors_with_its_outcome(outbox_handler, pump):
    def flaky(work: Any) -> None:
        app_log.info("not kept: below WARNING")
        app_log.warning("attempt %d starts", work.attempts)
        if work.attempts == 1:
            app_log.error("the remote said no")
            raise RuntimeError("remote refused")

    outbox_handler("al.flaky", flaky, max_attempts=3)
    work_id = workpump.send("al.flaky", {})

    assert drain(pump(drain=True)) == EXIT_OK

    rows = logs_of(work_id)
    assert [(r["attempt"], r["level"], r["message"]) for r in rows] == [
        (1, logging.WARNING, "attempt 1 starts"),
        (1, logging.ERROR, "the remote said no"),
        (2, logging.WARNING, "attempt 2 starts"),
    ]
    assert {r["logger"] for r in rows} == {"tests.attempt_logs"}
    # each attempt's records carry that attempt's lease token: two claims, two tokens
    assert rows[0]["lease_token"] == rows[1]["lease_token"] != rows[2]["lease_token"]


@override_settings(WORKPUMP={**FAST_PUMP, "ATTEMPT_LOG_LEVEL": "INFO"})
def test_an_async_handler_and_its_sync_to_async_calls_are_captured_at_a_lowered_level(
    outbox_handler, pump
):
    app_log.setLevel(logging.INFO)  # the logger must let INFO through for it to be captured
    try:

        def in_a_thread_call() -> None:
            app_log.info("from sync_to_async")

        async def handle(work: Any) -> None:
            app_log.info("before the await")
            await sync_to_async(in_a_thread_call)()
            await asyncio.gather(asyncio.sleep(0), asyncio.create_task(child()))
            raise workpump.Discard("not wanted")

        async def child() -> None:
            app_log.warning("from a task the handler started")

        outbox_handler("al.async", handle)
        work_id = workpump.send("al.async", {})
        assert drain(pump(drain=True)) == EXIT_OK
    finally:
        app_log.setLevel(logging.NOTSET)

    assert [r["message"] for r in logs_of(work_id)] == [
        "before the await",
        "from sync_to_async",
        "from a task the handler started",
    ]


@override_settings(WORKPUMP={**FAST_PUMP, "ATTEMPT_LOG_LEVEL": None})
def test_none_stores_no_records(outbox_handler, pump):
    outbox_handler("al.quiet", lambda work: app_log.error("not kept"))
    work_id = workpump.send("al.quiet", {})
    assert drain(pump(drain=True)) == EXIT_OK
    assert logs_of(work_id) == []


@override_settings(WORKPUMP=FAST_PUMP)
def test_records_are_bounded_and_cleaned_and_a_note_says_what_was_cut(outbox_handler, pump):
    def chatty(work: Any) -> None:
        app_log.warning("a NUL \x00 and a lone surrogate \udc80 here")
        for n in range(MAX_RECORDS + 30):
            app_log.warning("line %d", n)

    outbox_handler("al.chatty", chatty)
    work_id = workpump.send("al.chatty", {})
    assert drain(pump(drain=True)) == EXIT_OK

    rows = logs_of(work_id)
    assert len(rows) == MAX_RECORDS + 1  # the records kept, then the note
    assert rows[0]["message"].startswith("a NUL \ufffd and a lone surrogate \ufffd here")
    assert "2 characters PostgreSQL cannot store" in rows[0]["message"]
    assert rows[-2]["message"] == f"line {MAX_RECORDS - 2}"
    note = rows[-1]
    assert note["level"] == NOTE_LEVEL and note["logger"] == "django_workpump"
    assert note["message"].startswith("31 more records not kept")


@override_settings(WORKPUMP=FAST_PUMP)
def test_a_message_over_the_character_cap_is_cut_on_characters_with_a_note(outbox_handler, pump):
    # 'é' is two bytes: a cut on bytes would keep only half the characters
    long = "é" * (MAX_MESSAGE_CHARS + 250)
    head = "x" * (MAX_MESSAGE_CHARS - 10)

    def verbose(work: Any) -> None:
        app_log.warning(long)
        try:
            raise KeyError("deep")
        except KeyError:
            app_log.exception(head)  # the traceback counts toward the cap

    outbox_handler("al.verbose", verbose)
    work_id = workpump.send("al.verbose", {})
    assert drain(pump(drain=True)) == EXIT_OK

    first, second = (r["message"] for r in logs_of(work_id))  # nothing dropped: no note
    assert first == "é" * MAX_MESSAGE_CHARS + " [workpump: 250 more characters cut]"
    kept, note = second.split(" [workpump: ")
    assert kept.startswith(head + "\nTraceback") and len(kept) == MAX_MESSAGE_CHARS
    assert re.fullmatch(r"\d+ more characters cut\]", note)
    assert "KeyError: 'deep'" not in second  # the traceback's tail was cut


@override_settings(WORKPUMP=FAST_PUMP)
def test_records_past_the_byte_cap_are_not_kept_counting_utf8_bytes_not_characters(
    outbox_handler, pump
):
    big = "€" * 1365  # 1,365 characters, 4,095 bytes: four are 16,380 bytes
    fill = "abcd"  # brings the total to exactly MAX_BYTES, which is still kept
    assert 4 * len(big.encode()) + len(fill) == MAX_BYTES

    def wordy(work: Any) -> None:
        for _ in range(4):
            app_log.warning(big)
        app_log.warning(fill)
        app_log.warning("x")  # one byte over the cap
        app_log.warning(big)

    outbox_handler("al.wordy", wordy)
    work_id = workpump.send("al.wordy", {})
    assert drain(pump(drain=True)) == EXIT_OK

    *records, note = logs_of(work_id)
    # counted on characters, all seven (9,565 characters) would have fitted
    assert [r["message"] for r in records] == [big] * 4 + [fill]
    assert sum(len(r["message"].encode("utf-8")) for r in records) == MAX_BYTES
    assert (note["level"], note["logger"]) == (NOTE_LEVEL, "django_workpump")
    assert note["message"] == (
        f"2 more records not kept: an attempt keeps at most {MAX_RECORDS} records and "
        f"{MAX_BYTES} bytes of messages"
    )


@override_settings(WORKPUMP=FAST_PUMP)
def test_once_a_record_is_not_kept_no_later_one_is_so_the_log_has_no_hole(outbox_handler, pump):
    big = "€" * 1365  # 4,095 bytes

    def wordy(work: Any) -> None:
        for _ in range(4):
            app_log.warning(big)  # 16,380 bytes
        app_log.warning("too long for the 4 bytes left")
        app_log.warning("ok")  # 2 bytes would fit, but after a gap it would mislead

    outbox_handler("al.gap", wordy)
    work_id = workpump.send("al.gap", {})
    assert drain(pump(drain=True)) == EXIT_OK

    *records, note = logs_of(work_id)
    assert [r["message"] for r in records] == [big] * 4
    assert note["message"].startswith("2 more records not kept")


@override_settings(WORKPUMP=FAST_PUMP)
def test_an_atomic_handler_stores_its_records_with_its_completion(outbox_handler, pump):
    def atomic(work: Any) -> str:
        app_log.warning("inside the transaction")
        return "ok"

    outbox_handler("al.atomic", atomic, atomic=True)
    work_id = workpump.send("al.atomic", {})
    assert drain(pump(drain=True)) == EXIT_OK
    assert [r["message"] for r in logs_of(work_id)] == ["inside the transaction"]


@override_settings(WORKPUMP=FAST_PUMP)
def test_a_not_retryable_failure_keeps_its_records_with_the_dead_row(outbox_handler, pump):
    def doomed(work: Any) -> None:
        app_log.error("giving up on %s", work.id)
        raise ValueError("bad data")

    outbox_handler("al.doomed", doomed, retry=workpump.Retry(on=(KeyError,)))
    work_id = workpump.send("al.doomed", {})
    assert drain(pump(drain=True)) == EXIT_OK
    assert [r["message"] for r in logs_of(work_id)] == [f"giving up on {work_id}"]
    (row,) = run_sql("SELECT dead_lettered_at FROM workpump_outbox WHERE work_id = %s", [work_id])
    assert row["dead_lettered_at"] is not None


def test_each_attempt_reads_the_level_the_setting_has_then():
    with override_settings(WORKPUMP={**FAST_PUMP, "ATTEMPT_LOG_LEVEL": "ERROR"}):
        with capturing() as log:
            app_log.warning("below ERROR")
        assert log is not None and log.json() is None
    with override_settings(WORKPUMP={**FAST_PUMP, "ATTEMPT_LOG_LEVEL": "WARNING"}):
        with capturing() as log:
            app_log.warning("at WARNING")
        assert log is not None and "at WARNING" in (log.json() or "")
    with override_settings(WORKPUMP={**FAST_PUMP, "ATTEMPT_LOG_LEVEL": None}):
        with capturing() as log:
            app_log.error("none kept")
        assert log is None


def test_a_level_that_is_no_level_is_refused_by_name_even_when_unhashable():
    unhashable = {**FAST_PUMP, "ATTEMPT_LOG_LEVEL": ["WARNING"]}
    with (
        override_settings(WORKPUMP=unhashable),
        pytest.raises(ValueError, match=r"ATTEMPT_LOG_LEVEL.*must be a level name"),
    ):
        configured_level()
