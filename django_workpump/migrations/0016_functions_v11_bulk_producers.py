"""Schema version 11: send_many and emit_many, the bulk producers."""

from django.db import migrations

from django_workpump.sql import PIN_SEARCH_PATH, read

SQL_FILES = ["v11/bulk.sql"]


class Migration(migrations.Migration):
    dependencies = [
        ("workpump", "0015_admin_indexes"),
    ]

    operations = [
        # One statement list item per file: Django must not split dollar-quoted bodies.
        migrations.RunSQL(
            sql=[*(read(path) for path in SQL_FILES), PIN_SEARCH_PATH],
            reverse_sql=[
                "DROP FUNCTION workpump.send_many(text, jsonb[], text[], integer, timestamptz, "
                "integer, uuid[], integer, bigint, integer);"
                "DROP FUNCTION workpump.emit_many(text, jsonb[], text[], jsonb, uuid[], integer, "
                "integer, bigint, integer);"
                "DROP FUNCTION workpump.check_streams(text, text, jsonb[], text[]);"
                "DROP FUNCTION workpump.check_payloads(text, text, jsonb[], bigint, integer);",
                PIN_SEARCH_PATH,
            ],
        ),
    ]
