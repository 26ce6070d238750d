"""Schema version 3: a grace period before evicting an instance whose alive-lock went missing."""

from django.db import migrations, models

from django_workpump.sql import function_definitions, read

SQL_FILES = ["v3/liveness.sql"]
V1_REPLACED = ["cleanup_stale_instances", "reap_without_waiting", "record_heartbeat"]


class Migration(migrations.Migration):
    dependencies = [("workpump", "0005_task_attempts")]

    operations = [
        migrations.AddField(
            model_name="serviceinstance",
            name="alive_lock_lost_at",
            field=models.DateTimeField(blank=True, editable=False, null=True),
        ),
        migrations.RunSQL(
            sql=[read(path) for path in SQL_FILES],
            reverse_sql=[
                "DROP FUNCTION workpump.record_heartbeat(uuid, text, text, integer, jsonb, "
                "integer, integer, timestamptz, double precision);"
                "DROP FUNCTION workpump.reap_without_waiting(timestamptz, timestamptz, "
                "timestamptz, double precision);"
                "DROP FUNCTION workpump.cleanup_stale_instances(timestamptz, timestamptz, "
                "timestamptz, double precision);"
                "DROP FUNCTION workpump.stale_peer_exists(uuid, integer, timestamptz);"
                "DROP FUNCTION workpump.observe_alive_locks(timestamptz);",
                *function_definitions("v1/liveness.sql", V1_REPLACED),
            ],
        ),
    ]
