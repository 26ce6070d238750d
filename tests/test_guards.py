"""Guard tests: the SQL sources, the migrations
that load them, the function signatures in the database, the lease-pair CHECK, the named
queries of the db package, the Python twin of the partition hash, no SQL in runtime modules,
and the layout of the tests themselves.
"""

from __future__ import annotations

import ast
import hashlib
import importlib
import io
import pkgutil
import random
import re
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from django.core.management import call_command
from django.db import IntegrityError, migrations, transaction

import django_workpump
import django_workpump.migrations
from django_workpump import models
from django_workpump.sql import PIN_SEARCH_PATH, named_queries, read
from tests import factories
from tests.helpers import T0, TESTS, at, run_sql, scalar

PACKAGE = Path(django_workpump.__file__).parent
SQL_DIR = PACKAGE / "sql"

# Functions with a SQL-standard body that touch no table: nothing to resolve by name, so
# no search_path (which would also stop the planner from inlining them).
NO_SEARCH_PATH = {
    "console_latency_bounds",  # inlined into the console's counting trigger
    "console_finite",  # likewise
    "console_latency_sum",  # adds two histograms: console_latency_total's step
    "partition_of",
    "lock_namespace",
    "lock_stream",
    "state_of",
    "retry_delay_seconds",
    "instance_evictable",
    "attempt_logs_cte",  # builds text; the statement that runs it has the caller's path
    "outcome_of",  # a CASE over its arguments (the ended trigger's)
    "flow_tokens",  # a token bucket's arithmetic, inlined into the flow pass
    "console_counts",  # inlined into the console's queries (names bound at creation)
    "console_totals",  # likewise
}

TIME_DEPENDENT = {
    "claim_work",
    "claim_outbox",
    "claim_inbox",
    "claim_perspective_event",
    "claim_receptor",
    "renew_leases",
    "record_heartbeat",
    "cleanup_stale_instances",
    "complete_work",
    "fail_work",
    "release_work",
    "deregister_instance",
    "state_of",
    "release_leases",
    "retry_now",
    "dead_letter",
    "requeue_dead",
    "upsert_periodic",
    "fire_periodic",
    "skip_periodic",
    "pause_periodic",
}

# The parameters an operator must pass; every other one has a default.
REQUIRED_PARAMETERS = {
    "claim_work": ["p_instance_id"],
    "renew_leases": ["p_category", "p_ids", "p_lease_tokens"],
    "record_heartbeat": ["p_instance_id", "p_service_name", "p_host_name", "p_process_id"],
    "cleanup_stale_instances": ["p_stale_cutoff"],
    "complete_work": ["p_instance_id", "p_category", "p_ids", "p_lease_tokens"],
    "fail_work": ["p_instance_id", "p_category", "p_ids", "p_lease_tokens", "p_errors"],
    "release_work": ["p_instance_id", "p_category", "p_ids", "p_lease_tokens"],
    "deregister_instance": ["p_instance_id"],
    "upsert_periodic": ["p_name"],
    "fire_periodic": ["p_name", "p_slot"],
    "skip_periodic": ["p_name", "p_slot"],
    "pause_periodic": ["p_names"],
}


def migration_modules() -> list[Any]:
    return [
        importlib.import_module(f"django_workpump.migrations.{info.name}")
        for info in pkgutil.iter_modules(django_workpump.migrations.__path__)
    ]


def workpump_functions() -> list[dict[str, Any]]:
    """Every function of schema workpump, with its input parameter names and types."""
    functions = run_sql(
        """
        SELECT p.proname AS name, p.proconfig AS config, p.prosqlbody IS NOT NULL AS sql_body,
               p.pronargs AS nargs, p.pronargdefaults AS ndefaults,
               p.proargnames AS names, p.proargmodes::text[] AS modes,
               p.proargtypes::regtype[]::text[] AS types
        FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace
        WHERE n.nspname = 'workpump' AND p.prokind = 'f'
        ORDER BY p.proname
        """
    )
    for f in functions:
        names = f["names"] or []
        modes = f["modes"] or ["i"] * len(names)  # NULL modes: every argument is an input
        f["inputs"] = [name for name, mode in zip(names, modes, strict=True) if mode in "ibv"]
    return functions


# --- SQL sources and migrations ------------------------------------------------------


def test_every_sql_source_is_loaded_by_exactly_one_migration_or_read_for_its_queries():
    listed = Counter(
        path for module in migration_modules() for path in getattr(module, "SQL_FILES", [])
    )
    on_disk = {path.relative_to(SQL_DIR).as_posix() for path in SQL_DIR.rglob("*.sql")}
    # schema.sql whole until a release; from the first delta on, the deltas (the first
    # one the released schema.sql), and schema.sql only read by tests
    deltas = {path for path in on_disk if path.startswith("deltas/")}
    schema = deltas or {"schema.sql"}
    assert {path for path, count in listed.items() if count > 1} == set()
    assert set(listed) == schema, "a schema file loaded by no migration, or a missing one"
    runtime = "".join(
        path.read_text(encoding="utf-8")
        for path in PACKAGE.rglob("*.py")
        if path.relative_to(PACKAGE).parts[0] != "migrations"
    )
    for path in sorted(on_disk - schema - {"schema.sql"}):
        assert named_queries(path), f"{path} holds no named query"
        assert f'"{path}"' in runtime, f"{path} is read by no module"
        assert not re.search(r"^\s*CREATE\b", read(path), re.IGNORECASE | re.MULTILINE), (
            f"{path} creates objects: schema changes belong in schema.sql and a delta"
        )


def test_a_migration_runs_every_sql_file_it_lists():
    for module in migration_modules():
        files = getattr(module, "SQL_FILES", None)
        if files is None:
            continue
        statements = [
            statement
            for operation in module.Migration.operations
            if isinstance(operation, migrations.RunSQL)
            for statement in (
                operation.sql if isinstance(operation.sql, list | tuple) else [operation.sql]
            )
        ]
        # the files, in order; then the search_path pin, unless the file ends with it
        listed = [read(path) for path in files]
        assert statements[: len(listed)] == listed, module.__name__
        assert statements[len(listed) :] in ([], [PIN_SEARCH_PATH]), module.__name__


@pytest.mark.django_db
def test_the_models_and_migrations_agree():
    out = io.StringIO()
    try:
        call_command("makemigrations", check=True, dry_run=True, stdout=out, stderr=out)
    except SystemExit:
        pytest.fail(f"makemigrations found changes:\n{out.getvalue()}")


def schema_exists() -> bool:
    return bool(scalar("SELECT count(*) FROM pg_namespace WHERE nspname = 'workpump'"))


def function_names() -> set[str]:
    return {row["name"] for row in workpump_functions()}


@pytest.mark.django_db(transaction=True)
def test_migrating_back_drops_the_schema_and_forward_restores_it():
    before = function_names()
    assert before
    try:
        call_command("migrate", "workpump", "0001", verbosity=0)
        assert not schema_exists()
        assert scalar("SELECT to_regclass('workpump_outbox') IS NOT NULL"), "0001 keeps tables"
        triggers = scalar(
            "SELECT count(*) FROM pg_trigger t JOIN pg_class c ON c.oid = t.tgrelid"
            " WHERE NOT t.tgisinternal AND c.relname LIKE 'workpump%%'"
        )
        assert triggers == 0, "the insert triggers go with the schema"
    finally:
        call_command("migrate", "workpump", verbosity=0)
    assert schema_exists()
    assert function_names() == before
    message_id = django_workpump.send("emails.welcome", {"user_id": 1}, stream="user-1")
    row = models.Outbox.objects.get(work_id=message_id)
    assert row.stream_head is True
    assert row.partition_number == partition_of("user-1")


# --- The partition hash ----------------------------------------------------------------


def partition_of(key: str, partition_count: int = 10_000) -> int:
    """The hash docs/sql-api.md gives for ``workpump.partition_of``, written from it."""
    digest = hashlib.md5(key.encode(), usedforsecurity=False).hexdigest()
    return int(digest[:8], 16) % partition_count


def random_keys(count: int) -> list[str]:
    rng = random.Random(20260101)
    alphabet = (
        "abcXYZ019 -_:/."  # ascii
        "éüßøñ"  # latin-1
        "Ωжש"  # greek, cyrillic, hebrew
        "中文字"  # CJK
        "😀🚀"  # outside the BMP: four UTF-8 bytes
    )
    keys = ["", "a", "order-42", "user-7", "x" * 1000]
    while len(keys) < count:
        keys.append("".join(rng.choice(alphabet) for _ in range(rng.randint(1, 40))))
    return keys


@pytest.mark.django_db
def test_the_python_partition_hash_matches_sql():
    keys = random_keys(200)
    counts = [1, 2, 7, 10, 1000, 10_000, 2**31 - 1]
    rows = run_sql(
        "SELECT k.key, c.count, workpump.partition_of(k.key, c.count) AS partition "
        "FROM unnest(%s::text[]) WITH ORDINALITY k(key, n) CROSS JOIN unnest(%s::int[]) c(count)",
        (keys, counts),
    )
    assert len(rows) == len(keys) * len(counts)
    mismatches = [
        (row["key"], row["count"], row["partition"], partition_of(row["key"], row["count"]))
        for row in rows
        if partition_of(row["key"], row["count"]) != row["partition"]
    ]
    assert mismatches == []
    # The default count is the same on both sides too.
    assert scalar("SELECT workpump.partition_of('order-42')") == partition_of("order-42")


# --- Function signatures in the database -----------------------------------------------


@pytest.mark.django_db
def test_every_function_sets_search_path_except_pure_sql_expressions():
    functions = workpump_functions()
    names = {f["name"] for f in functions}
    assert names >= NO_SEARCH_PATH
    without = {
        f["name"]
        for f in functions
        if not any(entry.startswith("search_path=") for entry in f["config"] or [])
    }
    assert without == NO_SEARCH_PATH
    assert all(f["sql_body"] for f in functions if f["name"] in NO_SEARCH_PATH)


@pytest.mark.django_db
def test_every_time_dependent_function_takes_an_optional_p_now():
    functions = [f for f in workpump_functions() if f["name"] in TIME_DEPENDENT]
    assert {f["name"] for f in functions} == TIME_DEPENDENT
    for f in functions:
        assert "p_now" in f["inputs"], f["name"]
        position = f["inputs"].index("p_now")
        assert f["types"][position] == "timestamp with time zone", f["name"]
        assert position >= f["nargs"] - f["ndefaults"], f"{f['name']}: p_now has no default"


@pytest.mark.django_db
@pytest.mark.parametrize(("name", "required"), REQUIRED_PARAMETERS.items())
def test_only_the_documented_parameters_are_required(name, required):
    (function,) = [f for f in workpump_functions() if f["name"] == name]
    assert function["nargs"] - function["ndefaults"] == len(required)
    assert function["inputs"][: len(required)] == required


@pytest.mark.django_db
def test_an_operator_can_call_claim_work_with_the_instance_id_alone():
    instance_id = "00000000-0000-0000-0000-000000000001"
    assert scalar(
        "SELECT workpump.record_heartbeat(%s::uuid, 'ops', 'psql', 1, p_now => %s)",
        (instance_id, T0),
    )
    factories.OutboxFactory()
    rows = run_sql("SELECT * FROM workpump.claim_work(p_instance_id => %s::uuid)", (instance_id,))
    assert len(rows) == 1


# --- The lease-pair CHECK --------------------------------------------------------------

WORK_FACTORIES = [
    factories.OutboxFactory,
    factories.InboxFactory,
    factories.PerspectiveEventFactory,
    factories.ReceptorProcessingFactory,
]
HALF_LEASES = [
    pytest.param({"instance_id": "00000000-0000-0000-0000-0000000000aa"}, id="id"),
    pytest.param({"lease_expiry": at(300)}, id="expiry"),
]


@pytest.mark.django_db
@pytest.mark.parametrize("factory", WORK_FACTORIES, ids=lambda f: f._meta.model.__name__)
@pytest.mark.parametrize("half", HALF_LEASES)
def test_a_row_cannot_be_inserted_with_half_a_lease(factory, half):
    with pytest.raises(IntegrityError, match="lease_pair"), transaction.atomic():
        factory(**half)


@pytest.mark.django_db
@pytest.mark.parametrize("factory", WORK_FACTORIES, ids=lambda f: f._meta.model.__name__)
@pytest.mark.parametrize("half", HALF_LEASES)
def test_a_row_cannot_be_updated_to_half_a_lease(factory, half):
    leased = factory(instance_id="00000000-0000-0000-0000-0000000000bb", lease_expiry=at(60))
    unowned = factory()
    model = factory._meta.model
    with pytest.raises(IntegrityError, match="lease_pair"), transaction.atomic():
        model.objects.filter(pk=unowned.pk).update(**half)
    # Dropping only one half of a held lease is refused as well.
    dropped = {"lease_expiry": None} if "lease_expiry" in half else {"instance_id": None}
    with pytest.raises(IntegrityError, match="lease_pair"), transaction.atomic():
        model.objects.filter(pk=leased.pk).update(**dropped)
    # Both halves together are fine either way.
    model.objects.filter(pk=leased.pk).update(instance_id=None, lease_expiry=None)
    model.objects.filter(pk=unowned.pk).update(
        instance_id="00000000-0000-0000-0000-0000000000cc", lease_expiry=at(60)
    )


# --- Named queries and SQL in Python -------------------------------------------------

# The db package, the one door to SQL: its modules' sources, one after the other.
DB_SOURCES = [path.read_text(encoding="utf-8") for path in sorted((PACKAGE / "db").glob("*.py"))]
DB_SOURCE = "\n".join(DB_SOURCES)


def names_db_py_runs() -> set[str]:
    """The first argument of every _fetch/_scalar call in the db package."""
    names = set()
    for node in (n for source in DB_SOURCES for n in ast.walk(ast.parse(source))):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in {"_fetch", "_scalar"}
            and isinstance(node.args[0], ast.Constant)  # not the helpers' own plumbing
        ):
            names.add(node.args[0].value)
    return names


def test_every_query_db_py_runs_is_defined():
    used = names_db_py_runs()
    assert used
    assert used - set(named_queries()) == set()


def test_every_named_query_is_used_by_db_py():
    unused = {name for name in named_queries() if f'"{name}"' not in DB_SOURCE}
    assert unused == set()


SQL_START = re.compile(r"^\s*(SELECT|UPDATE|INSERT|DELETE|WITH)\b")
SQL_SHAPE = re.compile(
    r"^\s*(select\s.*\bfrom\b|update\s+\S+\s+set\b|insert\s+into\b|delete\s+from\b"
    r"|with\s+\w+\s+as\s*\()",
    re.IGNORECASE | re.DOTALL,
)


def docstrings(tree: ast.Module) -> set[int]:
    nodes = [tree, *(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef | ast.ClassDef))]
    ids = set()
    for node in nodes:
        body = getattr(node, "body", [])
        if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
            ids.add(id(body[0].value))
    return ids


def test_runtime_modules_contain_no_sql():
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        relative = path.relative_to(PACKAGE)
        if relative.parts[0] in {"migrations", "sql"}:
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"))
        skip = docstrings(tree)
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Constant)
                and isinstance(node.value, str)
                and id(node) not in skip
                and (SQL_START.match(node.value) or SQL_SHAPE.match(node.value))
            ):
                found.append(f"{relative}:{node.lineno}: {node.value[:60]!r}")
    assert found == []


def test_the_sql_finder_would_notice_sql():
    # Guard the guard: the patterns above match the usual shapes of SQL.
    for text in (
        "SELECT 1",
        "select * from workpump_outbox",
        "UPDATE t SET x = 1",
        "insert into t values (1)",
        "WITH a AS (SELECT 1) SELECT * FROM a",
    ):
        assert SQL_START.match(text) or SQL_SHAPE.match(text), text
    assert not SQL_START.match("delete") and not SQL_SHAPE.match("With no data_dir the server")


def _test_modules() -> list[Path]:
    return sorted(path for path in TESTS.rglob("*.py") if "async_sample" not in path.parts)


def test_no_test_module_imports_a_conftest():
    # Fixtures come from conftest.py by pytest's own lookup and names a module imports
    # from tests/helpers.py, so a conftest holds fixtures and hooks alone.
    offenders = []
    for path in _test_modules():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom):
                names = [node.module or ""] + [f"{node.module}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            else:
                continue
            if any("conftest" in name.split(".") for name in names):
                offenders.append(f"{path.relative_to(TESTS.parent)}:{node.lineno}")
    assert offenders == [], (
        f"These lines import a conftest: {offenders}; import the name from tests/helpers.py "
        "(or tests/faults/harness.py) instead, and leave fixtures to pytest."
    )


def test_test_modules_live_in_a_directory_named_for_what_they_check():
    # tests/sql, tests/pump, tests/admin, ...: a new test file goes where its behaviour
    # is, and each directory is a package, so equal file names in two of them can coexist.
    loose = [p.name for p in TESTS.glob("test_*.py") if p.name != Path(__file__).name]
    assert loose == [], (
        f"Test modules {loose} sit at the top of tests/; move each into the directory of "
        "what it checks (tests/sql, tests/pump, tests/admin, tests/tasks, tests/produce, "
        "tests/api, tests/faults)."
    )
    homes = {p.parent for p in TESTS.rglob("test_*.py") if "async_sample" not in p.parts}
    no_package = sorted(
        str(d.relative_to(TESTS.parent)) for d in homes if not (d / "__init__.py").exists()
    )
    assert no_package == [], f"Test directories {no_package} need an __init__.py."
