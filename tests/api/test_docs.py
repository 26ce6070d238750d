"""Docs rendered from the code cannot drift: the SQL API page from the installed functions,
the settings page's table from ``conf.SETTINGS``, and the Python snippets of the README
and of docs/*.md run (or compile, when marked as not runnable standalone)."""

from __future__ import annotations

import ast
import importlib
import importlib.util
import logging
import re
import sys
import types
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from django.db import connection, transaction

from tests.helpers import ROOT

pytestmark = pytest.mark.django_db

DOCS = ROOT / "docs"


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


def test_the_settings_page_table_matches_conf_settings():
    settings_table = load("settings_table")
    assert settings_table.PAGE == DOCS / "settings.md"
    page = settings_table.PAGE.read_text(encoding="utf-8")
    assert "| `LEASE_SECONDS` | 300 | a claimed row is held this long unless renewed |" in (
        settings_table.render()
    )
    assert settings_table.splice(page) == page, (
        "docs/settings.md's settings table differs from django_workpump.conf.SETTINGS: "
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


# --- the Python snippets of the README and of docs/*.md run ----------------------------
#
# Every ```python block of a page runs, in order, in one namespace per page (a later block
# uses what an earlier one imported or defined), each in a transaction rolled back after
# it, with the registries restored at the end. The comment on the line before a block
# says when it does not run as is:
#   <!-- snippet: settings -->         a settings fragment: executed on its own, and every
#                                      django_workpump path and WORKPUMP key it names must exist
#   <!-- snippet: not run (why) -->    not runnable standalone (it imports your app's
#                                      modules, configures the process, ...): compiled only
# Names the prose takes as given (the provider's event, some work ids, a client's
# exception, ...) are provided when a block uses them without defining them; a
# third-party module an example imports and the test extras lack has a stand-in here.

README = DOCS.parent / "README.md"
DOC_PAGES = [page for page in sorted(DOCS.glob("*.md")) if python_snippets(page)]
SNIPPET_MARKER = re.compile(r"^<!-- snippet: (settings|not run)\b.*-->$")
NOT_RUN_WITH_A_REASON = re.compile(r"^<!-- snippet: not run \(.+\) -->$")


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


def _a_sent_id() -> uuid.UUID:
    import django_workpump as workpump

    return workpump.send("docs.given", {})


class RateLimited(Exception):
    """docs/control-flow.md's client exception: it says when to try again."""

    retry_after = 30


class Order:
    def __init__(self) -> None:
        self.id = 7


def place_order(order: Order) -> None:
    """docs/testing.md's code under test: it sends the receipt and emits the event."""
    import django_workpump as workpump

    workpump.send("emails.receipt", {"order_id": order.id})
    workpump.emit("order.placed", {"order_id": order.id}, stream=f"order-{order.id}")


GIVEN: dict[str, Callable[[], Any]] = {
    "event": lambda: {"id": "evt_1PzQ", "type": "payment_intent.succeeded"},
    "ids": _some_ids,
    "instance_id": _an_instance,
    "client": SignupClient,
    "message_id": _a_sent_id,
    "other_id": _a_sent_id,
    "RateLimited": lambda: RateLimited,
    "order": Order,
    "place_order": lambda: place_order,
}


class SentryScope:
    """What a ``sentry_sdk`` scope was told, for the middleware examples."""

    def __init__(self) -> None:
        self.tags: dict[str, str] = {}
        self.contexts: dict[str, Any] = {}

    def set_tag(self, key: str, value: str) -> None:
        self.tags[key] = value

    def set_context(self, key: str, value: Any) -> None:
        self.contexts[key] = value


def sentry_stand_in() -> types.ModuleType:
    """A ``sentry_sdk`` that records its scopes and captured exceptions."""
    module = types.ModuleType("sentry_sdk")
    module.scopes = []  # type: ignore[attr-defined]
    module.captured = []  # type: ignore[attr-defined]

    @contextmanager
    def new_scope() -> Iterator[SentryScope]:
        module.scopes.append(SentryScope())  # type: ignore[attr-defined]
        yield module.scopes[-1]  # type: ignore[attr-defined]

    module.new_scope = new_scope  # type: ignore[attr-defined]
    module.capture_exception = module.captured.append  # type: ignore[attr-defined]
    return module


STAND_INS: dict[str, Callable[[], types.ModuleType]] = {"sentry_sdk": sentry_stand_in}


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


def check_settings_fragment(where: str, code: str) -> None:
    from django.utils.module_loading import import_string

    from django_workpump.conf import DEFAULTS

    settings: dict[str, Any] = {}
    exec(compile(code, where, "exec"), settings)
    for text in strings_in({k: v for k, v in settings.items() if k.isupper()}):
        if text.split(".")[0] == "django_workpump":
            try:
                importlib.import_module(text)
            except ImportError:
                import_string(text)  # raises, naming the path, if it does not exist
    unknown = set(settings.get("WORKPUMP", {})) - set(DEFAULTS)
    assert not unknown, f"{where}: unknown WORKPUMP keys {sorted(unknown)}"


def run_snippets(page: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """Run a page's snippets as the comment above says; return the page's namespace.

    Call it inside ``sandboxed_registries()``.
    """
    namespace: dict[str, Any] = {"__name__": page.stem.replace("-", "_")}
    for name, make in STAND_INS.items():
        if name not in sys.modules and importlib.util.find_spec(name) is None:
            monkeypatch.setitem(sys.modules, name, make())
    for line, kind, code in marked_snippets(page):
        where = f"{page.name}:{line}"
        compiled = compile(code, where, "exec")  # every block at least compiles
        if kind == "not run":
            continue
        if kind == "settings":
            check_settings_fragment(where, code)
            continue
        with transaction.atomic():
            for name in used_names(code) & GIVEN.keys():
                if name not in namespace:
                    namespace[name] = GIVEN[name]()
            try:
                exec(compiled, namespace)
            except Exception as exc:  # noqa: BLE001 - reported with the snippet's line
                pytest.fail(f"The snippet at {where} raised {type(exc).__name__}: {exc}\n{code}")
            finally:
                transaction.set_rollback(True)
                for name in GIVEN:
                    namespace.pop(name, None)
    return namespace


@pytest.mark.parametrize("page", [README, *DOC_PAGES], ids=lambda p: p.name)
def test_every_snippet_is_run_or_marked_with_a_reason(page):
    lines = page.read_text(encoding="utf-8").splitlines()
    kinds = [kind for _, kind, _ in marked_snippets(page)]
    assert set(kinds) <= {"run", "settings", "not run"}
    unexplained = [
        f"{page.name}:{line}"
        for line, kind, _ in marked_snippets(page)
        if kind == "not run" and not NOT_RUN_WITH_A_REASON.match(lines[line - 2].strip())
    ]
    assert unexplained == [], "say why a snippet is not run: <!-- snippet: not run (why) -->"
    if page == README:
        assert kinds.count("run") >= 6, kinds


def test_the_readme_python_snippets_run(monkeypatch):
    with sandboxed_registries():
        namespace = run_snippets(README, monkeypatch)
        # they ran: the handlers and schedules they define were registered
        from django_workpump.periodic import schedules
        from django_workpump.registry import registry

        assert registry.get("outbox", "emails.welcome").func is namespace["send_welcome"]
        assert schedules.get("reports.nightly") is not None
        assert namespace["produced"].assert_sent("emails.welcome")


@pytest.mark.parametrize("page", DOC_PAGES, ids=lambda p: p.name)
def test_the_python_snippets_of_the_docs_run(page, monkeypatch):
    with sandboxed_registries():
        run_snippets(page, monkeypatch)


def test_the_docs_run_their_handlers_and_calls_for_real(monkeypatch):
    """A few pages' snippets, checked for what they did, not only that they ran."""
    from django_workpump.registry import registry

    with sandboxed_registries():
        flow = run_snippets(DOCS / "control-flow.md", monkeypatch)
        capture = registry.get("outbox", "payments.capture")
        assert capture.func is flow["capture"] and capture.timeout == 120
        assert registry.get("perspective_event", "ledger").batch
        assert list(flow["result"]) != [] and flow["result"].unknown == []

        testing = run_snippets(DOCS / "testing.md", monkeypatch)
        assert testing["produced"].assert_sent("emails.receipt", order_id=7)


# --- the middleware examples wrap every kind of handler they say they wrap ---------------


def run_through_dispatcher(middleware: list[Any], batch: bool) -> Any:
    """Run three rows through a dispatcher with ``middleware``: one batch handler call on
    a stream run of three, or three single calls, all completed; return the rows."""
    import dataclasses

    from django_workpump.clock import FrozenClock
    from django_workpump.pump.dispatch import Dispatcher
    from django_workpump.pump.lease import LeaseRegistry
    from django_workpump.registry import Handler, Registry
    from tests.fakes import FakeCoordinator, make_row

    calls: list[Any] = []

    def handler(work: Any) -> None:
        calls.append(work)

    category = "receptor" if batch else "outbox"
    handlers = Registry()
    handlers.register(
        Handler(category, "docs.middleware", handler, events=("docs.event",), batch=True)
        if batch
        else Handler(category, "docs.middleware", handler)
    )
    rows = [
        dataclasses.replace(
            make_row(category),
            topic="docs.middleware",
            stream="s" if batch else None,
            payload={"n": n},
        )
        for n in range(3)
    ]
    coordinator = FakeCoordinator()
    dispatcher = Dispatcher(
        coordinator,
        handlers,
        LeaseRegistry(),
        concurrency=1,
        clock=FrozenClock(),
        middleware=middleware,
    )
    dispatcher.start()
    try:
        dispatcher.submit(rows)
        assert dispatcher.wait_idle(10)
    finally:
        dispatcher.stop()
    assert coordinator.failed == [], coordinator.failed
    assert sorted(work_id for work_id, _ in coordinator.completed) == sorted(
        row.work_id for row in rows
    )
    assert len(calls) == (1 if batch else 3)
    return rows


@pytest.mark.parametrize("batch", [True, False], ids=["batch", "single"])
def test_the_middleware_examples_wrap_batch_and_single_handlers(batch, monkeypatch, caplog, capsys):
    monkeypatch.setitem(sys.modules, "sentry_sdk", sentry_stand_in())
    with sandboxed_registries():
        examples = run_snippets(DOCS / "middleware.md", monkeypatch)
    sentry = sys.modules["sentry_sdk"]
    caplog.set_level(logging.INFO, logger="myproject.jobs")
    middleware = [examples["log_context"], examples["sentry_scope"], examples["timing"]]

    rows = run_through_dispatcher(middleware, batch)

    ids = [str(row.work_id) for row in rows]
    logged = [r.work_ids for r in caplog.records if r.name == "myproject.jobs"]
    assert logged == ([ids, ids] if batch else [[i] for i in ids for _ in ("start", "end")])
    assert [scope.tags["workpump.topic"] for scope in sentry.scopes] == ["docs.middleware"] * (
        1 if batch else 3
    )
    assert [scope.contexts["work"]["ids"] for scope in sentry.scopes] == (
        [ids] if batch else [[i] for i in ids]
    )
    printed = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in printed] == ["docs.middleware"] * (1 if batch else 3)
