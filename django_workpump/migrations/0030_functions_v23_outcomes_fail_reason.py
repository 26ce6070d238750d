"""Schema version 23: a row whose last attempt timed out is dead with reason 'timeout'."""

from django.db import migrations

from django_workpump.sql import PIN_SEARCH_PATH, read, replacing_definitions

SQL_FILES = ["v23_outcomes/fail_reason.sql"]


class Migration(migrations.Migration):
    dependencies = [("workpump", "0029_functions_v22_claim_heads_first")]

    operations = [
        # One statement list item per file: Django must not split dollar-quoted bodies.
        migrations.RunSQL(
            sql=[*(read(path) for path in SQL_FILES), PIN_SEARCH_PATH],
            reverse_sql=[*replacing_definitions("v14/control.sql", ["fail_work"]), PIN_SEARCH_PATH],
        ),
    ]
