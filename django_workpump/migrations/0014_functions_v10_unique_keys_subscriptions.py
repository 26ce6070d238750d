"""Schema version 10: unique keys for send and emit; subscriptions in the database."""

import django.db.models.functions.datetime
from django.db import migrations, models

from django_workpump.sql import PIN_SEARCH_PATH, function_definitions, read

SQL_FILES = ["v10/producers.sql"]
V5_REPLACED = ["send", "emit"]
V6_REPLACED = ["receive"]


class Migration(migrations.Migration):
    dependencies = [
        ("workpump", "0013_functions_v9_static_claim"),
    ]

    operations = [
        migrations.CreateModel(
            name="Subscription",
            fields=[
                (
                    "pk",
                    models.CompositePrimaryKey(
                        "event_type",
                        "category",
                        "name",
                        blank=True,
                        editable=False,
                        primary_key=True,
                        serialize=False,
                    ),
                ),
                ("event_type", models.TextField()),
                (
                    "category",
                    models.TextField(
                        choices=[("perspective_event", "perspective"), ("receptor", "receptor")]
                    ),
                ),
                ("name", models.TextField()),
                ("max_attempts", models.IntegerField()),
                (
                    "updated_at",
                    models.DateTimeField(db_default=django.db.models.functions.datetime.Now()),
                ),
            ],
            options={
                "db_table": "workpump_subscription",
                "ordering": ["event_type", "category", "name"],
            },
        ),
        migrations.AddField(
            model_name="event",
            name="unique_key",
            field=models.TextField(blank=True, null=True),
        ),
        migrations.AddField(
            model_name="outbox",
            name="unique_key",
            field=models.TextField(blank=True, null=True),
        ),
        migrations.AddField(
            model_name="inbox",
            name="unique_key",
            field=models.TextField(blank=True, null=True),
        ),
        migrations.AddIndex(
            model_name="inbox",
            index=models.Index(
                condition=models.Q(("unique_key__isnull", False)),
                fields=["handler_name", "unique_key", "created_at"],
                name="wp_inbox_unique_key",
            ),
        ),
        migrations.AddConstraint(
            model_name="inbox",
            constraint=models.UniqueConstraint(
                condition=models.Q(("processed_at__isnull", True), ("unique_key__isnull", False)),
                fields=("handler_name", "unique_key"),
                name="workpump_inbox_unique_key",
            ),
        ),
        migrations.AddIndex(
            model_name="event",
            index=models.Index(
                condition=models.Q(("unique_key__isnull", False)),
                fields=["event_type", "unique_key", "created_at"],
                name="wp_event_unique_key",
            ),
        ),
        migrations.AddIndex(
            model_name="outbox",
            index=models.Index(
                condition=models.Q(("unique_key__isnull", False)),
                fields=["destination", "unique_key", "created_at"],
                name="wp_outbox_unique_key",
            ),
        ),
        migrations.AddConstraint(
            model_name="outbox",
            constraint=models.UniqueConstraint(
                condition=models.Q(("processed_at__isnull", True), ("unique_key__isnull", False)),
                fields=("destination", "unique_key"),
                name="workpump_outbox_unique_key",
            ),
        ),
        migrations.AddConstraint(
            model_name="subscription",
            constraint=models.CheckConstraint(
                condition=models.Q(("category__in", ["perspective_event", "receptor"])),
                name="workpump_subscription_category",
            ),
        ),
        # One statement list item per file: Django must not split dollar-quoted bodies.
        migrations.RunSQL(
            sql=[*(read(path) for path in SQL_FILES), PIN_SEARCH_PATH],
            reverse_sql=[
                "DROP FUNCTION workpump.send(text, jsonb, text, integer, timestamptz, integer, "
                "uuid, integer, bigint, integer, text, interval, text, timestamptz);"
                "DROP FUNCTION workpump.emit(text, jsonb, text, jsonb, uuid, integer, integer, "
                "bigint, integer, text, interval, text, timestamptz);"
                "DROP FUNCTION workpump.receive(uuid, text, jsonb, text, integer, timestamptz, "
                "integer, integer, bigint, integer, boolean, text, interval, text, timestamptz);"
                "DROP FUNCTION workpump.unique_key_holder(text, text, text, interval, timestamptz);"
                "DROP FUNCTION workpump.sync_subscriptions(jsonb, boolean, timestamptz);"
                "DROP FUNCTION workpump.lock_unique_key(text, text, text);"
                "DROP FUNCTION workpump.check_unique_key(text, text, text, interval, text);",
                *function_definitions("v5/producers.sql", V5_REPLACED),
                *function_definitions("v6/retention.sql", V6_REPLACED),
                PIN_SEARCH_PATH,
            ],
        ),
    ]
