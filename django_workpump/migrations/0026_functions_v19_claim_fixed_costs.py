"""Schema version 19: claim_work reads its topics and its rank in one statement each."""

from django.db import migrations

from django_workpump.sql import PIN_SEARCH_PATH, read, replacing_definitions

SQL_FILES = ["v19/claim.sql"]


class Migration(migrations.Migration):
    dependencies = [("workpump", "0025_functions_v18_stream_locks_first")]

    operations = [
        # One statement list item per file: Django must not split dollar-quoted bodies.
        migrations.RunSQL(
            sql=[*(read(path) for path in SQL_FILES), PIN_SEARCH_PATH],
            reverse_sql=[
                *replacing_definitions("v16/claim.sql", ["claim_work"]),
                # pinned to the workpump schema's path again by PIN_SEARCH_PATH
                "ALTER FUNCTION workpump.any_topic_chosen(text[], text[])"
                " SET search_path = pg_catalog, pg_temp",
                PIN_SEARCH_PATH,
            ],
        ),
    ]
