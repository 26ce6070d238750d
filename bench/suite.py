"""Runs the sections, records them into bench/results/<mode>.json, renders its page."""

from __future__ import annotations

import contextlib
import json
import os
import platform
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from importlib import metadata
from pathlib import Path
from typing import Any

from bench import harness as h


@dataclass(frozen=True)
class Config:
    mode: str
    reps: int
    matrix: tuple[tuple[int, str], ...]  # (processes, "default" | "c10" | "tuned")
    jobs: dict[str, int]
    latency_rounds: int
    latency_n: int
    latency_gap_ms: float
    writes_window: float
    writes_warmup: float
    claim_sizes: tuple[tuple[str, str, int, int], ...]
    claim_calls: int
    profile: bool
    profile_jobs: int
    ordered_jobs: int = 5_000  # no-op rows per ordered-section case
    ordered_orm_jobs: int = 3_000  # ORM-handler rows per ordered-section case
    ordered_proc_jobs: int = 100  # Procrastinate lock= jobs enqueued
    ordered_proc_window: float = 20.0  # seconds Procrastinate lock= gets
    ordered_reps: int = 1  # rounds of the ordered section's cases (medians, alternated)
    chain_jobs: int = 300  # rows of the workflow section's chain (and its one stream)
    fanout_jobs: int = 2_000  # rows of its fan-out, with and without a batch callback
    workflow_reps: int = 1
    # Throughput: None drains ``jobs`` as given; a number sizes each case's backlog from a
    # calibration drain of ``jobs`` so that every drain lasts at least that many seconds.
    min_drain_seconds: float | None = None
    # Size each case's backlog from a calibration drain first (else start from ``jobs``,
    # and only a drain that ended too soon is run again with a bigger one).
    calibrate: bool = True


QUICK = Config(
    mode="quick",
    reps=2,  # two rounds of drains of 3 s and more; the full run takes three
    matrix=((1, "default"), (1, "tuned")),
    # backlogs that drain for over 3 s here (workpump ~5,600 jobs/s, PgQueuer ~4,400,
    # Procrastinate ~330): no calibration drains; a faster machine's short drain is run
    # again with a backlog sized from it
    jobs={"workpump": 24_000, "pgqueuer": 18_000, "procrastinate": 1_500},
    calibrate=False,
    latency_rounds=1,
    latency_n=200,
    latency_gap_ms=25,  # still idle between two sends: a pickup takes a few ms
    # a renewal round of the in-flight instances (one every ~20 s) falls in the window
    writes_window=30,
    # past the console's first sample, 30 s after start (startup, not idling)
    writes_warmup=35,
    claim_sizes=(
        ("1k", "wp_bench_claim_1k", 1_000, 0),
        ("100k+500k", "wp_bench_claim_100k", 100_000, 500_000),
    ),
    claim_calls=500,
    profile=False,
    profile_jobs=5_000,
    min_drain_seconds=3.0,
    # the sizes (a 1,000-row chain, a fan-in of 10,000), three alternated rounds:
    # a fan-out of 2,000 drained in a third of a second, and one round's ratio was noise
    chain_jobs=1_000,
    fanout_jobs=10_000,
    workflow_reps=3,
    ordered_proc_window=10.0,
    ordered_orm_jobs=2_000,
)
FULL = Config(
    mode="full",
    reps=3,
    matrix=(
        (1, "default"),
        (2, "default"),
        (1, "c10"),
        (2, "c10"),
        (1, "tuned"),
        (2, "tuned"),
    ),
    jobs={"workpump": 20_000, "pgqueuer": 20_000, "procrastinate": 2_000},
    latency_rounds=3,
    latency_n=200,
    latency_gap_ms=50,
    writes_window=120,
    writes_warmup=35,  # as in quick
    claim_sizes=(
        ("1k", "wp_bench_claim_1k", 1_000, 0),
        ("1M+5M", "wp_bench_claim_1m", 1_000_000, 5_000_000),
    ),
    claim_calls=1_000,
    profile=True,
    profile_jobs=5_000,
    ordered_jobs=20_000,
    ordered_orm_jobs=10_000,
    ordered_proc_jobs=200,
    ordered_proc_window=60.0,
    ordered_reps=3,
    chain_jobs=1_000,
    fanout_jobs=10_000,
    workflow_reps=3,
)
# BENCH_DB_PREFIX renames them, so two runs on one server keep apart.
_PREFIX = os.environ.get("BENCH_DB_PREFIX", "wp_bench")
DATABASES = {
    "workpump": _PREFIX,
    "pgqueuer": f"{_PREFIX}_pgqueuer",
    "procrastinate": f"{_PREFIX}_procrastinate",
}
# Our "tuned" configuration: a bigger claim batch (the one knob the profile points at).
TUNED = {"CLAIM_PREFETCH": 100}
TUNED_CONN_MAX_AGE = None


def revision() -> str:
    """HEAD of the working tree the workers import, flagged when django_workpump is edited."""
    import subprocess

    def git(*args: str) -> str:
        done = subprocess.run(["git", *args], cwd=h.ROOT, capture_output=True, text=True)
        return done.stdout.strip()

    try:
        rev = git("rev-parse", "--short", "HEAD") or "-"
        dirty = git("status", "--porcelain", "--", "django_workpump")
    except OSError:
        return "-"
    return rev + (" + uncommitted changes in django_workpump/" if dirty else "")


def versions(server: h.Server) -> dict[str, Any]:
    def v(name: str) -> str:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            return "-"

    rev = revision()
    return {
        "django-workpump": f"{v('django-workpump')} (git {rev})",
        "Django": v("Django"),
        "psycopg": v("psycopg"),
        "PgQueuer": v("pgqueuer"),
        "asyncpg": v("asyncpg"),
        "Procrastinate": v("procrastinate"),
        "Python": platform.python_version(),
        "PostgreSQL (machine)": server.version(),
        "CPU cores": os.cpu_count(),
        "load average at start": " ".join(f"{x:.2f}" for x in os.getloadavg()),
    }


# -- sections ----------------------------------------------------------------------
def section_latency(cfg: Config, server: h.Server, workdir: Path) -> dict[str, Any]:
    from bench import latency

    for system, database in DATABASES.items():
        h.install_schema(system, server, database)
    runs = []
    for rnd in range(cfg.latency_rounds):
        for system, database in DATABASES.items():
            h.log(f"latency round {rnd + 1}/{cfg.latency_rounds}: {system}")
            runs.append(
                latency.run(
                    system, server, database, cfg.latency_n, cfg.latency_gap_ms, workdir, rnd
                )
            )
    return {"runs": runs, "summary": latency.summarize(runs)}


def _cases(cfg: Config) -> list[Any]:
    from bench.throughput import Case

    cases = []
    for processes, name in cfg.matrix:
        for system in h.SYSTEMS:
            if name == "tuned" and system != "workpump":
                continue
            cases.append(
                Case(
                    system,
                    processes,
                    10 if name == "c10" else None,
                    cfg.jobs[system],
                    dict(TUNED) if name == "tuned" else {},
                    name,
                    TUNED_CONN_MAX_AGE if name == "tuned" else None,
                )
            )
    return cases


def section_throughput(cfg: Config, server: h.Server, workdir: Path) -> dict[str, Any]:
    from bench import throughput

    for system, database in DATABASES.items():
        h.install_schema(system, server, database)
    cases = _cases(cfg)
    calibration: dict[str, Any] = {}
    if not cfg.calibrate:
        # send_many: a backlog enqueued per row would cost more than its drain
        cases = [replace(c, variant="many") if c.system == "workpump" else c for c in cases]
    elif cfg.min_drain_seconds:
        cases, calibration = sized_cases(
            cfg,
            cases,
            lambda case, rep: throughput.run_case(
                server, DATABASES[case.system], case, rep, workdir
            ),
        )
    runs = []
    for rep in range(cfg.reps):
        for i, case in enumerate(cases):  # systems back to back within each repetition
            result, cases[i] = throughput.drain_long_enough(
                cfg.min_drain_seconds,
                case,
                lambda c, rep=rep: throughput.run_case(
                    server, DATABASES[c.system], c, rep, workdir
                ),
            )
            runs.append(result)
            h.log(f"throughput rep {rep + 1}/{cfg.reps} {case.key}: {_rate(result)}")
    pairs = {
        "vs_pgqueuer_p1": ("workpump/default/p1", "pgqueuer/default/p1"),
        "vs_procrastinate_p1": ("workpump/default/p1", "procrastinate/default/p1"),
        "vs_pgqueuer_p2": ("workpump/default/p2", "pgqueuer/default/p2"),
        "vs_pgqueuer_c10_p1": ("workpump/c10/p1", "pgqueuer/c10/p1"),
        "vs_procrastinate_c10_p1": ("workpump/c10/p1", "procrastinate/c10/p1"),
        "tuned_vs_pgqueuer_p1": ("workpump/tuned/p1", "pgqueuer/default/p1"),
        "tuned_vs_procrastinate_p1": ("workpump/tuned/p1", "procrastinate/default/p1"),
        "tuned_vs_pgqueuer_p2": ("workpump/tuned/p2", "pgqueuer/default/p2"),
        "workpump_p2_vs_p1": ("workpump/default/p2", "workpump/default/p1"),
        "workpump_tuned_p2_vs_p1": ("workpump/tuned/p2", "workpump/tuned/p1"),
        "pgqueuer_p2_vs_p1": ("pgqueuer/default/p2", "pgqueuer/default/p1"),
    }
    ratios = {}
    for name, (a, b) in pairs.items():
        values = throughput.ratios(runs, a, b)
        if values:
            ratios[name] = {"median": h.median(values), "by_rep": values}
    return {
        "runs": runs,
        "summary": throughput.summarize(runs),
        "ratios": ratios,
        "min_drain_seconds": cfg.min_drain_seconds,
        "calibration": calibration,
    }


def sized_cases(
    cfg: Config, cases: list[Any], run: Callable[[Any, int], dict[str, Any]]
) -> tuple[list[Any], dict[str, Any]]:
    """``cases`` with backlogs sized from one calibration drain each (of ``case.jobs``),
    so that a drain lasts ``cfg.min_drain_seconds`` with a margin, django-workpump's
    enqueued with ``send_many``; and the calibration."""
    from bench import throughput

    sized, calibration = [], {}
    for case in cases:
        probe = run(case, -1)
        jobs = throughput.backlog_for(
            probe.get("rate"), cfg.min_drain_seconds or 0, fallback=case.jobs
        )
        calibration[case.key] = {
            "jobs": case.jobs,
            "seconds": probe.get("seconds"),
            "rate": probe.get("rate"),
            "sized": jobs,
        }
        h.log(f"throughput calibration {case.key}: {_rate(probe)}; backlog {jobs:,} jobs")
        # send_many: a large backlog enqueued per row would cost more than its drain
        variant = "many" if case.system == "workpump" else case.variant
        sized.append(replace(case, jobs=jobs, variant=variant))
    return sized, calibration


def _rate(result: dict[str, Any]) -> str:
    rate = result.get("rate")
    return f"{rate:,.0f} jobs/s" if rate else f"FAILED {result.get('error')}"


def section_claim(cfg: Config, server: h.Server, workdir: Path) -> dict[str, Any]:
    from bench import claim_scale

    return claim_scale.run(server, list(cfg.claim_sizes), cfg.claim_calls)


def section_writes(cfg: Config, server: h.Server, workdir: Path) -> dict[str, Any]:
    from bench import embedded, writes

    pg = embedded.start()
    try:
        h.log(f"write volume: embedded PostgreSQL {pg.version()} at {pg.host}")
        result = writes.run(pg, cfg.writes_window, cfg.writes_warmup, workdir, batch=True)
        result["maintenance_pass"] = writes.maintenance_pass(pg, "wv_wp_lock")
        result["server"] = f"embedded PostgreSQL {pg.version()} (pg_stat_statements, track=all)"
        return result
    finally:
        embedded.stop()


def section_profile(cfg: Config, server: h.Server, workdir: Path) -> dict[str, Any]:
    from bench import embedded, profile

    h.install_schema("workpump", server, DATABASES["workpump"])
    out: dict[str, Any] = {}
    h.log("profile: py-spy on a default drain")
    out["pyspy"] = profile.spy(server, DATABASES["workpump"], cfg.profile_jobs * 2, workdir)
    h.log("profile: enqueue, per-row send against a set-based batch")
    out["enqueue"] = profile.enqueue_variants(server, DATABASES["workpump"], cfg.profile_jobs * 4)
    h.log("profile: claim batch / connection sweep")
    out["sweep"] = profile.sweep(server, DATABASES["workpump"], cfg.profile_jobs, workdir)
    pg = embedded.start()
    try:
        h.log("profile: per-statement database time (embedded, pg_stat_statements)")
        out["statements"] = profile.statements(pg, cfg.profile_jobs, workdir)
    finally:
        embedded.stop()
    return out


def section_scale(cfg: Config, server: h.Server, workdir: Path) -> dict[str, Any]:
    from bench import embedded, scale

    pg = embedded.start()
    try:
        h.log(f"scale: embedded PostgreSQL {pg.version()} at {pg.host}")
        return scale.run(pg, workdir, quick=cfg.mode == "quick")
    finally:
        embedded.stop()


def section_ordered(cfg: Config, server: h.Server, workdir: Path) -> dict[str, Any]:
    from bench import ordered

    h.install_schema("workpump", server, DATABASES["workpump"])
    h.install_schema("procrastinate", server, DATABASES["procrastinate"])
    return ordered.run(
        server,
        DATABASES,
        cfg.ordered_jobs,
        cfg.ordered_orm_jobs,
        cfg.ordered_proc_jobs,
        cfg.ordered_proc_window,
        workdir,
        cfg.ordered_reps,
    )


def section_console(cfg: Config, server: h.Server, workdir: Path) -> dict[str, Any]:
    from bench import console_overhead

    return console_overhead.run(cfg, server, DATABASES["workpump"], workdir)


def section_wait(cfg: Config, server: h.Server, workdir: Path) -> dict[str, Any]:
    from bench import workflow_wait

    return workflow_wait.run(
        server, DATABASES["workpump"], cfg.latency_n, cfg.latency_gap_ms, workdir
    )


def section_workflow(cfg: Config, server: h.Server, workdir: Path) -> dict[str, Any]:
    from bench import workflow

    h.install_schema("workpump", server, DATABASES["workpump"])
    return workflow.run(
        server,
        DATABASES["workpump"],
        cfg.chain_jobs,
        cfg.fanout_jobs,
        workdir,
        cfg.workflow_reps,
    )


def section_flow(cfg: Config, server: h.Server, workdir: Path) -> dict[str, Any]:
    from bench import flow

    h.install_schema("workpump", server, DATABASES["workpump"])
    return flow.run(server, DATABASES["workpump"], workdir, quick=cfg.mode == "quick")


RUNNERS = {
    "latency": section_latency,
    "throughput": section_throughput,
    "claim": section_claim,
    "writes": section_writes,
    "profile": section_profile,
    "scale": section_scale,
    "ordered": section_ordered,
    "console": section_console,
    "wait": section_wait,
    "workflow": section_workflow,
    "flow": section_flow,
}


# -- driver ------------------------------------------------------------------------
def cleanup() -> None:
    server = h.system_server()
    with server.connect() as conn:
        names = [
            r[0]
            for r in conn.execute(
                "SELECT datname FROM pg_database WHERE datname LIKE 'wp\\_bench%'"
            ).fetchall()
        ]
    for name in names:
        server.drop(name)
        h.log(f"dropped {name}")


def render(mode: str) -> None:
    """Write the page of bench/results/<mode>.json, whole."""
    from bench import report

    results = json.loads((h.RESULTS / f"{mode}.json").read_text())
    page = report.page_path(mode)
    page.parent.mkdir(parents=True, exist_ok=True)
    page.write_text(report.render(results))
    h.log(f"wrote {page.relative_to(h.ROOT)} from bench/results/{mode}.json")


def main(*, quick: bool, only: list[str] | None, write_doc: bool, argv: list[str]) -> None:
    from bench import report

    cfg = QUICK if quick else FULL
    server = h.system_server()
    chosen = [
        s for s in RUNNERS if (only and s in only) or (not only and (s != "profile" or cfg.profile))
    ]
    path = h.RESULTS / f"{cfg.mode}.json"
    # The sections this run does not measure keep their last measurement, each with its
    # own revision and time; the page is rendered whole from the merged results.
    results: dict[str, Any] = json.loads(path.read_text()) if path.exists() else {}
    results["mode"] = cfg.mode
    config = {
        "reps": cfg.reps,
        "matrix": cfg.matrix,
        "jobs": cfg.jobs,
        "min_drain_seconds": cfg.min_drain_seconds,
        "latency": [cfg.latency_rounds, cfg.latency_n, cfg.latency_gap_ms],
        "writes_window": cfg.writes_window,
        "claim_sizes": cfg.claim_sizes,
        "claim_calls": cfg.claim_calls,
        "tuned": dict(TUNED),
    }
    run_versions = versions(server)
    command = "python bench/run.py " + " ".join(argv)
    workdir = Path(tempfile.mkdtemp(prefix="wp-bench-"))
    started = time.monotonic()
    started_at = datetime.now(UTC).isoformat(timespec="seconds")
    h.log(f"mode {cfg.mode}: sections {', '.join(chosen)}; work files in {workdir}")
    try:
        for name in chosen:
            t0 = time.monotonic()
            data = RUNNERS[name](cfg, server, workdir)
            report.record(
                results,
                name,
                data,
                {
                    "started": started_at,
                    "finished": datetime.now(UTC).isoformat(timespec="seconds"),
                    "seconds": time.monotonic() - t0,
                    "revision": revision(),
                    "command": command.rstrip(),
                    "mode": cfg.mode,
                    "config": config,
                    "versions": run_versions,
                },
            )
            h.save_json(cfg.mode, results)
            h.log(f"section {name} done in {time.monotonic() - t0:.0f} s")
    finally:
        # only the databases this run used (the scale section keeps to its own server)
        uses_shared = {"latency", "throughput", "profile", "console", "workflow", "wait", "flow"}
        if set(chosen) & uses_shared:
            for database in DATABASES.values():
                with contextlib.suppress(Exception):
                    server.drop(database)
    if write_doc:
        render(cfg.mode)
    shutil.rmtree(workdir, ignore_errors=True)
    h.log(f"total {time.monotonic() - started:.0f} s")
    print(json.dumps(report.headline(results)), flush=True)
    sys.stdout.flush()
