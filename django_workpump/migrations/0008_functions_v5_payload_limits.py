"""Schema version 5: the SQL producers refuse payloads over a size or nesting limit."""

from django.db import migrations

from django_workpump.sql import function_definitions, read

SQL_FILES = ["v5/producers.sql"]
V1_REPLACED = ["send", "receive", "emit"]


class Migration(migrations.Migration):
    dependencies = [("workpump", "0007_functions_v4_fast_failover")]

    operations = [
        migrations.RunSQL(
            sql=[read(path) for path in SQL_FILES],
            reverse_sql=[
                "DROP FUNCTION workpump.send(text, jsonb, text, integer, timestamptz, integer, "
                "uuid, integer, bigint, integer);"
                "DROP FUNCTION workpump.receive(uuid, text, jsonb, text, integer, timestamptz, "
                "integer, integer, bigint, integer);"
                "DROP FUNCTION workpump.emit(text, jsonb, text, jsonb, uuid, integer, integer, "
                "bigint, integer);"
                "DROP FUNCTION workpump.check_payload(text, text, jsonb, bigint, integer);",
                *function_definitions("v1/producers.sql", V1_REPLACED),
            ],
        ),
    ]
