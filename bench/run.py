#!/usr/bin/env python3
"""The benchmark's one entry point: ``python bench/run.py [--quick] [--only NAME]``.

Creates bench/.venv from bench/requirements.txt (the project itself with its test extra,
PgQueuer with asyncpg, Procrastinate with psycopg, py-spy), re-runs itself inside it, uses
databases of its own (``wp_bench*`` on the machine's PostgreSQL at 127.0.0.1:5432, and an
embedded PostgreSQL with pg_stat_statements for the write counts), records the sections
it ran into bench/results/<mode>.json (the others keep their last measurement), renders
that file's page whole (full mode: docs/benchmark-results.md; quick:
bench/results/quick.md), and prints the headline as one JSON object on its last line.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
VENV = BENCH / ".venv"
SECTIONS = (
    "latency",
    "throughput",
    "claim",
    "writes",
    "profile",
    "scale",
    "ordered",
    "workflow",
    "console",
    "wait",
    "flow",
)


def bootstrap(script: Path = Path(__file__)) -> None:
    """Make bench/.venv (once per requirements change) and re-exec ``script`` inside it."""
    if Path(sys.prefix).resolve() == VENV.resolve():
        return
    python = VENV / "bin" / "python"
    requirements = BENCH / "requirements.txt"
    digest = hashlib.sha256(
        requirements.read_bytes() + (ROOT / "pyproject.toml").read_bytes()
    ).hexdigest()
    stamp = VENV / ".requirements.sha256"
    if not python.exists():
        print("[bench] creating bench/.venv", flush=True)
        subprocess.run([sys.executable, "-m", "venv", str(VENV)], check=True)
    if not stamp.exists() or stamp.read_text() != digest:
        print("[bench] installing bench/requirements.txt into bench/.venv", flush=True)
        subprocess.run([str(python), "-m", "pip", "install", "-q", "--upgrade", "pip"], check=True)
        subprocess.run(
            [str(python), "-m", "pip", "install", "-q", "-r", str(requirements)],
            cwd=BENCH,
            check=True,
        )
        stamp.write_text(digest)
    os.execv(str(python), [str(python), str(script.resolve()), *sys.argv[1:]])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="small sizes, one round (< 10 min)")
    parser.add_argument("--only", choices=SECTIONS, action="append", help="run only these")
    parser.add_argument(
        "--no-doc", action="store_true", help="record the results only, do not render the page"
    )
    parser.add_argument(
        "--cleanup", action="store_true", help="drop every wp_bench* database and exit"
    )
    parser.add_argument(
        "--render",
        action="store_true",
        help="only render the page of bench/results/<mode>.json",
    )
    args = parser.parse_args()
    bootstrap()
    sys.path.insert(0, str(ROOT))
    os.chdir(ROOT)
    from bench import suite

    if args.cleanup:
        suite.cleanup()
        return
    if args.render:
        suite.render("quick" if args.quick else "full")
        return
    suite.main(quick=args.quick, only=args.only, write_doc=not args.no_doc, argv=sys.argv[1:])


if __name__ == "__main__":
    main()
