"""Schema version 14: Snooze, Discard and cancellation.

Work rows gain ``end_state`` (a done row that was ``cancelled`` or ``discarded``) and
``snoozes``; the admin gains the cancel permission. The functions are in
``sql/v14/control.sql``: ``state_of`` reports the new states, ``renew_leases`` reports a
cancelled attempt, ``fail_work`` takes a handler's own retry delays, and ``snooze_work``,
``discard_work`` and ``cancel_work`` are new.
"""

import re

from django.db import migrations, models

from django_workpump.sql import PIN_SEARCH_PATH, function_definitions, read

SQL_FILES = ["v14/control.sql"]
V7_REPLACED = ["renew_leases", "fail_work"]


def _state_of_v1() -> str:
    """state_of as schema v1 defined it (a SQL-standard body, which ends with END;)."""
    found = re.search(
        r"^CREATE FUNCTION workpump\.state_of\(.*?^END;$", read("v1/common.sql"), re.M | re.S
    )
    assert found is not None, "v1/common.sql defines state_of"
    return found.group(0)


class Migration(migrations.Migration):
    dependencies = [
        ("workpump", "0019_held_index_by_seq"),
    ]

    operations = [
        migrations.AlterModelOptions(
            name="inbox",
            options={
                "permissions": [
                    ("retry_work", "Can retry scheduled work now"),
                    ("release_work_lease", "Can release work leases"),
                    (
                        "force_release_work_lease",
                        "Can force-release work leases held by live instances",
                    ),
                    ("dead_letter_work", "Can dead-letter work"),
                    ("requeue_work", "Can re-queue dead work"),
                    ("cancel_work", "Can cancel work"),
                ],
                "verbose_name": "inbox message",
            },
        ),
        migrations.AlterModelOptions(
            name="outbox",
            options={
                "permissions": [
                    ("retry_work", "Can retry scheduled work now"),
                    ("release_work_lease", "Can release work leases"),
                    (
                        "force_release_work_lease",
                        "Can force-release work leases held by live instances",
                    ),
                    ("dead_letter_work", "Can dead-letter work"),
                    ("requeue_work", "Can re-queue dead work"),
                    ("cancel_work", "Can cancel work"),
                ],
                "verbose_name": "outbox message",
            },
        ),
        migrations.AlterModelOptions(
            name="perspectiveevent",
            options={
                "permissions": [
                    ("retry_work", "Can retry scheduled work now"),
                    ("release_work_lease", "Can release work leases"),
                    (
                        "force_release_work_lease",
                        "Can force-release work leases held by live instances",
                    ),
                    ("dead_letter_work", "Can dead-letter work"),
                    ("requeue_work", "Can re-queue dead work"),
                    ("cancel_work", "Can cancel work"),
                ],
                "verbose_name": "perspective event",
            },
        ),
        migrations.AlterModelOptions(
            name="receptorprocessing",
            options={
                "permissions": [
                    ("retry_work", "Can retry scheduled work now"),
                    ("release_work_lease", "Can release work leases"),
                    (
                        "force_release_work_lease",
                        "Can force-release work leases held by live instances",
                    ),
                    ("dead_letter_work", "Can dead-letter work"),
                    ("requeue_work", "Can re-queue dead work"),
                    ("cancel_work", "Can cancel work"),
                ],
                "verbose_name": "receptor processing",
                "verbose_name_plural": "receptor processing",
            },
        ),
        migrations.AddField(
            model_name="inbox",
            name="end_state",
            field=models.CharField(blank=True, editable=False, max_length=20, null=True),
        ),
        migrations.AddField(
            model_name="inbox",
            name="snoozes",
            field=models.IntegerField(db_default=0, editable=False),
        ),
        migrations.AddField(
            model_name="outbox",
            name="end_state",
            field=models.CharField(blank=True, editable=False, max_length=20, null=True),
        ),
        migrations.AddField(
            model_name="outbox",
            name="snoozes",
            field=models.IntegerField(db_default=0, editable=False),
        ),
        migrations.AddField(
            model_name="perspectiveevent",
            name="end_state",
            field=models.CharField(blank=True, editable=False, max_length=20, null=True),
        ),
        migrations.AddField(
            model_name="perspectiveevent",
            name="snoozes",
            field=models.IntegerField(db_default=0, editable=False),
        ),
        migrations.AddField(
            model_name="receptorprocessing",
            name="end_state",
            field=models.CharField(blank=True, editable=False, max_length=20, null=True),
        ),
        migrations.AddField(
            model_name="receptorprocessing",
            name="snoozes",
            field=models.IntegerField(db_default=0, editable=False),
        ),
        migrations.AddIndex(
            model_name="inbox",
            index=models.Index(
                condition=models.Q(("processed_at__isnull", False), ("end_state__isnull", False)),
                fields=["processed_at"],
                name="wp_inbox_ended",
            ),
        ),
        migrations.AddIndex(
            model_name="outbox",
            index=models.Index(
                condition=models.Q(("processed_at__isnull", False), ("end_state__isnull", False)),
                fields=["processed_at"],
                name="wp_outbox_ended",
            ),
        ),
        migrations.AddIndex(
            model_name="perspectiveevent",
            index=models.Index(
                condition=models.Q(("processed_at__isnull", False), ("end_state__isnull", False)),
                fields=["processed_at"],
                name="wp_persp_ended",
            ),
        ),
        migrations.AddIndex(
            model_name="receptorprocessing",
            index=models.Index(
                condition=models.Q(("completed_at__isnull", False), ("end_state__isnull", False)),
                fields=["completed_at"],
                name="wp_receptor_ended",
            ),
        ),
        # One statement list item per file: Django must not split dollar-quoted bodies.
        migrations.RunSQL(
            sql=[*(read(path) for path in SQL_FILES), PIN_SEARCH_PATH],
            reverse_sql=[
                "DROP FUNCTION workpump.cancel_work(text, uuid[], timestamptz);"
                "DROP FUNCTION workpump.discard_work(uuid, text, uuid[], uuid[], text[], "
                "timestamptz);"
                "DROP FUNCTION workpump.snooze_work(uuid, text, uuid[], uuid[], "
                "double precision[], integer, timestamptz);"
                "DROP FUNCTION workpump.fail_work(uuid, text, uuid[], uuid[], text[], text[], "
                "integer, integer, timestamptz, double precision[]);"
                "DROP FUNCTION workpump.renew_leases(text, uuid[], uuid[], integer, uuid, "
                "timestamptz);"
                "DROP FUNCTION workpump.state_of(timestamptz, timestamptz, uuid, timestamptz, "
                "timestamptz, timestamptz, timestamptz, text);",
                _state_of_v1(),
                *function_definitions("v7/outcomes.sql", V7_REPLACED),
                PIN_SEARCH_PATH,
            ],
        ),
    ]
