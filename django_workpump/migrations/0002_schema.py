"""The workpump schema: every SQL function, type and sequence, and the insert triggers.

``sql/schema.sql`` is loaded whole; it ends by pinning each function's search_path.
"""

from django.db import migrations

from django_workpump.sql import read

SQL_FILES = ["schema.sql"]


class Migration(migrations.Migration):
    dependencies = [("workpump", "0001_initial")]

    operations = [
        # One statement list item per file: Django must not split dollar-quoted bodies.
        migrations.RunSQL(
            sql=[read(path) for path in SQL_FILES],
            # The insert triggers call the schema's functions, so CASCADE drops them too.
            reverse_sql=["DROP SCHEMA workpump CASCADE"],
        ),
    ]
