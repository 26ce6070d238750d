"""``manage.py workpump_action``: retry, re-queue, dead-letter, release or cancel work;
evict.

    manage.py workpump_action retry 3f0c... 9a1b...
    manage.py workpump_action cancel --topic reports.nightly --state pending --dry-run
    manage.py workpump_action requeue --category outbox --topic emails.welcome --state dead
    manage.py workpump_action release --state orphaned --older-than 3600 --dry-run
    manage.py workpump_action evict 6d2e...
    manage.py workpump_action pause --topic partner.sync      (resume: the same)
    manage.py workpump_action pause --key partner:acme
    manage.py workpump_action pause --category outbox

Rows are chosen by id and/or filters, flags before or after the ids. ``--dry-run`` runs
the action in a transaction that is rolled back, so what it prints is exactly what the
action would change. A selection holds at most ``SELECTION_CAP`` rows, the oldest,
unless ``--limit N`` or ``--all`` says otherwise; one of more than ``CONFIRM_OVER`` rows
is confirmed at a prompt (``--yes`` skips it; without a terminal the command refuses).
The action locks the selected rows and applies the filters again in the transaction
that changes them, so a row that changed while the prompt waited is left alone, and
the report counts only what was changed.

Work that may be running is protected: ``dead-letter`` leaves leased rows alone and
``evict`` refuses an instance that is live or holds unexpired leases, unless ``--force``
(which always asks first, naming what runs).

``pause`` and ``resume`` act on flow control (docs/flow-control.md), not on rows: a
topic (``--topic``, with ``--category`` when the name is in several), a concurrency or
fairness key (``--key``) or a whole ``--category``. A pause is persisted and in effect
at every instance's next claim; rows keep their attempts and order.
"""

from __future__ import annotations

import math
import sys
import unicodedata
import uuid
from collections.abc import Callable, Sequence
from typing import Any

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.db import transaction

from django_workpump import actions, db, flow, status
from django_workpump.conf import get_settings
from django_workpump.management.database import ensure_reachable
from django_workpump.pump.supervisor import MISSING_MIGRATIONS
from django_workpump.registry import CATEGORIES
from django_workpump.states import WorkState

CONFIRM_OVER = 10  # larger selections are confirmed at a prompt
SELECTION_CAP = 1_000  # rows one run acts on unless --limit or --all
# --older-than up to a century: beyond it the interval overflows PostgreSQL's.
MAX_OLDER_THAN_SECONDS = 100 * 365 * 24 * 3600
MAX_EVICT_REASON_CHARS = 200
RUNNING_SHOWN = 5  # running rows named in a prompt or a refusal
ACTIONS = ("retry", "requeue", "dead-letter", "release", "cancel", "evict", "pause", "resume")
FLOW_ACTIONS = ("pause", "resume")
FORCEABLE = ("release", "dead-letter", "evict")
# A state each action applies to, for the hint of a command that names no rows.
EXAMPLE_STATE = {
    "retry": "scheduled",
    "requeue": "dead",
    "dead-letter": "pending",
    "release": "orphaned",
    "cancel": "pending",
}
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


def _plural(count: int, noun: str) -> str:
    return f"{count} {noun}" if count == 1 else f"{count} {noun}s"


class Command(BaseCommand):
    help = (
        "Run an operator action on work rows chosen by id or filter (retry, requeue, "
        "dead-letter, release, cancel), or evict instances by id."
    )
    stealth_options = ("stdin",)

    def create_parser(self, prog_name: str, subcommand: str, **kwargs: Any) -> CommandParser:
        parser = super().create_parser(prog_name, subcommand, **kwargs)
        # Ids after flags too: plain parse_args ends the ids at the first flag.
        parser.parse_args = parser.parse_intermixed_args  # type: ignore[method-assign]
        return parser

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("action", choices=ACTIONS, help="What to do.")
        parser.add_argument(
            "ids", nargs="*", help="Work ids (instance ids for evict); filters narrow them."
        )
        parser.add_argument("--category", choices=CATEGORIES, help="Rows of this category.")
        parser.add_argument("--topic", help="Rows of this destination/handler/perspective/...")
        parser.add_argument("--state", choices=status.STATES, help="Rows in this state.")
        parser.add_argument(
            "--key", help="pause/resume: a concurrency or fairness key (every topic)."
        )
        parser.add_argument(
            "--older-than", metavar="SECONDS", help="Rows created more than SECONDS ago."
        )
        parser.add_argument("--reason", help="Reason recorded by dead-letter and evict.")
        parser.add_argument(
            "--force",
            action="store_true",
            help="release: also take leases from live instances; dead-letter: also leased "
            "rows; evict: also a live instance or one running rows. Their rows may run twice; "
            "the command asks first, naming what runs.",
        )
        parser.add_argument(
            "--limit",
            metavar="N",
            help=f"Act on at most N rows, the oldest (default {SELECTION_CAP}).",
        )
        parser.add_argument(
            "--all",
            action="store_true",
            help=f"Act on every matching row, however many (no cap of {SELECTION_CAP}).",
        )
        parser.add_argument(
            "--database",
            metavar="ALIAS",
            help="The Django database alias to act on (default WORKPUMP DATABASE_ALIAS): "
            "one per database shard.",
        )
        parser.add_argument(
            "--dry-run", action="store_true", help="Print what would change; change nothing."
        )
        parser.add_argument(
            "--yes", action="store_true", help=f"Do not ask before changing over {CONFIRM_OVER}."
        )

    def handle(self, *args: Any, **options: Any) -> None:
        self.stdin = options.get("stdin") or sys.stdin
        action = options["action"]
        if action in FLOW_ACTIONS:
            self._flow(action, options)
            return
        if options["key"] is not None:
            raise CommandError("--key is for pause and resume; rows are chosen by id or filter.")
        older_than = self._older_than(options["older_than"])
        options["topic"] = self._text("--topic", options["topic"])
        options["reason"] = self._reason(action, options["reason"])
        limit = self._limit(options)
        filters = {
            "category": options["category"],
            "topic": options["topic"],
            "state": options["state"],
            "older_than_seconds": older_than,
        }
        self._check_options(action, options, filters)
        using = self._database(options["database"])
        ensure_reachable(using)
        if not status.schema_ready(using=using):
            raise CommandError(MISSING_MIGRATIONS)
        if action == "evict":
            self._evict(options, using)
        else:
            self._work(action, options, filters, limit, using)

    def _flow(self, action: str, options: dict[str, Any]) -> None:
        """Pause or resume a topic, a key or a category (flow control)."""
        extra = [
            f"--{name.replace('_', '-')}"
            for name in ("state", "older_than", "reason", "limit")
            if options[name] is not None
        ] + (["ids"] if options["ids"] else [])
        if extra:
            raise CommandError(
                f"{action} takes --topic, --key or --category, not {', '.join(extra)}."
            )
        topic = self._text("--topic", options["topic"])
        key = self._text("--key", options["key"])
        using = self._database(options["database"])
        ensure_reachable(using)
        if not status.schema_ready(using=using):
            raise CommandError(MISSING_MIGRATIONS)
        change = flow.pause if action == "pause" else flow.resume
        try:
            with transaction.atomic(using=using):
                change(topic=topic, category=options["category"], key=key, using=using)
        except ValueError as exc:
            raise CommandError(str(exc)) from None
        subject = (
            f"key {key!r}" if key else f"topic {topic!r}" if topic else f"{options['category']}"
        )
        self.stdout.write(f"{'Paused' if action == 'pause' else 'Resumed'} {subject}.")

    # -- checks ------------------------------------------------------------------------

    def _database(self, alias: str | None) -> str:
        if alias is None:
            return str(get_settings()["DATABASE_ALIAS"])
        if alias not in settings.DATABASES:
            raise CommandError(
                f"--database {alias!a} is not a Django database; choose one of "
                f"{', '.join(settings.DATABASES)} (settings.DATABASES)."
            )
        return alias

    def _older_than(self, value: str | None) -> float | None:
        if value is None:
            return None
        try:
            seconds = float(value)
        except ValueError:
            seconds = math.nan
        if not (math.isfinite(seconds) and 0 <= seconds <= MAX_OLDER_THAN_SECONDS):
            raise CommandError(
                f"--older-than must be a number of seconds from 0 to "
                f"{MAX_OLDER_THAN_SECONDS} (100 years), not {value!a}."
            )
        return seconds

    def _text(self, flag: str, value: str | None) -> str | None:
        """``value`` if it is text the database can store: UTF-8, no control characters."""
        if value is None:
            return None
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise CommandError(
                f"{flag} {value!a} is not UTF-8 text (it holds bytes no character "
                "has); give it in UTF-8."
            ) from None
        if any(unicodedata.category(char) == "Cc" for char in value):
            raise CommandError(
                f"{flag} {value!a} holds a control character (a NUL, a newline, ...); "
                "give it as one line of text."
            )
        if not value.strip():
            raise CommandError(f"{flag} is empty; give it some text or leave it out.")
        return value

    def _reason(self, action: str, value: str | None) -> str | None:
        reason = self._text("--reason", value)
        if reason is None:
            return None
        most = actions.MAX_REASON_CHARS if action == "dead-letter" else MAX_EVICT_REASON_CHARS
        if len(reason) > most:
            raise CommandError(
                f"--reason is {len(reason)} characters long, over the {most} {action} "
                "stores; shorten it."
            )
        return reason

    def _limit(self, options: dict[str, Any]) -> int | None:
        """Rows to act on at most; None: every matching row (--all)."""
        value = options["limit"]
        if options["all"]:
            if value is not None:
                raise CommandError("--limit and --all contradict each other; give one of them.")
            return None
        if value is None:
            return SELECTION_CAP
        try:
            limit = int(value)
        except ValueError:
            limit = 0
        if limit < 1:
            raise CommandError(
                f"--limit must be a whole number of rows, at least 1, not {value!a}; "
                "--all lifts the cap."
            )
        return limit

    def _check_options(self, action: str, options: dict[str, Any], filters: dict[str, Any]) -> None:
        if options["force"] and action not in FORCEABLE:
            raise CommandError(
                f"--force applies to release, dead-letter and evict only, not to {action}."
            )
        if options["reason"] is not None and action not in ("dead-letter", "evict"):
            raise CommandError(f"--reason applies to dead-letter and evict only, not to {action}.")
        if action == "evict":
            if any(value is not None for value in filters.values()):
                raise CommandError(
                    "evict takes instance ids only (see manage.py workpump_status); "
                    "--category, --topic, --state and --older-than select work rows."
                )
            if options["limit"] is not None or options["all"]:
                raise CommandError(
                    "evict takes instance ids only; --limit and --all cap a selection of work rows."
                )
            if not options["ids"]:
                raise CommandError("evict needs one or more instance ids.")
        elif not options["ids"] and all(value is None for value in filters.values()):
            raise CommandError(
                f"Name the rows to {action}: give their ids, or select them with --category, "
                "--topic, --state or --older-than (e.g. "
                f"--state {EXAMPLE_STATE[action]} --category outbox)."
            )

    def _ids(self, values: list[str], what: str) -> list[uuid.UUID]:
        try:
            return list(dict.fromkeys(actions.as_ids(values, what)))
        except ValueError as exc:
            raise CommandError(str(exc)) from None

    def _confirm(
        self,
        count: int,
        noun: str,
        action: str,
        options: dict[str, Any],
        running: str | None = None,
    ) -> None:
        """Ask before changing many, or anything running; refuse without a terminal unless
        --yes."""
        if options["yes"] or options["dry_run"]:
            return
        if running is None and count <= CONFIRM_OVER:
            return
        why = f"more than {CONFIRM_OVER}" if running is None else running
        if not (hasattr(self.stdin, "isatty") and self.stdin.isatty()):
            raise CommandError(
                f"This would {action} {count} {noun}, {why}, and there is no terminal to ask "
                "for confirmation. Check the selection with --dry-run, then pass --yes."
            )
        question = f"{action} {count} {noun}"
        if running is not None:
            question += f"; {running}"
        self.stdout.write(f"{question}? [y/N] ", ending="")
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
        self,
        action: str,
        options: dict[str, Any],
        filters: dict[str, Any],
        limit: int | None,
        using: str,
    ) -> None:
        ids = self._ids(options["ids"], "work id") if options["ids"] else None
        fetch = None if limit is None else limit + 1  # one more tells whether more match
        selected = db.select_work(ids=ids, limit=fetch, using=using, **filters)
        capped = limit is not None and len(selected) > limit
        if capped:
            selected = selected[:limit]
        if ids is not None:
            self._report_missing(ids, selected, filters, using)
        if not selected:
            self.stdout.write(f"Nothing to {action}: no row matches.")
            return
        if capped:
            self.stdout.write(
                f"More than {limit} rows match: this acts on the oldest {limit} only. Pass "
                "--limit N to act on up to N rows, or --all for every matching row."
            )
        noun = "row" if len(selected) == 1 else "rows"
        force = options["force"]
        leased = [row for row in selected if row.state == WorkState.LEASED]
        running = None
        if leased and force and action in ("dead-letter", "release"):
            running = self._leased_note(action, leased)
        self._confirm(len(selected), noun, action, options, running)
        reason = options["reason"] or "dead-lettered by workpump_action"

        def act(category: str, found: list[uuid.UUID]) -> list[uuid.UUID]:
            if action == "retry":
                return actions.retry_now(found, category=category, using=using)
            if action == "requeue":
                return actions.requeue_dead(found, category=category, using=using)
            if action == "cancel":
                return actions.cancel(found, category=category, using=using)
            if action == "dead-letter":
                return actions.dead_letter(found, reason, category=category, using=using)
            return actions.release(found, force, category=category, using=using)

        def run() -> tuple[list[db.SelectedWork], set[uuid.UUID], int]:
            # The selection again, locked: rows that changed since it was listed drop out.
            current = db.lock_work(ids=[row.work_id for row in selected], using=using, **filters)
            held = 0
            grouped: dict[str, list[uuid.UUID]] = {}
            for row in current:
                if action == "dead-letter" and not force and row.state == WorkState.LEASED:
                    held += 1  # a running handler's row: only with --force
                    continue
                grouped.setdefault(row.category, []).append(row.work_id)
            changed: set[uuid.UUID] = set()
            for category, found in grouped.items():
                changed.update(act(category, found))
            return current, changed, held

        try:
            current, changed, held = self._in_transaction(options["dry_run"], using, run)
        except ValueError as exc:
            raise CommandError(str(exc)) from None
        verb = f"would be {PAST[action]}" if options["dry_run"] else PAST[action]
        for row in current:
            if row.work_id in changed:
                self.stdout.write(
                    # The topic comes from the row: escaped, it cannot forge a line.
                    f"{verb}: {row.category} {row.work_id} {status.printable(row.topic)} "
                    f"(was {row.state})"
                )
        summary = f"{action}: {len(changed)} of {len(selected)} selected {noun} {verb}"
        if gone := len(selected) - len(current):
            summary += (
                f"; {gone} no longer matched the selection when it was acted on (changed "
                "since it was listed) and were left as they were"
            )
        if held:
            summary += (
                f"; {held} leased by a running instance left as they were (--force "
                "dead-letters them too)"
            )
        if left := len(current) - len(changed) - held:
            summary += f"; {left} left as they were ({LEFT_ALONE[action]})"
        if options["dry_run"]:
            summary += "; dry run, nothing was changed"
        self.stdout.write(summary + ".")

    def _report_missing(
        self,
        ids: list[uuid.UUID],
        selected: Sequence[db.SelectedWork],
        filters: dict[str, Any],
        using: str,
    ) -> None:
        missing = set(ids) - {row.work_id for row in selected}
        if not missing:
            return
        filtered = any(value is not None for value in filters.values())
        exist = {row.work_id for row in db.select_work(ids=sorted(missing), using=using)}
        for work_id in sorted(missing, key=str):
            if work_id not in exist:
                self.stderr.write(f"{work_id}: no work row has this id; skipped.")
            elif filtered:
                self.stderr.write(f"{work_id}: its row does not match the filters; skipped.")
            else:
                self.stderr.write(
                    f"{work_id}: past the cap of this selection (--limit, --all); skipped."
                )

    def _leased_note(self, action: str, leased: list[db.SelectedWork]) -> str:
        shown = ", ".join(
            f"{row.category} {row.work_id} {status.printable(row.topic)}"
            for row in leased[:RUNNING_SHOWN]
        )
        more = f" and {len(leased) - RUNNING_SHOWN} more" if len(leased) > RUNNING_SHOWN else ""
        return (
            f"{_plural(len(leased), 'row')} of them leased, which a live instance may be "
            f"running now ({shown}{more}); --force {action}s them anyway and the attempt's "
            "outcome is then fenced out"
        )

    # -- instances ---------------------------------------------------------------------

    def _standing(self, ids: list[uuid.UUID], using: str) -> dict[uuid.UUID, Any]:
        s = get_settings()
        return {
            found.instance_id: found
            for found in db.instance_standing(
                ids=ids,
                stale_after_seconds=s["STALE_AFTER_SECONDS"],
                definitively_dead_after_seconds=s["DEFINITIVELY_DEAD_AFTER_SECONDS"],
                using=using,
            )
        }

    def _busy_note(self, busy: list[db.InstanceStanding], using: str) -> str:
        """One sentence per busy instance: live or not, and the rows it runs."""
        notes = []
        for found in busy:
            rows = db.running_work(ids=[found.instance_id], limit=RUNNING_SHOWN, using=using)
            what = "is live" if found.live else "is not live"
            if found.running:
                shown = ", ".join(
                    f"{r.category} {r.work_id} {status.printable(r.topic)}" for r in rows
                )
                more = found.running - len(rows)
                what += f" and runs {_plural(found.running, 'row')} ({shown}"
                what += f" and {more} more)" if more > 0 else ")"
            else:
                what += " (running no row now)"
            notes.append(f"{found.instance_id} {what}")
        return "; ".join(notes)

    def _evict(self, options: dict[str, Any], using: str) -> None:
        ids = self._ids(options["ids"], "instance id")
        standing = self._standing(ids, using)
        targets: list[uuid.UUID] = []
        unknown = 0
        for instance_id in ids:
            found = standing[instance_id]
            if not found.known:
                # No tombstone either: an id no process registered, and no lease names,
                # cannot hold work, and a process never takes an id it did not make.
                unknown += 1
                self.stderr.write(
                    f"{instance_id}: no instance is registered, tombstoned or holds a lease "
                    "under this id; nothing done. Check the id with manage.py workpump_status."
                )
            elif found.evicted_at is not None and not found.registered and not found.held:
                self.stdout.write(
                    f"{instance_id}: already evicted at {found.evicted_at:%Y-%m-%d %H:%M:%S %Z} "
                    f"({found.evicted_reason}); nothing to do."
                )
            else:
                targets.append(instance_id)
        if not targets:
            if unknown:
                raise CommandError(
                    f"Nothing was evicted: {_plural(unknown, 'instance id')} unknown (see above)."
                )
            return
        busy = [standing[i] for i in targets if standing[i].busy]
        if busy and not options["force"]:
            raise CommandError(self._refusal(busy, using))
        noun = "instance" if len(targets) == 1 else "instances"
        running = None
        if busy:
            running = (
                self._busy_note(busy, using)
                + "; --force evicts it anyway and its rows run again on a peer while it may "
                "still be running them"
            )
        self._confirm(len(targets), noun, "evict", options, running)
        reason = options["reason"] or "evicted with manage.py workpump_action"

        def run() -> list[int]:
            # Again, with the registrations locked: no instance turns busy unnoticed.
            now = self._standing(targets, using)
            turned = [now[i] for i in targets if now[i].busy and not options["force"]]
            if turned:
                raise CommandError(self._refusal(turned, using))
            return [actions.evict(instance_id, reason, using=using) for instance_id in targets]

        released = self._in_transaction(options["dry_run"], using, run)
        prefix = "would evict" if options["dry_run"] else "evicted"
        for instance_id, count in zip(targets, released, strict=True):
            self.stdout.write(f"{prefix} {instance_id}: {_plural(count, 'row')} released.")
        if options["dry_run"]:
            self.stdout.write("evict: dry run, nothing was changed.")

    def _refusal(self, busy: list[db.InstanceStanding], using: str) -> str:
        return (
            f"Nothing was evicted: {self._busy_note(busy, using)}. Evicted, its rows would "
            "run again on a peer while it may still be running them: stop its process "
            "(it exits once its handlers finish), or pass --force to evict it anyway."
        )
