"""Schema version 22: the claim statements lease the heads first, runs only with streams."""

from django.db import migrations

from django_workpump.sql import PIN_SEARCH_PATH, read, replacing_definitions

SQL_FILES = ["v22/claim_heads_first.sql"]
CLAIMS = ["claim_outbox", "claim_inbox", "claim_perspective_event", "claim_receptor"]


class Migration(migrations.Migration):
    dependencies = [("workpump", "0028_functions_v21_claim_in_fewer_statements")]

    operations = [
        # One statement list item per file: Django must not split dollar-quoted bodies.
        migrations.RunSQL(
            sql=[*(read(path) for path in SQL_FILES), PIN_SEARCH_PATH],
            reverse_sql=[
                *replacing_definitions("v16/claim.sql", CLAIMS),
                read("v20/claim_plans.sql"),  # v16's bodies, planned once per session
                PIN_SEARCH_PATH,
            ],
        ),
    ]
