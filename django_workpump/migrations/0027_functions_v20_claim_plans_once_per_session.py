"""Schema version 20: each claim statement is planned once per session, without JIT."""

from django.db import migrations

from django_workpump.sql import read

SQL_FILES = ["v20/claim_plans.sql"]
CLAIMS = ["claim_outbox", "claim_inbox", "claim_perspective_event", "claim_receptor"]
SIGNATURE = "(uuid, integer, integer, integer, integer, text[], timestamptz, text[], integer)"


class Migration(migrations.Migration):
    dependencies = [("workpump", "0026_functions_v19_claim_fixed_costs")]

    operations = [
        migrations.RunSQL(
            sql=[read(path) for path in SQL_FILES],
            reverse_sql=[
                f"ALTER FUNCTION workpump.{name}{SIGNATURE} RESET plan_cache_mode RESET jit"
                for name in CLAIMS
            ],
        ),
    ]
