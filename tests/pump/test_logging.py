"""What the pump logs: one line per failed attempt, an error per dead-letter, one warning
per topic nobody runs, and nothing at INFO while nothing happens."""

from __future__ import annotations

import json
import logging
import uuid
from typing import Any

import pytest
from django.test import override_settings

import django_workpump as workpump
from django_workpump import models
from django_workpump.pump.maintenance import MaintenanceWorker
from tests.helpers import FAST_PROCESS, FAST_PUMP, drain

FAST = {**FAST_PUMP, "CONCURRENCY": 2}


def failing(work: Any) -> None:
    raise ValueError(f"no such user: {work.payload['user']}")


def records(caplog: pytest.LogCaptureFixture, level: int) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.levelno >= level and r.name.startswith("django_")]


@pytest.mark.django_db(transaction=True)
@override_settings(
    WORKPUMP={**FAST, "RETRY_BACKOFF_BASE_SECONDS": 60, "RETRY_BACKOFF_MAX_SECONDS": 300}
)
def test_a_failed_attempt_logs_one_warning_with_the_exception_line_and_the_retry_time(
    outbox_handler, pump, caplog
):
    outbox_handler("logs.fail", failing, max_attempts=3)
    message_id = workpump.send("logs.fail", {"user": 7}, stream="user-7")
    caplog.set_level(logging.INFO)

    assert drain(pump(drain=True)) == 0  # the retry is a minute away: drained after one

    [warning] = records(caplog, logging.WARNING)
    row = models.Outbox.objects.get()
    assert warning.levelno == logging.WARNING
    message = warning.getMessage()
    assert f"outbox {message_id} failed" in message
    assert "topic 'logs.fail', stream 'user-7', attempt 1/3" in message
    assert "ValueError: no such user: 7" in message
    assert "Traceback" not in message
    # the retry time is the one the database scheduled
    assert row.scheduled_for is not None
    assert f"retry at {row.scheduled_for.isoformat(timespec='seconds')}" in message
    fields = {k: v for k, v in vars(warning).items() if k.startswith("workpump_")}
    assert fields == {
        "workpump_category": "outbox",
        "workpump_topic": "logs.fail",
        "workpump_id": str(message_id),
        "workpump_stream": "user-7",
        "workpump_attempt": 1,
        "workpump_max_attempts": 3,
        "workpump_reason": "handler_error",
        "workpump_error": "ValueError: no such user: 7",
        "workpump_retry_at": row.scheduled_for.isoformat(),
    }
    assert warning.action == "attempt_failed"


@pytest.mark.django_db(transaction=True)
@override_settings(WORKPUMP=FAST)
def test_the_attempt_that_dead_letters_a_row_logs_an_error(outbox_handler, pump, caplog):
    outbox_handler("logs.fail", failing, max_attempts=2)
    message_id = workpump.send("logs.fail", {"user": 8})
    caplog.set_level(logging.INFO)

    assert drain(pump(drain=True)) == 0

    warning, error = records(caplog, logging.WARNING)
    assert warning.levelno == logging.WARNING and "attempt 1/2" in warning.getMessage()
    assert "retry now" in warning.getMessage()  # no backoff configured
    assert error.levelno == logging.ERROR and error.action == "dead_lettered"
    message = error.getMessage()
    assert f"outbox {message_id} dead-lettered (topic 'logs.fail', attempt 2/2)" in message
    assert "ValueError: no such user: 8" in message
    assert f"workpump_action requeue {message_id}" in message
    assert error.workpump_retry_at is None
    assert models.Outbox.objects.get().dead_lettered_at is not None


def maintenance() -> MaintenanceWorker:
    return MaintenanceWorker(
        alias="default",
        interval_seconds=300,
        retention_seconds=86400,
        stale_after_seconds=30,
        definitively_dead_after_seconds=300,
    )


@pytest.mark.django_db
def test_a_topic_no_live_instance_runs_is_reported_once_per_topic(caplog):
    for n in range(3):
        workpump.send("logs.nobody", {"n": n})
    workpump.receive(uuid.uuid4(), "logs.nobody_inbox", {})
    worker = maintenance()
    caplog.set_level(logging.INFO)

    worker.run_once()
    worker.run_once()  # a second pass names nothing again
    workpump.send("logs.nobody", {"n": 4})  # nor does one more row
    worker.run_once()

    warnings = [r for r in records(caplog, logging.WARNING) if r.action == "no_live_handler"]
    assert sorted((r.workpump_category, r.workpump_topic) for r in warnings) == [
        ("inbox", "logs.nobody_inbox"),
        ("outbox", "logs.nobody"),
    ]
    outbox = next(r for r in warnings if r.workpump_category == "outbox")
    assert outbox.workpump_rows == 3
    message = outbox.getMessage()
    assert "3 outbox rows of topic 'logs.nobody' wait" in message
    assert "no live instance has a handler for it" in message
    assert "Deploy that handler" in message


@pytest.mark.django_db
def test_a_topic_that_was_handled_in_between_is_reported_again(caplog):
    workpump.send("logs.nobody", {})
    worker = maintenance()
    caplog.set_level(logging.WARNING)
    worker.run_once()
    models.Outbox.objects.update(done_at=models.Outbox.objects.get().created_at)
    worker.run_once()  # nothing waits: the topic is forgotten
    workpump.send("logs.nobody", {})
    worker.run_once()

    warnings = [r for r in records(caplog, logging.WARNING) if r.action == "no_live_handler"]
    assert len(warnings) == 2


@pytest.mark.django_db
def test_a_quiet_maintenance_pass_logs_nothing_at_info(caplog):
    caplog.set_level(logging.DEBUG)
    result = maintenance().run_once()
    assert result.ran and result.quiet
    assert records(caplog, logging.INFO) == []
    assert [r.getMessage() for r in caplog.records if r.action == "maintenance"] == [
        "maintenance pass: reaped 0, purged nothing, stuck 0, topics without a live handler 0"
    ]


@pytest.mark.django_db(transaction=True)
@override_settings(WORKPUMP=FAST)
def test_a_normal_start_and_stop_log_nothing_but_the_stop_request_at_info(pump, caplog):
    caplog.set_level(logging.DEBUG)
    supervisor = pump()
    assert supervisor.gate is not None and supervisor.gate.wait_settled(10)
    assert supervisor.gate.available
    supervisor.request_stop("received SIGTERM")
    assert supervisor.shutdown() == 0

    assert [(r.levelname, r.getMessage()) for r in records(caplog, logging.INFO)] == [
        ("INFO", "stopping: received SIGTERM")
    ]
    # the listener's coming up and going down are there, at DEBUG
    gate = [(r.levelname, r.action) for r in caplog.records if r.name == "django_workpump.notify"]
    assert gate == [("DEBUG", "gate_available"), ("DEBUG", "gate_unavailable")]


@pytest.mark.django_db(transaction=True)
@override_settings(WORKPUMP=FAST)
def test_an_idle_status_line_is_debug_and_a_busy_one_info(pump):
    from django_workpump.management.commands.runworkpump import _StatusReporter

    supervisor = pump()
    assert supervisor.gate is not None and supervisor.gate.wait_settled(10)
    reporter = _StatusReporter(supervisor)
    line, fields, changed = reporter.line()
    assert line.startswith("workpump status: ") and not changed
    assert reporter.line()[2] is False  # still nothing
    supervisor.dispatcher.stats.completed += 1
    assert reporter.line()[2] is True
    assert reporter.line()[2] is False
    assert fields["workpump_gate"] == "up"


@pytest.mark.django_db(transaction=True)
def test_json_logs_cover_every_line_of_a_real_drain(pump_process):
    # mp.raise (tests/app/workpump.py) fails twice (max_attempts=2), then is dead
    message_id = workpump.send("mp.raise", {"raise": "Halt"})
    # a slow cadence below the fast one: a system check warning, printed before the start
    timings = {
        **FAST_PROCESS,
        "HEARTBEAT_INTERVAL_SECONDS": 2,
        "HEARTBEAT_SLOW_INTERVAL_SECONDS": 1,
        "STALE_AFTER_SECONDS": 4,
    }
    process = pump_process("--drain", "--log-format", "json", timings=timings)
    output, _ = process.communicate(timeout=90)  # stdout and stderr, merged
    assert process.returncode == 0, output
    entries = [json.loads(line) for line in output.splitlines()]  # every line is JSON
    actions = [e.get("action") for e in entries]
    assert (
        actions[0] == "system_checks"
        and "HEARTBEAT_SLOW_INTERVAL_SECONDS" in (entries[0]["message"])
    )
    assert actions[1] == "started" and actions[-1] == "stopped", actions
    entries = entries[1:]
    assert entries[0]["workpump_listener"] == "up"
    failed = [e for e in entries if e.get("action") in ("attempt_failed", "dead_lettered")]
    assert [(e["level"], e["workpump_attempt"]) for e in failed] == [
        ("WARNING", 1),
        ("ERROR", 2),
    ]
    assert failed[1]["workpump_error"] == "tests.app.workpump.Halt: raised by mp.raise"
    assert failed[1]["workpump_id"] == str(message_id)
    assert entries[-1]["workpump_failed"] == 2


def test_json_logs_cover_a_failed_start_too(pump_process):
    process = pump_process("--log-format", "json", "--categories", "outbx")
    output, _ = process.communicate(timeout=60)
    assert process.returncode == 1, output
    [entry] = [json.loads(line) for line in output.splitlines()]
    assert (entry["level"], entry["action"]) == ("ERROR", "command_failed")
    assert entry["message"].startswith("Unknown categories outbx in --categories")
