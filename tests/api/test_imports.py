"""The package's import structure: no module-level import cycle, and a light top level.

``import django_workpump`` is what every project that uses the producer pays for; it must
not load the engine (``django_workpump.pump``). Imports under ``if TYPE_CHECKING:`` count
as module level here (a type-only cycle still ties the modules together); imports inside
functions do not.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import django_workpump

PACKAGE = Path(django_workpump.__file__).parent
NAME = "django_workpump"


def _modules() -> dict[str, tuple[Path, bool]]:
    modules = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        if is_package:
            parts.pop()
        modules[".".join(parts)] = (path, is_package)
    return modules


def _module_level(body: list[ast.stmt]) -> list[ast.Import | ast.ImportFrom]:
    """The imports a module runs (or names for type checking) outside any function."""
    found: list[ast.Import | ast.ImportFrom] = []
    for node in body:
        if isinstance(node, ast.Import | ast.ImportFrom):
            found.append(node)
        elif isinstance(node, ast.If):
            found += _module_level(node.body) + _module_level(node.orelse)
        elif isinstance(node, ast.Try):
            found += _module_level(node.body) + _module_level(node.orelse)
            found += _module_level(node.finalbody)
            for handler in node.handlers:
                found += _module_level(handler.body)
        elif isinstance(node, ast.With):
            found += _module_level(node.body)
    return found


def import_graph() -> dict[str, set[str]]:
    """Each module of the package -> the package modules it imports at module level."""
    modules = _modules()
    graph: dict[str, set[str]] = {}
    for name, (path, is_package) in modules.items():
        here = name.split(".") if is_package else name.split(".")[:-1]
        targets: set[str] = set()
        for node in _module_level(ast.parse(path.read_text(encoding="utf-8")).body):
            if isinstance(node, ast.Import):
                targets.update(alias.name for alias in node.names)
                continue
            if node.level:
                base = here[: len(here) - node.level + 1]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            for alias in node.names:
                # ``from . import x`` and ``from pkg import module`` import the module x.
                submodule = f"{source}.{alias.name}"
                targets.add(submodule if submodule in modules else source)
        graph[name] = {t for t in targets if t in modules and t != name}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle (its modules in order, the first repeated at the end), or None."""
    done: set[str] = set()
    path: list[str] = []
    on_path: set[str] = set()

    def visit(module: str) -> list[str] | None:
        path.append(module)
        on_path.add(module)
        for target in sorted(graph[module]):
            if target in on_path:
                return [*path[path.index(target) :], target]
            if target not in done:
                cycle = visit(target)
                if cycle:
                    return cycle
        on_path.discard(module)
        path.pop()
        done.add(module)
        return None

    for module in sorted(graph):
        if module not in done:
            cycle = visit(module)
            if cycle:
                return cycle
    return None


def test_the_graph_sees_every_import_form():
    graph = import_graph()
    assert "django_workpump.work" in graph["django_workpump"]  # from x import Name
    assert "django_workpump.db" in graph["django_workpump.status"]  # from pkg import module
    assert "django_workpump.pump.dispatch" in graph["django_workpump.pump.supervisor"]
    # A type-only import counts: it is a module-level edge too.
    assert "django_workpump.db" in graph["django_workpump.metrics"]


def test_the_cycle_finder_finds_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None


def test_the_package_has_no_import_cycle():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle or ())


def test_work_is_a_leaf_module():
    own = import_graph()["django_workpump.work"]
    assert own <= {"django_workpump.states"}, own


def test_importing_the_package_does_not_load_the_pump():
    env = {k: v for k, v in os.environ.items() if k != "DJANGO_SETTINGS_MODULE"}
    env["PYTHONPATH"] = os.pathsep.join(
        [str(PACKAGE.parent)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])
    )
    code = (
        "import sys, django_workpump\n"
        "assert django_workpump.Work.__module__ == 'django_workpump.work'\n"
        "loaded = sorted(m for m in sys.modules if m.startswith('django_workpump.pump'))\n"
        "assert not loaded, loaded\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr


MAX_MODULE_LINES = 800


def test_no_module_is_longer_than_a_reader_can_hold():
    long = {
        name: lines
        for name, (path, _) in _modules().items()
        if (lines := len(path.read_text(encoding="utf-8").splitlines())) > MAX_MODULE_LINES
    }
    assert long == {}
