"""Ordered streams and ORM handlers: what real workloads cost, in one run.

Each case enqueues N jobs (on one stream, or on none), then drains them with one fresh
``runworkpump`` process at its defaults, timed like the throughput section (first handler
start -> nothing left unfinished). The ORM handler (``bench.orm``) inserts one row
through the ORM; "default" is Django's ``CONN_MAX_AGE = 0``, "persistent" 60 s.
Procrastinate's per-lock ordering (every job under one ``lock=``) is the ordered anchor:
it advances about one job per poll, so it gets a fixed window and is rated by what it
finished in it.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Any

from bench import harness as h
from bench.marks import now_ns
from bench.throughput import Case, run_case

STREAM = "hot"  # every ordered job's stream: one hot aggregate
LOCK = "one"  # every Procrastinate job's lock


def cases(jobs: int, orm_jobs: int) -> dict[str, Case]:
    """The cases by name; ratios are taken between cases of this one run."""
    return {
        "unordered_noop": Case("workpump", 1, None, jobs, name="unordered_noop"),
        "ordered_noop": Case("workpump", 1, None, jobs, name="ordered_noop", stream=STREAM),
        "orm_default": Case("workpump", 1, None, orm_jobs, name="orm_default", task="orm"),
        "orm_persistent": Case(
            "workpump", 1, None, orm_jobs, name="orm_persistent", task="orm", conn_max_age="60"
        ),
        "orm_per_job": Case(
            "workpump",
            1,
            None,
            orm_jobs,
            {"HANDLER_CONNECTIONS": "per_job"},
            name="orm_per_job",
            task="orm",
        ),
        "ordered_orm": Case(
            "workpump", 1, None, orm_jobs, name="ordered_orm", task="orm", stream=STREAM
        ),
    }


def procrastinate_lock(
    server: h.Server, database: str, jobs: int, window: float, workdir: Path
) -> dict[str, Any]:
    """Jobs/s of one Procrastinate worker draining jobs that all share one lock."""
    with server.connect(database) as conn:
        conn.execute(h.RESET_SQL["procrastinate"])
    h.produce(
        "procrastinate",
        server,
        database,
        ["bulk", "--n", str(jobs), "--batch", str(jobs), "--lock", LOCK],
    )
    marks = workdir / "ordered-procrastinate-lock.marks"
    marks.unlink(missing_ok=True)
    worker = h.start_worker(
        "procrastinate",
        server,
        database,
        marks=marks,
        log_path=workdir / "ordered-procrastinate-lock.log",
    )
    try:
        started = now_ns()
        deadline = time.monotonic() + window + 30  # start-up is not part of the window
        first = None
        while time.monotonic() < deadline:
            firsts = [int(m[2]) for m in h.read_marks(marks) if m[0] == "first"]
            if firsts:
                first = min(firsts)
                break
            time.sleep(0.05)
        if first is not None:
            time.sleep(max(0.0, window - (now_ns() - first) / 1e9))
        with server.connect(database) as conn:
            done = conn.execute(h.DONE_COUNT_SQL["procrastinate"]).fetchone()[0]
        ended = now_ns()
    finally:
        h.stop_worker(worker)
    if first is None:
        return {"error": f"no job started in {window + 30:.0f} s", "jobs": jobs}
    seconds = (ended - first) / 1e9
    return {
        "jobs": jobs,
        "done": done,
        "window_seconds": seconds,
        "rate": done / seconds,
        "startup_seconds": (first - started) / 1e9,
    }


def run(
    server: h.Server,
    databases: dict[str, str],
    jobs: int,
    orm_jobs: int,
    proc_jobs: int,
    proc_window: float,
    workdir: Path,
    reps: int = 1,
) -> dict[str, Any]:
    """Every case ``reps`` times, the order reversed on every other round so no case
    always runs first or last; a case's rate is its median, a ratio the median of the
    ratios of neighbours in one round."""
    rounds: list[dict[str, dict[str, Any]]] = []
    for rep in range(reps):
        named = list(cases(jobs, orm_jobs).items())
        this_round: dict[str, dict[str, Any]] = {}
        for name, case in named if rep % 2 == 0 else reversed(named):
            result = run_case(server, databases["workpump"], case, rep, workdir)
            this_round[name] = result
            rate = result.get("rate")
            h.log(
                f"ordered {name} (round {rep + 1}/{reps}): "
                + (f"{rate:,.0f} rows/s" if rate else f"FAILED {result.get('error')}")
            )
        rounds.append(this_round)
    runs: dict[str, Any] = {}
    for name in cases(jobs, orm_jobs):
        results = [r[name] for r in rounds]
        rates = [r["rate"] for r in results if r.get("rate")]
        runs[name] = {
            **results[-1],
            "rate": statistics.median(rates) if len(rates) == len(results) else None,
            "rates": rates,
        }
    anchor = procrastinate_lock(server, databases["procrastinate"], proc_jobs, proc_window, workdir)
    h.log(
        "ordered procrastinate lock=: "
        + (f"{anchor['rate']:.2f} jobs/s" if "rate" in anchor else f"FAILED {anchor['error']}")
    )

    def rate(name: str) -> float | None:
        return runs[name].get("rate")

    def ratio(a: str, b: str) -> float | None:
        pairs = [(r[a].get("rate"), r[b].get("rate")) for r in rounds]
        if any(x is None or y is None for x, y in pairs):
            return None
        return statistics.median(x / y for x, y in pairs)

    return {
        "runs": runs,
        "rounds": reps,
        "procrastinate_lock": anchor,
        "summary": {
            "ordered_stream_rows_per_s": rate("ordered_noop"),
            "unordered_rows_per_s": rate("unordered_noop"),
            "ordered_vs_unordered_ratio": ratio("ordered_noop", "unordered_noop"),
            "orm_handler_rows_per_s": rate("orm_default"),
            "orm_persistent_rows_per_s": rate("orm_persistent"),
            "orm_per_job_rows_per_s": rate("orm_per_job"),
            "orm_default_vs_persistent_ratio": ratio("orm_default", "orm_persistent"),
            "orm_default_vs_per_job_ratio": ratio("orm_default", "orm_per_job"),
            "ordered_orm_rows_per_s": rate("ordered_orm"),
            "ordered_orm_vs_unordered_orm_ratio": ratio("ordered_orm", "orm_default"),
            "procrastinate_lock_jobs_per_s": anchor.get("rate"),
        },
    }
