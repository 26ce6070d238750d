"""Schema version 23 (notify): cancel_work notifies a holder of at most 50 attempts at once."""

from django.db import migrations

from django_workpump.sql import PIN_SEARCH_PATH, read, replacing_definitions

SQL_FILES = ["v23_notify/cancel_chunks.sql"]


class Migration(migrations.Migration):
    dependencies = [("workpump", "0029_functions_v22_claim_heads_first")]

    operations = [
        # One statement list item per file: Django must not split dollar-quoted bodies.
        migrations.RunSQL(
            sql=[*(read(path) for path in SQL_FILES), PIN_SEARCH_PATH],
            reverse_sql=[
                *replacing_definitions("v18/outcomes.sql", ["cancel_work"]),
                PIN_SEARCH_PATH,
            ],
        ),
    ]
