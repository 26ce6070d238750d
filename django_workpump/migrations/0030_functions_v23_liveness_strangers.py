"""Schema version 23: advisory locks a stranger cannot turn against the pump, and a lost
alive-lock seen after the last beat wherever in its life an instance dies."""

from django.db import migrations, models

from django_workpump.sql import PIN_SEARCH_PATH, read, replacing_definitions

SQL_FILES = ["v23_liveness/strangers.sql"]

# v16's lock_stream, a SQL-standard body (function_definitions reads dollar-quoted ones).
V16_LOCK_STREAM = """
CREATE OR REPLACE FUNCTION workpump.lock_stream(p_category text, p_scope text, p_stream text)
RETURNS void
LANGUAGE sql
RETURN pg_advisory_xact_lock(
    workpump.lock_namespace('stream'),
    hashtext(p_category || chr(31) || coalesce(p_scope, '') || chr(31) || p_stream)
);
"""


class Migration(migrations.Migration):
    dependencies = [("workpump", "0029_functions_v22_claim_heads_first")]

    operations = [
        migrations.AddField(
            model_name="serviceinstance",
            name="alive_lock_pid",
            field=models.IntegerField(blank=True, editable=False, null=True),
        ),
        # One statement list item per file: Django must not split dollar-quoted bodies.
        migrations.RunSQL(
            sql=[*(read(path) for path in SQL_FILES), PIN_SEARCH_PATH],
            reverse_sql=[
                *replacing_definitions(
                    "v1/liveness.sql", ["held_alive_lock_keys", "take_alive_lock"]
                ),
                *replacing_definitions("v10/producers.sql", ["lock_unique_key"]),
                V16_LOCK_STREAM,
                "DROP FUNCTION workpump.wait_for_xact_lock(integer, integer, text, text);",
                PIN_SEARCH_PATH,
            ],
        ),
    ]
