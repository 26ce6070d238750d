"""Render docs/sql-api.md from a migrated database and the SQL sources.

    DATABASE_URL=postgres://... python docs/sql_api.py > docs/sql-api.md

(the database migrated first, e.g. ``python -m django migrate --settings tests.settings``.)

Signatures come from pg_proc; each function's description is the comment block right
above its CREATE FUNCTION in the newest schema version that defines it.
tests/test_docs.py fails when the committed page differs from what this renders.
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path
from typing import Any

SQL_DIR = Path(__file__).resolve().parent.parent / "django_workpump" / "sql"
HEADER = """# The SQL API (schema `workpump`)

Signatures as installed by the migrations (read from `pg_proc`), with the comment that
precedes each function in its source file. Time-dependent functions take an optional
`p_now` for tests; production leaves it NULL and the database clock rules.
"""
_CREATE = re.compile(r"^CREATE (?:OR REPLACE )?FUNCTION workpump\.(\w+)\(", re.MULTILINE)


def _version(path: Path) -> int:
    # v23 or v23_<name>: a delta folder may carry a name after its version
    return int(re.match(r"v(\d+)", path.parent.name).group(1))


def descriptions() -> dict[str, tuple[str, str]]:
    """Map function name to (comment, source path), the newest schema version winning."""
    found: dict[str, tuple[int, str, str]] = {}
    for path in sorted(SQL_DIR.glob("v*/*.sql"), key=lambda p: (_version(p), p.name)):
        lines = path.read_text(encoding="utf-8").splitlines()
        for number, line in enumerate(lines):
            match = _CREATE.match(line)
            if match is None:
                continue
            comment: list[str] = []
            for above in reversed(lines[:number]):
                if not above.startswith("--"):
                    break
                comment.insert(0, above.removeprefix("--").strip())
            source = path.relative_to(SQL_DIR.parent).as_posix()
            found[match.group(1)] = (_version(path), " ".join(comment), source)
    return {name: (comment, source) for name, (_, comment, source) in found.items()}


def render(cursor: Any) -> str:
    """The whole page, given a DB-API cursor on a migrated database."""
    cursor.execute(
        "SELECT p.proname, pg_get_function_arguments(p.oid), pg_get_function_result(p.oid)"
        " FROM pg_proc p WHERE p.pronamespace = 'workpump'::regnamespace ORDER BY p.proname"
    )
    known = descriptions()
    parts = [HEADER]
    for name, arguments, result in cursor.fetchall():
        comment, source = known.get(name, ("", "?"))
        entry = f"### `{name}`\n\n```sql\nworkpump.{name}({arguments})\n  RETURNS {result}\n```\n"
        if comment:
            entry += f"\n{comment} *(source: `{source}`)*\n"
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
