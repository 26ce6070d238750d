"""Schema version 11: claim_work also claims the topics that start with given prefixes."""

from django.db import migrations

from django_workpump.sql import PIN_SEARCH_PATH, function_definitions, read

SQL_FILES = ["v11/claim_prefixes.sql"]
V9_CLAIM_REPLACED = [
    "claim_outbox",
    "claim_inbox",
    "claim_perspective_event",
    "claim_receptor",
    "claim_work",
]
CLAIM_ARGUMENTS = "uuid, integer, integer, integer, integer, text[], timestamptz, text[]"


class Migration(migrations.Migration):
    dependencies = [("workpump", "0015_admin_indexes")]

    operations = [
        # One statement list item per file: Django must not split dollar-quoted bodies.
        migrations.RunSQL(
            sql=[*(read(path) for path in SQL_FILES), PIN_SEARCH_PATH],
            reverse_sql=[
                "DROP FUNCTION workpump.claim_work(uuid, integer, integer, integer, text[], "
                "integer, integer, timestamptz, jsonb, jsonb);"
                f"DROP FUNCTION workpump.claim_outbox({CLAIM_ARGUMENTS});"
                f"DROP FUNCTION workpump.claim_inbox({CLAIM_ARGUMENTS});"
                f"DROP FUNCTION workpump.claim_perspective_event({CLAIM_ARGUMENTS});"
                f"DROP FUNCTION workpump.claim_receptor({CLAIM_ARGUMENTS});"
                "DROP FUNCTION workpump.any_topic_chosen(text[], text[]);",
                *function_definitions("v9/claim.sql", V9_CLAIM_REPLACED),
                PIN_SEARCH_PATH,
            ],
        ),
    ]
