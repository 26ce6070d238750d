"""The workpump schema, version 1: every SQL function and the insert triggers.

Released SQL is never edited: a change ships as a new migration with its own files.
"""

from django.db import migrations

from django_workpump.sql import read

SQL_FILES = [
    "v1/common.sql",
    "v1/triggers.sql",
    "v1/producers.sql",
    "v1/liveness.sql",
    "v1/claim.sql",
    "v1/outcomes.sql",
    "v1/maintenance.sql",
]


class Migration(migrations.Migration):
    dependencies = [("workpump", "0001_initial")]

    operations = [
        # One statement list item per file: Django must not split dollar-quoted bodies.
        migrations.RunSQL(
            sql=[read(path) for path in SQL_FILES],
            # The triggers depend on the schema's functions and go with them.
            reverse_sql=["DROP SCHEMA IF EXISTS workpump CASCADE"],
        ),
    ]
