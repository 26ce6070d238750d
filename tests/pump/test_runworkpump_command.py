"""``manage.py runworkpump``: startup and status lines, drain, and one-sentence failures."""

from __future__ import annotations

import gc
import json
import logging
import re
import signal
import uuid
from io import StringIO

import pytest
from django.core.management import CommandError, call_command
from django.db import connection
from django.test import override_settings

import django_workpump as workpump
from django_workpump import models
from django_workpump.pump.supervisor import Supervisor
from django_workpump.registry import registry
from tests.helpers import run_sql

FAST = {
    "POLLING_INTERVAL_MS": 50,
    "POLLING_MAX_INTERVAL_MS": 100,
    "NOTIFY_HEALTHY_POLLING_INTERVAL_MS": 100,
    "STATUS_INTERVAL_SECONDS": 1,
    "RETRY_BACKOFF_BASE_SECONDS": 0,
    "RETRY_BACKOFF_MAX_SECONDS": 0,
}


def messages(output: str) -> list[str]:
    """The messages of the command's text lines (``time level logger: message``)."""
    found = []
    for line in output.splitlines():
        match = re.match(r"^\S+ \S+ [A-Z]+ django_workpump[\w.]*: (.*)$", line)
        assert match, f"not a log line of the pump: {line!r}"
        found.append(match.group(1))
    return found


@pytest.fixture
def echo_handler():
    workpump.outbox_handler("cmd.echo")(lambda work: work.payload)
    yield
    registry.unregister("outbox", "cmd.echo")


@pytest.mark.django_db(transaction=True)
@override_settings(WORKPUMP=FAST)
def test_drain_prints_a_startup_line_processes_everything_and_exits_zero(echo_handler):
    for n in range(5):
        workpump.send("cmd.echo", {"n": n})
    out = StringIO()

    call_command(
        "runworkpump", "--drain", "--concurrency", "2", "--service-name", "cmdtest", stdout=out
    )

    lines = messages(out.getvalue())
    assert lines[0].startswith("workpump ")
    for part in (
        "started:",
        "listener=up ",
        "service=cmdtest",
        "concurrency=2",
        "categories=outbox,inbox,perspective_event,receptor",
        "liveness=advisory_lock_when_available",
        "database=default:",
    ):
        assert part in lines[0]
    assert "stopped: drained: nothing left to claim (exit 0)" in lines[-1]
    assert "claimed=5 done=5" in lines[-1]
    assert models.Outbox.objects.filter(done_at__isnull=False).count() == 5
    assert models.ServiceInstance.objects.count() == 0


@pytest.mark.django_db(transaction=True)
@override_settings(WORKPUMP=FAST)
def test_the_command_leaves_the_previous_signal_handlers_in_place():
    before = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
    call_command("runworkpump", "--drain", stdout=StringIO())
    assert (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)) == before


@pytest.mark.django_db(transaction=True)
@override_settings(WORKPUMP=FAST)
def test_the_command_freezes_what_was_loaded_before_it_starts_the_pump(monkeypatch):
    # The objects alive at start live as long as the process: full collections skip them.
    frozen_at_start = []
    original_start = Supervisor.start

    def start(self, *args, **kwargs):
        frozen_at_start.append(gc.get_freeze_count())
        return original_start(self, *args, **kwargs)

    monkeypatch.setattr(Supervisor, "start", start)
    gc.unfreeze()
    try:
        call_command("runworkpump", "--drain", stdout=StringIO())
    finally:
        gc.unfreeze()  # the rest of the test run collects as usual
    assert len(frozen_at_start) == 1
    assert frozen_at_start[0] > 10_000


@pytest.mark.django_db(transaction=True)
@override_settings(WORKPUMP=FAST)
def test_the_command_leaves_the_callers_connection_open(echo_handler):
    workpump.send("cmd.echo", {"n": 1})
    [before] = run_sql("SELECT pg_backend_pid() AS pid")

    call_command("runworkpump", "--drain", stdout=StringIO())

    # The same session, still usable: the command closed only what it opened.
    assert connection.connection is not None
    assert run_sql("SELECT pg_backend_pid() AS pid") == [before]
    assert models.Outbox.objects.get().done_at is not None


@pytest.mark.django_db(transaction=True)
@override_settings(WORKPUMP=FAST)
def test_categories_limit_what_is_claimed(echo_handler):
    workpump.send("cmd.echo", {})
    workpump.receive(uuid.uuid4(), "cmd.nobody", {})
    call_command("runworkpump", "--drain", "--categories", "outbox", stdout=StringIO())
    assert models.Outbox.objects.get().done_at is not None
    inbox = models.Inbox.objects.get()
    assert (inbox.attempts, inbox.done_at) == (0, None)


@pytest.mark.django_db(transaction=True)
@override_settings(WORKPUMP=FAST)
def test_topics_narrow_the_claim_to_the_named_handlers(echo_handler):
    workpump.outbox_handler("cmd.other")(lambda work: None)
    try:
        echo = workpump.send("cmd.echo", {})
        other = workpump.send("cmd.other", {})
        out = StringIO()
        call_command("runworkpump", "--drain", "--topics", "cmd.echo", stdout=out)
    finally:
        registry.unregister("outbox", "cmd.other")

    assert "topics=1 " in messages(out.getvalue())[0]
    assert models.Outbox.objects.get(work_id=echo).done_at is not None
    waiting = models.Outbox.objects.get(work_id=other)
    assert (waiting.attempts, waiting.instance_id, waiting.done_at) == (0, None, None)


@pytest.mark.django_db
def test_a_topic_with_no_handler_here_is_refused_with_the_known_ones_named(echo_handler):
    with pytest.raises(
        CommandError,
        match=r"No handler for topic 'cmd.typo' in categories outbox, inbox, perspective_event, "
        r"receptor: this process has handlers for .*cmd\.echo.*Check the name, or register",
    ):
        call_command("runworkpump", "--topics", "cmd.echo,cmd.typo")


@pytest.mark.django_db
def test_a_queue_no_task_backend_runs_is_refused_with_the_known_ones_named():
    with pytest.raises(
        CommandError, match=r"No task backend runs queue 'nightly': this process has queues "
    ):
        call_command("runworkpump", "--queues", "nightly")


@pytest.mark.django_db
def test_an_empty_topics_flag_is_refused():
    with pytest.raises(CommandError, match="--topics names nothing"):
        call_command("runworkpump", "--topics", " , ")


@pytest.mark.django_db(transaction=True)
@override_settings(WORKPUMP={**FAST, "STATUS_INTERVAL_SECONDS": 1})
def test_a_status_line_is_printed_every_status_interval(echo_handler):
    # A handler that takes a little over a second keeps the pump busy past one interval.
    gate = __import__("threading").Event()
    workpump.outbox_handler("cmd.slow")(lambda work: gate.wait(1.5))
    try:
        workpump.send("cmd.slow", {})
        out = StringIO()
        call_command("runworkpump", "--drain", stdout=out)
    finally:
        registry.unregister("outbox", "cmd.slow")
    status = [line for line in messages(out.getvalue()) if line.startswith("workpump status:")]
    assert status, out.getvalue()
    for part in (
        "claimed/s=",
        "done/s=",
        "failed=",
        "in_flight=1",
        "renewed=",
        "gate=",
        "poll_wait_ms=",
    ):
        assert part in status[0]


@pytest.mark.django_db(transaction=True)
@override_settings(WORKPUMP=FAST)
def test_json_log_format_writes_one_object_per_line(capsys, echo_handler):
    logger = logging.getLogger("django_workpump")
    handlers_before = list(logger.handlers)
    out = StringIO()

    call_command("runworkpump", "--drain", "--log-format", "json", stdout=out)

    assert logger.handlers == handlers_before  # the command removed what it added
    assert capsys.readouterr().err == ""  # one stream: the command's stdout
    entries = [json.loads(line) for line in out.getvalue().splitlines()]
    assert [e["action"] for e in entries if e["action"] in ("started", "stopped")] == [
        "started",
        "stopped",
    ]
    assert all({"time", "level", "logger", "message", "action"} <= e.keys() for e in entries)
    stopped = entries[-1]
    assert stopped["workpump_exit_code"] == 0 and stopped["workpump_claimed"] == 0


@pytest.mark.django_db
def test_unknown_categories_are_refused_with_the_valid_ones_named():
    with pytest.raises(CommandError, match=r"Unknown categories outbx in --categories; choose"):
        call_command("runworkpump", "--categories", "outbx")


@pytest.mark.django_db
def test_concurrency_below_one_is_refused():
    with pytest.raises(CommandError, match="--concurrency must be at least 1, not 0"):
        call_command("runworkpump", "--concurrency", "0")


@pytest.mark.django_db
def test_missing_migrations_stop_it_with_the_migrate_hint():
    run_sql("DROP SCHEMA workpump CASCADE")  # rolled back with the test
    with pytest.raises(
        CommandError,
        match=r"^Missing workpump migrations\. Run `python manage\.py migrate workpump`\.$",
    ):
        call_command("runworkpump")


@pytest.mark.parametrize("command", ["runworkpump", "workpump_status"])
def test_an_unreachable_database_stops_it_with_one_sentence(django_db_blocker, command):
    from django.db import connections

    connection = connections["default"]
    original = dict(connection.settings_dict)
    with django_db_blocker.unblock():
        connection.close()
        connection.settings_dict.update(HOST="127.0.0.1", PORT="1")
        try:
            with pytest.raises(CommandError) as raised:
                call_command(command)
        finally:
            connection.close()
            connection.settings_dict.clear()
            connection.settings_dict.update(original)
    message = str(raised.value)
    assert message.startswith("Cannot reach the database 'default' (")
    assert message.endswith("Check settings.DATABASES['default'] and that PostgreSQL is running.")
    assert "\n" not in message


@override_settings(WORKPUMP={"STALE_AFTER_SECONDS": 5})
def test_a_failing_system_check_stops_it_before_anything_starts():
    from django.core.management.base import SystemCheckError

    with pytest.raises(SystemCheckError, match=r"workpump\.E008"):
        call_command("runworkpump", skip_checks=False)


ROOT_HANDLER_LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "handlers": {"console": {"class": "logging.StreamHandler"}},
    "root": {"handlers": ["console"], "level": "INFO"},
}


@pytest.mark.parametrize(
    ("logging_setting", "adds_handler"),
    [
        (None, True),  # nothing configured: the readable default
        (ROOT_HANDLER_LOGGING, False),  # a root handler: ours would print every line twice
        ({"version": 1, "loggers": {"django_workpump": {"handlers": []}}}, False),
        ({"version": 1, "loggers": {"django_workpump.claim": {"level": "DEBUG"}}}, False),
        ({"version": 1, "loggers": {"django": {"handlers": ["x"]}}}, True),
    ],
)
def test_the_command_leaves_logging_to_a_project_that_configures_it(
    logging_setting, adds_handler, monkeypatch
):
    from django.conf import settings

    from django_workpump.management.commands.runworkpump import Command

    logger = logging.getLogger("django_workpump")
    before = list(logger.handlers)
    # set directly: override_settings would make Django apply the config to the process
    monkeypatch.setattr(settings, "LOGGING", logging_setting)
    added = Command()._configure_logging("text")
    try:
        assert (added is not None) == adds_handler
        assert (logger.handlers != before) == adds_handler
    finally:
        if added is not None:
            logger.removeHandler(added)


def test_with_a_root_handler_each_line_prints_once(pump_process):
    process = pump_process("--drain", settings_module="tests.settings_root_logging")
    output, _ = process.communicate(timeout=60)
    assert process.returncode == 0, output
    lines = output.splitlines()
    assert len([line for line in lines if "started:" in line]) == 1, output
    assert len([line for line in lines if "stopped:" in line]) == 1, output
    assert len(lines) == len(set(lines)), output


def test_json_log_format_under_a_project_logging_says_it_is_not_applied(monkeypatch, caplog):
    from django.conf import settings

    from django_workpump.management.commands.runworkpump import Command

    monkeypatch.setattr(settings, "LOGGING", ROOT_HANDLER_LOGGING)
    caplog.set_level(logging.INFO)
    assert Command()._configure_logging("json") is None
    [record] = [r for r in caplog.records if getattr(r, "action", "") == "log_format_ignored"]
    assert record.levelno == logging.WARNING
    assert "--log-format json is not applied: settings.LOGGING configures" in record.getMessage()
    assert Command()._configure_logging("text") is None  # nothing to say for text
    assert len([r for r in caplog.records if r.action == "log_format_ignored"]) == 1


@pytest.mark.django_db(transaction=True, databases=["default", "second"])
@override_settings(WORKPUMP=FAST)
def test_database_runs_the_pump_against_another_database_alias(echo_handler):
    """Producers write to the second database with using=; the pump started with
    --database second processes them there and leaves the default database alone."""
    on_second = workpump.send_many("cmd.echo", [{"n": n} for n in range(4)], using="second")
    on_default = workpump.send("cmd.echo", {"n": "default"})
    out = StringIO()

    call_command("runworkpump", "--drain", "--database", "second", stdout=out)

    lines = out.getvalue().splitlines()
    assert "database=second:" in lines[0]
    assert "_second" in lines[0]
    assert "claimed=4 done=4" in lines[-1]
    done = models.Outbox.objects.using("second").filter(done_at__isnull=False)
    assert sorted(done.values_list("work_id", flat=True)) == sorted(on_second)
    assert models.ServiceInstance.objects.using("second").count() == 0
    # the default database was not touched: its row waits, never claimed
    untouched = models.Outbox.objects.get(work_id=on_default)
    assert (untouched.done_at, untouched.attempts, untouched.claimed_at) == (None, 0, None)
    # the process-wide override ended with the command
    from django_workpump.conf import setting

    assert setting("DATABASE_ALIAS") == "default"


def test_an_unknown_database_alias_is_refused_with_the_known_ones_named():
    with pytest.raises(CommandError, match="--database 'shard9' is not a Django database"):
        call_command("runworkpump", "--drain", "--database", "shard9")


@pytest.mark.django_db(transaction=True)
@override_settings(
    WORKPUMP={**FAST, "RETRY_BACKOFF_BASE_SECONDS": 60, "RETRY_BACKOFF_MAX_SECONDS": 60}
)
def test_the_startup_line_comes_before_anything_the_claimed_work_logs():
    """The line is printed before the first claim, so even a handler that fails at
    once (its WARNING written by the failure flusher) logs after it."""
    workpump.outbox_handler("cmd.fails_at_once")(lambda work: 1 / 0)
    try:
        for n in range(3):
            workpump.send("cmd.fails_at_once", {"n": n})
        out = StringIO()

        call_command("runworkpump", "--drain", "--topics", "cmd.fails_at_once", stdout=out)

        lines = messages(out.getvalue())
        assert "started:" in lines[0], lines
        failures = [line for line in lines if "ZeroDivisionError" in line]
        assert len(failures) == 3
    finally:
        registry.unregister("outbox", "cmd.fails_at_once")
