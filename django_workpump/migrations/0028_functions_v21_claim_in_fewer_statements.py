"""Schema version 21: claim_work in fewer statements."""

from django.db import migrations

from django_workpump.sql import PIN_SEARCH_PATH, read, replacing_definitions

SQL_FILES = ["v21/claim.sql"]


class Migration(migrations.Migration):
    dependencies = [("workpump", "0027_functions_v20_claim_plans_once_per_session")]

    operations = [
        # One statement list item per file: Django must not split dollar-quoted bodies.
        migrations.RunSQL(
            sql=[*(read(path) for path in SQL_FILES), PIN_SEARCH_PATH],
            reverse_sql=[*replacing_definitions("v19/claim.sql", ["claim_work"]), PIN_SEARCH_PATH],
        ),
    ]
