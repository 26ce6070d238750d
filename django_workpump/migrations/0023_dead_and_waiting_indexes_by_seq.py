"""The _dead and _waiting indexes key their rows by time, then seq (was: time only).

The admin's dead and scheduled pages show their rows in these indexes' order (most
recently dead-lettered first, soonest due first; docs/admin.md, "At millions of rows"),
so a page reads the rows it shows, however many share one time. Neither index is
written by a claim, a completion or a renewal: a dead-lettering, a failed attempt
waiting for its retry and a deferred send add one entry each, as before, 8 bytes wider.
Building them reads the table once, like any index; on a large table run the migration
when a short write pause is acceptable.
"""

from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("workpump", "0022_functions_v16_claim_times_stream_owner"),
    ]

    operations = [
        migrations.RemoveIndex(
            model_name="inbox",
            name="wp_inbox_dead",
        ),
        migrations.RemoveIndex(
            model_name="inbox",
            name="wp_inbox_waiting",
        ),
        migrations.RemoveIndex(
            model_name="outbox",
            name="wp_outbox_dead",
        ),
        migrations.RemoveIndex(
            model_name="outbox",
            name="wp_outbox_waiting",
        ),
        migrations.RemoveIndex(
            model_name="perspectiveevent",
            name="wp_persp_dead",
        ),
        migrations.RemoveIndex(
            model_name="perspectiveevent",
            name="wp_persp_waiting",
        ),
        migrations.RemoveIndex(
            model_name="receptorprocessing",
            name="wp_receptor_dead",
        ),
        migrations.RemoveIndex(
            model_name="receptorprocessing",
            name="wp_receptor_waiting",
        ),
        migrations.AddIndex(
            model_name="inbox",
            index=models.Index(
                condition=models.Q(
                    ("processed_at__isnull", True), ("dead_lettered_at__isnull", False)
                ),
                fields=["dead_lettered_at", "seq"],
                name="wp_inbox_dead",
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
                fields=["scheduled_for", "seq"],
                name="wp_inbox_waiting",
            ),
        ),
        migrations.AddIndex(
            model_name="outbox",
            index=models.Index(
                condition=models.Q(
                    ("processed_at__isnull", True), ("dead_lettered_at__isnull", False)
                ),
                fields=["dead_lettered_at", "seq"],
                name="wp_outbox_dead",
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
                fields=["scheduled_for", "seq"],
                name="wp_outbox_waiting",
            ),
        ),
        migrations.AddIndex(
            model_name="perspectiveevent",
            index=models.Index(
                condition=models.Q(
                    ("processed_at__isnull", True), ("dead_lettered_at__isnull", False)
                ),
                fields=["dead_lettered_at", "seq"],
                name="wp_persp_dead",
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
                fields=["scheduled_for", "seq"],
                name="wp_persp_waiting",
            ),
        ),
        migrations.AddIndex(
            model_name="receptorprocessing",
            index=models.Index(
                condition=models.Q(
                    ("completed_at__isnull", True), ("dead_lettered_at__isnull", False)
                ),
                fields=["dead_lettered_at", "seq"],
                name="wp_receptor_dead",
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
                fields=["scheduled_for", "seq"],
                name="wp_receptor_waiting",
            ),
        ),
    ]
