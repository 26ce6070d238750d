"""Schema version 17: each purge deletes at most its batch (the keys are chosen once)."""

from django.db import migrations

from django_workpump.sql import PIN_SEARCH_PATH, function_definitions, read

SQL_FILES = ["v17/retention.sql"]


def replacing(path: str, names: list[str]) -> list[str]:
    """The definitions of ``names`` in ``path``, as statements that replace them."""
    return [
        definition.replace("CREATE FUNCTION", "CREATE OR REPLACE FUNCTION", 1)
        for definition in function_definitions(path, names)
    ]


class Migration(migrations.Migration):
    dependencies = [("workpump", "0023_dead_and_waiting_indexes_by_seq")]

    operations = [
        # One statement list item per file: Django must not split dollar-quoted bodies.
        migrations.RunSQL(
            sql=[*(read(path) for path in SQL_FILES), PIN_SEARCH_PATH],
            reverse_sql=[
                *replacing(
                    "v1/maintenance.sql",
                    ["purge_processed", "purge_events", "purge_idle_streams"],
                ),
                *replacing("v6/retention.sql", ["purge_dead", "purge_inbox_dedup"]),
                PIN_SEARCH_PATH,
            ],
        ),
    ]
