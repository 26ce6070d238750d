"""Schema version 16: the claim returns each row's created_at and due_at; a stream keeps
its owner while its run goes on; the stream lock is inlined."""

from django.db import migrations

from django_workpump.sql import PIN_SEARCH_PATH, function_definitions, read

SQL_FILES = ["v16/claim.sql", "v16/outcomes.sql", "v16/common.sql"]
V15_CLAIM_REPLACED = [
    "claim_outbox",
    "claim_inbox",
    "claim_perspective_event",
    "claim_receptor",
    "claim_work",
]
CLAIM_ARGUMENTS = "uuid, integer, integer, integer, integer, text[], timestamptz, text[], integer"


def replacing(path: str, names: list[str]) -> list[str]:
    """The definitions of ``names`` in ``path``, as statements that replace them."""
    return [
        definition.replace("CREATE FUNCTION", "CREATE OR REPLACE FUNCTION", 1)
        for definition in function_definitions(path, names)
    ]


class Migration(migrations.Migration):
    dependencies = [("workpump", "0021_functions_v15_stream_runs")]

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
                f"DROP FUNCTION workpump.claim_receptor({CLAIM_ARGUMENTS});"
                "ALTER TYPE workpump.leased_work DROP ATTRIBUTE due_at,"
                " DROP ATTRIBUTE created_at;",
                *function_definitions("v15/claim.sql", V15_CLAIM_REPLACED),
                *replacing("v7/outcomes.sql", ["complete_work"]),
                *replacing("v14/control.sql", ["discard_work"]),
                "DROP FUNCTION workpump.hand_over_streams(text, uuid, text[], text[]);",
                *replacing("v1/common.sql", ["lock_stream"]),
                PIN_SEARCH_PATH,
            ],
        ),
    ]
