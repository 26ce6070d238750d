"""Schema version 15: a claim can lease a stream's head with a run of the rows after it."""

from django.db import migrations

from django_workpump.sql import PIN_SEARCH_PATH, function_definitions, read

SQL_FILES = ["v15/claim.sql"]
V13_CLAIM_REPLACED = [
    "claim_outbox",
    "claim_inbox",
    "claim_perspective_event",
    "claim_receptor",
    "claim_work",
]
V1_OUTCOMES_REPLACED = ["promote_stream_heads"]
CLAIM_ARGUMENTS = "uuid, integer, integer, integer, integer, text[], timestamptz, text[], integer"


class Migration(migrations.Migration):
    dependencies = [("workpump", "0020_control_flow_cancellation")]

    operations = [
        # One statement list item per file: Django must not split dollar-quoted bodies.
        migrations.RunSQL(
            sql=[*(read(path) for path in SQL_FILES), PIN_SEARCH_PATH],
            reverse_sql=[
                "DROP FUNCTION workpump.claim_work(uuid, integer, integer, integer, text[], "
                "integer, integer, timestamptz, jsonb, jsonb, integer);"
                f"DROP FUNCTION workpump.claim_outbox({CLAIM_ARGUMENTS});"
                f"DROP FUNCTION workpump.claim_inbox({CLAIM_ARGUMENTS});"
                f"DROP FUNCTION workpump.claim_perspective_event({CLAIM_ARGUMENTS});"
                f"DROP FUNCTION workpump.claim_receptor({CLAIM_ARGUMENTS});",
                *function_definitions("v13/claim.sql", V13_CLAIM_REPLACED),
                *(
                    definition.replace("CREATE FUNCTION", "CREATE OR REPLACE FUNCTION", 1)
                    for definition in function_definitions("v1/outcomes.sql", V1_OUTCOMES_REPLACED)
                ),
                PIN_SEARCH_PATH,
            ],
        ),
    ]
