"""``manage.py workpump_action``: retry, re-queue, dead-letter, release or cancel work;
evict.

    manage.py workpump_action retry 3f0c... 9a1b...
    manage.py workpump_action cancel --topic reports.nightly --state pending --dry-run
    manage.py workpump_action requeue --category outbox --topic emails.welcome --state dead
    manage.py workpump_action release --state orphaned --older-than 3600 --dry-run
    manage.py workpump_action evict 6d2e...

Rows are chosen by id and/or filters; ``--dry-run`` runs the action in a transaction
that is rolled back, so what it prints is exactly what the action would change. A
selection of more than ``CONFIRM_OVER`` rows is confirmed at a prompt (``--yes`` skips
it; without a terminal the command refuses).
"""

from __future__ import annotations

import sys
import uuid
from collections.abc import Callable
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.db import transaction

from django_workpump import actions, db, status
from django_workpump.conf import get_settings
from django_workpump.pump.supervisor import MISSING_MIGRATIONS
from django_workpump.registry import CATEGORIES

CONFIRM_OVER = 10  # larger selections are confirmed at a prompt
ACTIONS = ("retry", "requeue", "dead-letter", "release", "cancel", "evict")
# What an action leaves alone, for the summary line.
LEFT_ALONE = {
    "retry": "only scheduled rows (waiting for a retry or a deferral) can be retried now",
    "requeue": "only dead rows can be re-queued",
    "dead-letter": "done and dead rows cannot be dead-lettered",
    "release": "only leased or orphaned rows have a lease to release, and rows of a live "
    "instance need --force",
    "cancel": "rows that already ended (done, cancelled, discarded) cannot be cancelled",
}
PAST = {
    "retry": "retried",
    "requeue": "re-queued",
    "dead-letter": "dead-lettered",
    "release": "released",
    "cancel": "cancelled",
}


class Command(BaseCommand):
    help = (
        "Run an operator action on work rows chosen by id or filter (retry, requeue, "
        "dead-letter, release, cancel), or evict instances by id."
    )
    stealth_options = ("stdin",)

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("action", choices=ACTIONS, help="What to do.")
        parser.add_argument(
            "ids", nargs="*", help="Work ids (instance ids for evict); filters narrow them."
        )
        parser.add_argument("--category", choices=CATEGORIES, help="Rows of this category.")
        parser.add_argument("--topic", help="Rows of this destination/handler/perspective/...")
        parser.add_argument("--state", choices=status.STATES, help="Rows in this state.")
        parser.add_argument(
            "--older-than",
            type=float,
            metavar="SECONDS",
            help="Rows created more than SECONDS ago.",
        )
        parser.add_argument("--reason", help="Reason recorded by dead-letter and evict.")
        parser.add_argument(
            "--force",
            action="store_true",
            help="release: also take leases from live instances (the rows may run twice).",
        )
        parser.add_argument(
            "--dry-run", action="store_true", help="Print what would change; change nothing."
        )
        parser.add_argument(
            "--yes", action="store_true", help=f"Do not ask before changing over {CONFIRM_OVER}."
        )

    def handle(self, *args: Any, **options: Any) -> None:
        self.stdin = options.get("stdin") or sys.stdin
        using = get_settings()["DATABASE_ALIAS"]
        if not status.schema_ready(using=using):
            raise CommandError(MISSING_MIGRATIONS)
        action = options["action"]
        filters = {
            "category": options["category"],
            "topic": options["topic"],
            "state": options["state"],
            "older_than_seconds": options["older_than"],
        }
        self._check_options(action, options, filters)
        if action == "evict":
            self._evict(options, using)
        else:
            self._work(action, options, filters, using)

    # -- checks ------------------------------------------------------------------------

    def _check_options(self, action: str, options: dict[str, Any], filters: dict[str, Any]) -> None:
        if options["force"] and action != "release":
            raise CommandError(f"--force applies to release only, not to {action}.")
        if options["reason"] is not None and action not in ("dead-letter", "evict"):
            raise CommandError(f"--reason applies to dead-letter and evict only, not to {action}.")
        if options["older_than"] is not None and options["older_than"] < 0:
            raise CommandError(
                f"--older-than must be 0 or more seconds, not {options['older_than']}."
            )
        if action == "evict":
            if any(value is not None for value in filters.values()):
                raise CommandError(
                    "evict takes instance ids only (see manage.py workpump_status); "
                    "--category, --topic, --state and --older-than select work rows."
                )
            if not options["ids"]:
                raise CommandError("evict needs one or more instance ids.")
        elif not options["ids"] and all(value is None for value in filters.values()):
            raise CommandError(
                f"Name the rows to {action}: give their ids, or select them with --category, "
                "--topic, --state or --older-than (e.g. --state dead --category outbox)."
            )

    def _ids(self, values: list[str], what: str) -> list[uuid.UUID]:
        try:
            return actions.as_ids(values, what)
        except ValueError as exc:
            raise CommandError(str(exc)) from None

    def _confirm(self, count: int, noun: str, action: str, options: dict[str, Any]) -> None:
        """Ask before changing many; refuse without a terminal unless --yes."""
        if count <= CONFIRM_OVER or options["yes"] or options["dry_run"]:
            return
        if not (hasattr(self.stdin, "isatty") and self.stdin.isatty()):
            raise CommandError(
                f"This would {action} {count} {noun}, more than {CONFIRM_OVER}, and there is no "
                "terminal to ask for confirmation. Check the selection with --dry-run, then "
                "pass --yes."
            )
        self.stdout.write(f"{action} {count} {noun}? [y/N] ", ending="")
        self.stdout.flush()
        answer = self.stdin.readline().strip().lower()
        if answer not in ("y", "yes"):
            raise CommandError("Cancelled: nothing was changed.")

    def _in_transaction(self, dry_run: bool, using: str, run: Callable[[], Any]) -> Any:
        with transaction.atomic(using=using):
            result = run()
            if dry_run:
                transaction.set_rollback(True, using=using)
        return result

    # -- work rows ---------------------------------------------------------------------

    def _work(
        self, action: str, options: dict[str, Any], filters: dict[str, Any], using: str
    ) -> None:
        ids = self._ids(options["ids"], "work id") if options["ids"] else None
        selected = db.select_work(ids=ids, using=using, **filters)
        if ids is not None:
            missing = set(ids) - {row.work_id for row in selected}
            for work_id in sorted(missing, key=str):
                self.stderr.write(f"{work_id}: no work row with this id matches; skipped.")
        if not selected:
            self.stdout.write(f"Nothing to {action}: no row matches.")
            return
        noun = "row" if len(selected) == 1 else "rows"
        self._confirm(len(selected), noun, action, options)
        grouped: dict[str, list[uuid.UUID]] = {}
        for row in selected:
            grouped.setdefault(row.category, []).append(row.work_id)
        reason = options["reason"] or "dead-lettered by workpump_action"

        def run() -> set[uuid.UUID]:
            changed: set[uuid.UUID] = set()
            for category, found in grouped.items():
                if action == "retry":
                    changed.update(actions.retry_now(found, category=category, using=using))
                elif action == "requeue":
                    changed.update(actions.requeue_dead(found, category=category, using=using))
                elif action == "cancel":
                    changed.update(actions.cancel(found, category=category, using=using))
                elif action == "dead-letter":
                    changed.update(
                        actions.dead_letter(found, reason, category=category, using=using)
                    )
                else:
                    changed.update(
                        actions.release(found, options["force"], category=category, using=using)
                    )
            return changed

        try:
            changed = self._in_transaction(options["dry_run"], using, run)
        except ValueError as exc:
            raise CommandError(str(exc)) from None
        verb = f"would be {PAST[action]}" if options["dry_run"] else PAST[action]
        for row in selected:
            if row.work_id in changed:
                self.stdout.write(
                    f"{verb}: {row.category} {row.work_id} {row.topic} (was {row.state})"
                )
        summary = f"{action}: {len(changed)} of {len(selected)} selected {noun} {verb}"
        if left := len(selected) - len(changed):
            summary += f"; {left} left as they were ({LEFT_ALONE[action]})"
        if options["dry_run"]:
            summary += "; dry run, nothing was changed"
        self.stdout.write(summary + ".")

    # -- instances ---------------------------------------------------------------------

    def _evict(self, options: dict[str, Any], using: str) -> None:
        ids = self._ids(options["ids"], "instance id")
        noun = "instance" if len(ids) == 1 else "instances"
        self._confirm(len(ids), noun, "evict", options)
        reason = options["reason"] or "evicted with manage.py workpump_action"

        def run() -> list[int]:
            return [actions.evict(instance_id, reason, using=using) for instance_id in ids]

        released = self._in_transaction(options["dry_run"], using, run)
        prefix = "would evict" if options["dry_run"] else "evicted"
        for instance_id, count in zip(ids, released, strict=True):
            self.stdout.write(f"{prefix} {instance_id}: {count} rows released.")
        if options["dry_run"]:
            self.stdout.write("evict: dry run, nothing was changed.")
