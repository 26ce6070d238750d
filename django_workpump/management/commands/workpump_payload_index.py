"""``manage.py workpump_payload_index``: the opt-in GIN indexes of admin payload searches."""

from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand, CommandParser

from django_workpump import db
from django_workpump.conf import get_settings


class Command(BaseCommand):
    help = (
        "Create (or with --drop, drop) GIN indexes (jsonb_path_ops) on the payloads of the "
        "outbox, the inbox and the events, so an admin payload search (user_id=7) over a "
        "whole table uses an index. CONCURRENTLY: writers are not blocked, but every insert "
        "then also writes the index (docs/admin.md, 'Search')."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--drop", action="store_true", help="Drop the indexes instead.")
        parser.add_argument("--database", metavar="ALIAS", help="Default: WORKPUMP DATABASE_ALIAS.")

    def handle(self, *args: Any, **options: Any) -> None:
        alias = options["database"] or get_settings()["DATABASE_ALIAS"]
        names = db.payload_indexes(create=not options["drop"], using=alias)
        verb = "Dropped" if options["drop"] else "Created (or found)"
        self.stdout.write(f"{verb} {', '.join(names)} on database {alias!r}.")
