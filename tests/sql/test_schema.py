"""schema.sql, the migrations and the models agree.

``django_workpump/sql/schema.sql`` is the current workpump schema in one file. The first
test builds one scratch database with ``migrate``, and another with the model migration
alone (``migrate workpump 0001``) followed by schema.sql, then compares the two catalogs
object by object: a migration that changes the schema without the same change in
schema.sql (or the reverse) fails it. The second checks that what ``migrate`` installs in
schema workpump is exactly what schema.sql declares, by name. That the model migration
matches the models is ``makemigrations --check`` (tests/test_guards.py).
"""

from __future__ import annotations

import difflib
import json
import os
import re
import subprocess
import sys
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import psycopg
import pytest
from django.db import connection

from django_workpump.categories import NAMES
from django_workpump.sql import read
from tests.helpers import ROOT, database_url, scalar

DISAGREE = (
    "schema.sql and the migrations disagree: make the same change in schema.sql and in a"
    " delta migration (docs/design-decisions.md)"
)

# Each query returns (kind, name, definition) rows: the objects compared, by name.
CATALOG = {
    "function": """
        SELECT 'function', p.proname || '(' || pg_get_function_identity_arguments(p.oid) || ')',
               json_build_object(
                   'kind', p.prokind,
                   'arguments', pg_get_function_arguments(p.oid),
                   'result', pg_get_function_result(p.oid),
                   'language', l.lanname,
                   'volatility', p.provolatile,
                   'strict', p.proisstrict,
                   'parallel', p.proparallel,
                   'leakproof', p.proleakproof,
                   'security_definer', p.prosecdef,
                   'cost', p.procost,
                   'rows', p.prorows,
                   'config', p.proconfig,
                   'body', p.prosrc,
                   -- a SQL-standard body (RETURN ...) is stored parsed, not in prosrc
                   'sql_body', CASE WHEN p.prosqlbody IS NOT NULL
                                    THEN pg_get_functiondef(p.oid) END
               )
        FROM pg_proc p JOIN pg_language l ON l.oid = p.prolang
        WHERE p.pronamespace = 'workpump'::regnamespace
    """,
    "type": """
        SELECT 'type', t.typname,
               json_build_object(
                   'type', t.typtype,
                   'attributes', (
                       SELECT json_agg(a.attname || ' ' || format_type(a.atttypid, a.atttypmod)
                                       ORDER BY a.attnum)
                       FROM pg_attribute a
                       WHERE a.attrelid = t.typrelid AND a.attnum > 0 AND NOT a.attisdropped
                   )
               )
        FROM pg_type t
        WHERE t.typnamespace = 'workpump'::regnamespace
          -- row types of sequences and array types come with the objects they belong to
          AND (t.typrelid = 0 OR (SELECT relkind FROM pg_class WHERE oid = t.typrelid) = 'c')
          AND t.typelem = 0
    """,
    "sequence": """
        SELECT 'sequence', s.sequencename,
               json_build_object(
                   'data_type', s.data_type::text, 'start', s.start_value,
                   'min', s.min_value, 'max', s.max_value, 'increment', s.increment_by,
                   'cycle', s.cycle, 'cache', s.cache_size
               )
        FROM pg_sequences s
        WHERE s.schemaname = 'workpump'
    """,
    "relation": """
        SELECT 'relation', c.relname, c.relkind::text
        FROM pg_class c
        WHERE c.relnamespace = 'workpump'::regnamespace AND c.relkind NOT IN ('S', 'c')
    """,
    "trigger": """
        SELECT 'trigger', t.tgrelid::regclass::text || '.' || t.tgname,
               pg_get_triggerdef(t.oid) || CASE WHEN t.tgenabled = 'O' THEN '' ELSE
                   ' (enabled: ' || t.tgenabled::text || ')' END
        FROM pg_trigger t JOIN pg_class c ON c.oid = t.tgrelid
        WHERE NOT t.tgisinternal AND c.relname LIKE 'workpump\\_%'
    """,
    "constraint": """
        SELECT 'constraint', c.conrelid::regclass::text || '.' || c.conname,
               pg_get_constraintdef(c.oid)
        FROM pg_constraint c JOIN pg_class r ON r.oid = c.conrelid
        WHERE r.relname LIKE 'workpump\\_%'
    """,
    "index": """
        SELECT 'index', i.indexrelid::regclass::text, pg_get_indexdef(i.indexrelid)
        FROM pg_index i JOIN pg_class r ON r.oid = i.indrelid
        WHERE r.relname LIKE 'workpump\\_%'
    """,
}


Definition = dict[str, Any] | str


def catalog(url: str) -> dict[tuple[str, str], Definition]:
    """Every compared object of the database at ``url``: (kind, name) -> definition."""
    objects: dict[tuple[str, str], Definition] = {}
    with psycopg.connect(url) as conn:
        for query in CATALOG.values():
            for kind, name, definition in conn.execute(query).fetchall():
                objects[(kind, name)] = definition
    return objects


@pytest.fixture
def scratch_database(raw_connect: Any) -> Iterator[Callable[[], str]]:
    """Create scratch databases on the test server; return their URLs; drop them after."""
    admin = raw_connect()
    created: list[str] = []

    def create() -> str:
        name = f"wp_schema_{uuid.uuid4().hex[:12]}"
        admin.execute(f'CREATE DATABASE "{name}"')
        created.append(name)
        address, separator, query = database_url().partition("?")  # ?host= may hold slashes
        return f"{address.rpartition('/')[0]}/{name}{separator}{query}"

    try:
        yield create
    finally:
        for name in created:
            admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def migrate(url: str, *target: str) -> None:
    """Run ``migrate [app] [migration]`` on the database at ``url``."""
    subprocess.run(
        [sys.executable, "-m", "django", "migrate", "-v0", "--settings", "tests.settings", *target],
        cwd=ROOT,
        env={**os.environ, "DATABASE_URL": url, "WORKPUMP_JSON": json.dumps({})},
        check=True,
        timeout=300,
    )


def load_schema_sql(url: str) -> None:
    """Build the workpump schema of the database at ``url`` from schema.sql alone."""
    with psycopg.connect(url, autocommit=True) as conn, conn.transaction():
        conn.execute(read("schema.sql"))


def describe(field: str, migrated: Any, loaded: Any) -> list[str]:
    """How one field differs: a line diff for multi-line text, else both values."""
    if isinstance(migrated, str) and isinstance(loaded, str) and "\n" in migrated + loaded:
        diff = difflib.unified_diff(
            migrated.splitlines(), loaded.splitlines(), "migrations", "schema.sql", lineterm="", n=1
        )
        return [f"  {field}:", *(f"    {line}" for line in diff)]
    return [f"  {field}: migrations {migrated!r}, schema.sql {loaded!r}"]


def differences(
    migrated: dict[tuple[str, str], Definition], loaded: dict[tuple[str, str], Definition]
) -> list[str]:
    """One entry per object that is missing on one side or defined differently."""
    found = []
    for key in sorted(migrated.keys() | loaded.keys()):
        kind, name = key
        if key not in loaded:
            found.append(f"{kind} {name}: created by the migrations, missing from schema.sql.")
        elif key not in migrated:
            found.append(f"{kind} {name}: in schema.sql, not created by the migrations.")
        elif migrated[key] != loaded[key]:
            before, after = migrated[key], loaded[key]
            if isinstance(before, dict) and isinstance(after, dict):
                fields = [f for f in before if before[f] != after.get(f)]
                lines = [line for f in fields for line in describe(f, before[f], after.get(f))]
            else:
                lines = describe("definition", before, after)
            found.append("\n".join([f"{kind} {name} differs:", *lines]))
    return found


@pytest.mark.django_db  # the test database only hosts the scratch ones: nothing to flush
def test_schema_sql_is_what_the_migrations_build(scratch_database):
    by_migrations = scratch_database()
    by_schema_sql = scratch_database()
    migrate(by_migrations)
    migrate(by_schema_sql, "workpump", "0001")  # the tables, from the models
    load_schema_sql(by_schema_sql)

    migrated, loaded = catalog(by_migrations), catalog(by_schema_sql)

    kinds = {"function", "type", "sequence", "trigger", "constraint", "index"}
    assert {kind for kind, _ in migrated} >= kinds, "the catalog queries found nothing"
    found = differences(migrated, loaded)
    assert not found, "\n".join([f"{DISAGREE}.", *found])


# What schema.sql declares, by kind and name (an aggregate is a function in pg_proc).
DECLARED = {
    # claim_{category} is a template define_claim builds once per category
    "function": re.compile(
        r"^CREATE (?:OR REPLACE )?(?:FUNCTION|AGGREGATE) workpump\.(\w+(?:\{category\}\w*)?)\(",
        re.MULTILINE,
    ),
    "type": re.compile(r"^CREATE TYPE workpump\.(\w+)\b", re.MULTILINE),
    "sequence": re.compile(r"^CREATE SEQUENCE workpump\.(\w+)\b", re.MULTILINE),
    "trigger": re.compile(r"^CREATE TRIGGER (\w+) .*? ON (\w+)", re.MULTILINE),
}
INSTALLED = {
    "function": "SELECT proname FROM pg_proc WHERE pronamespace = 'workpump'::regnamespace",
    "type": "SELECT typname FROM pg_type WHERE typnamespace = 'workpump'::regnamespace"
    " AND typtype = 'c' AND typrelid IN (SELECT oid FROM pg_class WHERE relkind = 'c')",
    "sequence": "SELECT sequencename FROM pg_sequences WHERE schemaname = 'workpump'",
    "trigger": "SELECT t.tgname || ' ON ' || c.relname FROM pg_trigger t"
    " JOIN pg_class c ON c.oid = t.tgrelid"
    " WHERE NOT t.tgisinternal AND c.relname LIKE 'workpump%%'",
}


def declared() -> dict[str, Counter[str]]:
    """(kind -> how many times each name is declared) in schema.sql."""
    text = read("schema.sql")
    return {
        kind: Counter(
            name.replace("{category}", category)
            for m in pattern.finditer(text)
            for name in [" ON ".join(m.groups())]
            for category in (NAMES if "{category}" in name else [""])
        )
        for kind, pattern in DECLARED.items()
    }


@pytest.mark.django_db
def test_migrate_installs_what_schema_sql_declares_and_nothing_else():
    installed = {}
    with connection.cursor() as cursor:
        for kind, query in INSTALLED.items():
            cursor.execute(query)
            installed[kind] = Counter(name for (name,) in cursor.fetchall())
    expected = declared()
    assert all(expected.values()), "the patterns found nothing in schema.sql"
    # the tables and their indexes belong to the models, never to schema workpump
    relations = "SELECT count(*) FROM pg_class WHERE relnamespace = 'workpump'::regnamespace"
    assert scalar(relations + " AND relkind NOT IN ('S', 'c')") == 0
    for kind in DECLARED:
        assert installed[kind] == expected[kind], f"{kind}s: {DISAGREE}"


# Each function of schema workpump that takes p_now, with its input parameters in order
# (proargnames also lists OUT and TABLE columns, which proargmodes tells apart).
P_NOW_FUNCTIONS = """
SELECT p.oid::regprocedure::text AS signature, array_agg(a.name ORDER BY a.ord) AS inputs
FROM pg_proc p
CROSS JOIN LATERAL unnest(
    p.proargnames,
    coalesce(p.proargmodes, array_fill('i'::"char", ARRAY[cardinality(p.proargnames)]))
) WITH ORDINALITY AS a(name, mode, ord)
WHERE p.pronamespace = 'workpump'::regnamespace
  AND 'p_now' = ANY (p.proargnames)
  AND a.mode IN ('i', 'b', 'v')
GROUP BY p.oid
"""


@pytest.mark.django_db
def test_p_now_is_the_last_parameter_of_every_function():
    with connection.cursor() as cursor:
        cursor.execute(P_NOW_FUNCTIONS)
        functions = dict(cursor.fetchall())
    assert "workpump.claim_work" in {s.split("(")[0] for s in functions}, functions
    misplaced = [
        f"{signature} takes p_now before {', '.join(inputs[inputs.index('p_now') + 1 :])}:"
        " move p_now to the end of its parameters."
        for signature, inputs in sorted(functions.items())
        if inputs[-1] != "p_now"
    ]
    assert misplaced == []
