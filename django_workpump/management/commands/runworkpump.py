"""``manage.py runworkpump``: run this process as one work-pump instance."""

from __future__ import annotations

import gc
import json
import logging
import os
import signal
import sys
import threading
from io import StringIO
from typing import Any

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError, CommandParser, OutputWrapper
from django.db import connections

from django_workpump import metrics
from django_workpump.conf import get_settings, overridden
from django_workpump.management.database import ensure_reachable
from django_workpump.pump.naming import application_name, name_thread_connections
from django_workpump.pump.supervisor import (
    EXIT_OK,
    PumpOptions,
    SchemaNotReady,
    Supervisor,
)
from django_workpump.registry import CATEGORIES, TopicSelectionError
from django_workpump.tasks import load_task_code

logger = logging.getLogger("django_workpump")
# The command's own lines (startup, status, stop) are records too: one stream, one format.
lines = logging.getLogger("django_workpump.runworkpump")
# How long the startup line waits for the NOTIFY listener's first connection to end.
LISTENER_SETTLE_SECONDS = 5.0
# Attributes every LogRecord has; the rest came in ``extra`` and go into the JSON object.
_RECORD_ATTRIBUTES = frozenset(
    vars(logging.LogRecord("", 0, "", 0, "", (), None)).keys() | {"message", "asctime"}
)


def project_configures_logging() -> bool:
    """Whether settings.LOGGING gives the root logger or a django_workpump logger handlers."""
    config = getattr(settings, "LOGGING", None)
    if not isinstance(config, dict):
        return False
    loggers = config.get("loggers") or {}
    if any(name == "django_workpump" or name.startswith("django_workpump.") for name in loggers):
        return True
    root = config.get("root") or loggers.get("") or {}
    return bool(isinstance(root, dict) and root.get("handlers"))


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time, level, logger, message, then every ``extra`` field
    of the record (``action``, ``workpump_topic``, ``workpump_id``, ...)."""

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "time": self.formatTime(record),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        for key, value in vars(record).items():
            if key not in _RECORD_ATTRIBUTES and not key.startswith("_"):
                entry[key] = value
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, default=str)


def json_line(level: int, message: str, action: str) -> str:
    """One JSON line for what the command prints outside a log record."""
    record = logging.makeLogRecord(
        {
            "name": lines.name,
            "levelno": level,
            "levelname": logging.getLevelName(level),
            "msg": message,
            "action": action,
        }
    )
    return JsonFormatter().format(record)


class Command(BaseCommand):
    help = "Run a work-pump instance: claim, run and complete work until stopped."
    _json_output = False  # --log-format json, and the command writes the lines itself

    def execute(self, *args: Any, **options: Any) -> Any:
        """With --log-format json, what Django itself would print (system check warnings,
        the error a failed start ends with) is a JSON line too."""
        self._json_output = options.get("log_format") == "json" and not project_configures_logging()
        try:
            return super().execute(*args, **options)
        except CommandError as exc:
            if not (self._json_output and getattr(self, "_called_from_command_line", False)):
                raise
            self.stdout.write(json_line(logging.ERROR, str(exc).strip(), "command_failed"))
            sys.exit(exc.returncode)

    def check(self, *args: Any, **kwargs: Any) -> None:
        if not self._json_output:
            return super().check(*args, **kwargs)
        real, captured = self.stderr, StringIO()
        self.stderr = OutputWrapper(captured)
        try:
            super().check(*args, **kwargs)
        finally:
            self.stderr = real
            text = captured.getvalue().strip()
            if text:
                self.stdout.write(json_line(logging.WARNING, text, "system_checks"))

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument(
            "--concurrency", type=int, help="Dispatch threads (WORKPUMP CONCURRENCY)."
        )
        parser.add_argument(
            "--categories",
            help=f"Comma-separated categories to claim (default all: {','.join(CATEGORIES)}).",
        )
        parser.add_argument(
            "--topics",
            help="Comma-separated topics to claim (outbox destinations, inbox handler names, "
            "perspective and receptor names); default: every topic with a handler here.",
        )
        parser.add_argument(
            "--queues",
            help="Comma-separated django.tasks queues to run. With --topics or --queues, "
            "only what they name is claimed.",
        )
        parser.add_argument(
            "--service-name", default="workpump", help="Name shown for this instance."
        )
        parser.add_argument(
            "--drain",
            action="store_true",
            help="Process until nothing is claimable, then exit 0 (tests, cron).",
        )
        parser.add_argument(
            "--no-listen",
            action="store_true",
            help="Do not LISTEN: poll only (no NOTIFY wakes, no alive-lock).",
        )
        parser.add_argument(
            "--database",
            help="The Django database alias to run against (default WORKPUMP "
            "DATABASE_ALIAS): one pump per database shard.",
        )
        parser.add_argument(
            "--metrics-port",
            type=int,
            help="Serve Prometheus metrics at http://<host>:PORT/metrics while running "
            "(WORKPUMP METRICS_PORT; needs the prometheus extra).",
        )
        parser.add_argument(
            "--metrics-bind",
            default="127.0.0.1",
            metavar="ADDRESS",
            help="The address the metrics port listens on (default 127.0.0.1: this host "
            "only; 0.0.0.0 or :: for every interface, e.g. for a Prometheus elsewhere).",
        )
        parser.add_argument("--log-format", choices=["text", "json"], default="text")

    def handle(self, *args: Any, **options: Any) -> None:
        level = logger.level
        alias = options.get("database")
        if alias is not None and alias not in settings.DATABASES:
            raise CommandError(
                f"--database {alias!r} is not a Django database; choose one of "
                f"{', '.join(settings.DATABASES)} (settings.DATABASES)."
            )
        log_handler = self._configure_logging(options["log_format"])
        try:
            if alias is None:
                self._run(options)
            else:
                # The pump, and every producer its handlers call, use this database.
                with overridden(DATABASE_ALIAS=alias):
                    self._run(options)
        finally:
            if log_handler is not None:
                logger.removeHandler(log_handler)
                logger.setLevel(level)

    def _run(self, options: dict[str, Any]) -> None:
        categories = self._categories(options["categories"])
        if options["concurrency"] is not None and options["concurrency"] < 1:
            raise CommandError(f"--concurrency must be at least 1, not {options['concurrency']}.")
        settings = get_settings()
        alias = settings["DATABASE_ALIAS"]
        port = options["metrics_port"]
        if port is not None and not 0 <= port <= 65535:
            raise CommandError(f"--metrics-port must be between 0 and 65535, not {port}.")
        bind = options["metrics_bind"].strip()
        if not bind:
            raise CommandError(
                "--metrics-bind is empty; give an address such as 127.0.0.1 (this host only) "
                "or 0.0.0.0 (every interface)."
            )
        topics = self._names("--topics", options["topics"])
        queues = self._names("--queues", options["queues"])
        ensure_reachable(alias)
        # Task code is loaded now, once: a task row never makes a worker import a module.
        load_task_code()
        try:
            supervisor = Supervisor(
                PumpOptions(
                    categories=categories,
                    concurrency=options["concurrency"],
                    service_name=options["service_name"],
                    listen=not options["no_listen"],
                    drain=options["drain"],
                    topics=topics,
                    queues=queues,
                    metrics_port=options["metrics_port"],
                    metrics_bind=bind,
                )
            )
        except (TopicSelectionError, metrics.MetricsUnavailable) as exc:
            raise CommandError(str(exc)) from None
        # What is loaded by now (Django, the app's modules, the handlers) lives as long as
        # the process. Frozen out of the collector's reach, it is not walked again by every
        # full collection, which holds the GIL, and so every handler and the claim loop,
        # for its whole length (about 30 ms with the benchmark's app, 1 ms after this).
        gc.collect()
        gc.freeze()
        # This thread registers the instance and waits for it: name its connection too.
        name_thread_connections(application_name(supervisor.identity.instance_id, "main"))
        # Before the start: a signal while it registers and claims stops it cleanly.
        previous = self._install_signal_handlers(supervisor)
        try:

            def announce() -> None:  # before the first claim: the startup line comes first
                line, fields = self._startup_line(supervisor, alias)
                lines.info("%s", line, extra={"action": "started", **fields})

            try:
                supervisor.start(on_ready=announce)
            except (SchemaNotReady, metrics.MetricsPortUnavailable) as exc:
                supervisor.shutdown()
                raise CommandError(str(exc)) from None
            interval = settings["STATUS_INTERVAL_SECONDS"]
            reporter = _StatusReporter(supervisor)
            while not supervisor.wait(interval):
                line, fields, changed = reporter.line()
                # A line while nothing happens is routine: DEBUG until something changes.
                lines.log(
                    logging.INFO if changed else logging.DEBUG,
                    "%s",
                    line,
                    extra={"action": "status", **fields},
                )
            code = supervisor.shutdown()
        finally:
            for signum, handler in previous.items():
                signal.signal(signum, handler)
            name_thread_connections(None)  # a failed start too: this thread is the caller's
        lines.log(
            logging.INFO if code == EXIT_OK else logging.ERROR,
            "workpump %s stopped: %s (exit %s); %s",
            supervisor.identity.instance_id,
            supervisor.stop_reason,
            code,
            reporter.totals(),
            extra={
                "action": "stopped",
                "workpump_instance": str(supervisor.identity.instance_id),
                "workpump_exit_code": code,
                "workpump_stop_reason": supervisor.stop_reason,
                **reporter.total_fields(),
            },
        )
        if code != EXIT_OK:
            raise SystemExit(code)

    # -- helpers -------------------------------------------------------------------
    def _categories(self, value: str | None) -> tuple[str, ...]:
        if not value:
            return CATEGORIES
        chosen = tuple(part.strip() for part in value.split(",") if part.strip())
        unknown = [c for c in chosen if c not in CATEGORIES]
        if unknown or not chosen:
            raise CommandError(
                f"Unknown categories {', '.join(unknown) or '(none given)'} in --categories; "
                f"choose from {', '.join(CATEGORIES)}."
            )
        return chosen

    def _names(self, flag: str, value: str | None) -> tuple[str, ...] | None:
        if value is None:
            return None
        names = tuple(part.strip() for part in value.split(",") if part.strip())
        if not names:
            raise CommandError(f"{flag} names nothing; give comma-separated names or leave it out.")
        return names

    def _configure_logging(self, log_format: str) -> logging.Handler | None:
        """Write the pump's lines to stdout unless the project configured logging for the
        package or the root logger (a handler of ours would print every line twice); return
        what was added."""
        if logger.handlers or project_configures_logging():
            if log_format == "json":
                lines.warning(
                    "--log-format json is not applied: settings.LOGGING configures the "
                    "django_workpump or root logger, so its handlers and formatters write "
                    "these lines. Give them a JSON formatter there (or remove that logger "
                    "configuration to let --log-format decide).",
                    extra={"action": "log_format_ignored"},
                )
            return None
        handler = logging.StreamHandler(self.stdout)
        handler.setFormatter(
            JsonFormatter()
            if log_format == "json"
            else logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s")
        )
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
        return handler

    def _install_signal_handlers(self, supervisor: Supervisor) -> dict[int, Any]:
        """Route SIGTERM/SIGINT to a graceful stop; return the handlers they replace."""
        if threading.current_thread() is not threading.main_thread():
            return {}  # signals can only be handled on the main thread
        received: list[int] = []

        def on_signal(signum: int, frame: Any) -> None:
            received.append(signum)
            if len(received) > 1:
                # A second signal: exit at once; peers recover the work through eviction.
                os._exit(128 + signum)
            supervisor.request_stop(f"received {signal.Signals(signum).name}")

        previous: dict[int, Any] = {
            signum: signal.getsignal(signum) for signum in (signal.SIGTERM, signal.SIGINT)
        }
        signal.signal(signal.SIGTERM, on_signal)
        signal.signal(signal.SIGINT, on_signal)
        return previous

    def _listener_state(self, supervisor: Supervisor) -> str:
        """off, up, down (why) or connecting: what the NOTIFY listener is doing now."""
        gate = supervisor.gate
        if gate is None:
            return "off"
        gate.wait_settled(LISTENER_SETTLE_SECONDS)
        if gate.available:
            return "up"
        if gate.settled:
            return f"down ({gate.last_failure or 'stopped'})"
        return f"connecting (no answer within {LISTENER_SETTLE_SECONDS:.0f} s)"

    def _startup_line(self, supervisor: Supervisor, alias: str) -> tuple[str, dict[str, Any]]:
        s = supervisor.settings
        db = connections[alias].settings_dict
        database = f"{db.get('HOST') or 'localhost'}:{db.get('PORT') or 5432}/{db.get('NAME')}"
        if db.get("HOST", "").startswith("/") or not db.get("HOST"):
            database = f"{db.get('NAME')} (socket)" if not db.get("PORT") else database
        listener = self._listener_state(supervisor)
        fields = {
            "workpump_instance": str(supervisor.identity.instance_id),
            "workpump_service": supervisor.identity.service_name,
            "workpump_categories": list(supervisor.options.categories),
            "workpump_topics": {c: list(t) for c, t in supervisor.topics.items()},
            "workpump_concurrency": supervisor.dispatcher.concurrency,
            "workpump_listener": listener.split(" ", 1)[0],
        }
        return (
            f"workpump {supervisor.identity.instance_id} started: "
            f"service={supervisor.identity.service_name} pid={supervisor.identity.process_id} "
            f"categories={','.join(supervisor.options.categories)} "
            f"topics={sum(len(t) for t in supervisor.topics.values())} "
            f"{_prefixes_part(supervisor)}"
            f"concurrency={supervisor.dispatcher.concurrency} database={alias}:{database} "
            f"liveness={s['LIVENESS_SOURCE_MODE']} "
            f"listener={listener} "
            f"lease={s['LEASE_SECONDS']}s heartbeat={s['HEARTBEAT_INTERVAL_SECONDS']}s"
        ), fields


def _prefixes_part(supervisor: Supervisor) -> str:
    """``topic_prefixes=a,b `` when the pump claims by prefix too (empty QUEUES), else ''."""
    prefixes = [p for ps in supervisor.topic_prefixes.values() for p in ps]
    return f"topic_prefixes={','.join(prefixes)} " if prefixes else ""


class _StatusReporter:
    """Rates since the previous line, from the services' counters."""

    def __init__(self, supervisor: Supervisor) -> None:
        self.supervisor = supervisor
        self.clock = supervisor.clock
        self._last_at = self.clock.monotonic()
        self._last = self._counters()
        self._last_state = self._state()

    def _counters(self) -> tuple[int, ...]:
        stats = self.supervisor.dispatcher.stats
        return (
            self.supervisor.claim.claimed_total,
            stats.completed,
            stats.failed,
            stats.abandoned,
            stats.lost_leases,
        )

    def _state(self) -> tuple[str, str, str]:
        """(gate, alive-lock, flushers): a change of any is worth a line."""
        gate = self.supervisor.gate
        return (
            "off" if gate is None else ("up" if gate.available else "DOWN"),
            "held" if gate is not None and gate.alive_lock_held else "no",
            flushers_state(self.supervisor),
        )

    def line(self) -> tuple[str, dict[str, Any], bool]:
        """The status line, its fields, and whether anything happened since the last one."""
        now = self.clock.monotonic()
        counters = self._counters()
        elapsed = max(now - self._last_at, 1e-9)
        claimed, done = (c - p for c, p in zip(counters[:2], self._last[:2], strict=True))
        moved = counters != self._last
        self._last_at, self._last = now, counters
        sup = self.supervisor
        state = self._state()
        gate_state, alive_lock, flushers = state
        changed = moved or sup.dispatcher.in_flight > 0 or state != self._last_state
        self._last_state = state
        wait_ms = sup.claim.current_wait_ms()
        fields = {
            "workpump_claimed_per_s": round(claimed / elapsed, 1),
            "workpump_done_per_s": round(done / elapsed, 1),
            "workpump_failed": sup.dispatcher.stats.failed,
            "workpump_in_flight": sup.dispatcher.in_flight,
            "workpump_gate": gate_state,
            "workpump_flushers": flushers,
        }
        return (
            (
                f"workpump status: claimed/s={claimed / elapsed:.1f} done/s={done / elapsed:.1f} "
                f"failed={sup.dispatcher.stats.failed} in_flight={sup.dispatcher.in_flight} "
                f"renewed={sup.renewal.renewed} abandoned={sup.dispatcher.stats.abandoned} "
                f"lost={sup.dispatcher.stats.lost_leases} gate={gate_state} "
                f"alive_lock={alive_lock} "
                f"poll_wait_ms={'signal' if wait_ms is None else wait_ms} "
                f"flushers={flushers}"
            ),
            fields,
            changed,
        )

    def total_fields(self) -> dict[str, int]:
        stats = self.supervisor.dispatcher.stats
        return {
            "workpump_claimed": self.supervisor.claim.claimed_total,
            "workpump_done": stats.completed,
            "workpump_failed": stats.failed,
            "workpump_abandoned": stats.abandoned,
            "workpump_released": stats.released,
        }

    def totals(self) -> str:
        return " ".join(
            f"{k.removeprefix('workpump_')}={v}" for k, v in self.total_fields().items()
        )


def flushers_state(supervisor: Supervisor) -> str:
    """'ok', or each stalled flusher with its failures, age, backlog and last error."""
    stalled = [h.summary() for h in supervisor.flusher_health() if h.stalled]
    return "STALLED " + "; ".join(stalled) if stalled else "ok"
