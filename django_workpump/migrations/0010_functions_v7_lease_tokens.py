"""Schema version 7: claims of the topics an instance can run, a lease token per claim
that fences every later write, and no claim or renewal for an evicted instance."""

from django.db import migrations, models

from django_workpump.sql import PIN_SEARCH_PATH, function_definitions, read

SQL_FILES = ["v7/common.sql", "v7/claim.sql", "v7/outcomes.sql"]
V1_CLAIM_REPLACED = ["claim_category", "claim_work"]
V1_OUTCOMES_REPLACED = ["renew_leases", "complete_work", "fail_work", "release_work"]


def lease_token() -> models.UUIDField:
    return models.UUIDField(blank=True, editable=False, null=True)


class Migration(migrations.Migration):
    dependencies = [("workpump", "0009_functions_v6_retention")]

    operations = [
        migrations.AddField(model_name="outbox", name="lease_token", field=lease_token()),
        migrations.AddField(model_name="inbox", name="lease_token", field=lease_token()),
        migrations.AddField(
            model_name="perspectiveevent", name="lease_token", field=lease_token()
        ),
        migrations.AddField(
            model_name="receptorprocessing", name="lease_token", field=lease_token()
        ),
        migrations.AddField(
            model_name="taskattempt",
            name="lease_token",
            field=models.UUIDField(blank=True, null=True),
        ),
        migrations.RunSQL(
            sql=[*(read(path) for path in SQL_FILES), PIN_SEARCH_PATH],
            reverse_sql=[
                "DROP FUNCTION workpump.claim_work(uuid, integer, integer, integer, text[], "
                "integer, integer, timestamptz, jsonb);"
                "DROP FUNCTION workpump.claim_topics(jsonb, text);"
                "DROP FUNCTION workpump.claim_category(text, uuid, integer, timestamptz, "
                "timestamptz, integer, integer, text[]);"
                "DROP TYPE workpump.leased_work;"
                "DROP FUNCTION workpump.renew_leases(text, uuid[], uuid[], integer, uuid, "
                "timestamptz);"
                "DROP FUNCTION workpump.complete_work(uuid, text, uuid[], uuid[], jsonb[], "
                "timestamptz);"
                "DROP FUNCTION workpump.fail_work(uuid, text, uuid[], uuid[], text[], text[], "
                "integer, integer, timestamptz);"
                "DROP FUNCTION workpump.release_work(uuid, text, uuid[], uuid[], timestamptz);"
                "DROP FUNCTION workpump.check_lease_tokens(text, uuid[], uuid[]);"
                "DROP FUNCTION workpump.check_instance(text, uuid);",
                *function_definitions("v1/claim.sql", V1_CLAIM_REPLACED),
                *function_definitions("v1/outcomes.sql", V1_OUTCOMES_REPLACED),
                PIN_SEARCH_PATH,
            ],
        ),
    ]
