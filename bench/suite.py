"""Runs the sections, keeps their results in bench/results/<mode>.json, renders the doc."""

from __future__ import annotations

import contextlib
import json
import os
import platform
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
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


QUICK = Config(
    mode="quick",
    reps=3,
    matrix=((1, "default"), (1, "tuned")),
    jobs={"workpump": 5_000, "pgqueuer": 5_000, "procrastinate": 1_000},
    latency_rounds=1,
    latency_n=200,
    latency_gap_ms=50,
    writes_window=60,
    writes_warmup=15,
    claim_sizes=(
        ("1k", "wp_bench_claim_1k", 1_000, 0),
        ("100k+500k", "wp_bench_claim_100k", 100_000, 500_000),
    ),
    claim_calls=500,
    profile=False,
    profile_jobs=5_000,
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
    writes_warmup=20,
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


def _revision() -> str:
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

    rev = _revision()
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
    runs = []
    cases = _cases(cfg)
    for rep in range(cfg.reps):
        for case in cases:  # systems back to back within each repetition
            result = throughput.run_case(server, DATABASES[case.system], case, rep, workdir)
            runs.append(result)
            rate = result.get("rate")
            h.log(
                f"throughput rep {rep + 1}/{cfg.reps} {case.key}: "
                + (f"{rate:,.0f} jobs/s" if rate else f"FAILED {result.get('error')}")
            )
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
    return {"runs": runs, "summary": throughput.summarize(runs), "ratios": ratios}


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


RUNNERS = {
    "latency": section_latency,
    "throughput": section_throughput,
    "claim": section_claim,
    "writes": section_writes,
    "profile": section_profile,
    "scale": section_scale,
    "ordered": section_ordered,
}


# -- headline ----------------------------------------------------------------------
def headline(results: dict[str, Any]) -> dict[str, Any]:
    sections = results.get("sections", {})
    out: dict[str, Any] = {"mode": results.get("mode")}
    tp = sections.get("throughput", {}).get("ratios", {})
    out["throughput_ratio_vs_pgqueuer"] = _round(tp.get("vs_pgqueuer_p1", {}).get("median"))
    out["throughput_ratio_vs_procrastinate"] = _round(
        tp.get("vs_procrastinate_p1", {}).get("median")
    )
    lat = sections.get("latency", {}).get("summary", {}).get("workpump", {})
    out["latency_p50_ms"] = _round(lat.get("p50"))
    out["latency_p99_ms"] = _round(lat.get("p99"))
    wv = sections.get("writes", {}).get("instances", {})
    out["idle_writes_per_min"] = _round(
        wv.get("workpump-idle-lock", {}).get("write_statements_per_min")
    )
    claim = sections.get("claim", {})
    labels = list(claim)
    if len(labels) == 2:
        small, large = claim[labels[0]], claim[labels[1]]
        out["claim_p50_ratio_1m_vs_1k"] = _round(large["p50_ms"] / small["p50_ms"])
        out["claim_sizes"] = f"{labels[1]} vs {labels[0]}"
    else:
        out["claim_p50_ratio_1m_vs_1k"] = None
    out["throughput_ratio_vs_pgqueuer_tuned"] = _round(
        tp.get("tuned_vs_pgqueuer_p1", {}).get("median")
    )
    scale = sections.get("scale", {})
    out["enqueue_many_ratio_vs_pgqueuer"] = _round(
        scale.get("enqueue", {}).get("many_ratio_vs_pgqueuer")
    )
    out["enqueue_single_ratio_vs_pgqueuer"] = _round(
        scale.get("enqueue", {}).get("single_ratio_vs_pgqueuer")
    )
    out["latency_p50_ratio_vs_pgqueuer"] = _round(
        scale.get("latency", {}).get("p50_ratio_vs_pgqueuer")
    )
    out["latency_p99_ratio_vs_pgqueuer"] = _round(
        scale.get("latency", {}).get("p99_ratio_vs_pgqueuer")
    )
    out["renewal_statements_per_window"] = _round(
        scale.get("renewals", {}).get("statements_per_category_per_window")
    )
    out["scale_8_vs_1_ratio"] = _round(scale.get("instances", {}).get("scale_8_vs_1_ratio"))
    out["scale_32_vs_1_ratio"] = _round(scale.get("instances", {}).get("scale_32_vs_1_ratio"))
    out["scale_32_share_spread"] = _round(scale.get("instances", {}).get("scale_32_share_spread"))
    out["scale_32_idle_write_statements_per_instance_per_min"] = _round(
        scale.get("instances", {}).get("idle_write_statements_per_instance_per_min")
    )
    ordered = sections.get("ordered", {}).get("summary", {})
    for key in (
        "ordered_stream_rows_per_s",
        "ordered_vs_unordered_ratio",
        "orm_handler_rows_per_s",
        "orm_default_vs_persistent_ratio",
        "ordered_orm_rows_per_s",
        "ordered_orm_vs_unordered_orm_ratio",
        "procrastinate_lock_jobs_per_s",
    ):
        out[key] = _round(ordered.get(key), 0 if key.endswith("rows_per_s") else 2)
    return out


def _round(value: Any, digits: int = 2) -> Any:
    return None if value is None else round(float(value), digits)


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
    from bench import report

    results = json.loads((h.RESULTS / f"{mode}.json").read_text())
    doc = h.ROOT / "docs" / "benchmarks.md"
    doc.write_text(report.render(results) + report.kept_sections(doc))
    h.log(f"wrote {doc.relative_to(h.ROOT)} from bench/results/{mode}.json")


def main(*, quick: bool, only: list[str] | None, write_doc: bool, argv: list[str]) -> None:
    cfg = QUICK if quick else FULL
    server = h.system_server()
    chosen = [
        s for s in RUNNERS if (only and s in only) or (not only and (s != "profile" or cfg.profile))
    ]
    path = h.RESULTS / f"{cfg.mode}.json"
    results: dict[str, Any] = {}
    if only and path.exists():
        results = json.loads(path.read_text())  # keep the other sections of the last run
    results.setdefault("sections", {})
    results["mode"] = cfg.mode
    results["config"] = {
        "reps": cfg.reps,
        "matrix": cfg.matrix,
        "jobs": cfg.jobs,
        "latency": [cfg.latency_rounds, cfg.latency_n, cfg.latency_gap_ms],
        "writes_window": cfg.writes_window,
        "claim_sizes": cfg.claim_sizes,
        "claim_calls": cfg.claim_calls,
        "tuned": dict(TUNED),
    }
    results["versions"] = versions(server)
    results["command"] = "python bench/run.py " + " ".join(argv)
    workdir = Path(tempfile.mkdtemp(prefix="wp-bench-"))
    started = time.monotonic()
    h.log(f"mode {cfg.mode}: sections {', '.join(chosen)}; work files in {workdir}")
    try:
        for name in chosen:
            t0 = time.monotonic()
            results["sections"][name] = RUNNERS[name](cfg, server, workdir)
            results.setdefault("timings", {})[name] = {
                "seconds": time.monotonic() - t0,
                "at": datetime.now(UTC).isoformat(timespec="seconds"),
            }
            h.save_json(cfg.mode, results)
            h.log(f"section {name} done in {time.monotonic() - t0:.0f} s")
    finally:
        # only the databases this run used (the scale section keeps to its own server)
        if set(chosen) & {"latency", "throughput", "profile"}:
            for database in DATABASES.values():
                with contextlib.suppress(Exception):
                    server.drop(database)
    results["versions"]["django-workpump at the end of the run"] = _revision()
    results["wall_seconds"] = time.monotonic() - started
    results["finished"] = datetime.now(UTC).isoformat(timespec="seconds")
    results["headline"] = headline(results)
    h.save_json(cfg.mode, results)
    if write_doc:
        from bench import report

        doc = h.ROOT / "docs" / "benchmarks.md"
        doc.parent.mkdir(exist_ok=True)
        # one section run alone replaces its own section: the others are from a full run
        if chosen == ["ordered"]:
            doc.write_text(report.splice_ordered(doc, results))
        elif chosen == ["scale"]:
            doc.write_text(report.splice_scale(doc, results))
        else:
            doc.write_text(report.render(results) + report.kept_sections(doc))
        h.log(f"wrote {doc.relative_to(h.ROOT)}")
    shutil.rmtree(workdir, ignore_errors=True)
    h.log(f"total {time.monotonic() - started:.0f} s")
    print(json.dumps(results["headline"]), flush=True)
    sys.stdout.flush()
