"""Run Django's own ``tests/tasks`` against ``WorkPumpBackend``.

    DATABASE_URL=postgres://... python ci/tasks_conformance.py [--sdist PATH] [-v 2]

Needs a Django with ``django.tasks`` (6.0 or later). The script downloads the source
distribution of the INSTALLED Django release from PyPI (``pip download --no-deps
--no-binary :all: Django==<version>``) into a temporary directory, extracts its
``tests/tasks`` package (nothing of Django's test suite is kept in this repository) and
runs it with Django's ``DiscoverRunner`` on PostgreSQL (``DATABASE_URL``; unset: the
embedded server the test suite uses), with two adaptations:

- the tests' settings name Django's in-process backends; they are pointed at the work
  pump's stand-ins in ``ci/tasks_conformance_backends.py`` (``ImmediateBackend`` ->
  ``DrainingWorkPumpBackend``, ``DummyBackend`` -> ``StoredWorkPumpBackend``), class
  imports included;
- a test case's ``available_apps = []`` names the apps the rows and the tasks belong to
  (``django_workpump``, ``tasks``);
- ``SimpleTestCase`` (no database) becomes ``TransactionTestCase``: the work pump's
  tasks are rows, and each statement commits as under ``runworkpump`` (so ``now()``
  is each write's own time and ``task_enqueued`` is sent at once, in autocommit).

``WORKPUMP["MAX_ATTEMPTS"]`` is 1, since Django's in-process backends never retry.

Every test that fails must be listed, with the reason, in docs/tasks.md, section
"Differences from Django's in-process backends" (a table whose first column is the
test id); the script prints one line

    tasks-conformance: ran=N passed=P expected_differences=D unexpected_failures=U

and exits 1 on a failure not listed there, or on a listed test that passed (the list
must say what is true). ``--sdist`` uses a downloaded ``Django-<version>.tar.gz``.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tarfile
import tempfile
import unittest
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
DOC = ROOT / "docs" / "tasks.md"
SECTION = "## Differences from Django's in-process backends"
ROW = re.compile(r"^\|\s*`(?P<test>tasks\.[\w.]+)`\s*\|(?P<reason>.*)\|\s*$")

# (text in Django's test files, what it becomes)
REWRITES = [
    (
        '"django.tasks.backends.immediate.ImmediateBackend"',
        '"tasks_conformance_backends.DrainingWorkPumpBackend"',
    ),
    (
        '"django.tasks.backends.dummy.DummyBackend"',
        '"tasks_conformance_backends.StoredWorkPumpBackend"',
    ),
    (
        "from django.tasks.backends.immediate import ImmediateBackend",
        "from tasks_conformance_backends import DrainingWorkPumpBackend as ImmediateBackend",
    ),
    (
        "from django.tasks.backends.dummy import DummyBackend",
        "from tasks_conformance_backends import StoredWorkPumpBackend as DummyBackend",
    ),
    # no app is needed by an in-process backend; here the rows' app and the tasks' are
    ("available_apps = []", 'available_apps = ["django_workpump", "tasks"]'),
]
SIMPLE = re.compile(r"\bSimpleTestCase\b")


def expected_differences() -> dict[str, str]:
    """The tests docs/tasks.md lists as differences, with their reasons."""
    text = DOC.read_text(encoding="utf-8")
    if SECTION not in text:
        sys.exit(f"{DOC} has no section {SECTION!r}.")
    section = text.split(SECTION, 1)[1].split("\n## ", 1)[0]
    listed = {}
    for line in section.splitlines():
        match = ROW.match(line)
        if match:
            reason = match["reason"].strip()
            if not reason:
                sys.exit(f"{DOC}: {match['test']} is listed without a reason.")
            listed[match["test"]] = reason
    return listed


def fetch_suite(version: str, into: Path, sdist: Path | None) -> Path:
    """Extract ``tests/tasks`` of Django ``version``'s sdist into ``into``/tasks."""
    if sdist is None:
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps",
             "--no-binary", ":all:", f"Django=={version}", "--dest", str(into)],
            check=True,
        )  # fmt: skip
        [sdist] = [p for p in into.iterdir() if p.name.lower().startswith("django-")]
    target = into / "suite"
    with tarfile.open(sdist) as archive:
        members = [
            m
            for m in archive.getmembers()
            if m.isfile() and re.match(r"^[^/]+/tests/tasks/[^/]+\.py$", m.name)
        ]
        if not members:
            sys.exit(f"{sdist} holds no tests/tasks: is it Django {version}'s sdist?")
        (target / "tasks").mkdir(parents=True)
        for member in members:
            source = archive.extractfile(member)
            assert source is not None
            text = source.read().decode("utf-8")
            for old, new in REWRITES:
                text = text.replace(old, new)
            text = SIMPLE.sub("TransactionTestCase", text)
            text = text.replace("TransactionTestCase, TransactionTestCase", "TransactionTestCase")
            (target / "tasks" / Path(member.name).name).write_text(text, encoding="utf-8")
    return target


def configure() -> None:
    import environ
    from django.conf import settings

    from django_workpump.embedded import embedded_database_url

    url = environ.Env().str("DATABASE_URL", default="") or embedded_database_url()
    database = environ.Env.db_url_config(url)
    database["TEST"] = {"NAME": f"test_{database['NAME']}_tasks_conformance"}
    settings.configure(
        DATABASES={"default": database},
        INSTALLED_APPS=["django_workpump", "tasks"],
        TASKS={
            "default": {
                "BACKEND": "tasks_conformance_backends.DrainingWorkPumpBackend",
                "QUEUES": [],
            }
        },
        USE_TZ=True,
        SECRET_KEY="tasks-conformance",
        DEFAULT_AUTO_FIELD="django.db.models.BigAutoField",
        WORKPUMP={"MAX_ATTEMPTS": 1},  # Django's in-process backends never retry
    )


class Outcomes(unittest.TextTestResult):
    """A text result that also remembers each test's outcome by test id (subtests
    count toward their test)."""

    outcomes: dict[str, str]

    def startTestRun(self) -> None:
        super().startTestRun()
        self.outcomes = {}

    def _set(self, test: Any, outcome: str) -> None:
        test_id = getattr(test, "test_case", test).id()
        if self.outcomes.get(test_id) in (None, "passed"):
            self.outcomes[test_id] = outcome

    def addSuccess(self, test: Any) -> None:
        super().addSuccess(test)
        self._set(test, "passed")

    def addFailure(self, test: Any, err: Any) -> None:
        super().addFailure(test, err)
        self._set(test, "failed")

    def addError(self, test: Any, err: Any) -> None:
        super().addError(test, err)
        self._set(test, "failed")

    def addSubTest(self, test: Any, subtest: Any, err: Any) -> None:
        super().addSubTest(test, subtest, err)
        if err is not None:
            self._set(test, "failed")

    def addSkip(self, test: Any, reason: str) -> None:
        super().addSkip(test, reason)
        self._set(test, "skipped")

    def addExpectedFailure(self, test: Any, err: Any) -> None:
        super().addExpectedFailure(test, err)
        self._set(test, "passed")

    def addUnexpectedSuccess(self, test: Any) -> None:
        super().addUnexpectedSuccess(test)
        self._set(test, "failed")


def run(suite_dir: Path, verbosity: int) -> dict[str, str]:
    """Run the suite; return {test id: passed | failed | skipped}."""
    import django
    from django.test.runner import DiscoverRunner

    sys.path[:0] = [str(suite_dir), str(HERE)]
    configure()
    django.setup()
    found: dict[str, dict[str, str]] = {}

    class Runner(DiscoverRunner):
        def get_resultclass(self) -> Any:
            return Outcomes

        def suite_result(self, suite: Any, result: Any, **kwargs: Any) -> int:
            found["outcomes"] = result.outcomes
            return super().suite_result(suite, result, **kwargs)

    Runner(top_level=str(suite_dir), verbosity=verbosity, interactive=False).run_tests(["tasks"])
    return found["outcomes"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sdist", type=Path, help="a downloaded Django sdist (.tar.gz)")
    parser.add_argument("-v", "--verbosity", type=int, default=1)
    args = parser.parse_args()
    import django

    if django.VERSION < (6, 0):
        sys.exit(f"Django {django.get_version()} has no django.tasks: use Django 6.0 or later.")
    listed = expected_differences()
    with tempfile.TemporaryDirectory(prefix="tasks-conformance-") as tmp:
        suite_dir = fetch_suite(django.get_version(), Path(tmp), args.sdist)
        outcomes = run(suite_dir, args.verbosity)
    failed = sorted(t for t, o in outcomes.items() if o == "failed")
    passed = [t for t, o in outcomes.items() if o == "passed"]
    expected = [t for t in failed if t in listed]
    unexpected = [t for t in failed if t not in listed]
    stale = sorted(t for t in listed if outcomes.get(t) != "failed")
    for test in unexpected:
        print(f"tasks-conformance: UNEXPECTED FAILURE {test}")
    for test in stale:
        state = outcomes.get(test, "not run")
        print(f"tasks-conformance: LISTED BUT {state.upper()} {test} (update docs/tasks.md)")
    skipped = len(outcomes) - len(passed) - len(failed)
    print(
        f"tasks-conformance: ran={len(outcomes)} passed={len(passed)} "
        f"expected_differences={len(expected)} unexpected_failures={len(unexpected)}"
        + (f" skipped={skipped}" if skipped else "")
    )
    return 1 if unexpected or stale or not outcomes else 0


if __name__ == "__main__":
    sys.exit(main())
