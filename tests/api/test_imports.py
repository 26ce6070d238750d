"""The import structure of the package and of the benchmarks: no import cycle, and a
light top level.

An import counts wherever it stands: at module level, under ``if TYPE_CHECKING:`` (a
type-only cycle still ties the modules together) or inside a function (a cycle that a
function-level import closes is still a cycle: it only shows later). ``bench/`` is checked
beside the package. ``import django_workpump`` is what every project that uses the
producer pays for; it must not load the engine (``django_workpump.pump``).
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

import django_workpump

PACKAGE = Path(django_workpump.__file__).parent
# The benchmarks: a package at the repository's root, beside django_workpump.
BENCH = Path(__file__).resolve().parents[2] / "bench"
PACKAGES = (PACKAGE, BENCH)


def _modules(packages: tuple[Path, ...] = PACKAGES) -> dict[str, tuple[Path, bool]]:
    modules = {}
    for package in packages:
        for path in package.rglob("*.py"):
            parts = list(path.relative_to(package.parent).with_suffix("").parts)
            is_package = parts[-1] == "__init__"
            if is_package:
                parts.pop()
            modules[".".join(parts)] = (path, is_package)
    return modules


def _imports(tree: ast.Module) -> list[ast.Import | ast.ImportFrom]:
    """Every import of a module, at any depth: module level, under ``if``, in functions."""
    return [node for node in ast.walk(tree) if isinstance(node, ast.Import | ast.ImportFrom)]


def import_graph(packages: tuple[Path, ...] = PACKAGES) -> dict[str, set[str]]:
    """Each module of ``packages`` -> the modules of ``packages`` it imports anywhere."""
    modules = _modules(packages)
    graph: dict[str, set[str]] = {}
    for name, (path, is_package) in modules.items():
        here = name.split(".") if is_package else name.split(".")[:-1]
        targets: set[str] = set()
        for node in _imports(ast.parse(path.read_text(encoding="utf-8"))):
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
    # So does an import inside a function (waiting connects as the pump's gate does).
    assert "django_workpump.pump.supervisor" in graph["django_workpump.waiting"]
    # The benchmarks are read too, with their imports inside functions.
    assert "bench.harness" in graph["bench.suite"]
    assert "bench.console_overhead" in graph["bench.suite"]


def test_the_cycle_finder_finds_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None


def test_an_import_inside_a_function_closes_a_cycle(tmp_path):
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "low.py").write_text("def f():\n    from pkg.high import g\n\n    return g\n")
    (package / "high.py").write_text("from pkg import low\n\n\ndef g():\n    return low\n")
    cycle = find_cycle(import_graph((package,)))
    assert cycle == ["pkg.high", "pkg.low", "pkg.high"]


@pytest.mark.parametrize("package", [PACKAGE, BENCH], ids=lambda path: path.name)
def test_no_import_cycle(package):
    graph = {
        module: {t for t in targets if t.partition(".")[0] == package.name}
        for module, targets in import_graph().items()
        if module.partition(".")[0] == package.name
    }
    assert graph, f"no module read under {package}"
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle or ())


def test_the_package_does_not_import_the_benchmarks():
    # So no cycle can run through both: the two checks above see them all.
    taken = {
        (module, t)
        for module, targets in import_graph().items()
        if module.partition(".")[0] == PACKAGE.name
        for t in targets
        if t.partition(".")[0] == BENCH.name
    }
    assert taken == set()


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
        for name, (path, _) in _modules((PACKAGE,)).items()
        if (lines := len(path.read_text(encoding="utf-8").splitlines())) > MAX_MODULE_LINES
    }
    assert long == {}
