"""Throughput: N no-op jobs enqueued in batches of 1,000, then drained by fresh workers.

Rate = N / (first handler start -> the moment no job is left unfinished in the
database). Workers are started after the enqueue, so the clock starts when the first
one begins work; their start-up is reported apart.

A drain that lasts well under a second measures start-up more than the steady rate, so
a run may size its backlogs from a short calibration drain (``backlog_for``) and
enqueue again, larger, when a drain still ends too soon.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from bench import harness as h
from bench.marks import now_ns


@dataclass(frozen=True)
class Case:
    system: str
    processes: int
    concurrency: int | None  # None: the system's default
    jobs: int
    workpump: dict[str, Any] = field(default_factory=dict)
    name: str = ""  # "default" | "c10" | "tuned"
    conn_max_age: str | None = None  # BENCH_CONN_MAX_AGE for our worker ("none": persistent)
    task: str = "noop"  # the handler: bench.<task>
    stream: str | None = None  # workpump: every job on this one stream
    variant: str = "send"  # workpump: how bench.produce enqueues (send per row, or send_many)

    @property
    def key(self) -> str:
        return f"{self.system}/{self.name}/p{self.processes}"


def backlog_for(
    rate: float | None,
    seconds: float,
    *,
    fallback: int,
    margin: float = 1.25,
    batch: int = 1_000,
    cap: int = 200_000,
) -> int:
    """Jobs for a drain at ``rate`` jobs/s to last ``seconds`` times ``margin``: whole
    batches of ``batch``, at most ``cap``; ``fallback`` when the rate is unknown."""
    if not rate or rate <= 0:
        return fallback
    jobs = math.ceil(rate * seconds * margin / batch) * batch
    return max(batch, min(jobs, cap))


def drain_long_enough(
    min_seconds: float | None, case: Case, run: Callable[[Case], dict[str, Any]], tries: int = 3
) -> tuple[dict[str, Any], Case]:
    """Run ``case``; while its drain ended before ``min_seconds``, enqueue a backlog
    sized from that drain and run it again. Return the result and the case (with the
    backlog that sufficed, for the next repetitions)."""
    result = run(case)
    for _ in range(tries - 1):
        seconds = result.get("seconds")
        if not min_seconds or seconds is None or seconds >= min_seconds:
            break
        jobs = backlog_for(result["rate"], min_seconds, fallback=case.jobs)
        if jobs <= case.jobs:
            break  # at the cap: the short drain stays, flagged by its seconds
        h.log(f"throughput {case.key}: drained in {seconds:.1f} s; again with {jobs:,} jobs")
        case = replace(case, jobs=jobs)
        result = run(case)
    return result, case


def run_case(
    server: h.Server, database: str, case: Case, rep: int, workdir: Path
) -> dict[str, Any]:
    with server.connect(database) as conn:
        conn.execute(h.RESET_SQL[case.system])
    args = ["bulk", "--n", str(case.jobs), "--batch", "1000", "--task", case.task]
    if case.stream is not None:
        args += ["--stream", case.stream]
    if case.system == "workpump" and case.variant != "send":
        args += ["--variant", case.variant]
    enqueue = h.produce(case.system, server, database, args)
    with server.connect(database) as conn:
        conn.execute(h.ANALYZE_SQL[case.system])
    marks = workdir / f"tp-{case.system}-{case.name}-p{case.processes}-r{rep}.marks"
    marks.unlink(missing_ok=True)
    launched = now_ns()
    workers = [
        h.start_worker(
            case.system,
            server,
            database,
            concurrency=case.concurrency,
            workpump=case.workpump,
            marks=marks,
            extra_env={"BENCH_CONN_MAX_AGE": case.conn_max_age} if case.conn_max_age else None,
            log_path=workdir / f"tp-{case.system}-{case.name}-p{case.processes}-r{rep}-w{i}.log",
        )
        for i in range(case.processes)
    ]
    ended = None
    error = None
    budget = 60 + case.jobs / 50  # generous: even 50 jobs/s finishes
    try:
        with h.RssSampler(workers, 0.25), server.connect(database) as conn:
            deadline = time.monotonic() + budget
            while time.monotonic() < deadline:
                if not conn.execute(h.LEFT_SQL[case.system]).fetchone()[0]:
                    ended = now_ns()
                    break
                dead = [w for w in workers if w.process.poll() is not None]
                if dead:
                    error = f"worker exited early: {dead[0].output()[-2000:]}"
                    break
                time.sleep(0.02)
            else:
                error = f"not drained within {budget:.0f} s"
    finally:
        codes = [h.stop_worker(w) for w in workers]
    with server.connect(database) as conn:
        done = conn.execute(h.DONE_COUNT_SQL[case.system]).fetchone()[0]
    firsts = [int(m[2]) for m in h.read_marks(marks) if m[0] == "first"]
    result: dict[str, Any] = {
        **asdict(case),
        "key": case.key,
        "rep": rep,
        "enqueue_seconds": enqueue["seconds"],
        "enqueue_rate": case.jobs / enqueue["seconds"],
        "done": done,
        "exit_codes": codes,
        "error": error,
        "rss_max_mb": max((max(w.rss_samples, default=0) for w in workers), default=0) / 2**20,
    }
    if ended is not None and firsts and done >= case.jobs:
        first = min(firsts)
        result["seconds"] = (ended - first) / 1e9
        result["rate"] = case.jobs / result["seconds"]
        result["startup_seconds"] = (first - launched) / 1e9
        result["first_start_skew_ms"] = (max(firsts) - first) / 1e6
    elif error is None:
        result["error"] = f"done={done} of {case.jobs}, first marks={len(firsts)}"
    return result


def summarize(runs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    by_key: dict[str, list[dict[str, Any]]] = {}
    for run in runs:
        by_key.setdefault(run["key"], []).append(run)
    summary = {}
    for key, items in by_key.items():
        rates = [r["rate"] for r in items if "rate" in r]
        enq = [r["enqueue_rate"] for r in items]
        summary[key] = {
            "system": items[0]["system"],
            "name": items[0]["name"],
            "processes": items[0]["processes"],
            "concurrency": items[0]["concurrency"],
            "jobs": items[0]["jobs"],
            "jobs_max": max(r["jobs"] for r in items),  # a short drain's rerun enqueues more
            "seconds_min": min((r["seconds"] for r in items if "rate" in r), default=None),
            "workpump": items[0]["workpump"],
            "conn_max_age": items[0].get("conn_max_age"),
            "runs": len(items),
            "ok": len(rates),
            "rate_median": h.median(rates) if rates else None,
            "rate_min": min(rates) if rates else None,
            "rate_max": max(rates) if rates else None,
            "rates": rates,
            "enqueue_rate_median": h.median(enq),
            "startup_median": h.median([r["startup_seconds"] for r in items if "rate" in r])
            if rates
            else None,
            "rss_max_mb": max(r["rss_max_mb"] for r in items),
            "errors": [r["error"] for r in items if r.get("error")],
        }
    return summary


def ratios(runs: list[dict[str, Any]], ours: str, theirs: str) -> list[float]:
    """Per-repetition ratio of two keys' rates (measured back to back)."""
    out = []
    reps = sorted({r["rep"] for r in runs})
    for rep in reps:
        a = [r for r in runs if r["rep"] == rep and r["key"] == ours and "rate" in r]
        b = [r for r in runs if r["rep"] == rep and r["key"] == theirs and "rate" in r]
        if a and b:
            out.append(a[0]["rate"] / b[0]["rate"])
    return out
