"""The _held indexes key held rows by holder, then seq (was: holder only).

The admin's stuck and owner = not-live pages read each holder's rows newest first and
stop after a page (docs/admin.md, "At millions of rows"). A claim adds one entry to
this index as before, now 8 bytes wider. Building it reads the table once, like any
index; on a large table run the migration when a short write pause is acceptable.
"""

from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("workpump", "0018_functions_v13_headers"),
    ]

    operations = [
        migrations.RemoveIndex(
            model_name="inbox",
            name="wp_inbox_held",
        ),
        migrations.RemoveIndex(
            model_name="outbox",
            name="wp_outbox_held",
        ),
        migrations.RemoveIndex(
            model_name="perspectiveevent",
            name="wp_persp_held",
        ),
        migrations.RemoveIndex(
            model_name="receptorprocessing",
            name="wp_receptor_held",
        ),
        migrations.AddIndex(
            model_name="inbox",
            index=models.Index(
                condition=models.Q(("instance_id__isnull", False)),
                fields=["instance_id", "seq"],
                name="wp_inbox_held",
            ),
        ),
        migrations.AddIndex(
            model_name="outbox",
            index=models.Index(
                condition=models.Q(("instance_id__isnull", False)),
                fields=["instance_id", "seq"],
                name="wp_outbox_held",
            ),
        ),
        migrations.AddIndex(
            model_name="perspectiveevent",
            index=models.Index(
                condition=models.Q(("instance_id__isnull", False)),
                fields=["instance_id", "seq"],
                name="wp_persp_held",
            ),
        ),
        migrations.AddIndex(
            model_name="receptorprocessing",
            index=models.Index(
                condition=models.Q(("instance_id__isnull", False)),
                fields=["instance_id", "seq"],
                name="wp_receptor_held",
            ),
        ),
    ]
