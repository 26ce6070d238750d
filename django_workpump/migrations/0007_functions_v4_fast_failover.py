"""Schema version 4: a dead instance's missing alive-lock evicts it, however fresh its heartbeat."""

from django.db import migrations

from django_workpump.sql import function_definitions, read

SQL_FILES = ["v4/liveness.sql"]
V3_REPLACED = ["cleanup_stale_instances", "record_heartbeat"]


class Migration(migrations.Migration):
    dependencies = [("workpump", "0006_functions_v3_lock_loss_grace")]

    operations = [
        migrations.RunSQL(
            sql=[read(path) for path in SQL_FILES],
            reverse_sql=[
                "DROP FUNCTION workpump.next_eviction_in(uuid, integer, integer, "
                "double precision, timestamptz);"
                "DROP FUNCTION workpump.record_heartbeat(uuid, text, text, integer, jsonb, "
                "integer, integer, timestamptz, double precision);"
                "DROP FUNCTION workpump.cleanup_stale_instances(timestamptz, timestamptz, "
                "timestamptz, double precision);"
                "DROP FUNCTION workpump.instance_evictable(timestamptz, timestamptz, boolean, "
                "timestamptz, timestamptz, timestamptz, boolean);",
                *function_definitions("v3/liveness.sql", V3_REPLACED),
            ],
        ),
    ]
