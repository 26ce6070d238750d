"""Schema version 9: one static claim statement per category, called by claim_work."""

from django.db import migrations

from django_workpump.sql import PIN_SEARCH_PATH, function_definitions, read

SQL_FILES = ["v9/claim.sql"]
V7_CLAIM_REPLACED = ["claim_category", "claim_work"]
CLAIM_ARGUMENTS = "uuid, integer, integer, integer, integer, text[], timestamptz"


class Migration(migrations.Migration):
    dependencies = [("workpump", "0012_periodic_schedules")]

    operations = [
        # One statement list item per file: Django must not split dollar-quoted bodies.
        migrations.RunSQL(
            sql=[*(read(path) for path in SQL_FILES), PIN_SEARCH_PATH],
            reverse_sql=[
                "DROP FUNCTION workpump.claim_work(uuid, integer, integer, integer, text[], "
                "integer, integer, timestamptz, jsonb);"
                f"DROP FUNCTION workpump.claim_outbox({CLAIM_ARGUMENTS});"
                f"DROP FUNCTION workpump.claim_inbox({CLAIM_ARGUMENTS});"
                f"DROP FUNCTION workpump.claim_perspective_event({CLAIM_ARGUMENTS});"
                f"DROP FUNCTION workpump.claim_receptor({CLAIM_ARGUMENTS});",
                *function_definitions("v7/claim.sql", V7_CLAIM_REPLACED),
                PIN_SEARCH_PATH,
            ],
        ),
    ]
