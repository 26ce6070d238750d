"""Latency: an idle, listening worker; single enqueues at a fixed gap, each committed on
its own; enqueue commit (producer side, after COMMIT returned) -> handler start.

Both times are CLOCK_MONOTONIC of this machine. Ten warm-up jobs go first (not counted)
so connections and caches are warm; then the worker idles a second before the run.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from bench import harness as h

WARMUP = 10
WARMUP_OFFSET = 1_000_000


def run(
    system: str, server: h.Server, database: str, n: int, gap_ms: float, workdir: Path, rep: int
) -> dict[str, Any]:
    with server.connect(database) as conn:
        conn.execute(h.RESET_SQL[system])
    marks = workdir / f"lat-{system}-r{rep}.marks"
    marks.unlink(missing_ok=True)
    worker = h.start_worker(
        system, server, database, marks=marks, log_path=workdir / f"lat-{system}-r{rep}.log"
    )

    def seen(keys: range) -> bool:
        got = {int(m[1]) for m in h.read_marks(marks) if m[0] == "lat"}
        return all(k in got for k in keys)

    try:
        time.sleep(2.0)
        h.produce(
            system,
            server,
            database,
            ["latency", "--n", str(WARMUP), "--gap-ms", "50", "--offset", str(WARMUP_OFFSET)],
        )
        if not h.wait_for(lambda: seen(range(WARMUP_OFFSET, WARMUP_OFFSET + WARMUP)), 60, 0.1):
            raise RuntimeError(f"{system}: warm-up jobs not handled:\n{worker.output()[-2000:]}")
        time.sleep(1.0)
        idle_rss = worker.rss()
        produced = h.produce(
            system, server, database, ["latency", "--n", str(n), "--gap-ms", str(gap_ms)]
        )
        if not h.wait_for(lambda: seen(range(n)), 60, 0.1):
            raise RuntimeError(f"{system}: not all latency jobs handled")
    finally:
        h.stop_worker(worker)
    starts = {int(m[1]): int(m[2]) for m in h.read_marks(marks) if m[0] == "lat"}
    commits = {int(k): v for k, v in produced["commits"].items()}
    lat_ms = [(starts[i] - commits[i]) / 1e6 for i in range(n)]
    return {
        "system": system,
        "rep": rep,
        "n": n,
        "gap_ms": gap_ms,
        "lat_ms": lat_ms,
        "p50": h.percentile(lat_ms, 50),
        "p95": h.percentile(lat_ms, 95),
        "p99": h.percentile(lat_ms, 99),
        "max": max(lat_ms),
        "min": min(lat_ms),
        "idle_rss_mb": idle_rss / 2**20,
    }


def summarize(runs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for system in h.SYSTEMS:
        items = [r for r in runs if r["system"] == system]
        if not items:
            continue
        pooled = [v for r in items for v in r["lat_ms"]]
        out[system] = {
            "rounds": len(items),
            "samples": len(pooled),
            "p50": h.percentile(pooled, 50),
            "p95": h.percentile(pooled, 95),
            "p99": h.percentile(pooled, 99),
            "max": max(pooled),
            "p50_by_round": [r["p50"] for r in items],
            "p99_by_round": [r["p99"] for r in items],
            "idle_rss_mb": h.median([r["idle_rss_mb"] for r in items]),
        }
    return out
