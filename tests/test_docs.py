"""Docs rendered from the code cannot drift: the SQL API page from the installed functions,
the README's settings table from ``conf.SETTINGS``."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
from django.db import connection

pytestmark = pytest.mark.django_db

DOCS = Path(__file__).resolve().parent.parent / "docs"


def load(name: str):
    """Import ``docs/<name>.py``, a script rather than a module of a package."""
    spec = importlib.util.spec_from_file_location(name, DOCS / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_sql_api_page_matches_the_installed_functions():
    spec = importlib.util.spec_from_file_location("sql_api", DOCS / "sql_api.py")
    assert spec is not None and spec.loader is not None
    sql_api = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sql_api)
    with connection.cursor() as cursor:
        rendered = sql_api.render(cursor)
    assert "### `observe_alive_locks`" in rendered
    assert (DOCS / "sql-api.md").read_text(encoding="utf-8") == rendered, (
        "docs/sql-api.md is out of date: DATABASE_URL=... python docs/sql_api.py > docs/sql-api.md"
    )


def test_the_readme_settings_table_matches_conf_settings():
    settings_table = load("settings_table")
    readme = settings_table.README.read_text(encoding="utf-8")
    assert "| `LEASE_SECONDS` | 300 | a claimed row is held this long unless renewed |" in (
        settings_table.render()
    )
    assert settings_table.splice(readme) == readme, (
        "README.md's settings table differs from django_workpump.conf.SETTINGS: "
        "run python docs/settings_table.py"
    )


def test_the_settings_table_has_a_row_per_setting():
    from django_workpump.conf import DEFAULTS

    rows = load("settings_table").render().splitlines()[2:]
    assert [row.split("`")[1] for row in rows] == list(DEFAULTS)


# --- the Python snippets of the README and the docs name what exists ----------------------

PAGES = [DOCS.parent / "README.md", *sorted(DOCS.glob("*.md"))]
# names a snippet imports the package as
PACKAGE_ALIASES = {"workpump", "django_workpump"}


def python_snippets(page: Path) -> list[tuple[int, str]]:
    """(line, code) of each ```python block of a page."""
    snippets, lines, start = [], page.read_text(encoding="utf-8").splitlines(), None
    for number, line in enumerate(lines, 1):
        if line.strip() == "```python" and start is None:
            start, body = number, []
        elif line.strip() == "```" and start is not None:
            snippets.append((start, "\n".join(body)))
            start = None
        elif start is not None:
            body.append(line)
    return snippets


def referenced_names(code: str) -> tuple[set[str], set[tuple[str, str]]]:
    """``workpump.X`` attributes, and (module, name) of ``from django_workpump… import``."""
    import ast

    tree = ast.parse(code)
    # a parameter named workpump is the pytest fixture, not the package
    parameters = {node.arg for node in ast.walk(tree) if isinstance(node, ast.arg)}
    aliases = PACKAGE_ALIASES - parameters
    attributes = {
        node.attr
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute)
        and isinstance(node.value, ast.Name)
        and node.value.id in aliases
    }
    imports = {
        (node.module, alias.name)
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom)
        and node.module
        and node.module.split(".")[0] == "django_workpump"
        for alias in node.names
    }
    return attributes, imports


@pytest.mark.parametrize("page", [p for p in PAGES if python_snippets(p)], ids=lambda p: p.name)
def test_the_python_snippets_of_a_page_use_only_what_exists(page):
    import importlib

    import django_workpump

    missing = []
    for line, code in python_snippets(page):
        attributes, imports = referenced_names(code)
        missing += [
            f"{page.name}:{line}: workpump.{name}"
            for name in sorted(attributes)
            if not hasattr(django_workpump, name)
        ]
        for module, name in sorted(imports):
            found = importlib.import_module(module)
            if not hasattr(found, name):
                try:
                    importlib.import_module(f"{module}.{name}")
                except ImportError:
                    missing.append(f"{page.name}:{line}: from {module} import {name}")
    assert missing == [], "snippets name things the package does not have: " + ", ".join(missing)
