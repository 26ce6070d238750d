"""Schema version 6: purges for dead rows and received ids; pinned search_path."""

from django.db import migrations, models

from django_workpump.sql import function_definitions, read

SQL_FILES = ["v6/retention.sql"]
V5_REPLACED = ["receive"]

# Back to what the earlier migrations left: each function's search_path captured from
# the migrating session.
UNPIN_SEARCH_PATH = """
DO $$
DECLARE
    v_function record;
BEGIN
    FOR v_function IN
        SELECT p.oid::regprocedure AS signature FROM pg_proc p
        WHERE p.pronamespace = 'workpump'::regnamespace
          AND EXISTS (SELECT 1 FROM unnest(p.proconfig) c WHERE c LIKE 'search_path=%')
    LOOP
        EXECUTE format('ALTER FUNCTION %s SET search_path FROM CURRENT', v_function.signature);
    END LOOP;
END
$$;
"""


class Migration(migrations.Migration):
    dependencies = [("workpump", "0008_functions_v5_payload_limits")]

    operations = [
        migrations.AddIndex(
            model_name="inboxdedup",
            index=models.Index(fields=["first_seen_at"], name="wp_inbox_dedup_seen"),
        ),
        migrations.RunSQL(
            sql=[read(path) for path in SQL_FILES],
            reverse_sql=[
                "DROP FUNCTION workpump.pin_search_path();"
                "DROP FUNCTION workpump.purge_dead(text, timestamptz, integer);"
                "DROP FUNCTION workpump.purge_inbox_dedup(timestamptz, integer);"
                "DROP FUNCTION workpump.receive(uuid, text, jsonb, text, integer, timestamptz, "
                "integer, integer, bigint, integer, boolean);",
                *function_definitions("v5/producers.sql", V5_REPLACED),
                UNPIN_SEARCH_PATH,
            ],
        ),
    ]
