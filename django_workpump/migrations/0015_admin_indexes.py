"""Partial indexes for the admin's state and stuck filters and the status counts.

Each holds rows in a rare state only (orphaned by an eviction, waiting unleased for a
retry or deferral, past half their attempts), so a claim or renewal never maintains it
(docs/admin.md, "At millions of rows").
"""

import django.db.models.expressions
from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("workpump", "0014_functions_v10_unique_keys_subscriptions"),
    ]

    operations = [
        migrations.AddIndex(
            model_name="inbox",
            index=models.Index(
                condition=models.Q(
                    ("dead_lettered_at__isnull", True),
                    ("processed_at__isnull", True),
                    ("claimed_at__isnull", False),
                    ("instance_id__isnull", True),
                ),
                fields=["seq"],
                name="wp_inbox_orphan",
            ),
        ),
        migrations.AddIndex(
            model_name="inbox",
            index=models.Index(
                condition=models.Q(
                    ("dead_lettered_at__isnull", True),
                    ("processed_at__isnull", True),
                    ("instance_id__isnull", True),
                    ("scheduled_for__isnull", False),
                ),
                fields=["scheduled_for"],
                name="wp_inbox_waiting",
            ),
        ),
        migrations.AddIndex(
            model_name="inbox",
            index=models.Index(
                condition=models.Q(
                    ("dead_lettered_at__isnull", True),
                    ("processed_at__isnull", True),
                    ("attempts__gt", 1),
                    (
                        "max_attempts__lte",
                        django.db.models.expressions.CombinedExpression(
                            models.F("attempts"), "*", models.Value(2)
                        ),
                    ),
                ),
                fields=["seq"],
                name="wp_inbox_retried",
            ),
        ),
        migrations.AddIndex(
            model_name="outbox",
            index=models.Index(
                condition=models.Q(
                    ("dead_lettered_at__isnull", True),
                    ("processed_at__isnull", True),
                    ("claimed_at__isnull", False),
                    ("instance_id__isnull", True),
                ),
                fields=["seq"],
                name="wp_outbox_orphan",
            ),
        ),
        migrations.AddIndex(
            model_name="outbox",
            index=models.Index(
                condition=models.Q(
                    ("dead_lettered_at__isnull", True),
                    ("processed_at__isnull", True),
                    ("instance_id__isnull", True),
                    ("scheduled_for__isnull", False),
                ),
                fields=["scheduled_for"],
                name="wp_outbox_waiting",
            ),
        ),
        migrations.AddIndex(
            model_name="outbox",
            index=models.Index(
                condition=models.Q(
                    ("dead_lettered_at__isnull", True),
                    ("processed_at__isnull", True),
                    ("attempts__gt", 1),
                    (
                        "max_attempts__lte",
                        django.db.models.expressions.CombinedExpression(
                            models.F("attempts"), "*", models.Value(2)
                        ),
                    ),
                ),
                fields=["seq"],
                name="wp_outbox_retried",
            ),
        ),
        migrations.AddIndex(
            model_name="perspectiveevent",
            index=models.Index(
                condition=models.Q(
                    ("dead_lettered_at__isnull", True),
                    ("processed_at__isnull", True),
                    ("claimed_at__isnull", False),
                    ("instance_id__isnull", True),
                ),
                fields=["seq"],
                name="wp_persp_orphan",
            ),
        ),
        migrations.AddIndex(
            model_name="perspectiveevent",
            index=models.Index(
                condition=models.Q(
                    ("dead_lettered_at__isnull", True),
                    ("processed_at__isnull", True),
                    ("instance_id__isnull", True),
                    ("scheduled_for__isnull", False),
                ),
                fields=["scheduled_for"],
                name="wp_persp_waiting",
            ),
        ),
        migrations.AddIndex(
            model_name="perspectiveevent",
            index=models.Index(
                condition=models.Q(
                    ("dead_lettered_at__isnull", True),
                    ("processed_at__isnull", True),
                    ("attempts__gt", 1),
                    (
                        "max_attempts__lte",
                        django.db.models.expressions.CombinedExpression(
                            models.F("attempts"), "*", models.Value(2)
                        ),
                    ),
                ),
                fields=["seq"],
                name="wp_persp_retried",
            ),
        ),
        migrations.AddIndex(
            model_name="receptorprocessing",
            index=models.Index(
                condition=models.Q(
                    ("completed_at__isnull", True),
                    ("dead_lettered_at__isnull", True),
                    ("claimed_at__isnull", False),
                    ("instance_id__isnull", True),
                ),
                fields=["seq"],
                name="wp_receptor_orphan",
            ),
        ),
        migrations.AddIndex(
            model_name="receptorprocessing",
            index=models.Index(
                condition=models.Q(
                    ("completed_at__isnull", True),
                    ("dead_lettered_at__isnull", True),
                    ("instance_id__isnull", True),
                    ("scheduled_for__isnull", False),
                ),
                fields=["scheduled_for"],
                name="wp_receptor_waiting",
            ),
        ),
        migrations.AddIndex(
            model_name="receptorprocessing",
            index=models.Index(
                condition=models.Q(
                    ("completed_at__isnull", True),
                    ("dead_lettered_at__isnull", True),
                    ("attempts__gt", 1),
                    (
                        "max_attempts__lte",
                        django.db.models.expressions.CombinedExpression(
                            models.F("attempts"), "*", models.Value(2)
                        ),
                    ),
                ),
                fields=["seq"],
                name="wp_receptor_retried",
            ),
        ),
    ]
