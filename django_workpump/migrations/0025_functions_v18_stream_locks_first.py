"""Schema version 18: discard_work and cancel_work lock their rows' streams first."""

from django.db import migrations

from django_workpump.sql import PIN_SEARCH_PATH, read, replacing_definitions

SQL_FILES = ["v18/outcomes.sql"]



class Migration(migrations.Migration):
    dependencies = [("workpump", "0024_functions_v17_purge_batches")]

    operations = [
        # One statement list item per file: Django must not split dollar-quoted bodies.
        migrations.RunSQL(
            sql=[*(read(path) for path in SQL_FILES), PIN_SEARCH_PATH],
            reverse_sql=[
                *replacing_definitions("v16/outcomes.sql", ["discard_work"]),
                *replacing_definitions("v14/control.sql", ["cancel_work"]),
                "DROP FUNCTION workpump.lock_streams_of(text, uuid[])",
                PIN_SEARCH_PATH,
            ],
        ),
    ]
