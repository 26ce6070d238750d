"""``manage.py runworkpump``: run this process as one work-pump instance."""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import threading
from typing import Any

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.db import connections

from django_workpump.conf import get_settings
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
    """One JSON object per line, with the record's ``action`` key when it has one."""

    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "time": self.formatTime(record),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        if hasattr(record, "action"):
            entry["action"] = record.action
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry)


class Command(BaseCommand):
    help = "Run a work-pump instance: claim, run and complete work until stopped."

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
        parser.add_argument("--log-format", choices=["text", "json"], default="text")

    def handle(self, *args: Any, **options: Any) -> None:
        log_handler = self._configure_logging(options["log_format"])
        try:
            self._run(options)
        finally:
            if log_handler is not None:
                logger.removeHandler(log_handler)

    def _run(self, options: dict[str, Any]) -> None:
        categories = self._categories(options["categories"])
        if options["concurrency"] is not None and options["concurrency"] < 1:
            raise CommandError(f"--concurrency must be at least 1, not {options['concurrency']}.")
        settings = get_settings()
        alias = settings["DATABASE_ALIAS"]
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
                )
            )
        except TopicSelectionError as exc:
            raise CommandError(str(exc)) from None
        # This thread registers the instance and waits for it: name its connection too.
        name_thread_connections(application_name(supervisor.identity.instance_id, "main"))
        # Before the start: a signal while it registers and claims stops it cleanly.
        previous = self._install_signal_handlers(supervisor)
        try:
            try:
                supervisor.start()
            except SchemaNotReady as exc:
                raise CommandError(str(exc)) from None
            self.stdout.write(self._startup_line(supervisor, alias))
            self.stdout.flush()
            interval = settings["STATUS_INTERVAL_SECONDS"]
            reporter = _StatusReporter(supervisor)
            while not supervisor.wait(interval):
                self.stdout.write(reporter.line())
                self.stdout.flush()
            code = supervisor.shutdown()
        finally:
            for signum, handler in previous.items():
                signal.signal(signum, handler)
        name_thread_connections(None)
        self.stdout.write(
            f"workpump {supervisor.identity.instance_id} stopped: {supervisor.stop_reason} "
            f"(exit {code}); {reporter.totals()}"
        )
        self.stdout.flush()
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
        """Log to stderr unless the project configured logging for the package or the root
        logger (a handler of ours would print every line twice); return what was added."""
        if logger.handlers or project_configures_logging():
            return None
        handler = logging.StreamHandler(sys.stderr)
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

    def _startup_line(self, supervisor: Supervisor, alias: str) -> str:
        s = supervisor.settings
        db = connections[alias].settings_dict
        database = f"{db.get('HOST') or 'localhost'}:{db.get('PORT') or 5432}/{db.get('NAME')}"
        if db.get("HOST", "").startswith("/") or not db.get("HOST"):
            database = f"{db.get('NAME')} (socket)" if not db.get("PORT") else database
        gate = supervisor.gate
        return (
            f"workpump {supervisor.identity.instance_id} started: "
            f"service={supervisor.identity.service_name} pid={supervisor.identity.process_id} "
            f"categories={','.join(supervisor.options.categories)} "
            f"topics={sum(len(t) for t in supervisor.topics.values())} "
            f"{_prefixes_part(supervisor)}"
            f"concurrency={supervisor.dispatcher.concurrency} database={alias}:{database} "
            f"liveness={s['LIVENESS_SOURCE_MODE']} "
            f"listener={'off' if gate is None else 'starting'} "
            f"lease={s['LEASE_SECONDS']}s heartbeat={s['HEARTBEAT_INTERVAL_SECONDS']}s"
        )


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

    def _counters(self) -> tuple[int, int, int]:
        stats = self.supervisor.dispatcher.stats
        return self.supervisor.claim.claimed_total, stats.completed, stats.failed

    def line(self) -> str:
        now = self.clock.monotonic()
        counters = self._counters()
        elapsed = max(now - self._last_at, 1e-9)
        claimed, done, _ = (c - p for c, p in zip(counters, self._last, strict=True))
        self._last_at, self._last = now, counters
        sup = self.supervisor
        gate = sup.gate
        gate_state = "off" if gate is None else ("up" if gate.available else "DOWN")
        wait_ms = sup.claim.current_wait_ms()
        return (
            f"workpump status: claimed/s={claimed / elapsed:.1f} done/s={done / elapsed:.1f} "
            f"failed={sup.dispatcher.stats.failed} in_flight={sup.dispatcher.in_flight} "
            f"renewed={sup.renewal.renewed} abandoned={sup.dispatcher.stats.abandoned} "
            f"lost={sup.dispatcher.stats.lost_leases} gate={gate_state} "
            f"alive_lock={'held' if gate is not None and gate.alive_lock_held else 'no'} "
            f"poll_wait_ms={'signal' if wait_ms is None else wait_ms} "
            f"flushers={flushers_state(sup)}"
        )

    def totals(self) -> str:
        stats = self.supervisor.dispatcher.stats
        return (
            f"claimed={self.supervisor.claim.claimed_total} done={stats.completed} "
            f"failed={stats.failed} abandoned={stats.abandoned} released={stats.released}"
        )


def flushers_state(supervisor: Supervisor) -> str:
    """'ok', or each stalled flusher with its failures, age, backlog and last error."""
    stalled = [h.summary() for h in supervisor.flusher_health() if h.stalled]
    return "STALLED " + "; ".join(stalled) if stalled else "ok"
