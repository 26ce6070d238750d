"""Schema version 12: send_many and emit_many, the bulk producers; the insert trigger
fires only for rows that need it."""

from django.db import migrations

from django_workpump.sql import PIN_SEARCH_PATH, read

SQL_FILES = ["v12/bulk.sql"]


class Migration(migrations.Migration):
    dependencies = [
        ("workpump", "0016_functions_v11_claim_prefixes"),
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
                "DROP FUNCTION workpump.check_payloads(text, text, jsonb[], bigint, integer);"
                "DROP TRIGGER workpump_outbox_before_insert ON workpump_outbox;"
                "CREATE TRIGGER workpump_outbox_before_insert BEFORE INSERT ON workpump_outbox"
                " FOR EACH ROW EXECUTE FUNCTION workpump.before_insert_work('outbox');"
                "DROP TRIGGER workpump_inbox_before_insert ON workpump_inbox;"
                "CREATE TRIGGER workpump_inbox_before_insert BEFORE INSERT ON workpump_inbox"
                " FOR EACH ROW EXECUTE FUNCTION workpump.before_insert_work('inbox');"
                "DROP TRIGGER workpump_perspective_event_before_insert ON workpump_perspective_event;"
                "CREATE TRIGGER workpump_perspective_event_before_insert BEFORE INSERT ON workpump_perspective_event"
                " FOR EACH ROW EXECUTE FUNCTION workpump.before_insert_work('perspective_event');"
                "DROP TRIGGER workpump_receptor_processing_before_insert ON workpump_receptor_processing;"
                "CREATE TRIGGER workpump_receptor_processing_before_insert BEFORE INSERT ON workpump_receptor_processing"
                " FOR EACH ROW EXECUTE FUNCTION workpump.before_insert_work('receptor');",
                PIN_SEARCH_PATH,
            ],
        ),
    ]
