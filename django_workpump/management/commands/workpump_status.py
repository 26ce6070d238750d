"""``manage.py workpump_status``: counts, blocked streams, dead rows and instances."""

from __future__ import annotations

import json
import math
import socket
from datetime import datetime
from typing import Any

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError, CommandParser

from django_workpump import status
from django_workpump.conf import get_settings
from django_workpump.management.database import ensure_reachable
from django_workpump.pump.supervisor import MISSING_MIGRATIONS

ABBREVIATED_STATES = {"scheduled": "sched", "orphaned": "orphan"}


class Command(BaseCommand):
    help = (
        "Show the work pump's state: rows per category and state, oldest pending age, "
        "blocked streams, dead rows, instances, tombstones and periodic schedules."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument(
            "--json", action="store_true", help="Print one JSON object (for monitoring)."
        )
        parser.add_argument(
            "--database",
            metavar="ALIAS",
            help="The Django database alias to report on (default WORKPUMP DATABASE_ALIAS): "
            "one report per database shard.",
        )
        parser.add_argument(
            "--check",
            action="store_true",
            help="Health check: print one line and exit 1 when something is wrong, else 0 "
            "(a Kubernetes exec probe, cron monitoring).",
        )
        parser.add_argument(
            "--max-age",
            type=float,
            metavar="SECONDS",
            help="With --check: a pending row older than this is unhealthy.",
        )
        parser.add_argument(
            "--max-listener-down",
            type=float,
            default=60,
            metavar="SECONDS",
            help="With --check: a NOTIFY listener down longer than this is unhealthy (60).",
        )
        parser.add_argument(
            "--instance-of-this-host",
            action="store_true",
            help="With --check: judge this host's instance (missing or stale is unhealthy) "
            "rather than the whole fleet.",
        )

    def handle(self, *args: Any, **options: Any) -> None:
        using = options.get("database")
        if using is None:
            using = get_settings()["DATABASE_ALIAS"]
        elif using not in settings.DATABASES:
            raise CommandError(
                f"--database {using!r} is not a Django database; choose one of "
                f"{', '.join(settings.DATABASES)} (settings.DATABASES)."
            )
        ensure_reachable(using)
        if not status.schema_ready(using=using):
            raise CommandError(MISSING_MIGRATIONS)
        report = status.collect(using=using)
        if options["check"]:
            self._check(report, options)
            return
        if options["json"]:
            # json.dumps escapes every control character (and every non-ASCII one).
            self.stdout.write(json.dumps(status.as_json(report), sort_keys=True))
        else:
            # Each line escaped again: text from rows must not forge a line of its own.
            self.stdout.write("\n".join(status.printable(line) for line in render_text(report)))

    def _check(self, report: status.StatusReport, options: dict[str, Any]) -> None:
        problems = status.health_problems(
            report,
            host_name=socket.gethostname() if options["instance_of_this_host"] else None,
            max_pending_age_seconds=options["max_age"],
            max_listener_down_seconds=options["max_listener_down"],
        )
        if problems:
            more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
            self.stdout.write(status.printable(f"UNHEALTHY: {problems[0]}{more}"))
            raise SystemExit(1)
        live = sum(1 for i in report.instances if i.live)
        self.stdout.write(f"OK: {live} live instance{'s' if live != 1 else ''}")


def render_text(report: status.StatusReport) -> list[str]:
    """Return the human report, one line per list item."""
    lines = [
        f"workpump status at {report.taken_at.isoformat()} "
        f"(stale after {report.stale_after_seconds}s, "
        f"definitively dead after {report.definitively_dead_after_seconds}s)",
        "",
    ]
    headers = [
        "category",
        *(ABBREVIATED_STATES.get(s, s) for s in status.STATES),
        "total",
        "oldest pending",
    ]
    rows = [
        [
            c.category,
            *(("~" if s in c.estimated else "") + str(c.counts[s]) for s in status.STATES),
            ("~" if c.estimated else "") + str(c.total),
            _age(c.oldest_pending_age_seconds),
        ]
        for c in report.categories
    ]
    estimated = {s for c in report.categories for s in c.estimated}
    totals = [
        "total",
        *(
            ("~" if s in estimated else "") + str(sum(c.counts[s] for c in report.categories))
            for s in status.STATES
        ),
        ("~" if estimated else "") + str(sum(c.total for c in report.categories)),
        "",
    ]
    lines += _table(headers, [*rows, totals])
    if estimated:
        lines.append(
            f"~ estimated: past {status.EXACT_COUNT_LIMIT:,} done rows a table is not counted "
            "row by row."
        )

    lines += ["", f"blocked streams: {report.blocked_streams_total}"]
    if report.blocked_streams:
        lines += _table(
            ["category", "scope", "stream", "head", "attempts", "waiting", "retry at", "error"],
            [
                [
                    b.category,
                    b.scope or "-",
                    b.stream,
                    b.head_state,
                    f"{b.attempts}/{b.max_attempts}",
                    str(b.waiting),
                    _when(b.retry_at),
                    _short(b.last_error),
                ]
                for b in report.blocked_streams
            ],
        )
        if report.blocked_streams_total > len(report.blocked_streams):
            lines.append(f"  ... and {report.blocked_streams_total - len(report.blocked_streams)}")

    waiting = sum(u.rows for u in report.unhandled)
    lines += ["", f"no live handler: {waiting} rows"]
    if report.unhandled:
        lines += _table(
            ["category", "topic", "rows", "oldest"],
            [
                [
                    u.category,
                    u.topic,
                    ("~" if u.estimated else "") + str(u.rows),
                    _age(u.oldest_age_seconds),
                ]
                for u in report.unhandled
            ],
        )
        lines.append(
            "  no live instance runs these topics: they wait, spending no attempt, until one "
            "with their handler starts (runworkpump --topics may leave them out)."
        )

    dead_total = sum(report.dead_counts.values())
    per_category = ", ".join(f"{k} {v}" for k, v in report.dead_counts.items() if v)
    lines += ["", f"dead rows: {dead_total}" + (f" ({per_category})" if per_category else "")]
    if report.dead_rows:
        lines += _table(
            ["category", "id", "topic", "attempts", "reason", "dead since", "error"],
            [
                [
                    d.category,
                    str(d.work_id),
                    d.topic,
                    f"{d.attempts}/{d.max_attempts}",
                    d.failure_reason or "-",
                    _when(d.dead_lettered_at),
                    _short(d.last_error),
                ]
                for d in report.dead_rows
            ],
        )

    lines += ["", f"instances: {len(report.instances)}"]
    if report.instances:
        lines += _table(
            [
                "instance",
                "service",
                "host",
                "pid",
                "heartbeat",
                "lock",
                "live",
                "listen",
                "flushers",
                "held",
            ],
            [
                [
                    str(i.instance_id),
                    i.service_name,
                    i.host_name,
                    str(i.process_id),
                    f"{_age(i.heartbeat_age_seconds)} ago",
                    _yes(i.alive_lock_held),
                    _yes(i.live),
                    _yes(i.listening),
                    _flushers(i.stalled_flushers),
                    " ".join(
                        f"{k}={'~' if k in i.rows_held_estimated else ''}{v}"
                        for k, v in i.rows_held.items()
                        if v
                    )
                    or "0",
                ]
                for i in report.instances
            ],
        )

    lines += ["", f"tombstones: {len(report.tombstones)}"]
    if report.tombstones:
        lines += _table(
            ["instance", "evicted", "reason"],
            [
                [str(t.instance_id), f"{_age(t.age_seconds)} ago", _short(t.reason, 80)]
                for t in report.tombstones
            ],
        )

    lines += ["", f"periodic schedules: {len(report.periodic)}"]
    if report.periodic:
        lines += _table(
            ["name", "schedule", "catch-up", "next fire", "last slot", "paused", "registered"],
            [
                [
                    p.name,
                    p.schedule,
                    p.catch_up,
                    _when(p.next_fire_at),
                    _when(p.last_slot),
                    _yes(p.paused),
                    _yes(p.registered) if p.registered else "no (not registered)",
                ]
                for p in report.periodic
            ],
        )

    lines += ["", f"flow rules: {len(report.flow_rules)}"]
    if report.flow_rules:
        lines += _table(
            ["rule", "paused", "in flight", "concurrency", "rate", "tokens", "waiting"],
            [
                [
                    r.subject,
                    _yes(r.paused),
                    "-" if r.in_flight is None else str(r.in_flight),
                    _limit(r.concurrency, r.key_concurrency),
                    "-" if r.rate is None else f"{r.rate:g}/s (burst {r.burst:g})",
                    "-" if r.tokens is None else f"{r.tokens:g}",
                    "-" if r.waiting is None else str(r.waiting),
                ]
                for r in report.flow_rules
            ],
        )

    lines += ["", "vacuum (dead row versions and their index entries stay until VACUUM):"]
    lines += _table(
        ["table", "live", "dead", "last vacuum", "autovacuum"],
        [
            [
                t.table_name,
                str(t.live_versions),
                str(t.dead_versions),
                "never" if t.vacuum_age_seconds is None else f"{_age(t.vacuum_age_seconds)} ago",
                "on" if t.autovacuum else "OFF",
            ]
            for t in report.vacuum.tables
        ],
    )
    lines += [_vacuum_behind(t) for t in report.vacuum.tables if t.behind]
    snapshot = report.vacuum.oldest_snapshot
    if snapshot is not None:
        lines.append(
            f"oldest snapshot: pid {snapshot.pid} (role {snapshot.role_name or '?'}, "
            f"application {snapshot.application_name or '?'!r}, {snapshot.state or '?'}), "
            f"its transaction open for {_age(snapshot.open_seconds)}"
        )
    return lines


def _vacuum_behind(table: status.TableVacuum) -> str:
    fix = (
        f"autovacuum is off for it: run VACUUM (ANALYZE) {table.table_name}, or turn it on"
        if not table.autovacuum
        else "if the oldest snapshot below is old, it holds VACUUM back"
    )
    return (
        f"VACUUM is behind on {table.table_name}: {table.dead_versions:,} dead row versions "
        f"against {table.live_versions:,} live, and each claim steps over the index entries "
        f"of done rows; {fix}."
    )


def _limit(concurrency: int | None, key_concurrency: int | None) -> str:
    parts = [] if concurrency is None else [str(concurrency)]
    if key_concurrency is not None:
        parts.append(f"{key_concurrency} per key")
    return ", ".join(parts) or "-"


def _flushers(stalled: dict[str, Any]) -> str:
    """'ok', or which outcome flushers cannot write (e.g. 'STALLED completions')."""
    if not stalled:
        return "ok"
    return "STALLED " + ",".join(name.removeprefix("workpump-") for name in sorted(stalled))


def _table(headers: list[str], rows: list[list[str]]) -> list[str]:
    """Columns two spaces apart; a column of numbers (and '-') is right-aligned. Cells are
    escaped (``status.printable``) before they are measured: they hold text from rows."""
    rows = [[status.printable(cell) for cell in row] for row in rows]
    columns = range(len(headers))
    widths = [max(len(r[i]) for r in [headers, *rows]) for i in columns]
    numeric = [
        any(r[i].replace("/", "").isdigit() for r in rows)
        and all(r[i].replace("/", "").isdigit() or r[i] in {"", "-"} for r in rows)
        for i in columns
    ]

    def line(cells: list[str]) -> str:
        out = [
            cell.rjust(widths[i]) if numeric[i] else cell.ljust(widths[i])
            for i, cell in enumerate(cells)
        ]
        return "  " + "  ".join(out).rstrip()

    return [line(headers), *(line(r) for r in rows)]


def _age(seconds: float | None) -> str:
    """'-' for none, else e.g. '45s', '3m 12s', '2h 5m', '3d 4h'."""
    if seconds is None:
        return "-"
    if not math.isfinite(seconds):  # a time written through SQL: 'infinity'
        return "forever"
    whole = max(int(seconds), 0)
    days, rest = divmod(whole, 86_400)
    hours, rest = divmod(rest, 3_600)
    minutes, secs = divmod(rest, 60)
    if days:
        return f"{days}d {hours}h"
    if hours:
        return f"{hours}h {minutes}m"
    if minutes:
        return f"{minutes}m {secs}s"
    return f"{secs}s"


def _when(value: datetime | str | None) -> str:
    """ISO time; '-' for none; a stored time Python cannot hold (``db.StoredTime``) as is."""
    if value is None:
        return "-"
    return value if isinstance(value, str) else value.isoformat()


def _short(text: str | None, width: int = 60) -> str:
    if not text:
        return "-"
    return text if len(text) <= width else text[: width - 1] + "…"


def _yes(value: bool) -> str:
    return "yes" if value else "no"
