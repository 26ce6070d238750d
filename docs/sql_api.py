"""Render docs/sql-api.md from a migrated database and sql/schema.sql.

    DATABASE_URL=postgres://... python docs/sql_api.py > docs/sql-api.md

(the database migrated first, e.g. ``python -m django migrate --settings tests.settings``.)

Signatures come from pg_proc; each function's description is the comment block right
above its CREATE FUNCTION in sql/schema.sql.
tests/api/test_docs.py fails when the committed page differs from what this renders.
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path
from typing import Any

from django_workpump.categories import NAMES

SCHEMA_SQL = Path(__file__).resolve().parent.parent / "django_workpump" / "sql" / "schema.sql"
HEADER = """# The SQL API (schema `workpump`)

Signatures as installed by the migrations (read from `pg_proc`), with the comment that
precedes each function in its source, `django_workpump/sql/schema.sql`. Time-dependent
functions take an optional `p_now` for tests; production leaves it NULL and the database
clock rules.

## Overview

The functions live in the schema `workpump`, installed by `migrate` from
`django_workpump/sql/schema.sql`, the whole schema in one file (after a release, each
release's change also ships as a delta with its own migration, and a test keeps the two
equal: [design-decisions.md](design-decisions.md)). The tables are Django's,
in the database's default schema (`workpump_outbox`, …). Every time-dependent function
takes an optional `p_now` (tests only; production uses the database clock), always its
last parameter, and every parameter except the required
ones has a default, so operators can call them by hand. Every function, with its
signature, is listed below; the main ones:

- `claim_work(p_instance_id, p_max_rows, p_lease_seconds, …, p_categories, p_topics,
  …, p_stream_run_max, …, p_now)` leases claimable rows (stream heads only, `FOR UPDATE SKIP
  LOCKED`, partition share with stealing, dead-letter at the attempts cap, `has_more` for
  drain mode; with `p_stream_run_max` > 1 each head with a run of the rows after it), only
  of the topics `p_topics` names (`{"outbox": ["emails.welcome"], "inbox": [...]}`; NULL:
  every topic), each with a fresh `lease_token`. It raises SQLSTATE `WP001` for an
  instance that is evicted (tombstoned) or not registered.
- `renew_leases(p_category, p_ids, p_lease_tokens, p_lease_seconds, p_instance_id, p_now)`
  (also `WP001` for an evicted or unregistered instance),
  `complete_work(p_instance_id, p_category, p_ids, p_lease_tokens, p_results, p_now)`,
  `fail_work(p_instance_id, p_category, p_ids, p_lease_tokens, p_errors, p_reasons, …)`,
  `release_work(p_instance_id, p_category, p_ids, p_lease_tokens, p_now)`: all fenced by
  the lease token of the attempt (`p_lease_tokens` parallel to `p_ids`, required) and by
  instance id; ids not held under that token are reported `lost` and left unchanged.
- `record_heartbeat(p_instance_id, p_service_name, p_host_name, p_process_id, …)` →
  false once the instance was evicted; `cleanup_stale_instances(p_stale_cutoff,
  p_definitive_dead_cutoff)`; `deregister_instance(p_instance_id)`;
  `evict_instance(p_instance_id, p_reason)`.
- Producers for non-Django code: `send`, `receive`, `emit`. Operator actions:
  `retry_now`, `release_leases`, `dead_letter`, `requeue_dead`, `cancel_work` (a running
  row's holder is told by `NOTIFY workpump_cancel` on commit).
- Handler control flow, fenced like `complete_work`: `snooze_work(..., p_seconds,
  p_max_snoozes)` (run again later, the attempt given back), `discard_work(...,
  p_reasons)` (ends the row `discarded`); `fail_work(..., p_retry_delays)` takes a
  handler's own retry delays.
- `send`, `receive` and `emit` take `p_unique_key`, `p_unique_for` (an interval) and
  `p_on_conflict` (`'return'`, the default: the holder's id, or false from `receive`;
  `'raise'`: SQLSTATE 23505 `unique_violation`); `unique_key_holder(p_kind, p_topic,
  p_unique_key, p_unique_for)` names the holder. Producers of one key serialize on a
  transaction advisory lock, so unique keys need the default READ COMMITTED isolation:
  under REPEATABLE READ the lookup's snapshot can predate a racer's commit (a racing
  `send` then fails with a serialization error on the outbox's unique index; `emit` has
  no such index).
  `emit` without `p_subscribers` fans out to the subscriptions of `workpump_subscription`.
- The producers check payloads at the door: a payload over `p_max_payload_bytes`
  (default 1048576, the `MAX_PAYLOAD_BYTES` default; measured as PostgreSQL prints the
  jsonb) or with objects and arrays nested deeper than `p_max_payload_depth` (default
  100, at most 512: the payload object is level 1) is refused with SQLSTATE 22023
  (`invalid_parameter_value`) and a message naming the limit and the fix. Pass
  `p_max_payload_bytes => n` to match a different `MAX_PAYLOAD_BYTES`. A row that gets in
  some other way (a plain `INSERT`, or written before these checks) and that Python cannot
  decode is dead-lettered by the claim with reason `undecodable_payload`, on its own: the
  rest of the batch runs. The admin shows its payload as stored.

## Every function
"""
_CREATE = re.compile(r"^CREATE (?:OR REPLACE )?FUNCTION workpump\.(\w+)\(", re.MULTILINE)


def descriptions() -> dict[str, str]:
    """Map function name to the comment block right above its CREATE FUNCTION."""
    found: dict[str, str] = {}
    lines = SCHEMA_SQL.read_text(encoding="utf-8").splitlines()
    for number, line in enumerate(lines):
        match = _CREATE.match(line)
        if match is None:
            continue
        comment: list[str] = []
        for above in reversed(lines[:number]):
            if not above.startswith("--"):
                break
            comment.insert(0, above.removeprefix("--").strip())
        found[match.group(1)] = " ".join(comment)
    return found


def render(cursor: Any) -> str:
    """The whole page, given a DB-API cursor on a migrated database."""
    cursor.execute(
        "SELECT p.proname, pg_get_function_arguments(p.oid), pg_get_function_result(p.oid)"
        " FROM pg_proc p WHERE p.pronamespace = 'workpump'::regnamespace ORDER BY p.proname"
    )
    known = descriptions()
    parts = [HEADER]
    for name, arguments, result in cursor.fetchall():
        comment = known.get(name, "")
        if not comment and name.startswith("claim_") and name.removeprefix("claim_") in NAMES:
            comment = (
                f"The claim of category `{name.removeprefix('claim_')}`, built from the one claim"
                " template by `define_claim` (see there)."
            )
        entry = f"### `{name}`\n\n```sql\nworkpump.{name}({arguments})\n  RETURNS {result}\n```\n"
        if comment:
            entry += f"\n{comment}\n"
        parts.append(entry)
    return "\n".join(parts)


def main() -> None:
    import psycopg

    url = os.environ.get("DATABASE_URL")
    if not url:
        sys.exit("Set DATABASE_URL to a database migrated with `manage.py migrate`.")
    with psycopg.connect(url) as conn, conn.cursor() as cursor:
        sys.stdout.write(render(cursor))


if __name__ == "__main__":
    main()
