"""Schema version 13: headers stored with every work row and returned by the claim."""

from django.db import migrations, models

from django_workpump.sql import PIN_SEARCH_PATH, function_definitions, read

SQL_FILES = ["v13/producers.sql", "v13/claim.sql"]
V10_REPLACED = ["send", "receive", "emit"]
V11_REPLACED = [
    "claim_outbox",
    "claim_inbox",
    "claim_perspective_event",
    "claim_receptor",
    "claim_work",
]
CLAIM_ARGUMENTS = "uuid, integer, integer, integer, integer, text[], timestamptz, text[]"


def headers_field() -> models.JSONField:
    return models.JSONField(blank=True, editable=False, null=True)


class Migration(migrations.Migration):
    dependencies = [
        ("workpump", "0017_functions_v12_bulk_producers"),
    ]

    operations = [
        migrations.AddField(model_name="outbox", name="headers", field=headers_field()),
        migrations.AddField(model_name="inbox", name="headers", field=headers_field()),
        migrations.AddField(model_name="perspectiveevent", name="headers", field=headers_field()),
        migrations.AddField(model_name="receptorprocessing", name="headers", field=headers_field()),
        # One statement list item per file: Django must not split dollar-quoted bodies.
        migrations.RunSQL(
            sql=[*(read(path) for path in SQL_FILES), PIN_SEARCH_PATH],
            reverse_sql=[
                "DROP FUNCTION workpump.send(text, jsonb, text, integer, timestamptz, integer, "
                "uuid, integer, bigint, integer, text, interval, text, timestamptz, jsonb);"
                "DROP FUNCTION workpump.emit(text, jsonb, text, jsonb, uuid, integer, integer, "
                "bigint, integer, text, interval, text, timestamptz, jsonb);"
                "DROP FUNCTION workpump.receive(uuid, text, jsonb, text, integer, timestamptz, "
                "integer, integer, bigint, integer, boolean, text, interval, text, timestamptz, "
                "jsonb);"
                "DROP FUNCTION workpump.check_headers(text, text, jsonb);"
                "DROP FUNCTION workpump.claim_work(uuid, integer, integer, integer, text[], "
                "integer, integer, timestamptz, jsonb, jsonb);"
                f"DROP FUNCTION workpump.claim_outbox({CLAIM_ARGUMENTS});"
                f"DROP FUNCTION workpump.claim_inbox({CLAIM_ARGUMENTS});"
                f"DROP FUNCTION workpump.claim_perspective_event({CLAIM_ARGUMENTS});"
                f"DROP FUNCTION workpump.claim_receptor({CLAIM_ARGUMENTS});"
                "ALTER TYPE workpump.leased_work DROP ATTRIBUTE headers;",
                *function_definitions("v10/producers.sql", V10_REPLACED),
                *function_definitions("v11/claim_prefixes.sql", V11_REPLACED),
                PIN_SEARCH_PATH,
            ],
        ),
    ]
