"""Schema version 2, part 1: operator eviction of a named instance."""

from django.db import migrations

from django_workpump.sql import read

SQL_FILES = ["v2/evict.sql"]


class Migration(migrations.Migration):
    dependencies = [("workpump", "0003_admin_permissions")]

    operations = [
        migrations.RunSQL(
            sql=[read(path) for path in SQL_FILES],
            reverse_sql=["DROP FUNCTION IF EXISTS workpump.evict_instance(uuid, text, timestamptz)"],
        ),
    ]
