"""Schema version 8: periodic schedules, and the functions that fire each slot once."""

import django.db.models.functions.datetime
from django.db import migrations, models

from django_workpump.sql import PIN_SEARCH_PATH, read

SQL_FILES = ["v8/periodic.sql"]


class Migration(migrations.Migration):
    dependencies = [("workpump", "0011_force_release_permission")]

    operations = [
        migrations.CreateModel(
            name="PeriodicSchedule",
            fields=[
                ("name", models.TextField(primary_key=True, serialize=False)),
                ("cron", models.TextField(blank=True, null=True)),
                ("every_seconds", models.IntegerField(blank=True, null=True)),
                ("timezone", models.TextField(db_default="UTC")),
                (
                    "catch_up",
                    models.TextField(
                        choices=[
                            ("latest", "latest: fire the most recent missed slot once"),
                            ("none", "none: skip missed slots"),
                            ("all", "all: fire every missed slot"),
                        ],
                        db_default="latest",
                    ),
                ),
                ("payload", models.JSONField(db_default={})),
                ("priority", models.SmallIntegerField(db_default=0)),
                ("max_attempts", models.IntegerField(db_default=10)),
                ("paused", models.BooleanField(db_default=False)),
                ("last_slot", models.DateTimeField(blank=True, null=True)),
                ("next_fire_at", models.DateTimeField(blank=True, null=True)),
                ("last_fired_at", models.DateTimeField(blank=True, null=True)),
                ("last_message_id", models.UUIDField(blank=True, null=True)),
                (
                    "created_at",
                    models.DateTimeField(db_default=django.db.models.functions.datetime.Now()),
                ),
                (
                    "registered_at",
                    models.DateTimeField(db_default=django.db.models.functions.datetime.Now()),
                ),
                (
                    "updated_at",
                    models.DateTimeField(db_default=django.db.models.functions.datetime.Now()),
                ),
            ],
            options={
                "verbose_name": "periodic schedule",
                "db_table": "workpump_periodic_schedule",
                "ordering": ["name"],
                "constraints": [
                    models.CheckConstraint(
                        condition=models.Q(
                            models.Q(("cron__isnull", False), ("every_seconds__isnull", True)),
                            models.Q(("cron__isnull", True), ("every_seconds__gte", 1)),
                            _connector="OR",
                        ),
                        name="workpump_periodic_one_rule",
                    ),
                    models.CheckConstraint(
                        condition=models.Q(("catch_up__in", ["latest", "none", "all"])),
                        name="workpump_periodic_catch_up",
                    ),
                ],
            },
        ),
        # One statement list item per file: Django must not split dollar-quoted bodies.
        migrations.RunSQL(
            sql=[*(read(path) for path in SQL_FILES), PIN_SEARCH_PATH],
            reverse_sql=[
                "DROP FUNCTION workpump.pause_periodic(text[], boolean, timestamptz);"
                "DROP FUNCTION workpump.skip_periodic(text, timestamptz, timestamptz, "
                "timestamptz);"
                "DROP FUNCTION workpump.fire_periodic(text, timestamptz, timestamptz, integer, "
                "bigint, timestamptz);"
                "DROP FUNCTION workpump.upsert_periodic(text, text, integer, text, text, jsonb, "
                "integer, integer, timestamptz, timestamptz);"
            ],
        ),
    ]
