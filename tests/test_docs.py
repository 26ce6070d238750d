"""Docs rendered from the code cannot drift: the SQL API page from the installed functions,
the README's settings table from ``conf.SETTINGS``, and the README's Python snippets run."""

from __future__ import annotations

import ast
import importlib
import importlib.util
import re
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from django.db import connection, transaction

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


# --- the README's Python snippets run ---------------------------------------------------
#
# Every ```python block of the README runs, in order, in one namespace (a later block uses
# what an earlier one imported or defined), each in a transaction rolled back after it, with
# the registries restored at the end. The comment on the line before a block says when it
# does not run as is:
#   <!-- snippet: settings -->         a settings fragment: executed on its own, and every
#                                      django_workpump path and WORKPUMP key it names must exist
#   <!-- snippet: not run (why) -->    illustrative only
# Names the README's prose takes as given (the provider's event, some work ids, ...) are
# provided when a block uses them without defining them.

README = DOCS.parent / "README.md"
SNIPPET_MARKER = re.compile(r"^<!-- snippet: (settings|not run)\b.*-->$")


def marked_snippets(page: Path) -> list[tuple[int, str, str]]:
    """(line, kind, code) of each ```python block; kind is run, settings or not run."""
    lines = page.read_text(encoding="utf-8").splitlines()
    found = []
    for start, code in python_snippets(page):
        before = lines[start - 2].strip() if start >= 2 else ""
        marker = SNIPPET_MARKER.match(before)
        found.append((start, marker.group(1) if marker else "run", code))
    return found


class SignupClient:
    """The README's test client: its signup view sends the welcome mail."""

    def post(self, path: str, data: dict[str, str]) -> None:
        import django_workpump as workpump

        assert path == "/signup/"
        workpump.send("emails.welcome", {"email": data["email"]})


def _some_ids() -> list[uuid.UUID]:
    import django_workpump as workpump

    return [workpump.send("readme.given", {"n": n}) for n in range(2)]


def _an_instance() -> uuid.UUID:
    from tests.factories import ServiceInstanceFactory

    return ServiceInstanceFactory().instance_id  # registered, its heartbeat long stale


GIVEN: dict[str, Callable[[], Any]] = {
    "event": lambda: {"id": "evt_1PzQ", "type": "payment_intent.succeeded"},
    "ids": _some_ids,
    "instance_id": _an_instance,
    "client": SignupClient,
}


def used_names(code: str) -> set[str]:
    return {
        node.id
        for node in ast.walk(ast.parse(code))
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load)
    }


@contextmanager
def sandboxed_registries() -> Iterator[None]:
    """Let snippets register handlers and schedules; put the registries back afterwards."""
    from django_workpump.periodic import schedules
    from django_workpump.registry import registry

    handlers, periodic = dict(registry._handlers), dict(schedules._schedules)
    try:
        yield
    finally:
        registry._handlers.clear()
        registry._handlers.update(handlers)
        schedules._schedules.clear()
        schedules._schedules.update(periodic)


def strings_in(value: Any) -> Iterator[str]:
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for item in value.values():
            yield from strings_in(item)
    elif isinstance(value, list | tuple):
        for item in value:
            yield from strings_in(item)


def check_settings_fragment(line: int, code: str) -> None:
    from django.utils.module_loading import import_string

    from django_workpump.conf import DEFAULTS

    settings: dict[str, Any] = {}
    exec(compile(code, f"README.md:{line}", "exec"), settings)
    for text in strings_in({k: v for k, v in settings.items() if k.isupper()}):
        if text.split(".")[0] == "django_workpump":
            try:
                importlib.import_module(text)
            except ImportError:
                import_string(text)  # raises, naming the path, if it does not exist
    unknown = set(settings.get("WORKPUMP", {})) - set(DEFAULTS)
    assert not unknown, f"README.md:{line}: unknown WORKPUMP keys {sorted(unknown)}"


def test_every_readme_snippet_is_run_or_marked():
    kinds = [kind for _, kind, _ in marked_snippets(README)]
    assert kinds.count("run") >= 6, kinds
    assert set(kinds) <= {"run", "settings", "not run"}


def test_the_readme_python_snippets_run():
    namespace: dict[str, Any] = {"__name__": "readme"}
    with sandboxed_registries():
        for line, kind, code in marked_snippets(README):
            if kind == "not run":
                continue
            if kind == "settings":
                check_settings_fragment(line, code)
                continue
            with transaction.atomic():
                for name in used_names(code) & GIVEN.keys():
                    if name not in namespace:
                        namespace[name] = GIVEN[name]()
                try:
                    exec(compile(code, f"README.md:{line}", "exec"), namespace)
                except Exception as exc:  # noqa: BLE001 - reported with the snippet's line
                    pytest.fail(
                        f"The README's snippet at line {line} raised "
                        f"{type(exc).__name__}: {exc}\n{code}"
                    )
                finally:
                    transaction.set_rollback(True)
                    for name in GIVEN:
                        namespace.pop(name, None)
        # they ran: the handlers and schedules they define were registered
        from django_workpump.periodic import schedules
        from django_workpump.registry import registry

        assert registry.get("outbox", "emails.welcome").func is namespace["send_welcome"]
        assert schedules.get("reports.nightly") is not None
        assert namespace["produced"].assert_sent("emails.welcome")
