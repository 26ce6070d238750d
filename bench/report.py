"""The benchmark's results file: bench/results/<mode>.json, and the page rendered from it.

The JSON holds one entry per section under ``sections`` (what the section measured)
and ``measured`` (when, at which revision, by which command, and what the section
contributes to the headline, the targets table and the footprint table). A run records
the sections it ran into the saved JSON (``record``) and leaves the others as they
were; the page is then rendered whole from the JSON (``render``), never edited in
place: docs/benchmark-results.md from full.json, bench/results/quick.md from quick.json.
A section whose ``measured`` entry says ``imported`` was carried over as written from
an older page (its ``sections`` entry is ``{"markdown": ...}``) until a run replaces it.
"""

# ruff: noqa: E501  (markdown table rows and prose read best unbroken)

from __future__ import annotations

import json
import re
from typing import Any

from bench import flow
from bench.harness import LABELS, RESULTS, ROOT

# The page's sections, in order; Footprint (measured by three of them) follows "claim".
HEADINGS = {
    "throughput": "1. Throughput",
    "latency": "2. Latency",
    "writes": "3. Write volume of liveness",
    "claim": "4. Claim scaling",
    "profile": "6. Profile of the drain (django-workpump, defaults)",
    "scale": "7. Hot path and scale-out",
    "ordered": "Ordered streams and ORM handlers",
    "flow": "Flow control",
    "admin_pages": "Admin pages and workpump_status at scale",
    "index_cost": "The admin's indexes on the hot path",
    "cancel_latency": "Cancel latency",
    "console": "The console's counting on the hot path",
    "workflow": "Workflows: chains and batch callbacks",
    "wait": "Workflows: waiting for results",
}
# The order of the headline keys and of the targets table.
SUMMARY_ORDER = (
    "throughput",
    "latency",
    "writes",
    "claim",
    "scale",
    "ordered",
    "console",
    "workflow",
    "wait",
    "flow",
    "admin_pages",
)


def page_path(mode: str) -> Any:
    """Where the page of ``mode``'s results goes: the full run's is the docs page."""
    if mode == "full":
        return ROOT / "docs" / "benchmark-results.md"
    return RESULTS / f"{mode}.md"


# -- recording a run's sections ------------------------------------------------------
def record(results: dict[str, Any], name: str, data: dict[str, Any], meta: dict[str, Any]) -> None:
    """Put section ``name``'s ``data`` into ``results``, replacing its last measurement,
    with ``meta`` (finished, revision, command, ...) and what it adds to the summaries."""
    results.setdefault("sections", {})[name] = data
    results.setdefault("measured", {})[name] = {
        **meta,
        "headline": section_headline(name, data),
        "targets": [list(row) for row in section_targets(name, data)],
        "footprint": [list(row) for row in section_footprint(name, data)],
    }
    results["headline"] = headline(results)


def headline(results: dict[str, Any]) -> dict[str, Any]:
    """The headline: each section's own keys, merged (the last line run.py prints)."""
    measured = results.get("measured", {})
    out: dict[str, Any] = {"mode": results.get("mode")}
    for name in (*SUMMARY_ORDER, *(n for n in measured if n not in SUMMARY_ORDER)):
        out.update(measured.get(name, {}).get("headline", {}))
    return out


def _round(value: Any, digits: int = 2) -> Any:
    return None if value is None else round(float(value), digits)


SCALE_KEYS = (
    "enqueue_many_ratio_vs_pgqueuer",
    "enqueue_single_ratio_vs_pgqueuer",
    "latency_p50_ratio_vs_pgqueuer",
    "latency_p99_ratio_vs_pgqueuer",
    "renewal_statements_per_window",
    "scale_8_vs_1_ratio",
    "scale_32_vs_1_ratio",
    "scale_32_share_spread",
    "scale_32_idle_write_statements_per_instance_per_min",
)
ORDERED_KEYS = (
    "ordered_stream_rows_per_s",
    "ordered_vs_unordered_ratio",
    "orm_handler_rows_per_s",
    "orm_default_vs_persistent_ratio",
    "ordered_orm_rows_per_s",
    "ordered_orm_vs_unordered_orm_ratio",
    "procrastinate_lock_jobs_per_s",
)


def section_headline(name: str, data: dict[str, Any]) -> dict[str, Any]:
    """The headline keys section ``name`` measures."""
    if name == "throughput":
        tp = data.get("ratios", {})
        return {
            "throughput_ratio_vs_pgqueuer": _round(tp.get("vs_pgqueuer_p1", {}).get("median")),
            "throughput_ratio_vs_procrastinate": _round(
                tp.get("vs_procrastinate_p1", {}).get("median")
            ),
            "throughput_ratio_vs_pgqueuer_tuned": _round(
                tp.get("tuned_vs_pgqueuer_p1", {}).get("median")
            ),
        }
    if name == "latency":
        lat = data.get("summary", {}).get("workpump", {})
        return {"latency_p50_ms": _round(lat.get("p50")), "latency_p99_ms": _round(lat.get("p99"))}
    if name == "writes":
        lock = data.get("instances", {}).get("workpump-idle-lock", {})
        return {"idle_writes_per_min": _round(lock.get("write_statements_per_min"))}
    if name == "claim":
        labels = list(data)
        if len(labels) != 2:
            return {"claim_p50_ratio_1m_vs_1k": None}
        small, large = data[labels[0]], data[labels[1]]
        return {
            "claim_p50_ratio_1m_vs_1k": _round(large["p50_ms"] / small["p50_ms"]),
            "claim_sizes": f"{labels[1]} vs {labels[0]}",
        }
    if name == "scale":
        enq, lat = data.get("enqueue", {}), data.get("latency", {})
        ins = data.get("instances", {})
        values = {
            "enqueue_many_ratio_vs_pgqueuer": enq.get("many_ratio_vs_pgqueuer"),
            "enqueue_single_ratio_vs_pgqueuer": enq.get("single_ratio_vs_pgqueuer"),
            "latency_p50_ratio_vs_pgqueuer": lat.get("p50_ratio_vs_pgqueuer"),
            "latency_p99_ratio_vs_pgqueuer": lat.get("p99_ratio_vs_pgqueuer"),
            "renewal_statements_per_window": data.get("renewals", {}).get(
                "statements_per_category_per_window"
            ),
            "scale_8_vs_1_ratio": ins.get("scale_8_vs_1_ratio"),
            "scale_32_vs_1_ratio": ins.get("scale_32_vs_1_ratio"),
            "scale_32_share_spread": ins.get("scale_32_share_spread"),
            "scale_32_idle_write_statements_per_instance_per_min": ins.get(
                "idle_write_statements_per_instance_per_min"
            ),
        }
        return {key: _round(values[key]) for key in SCALE_KEYS}
    if name == "console":
        return {
            "console_overhead_ratio": _round(data.get("console_overhead_ratio")),
            "console_throughput_ratio": _round(data.get("throughput_ratio")),
            "console_latency_ratio": _round(data.get("latency_ratio")),
        }
    if name == "ordered":
        summary = data.get("summary", {})
        return {
            key: _round(summary.get(key), 0 if key.endswith("rows_per_s") else 2)
            for key in ORDERED_KEYS
        }
    if name == "workflow":
        summary = data.get("summary", {})
        return {
            "workflow_chain_vs_stream_ratio": _round(summary.get("workflow_chain_vs_stream_ratio")),
            "workflow_fanin_overhead": _round(summary.get("workflow_fanin_overhead"), 3),
        }
    if name == "wait":
        return {"workflow_wait_vs_pickup_ratio": _round(data.get("workflow_wait_vs_pickup_ratio"))}
    if name == "flow":
        return flow.headline(data)
    if name == "admin_pages" and "pages" in data:
        return {
            "admin_console_overview_ms": _round(_slowest(data, min(data["sizes"]), OVERVIEWS), 1),
            "admin_console_overview_10m_ms": _round(_slowest(data, TEN_MILLION, OVERVIEWS), 1),
        }
    return {}


TEN_MILLION = 10_000_000
OVERVIEWS = ("console overview", "console overview, day")
PAYLOAD_SEARCHES = ("payload search", "payload search + topic")


def _slowest(data: dict[str, Any], size: int, pages: tuple[str, ...]) -> float | None:
    """The slowest of ``pages`` at ``size`` rows (None: not measured)."""
    times = [data["pages"].get(p, {}).get(str(size)) for p in pages]
    return None if None in times or not times else max(times)


Row = tuple[str, str, str, str]


def _target(name: str, goal: str, value: str, ok: bool | None) -> Row:
    return (name, goal, value, "-" if ok is None else ("met" if ok else "**not met**"))


def section_targets(name: str, data: dict[str, Any]) -> list[Row]:
    """The rows of the targets table section ``name`` measures."""
    rows: list[Row] = []
    add = rows.append
    if name == "admin_pages" and "pages" in data:
        smallest = min(data["sizes"])
        for label, size, pages, limit in (
            (
                f"Console overview, 7 days of series for {data['series']['topics']} topics"
                f" (slower of hour / day, {smallest:,} work rows)",
                smallest,
                OVERVIEWS,
                300,
            ),
            ("Console overview at 10M work rows (slower of hour / day)", TEN_MILLION, OVERVIEWS, 1000),
            ("Payload search at 10M work rows (slower of plain / with topic)", TEN_MILLION,
             PAYLOAD_SEARCHES, 1000),
        ):  # fmt: skip
            ms = _slowest(data, size, pages)
            if ms is not None:
                add(_target(label, f"<= {limit:,} ms", _f(ms, 1, " ms"), ms <= limit))
    if name == "console":
        for label, key in (
            ("Throughput with the console's counting on / off (same run)", "throughput_ratio"),
            ("Pickup p50 with the console's counting off / on (same run)", "latency_ratio"),
        ):
            ratio = data.get(key)
            add(_target(label, ">= 0.95", _f(ratio, 2), None if ratio is None else ratio >= 0.95))
    if name == "throughput":
        ratios = data.get("ratios", {})
        for key, label, goal, floor in (
            ("vs_pgqueuer_p1", "Throughput, 1 process, defaults vs PgQueuer", ">= 2x", 2),
            (
                "vs_procrastinate_p1",
                "Throughput, 1 process, defaults vs Procrastinate",
                ">= 10x",
                10,
            ),
            ("workpump_p2_vs_p1", "Throughput, 2 processes vs 1 (defaults)", ">= 1.4x", 1.4),
        ):
            r = ratios.get(key, {}).get("median")
            add(_target(label, goal, _f(r, 2, "x"), None if r is None else r >= floor))
    elif name == "latency":
        summary = data.get("summary", {})
        ours, pgq = summary.get("workpump", {}), summary.get("pgqueuer", {})
        if ours:
            p50, p99 = ours["p50"], ours["p99"]
            add(_target("Latency p50 (NOTIFY healthy)", "<= 2 ms", _f(p50, 2, " ms"), p50 <= 2))
            if pgq:
                add(
                    _target(
                        "Latency p50 vs PgQueuer p50",
                        "<= PgQueuer",
                        f"{p50:.2f} vs {pgq['p50']:.2f} ms",
                        p50 <= pgq["p50"],
                    )
                )
            add(_target("Latency p99", "<= 10 ms", _f(p99, 2, " ms"), p99 <= 10))
            idle = ours.get("idle_rss_mb")
            if idle is not None:
                add(
                    _target("Idle RSS of runworkpump", "<= 100 MB", _f(idle, 1, " MB"), idle <= 100)
                )
    elif name == "writes":
        wv = data.get("instances", {})
        if not wv:
            return rows
        lock = wv["workpump-idle-lock"]["write_statements_per_min"]
        add(
            _target(
                "Idle writes, alive-lock held", "<= 1 statement/min", _f(lock, 2), lock <= 1.0001
            )
        )
        table = wv["workpump-idle-table"]["write_statements_per_min"]
        add(
            _target(
                "Idle writes, heartbeat_table_only",
                "<= 6 statements/min",
                _f(table, 2),
                table <= 6.0001,
            )
        )
        others = [
            w
            for w in wv["workpump-idle-lock"]["writes"]
            if "workpump_service_instance" not in w["query"]
        ]
        noop = sum(w["calls"] for w in wv["workpump-idle-lock"].get("noop_writes", []))
        add(
            _target(
                "An idle claim poll writes nothing",
                "0 writes besides the heartbeat",
                f"{sum(w['calls'] for w in others)} other write statements "
                f"({noop} no-op: polls that found nothing)",
                not others,
            )
        )
        per_round = wv.get("workpump-inflight-1000", {}).get("renewal_statements_per_round")
        add(
            _target(
                "Renewals, 1,000 in flight (defaults)",
                "<= 1 statement/category/window",
                _f(per_round, 1),
                None if per_round is None else per_round <= 1.0001,
            )
        )
        tuned = wv.get("workpump-inflight-1000-batch1000", {}).get("renewal_statements_per_round")
        if tuned is not None:
            add(
                _target(
                    "Renewals, 1,000 in flight, RENEWAL_MAX_BATCH=1000",
                    "(same)",
                    _f(tuned, 1),
                    tuned <= 1.0001,
                )
            )
    elif name == "claim" and len(data) == 2:
        small, large = list(data.values())
        ratio = large["p50_ms"] / small["p50_ms"]
        labels = list(data)
        scans = [g for row in data.values() for g in guard_scans(row["plans"])]
        caveat = (
            f"; but one guard Seq Scan took {max(g[0] for g in scans):.0f} ms, see section 4"
            if scans
            else ""
        )
        add(
            _target(
                f"Claim p50, {labels[1]} vs {labels[0]}",
                "<= 2x",
                f"{ratio:.2f}x ({large['p50_ms']:.2f} vs {small['p50_ms']:.2f} ms{caveat})",
                ratio <= 2,
            )
        )
    elif name == "ordered":
        rows += ordered_targets(data.get("summary", {}))
    elif name == "workflow":
        rows += workflow_targets(data.get("summary", {}))
    elif name == "wait":
        ratio = data.get("workflow_wait_vs_pickup_ratio")
        add(
            _target(
                "`wait()` p50 after the last completion's commit / pickup p50, same run",
                "<= 2x",
                _f(ratio, 2, "x"),
                None if ratio is None else ratio <= 2,
            )
        )
    elif name == "flow":
        rows += flow.targets(data)
    return rows


def workflow_targets(summary: dict[str, Any]) -> list[Row]:
    chain = summary.get("workflow_chain_vs_stream_ratio")
    fanin = summary.get("workflow_fanin_overhead")
    return [
        _target(
            "A chain vs one stream (each link leased, started after the one before)",
            ">= 0.5x",
            "-" if chain is None else f"{chain:.2f}x",
            None if chain is None else chain >= 0.5,
        ),
        _target(
            "A fan-out with a batch callback vs without",
            "<= +5%",
            "-" if fanin is None else f"{fanin * 100:+.1f}%",
            None if fanin is None else fanin <= 0.05,
        ),
    ]


def body_workflow(section: dict[str, Any], meta: dict[str, Any]) -> list[str]:
    out: list[str] = []
    w = out.append
    w(
        "Each case: rows enqueued, then drained by one fresh `runworkpump` at its defaults "
        "(rows/s = rows / (first handler start -> nothing unfinished)). 'chain': every row "
        "sent with `after=[the previous row]`; 'stream': the same number of rows on one "
        "stream; 'fanout': `send_many`; 'fanin': the same `send_many` inside "
        "`workpump.batch()` with a callback. "
        f"{section.get('rounds', 1)} round(s), the order reversed every other round; ratios "
        "are medians of one round's pairs.\n"
    )
    w("| Case | Rows | rows/s per round | drain seconds per round |\n|---|---|---|---|")
    for name, run in section.get("runs", {}).items():
        rates = ", ".join(_f(r) for r in run.get("rates", []) if r) or f"failed: {run.get('error')}"
        secs = ", ".join(_f(x, 2) for x in run.get("seconds", []) if x)
        w(f"| {name} | {run.get('jobs', 0):,} | {rates} | {secs} |")
    w("")
    w("| Target | Goal | Measured | |\n|---|---|---|---|")
    for name, goal, value, verdict in workflow_targets(section.get("summary", {})):
        w(f"| {name} | {goal} | {value} | {verdict} |")
    w("")
    return out


def section_footprint(name: str, data: dict[str, Any]) -> list[tuple[str, str]]:
    """The (process, RSS) rows of the footprint table section ``name`` measures."""
    if name == "latency":
        return [
            (
                f"{LABELS[system]} worker, idle, listening (after warm-up)",
                f"{row['idle_rss_mb']:.0f} MB",
            )
            for system, row in data.get("summary", {}).items()
        ]
    if name == "throughput":
        return [
            (
                f"{LABELS[row['system']]} worker, full load (max while draining, defaults)",
                f"{row['rss_max_mb']:.0f} MB",
            )
            for row in data.get("summary", {}).values()
            if row["name"] == "default" and row["processes"] == 1
        ]
    if name == "writes":
        return [
            (row["description"], f"{row['rss_mb']:.0f} MB")
            for key, row in data.get("instances", {}).items()
            if "inflight" in key
        ]
    return []


# -- the page --------------------------------------------------------------------------
def _runs(measured: dict[str, Any]) -> dict[str, list[str]]:
    """Sections by the run that measured them (its start, or its revision if imported)."""
    runs: dict[str, list[str]] = {}
    for name, meta in measured.items():
        runs.setdefault(meta.get("started") or meta.get("revision") or "-", []).append(name)
    return runs


def render(results: dict[str, Any]) -> str:
    """The whole page of ``results``."""
    sections = results.get("sections", {})
    measured = results.get("measured", {})
    out: list[str] = []
    w = out.append
    w("# Benchmark results: django-workpump, PgQueuer and Procrastinate\n")
    w(
        f"Generated by `python bench/run.py --render{'' if results.get('mode') == 'full' else ' --quick'}` "
        f"from `bench/results/{results.get('mode')}.json`, whole: do not edit it, run the "
        f"benchmark again. [docs/benchmarks.md]({_link(results)}) says what each section "
        "measures and how to run it. Each section carries the run that measured it, "
        "since a run of some sections (`--only`) replaces those and keeps the others; "
        "compare ratios within one run, not rates across runs.\n"
    )
    w("## Runs\n")
    w("| Section | Finished | Revision | Command | Minutes |\n|---|---|---|---|---|")
    for name in HEADINGS:
        meta = measured.get(name)
        if meta:
            minutes = meta.get("seconds")
            w(
                f"| {HEADINGS[name]} | {meta.get('finished') or '-'} | {meta.get('revision') or '-'} "
                f"| `{meta.get('command') or '-'}` | {_f(minutes and minutes / 60, 1)} |"
            )
    w("")
    imported = {meta["imported"] for meta in measured.values() if meta.get("imported")}
    for note in sorted(imported):
        w(f"{note}\n")
    for names in _runs(measured).values():
        versions = next(
            (measured[n].get("versions") for n in names if measured[n].get("versions")), None
        )
        if not versions:
            continue
        w(f"### Versions and machine: {', '.join(HEADINGS.get(n, n) for n in names)}\n")
        w("| | |\n|---|---|")
        for key, value in versions.items():
            w(f"| {key} | {value} |")
        w("")
    w("## Headline\n")
    w("```json\n" + json.dumps(headline(results)) + "\n```\n")
    w("| Target | Goal | Measured | |\n|---|---|---|---|")
    for name in SUMMARY_ORDER:
        for target, goal, value, verdict in measured.get(name, {}).get("targets", []):
            w(f"| {target} | {goal} | {value} | {verdict} |")
    w("")
    for name, heading in HEADINGS.items():
        if name in sections:
            out.extend(_section(name, heading, sections[name], measured.get(name, {})))
        if name == "claim":
            rows = [
                row
                for n in ("latency", "throughput", "writes")
                for row in measured.get(n, {}).get("footprint", [])
            ]
            if rows:
                w("## 5. Footprint\n")
                w("| Process | RSS |\n|---|---|")
                for process, rss in rows:
                    w(f"| {process} | {rss} |")
                w("")
    return "\n".join(out).rstrip("\n") + "\n"


def _link(results: dict[str, Any]) -> str:
    """docs/benchmarks.md relative to the page (docs/, or bench/results/ for quick)."""
    return "benchmarks.md" if results.get("mode") == "full" else "../../docs/benchmarks.md"


BODIES: dict[str, Any] = {}  # filled below: section name -> body(data, meta) -> lines


def _section(name: str, heading: str, data: dict[str, Any], meta: dict[str, Any]) -> list[str]:
    level = "###" if name == "index_cost" else "##"
    lines = [f"{level} {heading}\n"]
    if meta.get("imported"):
        return [*lines, data["markdown"].strip("\n") + "\n"]
    lines.append(
        f"Measured by `{meta.get('command')}` ({meta.get('mode')} mode), finished "
        f"{meta.get('finished')} at revision {meta.get('revision')}.\n"
    )
    return lines + BODIES[name](data, meta)


# -- helpers ---------------------------------------------------------------------------
NAMES = {"default": "defaults", "c10": "concurrency 10", "tuned": "tuned"}


def _f(value: Any, digits: int = 0, unit: str = "") -> str:
    if value is None:
        return "-"
    return f"{value:,.{digits}f}{unit}"


def _conc(system: str, name: str, concurrency: Any) -> str:
    if name == "c10":
        return {
            "workpump": "`--concurrency 10`",
            "pgqueuer": "`--max-concurrent-tasks 10 --batch-size 5`",
            "procrastinate": "`--concurrency 10`",
        }[system]
    if name == "tuned":
        return "defaults + `CLAIM_PREFETCH=100`"
    return {
        "workpump": "defaults (CONCURRENCY 4, CLAIM_PREFETCH 2)",
        "pgqueuer": "defaults (batch 10, no cap)",
        "procrastinate": "defaults (concurrency 1)",
    }[system]


def guard_scans(plans: list[str]) -> list[tuple[float, int]]:
    """(duration ms, rows removed) of claim plans that seq-scan workpump_outbox."""
    found = []
    for plan in plans:
        first = plan.splitlines()[0] if plan else ""
        match = re.search(r"duration: ([\d.]+) ms", first)
        removed = re.search(
            r"Seq Scan on workpump_outbox t .*?Rows Removed by Filter: (\d+)", plan, re.S
        )
        if match and removed and int(removed.group(1)) >= 1000:
            found.append((float(match.group(1)), int(removed.group(1))))
    return found


def ordered_targets(summary: dict[str, Any]) -> list[tuple[str, str, str, str]]:
    """The targets of the ordered-streams section, as rows of a targets table."""
    rows: list[tuple[str, str, str, str]] = []

    def add(name: str, goal: str, value: str, ok: bool | None) -> None:
        rows.append((name, goal, value, "-" if ok is None else ("met" if ok else "**not met**")))

    if not summary:
        return rows
    rate = summary.get("ordered_stream_rows_per_s")
    add(
        "One stream of no-op rows, 1 process",
        ">= 2,000 rows/s",
        _f(rate, 0, " rows/s"),
        None if rate is None else rate >= 2000,
    )
    r = summary.get("ordered_vs_unordered_ratio")
    add(
        "One stream vs unordered no-op rows (same run)",
        ">= 0.4x",
        _f(r, 2, "x"),
        None if r is None else r >= 0.4,
    )
    r = summary.get("orm_default_vs_persistent_ratio")
    add(
        "ORM handler, Django defaults vs CONN_MAX_AGE=60",
        ">= 0.9x",
        _f(r, 2, "x"),
        None if r is None else r >= 0.9,
    )
    r = summary.get("ordered_orm_vs_unordered_orm_ratio")
    add(
        "One stream vs unordered, ORM handler",
        ">= 0.35x",
        _f(r, 2, "x"),
        None if r is None else r >= 0.35,
    )
    return rows


# -- section bodies --------------------------------------------------------------------
def body_throughput(tp: dict[str, Any], meta: dict[str, Any]) -> list[str]:
    out: list[str] = []
    w = out.append
    cfg = meta.get("config", {})
    jobs = cfg.get("jobs", {})
    floor = tp.get("min_drain_seconds")
    if floor:
        backlog = (
            f"each case's backlog sized from one calibration drain of "
            f"{jobs.get('workpump', '?'):,} jobs ({jobs.get('procrastinate', '?'):,} for "
            f"Procrastinate) so that a drain lasts at least {floor:g} s, and enqueued "
            "again, larger, for a drain that still ended sooner: the Jobs column; "
            "django-workpump's backlog enqueued with `send_many`"
        )
    else:
        backlog = (
            f"{jobs.get('workpump', '?'):,} jobs for django-workpump and PgQueuer, "
            f"{jobs.get('procrastinate', '?'):,} for Procrastinate, whose rate needs no more "
            "to be read"
        )
    w(
        f"No-op jobs enqueued in batches of 1,000, then drained by freshly started workers "
        f"({backlog}). "
        "jobs/s = jobs / (first handler start -> the moment the database shows no job "
        "unfinished, polled every 20 ms). Median of "
        f"{cfg.get('reps')} repetitions (range = min-max); within each repetition the "
        "systems ran back to back. Each peer runs its recommended worker: PgQueuer "
        "`pgqueuer.run()` with asyncpg (what `pgq run` calls; see docs/benchmarks.md), "
        "Procrastinate "
        "`procrastinate worker` with the psycopg connector. Ours: `python -m django "
        "runworkpump --settings=bench.settings` with `WORKPUMP = {}` (all categories), "
        "Django's default `CONN_MAX_AGE = 0`.\n"
    )
    w(
        "| System | Worker settings | Processes | Jobs | Shortest drain | Median jobs/s | Range "
        "| Enqueue jobs/s | Max RSS |"
    )
    w("|---|---|---|---|---|---|---|---|---|")
    for _key, row in sorted(
        tp["summary"].items(),
        key=lambda kv: (
            ["default", "c10", "tuned"].index(kv[1]["name"]),
            kv[1]["processes"],
            kv[1]["system"],
        ),
    ):
        w(
            f"| {LABELS[row['system']]} | {_conc(row['system'], row['name'], row['concurrency'])} "
            f"| {row['processes']} | {_f(row.get('jobs_max'))} "
            f"| {_f(row.get('seconds_min'), 1, ' s')} | {_f(row['rate_median'])} | "
            f"{_f(row['rate_min'])}-{_f(row['rate_max'])} | {_f(row['enqueue_rate_median'])} "
            f"| {_f(row['rss_max_mb'], 0, ' MB')} |"
            + (f" errors: {len(row['errors'])}" if row["errors"] else "")
        )
    w("")
    w("Ratios, computed per repetition (back to back) and then the median:\n")
    w("| Ratio | Median | Per repetition |\n|---|---|---|")
    for name, r in tp["ratios"].items():
        w(f"| {name} | {r['median']:.2f}x | {', '.join(f'{x:.2f}' for x in r['by_rep'])} |")
    w("")
    ours = (
        "with `workpump.send_many` (one statement per batch)"
        if floor
        else "as 1,000 `workpump.send()` calls inside one `transaction.atomic()` (one SQL call "
        "per row; the profile and the scale section measure `send_many`)"
    )
    w(
        f"Enqueue: django-workpump enqueues each batch {ours}; "
        "PgQueuer with one `Queries.enqueue(list...)` call (UNNEST) and "
        "Procrastinate with `batch_defer_async`.\n"
    )
    return out


def body_latency(lat: dict[str, Any], meta: dict[str, Any]) -> list[str]:
    out: list[str] = []
    w = out.append
    cfg = meta.get("config", {}).get("latency", [1, 200, 50])
    w(
        f"One idle, listening worker with default settings; {cfg[1]} single enqueues "
        f"{cfg[2]:.0f} ms apart, each committed in its own transaction, after 10 warm-up jobs; "
        f"{cfg[0]} round(s) per system, systems back to back. Latency = handler start - the "
        "moment the producer's COMMIT returned (both CLOCK_MONOTONIC of this machine). "
        "Percentiles over all samples.\n"
    )
    w(
        "| System | p50 | p95 | p99 | max | p50 per round | idle RSS |\n|---|---|---|---|---|---|---|"
    )
    for system, row in lat["summary"].items():
        w(
            f"| {LABELS[system]} | {row['p50']:.2f} ms | {row['p95']:.2f} ms | {row['p99']:.2f} ms "
            f"| {row['max']:.1f} ms | {', '.join(f'{x:.2f}' for x in row['p50_by_round'])} "
            f"| {row['idle_rss_mb']:.0f} MB |"
        )
    w("")
    return out


def body_writes(wv: dict[str, Any], meta: dict[str, Any]) -> list[str]:
    out: list[str] = []
    w = out.append
    w(
        f"All instances ran at once on {wv.get('server')}, each in a database of its own, "
        f"through one window of {wv['window_seconds']:.0f} s after a warm-up (and after all "
        "held jobs were in flight). Write statements = INSERT/UPDATE/DELETE/MERGE executed "
        "at any nesting level that wrote, i.e. whose pg_stat_statements entry recorded WAL "
        "(so `SELECT workpump.record_heartbeat()` counts as the UPDATE it runs, like "
        "PgQueuer's top-level UPDATE); no-op write statements = those that found nothing to "
        "change (an idle poll's UPDATE: no WAL, no row version), every system's alike; rows "
        "= rows the writing statements returned or changed; table rows = "
        "pg_stat_user_tables n_tup_ins+upd+del delta; commits = pg_stat_database "
        "xact_commit delta (reads included).\n"
    )
    w(
        "| Instance | Write statements/min | No-op write statements/min | Rows written/min | All top-level statements/min | Table rows/min | Commits/min | WAL bytes/min | RSS |"
    )
    w("|---|---|---|---|---|---|---|---|---|")
    for _name, row in wv["instances"].items():
        w(
            f"| {row['description']} | {row['write_statements_per_min']:.1f} | "
            f"{_f(row.get('noop_write_statements_per_min'), 1)} | "
            f"{row['rows_written_per_min']:.0f} | {row['toplevel_statements_per_min']:.1f} | "
            f"{row['table_rows_per_min']:.0f} | {row['commits_per_min']:.0f} | "
            f"{row['wal_bytes_per_min']:,.0f} | {row['rss_mb']:.0f} MB |"
        )
    w("")
    for name in ("workpump-inflight-1000", "workpump-inflight-1000-batch1000"):
        row = wv["instances"].get(name)
        if row and row.get("renewal_rounds"):
            w(
                f"- {row['description']}: {row['renewal_statements']} renew statements for "
                f"{row['renewed_rows']:,} renewed rows = {row['renewal_rounds']:.1f} rounds, "
                f"**{row['renewal_statements_per_round']:.1f} statement(s) per renewal window** "
                "(all rows are outbox: one category)."
            )
    m = wv.get("maintenance_pass")
    if m:
        w(
            f"- Housekeeping (not liveness): one maintenance pass of an idle instance runs "
            f"{m['write_statements']} write statements ({m['rows_written']} rows, "
            f"{m['wal_bytes']} WAL bytes) and {m.get('noop_write_statements', 0)} no-op "
            "ones (DELETEs that find nothing) every MAINTENANCE_INTERVAL_SECONDS (300 s): "
            f"{(m['write_statements'] + m.get('noop_write_statements', 0)) / 5:.1f} "
            "statements/min amortized. It is not in the window above (the first pass runs "
            "300 s after start)."
        )
    w(
        "- With the default LEASE_SECONDS=300 a held row is renewed every ~180 s (when a "
        "third of the 270 s local lease is left); the in-flight rows above use LEASE_SECONDS=60 "
        "(a round every ~20 s) so that several rounds fit the window. Statements per round "
        "do not depend on the lease."
    )
    w("")
    w("<details><summary>Write statements seen per instance</summary>\n")
    for name, row in wv["instances"].items():
        w(f"**{name}**\n")
        for e in row["writes"][:8]:
            w(f"- {e['calls']} calls, {e['rows']} rows: `{e['query'][:140]}`")
        if not row["writes"]:
            w("- none")
        w("")
    w("</details>\n")
    return out


def body_claim(claim: dict[str, Any], meta: dict[str, Any]) -> list[str]:
    mode = meta.get("mode")
    out: list[str] = []
    w = out.append
    w(
        "`claim_work` (the pump's own named query: all four categories, batch 100), timed "
        "client-side over "
        f"{next(iter(claim.values()))['calls']:,} committed calls per dataset. Between calls "
        "(untimed) the claimed rows are completed and 100 new pending rows inserted, so the "
        "backlog keeps its size. Datasets are built with set-based SQL "
        "(`INSERT ... SELECT generate_series`, stream NULL) straight into workpump_outbox, "
        "processed rows first (older), then VACUUM ANALYZE"
        + (
            "; quick mode uses 100k pending + 500k processed instead of 1M + 5M"
            if mode == "quick"
            else ""
        )
        + ".\n"
    )
    w(
        "| Dataset | Pending | Processed | p50 | p95 | p99 | mean | rows/call | built in |\n|---|---|---|---|---|---|---|---|---|"
    )
    for label, row in claim.items():
        built = "reused" if row["reused"] else f"{row['build_seconds']:.0f} s"
        w(
            f"| {label} | {row['pending']:,} | {row['processed']:,} | {row['p50_ms']:.2f} ms | "
            f"{row['p95_ms']:.2f} ms | {row['p99_ms']:.2f} ms | {row['mean_ms']:.2f} ms | "
            f"{row['rows_per_call']:.0f} | {built} |"
        )
    w("")
    for label, row in claim.items():
        for ms, removed in guard_scans(row["plans"]):
            w(
                f"- {label}: the first claim of a fresh session planned the ready guard as "
                f"a Seq Scan that removed {removed:,} rows and took {ms:.1f} ms (see "
                "finding 3 in docs/benchmarks.md; later calls were cheaper only because synchronized seq "
                "scans resume where the previous one stopped, and, on the 1k dataset, the "
                "guard walks the processed rows the measurement itself adds)."
            )
    w("")
    w(
        "EXPLAIN (ANALYZE, BUFFERS) of the statements one claim runs on workpump_outbox "
        "(auto_explain with nested statements, in a rolled-back transaction):\n"
    )
    for label, row in claim.items():
        w(f"<details><summary>{label}</summary>\n\n```")
        for plan in row["plans"]:
            w(plan.rstrip())
            w("")
        w("```\n</details>\n")
    return out


def body_profile(prof: dict[str, Any], meta: dict[str, Any]) -> list[str]:
    out: list[str] = []
    w = out.append
    sweep = prof.get("sweep", [])
    if sweep:
        w("Claim batch and connection knobs, one drain each (same machine, back to back):\n")
        w("| Settings | jobs/s |\n|---|---|")
        for row in sweep:
            w(f"| {row['label']} | {_f(row['rate'])} |")
        w("")
    enq = prof.get("enqueue")
    if enq:
        w("Enqueue of django-workpump, same machine, back to back:\n")
        w("| Producer | jobs/s |\n|---|---|")
        for row in enq:
            w(f"| {row['label']} | {_f(row['rate'])} |")
        w("")
    st = prof.get("statements")
    if st:
        w(
            f"Database time per statement during a default drain of {st['jobs']:,} jobs "
            f"(embedded PostgreSQL, pg_stat_statements track=all; {_f(st['rate'])} jobs/s "
            "there):\n"
        )
        w(
            "| top-level | calls | rows | total ms | mean ms | statement |\n|---|---|---|---|---|---|"
        )
        for e in st["statements"]:
            w(
                f"| {'yes' if e['toplevel'] else 'nested'} | {e['calls']:,} | {e['rows']:,} | "
                f"{e['total_ms']:,.0f} | {e['mean_ms']:.3f} | `{e['query'][:110]}` |"
            )
        w("")
    spy = prof.get("pyspy")
    if spy:
        w(f"py-spy (on-CPU samples of all threads, {spy['samples']:,} samples):\n")
        w("| Thread | samples |\n|---|---|")
        for name, n in spy["threads"][:12]:
            w(f"| {name} | {n} |")
        w("")
        w(
            "Samples inside `get_new_connection` (a new PostgreSQL connection) by thread: "
            + (", ".join(f"{t}: {n}" for t, n in spy["connect_samples_by_thread"]) or "none")
            + "\n"
        )
    return out


def body_ordered(section: dict[str, Any], meta: dict[str, Any]) -> list[str]:
    summary = section["summary"]
    runs = section["runs"]
    out: list[str] = []
    w = out.append
    w(
        "Each case: jobs enqueued, then drained by one fresh "
        "`runworkpump` process at its defaults (`CONCURRENCY` 4, `STREAM_RUN_MAX` 100, "
        "`HANDLER_CONNECTIONS` persistent); rows/s = jobs / (first handler start -> nothing "
        "unfinished). One run; the cases back to back in each of "
        f"{section.get('rounds', 1)} round(s), the order reversed every other round; a "
        "case's rows/s is its median (range after it), a ratio the median of the ratios "
        "of neighbours in one round. "
        "'One stream': every job on the same stream (one hot aggregate, strictly in order). "
        "The ORM handler (`bench.orm`) inserts one row with `Model.objects.create`; "
        "'defaults' is Django's `CONN_MAX_AGE = 0`.\n"
    )
    w("| Case | Handler | Ordering | Connections | Jobs | rows/s |")
    w("|---|---|---|---|---|---|")
    labels = {
        "unordered_noop": ("no-op", "none", "defaults"),
        "ordered_noop": ("no-op", "one stream", "defaults"),
        "orm_default": ("ORM insert", "none", "defaults (`CONN_MAX_AGE = 0`)"),
        "orm_persistent": ("ORM insert", "none", "`CONN_MAX_AGE = 60`"),
        "orm_per_job": ("ORM insert", "none", '`HANDLER_CONNECTIONS = "per_job"`, age 0'),
        "ordered_orm": ("ORM insert", "one stream", "defaults (`CONN_MAX_AGE = 0`)"),
    }
    for name, run in runs.items():
        handler, ordering, conns = labels.get(name, (name, "", ""))
        rate = run.get("rate")
        rates = run.get("rates") or []
        spread = f" ({_f(min(rates))}-{_f(max(rates))})" if len(rates) > 1 else ""
        w(
            f"| {name} | {handler} | {ordering} | {conns} | {run.get('jobs', 0):,} | "
            + (_f(rate) + spread if rate else f"failed: {run.get('error')}")
            + " |"
        )
    anchor = section.get("procrastinate_lock", {})
    if "rate" in anchor:
        w(
            f"| procrastinate lock= | no-op | one lock | psycopg pool | {anchor['done']} of "
            f"{anchor['jobs']} in {anchor['window_seconds']:.0f} s | {anchor['rate']:.2f} |"
        )
    w("")
    w("| Target | Goal | Measured | |\n|---|---|---|---|")
    for name, goal, value, verdict in ordered_targets(summary):
        w(f"| {name} | {goal} | {value} | {verdict} |")
    w("")
    keys = {k: (None if v is None else round(v, 2)) for k, v in summary.items()}
    w("```json\n" + json.dumps(keys) + "\n```\n")
    w(
        "What bounds these cases. A stream's rows run one after another by design, on one "
        "thread: with no-op handlers a run of up to `STREAM_RUN_MAX` rows costs one claim, "
        "the rows, and one `complete_work` (flushed as soon as the run ends), and the "
        "stream's next run can be claimed only once that completion committed; so one "
        "stream advances a run per claim and completion round trip instead of a row, and "
        "what is left is the Python cost of each row on one thread plus those two round "
        "trips per run. With the ORM handler each row is its own autocommit `INSERT`: the "
        "stream waits for one commit per row in sequence, where unordered rows commit "
        "`CONCURRENCY` at a time. A read model that must keep up with a hot stream should "
        "be a batch perspective (`batch=True, atomic=True`): one transaction, one commit, "
        "per run. `orm_default` and `orm_persistent` run the same code (handler threads "
        "keep their connections in both; `CONN_MAX_AGE = 60` only bounds their age), so the "
        "gap between them is this shared machine's noise; `orm_per_job` (a connection per "
        "job, the behaviour before handler connections were kept) shows what keeping them "
        "is worth.\n"
    )
    return out


def body_scale(sc: dict[str, Any], meta: dict[str, Any]) -> list[str]:
    out: list[str] = []
    w = out.append
    w(
        f"From `bench/scale.py` on {sc.get('server')}: every system on that one server, "
        "in one run. Two shared cores: read the ratios.\n"
    )
    enq = sc.get("enqueue", {})
    if enq:
        w("| Enqueue | rows | rows/s |\n|---|---|---|")
        for key, label in (
            ("workpump_send_many", "django-workpump `send_many`, batches of 1,000"),
            ("pgqueuer_batch", "PgQueuer `enqueue` of 1,000"),
            ("workpump_send", "django-workpump `send`, one per call (autocommit)"),
            ("pgqueuer_single", "PgQueuer `enqueue` of one per call"),
        ):
            row = enq.get(key, {})
            w(f"| {label} | {_f(row.get('n'))} | {_f(row.get('rate'))} |")
        w(
            f"\nBatch ratio {_f(enq.get('many_ratio_vs_pgqueuer'), 2)}, single ratio "
            f"{_f(enq.get('single_ratio_vs_pgqueuer'), 2)} (django-workpump / PgQueuer).\n"
        )
    lat = sc.get("latency", {})
    if lat:
        w("| Latency, enqueue commit -> handler start | samples | p50 | p95 | p99 | max |")
        w("|---|---|---|---|---|---|")
        for system in ("workpump", "pgqueuer"):
            row = lat.get(system)
            if row:
                w(
                    f"| {LABELS[system]} | {row['samples']} | {row['p50']:.2f} ms | "
                    f"{row['p95']:.2f} ms | {row['p99']:.2f} ms | {row['max']:.2f} ms |"
                )
        rounds = lat.get("workpump", {}).get("rounds")
        by_round = lat.get("p50_ratio_by_round")
        w(
            f"\np50 ratio {_f(lat.get('p50_ratio_vs_pgqueuer'), 2)}, p99 ratio "
            f"{_f(lat.get('p99_ratio_vs_pgqueuer'), 2)}"
            + (
                f", of the samples of {rounds} rounds pooled (the order alternating); "
                "p50 ratio by round " + ", ".join(_f(r, 2) for r in by_round)
                if rounds and by_round
                else ""
            )
            + ".\n"
        )
    ren = sc.get("renewals", {})
    if ren:
        w(
            f"Renewals: {ren.get('rows')} leased rows of {ren.get('categories')} categories, "
            f"{ren.get('windows')} renewal windows: {ren.get('renew_statements')} "
            f"`renew_leases` statements, "
            f"{_f(ren.get('statements_per_category_per_window'), 2)} per category per "
            "window.\n"
        )
    ins = sc.get("instances", {})
    if ins:
        w(
            "| Processes x CONCURRENCY | jobs | aggregate jobs/s | shares (done per instance) "
            "| spread | commits/s | server CPU | connections / instance |"
        )
        w("|---|---|---|---|---|---|---|---|")
        for r in ins.get("runs", []):
            shares = r.get("shares", [])
            shown = (
                ", ".join(str(x) for x in shares)
                if len(shares) <= 8
                else (f"min {min(shares)}, max {max(shares)}, mean {sum(shares) / len(shares):.0f}")
            )
            again = f" (again, {r['repeat'] + 1})" if r.get("repeat") else ""
            w(
                f"| {r['processes']} x {r['concurrency']}{again} | {_f(r['jobs'])} "
                f"| {_f(r['rate'])} "
                f"| {shown} | {_f(r.get('share_spread'), 2)} | {_f(r.get('commits_per_s'))} "
                f"| {_f(100 * (r.get('server_cpu_share') or 0))}% "
                f"| {_f(r.get('connections_per_instance'), 1)} |"
            )
        repeats = ins.get("repeats") or 1
        by_repeat = ins.get("scale_32_vs_1_ratio_by_repeat") or []
        w(
            f"\n8 processes / 1: {_f(ins.get('scale_8_vs_1_ratio'), 2)}; 32 x 1 / 1 x 4: "
            f"{_f(ins.get('scale_32_vs_1_ratio'), 2)}; 32-instance share spread (largest "
            f"distance from the mean share, over the mean): "
            f"{_f(ins.get('scale_32_share_spread'), 2)}"
            + (
                f" (medians of {repeats} drains each of 1 x 4 and 32 x 1, interleaved; "
                "32 x 1 / the 1 x 4 before it, by drain: "
                + ", ".join(_f(r, 2) for r in by_repeat)
                + "; 1 x 4 is the denominator of 8 / 1 too)"
                if repeats > 1
                else ""
            )
            + ". Each backlog was committed in one transaction once every instance was "
            "registered. Idle, after the drain (its dead row versions vacuumed first): "
            f"{_f(ins.get('idle_row_writes_per_instance_per_min'), 2)} row writes and "
            f"{_f(ins.get('idle_write_statements_per_instance_per_min'), 2)} write statements "
            "(and "
            f"{_f(ins.get('idle_noop_write_statements_per_instance_per_min'), 2)} no-op ones, "
            "idle claim polls that found nothing) per instance per minute in the workpump "
            "tables. Claim conflicts (rows a SKIP LOCKED "
            "claim passed over) are not counted: PostgreSQL reports no such number. Server "
            "CPU is the embedded server's share of the machine's cores during the middle of "
            "the drain.\n"
        )
    return out


def body_console(section: dict[str, Any], meta: dict[str, Any]) -> list[str]:
    return [
        "| Counting | Median rate | Drains |\n|---|---|---|",
        f"| on | {_f(section.get('rate_on_median'), 0, ' jobs/s')} "
        f"| {sum(1 for r in section.get('runs', []) if r.get('counting'))} |",
        f"| off | {_f(section.get('rate_off_median'), 0, ' jobs/s')} "
        f"| {sum(1 for r in section.get('runs', []) if not r.get('counting'))} |",
        "",
        f"Throughput ratio on / off per repetition: "
        f"{', '.join(_f(r, 3) for r in section.get('by_rep', []))}"
        f"; median {_f(section.get('throughput_ratio'), 3)}"
        f". {section.get('jobs', 0):,} no-op jobs per drain, one "
        "process at the defaults; the counting triggers switched by "
        "`workpump.console_counting` between drains.\n",
        *_console_latency(section.get("latency")),
        f"`console_overhead_ratio` (the lower of the two): "
        f"{_f(section.get('console_overhead_ratio'), 3)}.\n",
    ]


def _console_latency(lat: dict[str, Any] | None) -> list[str]:
    if not lat:
        return []
    return [
        f"Pickup latency p50 with counting on: "
        f"{', '.join(_f(v, 2, ' ms') for v in lat.get('p50_on_ms', []))}; off: "
        f"{', '.join(_f(v, 2, ' ms') for v in lat.get('p50_off_ms', []))}; ratio off / on per "
        f"pair {', '.join(_f(r, 3) for r in lat.get('by_rep', []))}, median "
        f"{_f(lat.get('ratio'), 3)} ({lat.get('n')} single enqueues {lat.get('gap_ms')} ms "
        f"apart per block, after {lat.get('warmup')} uncounted; every block to one idle "
        "listening worker).\n",
    ]


def body_wait(data: dict[str, Any], meta: dict[str, Any]) -> list[str]:
    """How soon ``workpump.wait`` returns after a completion (bench/workflow_wait.py)."""
    return [
        "| Measure | p50 | p99 | max |\n|---|---|---|---|",
        f"| Pickup: send commit -> handler start | {_f(data.get('pickup_p50_ms'), 2, ' ms')} "
        f"| {_f(data.get('pickup_p99_ms'), 2, ' ms')} | - |",
        f"| Wait: completion commit -> `wait()` returned | {_f(data.get('wait_p50_ms'), 2, ' ms')} "
        f"| {_f(data.get('wait_p99_ms'), 2, ' ms')} | {_f(data.get('wait_max_ms'), 2, ' ms')} |",
        "",
        f"{data.get('n')} rows each. The waiter polls once an hour, so only the NOTIFY on "
        "`workpump_done` wakes it in time; the completion is committed by another "
        "connection once the waiter is blocked on its socket. Ratio of the p50s: "
        f"{_f(data.get('workflow_wait_vs_pickup_ratio'), 2)}.\n",
    ]


def body_admin_pages(data: dict[str, Any], meta: dict[str, Any]) -> list[str]:
    """Each page's median time at each size, and its ratio to the smallest size."""
    sizes = data["sizes"]
    base = str(sizes[0])
    header = [
        "Page",
        *(f"{s:,} rows (ms)" for s in sizes),
        *(f"{s:,} / {sizes[0]:,}" for s in sizes[1:]),
    ]
    out = [
        "| " + " | ".join(header) + " |",
        "|" + "---|" * len(header),
    ]
    for page, times in data["pages"].items():
        cells = [page, *(_f(times.get(str(s)), 1) for s in sizes)]
        for s in sizes[1:]:
            ratio = (
                times.get(str(s)) / times[base] if times.get(str(s)) and times.get(base) else None
            )
            cells.append(_f(ratio, 2, "x"))
        out.append("| " + " | ".join(cells) + " |")
    series = data["series"]
    builds = ", ".join(f"{int(s):,} rows in {t:.0f} s" for s, t in data["build_seconds"].items())
    out += [
        "",
        f"Medians of {data['repeat']} fetches after one warm-up, by Django's test client as a "
        "superuser, in one process against the machine's PostgreSQL. The outbox is rebuilt "
        "for each size (90 % done, then dead, waiting for a retry, past half their attempts, "
        "leased by a live and by a gone instance, orphaned, and the newest 7.5 % pending; "
        f"built {builds}). The console reads {series['days']} days of series for "
        f"{series['topics']} topics on 2 instances ({series['counter_rows']:,} counter rows, "
        f"built and folded in {data['series_seconds']:.0f} s). The row pages' target is at "
        "most 3x their smallest-size time; the ratios near 1 read as flat, since the "
        "smallest size moves by about 20 ms between runs.\n",
    ]
    return out


BODIES.update(
    admin_pages=body_admin_pages,
    console=body_console,
    wait=body_wait,
    throughput=body_throughput,
    latency=body_latency,
    writes=body_writes,
    claim=body_claim,
    profile=body_profile,
    scale=body_scale,
    ordered=body_ordered,
    workflow=body_workflow,
    flow=flow.body,
)
